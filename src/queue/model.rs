//! The batch as the queuer sees it: who it belongs to, when it was created, whether a submitter
//! has it, and what the ledger last said about it.

use std::fmt;
use std::time::Duration;

use bson::DateTime;

/// What the ledger last said about a batch (`None` on a [`Batch`]: nothing yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchStatus {
    /// Accepted by the ledger, not yet decided.
    Pending,
    /// Refused by the ledger; never submitted again.
    Invalid,
    /// Validated by the ledger, on its way to being committed.
    Valid,
    /// Committed by the ledger.
    Committed,
    /// The ledger does not know the batch (the submission was lost, or the answer was): it must
    /// be submitted again.
    Unknown,
    /// The submitter could not get an answer; retry once the delay window has passed.
    Delayed,
}

impl BatchStatus {
    /// The status's name as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            BatchStatus::Pending => "pending",
            BatchStatus::Invalid => "invalid",
            BatchStatus::Valid => "valid",
            BatchStatus::Committed => "committed",
            BatchStatus::Unknown => "unknown",
            BatchStatus::Delayed => "delayed",
        }
    }

    /// Whether the ledger has settled the batch for good (the queuer's step 1 leaves these out).
    pub fn is_final(self) -> bool {
        matches!(
            self,
            BatchStatus::Committed | BatchStatus::Valid | BatchStatus::Invalid
        )
    }
}

impl fmt::Display for BatchStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One batch, as the queuer reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The batch header (its id; unique, and the tie-break between batches of one service
    /// created at the same time).
    pub header: String,
    /// The service the batch belongs to: batches of one service reach the ledger one at a time,
    /// in creation order.
    pub service_id: String,
    /// When the batch was created (server time).
    pub created_at: DateTime,
    /// Whether a submitter has the batch and is doing something with it.
    pub submitted: bool,
    /// What the ledger last said.
    pub status: Option<BatchStatus>,
    /// When a submitter last tried to submit it (server time).
    pub last_submitted_at: Option<DateTime>,
}

/// The seed's default delay window: a delayed batch is retried once this long has passed since
/// its last submission.
pub const DEFAULT_DELAY: Duration = Duration::from_secs(15);

impl Batch {
    /// Whether recording `status` would change the batch: another status, or unknown for a
    /// batch still marked with a submitter (recording it clears the mark).
    pub fn needs(&self, status: BatchStatus) -> bool {
        self.status != Some(status) || (status == BatchStatus::Unknown && self.submitted)
    }
}
