//! The commit protocol: how a staged transaction becomes all-or-nothing on single-document writes.
//!
//! 1. **Record.** Write the ActiveTransaction record: the worklist, a deadline (server time plus
//!    the timeout), state `pending`, and a fresh random nonce per send.
//! 2. **Apply.** Apply every entry concurrently, each conditional on the expected version and a
//!    free document; each leaves the document *held*: `_txn` names the transaction and `_hold`
//!    carries the deadline and the entry's own undo (see `repo::hold`).
//! 3. **Commit point.** Set the state to `committed` with one write conditional on the record
//!    still being `pending` with our nonce. This write decides the transaction.
//! 4. **Finish.** Free every document concurrently (a delete becomes a tombstone).
//! 5. **End.** Delete the record. 2k + 3 writes for k documents.
//!
//! A failure before the commit point rolls back what was applied and deletes the record; a
//! document held by another live transaction makes the attempt roll back and run again in lock
//! order, waiting (bounded) for holders, so that waits never form a cycle: a transaction that waits
//! only waits for documents later in the order than all it holds, and one that holds out of order
//! never waits.
//!
//! # Why each step is safe when repeated, late or interrupted
//!
//! - The record is written before any apply is sent, and deleted only after every entry is
//!   finished or undone, so a hold whose record is absent belongs to an ended transaction and did
//!   not commit. Every hold describes its own undo, so anyone can resolve it.
//! - An apply delivered after the coordinator gave up can only match the document at the version
//!   the transaction read: it puts the same hold back, which any reader ignores and any writer or
//!   GC undoes. Rollback restores the version too, so a transaction that did not commit leaves no
//!   trace, not even a spurious version conflict.
//! - The commit point and every abort are conditional on `pending`: exactly one wins. A send of the
//!   record delivered after the record was deleted would create a new `pending` record, but with
//!   another nonce, so no late commit point can commit it.
//! - Finish, undo and end are conditional on the hold (or the record) still being there, and are
//!   simply resent after a transient error.

use bson::{doc, oid::ObjectId, DateTime};
use futures::future::join_all;
use rand::Rng;

use crate::repo::error::{show_id, RepoError};
use crate::repo::fields::{self, SystemFields};
use crate::repo::hold::{HoldKind, TxnState};
use crate::repo::resolve::{self, Settled};
use crate::repo::write;
use crate::server::{clock, is_transient, probe};
use crate::txn::error::TxnError;
use crate::txn::failpoint;
use crate::txn::recovery::{self, COORDINATOR};
use crate::txn::transaction::{Finish, Outcome, Transactions, Written};
use crate::txn::worklist::{ActiveTransaction, Entry, Op};

/// How an apply ended.
enum Applied {
    Yes,
    Blocked(ObjectId),
    Failed(RepoError),
}

/// What the document says about an apply that did not (visibly) land.
enum Diagnosis {
    Landed,
    Retry,
    Held(ObjectId),
    Fail(RepoError),
}

/// How one attempt at committing ended (errors are returned as `Err`).
enum Attempt {
    Committed(Outcome),
    /// Another live transaction held a document; everything was rolled back.
    Blocked,
}

/// How often the coordinator tries to write its commit point before aborting instead.
const COMMIT_POINT_ATTEMPTS: u32 = 6;
/// How often the record is sent before giving up.
const RECORD_SENDS: u32 = 5;
/// How often an apply is retried when the document changes under it without a holder.
const APPLY_RETRIES: u32 = 8;

impl Transactions {
    /// Commits `entries`: all of them become visible together, or none does.
    pub(crate) async fn commit_entries(
        &self,
        mut entries: Vec<Entry>,
    ) -> Result<Outcome, TxnError> {
        if entries.is_empty() {
            return Ok(Outcome {
                txn: None,
                written: Vec::new(),
                finished: true,
            });
        }
        entries.sort_by_key(Entry::lock_key);
        let mut ordered = false;
        loop {
            match self.attempt(&entries, ordered).await? {
                Attempt::Committed(outcome) => return Ok(outcome),
                // Ordered attempts wait for holders instead of reporting blocks, so this switches
                // to ordered mode once and never loops again.
                Attempt::Blocked => ordered = true,
            }
        }
    }

    async fn attempt(&self, entries: &[Entry], ordered: bool) -> Result<Attempt, TxnError> {
        let env = &self.env;
        let now = env.now(None).await?;
        let t = ObjectId::new();
        let mut txn = ActiveTransaction {
            id: t,
            state: TxnState::Pending,
            nonce: 0,
            created: now,
            deadline: clock::plus(now, self.options.timeout),
            entries: entries.to_vec(),
        };

        env.point(Some(t), failpoint::BEGIN_BEFORE, 0)?;
        self.write_record(&mut txn).await?;
        env.point(Some(t), failpoint::BEGIN_AFTER, 0)?;

        let results: Vec<Result<Applied, TxnError>> = if ordered {
            let mut results = Vec::with_capacity(txn.entries.len());
            for (i, entry) in txn.entries.iter().enumerate() {
                let result = self.apply(t, txn.deadline, i, entry, true).await;
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
                    .map(|(i, entry)| self.apply(t, txn.deadline, i, entry, false)),
            )
            .await
        };

        let mut failure: Option<TxnError> = None;
        let mut blocked = false;
        for result in results {
            match result {
                Ok(Applied::Yes) => {}
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
            // Someone may have aborted this transaction past its deadline; say so rather than
            // report whatever that did to the applies.
            let aborted = failure.is_some()
                && matches!(
                    recovery::load(env, t).await,
                    Ok(None)
                        | Ok(Some(ActiveTransaction {
                            state: TxnState::Aborted,
                            ..
                        }))
                );
            recovery::rollback_all(env, &txn, COORDINATOR).await?;
            if aborted {
                tracing::debug!(txn = %t, "aborted by another party before its commit point; rolled back");
                return Err(TxnError::Expired { txn: t });
            }
            if let Some(error) = failure {
                tracing::debug!(txn = %t, error = %error, "rolled back");
                return Err(error);
            }
            tracing::debug!(txn = %t, "blocked by another transaction; retrying in lock order");
            return Ok(Attempt::Blocked);
        }

        self.commit_point(&txn).await?;

        let outcome = Outcome {
            txn: Some(t),
            written: txn
                .entries
                .iter()
                .filter(|e| !e.is_guard())
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
                    // Committed all the same: readers see it, and anyone finishes what is left.
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

    /// Writes the record. Every send carries a fresh nonce; when a reply is lost and a resend
    /// finds the record already there, the stored nonce is read back and adopted.
    async fn write_record(&self, txn: &mut ActiveTransaction) -> Result<(), TxnError> {
        let env = &self.env;
        let t = txn.id;
        let records = env.records(Some(t)).await?;
        let mut ambiguous = false;
        let mut last = None;
        for send in 0..RECORD_SENDS {
            if send > 0 {
                tokio::time::sleep(self.options.retry.backoff(send)).await;
            }
            txn.nonce = rand::rng().random();
            let stored = bson::to_document(&*txn).map_err(|e| TxnError::Malformed {
                txn: t,
                reason: e.to_string(),
            })?;
            match records.insert_one(stored).await {
                Ok(_) => return Ok(()),
                Err(e) if ambiguous && probe::error_code(&e) == Some(probe::DUPLICATE_KEY) => {
                    return match recovery::load(env, t).await? {
                        Some(found) if found.state == TxnState::Pending => {
                            txn.nonce = found.nonce;
                            Ok(())
                        }
                        // Aborted (or already resolved) past its deadline before anything applied.
                        _ => Err(TxnError::Expired { txn: t }),
                    };
                }
                Err(e) if is_transient(&e) => {
                    ambiguous = true;
                    last = Some(e);
                }
                Err(e) => return Err(TxnError::database(Some(t), "write the record", e)),
            }
        }
        Err(match last {
            Some(e) => TxnError::database(Some(t), "write the record", e),
            None => TxnError::Malformed {
                txn: t,
                reason: "the record could not be written".into(),
            },
        })
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
            match recovery::leave_pending(env, t, TxnState::Committed, doc! { "nonce": txn.nonce })
                .await
            {
                Ok(true) => return env.point(Some(t), failpoint::COMMIT_AFTER, 0),
                Ok(false) => {}
                Err(e) if is_transient(&e) => {
                    maybe_landed = true;
                    last_error = Some(crate::server::summarize(&e));
                    continue;
                }
                Err(e) => {
                    last_error = Some(crate::server::summarize(&e));
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
                Err(e) => last_error = Some(e.to_string()),
            }
        }
        let cause = last_error.unwrap_or_else(|| "no attempt got through".to_string());
        let aborted = recovery::leave_pending(env, t, TxnState::Aborted, doc! {}).await;
        if matches!(aborted, Ok(true)) {
            recovery::rollback_all(env, txn, COORDINATOR).await?;
            return Err(TxnError::Aborted { txn: t, cause });
        }
        match recovery::load(env, t).await {
            Ok(stored) => self.decided(txn, stored, maybe_landed).await,
            Err(_) => None,
        }
        .unwrap_or_else(|| {
            Err(TxnError::CommitUnknown {
                txn: t,
                cause: cause.clone(),
            })
        })
    }

    /// What the stored record of `txn` (read back after the commit-point write matched nothing)
    /// says about its outcome; `None` while it is still pending.
    async fn decided(
        &self,
        txn: &ActiveTransaction,
        stored: Option<ActiveTransaction>,
        maybe_landed: bool,
    ) -> Option<Result<(), TxnError>> {
        let t = txn.id;
        // A record with another nonce is a late send of ours, not the record we applied under.
        let stored = stored.filter(|s| s.nonce == txn.nonce);
        match stored.map(|s| s.state) {
            Some(TxnState::Committed) => Some(self.env.point(Some(t), failpoint::COMMIT_AFTER, 0)),
            Some(TxnState::Pending) => None,
            Some(TxnState::Aborted) => Some(self.expired(txn).await),
            // Gone: resolved by someone else after its deadline. Rolled back, unless our own commit
            // point may have landed first (then it was finished instead).
            None if maybe_landed => Some(Err(TxnError::CommitUnknown {
                txn: t,
                cause:
                    "the record was resolved by another party after a commit-point reply was lost"
                        .into(),
            })),
            None => Some(self.expired(txn).await),
        }
    }

    /// Undoes what is still ours of a transaction someone else aborted, and says so.
    async fn expired(&self, txn: &ActiveTransaction) -> Result<(), TxnError> {
        recovery::rollback_all(&self.env, txn, COORDINATOR).await?;
        Err(TxnError::Expired { txn: txn.id })
    }

    /// Applies entry `i` of transaction `t`; with `wait`, waits (bounded) for documents held by
    /// live transactions, else reports them.
    async fn apply(
        &self,
        t: ObjectId,
        deadline: DateTime,
        i: usize,
        entry: &Entry,
        wait: bool,
    ) -> Result<Applied, TxnError> {
        let env = &self.env;
        env.point(Some(t), failpoint::APPLY_BEFORE, i)?;
        let write = entry.apply(t, deadline);
        let coll = env.collection(Some(t), &entry.coll).await?;
        let lock_wait = self.store.lock_wait();
        let started = std::time::Instant::now();
        let mut pauses = 0_u32;
        let mut last_holder = None;
        let mut retries = 0;
        let locked = |holder| RepoError::Locked {
            collection: entry.coll.clone(),
            id: show_id(&entry.id),
            holder,
            waited: started.elapsed(),
        };
        let applied = loop {
            let diagnosis = match write::run(&coll, &write).await {
                Ok(1) => break Applied::Yes,
                Ok(_) => self.diagnose(t, entry).await?,
                Err(e) if probe::error_code(&e) == Some(probe::DUPLICATE_KEY) => {
                    match probe::duplicate_key_index(&e).filter(|index| index != "_id_") {
                        Some(index) => {
                            break Applied::Failed(RepoError::DuplicateKey {
                                collection: entry.coll.clone(),
                                id: show_id(&entry.id),
                                index,
                            })
                        }
                        None => self.diagnose(t, entry).await?,
                    }
                }
                // The write may or may not have landed: the document says which.
                Err(e) if is_transient(&e) => self.diagnose(t, entry).await?,
                Err(e) => return Err(TxnError::database(Some(t), "apply", e)),
            };
            match diagnosis {
                Diagnosis::Landed => break Applied::Yes,
                Diagnosis::Fail(e) => break Applied::Failed(e),
                Diagnosis::Retry => {
                    retries += 1;
                    if retries > APPLY_RETRIES {
                        break Applied::Failed(locked(last_holder));
                    }
                }
                Diagnosis::Held(holder) => {
                    let settled = resolve::settle(&self.store, &entry.coll, &entry.id, holder)
                        .await
                        .map_err(|source| {
                            TxnError::hold(Some(t), &entry.coll, &entry.id, holder, source)
                        })?;
                    let again = last_holder == Some(holder);
                    last_holder = Some(holder);
                    if settled == Settled::Freed && !again {
                        continue;
                    }
                    if settled == Settled::Live && !wait {
                        break Applied::Blocked(holder);
                    }
                    if started.elapsed() >= lock_wait.max_wait {
                        break Applied::Failed(locked(Some(holder)));
                    }
                    tokio::time::sleep(lock_wait.backoff(pauses)).await;
                    pauses += 1;
                }
            }
        };
        env.point(Some(t), failpoint::APPLY_AFTER, i)?;
        Ok(applied)
    }

    /// Reads the document after an apply that did not (visibly) land and says what happened.
    async fn diagnose(&self, t: ObjectId, entry: &Entry) -> Result<Diagnosis, TxnError> {
        let shown = show_id(&entry.id);
        let stored = self
            .env
            .collection(Some(t), &entry.coll)
            .await?
            .find_one(doc! { "_id": entry.id.clone() })
            .await
            .map_err(|e| TxnError::database(Some(t), "read after apply", e))?;
        let is_insert = matches!(entry.op, Op::Insert { .. });
        let duplicate = || {
            Diagnosis::Fail(RepoError::DuplicateId {
                collection: entry.coll.clone(),
                id: shown.clone(),
            })
        };
        let Some(stored) = stored else {
            return Ok(if is_insert {
                Diagnosis::Retry
            } else {
                Diagnosis::Fail(RepoError::NotFound {
                    collection: entry.coll.clone(),
                    id: shown.clone(),
                })
            });
        };
        let malformed = |reason| {
            TxnError::document(
                Some(t),
                RepoError::Malformed {
                    collection: entry.coll.clone(),
                    id: shown.clone(),
                    reason,
                },
            )
        };
        let sys = SystemFields::read(&stored).map_err(malformed)?;
        if sys.active_txn == Some(t) {
            return Ok(Diagnosis::Landed);
        }
        if let Some(holder) = sys.active_txn {
            // Only a pending insert can give the id back; anything else keeps it taken.
            if is_insert && fields::read_hold(&stored).map_err(malformed)?.op != HoldKind::Insert {
                return Ok(duplicate());
            }
            return Ok(Diagnosis::Held(holder));
        }
        if is_insert {
            return Ok(duplicate());
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
        if entry.is_guard() {
            return Ok(if entry.guard_holds(&stored) {
                Diagnosis::Retry
            } else {
                Diagnosis::Fail(RepoError::ConditionFailed {
                    collection: entry.coll.clone(),
                    id: shown,
                    condition: entry.guard_condition(),
                    actual: sys.version,
                })
            });
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
