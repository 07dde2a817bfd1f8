//! Finishing and rolling back stored transactions, shared by the coordinator, the GC and writers
//! that meet an expired holder; and the [`HoldResolver`] that gives readers committed views.
//!
//! Every write here is conditional on the document still referencing the transaction (and, for a
//! rollback, still being at the applied version), so running the same step twice, or from two
//! processes at once, changes a document at most once.

use std::time::Duration;

use async_trait::async_trait;
use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use futures::future::try_join_all;
use mongodb::{Collection, Database};

use crate::error::{is_transient, HoldError, TxnError};
use crate::failpoint::{self, Faults};
use crate::fields;
use crate::hold::{CommittedView, HoldResolver};
use crate::probe;
use crate::worklist::{ActiveTransaction, Entry, TxnState, Write};

/// Which failpoint names a party uses for the steps it shares with others.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Role {
    finish: (&'static str, &'static str),
    rollback: (&'static str, &'static str),
    end: (&'static str, &'static str),
    rollback_end: (&'static str, &'static str),
    /// Whether entries found unapplied are fenced against a late apply. The coordinator never
    /// needs to (its own applies have all returned before it rolls back); a collector must,
    /// because the coordinator it overrules may still be sending them.
    fence: bool,
}

/// The coordinator of the transaction.
pub(crate) const COORDINATOR: Role = Role {
    finish: (failpoint::FINISH_BEFORE, failpoint::FINISH_AFTER),
    rollback: (failpoint::ROLLBACK_BEFORE, failpoint::ROLLBACK_AFTER),
    end: (failpoint::END_BEFORE, failpoint::END_AFTER),
    rollback_end: (
        failpoint::ROLLBACK_END_BEFORE,
        failpoint::ROLLBACK_END_AFTER,
    ),
    fence: false,
};

/// A GC round, or a writer resolving an expired holder.
pub(crate) const COLLECTOR: Role = Role {
    finish: (failpoint::GC_FINISH_BEFORE, failpoint::GC_FINISH_AFTER),
    rollback: (failpoint::GC_ROLLBACK_BEFORE, failpoint::GC_ROLLBACK_AFTER),
    end: (failpoint::GC_END_BEFORE, failpoint::GC_END_AFTER),
    rollback_end: (failpoint::GC_END_BEFORE, failpoint::GC_END_AFTER),
    fence: true,
};

/// What the transaction machinery needs: the database, the ActiveTransaction collection, faults.
#[derive(Clone, Debug)]
pub(crate) struct Env {
    pub(crate) db: Database,
    pub(crate) txns: Collection<Document>,
    pub(crate) faults: Faults,
}

impl Env {
    pub(crate) fn new(db: Database, txns_collection: &str, faults: Faults) -> Env {
        Env {
            txns: db.collection(txns_collection),
            db,
            faults,
        }
    }

    /// Consults the fault injector on behalf of transaction `txn`.
    pub(crate) fn point(
        &self,
        txn: Option<ObjectId>,
        name: &'static str,
        step: usize,
    ) -> Result<(), TxnError> {
        self.faults
            .check(name, step)
            .map_err(|at| TxnError::Crashed { txn, at })
    }
}

/// How many times an idempotent write is retried after a transient error.
const TRANSIENT_RETRIES: u32 = 4;

/// Runs one entry write; the result is the number of documents it matched (1 for an insert).
pub(crate) async fn run_write(
    db: &Database,
    coll: &str,
    write: &Write,
) -> mongodb::error::Result<u64> {
    let coll: Collection<Document> = db.collection(coll);
    match write {
        Write::Insert(doc) => coll.insert_one(doc).await.map(|_| 1),
        Write::Update(filter, update) => coll
            .update_one(filter.clone(), update.clone())
            .await
            .map(|r| r.matched_count),
        Write::Replace(filter, replacement) => coll
            .replace_one(filter.clone(), replacement)
            .await
            .map(|r| r.matched_count),
    }
}

/// Runs an idempotent operation, retrying transient failures with a short backoff: a reply
/// lost after a conditional write landed makes the retry match nothing, which is the same outcome.
pub(crate) async fn retry_transient<T, F, Fut>(what: &str, mut op: F) -> mongodb::error::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = mongodb::error::Result<T>>,
{
    let mut attempt = 0;
    loop {
        match op().await {
            Err(e) if is_transient(&e) && attempt < TRANSIENT_RETRIES => {
                attempt += 1;
                tracing::debug!(what, attempt, error = %e, "retrying after transient error");
                tokio::time::sleep(Duration::from_millis(10 << attempt)).await;
            }
            other => return other,
        }
    }
}

/// Runs a conditional entry write, retrying transient failures.
async fn run_idempotent(db: &Database, coll: &str, write: &Write) -> mongodb::error::Result<u64> {
    retry_transient(coll, || run_write(db, coll, write)).await
}

/// Frees every document of a committed transaction, then deletes its ActiveTransaction document.
pub(crate) async fn finish_all(
    env: &Env,
    txn: &ActiveTransaction,
    role: Role,
) -> Result<(), TxnError> {
    let t = txn.id;
    try_join_all(txn.entries.iter().enumerate().map(|(i, entry)| async move {
        env.point(Some(t), role.finish.0, i)?;
        run_idempotent(&env.db, &entry.coll, &entry.finish(t))
            .await
            .map_err(|e| TxnError::database(Some(t), "finish", e))?;
        env.point(Some(t), role.finish.1, i)
    }))
    .await?;
    end(env, t, role.end).await
}

/// Undoes every applied entry of a transaction that did not commit, then deletes its
/// ActiveTransaction document. Returns, per entry, whether this call undid it.
pub(crate) async fn rollback_all(
    env: &Env,
    txn: &ActiveTransaction,
    role: Role,
) -> Result<Vec<bool>, TxnError> {
    let t = txn.id;
    let undone = try_join_all(txn.entries.iter().enumerate().map(|(i, entry)| async move {
        env.point(Some(t), role.rollback.0, i)?;
        let undone = roll_back_entry(env, txn, entry, role.fence).await?;
        env.point(Some(t), role.rollback.1, i)?;
        Ok::<bool, TxnError>(undone)
    }))
    .await?;
    end(env, t, role.rollback_end).await?;
    Ok(undone)
}

/// How many times a collector goes round undo, fence, re-read for one entry. A late apply lands
/// at most once, so the second round always settles it; more means a state the protocol does
/// not produce.
const SETTLE_ROUNDS: usize = 3;

/// Undoes one entry if it is applied; with `fence`, makes sure an unapplied one never lands.
/// Returns whether this call undid it.
async fn roll_back_entry(
    env: &Env,
    txn: &ActiveTransaction,
    entry: &Entry,
    fence: bool,
) -> Result<bool, TxnError> {
    let t = txn.id;
    let failed = |e| TxnError::database(Some(t), "rollback", e);
    for _ in 0..SETTLE_ROUNDS {
        if run_idempotent(&env.db, &entry.coll, &entry.rollback(t))
            .await
            .map_err(failed)?
            == 1
        {
            return Ok(true);
        }
        if !fence {
            return Ok(false);
        }
        for write in entry.fences(t, txn.created) {
            match run_idempotent(&env.db, &entry.coll, &write).await {
                Ok(1) => return Ok(false),
                Ok(_) => {}
                // The id is taken (by a live document, a hold, or a resent fence that landed).
                Err(e) if probe::error_code(&e) == Some(probe::DUPLICATE_KEY) => {}
                Err(e) => return Err(failed(e)),
            }
        }
        // Neither undone nor fenced: the document moved on (it is someone else's now), or the
        // late apply landed in between and must be undone after all.
        let held = env
            .db
            .collection::<Document>(&entry.coll)
            .find_one(doc! { "_id": entry.id.clone(), fields::ACTIVE_TXN: t })
            .await
            .map_err(failed)?;
        if held.is_none() {
            return Ok(false);
        }
    }
    Err(TxnError::Unsettled {
        txn: t,
        collection: entry.coll.clone(),
        id: crate::error::show_id(&entry.id),
        reason: format!(
            "still held after {SETTLE_ROUNDS} rounds of undo and fence (expected version {}, applied {})",
            entry.expected, entry.applied
        ),
    })
}

async fn end(
    env: &Env,
    t: ObjectId,
    (before, after): (&'static str, &'static str),
) -> Result<(), TxnError> {
    env.point(Some(t), before, 0)?;
    retry_transient("delete ActiveTransaction", || async {
        env.txns.delete_one(doc! { "_id": t }).await
    })
    .await
    .map_err(|e| TxnError::database(Some(t), "delete ActiveTransaction", e))?;
    env.point(Some(t), after, 0)
}

/// Moves transaction `t` out of the pending state to `to`, conditionally on it still being pending
/// (and on `extra`): the one kind of write that decides a transaction's outcome, so the commit
/// point and every claim or abort race on the same condition and exactly one wins. Returns
/// whether this write was the one.
pub(crate) async fn leave_pending(
    env: &Env,
    t: ObjectId,
    to: TxnState,
    extra: Document,
) -> mongodb::error::Result<bool> {
    let mut filter = doc! { "_id": t, "state": TxnState::Pending.as_str() };
    filter.extend(extra);
    let result = env
        .txns
        .update_one(filter, doc! { "$set": { "state": to.as_str() } })
        .await?;
    Ok(result.matched_count == 1)
}

/// Reads an ActiveTransaction document.
pub(crate) async fn load(env: &Env, t: ObjectId) -> Result<Option<ActiveTransaction>, TxnError> {
    let stored = env
        .txns
        .find_one(doc! { "_id": t })
        .await
        .map_err(|e| TxnError::database(Some(t), "read ActiveTransaction", e))?;
    stored
        .map(|d| {
            bson::from_document::<ActiveTransaction>(d).map_err(|e| TxnError::Malformed {
                txn: t,
                reason: e.to_string(),
            })
        })
        .transpose()
}

/// What resolving a transaction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resolution {
    /// Its ActiveTransaction document is gone: it already ended.
    Gone,
    /// Its deadline has not passed; it may still be working.
    NotExpired,
    /// It had committed; its documents were freed.
    Finished,
    /// It had not committed; its applied changes were undone.
    RolledBack,
}

/// Finishes or rolls back transaction `t` if its deadline is at or before `now`.
///
/// A pending transaction is first claimed (set to aborted) with a write conditional on it being
/// still pending: the coordinator's commit point is conditional on the same thing, so exactly one
/// of the two wins.
pub(crate) async fn resolve_expired(
    env: &Env,
    t: ObjectId,
    now: DateTime,
) -> Result<Resolution, TxnError> {
    for _ in 0..3 {
        let Some(txn) = load(env, t).await? else {
            return Ok(Resolution::Gone);
        };
        if txn.deadline > now {
            return Ok(Resolution::NotExpired);
        }
        match txn.state {
            TxnState::Committed => {
                finish_all(env, &txn, COLLECTOR).await?;
                tracing::info!(txn = %t, entries = txn.entries.len(), "finished expired committed transaction");
                return Ok(Resolution::Finished);
            }
            TxnState::Aborted => {
                rollback_all(env, &txn, COLLECTOR).await?;
                tracing::info!(txn = %t, entries = txn.entries.len(), "rolled back expired transaction");
                return Ok(Resolution::RolledBack);
            }
            TxnState::Pending => {
                env.point(Some(t), failpoint::GC_CLAIM_BEFORE, 0)?;
                let claimed = leave_pending(
                    env,
                    t,
                    TxnState::Aborted,
                    doc! { "deadline": { "$lte": now } },
                )
                .await
                .map_err(|e| TxnError::database(Some(t), "claim ActiveTransaction", e))?;
                env.point(Some(t), failpoint::GC_CLAIM_AFTER, 0)?;
                if claimed {
                    let txn = ActiveTransaction {
                        state: TxnState::Aborted,
                        ..txn
                    };
                    rollback_all(env, &txn, COLLECTOR).await?;
                    tracing::info!(txn = %t, entries = txn.entries.len(), "claimed and rolled back expired transaction");
                    return Ok(Resolution::RolledBack);
                }
                // The coordinator reached its commit point (or another party claimed it) in
                // between: look again.
            }
        }
    }
    Ok(Resolution::NotExpired)
}

/// The entry of `txn` for document `id` of collection `coll`.
pub(crate) fn entry_for<'a>(
    txn: &'a ActiveTransaction,
    coll: &str,
    id: &Bson,
) -> Option<&'a Entry> {
    txn.entries.iter().find(|e| e.coll == coll && e.id == *id)
}

/// The [`HoldResolver`] of the transaction layer: pre-images for pending transactions, stored
/// documents past the commit point, inline resolution of expired holders.
#[derive(Debug, Clone)]
pub struct TransactionHolds {
    txns_collection: String,
}

impl TransactionHolds {
    /// A resolver reading ActiveTransaction documents from `txns_collection`.
    pub fn new(txns_collection: impl Into<String>) -> TransactionHolds {
        TransactionHolds {
            txns_collection: txns_collection.into(),
        }
    }

    fn env(&self, db: &Database) -> Env {
        Env::new(db.clone(), &self.txns_collection, Faults::default())
    }
}

#[async_trait]
impl HoldResolver for TransactionHolds {
    async fn committed_view(
        &self,
        db: &Database,
        collection: &str,
        stored: &Document,
        holder: &ObjectId,
    ) -> Result<CommittedView, HoldError> {
        let env = self.env(db);
        let id = stored.get("_id").cloned().unwrap_or(Bson::Null);
        let Some(txn) = load(&env, *holder).await? else {
            // The holder ended between the two reads, or the hold is an orphan.
            let fresh = db
                .collection::<Document>(collection)
                .find_one(doc! { "_id": id.clone() })
                .await?;
            let still_held = fresh
                .as_ref()
                .and_then(|d| d.get_object_id(fields::ACTIVE_TXN).ok())
                == Some(*holder);
            if still_held {
                return Err(format!(
                    "held by transaction {} whose ActiveTransaction document no longer exists (orphaned hold)",
                    holder.to_hex()
                )
                .into());
            }
            return Ok(CommittedView::Reread);
        };
        if txn.state == TxnState::Committed {
            return Ok(CommittedView::Stored);
        }
        let Some(entry) = entry_for(&txn, collection, &id) else {
            return Err(format!(
                "transaction {} holds {collection}/{id} but has no entry for it",
                holder.to_hex()
            )
            .into());
        };
        Ok(match entry.pre_image(stored) {
            Some(pre) => CommittedView::PreImage(pre),
            None => CommittedView::Absent,
        })
    }

    async fn resolve_holder(
        &self,
        db: &Database,
        _collection: &str,
        _id: &Bson,
        holder: &ObjectId,
    ) -> Result<bool, HoldError> {
        let resolution = resolve_expired(&self.env(db), *holder, DateTime::now()).await?;
        Ok(resolution != Resolution::NotExpired)
    }
}
