//! The batch as the queuer sees it: who it belongs to, when it was created, whether a submitter
//! has it, and what the ledger last said about it.

use std::fmt;
use std::time::Duration;

use bson::{oid::ObjectId, Document};

/// What the ledger last said about a batch (`None` on a [`Batch`]: nothing yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchStatus {
    /// Accepted by the ledger, not yet decided.
    Pending,
    /// Refused by the ledger; never submitted again.
    Invalid,
    /// Validated by the ledger, on its way to being committed (the ledger may still forget it:
    /// then it is unknown, and sent again before any younger batch of its service).
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

    /// Whether the ledger has settled the batch, as the queuer sees it: committed, valid or
    /// invalid (its step 1 leaves these out). A valid batch may still come back unknown (the
    /// ledger forgot it), so it keeps its service's slot until the ledger commits it.
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
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// Whether a submitter has the batch and is doing something with it.
    pub submitted: bool,
    /// What the ledger last said.
    pub status: Option<BatchStatus>,
    /// When a submitter last tried to submit it (server time).
    pub last_submitted_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// The default delay window, 15 s as in the queuer's reference design: a delayed batch is
/// retried once this long has passed since its last submission.
pub const DEFAULT_DELAY: Duration = Duration::from_secs(15);

impl Batch {
    /// Whether recording `status` would change the batch: another status, or unknown for a
    /// batch still marked with a submitter (recording it clears the mark).
    pub fn needs(&self, status: BatchStatus) -> bool {
        self.status != Some(status) || (status == BatchStatus::Unknown && self.submitted)
    }
}

/// A batch's place in its service's order.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Place {
    pub at: i64,
    pub header: String,
}

impl Place {
    pub(crate) fn of(batch: &Batch) -> Place {
        Place {
            at: batch.created_at.timestamp_millis(),
            header: batch.header.clone(),
        }
    }

    fn from_fields(d: &Document, at: &str, header: &str) -> Option<Place> {
        Some(Place {
            at: d.get_datetime(at).ok()?.timestamp_millis(),
            header: d.get_str(header).ok()?.to_string(),
        })
    }
}

/// A service's document: its slot (the batch that may be in flight) and its mark.
#[derive(Debug, Clone, Default)]
pub(crate) struct Service {
    pub holder: Option<Place>,
    /// The claim that took the slot.
    pub holder_token: Option<ObjectId>,
    pub mark: Option<Place>,
}

impl Service {
    pub(crate) fn parse(d: &Document) -> Service {
        Service {
            holder: d
                .get_document("holder")
                .ok()
                .and_then(|h| Place::from_fields(h, "at", "header")),
            holder_token: d
                .get_document("holder")
                .ok()
                .and_then(|h| h.get_object_id("token").ok()),
            mark: Place::from_fields(d, "mark_at", "mark_header"),
        }
    }

    /// The latest place a new batch must come after (other than `header` itself holding the
    /// slot).
    pub(crate) fn bound(&self, header: &str) -> Option<Place> {
        let holder = self.holder.clone().filter(|h| h.header != header);
        holder.max(self.mark.clone())
    }
}
