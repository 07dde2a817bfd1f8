//! The seam between the repository and the transaction layer: documents held by a transaction.
//!
//! A document whose active-transaction field is set belongs to a transaction in flight. Readers
//! must see its committed value (the pre-image until the commit point, the post-image after), and
//! writers must wait for the holder, or resolve it when its deadline has passed. Only the
//! transaction layer knows how, so the repository asks a [`HoldResolver`].

use std::time::Duration;

use async_trait::async_trait;
use bson::{oid::ObjectId, Bson, Document};
use mongodb::Database;
use rand::Rng;

use crate::error::HoldError;

/// What readers see of a held document.
#[derive(Debug, Clone, PartialEq)]
pub enum CommittedView {
    /// The stored document is the committed one (the holder passed its commit point).
    Stored,
    /// The committed document is this pre-image (system fields included).
    PreImage(Document),
    /// The document does not exist yet (an insert that has not committed).
    Absent,
    /// The holder finished while the document was being read: read it again.
    Reread,
}

/// Decides what a held document means; implemented by the transaction layer.
#[async_trait]
pub trait HoldResolver: Send + Sync + 'static {
    /// The committed view of `stored`, which transaction `holder` holds.
    async fn committed_view(
        &self,
        db: &Database,
        collection: &str,
        stored: &Document,
        holder: &ObjectId,
    ) -> Result<CommittedView, HoldError>;

    /// Resolves `holder` if it has expired; `Ok(true)` means the document may have been freed.
    async fn resolve_holder(
        &self,
        db: &Database,
        collection: &str,
        id: &Bson,
        holder: &ObjectId,
    ) -> Result<bool, HoldError>;
}

/// The resolver used without a transaction layer: held documents read as stored, holders are
/// waited for and never resolved.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoTransactions;

#[async_trait]
impl HoldResolver for NoTransactions {
    async fn committed_view(
        &self,
        _db: &Database,
        _collection: &str,
        _stored: &Document,
        _holder: &ObjectId,
    ) -> Result<CommittedView, HoldError> {
        Ok(CommittedView::Stored)
    }

    async fn resolve_holder(
        &self,
        _db: &Database,
        _collection: &str,
        _id: &Bson,
        _holder: &ObjectId,
    ) -> Result<bool, HoldError> {
        Ok(false)
    }
}

/// How long a writer waits for a held document, and how it backs off meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockWait {
    /// Total time to wait before failing with `Locked`.
    pub max_wait: Duration,
    /// First pause between attempts.
    pub initial_backoff: Duration,
    /// Longest pause between attempts.
    pub max_backoff: Duration,
}

impl Default for LockWait {
    fn default() -> LockWait {
        LockWait {
            max_wait: Duration::from_secs(2),
            initial_backoff: Duration::from_millis(2),
            max_backoff: Duration::from_millis(100),
        }
    }
}

impl LockWait {
    /// The pause before attempt `attempt` (0-based): exponential, capped, jittered so
    /// that writers queued on one document do not retry in lockstep.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let ceiling = self
            .initial_backoff
            .saturating_mul(1_u32 << attempt.min(16))
            .min(self.max_backoff);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        if nanos == 0 {
            return Duration::ZERO;
        }
        Duration::from_nanos(rand::rng().random_range(nanos / 2..=nanos))
    }
}
