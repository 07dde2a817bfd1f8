//! The batch as the queuer sees it: who it belongs to, when it was created, whether a submitter
//! has it, and what the ledger last said about it.

use std::fmt;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Document};

use crate::repo::names::{name_problem, shown};

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

/// Statuses of a batch the ledger has or had: under the parallel strategy, with `submitted` and
/// `sent`, what makes a batch have gone.
pub(crate) const AT_LEDGER: [BatchStatus; 4] = [
    BatchStatus::Pending,
    BatchStatus::Valid,
    BatchStatus::Committed,
    BatchStatus::Invalid,
];

impl BatchStatus {
    /// Whether the ledger has or had a batch of this status (see [`AT_LEDGER`]).
    pub(crate) fn at_ledger(self) -> bool {
        AT_LEDGER.contains(&self)
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
    /// The keys it declared it reads and writes; `None`: it declared none, and conflicts with
    /// every batch of its service.
    pub keys: Option<Keys>,
    /// How its service sends batches (chosen before the service's first batch).
    pub strategy: Strategy,
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

/// The most keys a batch may declare it reads, and the most it may declare it writes: each is
/// matched against the other batches of its service at every claim.
pub const MAX_KEYS: usize = 256;

/// How a service's batches go to the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Strategy {
    /// One batch at a time, in creation order (the one-round serial strategy).
    #[default]
    Serial,
    /// Batches whose declared keys do not conflict go together; of two that conflict, the
    /// older is final at the ledger (committed or invalid) before the younger is sent.
    Parallel,
}

impl Strategy {
    /// The strategy's name as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Serial => "serial",
            Strategy::Parallel => "parallel",
        }
    }

    /// The strategy stored as `name` (a missing field is serial).
    pub(crate) fn parse(name: Option<&str>) -> Option<Strategy> {
        match name {
            None | Some("serial") => Some(Strategy::Serial),
            Some("parallel") => Some(Strategy::Parallel),
            Some(_) => None,
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a batch declares it reads and writes: the keys (names the service chooses: accounts,
/// assets, documents) its transactions touch on the ledger. Under the parallel strategy two
/// batches conflict when one writes a key the other reads or writes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Keys {
    // Sorted and without repeats (kept so by `new`, the only way to make one), so that
    // `conflicts` can search them.
    reads: Vec<String>,
    writes: Vec<String>,
}

impl Keys {
    /// Keys read and written; sorted, repeats dropped (a key both read and written is kept in
    /// both lists).
    pub fn new<R, W>(reads: R, writes: W) -> Keys
    where
        R: IntoIterator,
        R::Item: Into<String>,
        W: IntoIterator,
        W::Item: Into<String>,
    {
        let tidy = |keys: Vec<String>| {
            let mut keys = keys;
            keys.sort();
            keys.dedup();
            keys
        };
        Keys {
            reads: tidy(reads.into_iter().map(Into::into).collect()),
            writes: tidy(writes.into_iter().map(Into::into).collect()),
        }
    }

    /// The keys it reads, sorted.
    pub fn reads(&self) -> &[String] {
        &self.reads
    }

    /// The keys it writes, sorted.
    pub fn writes(&self) -> &[String] {
        &self.writes
    }

    /// Every key it touches, read or written.
    pub(crate) fn touched(&self) -> Vec<&str> {
        let mut all: Vec<&str> = self
            .reads
            .iter()
            .chain(&self.writes)
            .map(String::as_str)
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    }
}

/// Whether two batches of one service must keep their order: one of them declared nothing, or
/// one writes a key the other reads or writes.
pub fn conflicts(a: Option<&Keys>, b: Option<&Keys>) -> bool {
    let (Some(a), Some(b)) = (a, b) else {
        return true;
    };
    let meets = |w: &[String], other: &[String]| w.iter().any(|k| other.binary_search(k).is_ok());
    meets(&a.writes, &b.writes) || meets(&a.writes, &b.reads) || meets(&b.writes, &a.reads)
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

/// The stored form of declared keys.
pub(crate) fn keys_doc(keys: &Keys) -> Document {
    doc! { "reads": keys.reads(), "writes": keys.writes() }
}

/// What is wrong with the keys a batch declares, if anything.
pub(crate) fn keys_problem(keys: &Keys) -> Option<String> {
    for (what, list) in [("reads", keys.reads()), ("writes", keys.writes())] {
        if list.len() > MAX_KEYS {
            return Some(format!(
                "it declares {} keys it {what}, over the {MAX_KEYS} allowed",
                list.len()
            ));
        }
        if let Some((key, problem)) = list.iter().find_map(|k| name_problem(k).map(|p| (k, p))) {
            return Some(format!(
                "the key {} it {what} is unusable: {problem}",
                shown(key)
            ));
        }
    }
    None
}

/// The keys stored batch `d` declares.
pub(crate) fn parse_keys(d: &Document) -> Result<Option<Keys>, String> {
    let Ok(keys) = d.get_document("keys") else {
        return Ok(None);
    };
    let list = |field: &str| -> Result<Vec<String>, String> {
        keys.get_array(field)
            .map_err(|_| format!("no list of keys it {field}"))?
            .iter()
            .map(|k| {
                k.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("a key it {field} is not a string"))
            })
            .collect()
    };
    Ok(Some(Keys::new(list("reads")?, list("writes")?)))
}
