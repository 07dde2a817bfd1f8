//! Finishing and rolling back whole transactions from their records, shared by the coordinator
//! and the GC.
//!
//! Every write here is conditional on the document still being held by the transaction, so
//! running the same step twice, or from two processes at once, changes a document at most once.
//! No step needs to look at anything but the record's entries: the entry says how to finish or
//! undo its document, and is the same description the document's own hold carries.

use std::time::Duration;

use bson::{doc, oid::ObjectId, DateTime, Document};
use futures::future::try_join_all;
use mongodb::Collection;

use crate::repo::hold::{self, TxnState};
use crate::repo::store::Store;
use crate::repo::write::{self, Write};
use crate::server::is_transient;
use crate::txn::error::TxnError;
use crate::txn::failpoint::{self, Faults};
use crate::txn::worklist::{ActiveTransaction, Entry};

/// Which failpoint names a party uses for the steps it shares with others.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Role {
    finish: (&'static str, &'static str),
    rollback: (&'static str, &'static str),
    end: (&'static str, &'static str),
    rollback_end: (&'static str, &'static str),
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
};

/// A GC round.
pub(crate) const COLLECTOR: Role = Role {
    finish: (failpoint::GC_FINISH_BEFORE, failpoint::GC_FINISH_AFTER),
    rollback: (failpoint::GC_ROLLBACK_BEFORE, failpoint::GC_ROLLBACK_AFTER),
    end: (failpoint::GC_END_BEFORE, failpoint::GC_END_AFTER),
    rollback_end: (failpoint::GC_END_BEFORE, failpoint::GC_END_AFTER),
};

/// What the transaction machinery needs: the store (database, clock, durability) and faults.
#[derive(Clone, Debug)]
pub(crate) struct Env {
    pub(crate) store: Store,
    pub(crate) faults: Faults,
}

impl Env {
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

    /// The records collection, with the protocol's write and read concerns.
    pub(crate) async fn records(
        &self,
        txn: Option<ObjectId>,
    ) -> Result<Collection<Document>, TxnError> {
        self.collection(txn, self.store.transactions_collection())
            .await
    }

    /// A data collection, with the protocol's write and read concerns.
    pub(crate) async fn collection(
        &self,
        txn: Option<ObjectId>,
        name: &str,
    ) -> Result<Collection<Document>, TxnError> {
        self.store
            .protocol_collection(name)
            .await
            .map_err(|e| TxnError::database(txn, "learn the deployment's durability", e))
    }

    /// The server's time.
    pub(crate) async fn now(&self, txn: Option<ObjectId>) -> Result<DateTime, TxnError> {
        self.store
            .now()
            .await
            .map_err(|source| TxnError::Clock { txn, source })
    }
}

/// How many times an idempotent write is retried after a transient error.
const TRANSIENT_RETRIES: u32 = 4;

/// Runs an idempotent operation, retrying transient failures with a short backoff: a reply lost
/// after a conditional write landed makes the retry match nothing, which is the same outcome.
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
                tracing::debug!(what, attempt, "retrying after a transient error");
                tokio::time::sleep(Duration::from_millis(10 << attempt)).await;
            }
            other => return other,
        }
    }
}

/// Makes entry `entry` of committed transaction `txn` final (idempotent).
pub(crate) async fn finish_entry(env: &Env, txn: ObjectId, entry: &Entry) -> Result<(), TxnError> {
    let coll = env.collection(Some(txn), &entry.coll).await?;
    let filter = hold::held_by(&entry.id, txn);
    retry_transient("finish", || async {
        if entry.deletes() {
            env.store
                .write_tombstone(
                    &coll,
                    filter.clone(),
                    &entry.id,
                    entry.schema,
                    entry.applied,
                )
                .await
        } else {
            write::run(&coll, &entry.finish(txn)).await
        }
    })
    .await
    .map_err(|e| TxnError::database(Some(txn), "finish", e))?;
    Ok(())
}

/// Frees every document of a committed transaction, then deletes its record.
pub(crate) async fn finish_all(
    env: &Env,
    txn: &ActiveTransaction,
    role: Role,
) -> Result<(), TxnError> {
    each_entry(env, txn, role.finish, |entry| {
        finish_entry(env, txn.id, entry)
    })
    .await?;
    end(env, txn.id, role.end).await
}

/// Undoes every applied entry of a transaction that did not commit, then deletes its record.
pub(crate) async fn rollback_all(
    env: &Env,
    txn: &ActiveTransaction,
    role: Role,
) -> Result<(), TxnError> {
    each_entry(env, txn, role.rollback, |entry| {
        undo_entry(env, txn.id, txn.deadline, entry)
    })
    .await?;
    end(env, txn.id, role.rollback_end).await
}

/// Runs `step` on every entry concurrently, between the failpoints `(before, after)`.
async fn each_entry<'a, F, Fut>(
    env: &Env,
    txn: &'a ActiveTransaction,
    (before, after): (&'static str, &'static str),
    step: F,
) -> Result<(), TxnError>
where
    F: Fn(&'a Entry) -> Fut,
    Fut: std::future::Future<Output = Result<(), TxnError>>,
{
    let t = txn.id;
    try_join_all(txn.entries.iter().enumerate().map(|(i, entry)| {
        let work = step(entry);
        async move {
            env.point(Some(t), before, i)?;
            work.await?;
            env.point(Some(t), after, i)
        }
    }))
    .await
    .map(|_| ())
}

/// Undoes one entry if the transaction holds its document.
async fn undo_entry(
    env: &Env,
    t: ObjectId,
    deadline: DateTime,
    entry: &Entry,
) -> Result<(), TxnError> {
    let coll = env.collection(Some(t), &entry.coll).await?;
    let undo: Write = entry.rollback(t, deadline);
    retry_transient("rollback", || write::run(&coll, &undo))
        .await
        .map_err(|e| TxnError::database(Some(t), "rollback", e))?;
    Ok(())
}

async fn end(
    env: &Env,
    t: ObjectId,
    (before, after): (&'static str, &'static str),
) -> Result<(), TxnError> {
    env.point(Some(t), before, 0)?;
    let records = env.records(Some(t)).await?;
    retry_transient("delete the record", || async {
        records.delete_one(doc! { "_id": t }).await
    })
    .await
    .map_err(|e| TxnError::database(Some(t), "delete the record", e))?;
    env.point(Some(t), after, 0)
}

/// Moves transaction `t` out of the pending state to `to` (see [`hold::leave_pending`]).
pub(crate) async fn leave_pending(
    env: &Env,
    t: ObjectId,
    to: TxnState,
    extra: Document,
) -> mongodb::error::Result<bool> {
    let records = env
        .store
        .protocol_collection(env.store.transactions_collection())
        .await?;
    hold::leave_pending(&records, t, to, extra).await
}

/// Reads a record.
pub(crate) async fn load(env: &Env, t: ObjectId) -> Result<Option<ActiveTransaction>, TxnError> {
    let stored = env
        .records(Some(t))
        .await?
        .find_one(doc! { "_id": t })
        .await
        .map_err(|e| TxnError::database(Some(t), "read the record", e))?;
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
    /// Its record is gone: it already ended.
    Gone,
    /// Its deadline has not passed; it may still be working.
    NotExpired,
    /// It had committed; its documents were freed.
    Finished,
    /// It had not committed; its applied changes were undone.
    RolledBack,
}

/// Finishes or rolls back transaction `t` if its deadline is at or before `now` (server time).
///
/// A pending transaction is first aborted with a write conditional on it being still pending:
/// the coordinator's commit point is conditional on the same thing, so exactly one of the two wins.
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
                tracing::info!(txn = %t, entries = txn.entries.len(), "rolled back aborted transaction");
                return Ok(Resolution::RolledBack);
            }
            TxnState::Pending => {
                env.point(Some(t), failpoint::GC_CLAIM_BEFORE, 0)?;
                let aborted = leave_pending(
                    env,
                    t,
                    TxnState::Aborted,
                    doc! { hold::record::DEADLINE: { "$lte": now } },
                )
                .await
                .map_err(|e| TxnError::database(Some(t), "abort the expired transaction", e))?;
                env.point(Some(t), failpoint::GC_CLAIM_AFTER, 0)?;
                if aborted {
                    rollback_all(env, &txn, COLLECTOR).await?;
                    tracing::info!(txn = %t, entries = txn.entries.len(), "aborted and rolled back expired transaction");
                    return Ok(Resolution::RolledBack);
                }
                // The coordinator reached its commit point (or another party aborted it) in
                // between: look again.
            }
        }
    }
    Ok(Resolution::NotExpired)
}
