//! The store's background work (the finishing of transactions committed with
//! `Finish::InBackground`), tracked so that a service stopping for a deploy can wait for it
//! instead of leaving committed documents held until a reader, a writer or the GC finishes them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::task::task_tracker::TaskTrackerToken;
use tokio_util::task::TaskTracker;

use crate::metrics;

/// What [`Store::shutdown`](crate::Store::shutdown) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Shutdown {
    /// Background finishes that ended while the call waited.
    pub finished: usize,
    /// Background finishes still running when the wait ran out. Their transactions are
    /// committed; what they had not freed stays held until a reader, a writer or the GC finishes
    /// it.
    pub unfinished: usize,
}

/// Every background task of one store (shared by its clones).
#[derive(Debug, Default)]
pub(crate) struct Background {
    tracker: TaskTracker,
    ended: Arc<AtomicUsize>,
}

/// A place in the store's background work, held by the task doing it; the work counts as
/// running until this is dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    _token: TaskTrackerToken,
    ended: Arc<AtomicUsize>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.ended.fetch_add(1, Ordering::Relaxed);
        metrics::background_ended();
    }
}

impl Background {
    /// A slot for one more background task, or `None` once shutdown began (the caller then does
    /// the work before returning). The slot is taken before the check, so a shutdown that begins
    /// after it waits for this task too.
    pub(crate) fn slot(&self) -> Option<Slot> {
        let token = self.tracker.token();
        if self.tracker.is_closed() {
            return None;
        }
        metrics::background_started();
        Some(Slot {
            _token: token,
            ended: Arc::clone(&self.ended),
        })
    }

    /// Takes no more background work and waits up to `limit` for what is running.
    pub(crate) async fn shutdown(&self, limit: Duration) -> Shutdown {
        let ended_before = self.ended.load(Ordering::Relaxed);
        self.tracker.close();
        if tokio::time::timeout(limit, self.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                running = self.tracker.len(),
                ?limit,
                "shutdown: background finishes still running; the GC will finish them"
            );
        }
        Shutdown {
            finished: self
                .ended
                .load(Ordering::Relaxed)
                .saturating_sub(ended_before),
            unfinished: self.tracker.len(),
        }
    }
}
