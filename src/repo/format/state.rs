//! A store's own part in the stored format's gate: who it is, what it reads, and the format the
//! database writes as it last read it. Apart from `gate`, which reads and writes `mongotx_meta`
//! through the store, so that the store's handle holds it without importing what uses the store.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use bson::oid::ObjectId;

use crate::repo::format::UNMARKED;

/// The prefix of the ids of instance announcements.
pub(crate) const INSTANCE_PREFIX: &str = "instance:";

/// A store's part in the gate: who it is, what it reads, and the written format it last read.
#[derive(Debug)]
pub(crate) struct Gate {
    instance: ObjectId,
    /// The newest format this store reads.
    pub(super) reads: i64,
    /// How often, at most, it reads the format the database writes and renews its announcement.
    pub(super) refresh: Duration,
    /// The format the database writes, and when this store read it.
    cached: Mutex<Option<(i64, Instant)>>,
    /// Whether this store has announced itself yet (its first announcement also deletes the
    /// announcements nobody renewed for a day).
    pub(super) announced: Mutex<bool>,
}

impl Gate {
    pub(crate) fn new(reads: i64, refresh: Duration) -> Gate {
        Gate {
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

    pub(super) fn id(&self) -> String {
        format!("{INSTANCE_PREFIX}{}", self.instance.to_hex())
    }

    pub(super) fn fresh(&self) -> Option<i64> {
        let cached = *self.cached.lock().ok()?;
        cached
            .filter(|(_, at)| at.elapsed() < self.refresh)
            .map(|(writes, _)| writes)
    }

    pub(super) fn last_known(&self) -> i64 {
        self.cached
            .lock()
            .ok()
            .and_then(|c| c.map(|(writes, _)| writes))
            .unwrap_or(UNMARKED)
    }

    pub(super) fn remember(&self, writes: Option<i64>) {
        if let Ok(mut cached) = self.cached.lock() {
            *cached = writes.map(|w| (w, Instant::now()));
        }
    }
}
