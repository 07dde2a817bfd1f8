//! The parallel strategy: batches of one service whose declared keys do not conflict go to the
//! ledger together; of two that conflict, the older is final at the ledger (committed or
//! invalid) before the younger is sent. A batch that declares no keys conflicts with every
//! batch of its service, so a parallel service whose batches declare nothing behaves as a serial
//! one.
//!
//! There is no slot: the batches themselves say what is in flight. A batch **went** while a
//! submitter has it (`submitted`), once a claimant found it clear to send (`sent`, never taken
//! back: the ledger may take a batch after the monitor recorded it unknown, or forget one it had),
//! or while the ledger has or had it (pending, valid, committed, invalid). A submitter takes a
//! batch in three round trips:
//!
//! 1. **claim** it and mark it submitted, on the same conditions as a serial claim (not at or
//!    done with the ledger, not with a submitter, unclaimed or its claim expired, its stamp
//!    unchanged, the server's clock before the claim's expiry), and only if it is a batch of a
//!    parallel service;
//! 2. **count**, from the stored keys, the older batches of the service it conflicts with that
//!    the ledger is not done with, and the younger ones it conflicts with that went. Otherwise the
//!    claim is given back;
//! 3. both zero: **mark it sent**, only while the claim is still its own and live by the
//!    server's clock. Then it goes.
//!
//! Why two conflicting batches never overlap, nor go out of order: say A is older than B. B's
//! count comes after B was marked submitted, and B is marked sent before it goes, with no moment
//! between in which it does not count as gone. If B's count sees A (inserted and not done), B
//! waits. If not, A was inserted after B's count, so after B was marked submitted, and everything
//! that looks at A later (its adder's check, its claimants' counts) finds B went, whatever the
//! ledger or the monitor said of B since: A's adder stamps A again, after B (their adds
//! overlapped: A's stamp was drawn before B's, its insert came after B's count), and a claimant
//! of A waits. So of two conflicting batches the one that goes first is the older by the stamps
//! they end with, and the younger goes only once the older is done.
//!
//! Recovery follows the serial queue: a new batch whose adder died before stamping it again is
//! stamped again by a claimant that finds a younger conflicting batch sent; an unknown or delayed
//! batch never marked sent that finds an older conflicting batch open, or a younger one sent,
//! was never sent at all (its claimant died after counting) and becomes a new batch again. A
//! batch marked sent keeps its stamp: an older conflicting batch that finds it sent moves after
//! it instead.

use std::time::Duration;

use bson::{doc, DateTime, Document};
use mongodb::options::ReturnDocument;

use crate::queue::claim::{after, older_open, unclaim_submitted, Claim, Claimed, Previous, Terms};
use crate::queue::db::{self, check_service, db_error, guarded, writes};
use crate::queue::error::QueueError;
use crate::queue::model::{Batch, BatchStatus, Keys, Place, Strategy, AT_LEDGER};
use crate::queue::stamp;
use crate::queue::store::{before_parallel_format, NewBatch, PARALLEL_FORMAT};
use crate::queue::Batches;
use crate::repo::format::{self, mark_update};
use crate::repo::names::{name_problem, shown};
use crate::server::codes;

/// The stored names of [`AT_LEDGER`], for filters.
fn at_ledger() -> Vec<&'static str> {
    AT_LEDGER.map(BatchStatus::as_str).to_vec()
}

/// How many times adding a batch stamps it again before giving up (as the serial add).
const STAMPS: u32 = 32;

/// How many times (5 ms apart) adding a batch looks again at a claimant deciding whether it
/// goes, before giving up: 2 s, many times a claim's three round trips.
const CLAIM_WAITS: u32 = 400;

/// Filter: batches that conflict with a batch declaring `keys` (all of them when it declares
/// none).
pub(crate) fn conflicting(keys: Option<&Keys>) -> Document {
    let Some(keys) = keys else {
        return Document::new();
    };
    let mut either = vec![doc! { "keys": { "$exists": false } }];
    let touched = keys.touched();
    if !touched.is_empty() {
        either.push(doc! { "keys.writes": { "$in": touched } });
    }
    if !keys.writes().is_empty() {
        either.push(doc! { "keys.reads": { "$in": keys.writes() } });
    }
    doc! { "$or": either }
}

/// Filter: `filter` and `more` both.
fn both(filter: Document, more: Document) -> Document {
    if more.is_empty() {
        return filter;
    }
    doc! { "$and": [filter, more] }
}

/// Filter: the older batches of `service` conflicting with the one at `place` that the ledger
/// is not done with.
fn older_conflicting(service: &str, place: &Place, keys: Option<&Keys>) -> Document {
    both(older_open(service, place), conflicting(keys))
}

/// Filter: the younger batches of `service` conflicting with the one at `place` that went
/// (`surely`: only those that were sent or the ledger has or had, leaving out those a submitter
/// merely claimed).
fn younger_went(service: &str, place: &Place, keys: Option<&Keys>, surely: bool) -> Document {
    let mut went = vec![
        doc! { "sent": true },
        doc! { "status": { "$in": at_ledger() } },
    ];
    if !surely {
        went.push(doc! { "submitted": true });
    }
    both(
        both(after(service, place), conflicting(keys)),
        doc! { "$or": went },
    )
}

async fn count(queue: &Batches, header: &str, filter: Document) -> Result<u64, QueueError> {
    queue
        .coll
        .count_documents(filter)
        .await
        .map_err(|e| db::db_error(queue, header, "claim", e))
}

/// The body of [`Batches::claim`](crate::queue::Batches::claim) for a batch of a parallel
/// service (see the module's doc).
pub(crate) async fn claim(
    queue: &Batches,
    batch: &Batch,
    terms: &Terms<'_>,
) -> Result<Claimed, QueueError> {
    let header = batch.header.as_str();
    let Terms {
        token,
        until,
        now,
        deadline,
        writes,
        ..
    } = *terms;
    // Round 1: the claim, which also tells the others this batch may be going.
    let parallel = doc! { "strategy": Strategy::Parallel.as_str() };
    let found = queue
        .coll
        .find_one_and_update(
            guarded(queue, terms.claimable(batch, parallel)),
            terms.claiming(),
        )
        .return_document(ReturnDocument::Before)
        .await
        .map_err(|e| db::db_error(queue, header, "claim", e))?;
    let Some(found) = found else {
        // Only a batch that is not there, or of a newer format, is an error.
        db::check_batch(queue, &db::stored(queue, header).await?)?;
        return Ok(Claimed::Unavailable);
    };
    let stored = db::parse(queue, &found)?;
    let place = Place::of(&stored);
    let service = stored.service_id.as_str();
    let keys = stored.keys.as_ref();
    // Round 2: what must go first, counted after the claim landed (the claimant's half of the
    // ordering), from the keys as stored.
    let (older, younger) = tokio::join!(
        count(queue, header, older_conflicting(service, &place, keys)),
        count(queue, header, younger_went(service, &place, keys, false)),
    );
    let (older, younger) = (older?, younger?);
    if older == 0 && younger == 0 {
        // Round 3: marked sent, for good, while the claim is still this one's and live.
        let marked = queue
            .coll
            .update_one(
                guarded(
                    queue,
                    doc! {
                        "_id": header,
                        "claim.token": token,
                        "$expr": { "$lt": ["$$NOW", until] },
                    },
                ),
                mark_update(doc! { "$set": { "sent": true } }, writes),
            )
            .await
            .map_err(|e| db::db_error(queue, header, "claim", e))?;
        if marked.matched_count == 0 {
            // The claim ran out (or was taken over) meanwhile: nothing is sent under it, and
            // the monitor asks the ledger about the batch once it has expired.
            return Ok(Claimed::Unavailable);
        }
        let content = found.get_str("content").unwrap_or_default().to_string();
        let mut batch = stored;
        batch.submitted = true;
        batch.last_submitted_at = Some(now.to_chrono());
        return Ok(Claimed::Yes(Claim {
            batch,
            content,
            token,
            deadline,
        }));
    }
    tracing::debug!(
        header,
        service,
        older,
        younger,
        "a conflicting batch goes first"
    );
    // A younger conflicting batch sent went ahead of this one: this one's adder died before
    // stamping it again. Only those count: a younger batch merely claimed may give its claim
    // back because of this very batch.
    let passed = match younger {
        0 => 0,
        _ => count(queue, header, younger_went(service, &place, keys, true)).await?,
    };
    // An unknown or delayed batch never marked sent that an older conflicting batch is open
    // before, or that a younger one passed, was never sent (see the module's doc): it becomes a
    // new batch.
    let sent = found.get_bool("sent").unwrap_or(false);
    let reset = (older > 0 || passed > 0)
        && !sent
        && matches!(
            stored.status,
            Some(BatchStatus::Unknown | BatchStatus::Delayed)
        );
    let previous = Previous {
        at: found.get_datetime("last_submitted_at").ok().copied(),
        status: stored.status,
        reset,
    };
    unclaim_submitted(queue, header, token, previous, writes).await?;
    // And one that was passed goes after what passed it.
    if passed > 0 && !sent {
        stamp_again(queue, service, &place, writes).await?;
    }
    Ok(Claimed::OlderFirst)
}

/// Stamps the batch at `place` again (see [`stamp::stamp_again`]), only while it was never marked
/// sent (so never sent: an unknown it carries is a monitor's answer about a claim that died
/// before it was clear to send, and is dropped) and the ledger never had it.
async fn stamp_again(
    queue: &Batches,
    service: &str,
    place: &Place,
    writes: i64,
) -> Result<Option<DateTime>, QueueError> {
    let condition = doc! {
        "sent": { "$exists": false },
        "status": { "$nin": at_ledger() },
    };
    stamp::stamp_again(queue, service, place, condition, writes).await
}

/// The adder's half of the ordering, once a batch of a parallel service is inserted: a younger
/// conflicting batch that went (its add overlapping this one, its stamp drawn later) may have
/// missed this one in its count. Then this one is stamped again, after it. `again`: the batch
/// was found stored by a later add (the first died or failed before this check), and may carry
/// a monitor's word or a claim: what is returned is read back.
pub(crate) async fn place_after_went(
    queue: &Batches,
    batch: &NewBatch,
    created_at: DateTime,
    writes: i64,
    again: bool,
) -> Result<Batch, QueueError> {
    let header = batch.header.as_str();
    let service = batch.service_id.as_str();
    let mut place = Place {
        at: created_at.timestamp_millis(),
        header: header.to_string(),
    };
    let keys = batch.keys.as_ref();
    let (mut stamps, mut waits) = (0, 0);
    while stamps < STAMPS && waits < CLAIM_WAITS {
        let went = count(queue, header, younger_went(service, &place, keys, false)).await?;
        if went == 0 && again {
            return db::parse(queue, &db::stored(queue, header).await?);
        }
        if went == 0 {
            return Ok(batch.unsent(place.at, Strategy::Parallel));
        }
        if let Some(again) = stamp_again(queue, service, &place, writes).await? {
            place.at = again.timestamp_millis();
            stamps += 1;
            continue;
        }
        let found = db::stored(queue, header).await?;
        let stored = db::parse(queue, &found)?;
        // Sent, or at the ledger: its claimant found its place right.
        let at_ledger = stored.status.is_some_and(BatchStatus::at_ledger);
        if at_ledger || found.get_bool("sent").unwrap_or(false) {
            return Ok(stored);
        }
        if stored.submitted {
            // A claimant is counting; whether it goes or gives the claim back, the next look
            // knows. (Returning now could leave it to be stamped again after this add
            // returned, behind batches added later.)
            waits += 1;
        } else {
            // Stamped again by a claimant.
            place.at = stored.created_at.timestamp_millis();
            stamps += 1;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Err(QueueError::Contended {
        collection: queue.name.clone(),
        header: header.to_string(),
        what: "add",
        tries: stamps + waits,
    })
}

/// The body of [`Batches::set_strategy`]: only while no batch of the service has drawn a stamp
/// (the draw and this write are on the same document, so one of them comes first).
pub(crate) async fn set_strategy(
    queue: &Batches,
    service: &str,
    strategy: Strategy,
) -> Result<(), QueueError> {
    if let Some(problem) = name_problem(service) {
        return Err(QueueError::Invalid {
            collection: queue.name.clone(),
            reason: format!("the service id {} is unusable: {problem}", shown(service)),
        });
    }
    let writes = writes(queue).await?;
    if strategy == Strategy::Parallel && writes < PARALLEL_FORMAT {
        return Err(before_parallel_format(
            queue,
            "the parallel strategy and its batches",
            writes,
        ));
    }
    let set = queue
        .services
        .update_one(
            guarded(
                queue,
                doc! { "_id": service, "newest": { "$exists": false } },
            ),
            format::mark_update(doc! { "$set": { "strategy": strategy.as_str() } }, writes),
        )
        .upsert(true)
        .await;
    match set {
        Ok(_) => return Ok(()),
        // The service has drawn a stamp (or is of a newer format): only its document says.
        Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) => {}
        Err(e) => return Err(db_error(queue, "*", "set the strategy", e)),
    }
    let found = queue
        .services
        .find_one(doc! { "_id": service })
        .await
        .map_err(|e| db_error(queue, "*", "set the strategy", e))?;
    let Some(found) = found else {
        return Err(QueueError::Contended {
            collection: queue.name.clone(),
            header: "*".to_string(),
            what: "set the strategy (the service changed meanwhile)",
            tries: 1,
        });
    };
    check_service(queue, &found)?;
    let current = Strategy::parse(found.get_str("strategy").ok());
    if current == Some(strategy) {
        return Ok(());
    }
    Err(QueueError::Invalid {
        collection: queue.name.clone(),
        reason: format!(
            "the service {} has batches already, sent by the {} strategy: a service's strategy is chosen before its first batch",
            shown(service),
            current.map_or("unknown", Strategy::as_str)
        ),
    })
}
