//! Finishing and rolling back whole transactions from their records, shared by the coordinator
//! and the GC.
//!
//! Every write here is conditional on the document still being held by the transaction, so
//! running the same step twice, or from two processes at once, changes a document at most once.
//! No step needs to look at anything but the record's entries: the entry says how to finish or
//! undo its document, and is the same description the document's own hold carries.

use std::time::Duration;

use bson::{doc, oid::ObjectId, DateTime, Document};
use futures::future::join_all;
use mongodb::Collection;

use crate::repo::hold::{self, TxnState, TxnStatus};
use crate::repo::resolve;
use crate::repo::staging;
use crate::repo::store::Store;
use crate::repo::write::{self, Write};
use crate::server::is_transient;
use crate::txn::error::TxnError;
use crate::txn::failpoint::{self, Faults};
use crate::txn::worklist::ActiveTransaction;

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

    /// Passes failpoint `name` for steps `0..n` in order, as a process sending `n` writes at once
    /// does: a crash at one stops it and every later one (a dead process sends nothing more).
    /// Returns how many passed, and the crash.
    pub(crate) fn points(
        &self,
        txn: Option<ObjectId>,
        name: &'static str,
        n: usize,
    ) -> (usize, Option<TxnError>) {
        for step in 0..n {
            if let Err(crash) = self.point(txn, name, step) {
                return (step, Some(crash));
            }
        }
        (n, None)
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
pub(crate) async fn retry_transient<T, F, Fut>(what: &str, op: F) -> mongodb::error::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = mongodb::error::Result<T>>,
{
    retry_transient_after(None, what, op).await
}

/// As [`retry_transient`], when the first send (`first`, its result) was made already, in a
/// round with others.
async fn retry_transient_after<T, F, Fut>(
    first: Option<mongodb::error::Result<T>>,
    what: &str,
    mut op: F,
) -> mongodb::error::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = mongodb::error::Result<T>>,
{
    let mut result = match first {
        Some(sent) => sent,
        None => op().await,
    };
    let mut attempt = 0;
    loop {
        match result {
            Err(e) if is_transient(&e) && attempt < TRANSIENT_RETRIES => {
                attempt += 1;
                tracing::debug!(what, attempt, error = %e, "retrying after a transient error");
                tokio::time::sleep(Duration::from_millis(10 << attempt)).await;
                result = op().await;
            }
            other => return other,
        }
    }
}

/// Runs one round of recovery writes for transaction `t`, one per entry (its finish or its
/// undo): sent together (one message where the server allows it: see `write::run_together`) once
/// each entry's `before` failpoint has passed (see [`Env::points`]), then each settled by
/// `settle` (given its index and the result of that first send) and passed through its `after`
/// failpoint. A crash before the round ends it once the writes before it have settled.
async fn run_round<F, Fut>(
    env: &Env,
    t: ObjectId,
    (before, after): (&'static str, &'static str),
    writes: &[(Collection<Document>, Write)],
    settle: F,
) -> Result<(), TxnError>
where
    F: Fn(usize, mongodb::error::Result<u64>) -> Fut,
    Fut: std::future::Future<Output = Result<(), TxnError>>,
{
    let (passed, crash) = env.points(Some(t), before, writes.len());
    let sent = write::run_together(&env.store, &writes[..passed]).await;
    let settled = join_all(sent.into_iter().enumerate().map(|(i, first)| {
        let work = settle(i, first);
        async move {
            work.await?;
            env.point(Some(t), after, i)
        }
    }))
    .await;
    if let Some(crash) = crash {
        return Err(crash);
    }
    settled.into_iter().collect()
}

/// Frees every document of a committed transaction (one round of writes), then deletes its
/// record. A delete becomes a tombstone.
pub(crate) async fn finish_all(
    env: &Env,
    txn: &ActiveTransaction,
    role: Role,
) -> Result<(), TxnError> {
    let t = txn.id;
    let fail = |e| TxnError::database(Some(t), "finish", e);
    let mut writes = Vec::with_capacity(txn.entries.len());
    for entry in &txn.entries {
        let coll = env.collection(Some(t), &entry.coll).await?;
        let write = if entry.deletes() {
            let filter = hold::applied_by(&entry.id, t);
            env.store
                .tombstone_write(coll.name(), filter, &entry.id, entry.schema, entry.applied)
                .await
                .map_err(fail)?
        } else {
            entry.finish(t)
        };
        writes.push((coll, write));
    }
    run_round(env, t, role.finish, &writes, |i, first| {
        let (entry, (coll, write)) = (&txn.entries[i], &writes[i]);
        async move {
            if !entry.deletes() {
                retry_transient_after(Some(first), "finish", || write::run(coll, write))
                    .await
                    .map_err(fail)?;
                return Ok(());
            }
            // A tombstone is made anew for each send (the unique-index markers may change).
            let filter = hold::applied_by(&entry.id, t);
            let (id, schema, version) = (&entry.id, entry.schema, entry.applied);
            let first = env
                .store
                .after_tombstone(coll, filter.clone(), id, schema, version, first)
                .await;
            retry_transient_after(Some(first), "finish", || {
                env.store
                    .write_tombstone(coll, filter.clone(), id, schema, version)
            })
            .await
            .map_err(fail)?;
            Ok(())
        }
    })
    .await?;
    end(env, t, role.end, Deletion::Now).await.map(|_| ())
}

/// When the record of a transaction that did not commit may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Deletion {
    /// Right away: no copy of the record can still be on its way (its coordinator got an answer
    /// to every send), or it committed.
    Now,
    /// Once the server's clock has passed its deadline, after which no late copy of it can be
    /// created as staging; until then it stays, aborted, and a GC round deletes it later.
    AfterDeadline,
}

/// Undoes every applied entry (and any fence) of a transaction that did not commit (one round
/// of writes), then deletes its record as `deletion` allows; says whether the record is gone.
///
/// Each entry's undo puts back its own apply. One that matches nothing finds whatever hold of
/// the transaction is there (a fence, or a late copy of the apply) and undoes it from the hold
/// the document carries.
pub(crate) async fn rollback_all(
    env: &Env,
    txn: &ActiveTransaction,
    role: Role,
    deletion: Deletion,
) -> Result<bool, TxnError> {
    let t = txn.id;
    let mut writes = Vec::with_capacity(txn.entries.len());
    for entry in &txn.entries {
        let coll = env.collection(Some(t), &entry.coll).await?;
        writes.push((coll, entry.rollback(t, txn.deadline)));
    }
    run_round(env, t, role.rollback, &writes, |i, first| {
        let (entry, (coll, undo)) = (&txn.entries[i], &writes[i]);
        async move {
            let undone = retry_transient_after(Some(first), "rollback", || write::run(coll, undo))
                .await
                .map_err(|e| TxnError::database(Some(t), "rollback", e))?;
            if undone == 0 {
                resolve::roll_back(&env.store, &entry.coll, &entry.id, t)
                    .await
                    .map_err(|source| TxnError::hold(Some(t), &entry.coll, &entry.id, t, source))?;
            }
            Ok(())
        }
    })
    .await?;
    end(env, t, role.rollback_end, deletion).await
}

async fn end(
    env: &Env,
    t: ObjectId,
    (before, after): (&'static str, &'static str),
    deletion: Deletion,
) -> Result<bool, TxnError> {
    env.point(Some(t), before, 0)?;
    let records = env.records(Some(t)).await?;
    let filter = match deletion {
        Deletion::Now => doc! { "_id": t },
        Deletion::AfterDeadline => doc! {
            "_id": t,
            "$expr": { "$gt": ["$$NOW", format!("${}", hold::record::DEADLINE)] },
        },
    };
    retry_transient("delete the record", || async {
        records.delete_one(filter.clone()).await
    })
    .await
    .map_err(|e| TxnError::database(Some(t), "delete the record", e))?;
    env.point(Some(t), after, 0)?;
    match deletion {
        Deletion::Now => Ok(true),
        // A lost reply of a delete that landed reads as "not deleted" on the resend: ask.
        Deletion::AfterDeadline => Ok(load(env, t).await?.is_none()),
    }
}

/// Moves staging transaction `t` to `to` (see [`hold::leave_staging`]).
pub(crate) async fn leave_staging(
    env: &Env,
    t: ObjectId,
    to: TxnState,
    extra: Document,
) -> mongodb::error::Result<bool> {
    let records = env
        .store
        .protocol_collection(env.store.transactions_collection())
        .await?;
    hold::leave_staging(&records, t, to, extra).await
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
/// A staging transaction is first decided: committed if every participant is in place, else a
/// missing one is fenced and it is aborted (see `repo::staging`). An aborted record stays until
/// the server's clock passes its deadline.
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
                if !rollback_all(env, &txn, COLLECTOR, Deletion::AfterDeadline).await? {
                    // Undone; the record waits for the server's clock to pass its deadline.
                    return Ok(Resolution::NotExpired);
                }
                tracing::info!(txn = %t, entries = txn.entries.len(), "rolled back aborted transaction");
                return Ok(Resolution::RolledBack);
            }
            TxnState::Staging => {
                let Some(found) = staging::load(&env.store, t)
                    .await
                    .map_err(|source| TxnError::Resolve { txn: t, source })?
                else {
                    return Ok(Resolution::Gone);
                };
                let point = |name: &'static str, step: usize| {
                    let name = match name {
                        staging::FENCE_BEFORE => failpoint::GC_FENCE_BEFORE,
                        staging::FENCE_AFTER => failpoint::GC_FENCE_AFTER,
                        staging::DECIDE_BEFORE => failpoint::GC_CLAIM_BEFORE,
                        _ => failpoint::GC_CLAIM_AFTER,
                    };
                    env.point(Some(t), name, step)
                };
                let decided = staging::decide_expired(&env.store, t, &found, &point, &|source| {
                    TxnError::Resolve { txn: t, source }
                })
                .await?;
                if matches!(decided, TxnStatus::Pending { .. }) {
                    // A participant is held by another live transaction: next round.
                    return Ok(Resolution::NotExpired);
                }
                // Decided (by us or meanwhile): look again and act on it.
            }
        }
    }
    Ok(Resolution::NotExpired)
}
