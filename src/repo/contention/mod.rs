//! The contention record: which collections (and, sampled, which documents) see the most
//! conflicts and aborts, across every instance of a service, kept in the database in a bounded
//! form, as CockroachDB keeps its contention events.
//!
//! # What is counted, and where
//!
//! - A **conflict**: a write or a staged change named a version the document no longer has (a
//!   repository write's `VersionConflict` in `write_path`, a transaction staging a change at a
//!   stale version in `transaction`, an apply of the commit round finding the document moved on
//!   in `committer`).
//! - An **abort**: a transaction attempt rolled back by its coordinator (`committer`'s give-up:
//!   a conflict, a document held by a live transaction, the deadline, a failure). It counts once
//!   in each collection the transaction touched; the document that stopped it, when one did, is
//!   offered to the sample.
//!
//! Only collection names and document ids are kept, never values: per collection, the counts
//! and a uniform sample of at most `tally::SAMPLES_PER_FLUSH` ids (reservoir sampling) between
//! two flushes, each id as errors show it and cut to `tally::MAX_ID_BYTES` bytes; at most
//! `tally::MAX_COLLECTIONS` collections between two flushes.
//!
//! # Where it goes
//!
//! Each [`Store`] (with its clones) counts in memory (`tally`) and writes what it counted at
//! most once per interval ([`StoreBuilder::contention_flush_every`], 5 s by default): the first
//! event after a flush starts a background task that waits for the interval, takes the counts
//! and writes them (`flush`), one upsert per collection into
//! [`CONTENTION_COLLECTION`](crate::collections::CONTENTION_COLLECTION): the document of that
//! collection and that minute of the server's time (the flush's minute, by the store's estimate
//! of the server's clock, so no host's clock is compared with another's) gains the counts
//! (`$inc`, so every instance adds to the same document), one more `flushes`, and the sampled
//! ids (`$push` with `$slice`: the newest `flush::IDS_PER_BUCKET`). Each document carries
//! `expires` (its minute plus a day), under a TTL index: the record holds at most a day of
//! minutes per collection. The task is tracked by the store's background work, so
//! [`Store::shutdown`] writes what is pending at once and waits for it. A flush that fails is
//! logged and its counts are dropped: the record is a diagnosis aid, never a reason for a
//! user's operation to fail or wait.
//!
//! # On by default
//!
//! Contention is looked for after the fact, in an incident, when it is too late to switch a
//! record on; and it costs nothing while nothing conflicts, and at most one small write per
//! collection per interval per instance while something does.
//! [`StoreBuilder::contention_record`]`(false)` switches it off (nothing is counted or
//! written).
//!
//! [`contention`] reads it: collections ranked by conflicts and aborts summed over the minutes
//! asked for and every instance, with their most frequent sampled documents (`mongotx
//! contention` prints it).
//!
//! [`StoreBuilder::contention_flush_every`]: crate::repo::store::StoreBuilder::contention_flush_every
//! [`StoreBuilder::contention_record`]: crate::repo::store::StoreBuilder::contention_record
//! [`Store::shutdown`]: crate::repo::store::Store::shutdown

mod flush;
mod report;
pub(crate) mod tally;

pub use flush::CONTENTION_SCHEMA;
pub use report::{contention, CollectionContention, ContentionReport, SampledDocument};

use bson::Bson;

use crate::repo::store::Store;
use tally::Event;

/// Counts a version conflict on document `id` of `collection`.
pub(crate) fn conflict(store: &Store, collection: &str, id: &Bson) {
    record(store, Event::Conflict, [collection], Some((collection, id)));
}

/// Counts an aborted transaction attempt in each of `collections` (the collections of its
/// documents), offering the document that stopped it, if one did, to the sample.
pub(crate) fn aborted<'a>(
    store: &Store,
    collections: impl IntoIterator<Item = &'a str>,
    culprit: Option<(&str, &Bson)>,
) {
    record(store, Event::Abort, collections, culprit);
}

fn record<'a>(
    store: &Store,
    event: Event,
    collections: impl IntoIterator<Item = &'a str>,
    sampled: Option<(&str, &Bson)>,
) {
    if store.inner.contention.count(event, collections, sampled) {
        flush::start(store);
    }
}
