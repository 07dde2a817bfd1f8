//! Settling one expired transaction now (`mongotx resolve`), exactly as a GC round would settle
//! it: the record pass (`expired::resolve_expired`: decide a staging transaction, then finish
//! or roll back, then delete the record), then the sweep of the holds it leaves (the GC's
//! one-by-one path, `resolve::settle_at`). A live transaction, one whose deadline has not
//! passed on the server's clock, is refused before anything is written: until then only its
//! coordinator decides it.
//!
//! Another runner's claim on the record does not stop it: claims only share work between
//! runners (every write of a resolution is conditional), and an operator asking for this one
//! wants it now, typically because a dead runner's claim keeps the others off it.

use bson::{oid::ObjectId, DateTime};
use serde::Serialize;

use crate::repo::error::show_id;
use crate::repo::hold::record::TxnState;
use crate::repo::hold::resolve::{self, Settled};
use crate::txn::error::TxnError;
use crate::txn::expired::{self, Resolution};
use crate::txn::inspect::documents::{entry_states, held_by, restate};
use crate::txn::inspect::model::{ser, DocState, DocumentState, RecordInfo};
use crate::txn::inspect::report::stored;
use crate::txn::recovery::Env;

/// What settling a transaction did.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Resolved {
    /// The transaction.
    pub txn: ObjectId,
    /// The server's time it was settled at (the time its deadline was judged by).
    #[serde(serialize_with = "ser::time")]
    pub now: DateTime,
    /// Its record before (`None`: it had none, only holds).
    pub before: Option<RecordInfo>,
    /// What was done.
    pub outcome: Settlement,
    /// Holds of the transaction settled after the record pass (those its worklist did not
    /// cover, or that a transaction without a record left), as the GC's sweep settles them.
    pub holds_settled: usize,
    /// Its record afterwards, if it is still there.
    pub record_after: Option<RecordInfo>,
    /// Its documents afterwards, each with where it stands.
    pub documents: Vec<DocumentState>,
    /// What was done, in a sentence or two.
    pub says: String,
}

/// What settling a transaction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Settlement {
    /// It had committed: its documents were freed with its changes and its record deleted.
    Finished,
    /// It had not committed: its changes were undone (an aborted record may stay until the
    /// records' own clock passes its deadline; the next GC round deletes it).
    RolledBack,
    /// Its record went meanwhile: someone else ended it.
    AlreadyEnded,
    /// It could not be decided yet: a participant is held by another transaction that is live.
    Undecided,
    /// It had no record: its holds were undone, an aborted record written in the missing
    /// one's place first.
    HoldsUndone,
}

/// Settles transaction `txn` now, as the GC would, if it has expired.
pub(crate) async fn resolve(env: &Env, txn: ObjectId) -> Result<Resolved, TxnError> {
    let now = env.now(Some(txn)).await?;
    let before = stored(env, txn, now).await?;
    if before.is_empty() {
        return Err(TxnError::UnknownTransaction { txn });
    }
    if let Some(record) = &before.record {
        if let Some(left) = record.left {
            return Err(TxnError::Live {
                txn,
                state: record.state,
                deadline: record.deadline,
                left,
            });
        }
    }
    let resolution = match before.raw {
        Some(_) => Some(expired::resolve_expired(env, txn, now).await?),
        None => None,
    };
    let holds_settled = sweep(env, txn, now).await?;
    let after = stored(env, txn, now).await?;
    let outcome = match resolution {
        Some(Resolution::Finished) => Settlement::Finished,
        Some(Resolution::RolledBack) => Settlement::RolledBack,
        Some(Resolution::Gone) => Settlement::AlreadyEnded,
        // Rolled back, its aborted record waiting for the records' own clock.
        Some(Resolution::NotExpired)
            if after
                .record
                .as_ref()
                .is_some_and(|r| r.state == TxnState::Aborted) =>
        {
            Settlement::RolledBack
        }
        Some(Resolution::NotExpired) => Settlement::Undecided,
        None => Settlement::HoldsUndone,
    };
    // Where its documents stand now: the holds found, read again, if it had no record (an
    // aborted record put in the missing one's place lists no documents); by the record if it is
    // still there; else by the worklist read before, judged by the outcome.
    let documents = match (before.parsed, after.parsed.is_some()) {
        (None, _) => restate(env, txn, before.documents).await?,
        (Some(_), true) => after.documents,
        (Some(parsed), false) => {
            let state = match outcome {
                Settlement::Finished => TxnState::Committed,
                Settlement::RolledBack => TxnState::Aborted,
                _ => parsed.state,
            };
            entry_states(env, txn, state, &parsed.entries).await?
        }
    };
    let says = describe(outcome, holds_settled, after.record.is_some(), &documents);
    Ok(Resolved {
        txn,
        now,
        before: before.record,
        outcome,
        holds_settled,
        record_after: after.record,
        documents,
        says,
    })
}

/// Settles the holds of `txn` the record pass left (none, usually), one by one as the GC's
/// sweep does; returns how many were freed.
async fn sweep(env: &Env, txn: ObjectId, now: DateTime) -> Result<usize, TxnError> {
    let mut freed = 0;
    for held in held_by(env, txn).await? {
        let (settled, _) =
            resolve::settle_at(&env.store, &held.collection, &held.id, txn, Some(now))
                .await
                .map_err(|source| {
                    TxnError::hold(Some(txn), &held.collection, &held.id, txn, source)
                })?;
        if settled == Settled::Freed {
            freed += 1;
        }
    }
    Ok(freed)
}

fn describe(
    outcome: Settlement,
    holds: usize,
    record_left: bool,
    documents: &[DocumentState],
) -> String {
    let mut says = match outcome {
        Settlement::Finished => {
            "finished: it had committed; its documents are free with its changes and its record \
             is deleted."
                .to_string()
        }
        Settlement::RolledBack if record_left => {
            "rolled back: it had not committed; its documents are back as they were. Its aborted \
             record stays until the records' own clock passes its deadline; the next GC round \
             deletes it."
                .to_string()
        }
        Settlement::RolledBack => {
            "rolled back: it had not committed; its documents are back as they were and its \
             record is deleted."
                .to_string()
        }
        Settlement::AlreadyEnded => {
            "nothing to settle: its record went meanwhile (its coordinator or a resolver ended it)."
                .to_string()
        }
        Settlement::Undecided => {
            let holder = documents.iter().find_map(|d| match d.state {
                DocState::HeldByOther { txn } => Some(format!(
                    "{}/{} is held by transaction {txn}",
                    d.collection,
                    show_id(&d.id)
                )),
                _ => None,
            });
            format!(
                "left undecided: {}, which is live; the next GC round tries again.",
                holder.unwrap_or_else(|| "a participant is held by another transaction".into())
            )
        }
        Settlement::HoldsUndone => {
            "no record: its holds are undone, after an aborted record was written in the missing \
             one's place (so that none can still arrive as staging)."
                .to_string()
        }
    };
    if holds > 0 && outcome != Settlement::HoldsUndone {
        says.push_str(&format!(
            " {holds} more hold(s) of it settled, as the GC's sweep would."
        ));
    }
    says
}
