//! The store's background work (the finishing of transactions committed with
//! `Finish::InBackground`, and the flushes of the contention record), tracked so that a service
//! stopping for a deploy can wait for it instead of leaving committed documents held until a
//! reader, a writer or the GC finishes them, or counts of conflicts unwritten.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
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
    /// The contention record's flushes: waited for by shutdown too, but not counted in its
    /// report, which is about committed transactions.
    flushes: TaskTracker,
    /// Cancelled when shutdown begins: work that waits before doing something (a flush of the
    /// contention record waits for its interval) does it at once instead.
    closing: CancellationToken,
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

    /// A place for one flush of the contention record, held by the task doing it, and the token
    /// cancelled once shutdown begins, when the flush should write at once rather than wait for
    /// its interval. Unlike [`Background::slot`] there is always one: a flush after shutdown
    /// began goes at once, and a second shutdown waits for it.
    pub(crate) fn flush_slot(&self) -> (TaskTrackerToken, CancellationToken) {
        (self.flushes.token(), self.closing.clone())
    }

    /// Takes no more background work and waits up to `limit` for what is running.
    pub(crate) async fn shutdown(&self, limit: Duration) -> Shutdown {
        let ended_before = self.ended.load(Ordering::Relaxed);
        self.tracker.close();
        self.flushes.close();
        self.closing.cancel();
        let both = async { tokio::join!(self.tracker.wait(), self.flushes.wait()) };
        if tokio::time::timeout(limit, both).await.is_err() {
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
