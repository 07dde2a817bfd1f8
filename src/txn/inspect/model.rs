//! What the reports share: a transaction's record as a person needs it, a GC runner's claim, one
//! document of a worklist and where it stands, and how times and durations are written in JSON
//! (RFC 3339 and milliseconds, so that scripts need no BSON).

use std::time::Duration;

use bson::{oid::ObjectId, Bson, DateTime, Document};
use serde::Serialize;

use crate::repo::hold::record::TxnState;
use crate::server::clock;
use crate::txn::claims;
use crate::txn::worklist::{ActiveTransaction, Entry, Op};

/// A transaction's record, as it stands, with its deadline measured against the server's clock.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct RecordInfo {
    /// The record's state: only this changes once the record is written.
    pub state: TxnState,
    /// When the record was written (server time): how old the transaction is.
    #[serde(serialize_with = "ser::time")]
    pub created: DateTime,
    /// From this moment (server time) anyone may decide, finish or roll back the transaction:
    /// the GC's first round after it settles whatever its coordinator left.
    #[serde(serialize_with = "ser::time")]
    pub deadline: DateTime,
    /// How long until the deadline, by the server's clock (`None` once it has passed).
    #[serde(rename = "left_ms", serialize_with = "ser::opt_millis")]
    pub left: Option<Duration>,
    /// How long ago the deadline passed (`None` while it has not): how long the transaction has
    /// waited for the GC.
    #[serde(rename = "overdue_ms", serialize_with = "ser::opt_millis")]
    pub overdue: Option<Duration>,
    /// A GC runner's claim on the record, while it has not run out.
    pub claim: Option<GcClaim>,
}

impl RecordInfo {
    /// The record `txn` (whole, as stored: `raw` carries the claim) seen at `now`.
    pub(crate) fn new(txn: &ActiveTransaction, raw: &Document, now: DateTime) -> RecordInfo {
        let passed = txn.deadline <= now;
        RecordInfo {
            state: txn.state,
            created: txn.created,
            deadline: txn.deadline,
            left: (!passed).then(|| clock::between(now, txn.deadline)),
            overdue: passed.then(|| clock::between(txn.deadline, now)),
            claim: GcClaim::of(raw, now),
        }
    }
}

/// A GC runner's claim on an expired record: until it runs out, other runners leave the record
/// (and its transaction's holds) to that runner, alive or dead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct GcClaim {
    /// The runner's name (a fresh id per GC handle).
    pub runner: ObjectId,
    /// When the claim runs out (server time).
    #[serde(serialize_with = "ser::time")]
    pub until: DateTime,
    /// How long until then.
    #[serde(rename = "left_ms", serialize_with = "ser::millis")]
    pub left: Duration,
}

impl GcClaim {
    /// The claim stored on `record`, if it has not run out by `now`.
    pub(crate) fn of(record: &Document, now: DateTime) -> Option<GcClaim> {
        let (runner, until) = claims::claim_of(record)?;
        (until > now).then(|| GcClaim {
            runner,
            until,
            left: clock::between(now, until),
        })
    }
}

/// One document of a transaction: what the worklist does to it and where it stands now.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct DocumentState {
    /// Its collection.
    pub collection: String,
    /// Its id.
    pub id: Bson,
    /// What the transaction does to it: `insert`, `update`, `adjust`, `rewrite`, `delete`,
    /// `check` or `guard` (`held` for a document found held without a record listing it).
    pub op: &'static str,
    /// The version the transaction read (0 for an insert; `None` without a record).
    pub expected: Option<i64>,
    /// The version its change gives the document (the same as `expected` for a check).
    pub applied: Option<i64>,
    /// Where the document stands.
    pub state: DocState,
}

impl DocumentState {
    /// The document of `entry`, where it stands.
    pub(crate) fn of_entry(entry: &Entry, state: DocState) -> DocumentState {
        DocumentState {
            collection: entry.coll.clone(),
            id: entry.id.clone(),
            op: op_name(&entry.op),
            expected: Some(entry.expected),
            applied: Some(entry.applied),
            state,
        }
    }
}

/// The name of what an entry does, as the record stores it (`op.kind`).
pub(crate) fn op_name(op: &Op) -> &'static str {
    match op {
        Op::Insert { .. } => "insert",
        Op::Update { .. } => "update",
        Op::Adjust { .. } => "adjust",
        Op::Rewrite { .. } => "rewrite",
        Op::Delete => "delete",
        Op::Check => "check",
        Op::Guard { .. } => "guard",
    }
}

/// Where one document of a transaction stands, read from the document itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "is", rename_all = "snake_case")]
#[non_exhaustive]
pub enum DocState {
    /// Held by this transaction's own change (for a check, its hold): the change is in place.
    Held {
        /// The stored version (the change's, while held).
        version: i64,
    },
    /// Held by this transaction's fence: a resolver deciding it after its deadline holds the
    /// document so that the change can never land; the transaction cannot commit.
    Fenced,
    /// Created by this transaction after its deadline (the server stamped the creation too
    /// late): it never counts, and the transaction cannot commit.
    CreatedLate,
    /// Held by another transaction.
    HeldByOther {
        /// The other transaction.
        txn: ObjectId,
    },
    /// Free, carrying this committed transaction's change: finished (a delete as a tombstone).
    Finished {
        /// The stored version.
        version: i64,
    },
    /// Free, at the version the transaction read: its change never landed or was rolled back,
    /// or it changes nothing (a check).
    AsRead {
        /// The stored version.
        version: i64,
    },
    /// Free, at a version other than the one read (and, for a committed transaction, other than
    /// its change's): changed by someone else.
    Changed {
        /// The stored version.
        version: i64,
    },
    /// Free, with no worklist entry to compare its version with (a document found held by a
    /// transaction without a record, since freed).
    Free {
        /// The stored version.
        version: i64,
    },
    /// A tombstone the transaction did not make.
    Deleted {
        /// The tombstone's version.
        version: i64,
    },
    /// No document with this id (an insert that never landed or was rolled back, or one purged).
    Missing,
    /// Its system fields cannot be read (a writer outside mongotx changed them).
    Unreadable,
}

impl DocState {
    /// Whether the document carries the transaction's own change (what an implicit commit
    /// needs of every participant).
    pub fn is_applied(&self) -> bool {
        matches!(self, DocState::Held { .. })
    }
}

/// How the reports are written as JSON: times in RFC 3339 (UTC, milliseconds), durations in
/// whole milliseconds.
pub(crate) mod ser {
    use std::time::Duration;

    use bson::DateTime;
    use serde::Serializer;

    use crate::server::clock;

    pub(crate) fn time<S: Serializer>(at: &DateTime, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&clock::rfc3339(*at))
    }

    pub(crate) fn opt_time<S: Serializer>(at: &Option<DateTime>, s: S) -> Result<S::Ok, S::Error> {
        match at {
            Some(at) => time(at, s),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn millis<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub(crate) fn opt_millis<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => millis(d, s),
            None => s.serialize_none(),
        }
    }
}
