//! Resolving transactions whose deadline has passed, which is the GC's job (and anyone's who
//! meets one of their holds): a staging transaction is decided (committed if every participant
//! is in place, else fenced and aborted), then finished or rolled back through `recovery`.

use std::collections::HashMap;

use bson::{doc, oid::ObjectId, DateTime, Document};
use futures::StreamExt;

use crate::repo::format;
use crate::repo::hold::record::{self, TxnState};
use crate::repo::hold::{resolve, staging};
use crate::repo::outcome::TxnStatus;
use crate::txn::error::TxnError;
use crate::txn::failpoint::{self};
use crate::txn::recovery::{
    finish_all, finish_many, load, rollback_all, rollback_many, Deletion, Env, COLLECTOR,
};
use crate::txn::worklist::ActiveTransaction;

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

/// Resolves many expired transactions at once (a GC page): the staging ones are decided,
/// `parallel` at a time; then every committed one is finished in one round of writes and every
/// aborted one rolled back in another, and their records go in one command each. `found` are
/// the records as read. Returns each transaction's resolution; `Err` only for an injected crash.
pub(crate) async fn resolve_expired_many(
    env: &Env,
    found: Vec<Document>,
    now: DateTime,
    parallel: usize,
) -> Result<Vec<(ObjectId, Result<Resolution, TxnError>)>, TxnError> {
    let mut out = Vec::new();
    let mut committed: Vec<ActiveTransaction> = Vec::new();
    let mut aborted: Vec<ActiveTransaction> = Vec::new();
    let mut staging: Vec<(ActiveTransaction, Document)> = Vec::new();
    for record in found {
        let Ok(t) = record.get_object_id("_id") else {
            continue;
        };
        // A record of a newer format is left to the instances that read it.
        let records = env.store.transactions_collection();
        if let Err(newer) = format::check_doc(&record, env.store.reads_format(), records) {
            out.push((t, Err(newer.into())));
            continue;
        }
        let txn = match bson::from_document::<ActiveTransaction>(record.clone()) {
            Ok(txn) => txn,
            Err(e) => {
                out.push((
                    t,
                    Err(TxnError::Malformed {
                        txn: t,
                        reason: e.to_string(),
                    }),
                ));
                continue;
            }
        };
        if txn.deadline > now {
            out.push((t, Ok(Resolution::NotExpired)));
            continue;
        }
        match txn.state {
            TxnState::Committed => committed.push(txn),
            TxnState::Aborted => aborted.push(txn),
            TxnState::Staging => staging.push((txn, record)),
        }
    }
    let (together, staging) = decide_together(env, staging).await?;
    let decided: Vec<_> = futures::stream::iter(staging)
        .map(|(txn, record)| async move {
            let decided = decide_staging(env, txn.id, &record).await;
            (txn, decided)
        })
        .buffer_unordered(parallel.max(1))
        .collect()
        .await;
    // Decided together or alone, each is acted on as its record says (someone else may have
    // decided it meanwhile).
    for (mut txn, decided) in together.into_iter().chain(decided) {
        match decided {
            Ok(TxnStatus::Committed) => {
                txn.state = TxnState::Committed;
                committed.push(txn);
            }
            Ok(TxnStatus::Aborted) => {
                txn.state = TxnState::Aborted;
                aborted.push(txn);
            }
            // A participant is held by another live transaction: next round.
            Ok(TxnStatus::Pending { .. }) => out.push((txn.id, Ok(Resolution::NotExpired))),
            Ok(TxnStatus::Absent) => out.push((txn.id, Ok(Resolution::Gone))),
            Err(crash) if crash.is_crash() => return Err(crash),
            Err(e) => out.push((txn.id, Err(e))),
        }
    }
    let committed: Vec<&ActiveTransaction> = committed.iter().collect();
    let aborted: Vec<&ActiveTransaction> = aborted.iter().collect();
    let (finished, rolled_back) = futures::join!(
        finish_many(env, &committed, COLLECTOR),
        rollback_many(env, &aborted, COLLECTOR, Deletion::AfterDeadline),
    );
    let (finished, rolled_back) = (finished?, rolled_back?);
    for (txn, result) in committed.iter().zip(finished) {
        out.push((txn.id, result.map(|()| Resolution::Finished)));
    }
    for (txn, result) in aborted.iter().zip(rolled_back) {
        // Undone; a record that stays waits for the server's clock to pass its deadline.
        let resolution = |gone| {
            if gone {
                Resolution::RolledBack
            } else {
                Resolution::NotExpired
            }
        };
        out.push((txn.id, result.map(resolution)));
    }
    Ok(out)
}

/// Decides a page of expired staging transactions together where that is plain: their
/// participants are read in one command per collection; those with every participant applied
/// are committed in one write; those missing one get a fence on the first missing one (all at
/// once) and are aborted in one more write. Returns the decided ones with what their records say
/// then, beside the rest (a fence that could not be put, a participant held by another
/// transaction, a failed read), which are decided one by one. A decided abort whose record says
/// committed (someone committed and freed it before the fence went up) has its fence removed.
async fn decide_together(
    env: &Env,
    staging: Vec<(ActiveTransaction, Document)>,
) -> Result<Decided, TxnError> {
    if staging.is_empty() {
        return Ok((Vec::new(), staging));
    }
    let records: Vec<&Document> = staging.iter().map(|(_, record)| record).collect();
    let firsts = match staging::first_missing(&env.store, &records).await {
        Ok(firsts) => firsts,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the participants of expired staging transactions together; deciding them one by one");
            return Ok((Vec::new(), staging));
        }
    };
    let mut complete = Vec::new();
    let mut open = Vec::new();
    let mut rest = Vec::new();
    for (txn, record) in staging {
        match firsts.get(&txn.id).copied() {
            Some(None) => complete.push((txn, record)),
            Some(Some(i)) => match record::participants(&record) {
                Ok(all) if i < all.len() => {
                    let participant = all[i].clone();
                    open.push((txn, record, i, participant));
                }
                _ => rest.push((txn, record)),
            },
            None => rest.push((txn, record)),
        }
    }
    let fenced: Vec<_> = futures::stream::iter(open)
        .map(|(txn, record, i, participant)| async move {
            env.point(Some(txn.id), failpoint::GC_FENCE_BEFORE, i)?;
            let placed = staging::fence(&env.store, txn.id, &participant, txn.deadline).await;
            if placed.is_ok() {
                env.point(Some(txn.id), failpoint::GC_FENCE_AFTER, i)?;
            }
            Ok::<_, TxnError>((txn, record, participant, placed))
        })
        .buffer_unordered(FENCES_AT_ONCE)
        .collect()
        .await;
    let mut aborting = Vec::new();
    for result in fenced {
        let (txn, record, participant, placed) = result?;
        match placed {
            Ok(true) => aborting.push((txn, record, participant)),
            // Taken meanwhile (the late apply, another transaction, another resolver's fence):
            // the one-by-one path looks again.
            Ok(false) => rest.push((txn, record)),
            Err(e) => {
                tracing::debug!(txn = %txn.id, error = %e, "a fence failed; deciding it alone");
                rest.push((txn, record));
            }
        }
    }
    let commit_ids: Vec<ObjectId> = complete.iter().map(|(txn, _)| txn.id).collect();
    let abort_ids: Vec<ObjectId> = aborting.iter().map(|(txn, _, _)| txn.id).collect();
    for t in commit_ids.iter().chain(&abort_ids) {
        env.point(Some(*t), failpoint::GC_CLAIM_BEFORE, 0)?;
    }
    // An abort waits for the records' clock to pass the deadline: only then can no late copy of
    // an apply take effect, nor a late copy of the record be created staging.
    let (committed, aborted) = futures::join!(
        record::decide_many(&env.store, &commit_ids, TxnState::Committed, doc! {}),
        record::decide_many(
            &env.store,
            &abort_ids,
            TxnState::Aborted,
            record::past_deadline()
        ),
    );
    let (committed, aborted) = match (committed, aborted) {
        (Ok(c), Ok(a)) => (c, a),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(error = %e, "could not decide expired staging transactions together; deciding them one by one");
            rest.extend(complete);
            rest.extend(aborting.into_iter().map(|(txn, record, _)| (txn, record)));
            return Ok((Vec::new(), rest));
        }
    };
    for t in commit_ids.iter().chain(&abort_ids) {
        env.point(Some(*t), failpoint::GC_CLAIM_AFTER, 0)?;
    }
    let status = |statuses: &HashMap<ObjectId, TxnStatus>, t: ObjectId| {
        statuses.get(&t).copied().unwrap_or(TxnStatus::Absent)
    };
    let mut decided: Vec<(ActiveTransaction, Result<TxnStatus, TxnError>)> = complete
        .into_iter()
        .map(|(txn, _)| {
            let s = status(&committed, txn.id);
            (txn, Ok(s))
        })
        .collect();
    for (txn, _, participant) in aborting {
        let s = status(&aborted, txn.id);
        if matches!(s, TxnStatus::Committed | TxnStatus::Absent) {
            // Committed and freed before the fence went up, or decided and ended by someone
            // else meanwhile (its record is gone): the fence sits on a document its transaction
            // is done with, and must go.
            let undone = resolve::roll_back(&env.store, &participant.coll, &participant.id, txn.id)
                .await
                .map(|_| s)
                .map_err(|source| TxnError::Resolve {
                    txn: txn.id,
                    source,
                });
            decided.push((txn, undone));
        } else {
            decided.push((txn, Ok(s)));
        }
    }
    Ok((decided, rest))
}

/// What `decide_together` decided (with what the records say), and what it left.
type Decided = (
    Vec<(ActiveTransaction, Result<TxnStatus, TxnError>)>,
    Vec<(ActiveTransaction, Document)>,
);

/// How many fences a page puts at once.
const FENCES_AT_ONCE: usize = 32;

/// Decides the expired staging transaction `t` (record `found`) with the GC's failpoints.
async fn decide_staging(env: &Env, t: ObjectId, found: &Document) -> Result<TxnStatus, TxnError> {
    let point = |name: &'static str, step: usize| {
        let name = match name {
            staging::FENCE_BEFORE => failpoint::GC_FENCE_BEFORE,
            staging::FENCE_AFTER => failpoint::GC_FENCE_AFTER,
            staging::DECIDE_BEFORE => failpoint::GC_CLAIM_BEFORE,
            _ => failpoint::GC_CLAIM_AFTER,
        };
        env.point(Some(t), name, step)
    };
    staging::decide_expired(&env.store, t, found, &point, &|source| TxnError::Resolve {
        txn: t,
        source,
    })
    .await
}

/// Finishes or rolls back transaction `t` if its deadline is at or before `now` (server time).
///
/// A staging transaction is first decided: committed if every participant is in place, else a
/// missing one is fenced and it is aborted (see `repo::hold::staging`). An aborted record stays until
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
                let Some(found) = record::load(&env.store, t)
                    .await
                    .map_err(|source| TxnError::Resolve { txn: t, source })?
                else {
                    return Ok(Resolution::Gone);
                };
                let decided = decide_staging(env, t, &found).await?;
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
