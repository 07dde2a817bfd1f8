//! Finishing and rolling back whole transactions from their records, shared by the coordinator
//! and the GC.
//!
//! Every write here is conditional on the document still being held by the transaction, so
//! running the same step twice, or from two processes at once, changes a document at most once.
//! No step needs to look at anything but the record's entries: the entry says how to finish or
//! undo its document, and is the same description the document's own hold carries.

use std::time::Duration;

use std::collections::HashSet;

use bson::{doc, oid::ObjectId, DateTime, Document};
use futures::future::join_all;
use futures::TryStreamExt;
use mongodb::Collection;

use crate::repo::format;
use crate::repo::hold::held;
use crate::repo::hold::record::{self, TxnState};
use crate::repo::hold::resolve;
use crate::repo::hold::tombstone;
use crate::repo::hold::write::{self, Write};
use crate::repo::store::Store;
use crate::retry::LockWait;
use crate::retry::Retry;
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
        #[cfg(feature = "testkit")]
        return self
            .faults
            .check(name, step)
            .map_err(|at| TxnError::Crashed { txn, at });
        // Without the test rig no injector can be installed: every point passes.
        #[cfg(not(feature = "testkit"))]
        {
            let _ = (&self.faults, txn, name, step);
            Ok(())
        }
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

/// The pauses between those retries: 20, 40, 80, 160 ms (jittered down to half).
const TRANSIENT_PACE: LockWait = LockWait {
    max_wait: Duration::MAX,
    initial_backoff: Duration::from_millis(20),
    max_backoff: Duration::from_millis(160),
};

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
    let mut pace = Retry::tries(TRANSIENT_PACE, TRANSIENT_RETRIES + 1);
    loop {
        match result {
            Err(e) if is_transient(&e) && !pace.exhausted() => {
                let attempt = pace.pauses() + 1;
                tracing::debug!(what, attempt, error = %e, "retrying after a transient error");
                pace.pause().await;
                result = op().await;
            }
            other => return other,
        }
    }
}

/// The writes of one recovery round, for one or many transactions: each transaction's writes
/// are a contiguous span of `writes`, in the order of `txns`.
struct Round<'a> {
    txns: Vec<&'a ActiveTransaction>,
    writes: Vec<(Collection<Document>, Write)>,
    /// For each write: the index of its transaction in `txns` and of its entry in that one.
    owner: Vec<(usize, usize)>,
}

impl<'a> Round<'a> {
    /// One write per entry of each of `txns`, made by `make`. A transaction one of whose writes
    /// cannot be made is left out of the round whole, with that error in the results returned
    /// beside it (one per transaction of `txns`).
    async fn build<F, Fut>(
        txns: &[&'a ActiveTransaction],
        make: F,
    ) -> (Round<'a>, Vec<Result<(), TxnError>>)
    where
        F: Fn(&'a ActiveTransaction, &'a Entry) -> Fut,
        Fut: std::future::Future<Output = Result<(Collection<Document>, Write), TxnError>>,
    {
        let mut round = Round {
            txns: Vec::with_capacity(txns.len()),
            writes: Vec::new(),
            owner: Vec::new(),
        };
        let mut each = Vec::with_capacity(txns.len());
        'txns: for txn in txns {
            let mut made = Vec::with_capacity(txn.entries.len());
            for entry in &txn.entries {
                match make(txn, entry).await {
                    Ok(write) => made.push(write),
                    Err(e) => {
                        each.push(Err(e));
                        continue 'txns;
                    }
                }
            }
            let k = round.txns.len();
            round.txns.push(txn);
            round.owner.extend((0..made.len()).map(|step| (k, step)));
            round.writes.extend(made);
            each.push(Ok(()));
        }
        (round, each)
    }
}

/// What a round did for each of its transactions, and the injected crash that ended it early.
struct Settled {
    /// Per transaction: `Ok` if every write of it was sent and settled.
    each: Vec<Result<(), TxnError>>,
    crash: Option<TxnError>,
}

/// Runs one round of recovery writes (a finish or an undo per entry, for every transaction of
/// `round`): each write's `before` failpoint in order, transaction by transaction (see
/// [`Env::points`]; a crash stops that write and every later one, as a dead process sends
/// nothing more), then the writes that passed sent together (one message where the server
/// allows it: see `write::run_together`), then each settled by `settle` (given its index and the
/// result of that first send) and passed through its `after` failpoint.
async fn run_round<F, Fut>(
    env: &Env,
    (before, after): (&'static str, &'static str),
    round: &Round<'_>,
    settle: F,
) -> Settled
where
    F: Fn(usize, mongodb::error::Result<u64>) -> Fut,
    Fut: std::future::Future<Output = Result<(), TxnError>>,
{
    let mut each: Vec<Result<(), TxnError>> = round.txns.iter().map(|_| Ok(())).collect();
    let mut passed = 0;
    let mut crash = None;
    for (k, txn) in round.txns.iter().enumerate() {
        let n = round.owner.iter().filter(|(owner, _)| *owner == k).count();
        let (through, crashed) = env.points(Some(txn.id), before, n);
        passed += through;
        if let Some(crashed) = crashed {
            // This transaction and every later one are left for whoever comes next.
            // A crashed handle stops at every later point too, with the same failpoint.
            for left in each.iter_mut().skip(k) {
                if let Err(crash) = env.point(Some(txn.id), before, 0) {
                    *left = Err(crash);
                }
            }
            crash = Some(crashed);
            break;
        }
    }
    let sent = write::run_together(&env.store, &round.writes[..passed]).await;
    let settled = join_all(sent.into_iter().enumerate().map(|(i, first)| {
        let work = settle(i, first);
        let (k, step) = round.owner[i];
        let t = round.txns[k].id;
        async move {
            work.await?;
            env.point(Some(t), after, step)
        }
    }))
    .await;
    for (i, result) in settled.into_iter().enumerate() {
        if let Err(e) = result {
            let k = round.owner[i].0;
            if e.is_crash() && crash.is_none() {
                crash = Some(e);
                continue;
            }
            if each[k].is_ok() {
                each[k] = Err(e);
            }
        }
    }
    Settled { each, crash }
}

/// Frees every document of a committed transaction (one round of writes), then deletes its
/// record. A delete becomes a tombstone.
pub(crate) async fn finish_all(
    env: &Env,
    txn: &ActiveTransaction,
    role: Role,
) -> Result<(), TxnError> {
    one(finish_many(env, &[txn], role).await)
}

/// The single result of a batch of one.
fn one(done: Result<Vec<Result<(), TxnError>>, TxnError>) -> Result<(), TxnError> {
    done?.into_iter().next().unwrap_or(Ok(()))
}

/// Frees every document of each committed transaction of `txns`, all in one round of writes,
/// then deletes their records in one command. Returns each transaction's result; `Err` only
/// for an injected crash (after what went before it was done).
pub(crate) async fn finish_many(
    env: &Env,
    txns: &[&ActiveTransaction],
    role: Role,
) -> Result<Vec<Result<(), TxnError>>, TxnError> {
    let (round, each) = Round::build(txns, |txn, entry| async move {
        let t = txn.id;
        let coll = env.collection(Some(t), &entry.coll).await?;
        let write = if entry.deletes() {
            let filter = held::applied_by(&entry.id, t);
            tombstone::tombstone_write(
                &env.store,
                coll.name(),
                filter,
                &entry.id,
                entry.schema,
                entry.applied,
            )
            .await
            .map_err(|e| TxnError::database(Some(t), "finish", e))?
        } else {
            entry.finish(t)
        };
        Ok((coll, write))
    })
    .await;
    let settled = run_round(env, role.finish, &round, |i, first| {
        let (k, step) = round.owner[i];
        let t = round.txns[k].id;
        let entry = &round.txns[k].entries[step];
        let (coll, write) = &round.writes[i];
        let fail = move |e| TxnError::database(Some(t), "finish", e);
        async move {
            if !entry.deletes() {
                retry_transient_after(Some(first), "finish", || write::run(coll, write))
                    .await
                    .map_err(fail)?;
                return Ok(());
            }
            // A tombstone is made anew for each send (the unique-index markers may change).
            let filter = held::applied_by(&entry.id, t);
            let (id, schema, version) = (&entry.id, entry.schema, entry.applied);
            let first = tombstone::after_tombstone(
                &env.store,
                coll,
                filter.clone(),
                id,
                schema,
                version,
                first,
            )
            .await;
            retry_transient_after(Some(first), "finish", || {
                tombstone::write_tombstone(&env.store, coll, filter.clone(), id, schema, version)
            })
            .await
            .map_err(fail)?;
            Ok(())
        }
    })
    .await;
    let ended = conclude(env, txns, each, settled, role.end, Deletion::Now).await?;
    Ok(ended.into_iter().map(|r| r.map(|_| ())).collect())
}

/// Each transaction's result: its error from building its writes, or else what its round did
/// (the round holds exactly the transactions whose writes were built, in order).
fn merge(
    before: Vec<Result<(), TxnError>>,
    settled: Vec<Result<(), TxnError>>,
) -> Vec<Result<(), TxnError>> {
    let mut settled = settled.into_iter();
    before
        .into_iter()
        .map(|earlier| earlier.and_then(|()| settled.next().unwrap_or(Ok(()))))
        .collect()
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
    rollback_many(env, &[txn], role, deletion)
        .await?
        .into_iter()
        .next()
        .unwrap_or(Ok(false))
}

/// [`rollback_all`] for each of `txns`, all in one round of writes and one command for the
/// records. Returns each transaction's result; `Err` only for an injected crash.
pub(crate) async fn rollback_many(
    env: &Env,
    txns: &[&ActiveTransaction],
    role: Role,
    deletion: Deletion,
) -> Result<Vec<Result<bool, TxnError>>, TxnError> {
    let (round, each) = Round::build(txns, |txn, entry| async move {
        let coll = env.collection(Some(txn.id), &entry.coll).await?;
        Ok((coll, entry.rollback(txn.id, txn.deadline)))
    })
    .await;
    let settled = run_round(env, role.rollback, &round, |i, first| {
        let (k, step) = round.owner[i];
        let t = round.txns[k].id;
        let entry = &round.txns[k].entries[step];
        let (coll, undo) = &round.writes[i];
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
    .await;
    conclude(env, txns, each, settled, role.rollback_end, deletion).await
}

/// After a round: each transaction's result (an error from building its writes, or what the
/// round did), then, unless an injected crash ended the round, the records of those that went
/// through deleted as `deletion` allows (see [`end_many`]).
async fn conclude(
    env: &Env,
    txns: &[&ActiveTransaction],
    before: Vec<Result<(), TxnError>>,
    settled: Settled,
    names: (&'static str, &'static str),
    deletion: Deletion,
) -> Result<Vec<Result<bool, TxnError>>, TxnError> {
    let each = merge(before, settled.each);
    if let Some(crash) = settled.crash {
        return Err(crash);
    }
    end_many(env, txns, each, names, deletion).await
}

/// Deletes the records of those of `txns` whose result in `each` is `Ok`, in one command, as
/// `deletion` allows (each passing its failpoints in order); returns for each whether its
/// record is gone, or its earlier error. `Err` only for an injected crash.
async fn end_many(
    env: &Env,
    txns: &[&ActiveTransaction],
    each: Vec<Result<(), TxnError>>,
    (before, after): (&'static str, &'static str),
    deletion: Deletion,
) -> Result<Vec<Result<bool, TxnError>>, TxnError> {
    let mut ending: Vec<ObjectId> = Vec::new();
    let mut crash = None;
    for (txn, result) in txns.iter().zip(&each) {
        if result.is_err() {
            continue;
        }
        if let Err(crashed) = env.point(Some(txn.id), before, 0) {
            crash = Some(crashed);
            break;
        }
        ending.push(txn.id);
    }
    let mut gone: HashSet<ObjectId> = HashSet::new();
    let mut failed = None;
    if !ending.is_empty() {
        match delete_records(env, &ending, deletion).await {
            Ok(deleted) => gone = deleted,
            Err(e) => failed = Some(e),
        }
    }
    if failed.is_none() {
        for t in &ending {
            env.point(Some(*t), after, 0)?;
        }
    }
    if let Some(crash) = crash {
        return Err(crash);
    }
    Ok(txns
        .iter()
        .zip(each)
        .map(|(txn, result)| {
            result?;
            match &failed {
                Some(e) if ending.contains(&txn.id) => Err(TxnError::database(
                    Some(txn.id),
                    "delete the record",
                    e.clone(),
                )),
                _ => Ok(gone.contains(&txn.id)),
            }
        })
        .collect())
}

/// Deletes the records `ts` (for [`Deletion::AfterDeadline`], those whose deadline the server's
/// clock has passed) and returns those that are gone.
async fn delete_records(
    env: &Env,
    ts: &[ObjectId],
    deletion: Deletion,
) -> mongodb::error::Result<HashSet<ObjectId>> {
    let records = env
        .store
        .protocol_collection(env.store.transactions_collection())
        .await?;
    let mut filter = doc! { "_id": { "$in": ts.to_vec() } };
    if deletion == Deletion::AfterDeadline {
        filter.extend(record::past_deadline());
    }
    retry_transient("delete the records", || async {
        if ts.len() == 1 {
            records.delete_one(filter.clone()).await
        } else {
            records.delete_many(filter.clone()).await
        }
    })
    .await?;
    match deletion {
        Deletion::Now => Ok(ts.iter().copied().collect()),
        // A lost reply of a delete that landed reads as "not deleted" on the resend: ask.
        Deletion::AfterDeadline => {
            let left: Vec<Document> = records
                .find(doc! { "_id": { "$in": ts.to_vec() } })
                .projection(doc! { "_id": 1 })
                .await?
                .try_collect()
                .await?;
            let left: HashSet<ObjectId> = left
                .iter()
                .filter_map(|d| d.get_object_id("_id").ok())
                .collect();
            Ok(ts.iter().copied().filter(|t| !left.contains(t)).collect())
        }
    }
}

/// Moves staging transaction `t` to `to` (see [`record::leave_staging`]).
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
    record::leave_staging(&records, t, to, extra, env.store.reads_format()).await
}

/// Reads a record.
pub(crate) async fn load(env: &Env, t: ObjectId) -> Result<Option<ActiveTransaction>, TxnError> {
    let stored = env
        .records(Some(t))
        .await?
        .find_one(doc! { "_id": t })
        .await
        .map_err(|e| TxnError::database(Some(t), "read the record", e))?;
    if let Some(found) = &stored {
        let records = env.store.transactions_collection();
        format::check_doc(found, env.store.reads_format(), records)?;
    }
    stored
        .map(|d| {
            bson::from_document::<ActiveTransaction>(d).map_err(|e| TxnError::Malformed {
                txn: t,
                reason: e.to_string(),
            })
        })
        .transpose()
}
