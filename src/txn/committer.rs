//! The commit protocol: how a staged transaction becomes all-or-nothing on single-document writes,
//! in one round of writes (a parallel commit).
//!
//! (Over 700 lines on purpose: the protocol's steps read here in the order they run, and that
//! order, with what each step may assume of the ones before it, is what makes it safe; split,
//! a reader would have to reassemble it. What the steps share with the GC is in `recovery`.)
//!
//! 1. **Round.** Concurrently: write the ActiveTransaction record in state `staging` (its
//!    participants, a deadline: server time plus the timeout), and apply every entry, each
//!    conditional on the expected version and a free document. An apply leaves the document
//!    *held*: `_txn` names the transaction and `_hold` carries the deadline and the entry's own
//!    undo (see `repo::hold`). The applies to existing documents travel in one `bulkWrite` where
//!    the server has it (see `repo::hold::write`): two messages for the whole round.
//! 2. **Return.** Once the record and every apply are acknowledged, the transaction is committed
//!    (implicitly: see `repo::hold::staging`), and `commit` can return.
//! 3. **Commit point.** Write `committed` (conditional on `staging`) so that readers need not check
//!    the participants, ...
//! 4. **Finish.** ... free every document in one round (a delete becomes a tombstone), ...
//! 5. **End.** ... and delete the record. With [`Finish::InBackground`] steps 3 to 5 run after
//!    returning; with [`Finish::BeforeReturning`] before. 2k + 3 writes for k documents.
//!
//! A failure in the round (a conflict, a document held by a live transaction) aborts the record
//! (conditional on `staging`), undoes what was applied and, when a document was held, runs the
//! attempt again in lock order, waiting (bounded) for holders, so that waits never form a cycle: a
//! transaction that waits only waits for documents later in the order than all it holds, and one
//! that holds out of order never waits.
//!
//! # Why each step is safe when repeated, late or interrupted
//!
//! - The record is written by an upsert that keeps a record already there and creates a missing
//!   one `staging` only while the server's clock is at or before the deadline (`aborted` after),
//!   and it returns the state it left. A copy of it delivered late can never bring back an
//!   undecided transaction whose record was already decided and deleted.
//! - No apply takes effect after the deadline on the server's clock: changes of existing
//!   documents are conditional on `$$NOW`, and a created document carries the server's time of
//!   creation in its hold: one created after the deadline counts for nobody (the coordinator and
//!   every resolver judge it by that stamp, `Hold::created_late`). A resolver aborts a staging transaction
//!   only after the deadline (again by `$$NOW`) and only after fencing a participant whose apply had
//!   not landed; so when the record came back `staging` and every apply took effect in time, no
//!   resolver can have aborted it, and the coordinator returns committed without another write.
//! - An apply delivered after the transaction was decided can only match the document at the
//!   version the transaction read: it puts the same hold back, which any reader ignores and any
//!   writer or GC undoes. Rollback restores the version too, so a transaction that did not commit
//!   leaves no trace, not even a spurious version conflict.
//! - The commit point and every abort are conditional on `staging`: exactly one wins.
//! - Finish, undo and end are conditional on the hold (or the record) still being there, and are
//!   simply resent after a transient error.

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use futures::future::join_all;
use mongodb::options::ReturnDocument;
use mongodb::Collection;

use crate::metrics::{self, Access};
use crate::repo::contention;
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields::SystemFields;
use crate::repo::format;
use crate::repo::hold::held::{self, HoldKind};
use crate::repo::hold::record::{self, TxnState};
use crate::repo::hold::resolve::{self, Settled};
use crate::repo::hold::staging;
use crate::repo::hold::write;
use crate::repo::outcome::{HoldError, TxnStatus};
use crate::repo::plain;
use crate::repo::store::Store;
use crate::retry::Retry;
use crate::server::codes;
use crate::server::{clock, is_transient};
use crate::txn::error::TxnError;
use crate::txn::failpoint;
use crate::txn::options::{Finish, Outcome, TxnOptions, Written};
use crate::txn::recovery::{self, Deletion, Env, COORDINATOR};
use crate::txn::worklist::{ActiveTransaction, Entry, Op};

/// How an apply ended.
enum Applied {
    Yes,
    /// Held by this live transaction; `true`: an earlier send of the apply may still land.
    Blocked(ObjectId, bool),
    /// Refused for this reason; `true` as for `Blocked`.
    Failed(RepoError, bool),
    /// Too late: refused after the deadline, fenced, or created after it; `true` as for `Blocked`.
    Late(bool),
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

/// How the record's write went.
struct RecordSent {
    /// The state the write left the record in: `staging`, or already decided (committed by a
    /// resolver who found every participant in place; aborted when created too late or when a
    /// resolver had put an aborted one in its place); or why it could not be written.
    staging: Result<TxnState, TxnError>,
    /// Some send got no answer, so a copy of it may still arrive.
    ambiguous: bool,
}

/// What became of the record of an attempt that did not get every write in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Record {
    /// Written, and every send of it answered.
    Written,
    /// Every send was refused outright: there is none, and none can arrive.
    Never,
    /// Some send got no answer: a copy may still arrive.
    MayArriveLate,
}

/// How often the record is sent before giving up.
const RECORD_SENDS: u32 = 5;
/// How often an apply is retried when the document changes under it without a holder.
const APPLY_RETRIES: u32 = 8;
/// How often the coordinator tries to abort its own transaction.
const ABORT_ATTEMPTS: u32 = 6;

/// The commit protocol under one handle's settings: what a
/// [`Transactions`](crate::txn::transaction::Transactions) commit hands its entries to.
pub(crate) struct Committer<'a> {
    pub(crate) store: &'a Store,
    pub(crate) env: &'a Env,
    pub(crate) options: &'a TxnOptions,
}

impl Committer<'_> {
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
        // The commit's span (`txn::observe`) shows how many attempts it took.
        let span = tracing::Span::current();
        let mut attempts = 0_u32;
        loop {
            attempts = attempts.saturating_add(1);
            span.record("attempts", attempts);
            match self.attempt(&entries, ordered).await? {
                Attempt::Committed(outcome) => return Ok(outcome),
                // Ordered attempts wait for holders instead of reporting blocks, so this switches
                // to ordered mode once and never loops again.
                Attempt::Blocked => ordered = true,
            }
        }
    }

    async fn attempt(&self, entries: &[Entry], ordered: bool) -> Result<Attempt, TxnError> {
        let env = self.env;
        let now = env.now(None).await?;
        // Read before anything is written: a process of an old release in a fleet switched to a
        // newer format writes nothing.
        let format = env.store.writes_format().await?;
        let t = ObjectId::new();
        tracing::Span::current().record("txn", tracing::field::display(t));
        let txn = ActiveTransaction {
            id: t,
            state: TxnState::Staging,
            created: now,
            deadline: clock::plus(now, self.options.timeout),
            entries: entries.to_vec(),
            format,
        };

        let (sent, results): (RecordSent, Vec<Result<Applied, TxnError>>) = if ordered {
            // The contended path: the record first, then one document at a time in lock order.
            let sent = self.write_record(&txn).await;
            let mut results = Vec::with_capacity(txn.entries.len());
            if sent.staging.is_ok() {
                for (i, entry) in txn.entries.iter().enumerate() {
                    let result = async {
                        self.env.point(Some(t), failpoint::APPLY_BEFORE, i)?;
                        let coll = self.env.collection(Some(t), &entry.coll).await?;
                        let write = (coll, entry.apply(t, txn.deadline, txn.format));
                        self.apply(t, txn.deadline, i, entry, &write, None, true)
                            .await
                    }
                    .await;
                    let stop = !matches!(result, Ok(Applied::Yes));
                    results.push(result);
                    if stop {
                        break;
                    }
                }
            }
            (sent, results)
        } else {
            // The applies are sent first (a crash before the record leaves holds without
            // one: not committed).
            let (results, sent) =
                futures::join!(self.apply_round(t, &txn), self.write_record(&txn));
            (sent, results)
        };

        let mut failure: Option<TxnError> = None;
        let mut blocked = false;
        // Some write of the round was refused for good: the transaction can never be in place.
        let mut refused = false;
        let record_ambiguous = sent.ambiguous;
        let staging = match sent.staging {
            Err(crash) if crash.is_crash() => return Err(crash),
            Err(e) => {
                failure = Some(e);
                None
            }
            Ok(state) => {
                // An aborted record answers only if no copy of it can have been created anew
                // after the transaction ended (which needs an unanswered send).
                refused |= state == TxnState::Aborted && !record_ambiguous;
                Some(state)
            }
        };
        let answered = results.len();
        // The first entry whose document stopped the attempt (for the contention record).
        let mut culprit = None;
        for (i, result) in results.into_iter().enumerate() {
            match result {
                Ok(Applied::Yes) => {}
                Ok(Applied::Blocked(holder, ambiguous)) => {
                    tracing::debug!(txn = %t, holder = %holder, "document held by another transaction");
                    blocked = true;
                    refused |= !ambiguous;
                    culprit = culprit.or(Some(i));
                }
                Ok(Applied::Failed(e, ambiguous)) => {
                    failure.get_or_insert(TxnError::document(Some(t), e));
                    refused |= !ambiguous;
                    culprit = culprit.or(Some(i));
                }
                Ok(Applied::Late(ambiguous)) => {
                    failure.get_or_insert(TxnError::Expired { txn: t });
                    refused |= !ambiguous;
                }
                Err(crash) if crash.is_crash() => return Err(crash),
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        let all_applied = failure.is_none() && !blocked && answered == txn.entries.len();

        let decided_committed = staging == Some(TxnState::Committed);
        if !decided_committed && (staging != Some(TxnState::Staging) || !all_applied) {
            // A record refused outright by every send does not exist and never will.
            let record = if staging.is_none() && !record_ambiguous {
                Record::Never
            } else if record_ambiguous {
                Record::MayArriveLate
            } else {
                Record::Written
            };
            return self
                .give_up(&txn, failure, blocked, record, refused, culprit)
                .await;
        }

        // The record was staging when written and every apply took effect before the deadline:
        // the transaction is committed. No resolver can have aborted it, because aborting needs a
        // fence on a participant whose apply had not landed, and after the deadline.
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
            finished: true,
        };
        // Once the store shuts down it takes no background work: the commit finishes here.
        let slot = match self.options.finish {
            Finish::BeforeReturning => None,
            Finish::InBackground => env.store.inner.background.slot(),
        };
        match slot {
            None => match complete(env, &txn).await {
                Ok(()) => {}
                Err(crash) if crash.is_crash() => return Err(crash),
                Err(e) => {
                    // Committed all the same: readers see it, and anyone finishes what is left.
                    tracing::warn!(txn = %t, error = %e, "committed, but finishing failed; the GC will finish it");
                    return Ok(Attempt::Committed(Outcome {
                        finished: false,
                        ..outcome
                    }));
                }
            },
            Some(slot) => {
                let env = env.clone();
                tokio::spawn(async move {
                    if let Err(e) = complete(&env, &txn).await {
                        tracing::warn!(txn = %t, error = %e, "background finish failed; the GC will finish it");
                    }
                    drop(slot);
                });
                return Ok(Attempt::Committed(Outcome {
                    finished: false,
                    ..outcome
                }));
            }
        }
        Ok(Attempt::Committed(outcome))
    }

    /// Ends an attempt that did not get every write in: aborts the record and rolls back. If the
    /// record turns out committed (an apply whose reply was lost had landed, and a resolver saw
    /// every participant in place), the transaction committed after all. `culprit` is the
    /// entry whose document stopped the attempt, if one did.
    async fn give_up(
        &self,
        txn: &ActiveTransaction,
        failure: Option<TxnError>,
        blocked: bool,
        record: Record,
        refused: bool,
        culprit: Option<usize>,
    ) -> Result<Attempt, TxnError> {
        let env = self.env;
        let t = txn.id;
        env.point(Some(t), failpoint::ABORT_BEFORE, 0)?;
        let status = if record == Record::Never {
            TxnStatus::Absent
        } else {
            self.abort(txn, refused, record == Record::MayArriveLate)
                .await?
        };
        env.point(Some(t), failpoint::ABORT_AFTER, 0)?;
        match status {
            TxnStatus::Committed => {
                // Finished by whoever committed it, or by the GC.
                tracing::debug!(txn = %t, "committed by a resolver although an apply seemed to fail");
                return Ok(Attempt::Committed(Outcome {
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
                    finished: false,
                }));
            }
            TxnStatus::Pending { .. } => {
                return Err(TxnError::CommitUnknown {
                    txn: t,
                    cause: "the transaction could not be aborted".into(),
                })
            }
            TxnStatus::Aborted | TxnStatus::Absent => {}
        }
        contention::aborted(
            self.store,
            txn.entries.iter().map(|e| e.coll.as_str()),
            culprit
                .and_then(|i| txn.entries.get(i))
                .map(|e| (e.coll.as_str(), &e.id)),
        );
        // No copy of the record can arrive later if every send of it was answered.
        let deletion = if record == Record::MayArriveLate {
            Deletion::AfterDeadline
        } else {
            Deletion::Now
        };
        recovery::rollback_all(env, txn, COORDINATOR, deletion).await?;
        if let Some(error) = failure {
            tracing::debug!(txn = %t, error = %error, "rolled back");
            return Err(error);
        }
        if blocked {
            tracing::debug!(txn = %t, "blocked by another transaction; retrying in lock order");
            return Ok(Attempt::Blocked);
        }
        Err(TxnError::Expired { txn: t })
    }

    /// Aborts the coordinator's own transaction (conditional on `staging`), writing an aborted
    /// record if its record never arrived; returns the status it ends with.
    ///
    /// Unless one of its writes was `refused` outright, an apply whose reply was lost may still
    /// land and complete the set of participants, which would commit the transaction: so first a
    /// missing participant is fenced, as any resolver would (and if none is missing, it has
    /// committed).
    ///
    /// With no refusal and a send of the record unanswered, nothing it finds can be trusted: the
    /// transaction may have committed, been finished and ended before a late copy of its record
    /// created it anew. Unless the record says committed, the outcome is then unknown.
    async fn abort(
        &self,
        txn: &ActiveTransaction,
        refused: bool,
        record_ambiguous: bool,
    ) -> Result<TxnStatus, TxnError> {
        let env = self.env;
        let t = txn.id;
        if !refused && record_ambiguous {
            return match record::load(&env.store, t).await {
                Ok(Some(found)) if record::status_of(&found) == Ok(TxnStatus::Committed) => {
                    Ok(TxnStatus::Committed)
                }
                _ => Err(TxnError::CommitUnknown {
                    txn: t,
                    cause: "a send of its record went unanswered and no write was refused".into(),
                }),
            };
        }
        let mut last = String::new();
        let parts: Vec<record::Participant> = txn
            .entries
            .iter()
            .map(|e| record::Participant {
                coll: e.coll.clone(),
                id: e.id.clone(),
                schema: e.schema,
            })
            .collect();
        let mut fenced = refused;
        let mut pace = Retry::until_deadline(self.options.retry);
        for attempt in 0..ABORT_ATTEMPTS {
            if attempt > 0 {
                pace.pause().await;
            }
            if !fenced {
                match staging::fence_one(&env.store, t, &parts, txn.deadline).await {
                    Ok(staging::Missing::Fenced | staging::Missing::Shut) => fenced = true,
                    Ok(staging::Missing::None) => {
                        // Every participant is in place: committed, if the record is staging.
                        match staging::status(&env.store, t).await {
                            Ok(TxnStatus::Pending { .. }) => {}
                            Ok(TxnStatus::Absent) => fenced = true,
                            Ok(status) => return Ok(status),
                            Err(e) => last = e.to_string(),
                        }
                        continue;
                    }
                    Ok(staging::Missing::Held) => {
                        last = "a participant is held by another transaction".into();
                        continue;
                    }
                    Err(e) => {
                        last = e.to_string();
                        continue;
                    }
                }
            }
            match recovery::leave_staging(env, t, TxnState::Aborted, doc! {}).await {
                Ok(true) => return Ok(TxnStatus::Aborted),
                Ok(false) => {}
                Err(e) => {
                    last = crate::server::summarize(&e);
                    continue;
                }
            }
            let status = match record::load(&env.store, t).await {
                // Refused for good: it never committed, whatever became of its record.
                Ok(None) if refused => record::fence_record(&env.store, t, txn.deadline).await,
                Ok(None) => {
                    // Its record may have arrived staging, been committed by a resolver who found
                    // every participant in place, been finished and deleted.
                    return Err(TxnError::CommitUnknown {
                        txn: t,
                        cause: "its record is gone and an apply's reply was lost".into(),
                    });
                }
                Ok(Some(found)) => record::status_of(&found).map_err(HoldError::new),
                Err(e) => Err(e),
            };
            match status {
                Ok(TxnStatus::Pending { .. }) => {}
                Ok(status) => return Ok(status),
                Err(e) => last = e.to_string(),
            }
        }
        Err(TxnError::CommitUnknown {
            txn: t,
            cause: format!("the transaction could not be aborted: {last}"),
        })
    }

    /// Writes the record: an upsert that keeps a record already there and creates a missing one
    /// `staging` while the server's clock is before the deadline, `aborted` after (so a late copy
    /// of it is harmless). Resent after a transient error.
    async fn write_record(&self, txn: &ActiveTransaction) -> RecordSent {
        let mut ambiguous = false;
        let staging = self.send_record(txn, &mut ambiguous).await;
        RecordSent { staging, ambiguous }
    }

    async fn send_record(
        &self,
        txn: &ActiveTransaction,
        ambiguous: &mut bool,
    ) -> Result<TxnState, TxnError> {
        let env = self.env;
        let t = txn.id;
        env.point(Some(t), failpoint::BEGIN_BEFORE, 0)?;
        let records = env.records(Some(t)).await?;
        let entries = bson::to_bson(&txn.entries).map_err(|e| TxnError::Malformed {
            txn: t,
            reason: e.to_string(),
        })?;
        let keep_or = |field: &str, value: Bson| doc! { "$ifNull": [format!("${field}"), value] };
        let state = doc! { "$cond": [
            { "$lte": ["$$NOW", txn.deadline] },
            TxnState::Staging.as_str(),
            TxnState::Aborted.as_str(),
        ] };
        let update = vec![doc! { "$addFields": {
            format::FIELD: keep_or(format::FIELD, txn.format.into()),
            record::STATE: keep_or(record::STATE, state.into()),
            "created": keep_or("created", txn.created.into()),
            record::DEADLINE: keep_or(record::DEADLINE, txn.deadline.into()),
            // Literal: user values in the entries must not be read as expressions.
            record::ENTRIES: keep_or(record::ENTRIES, doc! { "$literal": entries }.into()),
        } }];
        let mut last = None;
        let mut pace = Retry::until_deadline(self.options.retry);
        for send in 0..RECORD_SENDS {
            if send > 0 {
                pace.pause().await;
            }
            match records
                .find_one_and_update(doc! { "_id": t }, update.clone())
                .upsert(true)
                .return_document(ReturnDocument::After)
                .projection(doc! { record::STATE: 1 })
                .await
            {
                Ok(stored) => {
                    env.point(Some(t), failpoint::BEGIN_AFTER, 0)?;
                    let state = stored
                        .as_ref()
                        .and_then(|s| s.get(record::STATE).cloned())
                        .and_then(|state| bson::from_bson::<TxnState>(state).ok());
                    return state.ok_or_else(|| TxnError::Malformed {
                        txn: t,
                        reason: "the record's write returned no state".into(),
                    });
                }
                Err(e) if is_transient(&e) => {
                    *ambiguous = true;
                    last = Some(e);
                }
                Err(e) => {
                    // Only a refusal before anything was written says the record is not there. A
                    // write concern error comes after the write (on a primary whose majority did
                    // not confirm it in time): a resolver may already have found the record
                    // staging with every participant in place and committed it.
                    if !refused_before_writing(&e) {
                        *ambiguous = true;
                    }
                    return Err(TxnError::database(Some(t), "write the record", e));
                }
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

    /// The applies of the one-round commit: every entry's failpoint first, in order (a crash stops
    /// that entry and every later one, as a dead process sends nothing more), then all at once the
    /// changes of existing documents together (one message where the server allows it: see
    /// `write::run_together`) and each create on its own; then each apply settles on its own
    /// (reading back, retrying, reporting holders). One result per entry sent, in order, and the
    /// crash that stopped the rest, if one did.
    async fn apply_round(
        &self,
        t: ObjectId,
        txn: &ActiveTransaction,
    ) -> Vec<Result<Applied, TxnError>> {
        let env = self.env;
        // Every failpoint before anything that can wait, so that all of them come before the
        // record's own.
        let (passed, crash) = env.points(Some(t), failpoint::APPLY_BEFORE, txn.entries.len());
        let mut results: Vec<Option<Result<Applied, TxnError>>> =
            (0..passed).map(|_| None).collect();
        let mut batch = Vec::new();
        let mut creates = Vec::new();
        for (i, entry) in txn.entries[..passed].iter().enumerate() {
            match env.collection(Some(t), &entry.coll).await {
                Ok(coll) => {
                    let write = entry.apply(t, txn.deadline, txn.format);
                    if matches!(write, write::Write::Create(..)) {
                        creates.push((i, (coll, write)));
                    } else {
                        batch.push((i, (coll, write)));
                    }
                }
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        let (indices, writes): (Vec<usize>, Vec<_>) = batch.into_iter().unzip();
        let batched = async {
            let sent = write::run_together(&env.store, &writes).await;
            join_all(
                indices
                    .iter()
                    .zip(&writes)
                    .zip(sent)
                    .map(|((&i, write), sent)| {
                        self.apply(
                            t,
                            txn.deadline,
                            i,
                            &txn.entries[i],
                            write,
                            Some(sent),
                            false,
                        )
                    }),
            )
            .await
        };
        let created = join_all(creates.iter().map(|(i, write)| {
            self.apply(t, txn.deadline, *i, &txn.entries[*i], write, None, false)
        }));
        let (batched, created) = futures::join!(batched, created);
        let settled = indices
            .iter()
            .copied()
            .zip(batched)
            .chain(creates.iter().map(|(i, _)| *i).zip(created));
        for (i, result) in settled {
            results[i] = Some(result);
        }
        results
            .into_iter()
            .map(|result| {
                result.unwrap_or_else(|| {
                    Err(TxnError::Malformed {
                        txn: t,
                        reason: "an apply of the round went unanswered".into(),
                    })
                })
            })
            .chain(crash.map(Err))
            .collect()
    }

    /// Applies entry `i` of transaction `t` with `write` (its apply, and the collection it runs
    /// on), once its failpoint has passed; `sent` is the result of a first send the round made
    /// already. With `wait`, waits (bounded) for documents held by live transactions, else
    /// reports them.
    #[allow(clippy::too_many_arguments)]
    async fn apply(
        &self,
        t: ObjectId,
        deadline: DateTime,
        i: usize,
        entry: &Entry,
        (coll, write): &(Collection<Document>, write::Write),
        mut sent: Option<mongodb::error::Result<u64>>,
        wait: bool,
    ) -> Result<Applied, TxnError> {
        let env = self.env;
        let mut waiting = Retry::until_deadline(self.store.lock_wait());
        let mut last_holder = None;
        // A send without an answer may still run later: then a refusal is not final.
        let mut ambiguous = false;
        let mut retries = 0;
        let locked = |holder, waited| RepoError::Locked {
            collection: entry.coll.clone(),
            id: show_id(&entry.id),
            holder,
            waited,
        };
        let applied = loop {
            let sent = match (sent.take(), write) {
                (Some(sent), _) => sent,
                (None, write::Write::Create(..)) => match write::create(coll, write).await {
                    // A copy that ran after the deadline counts for nothing: resolvers may have
                    // decided without it. The document it made is this transaction's to undo.
                    Ok(Some(created)) if !created_in_time(&created) => break Applied::Late(false),
                    Ok(created) => Ok(u64::from(created.is_some())),
                    Err(e) => Err(e),
                },
                (None, other) => write::run(coll, other).await,
            };
            let diagnosis = match sent {
                Ok(1) => break Applied::Yes,
                Ok(_) => match self.diagnose(t, deadline, entry).await {
                    // Refused after the deadline (or fenced): final, unless an earlier send
                    // of it is still on its way.
                    Err(TxnError::Expired { .. }) => break Applied::Late(false),
                    other => other?,
                },
                Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) => {
                    match codes::duplicate_key_index(&e).filter(|index| index != "_id_") {
                        Some(index) => {
                            break Applied::Failed(
                                RepoError::DuplicateKey {
                                    collection: entry.coll.clone(),
                                    id: show_id(&entry.id),
                                    index,
                                },
                                false,
                            )
                        }
                        None => self.diagnose(t, deadline, entry).await?,
                    }
                }
                // The write may or may not have landed: the document says which.
                Err(e) if is_transient(&e) => {
                    ambiguous = true;
                    self.diagnose(t, deadline, entry).await?
                }
                Err(e) => return Err(TxnError::database(Some(t), "apply", e)),
            };
            match diagnosis {
                Diagnosis::Landed => break Applied::Yes,
                Diagnosis::Fail(e) => break Applied::Failed(e, false),
                Diagnosis::Retry => {
                    retries += 1;
                    if retries > APPLY_RETRIES {
                        break Applied::Failed(locked(last_holder, waiting.elapsed()), false);
                    }
                }
                Diagnosis::Held(holder) => {
                    if last_holder != Some(holder) {
                        metrics::holds_met(&entry.coll, Access::Write, 1);
                    }
                    let settled = resolve::settle(self.store, &entry.coll, &entry.id, holder)
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
                        break Applied::Blocked(holder, false);
                    }
                    if waiting.exhausted() {
                        break Applied::Failed(locked(Some(holder), waiting.elapsed()), false);
                    }
                    waiting.pause().await;
                }
            }
        };
        env.point(Some(t), failpoint::APPLY_AFTER, i)?;
        Ok(match applied {
            Applied::Failed(e, _) => Applied::Failed(e, ambiguous),
            Applied::Blocked(holder, _) => Applied::Blocked(holder, ambiguous),
            Applied::Late(_) => Applied::Late(ambiguous),
            yes => yes,
        })
    }

    /// Reads the document after an apply that did not (visibly) land and says what happened.
    async fn diagnose(
        &self,
        t: ObjectId,
        deadline: DateTime,
        entry: &Entry,
    ) -> Result<Diagnosis, TxnError> {
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
        if sys.plain {
            return self.diagnose_plain(t, deadline, entry, sys.version).await;
        }
        if sys.active_txn == Some(t) {
            if held::read_hold(&stored).map_err(malformed)?.fence {
                // A resolver fenced it after our deadline and is aborting us.
                return Err(TxnError::Expired { txn: t });
            }
            if is_insert && !created_in_time(&stored) {
                return Err(TxnError::Expired { txn: t });
            }
            return Ok(Diagnosis::Landed);
        }
        if let Some(holder) = sys.active_txn {
            // Only a pending insert can give the id back; anything else keeps it taken.
            if is_insert && held::read_hold(&stored).map_err(malformed)?.op != HoldKind::Insert {
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
            contention::conflict(self.store, &entry.coll, &entry.id);
            return Ok(Diagnosis::Fail(RepoError::VersionConflict {
                collection: entry.coll.clone(),
                id: shown,
                expected: entry.expected,
                actual: sys.version,
            }));
        }
        self.past_deadline(t, deadline).await?;
        Ok(Diagnosis::Retry)
    }

    /// What an apply that met a plain document (no system fields) should do: an insert meets a
    /// taken id; a guard stamps the document (it holds any version) and tries again; any other
    /// entry expected a stamped version (entries staged on plain documents were stamped before
    /// the round), so the document was replaced by a plain one meanwhile: a conflict.
    async fn diagnose_plain(
        &self,
        t: ObjectId,
        deadline: DateTime,
        entry: &Entry,
        fingerprint: i64,
    ) -> Result<Diagnosis, TxnError> {
        let shown = show_id(&entry.id);
        if matches!(entry.op, Op::Insert { .. }) {
            return Ok(Diagnosis::Fail(RepoError::DuplicateId {
                collection: entry.coll.clone(),
                id: shown,
            }));
        }
        if entry.rewrites_plain() && fingerprint == entry.expected {
            // The content is the one read: the apply was refused for its time guard.
            self.past_deadline(t, deadline).await?;
            return Ok(Diagnosis::Retry);
        }
        if !entry.is_guard() {
            contention::conflict(self.store, &entry.coll, &entry.id);
            return Ok(Diagnosis::Fail(RepoError::VersionConflict {
                collection: entry.coll.clone(),
                id: shown,
                expected: entry.expected,
                actual: fingerprint,
            }));
        }
        let Some(spec) = self.store.spec_of(&entry.coll) else {
            return Ok(Diagnosis::Fail(RepoError::Malformed {
                collection: entry.coll.clone(),
                id: shown,
                reason: "a plain document of a collection this store has not opened".into(),
            }));
        };
        let coll = self.env.collection(Some(t), &entry.coll).await?;
        match plain::stamp(self.store, &coll, &spec, &entry.id, None).await {
            Ok(_) => Ok(Diagnosis::Retry),
            Err(e) => Ok(Diagnosis::Fail(e)),
        }
    }

    /// `Expired` once the deadline has passed (this process's estimate of server time): a free
    /// document at the expected version then refused the apply for its time guard.
    async fn past_deadline(&self, t: ObjectId, deadline: DateTime) -> Result<(), TxnError> {
        if self.env.now(Some(t)).await? >= deadline {
            return Err(TxnError::Expired { txn: t });
        }
        Ok(())
    }
}

/// What follows an implicit commit: the commit point (so that readers need not check the
/// participants), then every document freed and the record deleted.
async fn complete(env: &Env, txn: &ActiveTransaction) -> Result<(), TxnError> {
    let t = txn.id;
    env.point(Some(t), failpoint::COMMIT_BEFORE, 0)?;
    let written = recovery::retry_transient("write the commit point", || {
        recovery::leave_staging(env, t, TxnState::Committed, doc! {})
    })
    .await
    .map_err(|e| TxnError::database(Some(t), "write the commit point", e))?;
    if !written {
        // Someone who met it decided it first; every participant was in place, so committed.
        tracing::debug!(txn = %t, "commit point written by a resolver");
    }
    env.point(Some(t), failpoint::COMMIT_AFTER, 0)?;
    recovery::finish_all(env, txn, COORDINATOR).await
}

/// Whether the server (or the driver) refused the record's write before carrying it out, so that
/// it certainly did not happen: the client's own refusal of a malformed command, failed
/// authentication, or a command or write error the server answered instead of writing (`ok: 0`).
/// Not so: a write concern error (the primary wrote it, its majority did not confirm it in
/// time), a duplicate key (another copy of the upsert created the record), or an answer the
/// driver could not read: the record may be there.
fn refused_before_writing(error: &mongodb::error::Error) -> bool {
    use mongodb::error::{ErrorKind, WriteFailure};
    const DUPLICATE_KEY: i32 = 11000;
    // The write concern failures a server may report as a command error (64 WriteConcernFailed,
    // 79 UnknownReplWriteConcern, 100 UnsatisfiableWriteConcern) after the write.
    const CONCERN: [i32; 3] = [64, 79, 100];
    match error.kind.as_ref() {
        ErrorKind::InvalidArgument { .. } | ErrorKind::Authentication { .. } => true,
        ErrorKind::Write(WriteFailure::WriteError(refused)) => refused.code != DUPLICATE_KEY,
        ErrorKind::Command(refused) => {
            refused.code != DUPLICATE_KEY && !CONCERN.contains(&refused.code)
        }
        _ => false,
    }
}

/// Whether a document created by an apply was created at or before its transaction's deadline
/// (server time): judged by [`Hold::created_late`](held::Hold::created_late) on the stored hold,
/// the very fact readers, writers and the GC judge it by, so that the coordinator never counts a
/// creation they do not (or the other way round).
fn created_in_time(created: &bson::Document) -> bool {
    held::read_hold(created).is_ok_and(|hold| hold.at.is_some() && !hold.created_late())
}
