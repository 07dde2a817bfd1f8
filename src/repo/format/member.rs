//! A store as a member of the fleet the gate (`gate`) keeps: its announcement id, the newest
//! format it reads, and the written format it last read. Kept apart from the gate's operations,
//! which take the whole store, so that the store's state can hold it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use bson::oid::ObjectId;

use crate::repo::format::UNMARKED;

/// The prefix of the ids of instance announcements.
pub(crate) const INSTANCE_PREFIX: &str = "instance:";

/// A store's part in the gate: who it is, what it reads, and the written format it last read.
#[derive(Debug)]
pub(crate) struct Member {
    instance: ObjectId,
    reads: i64,
    pub(crate) refresh: Duration,
    /// The format the database writes, and when this store read it.
    cached: Mutex<Option<(i64, Instant)>>,
    /// Whether this store has announced itself yet (its first announcement also deletes the
    /// announcements nobody renewed for a day).
    pub(crate) announced: Mutex<bool>,
}

impl Member {
    pub(crate) fn new(reads: i64, refresh: Duration) -> Member {
        Member {
            instance: ObjectId::new(),
            reads,
            refresh,
            cached: Mutex::new(None),
            announced: Mutex::new(false),
        }
    }

    /// The newest format this store reads.
    pub(crate) fn reads(&self) -> i64 {
        self.reads
    }

    pub(crate) fn id(&self) -> String {
        format!("{INSTANCE_PREFIX}{}", self.instance.to_hex())
    }

    pub(crate) fn fresh(&self) -> Option<i64> {
        let cached = *self.cached.lock().ok()?;
        cached
            .filter(|(_, at)| at.elapsed() < self.refresh)
            .map(|(writes, _)| writes)
    }

    pub(crate) fn last_known(&self) -> i64 {
        self.cached
            .lock()
            .ok()
            .and_then(|c| c.map(|(writes, _)| writes))
            .unwrap_or(UNMARKED)
    }

    pub(crate) fn remember(&self, writes: Option<i64>) {
        if let Ok(mut cached) = self.cached.lock() {
            *cached = writes.map(|w| (w, Instant::now()));
        }
    }
}
