//! Multi-document transactions on single-document atomic writes: staging, the commit protocol,
//! active rollback, and a helper that reruns a transaction body on retryable errors.
//!
//! Commit writes the ActiveTransaction document (the worklist with everything needed to finish or
//! undo each entry), applies every entry conditionally and concurrently, flips the transaction to
//! committed with one conditional write (the commit point), frees every document concurrently, and
//! deletes the ActiveTransaction document: 2k + 3 writes for k documents.
//!
//! Lock order: applies first run concurrently without waiting. If any document is held by another
//! live transaction, everything applied is rolled back and the commit runs again in ordered mode,
//! acquiring documents one by one in (collection, id) order and waiting (bounded) for holders.
//! Transactions that wait only ever wait for documents later in the order than all they hold, and
//! transactions that hold out of order never wait, so no cycle of waits can form.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use futures::future::join_all;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::changes::{Adjust, Update};
use crate::error::{is_transient, show_id, RepoError, TxnError};
use crate::failpoint::{self, FaultInjector, Faults};
use crate::fields::{self, SystemFields};
use crate::hold::LockWait;
use crate::probe;
use crate::recovery::{self, Env, Resolution, COORDINATOR};
use crate::repository::Repository;
use crate::store::Store;
use crate::worklist::{
    lock_key, undo_for, ActiveTransaction, Entry, Op, PathValue, TxnState, Write,
};

/// When the coordinator frees the documents of a committed transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Finish {
    /// Free every document before `commit` returns.
    #[default]
    BeforeReturning,
    /// Return once the commit point is written and free the documents in a background task
    /// (readers already see the committed values; a GC finishes the job if the process dies).
    InBackground,
}

/// Settings of a [`Transactions`] handle.
#[derive(Clone)]
pub struct TxnOptions {
    /// How long a transaction may take before a GC may roll it back (or finish it).
    pub timeout: Duration,
    /// When documents are freed after the commit point.
    pub finish: Finish,
    /// How [`Transactions::run`] retries: `max_wait` is the overall deadline.
    pub retry: LockWait,
    faults: Option<Arc<dyn FaultInjector>>,
}

impl Default for TxnOptions {
    fn default() -> TxnOptions {
        TxnOptions {
            timeout: Duration::from_secs(30),
            finish: Finish::default(),
            retry: LockWait {
                max_wait: Duration::from_secs(10),
                initial_backoff: Duration::from_millis(2),
                max_backoff: Duration::from_millis(100),
            },
            faults: None,
        }
    }
}

impl std::fmt::Debug for TxnOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxnOptions")
            .field("timeout", &self.timeout)
            .field("finish", &self.finish)
            .field("retry", &self.retry)
            .field("faults", &self.faults.is_some())
            .finish()
    }
}

impl TxnOptions {
    /// Sets how long a transaction may take before a GC may resolve it.
    pub fn timeout(mut self, timeout: Duration) -> TxnOptions {
        self.timeout = timeout;
        self
    }

    /// Sets when documents are freed after the commit point.
    pub fn finish(mut self, finish: Finish) -> TxnOptions {
        self.finish = finish;
        self
    }

    /// Sets how [`Transactions::run`] retries.
    pub fn retry(mut self, retry: LockWait) -> TxnOptions {
        self.retry = retry;
        self
    }

    /// Installs a fault injector (tests): the coordinator stops at the points it chooses.
    pub fn fault_injector(mut self, injector: Arc<dyn FaultInjector>) -> TxnOptions {
        self.faults = Some(injector);
        self
    }
}

/// What a document looks like after a committed transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct Written {
    /// Collection name.
    pub collection: String,
    /// Document id.
    pub id: Bson,
    /// Its version now (unchanged for a check; the tombstone's for a delete).
    pub version: i64,
}

/// The result of a committed transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The transaction id (`None` when nothing was staged and nothing written).
    pub txn: Option<ObjectId>,
    /// Each staged document, in lock order.
    pub written: Vec<Written>,
    /// Whether every document was freed before returning.
    pub finished: bool,
}

impl Outcome {
    /// The new version of document `id` in `collection`, if the transaction staged it.
    pub fn version_of(&self, collection: &str, id: impl Into<Bson>) -> Option<i64> {
        let id = id.into();
        self.written
            .iter()
            .find(|w| w.collection == collection && w.id == id)
            .map(|w| w.version)
    }
}

/// Begins and runs transactions on one store. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Transactions {
    store: Store,
    env: Env,
    options: Arc<TxnOptions>,
}

impl Transactions {
    /// Transactions on `store` with default options.
    pub fn new(store: &Store) -> Transactions {
        Transactions::with_options(store, TxnOptions::default())
    }

    /// Transactions on `store` with `options`.
    pub fn with_options(store: &Store, options: TxnOptions) -> Transactions {
        let faults = Faults::new(options.faults.clone());
        Transactions {
            env: Env::new(
                store.database().clone(),
                store.transactions_collection(),
                faults,
            ),
            store: store.clone(),
            options: Arc::new(options),
        }
    }

    /// The options in force.
    pub fn options(&self) -> &TxnOptions {
        &self.options
    }

    /// A new, empty transaction.
    pub fn begin(&self) -> Transaction {
        Transaction {
            txns: self.clone(),
            entries: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// Runs `body` on a fresh transaction and commits what it staged; reruns both on retryable
    /// errors (conflicts, holds, expiry) with jittered backoff until `options.retry.max_wait`
    /// has passed. The body gets a handle to stage on; it must not commit it itself.
    pub async fn run<R, F, Fut>(&self, mut body: F) -> Result<(R, Outcome), TxnError>
    where
        F: FnMut(Transaction) -> Fut,
        Fut: Future<Output = Result<R, TxnError>>,
    {
        let started = Instant::now();
        let mut attempts = 0_u32;
        loop {
            attempts += 1;
            let tx = self.begin();
            let result = match body(tx.clone()).await {
                Ok(value) => tx.commit().await.map(|outcome| (value, outcome)),
                Err(e) => Err(e),
            };
            match result {
                Err(e) if e.is_retryable() => {
                    let elapsed = started.elapsed();
                    if elapsed >= self.options.retry.max_wait {
                        return Err(TxnError::GaveUp {
                            attempts,
                            elapsed,
                            last: Box::new(e),
                        });
                    }
                    tracing::debug!(attempts, error = %e, "retrying transaction");
                    tokio::time::sleep(self.options.retry.backoff(attempts.saturating_sub(1)))
                        .await;
                }
                other => return other,
            }
        }
    }
}

/// A transaction being staged: add actions, then [`commit`](Transaction::commit). Clones are
/// handles on the same transaction.
#[derive(Debug, Clone)]
pub struct Transaction {
    txns: Transactions,
    entries: Arc<Mutex<Vec<Entry>>>,
}

/// How an apply ended.
enum Applied {
    Yes,
    Blocked(ObjectId),
    Failed(RepoError),
}

/// What the document says about an apply that matched nothing.
enum Diagnosis {
    Landed,
    Retry,
    TakePlaceholder,
    Held(ObjectId),
    Fail(RepoError),
}

impl Transaction {
    /// How many documents are staged.
    pub fn len(&self) -> usize {
        self.staged().len()
    }

    /// Whether nothing is staged.
    pub fn is_empty(&self) -> bool {
        self.staged().is_empty()
    }

    fn staged(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        // Never held across an await; a panic while staging leaves a usable list.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stages the insert of a new document; returns its id (generated if the value has none).
    pub async fn insert<T>(&self, repo: &Repository<T>, value: &T) -> Result<Bson, TxnError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        let (id, doc) = repo.prepare_insert(value)?;
        let shown = show_id(&id);
        let mut check = doc.clone();
        repo.stamp(&mut check, crate::FIRST_VERSION);
        repo.validate(&shown, &check)?;
        self.push(Entry {
            coll: repo.name().to_string(),
            id: id.clone(),
            expected: 0,
            applied: crate::FIRST_VERSION,
            schema: repo.spec().schema_version(),
            op: Op::Insert { doc },
        })?;
        Ok(id)
    }

    /// Stages setting and unsetting fields of the document at `expected_version`.
    pub async fn update<T>(
        &self,
        repo: &Repository<T>,
        id: impl Into<Bson>,
        expected_version: i64,
        update: &Update,
    ) -> Result<(), TxnError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        let id = id.into();
        let shown = show_id(&id);
        repo.check_write(&id, expected_version)?;
        repo.check_update(&shown, update)?;
        let (stored, sys) = read_for_change(repo, &id, &shown, expected_version).await?;
        let op = if sys.schema_version < repo.spec().schema_version() {
            let mut post = repo.upgrade(&shown, stored.clone(), sys.schema_version)?;
            update
                .apply_to(&mut post)
                .map_err(|v| repo.invalid(&shown, v))?;
            rewrite(repo, &shown, expected_version, post, stored)?
        } else {
            Op::Update {
                set: pairs(update.sets()),
                unset: update.unsets().to_vec(),
                undo: undo_for(&stored, update.paths()),
            }
        };
        self.push(Entry {
            coll: repo.name().to_string(),
            id,
            expected: expected_version,
            applied: expected_version + 1,
            schema: repo.spec().schema_version(),
            op,
        })
    }

    /// Stages numeric increments of the document at `expected_version`.
    pub async fn adjust<T>(
        &self,
        repo: &Repository<T>,
        id: impl Into<Bson>,
        expected_version: i64,
        adjust: &Adjust,
    ) -> Result<(), TxnError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        let id = id.into();
        let shown = show_id(&id);
        repo.check_write(&id, expected_version)?;
        repo.check_adjust(&shown, adjust)?;
        let (stored, sys) = read_for_change(repo, &id, &shown, expected_version).await?;
        let op = if sys.schema_version < repo.spec().schema_version() {
            let mut post = repo.upgrade(&shown, stored.clone(), sys.schema_version)?;
            adjust
                .apply_to(&mut post)
                .map_err(|v| repo.invalid(&shown, v))?;
            rewrite(repo, &shown, expected_version, post, stored)?
        } else {
            Op::Adjust {
                inc: pairs(adjust.increments()),
                undo: undo_for(&stored, adjust.increments().iter().map(|(p, _)| p.as_str())),
            }
        };
        self.push(Entry {
            coll: repo.name().to_string(),
            id,
            expected: expected_version,
            applied: expected_version + 1,
            schema: repo.spec().schema_version(),
            op,
        })
    }

    /// Stages the deletion of the document at `expected_version` (a tombstone once committed).
    pub fn delete<T>(
        &self,
        repo: &Repository<T>,
        id: impl Into<Bson>,
        expected_version: i64,
    ) -> Result<(), TxnError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        let id = id.into();
        repo.check_write(&id, expected_version)?;
        self.push(Entry {
            coll: repo.name().to_string(),
            id,
            expected: expected_version,
            applied: expected_version + 1,
            schema: repo.spec().schema_version(),
            op: Op::Delete,
        })
    }

    /// Stages a check: the document must still be at `expected_version` at commit, and is held
    /// unchanged until the transaction ends (read validation).
    pub fn check<T>(
        &self,
        repo: &Repository<T>,
        id: impl Into<Bson>,
        expected_version: i64,
    ) -> Result<(), TxnError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        let id = id.into();
        repo.check_write(&id, expected_version)?;
        self.push(Entry {
            coll: repo.name().to_string(),
            id,
            expected: expected_version,
            applied: expected_version,
            schema: repo.spec().schema_version(),
            op: Op::Check,
        })
    }

    fn push(&self, entry: Entry) -> Result<(), TxnError> {
        let mut entries = self.staged();
        if entries
            .iter()
            .any(|e| e.coll == entry.coll && e.id == entry.id)
        {
            return Err(TxnError::DuplicateEntry {
                collection: entry.coll,
                id: show_id(&entry.id),
            });
        }
        entries.push(entry);
        Ok(())
    }

    /// Commits: all staged changes become visible together, or none does.
    pub async fn commit(self) -> Result<Outcome, TxnError> {
        let mut entries = std::mem::take(&mut *self.staged());
        let txns = self.txns;
        if entries.is_empty() {
            return Ok(Outcome {
                txn: None,
                written: Vec::new(),
                finished: true,
            });
        }
        entries.sort_by_key(lock_key);
        let mut ordered = false;
        loop {
            match txns.attempt(entries, ordered).await? {
                Attempt::Committed(outcome) => return Ok(outcome),
                // Ordered attempts wait for holders instead of reporting blocks, so this
                // switches to ordered mode once and never loops again.
                Attempt::Blocked(rebased) => {
                    entries = rebased;
                    ordered = true;
                }
            }
        }
    }
}

/// How one attempt at committing ended (errors are returned as `Err`).
enum Attempt {
    Committed(Outcome),
    /// Another live transaction held a document; everything was rolled back. The entries are
    /// rebased on the versions the rollback left.
    Blocked(Vec<Entry>),
}

impl Transactions {
    async fn attempt(&self, entries: Vec<Entry>, ordered: bool) -> Result<Attempt, TxnError> {
        let env = &self.env;
        let t = ObjectId::new();
        let now = DateTime::now();
        let timeout = i64::try_from(self.options.timeout.as_millis()).unwrap_or(i64::MAX);
        let txn = ActiveTransaction {
            id: t,
            state: TxnState::Pending,
            deadline: DateTime::from_millis(now.timestamp_millis().saturating_add(timeout)),
            created: now,
            entries,
        };
        let stored = bson::to_document(&txn).map_err(|e| TxnError::Malformed {
            txn: t,
            reason: e.to_string(),
        })?;

        env.point(Some(t), failpoint::BEGIN_BEFORE, 0)?;
        self.write_active_transaction(t, &stored).await?;
        env.point(Some(t), failpoint::BEGIN_AFTER, 0)?;

        let results: Vec<Result<Applied, TxnError>> = if ordered {
            let mut results = Vec::with_capacity(txn.entries.len());
            for (i, entry) in txn.entries.iter().enumerate() {
                let result = self.apply(t, txn.created, i, entry, true).await;
                let stop = !matches!(result, Ok(Applied::Yes));
                results.push(result);
                if stop {
                    break;
                }
            }
            results
        } else {
            join_all(
                txn.entries
                    .iter()
                    .enumerate()
                    .map(|(i, entry)| self.apply(t, txn.created, i, entry, false)),
            )
            .await
        };

        let mut failure: Option<TxnError> = None;
        let mut blocked = false;
        let mut landed = vec![false; txn.entries.len()];
        for (i, result) in results.into_iter().enumerate() {
            match result {
                Ok(Applied::Yes) => landed[i] = true,
                Ok(Applied::Blocked(holder)) => {
                    tracing::debug!(txn = %t, holder = %holder, "document held by another transaction");
                    blocked = true;
                }
                Ok(Applied::Failed(e)) => {
                    failure.get_or_insert(TxnError::document(Some(t), e));
                }
                Err(crash @ TxnError::Crashed { .. }) => return Err(crash),
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        if failure.is_some() || blocked {
            // A GC that claimed this transaction fences the entries it finds unapplied, so a
            // late apply fails; say what really happened rather than report the fence.
            let claimed = failure.is_some()
                && matches!(
                    recovery::load(env, t).await,
                    Ok(None)
                        | Ok(Some(ActiveTransaction {
                            state: TxnState::Aborted,
                            ..
                        }))
                );
            let undone = recovery::rollback_all(env, &txn, COORDINATOR).await?;
            if claimed {
                tracing::debug!(txn = %t, "claimed by a GC before its commit point; rolled back");
                return Err(TxnError::Expired { txn: t });
            }
            if let Some(error) = failure {
                tracing::debug!(txn = %t, error = %error, "rolled back");
                return Err(error);
            }
            tracing::debug!(txn = %t, "blocked by another transaction; retrying in lock order");
            // A rollback write whose reply was lost matches nothing when resent, so an entry
            // counts as undone if either its apply or its rollback is known to have landed.
            let rebased = txn
                .entries
                .iter()
                .zip(undone.into_iter().zip(landed))
                .map(|(entry, (undone, landed))| rebase(entry, undone || landed))
                .collect();
            return Ok(Attempt::Blocked(rebased));
        }

        self.commit_point(&txn).await?;

        let outcome = Outcome {
            txn: Some(t),
            written: txn
                .entries
                .iter()
                .map(|e| Written {
                    collection: e.coll.clone(),
                    id: e.id.clone(),
                    version: e.applied,
                })
                .collect(),
            finished: self.options.finish == Finish::BeforeReturning,
        };
        match self.options.finish {
            Finish::BeforeReturning => match recovery::finish_all(env, &txn, COORDINATOR).await {
                Ok(()) => {}
                Err(crash @ TxnError::Crashed { .. }) => return Err(crash),
                Err(e) => {
                    // Committed all the same: the GC frees what is left once the deadline passes.
                    tracing::warn!(txn = %t, error = %e, "committed, but finishing failed; the GC will finish it");
                    return Ok(Attempt::Committed(Outcome {
                        finished: false,
                        ..outcome
                    }));
                }
            },
            Finish::InBackground => {
                let env = env.clone();
                tokio::spawn(async move {
                    if let Err(e) = recovery::finish_all(&env, &txn, COORDINATOR).await {
                        tracing::warn!(txn = %t, error = %e, "background finish failed; the GC will finish it");
                    }
                });
            }
        }
        Ok(Attempt::Committed(outcome))
    }

    /// Writes the ActiveTransaction document. A reply lost in transit is settled by sending it
    /// again: a duplicate-key answer to the resend means the first one landed.
    async fn write_active_transaction(
        &self,
        t: ObjectId,
        stored: &Document,
    ) -> Result<(), TxnError> {
        // Counted across the retries: an atomic keeps the commit future `Send`.
        let sends = std::sync::atomic::AtomicU32::new(0);
        let written = recovery::retry_transient("write ActiveTransaction", || {
            sends.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            async { self.env.txns.insert_one(stored).await }
        })
        .await;
        match written {
            Ok(_) => Ok(()),
            Err(e)
                if sends.load(std::sync::atomic::Ordering::Relaxed) > 1
                    && probe::error_code(&e) == Some(probe::DUPLICATE_KEY) =>
            {
                Ok(())
            }
            Err(e) => Err(TxnError::database(Some(t), "write ActiveTransaction", e)),
        }
    }

    /// Writes the commit point. A write whose reply is lost is settled by reading the state back;
    /// when no attempt gets through, the coordinator aborts its own transaction (a write
    /// conditional on it still being pending) so that the caller learns a definite outcome.
    async fn commit_point(&self, txn: &ActiveTransaction) -> Result<(), TxnError> {
        let env = &self.env;
        let t = txn.id;
        env.point(Some(t), failpoint::COMMIT_BEFORE, 0)?;
        // Whether an attempt may have landed without its reply reaching us.
        let mut maybe_landed = false;
        let mut last_error = None;
        for attempt in 0..COMMIT_POINT_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(self.options.retry.backoff(attempt)).await;
            }
            match recovery::leave_pending(env, t, TxnState::Committed, doc! {}).await {
                Ok(true) => return env.point(Some(t), failpoint::COMMIT_AFTER, 0),
                Ok(false) => {}
                Err(e) if is_transient(&e) => {
                    maybe_landed = true;
                    last_error = Some(TxnError::database(Some(t), "write the commit point", e));
                    continue;
                }
                Err(e) => {
                    last_error = Some(TxnError::database(Some(t), "write the commit point", e));
                    break;
                }
            }
            // It matched nothing: it is no longer pending. The stored state says who decided.
            match recovery::load(env, t).await {
                Ok(stored) => {
                    if let Some(decided) = self.decided(txn, stored, maybe_landed).await {
                        return decided;
                    }
                }
                Err(e) => last_error = Some(e),
            }
        }
        let cause = last_error
            .map(|e| e.to_string())
            .unwrap_or_else(|| "no attempt got through".to_string());
        let aborted = recovery::leave_pending(env, t, TxnState::Aborted, doc! {}).await;
        if matches!(aborted, Ok(true)) {
            recovery::rollback_all(env, txn, COORDINATOR).await?;
            return Err(TxnError::Aborted { txn: t, cause });
        }
        match recovery::load(env, t).await {
            Ok(stored) => self.decided(txn, stored, maybe_landed).await,
            Err(_) => None,
        }
        .unwrap_or_else(|| Err(commit_unknown(t, &cause)))
    }

    /// What the stored state of `txn` (read back after the commit-point write matched nothing)
    /// says about its outcome; `None` while it is still pending.
    async fn decided(
        &self,
        txn: &ActiveTransaction,
        stored: Option<ActiveTransaction>,
        maybe_landed: bool,
    ) -> Option<Result<(), TxnError>> {
        let t = txn.id;
        match stored.map(|s| s.state) {
            Some(TxnState::Committed) => Some(self.env.point(Some(t), failpoint::COMMIT_AFTER, 0)),
            Some(TxnState::Pending) => None,
            Some(TxnState::Aborted) => Some(self.expired(txn).await),
            // Gone: a GC resolved it after its deadline. Rolled back, unless our own commit
            // point may have landed first (then the GC finished it instead).
            None if maybe_landed => Some(Err(commit_unknown(
                t,
                "the transaction ended under a GC after a commit-point reply was lost",
            ))),
            None => Some(self.expired(txn).await),
        }
    }

    /// Undoes what is still ours of a transaction a GC claimed (or already resolved: an apply of
    /// ours that landed late is undone here, the rest are no-ops), and says so.
    async fn expired(&self, txn: &ActiveTransaction) -> Result<(), TxnError> {
        recovery::rollback_all(&self.env, txn, COORDINATOR).await?;
        Err(TxnError::Expired { txn: txn.id })
    }

    /// Applies entry `i` of transaction `t` (written at `created`); with `wait`, waits (bounded)
    /// for documents held by live transactions.
    async fn apply(
        &self,
        t: ObjectId,
        created: DateTime,
        i: usize,
        entry: &Entry,
        wait: bool,
    ) -> Result<Applied, TxnError> {
        let env = &self.env;
        env.point(Some(t), failpoint::APPLY_BEFORE, i)?;
        let write = entry.apply(t);
        let lock_wait = self.store.lock_wait();
        let started = Instant::now();
        let mut pauses = 0_u32;
        let mut last_holder = None;
        let mut retries = 0;
        let applied = loop {
            let diagnosis = match recovery::run_write(&env.db, &entry.coll, &write).await {
                Ok(1) => break Applied::Yes,
                Ok(_) => self.diagnose(t, created, entry).await?,
                Err(e) if probe::error_code(&e) == Some(probe::DUPLICATE_KEY) => {
                    self.diagnose(t, created, entry).await?
                }
                // The write may or may not have landed: the document says which.
                Err(e) if is_transient(&e) => self.diagnose(t, created, entry).await?,
                Err(e) => return Err(TxnError::database(Some(t), "apply", e)),
            };
            match diagnosis {
                Diagnosis::Landed => break Applied::Yes,
                Diagnosis::Fail(e) => break Applied::Failed(e),
                Diagnosis::TakePlaceholder => {
                    if self.take_placeholder(t, created, entry, &write).await? {
                        break Applied::Yes;
                    }
                }
                Diagnosis::Retry => {}
                Diagnosis::Held(holder) => {
                    let quiet = Env {
                        faults: Faults::default(),
                        ..env.clone()
                    };
                    let resolution =
                        recovery::resolve_expired(&quiet, holder, DateTime::now()).await?;
                    let again = last_holder == Some(holder);
                    last_holder = Some(holder);
                    if resolution == Resolution::NotExpired || again {
                        if !wait {
                            break Applied::Blocked(holder);
                        }
                        if started.elapsed() >= lock_wait.max_wait {
                            break Applied::Failed(RepoError::Locked {
                                collection: entry.coll.clone(),
                                id: show_id(&entry.id),
                                holder: Some(holder),
                                waited: started.elapsed(),
                            });
                        }
                        tokio::time::sleep(lock_wait.backoff(pauses)).await;
                        pauses += 1;
                    }
                    continue;
                }
            }
            retries += 1;
            if retries > 8 {
                break Applied::Failed(RepoError::Locked {
                    collection: entry.coll.clone(),
                    id: show_id(&entry.id),
                    holder: last_holder,
                    waited: started.elapsed(),
                });
            }
        };
        env.point(Some(t), failpoint::APPLY_AFTER, i)?;
        Ok(applied)
    }

    /// Replaces the free placeholder of a rolled-back insert with this entry's document, if the
    /// placeholder is older than the transaction: a newer one may be the fence a GC left against
    /// this very insert after claiming the transaction.
    async fn take_placeholder(
        &self,
        t: ObjectId,
        created: DateTime,
        entry: &Entry,
        write: &Write,
    ) -> Result<bool, TxnError> {
        let Write::Insert(doc) = write else {
            return Ok(false);
        };
        let mut filter = fields::free_placeholder_filter(&entry.id);
        filter.insert(fields::DELETED, doc! { "$lt": created });
        recovery::run_write(
            &self.env.db,
            &entry.coll,
            &Write::Replace(filter, doc.clone()),
        )
        .await
        .map(|matched| matched == 1)
        .map_err(|e| TxnError::database(Some(t), "apply", e))
    }

    /// Reads the document after an apply that did not (visibly) land and says what happened.
    async fn diagnose(
        &self,
        t: ObjectId,
        created: DateTime,
        entry: &Entry,
    ) -> Result<Diagnosis, TxnError> {
        let shown = show_id(&entry.id);
        let stored = self
            .env
            .db
            .collection::<Document>(&entry.coll)
            .find_one(doc! { "_id": entry.id.clone() })
            .await
            .map_err(|e| TxnError::database(Some(t), "read after apply", e))?;
        let is_insert = matches!(entry.op, Op::Insert { .. });
        let not_found = || RepoError::NotFound {
            collection: entry.coll.clone(),
            id: shown.clone(),
        };
        let Some(stored) = stored else {
            return Ok(if is_insert {
                Diagnosis::Retry
            } else {
                Diagnosis::Fail(not_found())
            });
        };
        let sys = SystemFields::read(&stored).map_err(|reason| {
            TxnError::document(
                Some(t),
                RepoError::Malformed {
                    collection: entry.coll.clone(),
                    id: shown.clone(),
                    reason,
                },
            )
        })?;
        if sys.active_txn == Some(t) {
            return Ok(Diagnosis::Landed);
        }
        if sys.is_placeholder() {
            return Ok(match (is_insert, sys.deleted_at) {
                (true, Some(at)) if at < created => Diagnosis::TakePlaceholder,
                // Left after this transaction began: a GC's fence against it, or an insert of
                // the same id that another transaction rolled back meanwhile.
                (true, _) => Diagnosis::Fail(RepoError::DuplicateId {
                    collection: entry.coll.clone(),
                    id: shown,
                }),
                (false, _) => Diagnosis::Fail(not_found()),
            });
        }
        if is_insert {
            return Ok(Diagnosis::Fail(RepoError::DuplicateId {
                collection: entry.coll.clone(),
                id: shown,
            }));
        }
        if sys.is_deleted() {
            return Ok(Diagnosis::Fail(RepoError::Deleted {
                collection: entry.coll.clone(),
                id: shown,
                version: sys.version,
            }));
        }
        if sys.schema_version > entry.schema {
            return Ok(Diagnosis::Fail(RepoError::SchemaTooNew {
                collection: entry.coll.clone(),
                id: shown,
                found: sys.schema_version,
                supported: entry.schema,
            }));
        }
        if let Some(holder) = sys.active_txn {
            return Ok(Diagnosis::Held(holder));
        }
        if sys.version != entry.expected {
            return Ok(Diagnosis::Fail(RepoError::VersionConflict {
                collection: entry.coll.clone(),
                id: shown,
                expected: entry.expected,
                actual: sys.version,
            }));
        }
        Ok(Diagnosis::Retry)
    }
}

/// How often the coordinator tries to write its commit point before aborting instead.
const COMMIT_POINT_ATTEMPTS: u32 = 6;

fn commit_unknown(txn: ObjectId, cause: &str) -> TxnError {
    TxnError::CommitUnknown {
        txn,
        cause: cause.to_string(),
    }
}

/// The entry to apply after an own rollback left the document at a new version.
fn rebase(entry: &Entry, was_applied: bool) -> Entry {
    let mut next = entry.clone();
    if was_applied {
        next.expected = entry.rolled_back_version();
        next.applied = match entry.op {
            Op::Check => next.expected,
            Op::Insert { .. } => crate::FIRST_VERSION,
            _ => next.expected + 1,
        };
        if let Op::Rewrite { pre, .. } = &mut next.op {
            pre.insert(fields::VERSION, next.expected);
        }
    }
    next
}

/// Reads the document a field-level change is staged on, refusing what can never succeed.
async fn read_for_change<T>(
    repo: &Repository<T>,
    id: &Bson,
    shown: &str,
    expected: i64,
) -> Result<(Document, SystemFields), TxnError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let stored = repo
        .raw_collection()
        .find_one(doc! { "_id": id.clone() })
        .await
        .map_err(|e| repo.db_error(shown, "find by id", e))?;
    let not_found = || RepoError::NotFound {
        collection: repo.name().to_string(),
        id: shown.to_string(),
    };
    let stored = stored.ok_or_else(not_found)?;
    let sys = repo.system_fields(shown, &stored)?;
    if sys.is_placeholder() {
        return Err(not_found().into());
    }
    if sys.is_deleted() {
        return Err(RepoError::Deleted {
            collection: repo.name().to_string(),
            id: shown.to_string(),
            version: sys.version,
        }
        .into());
    }
    if sys.schema_version > repo.spec().schema_version() {
        return Err(repo.too_new(shown, sys.schema_version).into());
    }
    // A held document is judged at apply time, when its holder is gone.
    if sys.active_txn.is_none() && sys.version != expected {
        return Err(RepoError::VersionConflict {
            collection: repo.name().to_string(),
            id: shown.to_string(),
            expected,
            actual: sys.version,
        }
        .into());
    }
    Ok((stored, sys))
}

/// The rewrite of an older-shape document into its upgraded, changed form.
fn rewrite<T>(
    repo: &Repository<T>,
    shown: &str,
    expected: i64,
    post: Document,
    pre: Document,
) -> Result<Op, TxnError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let mut check = post.clone();
    repo.stamp(&mut check, expected + 1);
    repo.validate(shown, &check)?;
    Ok(Op::Rewrite { post, pre })
}

fn pairs(list: &[(String, Bson)]) -> Vec<PathValue> {
    list.iter()
        .map(|(path, value)| PathValue {
            path: path.clone(),
            value: value.clone(),
        })
        .collect()
}
