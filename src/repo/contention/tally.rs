//! The contention record's in-memory half: what one store (all its clones) counted since its
//! last flush, per collection, with a bounded sample of the documents involved. No I/O.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use bson::{Bson, Document};
use mongodb::Collection;
use tokio::sync::OnceCell;

use crate::repo::error::show_id;

/// Sampled document ids kept per collection between two flushes (a uniform sample of the
/// events: reservoir sampling).
pub(crate) const SAMPLES_PER_FLUSH: usize = 8;

/// Collections counted between two flushes, at most: events of further collections are
/// dropped (and counted as dropped in the log), so memory stays bounded whatever happens.
pub(crate) const MAX_COLLECTIONS: usize = 1024;

/// The longest sampled id kept, in bytes (a longer one is cut at a character boundary).
pub(crate) const MAX_ID_BYTES: usize = 200;

/// What happened to a document, as the record counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// A write or a staged change named a version the document no longer had.
    Conflict,
    /// A transaction attempt was rolled back (a conflict, a document held by a live
    /// transaction, its deadline, a failure).
    Abort,
}

/// One collection's counts since the last flush.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) conflicts: u64,
    pub(crate) aborts: u64,
    /// Events that offered an id to the sample.
    offered: u64,
    /// A uniform sample of those ids (shown as errors show them), at most
    /// [`SAMPLES_PER_FLUSH`].
    pub(crate) sample: Vec<String>,
}

impl Counts {
    /// Offers `id` to the sample: kept with probability `SAMPLES_PER_FLUSH / offered`, so every
    /// event is equally likely to be in it (every one while there are few).
    fn offer(&mut self, id: &Bson) {
        self.offered += 1;
        let shown = cut(show_id(id));
        if self.sample.len() < SAMPLES_PER_FLUSH {
            self.sample.push(shown);
            return;
        }
        let at = rand::random_range(0..self.offered);
        if let Some(slot) = usize::try_from(at)
            .ok()
            .and_then(|i| self.sample.get_mut(i))
        {
            *slot = shown;
        }
    }
}

/// `text` cut to at most [`MAX_ID_BYTES`] bytes.
fn cut(mut text: String) -> String {
    if text.len() > MAX_ID_BYTES {
        let mut end = MAX_ID_BYTES;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// The counts of one store and its clones, and whether a flush is on its way.
#[derive(Debug)]
pub(crate) struct Tally {
    enabled: bool,
    every: Duration,
    state: Mutex<State>,
    /// The record's collection once its first flush has set it up (validator, indexes).
    collection: OnceCell<Collection<Document>>,
}

#[derive(Debug, Default)]
struct State {
    pending: BTreeMap<String, Counts>,
    /// A flush task is waiting for its interval: events only add to `pending`.
    scheduled: bool,
    /// Events dropped for [`MAX_COLLECTIONS`] since the last flush.
    dropped: u64,
}

/// What a flush takes.
#[derive(Debug, Default)]
pub(crate) struct Taken {
    pub(crate) counts: BTreeMap<String, Counts>,
    pub(crate) dropped: u64,
}

impl Tally {
    /// A tally that records (`enabled`) and is flushed at most every `every`.
    pub(crate) fn new(enabled: bool, every: Duration) -> Tally {
        Tally {
            enabled,
            every,
            state: Mutex::new(State::default()),
            collection: OnceCell::new(),
        }
    }

    /// The record's collection, set up by the first flush.
    pub(crate) fn collection(&self) -> &OnceCell<Collection<Document>> {
        &self.collection
    }

    /// The shortest time between two flushes of this store.
    pub(crate) fn every(&self) -> Duration {
        self.every
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Counts left by a panicking task are still counts.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts `event` in each of `collections` (each once), offering `sampled` (a collection
    /// and one of its documents) to that collection's sample. Returns whether the caller must
    /// start a flush (none is on its way).
    pub(crate) fn count<'a>(
        &self,
        event: Event,
        collections: impl IntoIterator<Item = &'a str>,
        sampled: Option<(&str, &Bson)>,
    ) -> bool {
        if !self.enabled {
            return false;
        }
        let mut state = self.state();
        let mut counted: Vec<&str> = Vec::new();
        for collection in collections {
            if counted.contains(&collection) {
                continue;
            }
            counted.push(collection);
            let Some(counts) = entry(&mut state, collection) else {
                continue;
            };
            match event {
                Event::Conflict => counts.conflicts += 1,
                Event::Abort => counts.aborts += 1,
            }
        }
        if let Some((collection, id)) = sampled {
            if let Some(counts) = entry(&mut state, collection) {
                counts.offer(id);
            }
        }
        let start = !state.scheduled && !state.pending.is_empty();
        state.scheduled |= start;
        start
    }

    /// Takes everything counted so far; events from now on start the next flush.
    pub(crate) fn take(&self) -> Taken {
        let mut state = self.state();
        state.scheduled = false;
        Taken {
            counts: std::mem::take(&mut state.pending),
            dropped: std::mem::take(&mut state.dropped),
        }
    }

    /// Forgets that a flush is on its way (it could not be started): the next event starts one.
    pub(crate) fn unschedule(&self) {
        self.state().scheduled = false;
    }
}

/// `collection`'s counts, made if there is room for one more collection.
fn entry<'s>(state: &'s mut State, collection: &str) -> Option<&'s mut Counts> {
    if !state.pending.contains_key(collection) && state.pending.len() >= MAX_COLLECTIONS {
        state.dropped += 1;
        return None;
    }
    Some(state.pending.entry(collection.to_string()).or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_each_collection_once_per_event_and_samples_at_most_a_few_ids() {
        let tally = Tally::new(true, Duration::from_secs(5));
        assert!(tally.count(Event::Abort, ["a", "b", "a"], Some(("a", &Bson::from("x")))));
        for i in 0..100 {
            // A flush is on its way: no second one.
            assert!(!tally.count(Event::Conflict, ["a"], Some(("a", &Bson::from(i)))));
        }
        let taken = tally.take();
        let a = &taken.counts["a"];
        assert_eq!((a.conflicts, a.aborts), (100, 1));
        assert_eq!(a.sample.len(), SAMPLES_PER_FLUSH);
        assert_eq!(taken.counts["b"].aborts, 1);
        assert!(taken.counts["b"].sample.is_empty());
        // Taken: the next event starts a flush again.
        assert!(tally.count(Event::Conflict, ["a"], None));
    }

    #[test]
    fn a_disabled_tally_counts_nothing() {
        let tally = Tally::new(false, Duration::from_secs(5));
        assert!(!tally.count(Event::Conflict, ["a"], Some(("a", &Bson::from(1)))));
        assert!(tally.take().counts.is_empty());
    }

    #[test]
    fn collections_beyond_the_bound_are_dropped_and_ids_cut() {
        let tally = Tally::new(true, Duration::from_secs(5));
        for i in 0..MAX_COLLECTIONS + 3 {
            tally.count(Event::Conflict, [format!("c{i}").as_str()], None);
        }
        let long = "é".repeat(300);
        tally.count(Event::Conflict, ["c0"], Some(("c0", &Bson::from(long))));
        let taken = tally.take();
        assert_eq!(taken.counts.len(), MAX_COLLECTIONS);
        assert_eq!(taken.dropped, 3);
        assert!(taken.counts["c0"].sample[0].len() <= MAX_ID_BYTES);
    }
}
