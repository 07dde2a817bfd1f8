//! Taking a batch for submission and recording what became of it.
//!
//! Three documents decide whether a batch may go to the ledger: the batch (its claim, its status,
//! its `submitted` flag) and its service's document in the services collection, which holds the
//! service's **slot** (the one batch of the service that may be at the ledger, with the claim
//! that took it and when that taking runs out) and the **mark** (the place in the service's
//! order, `(created_at, header)`, of the last batch that went).
//!
//! A submitter takes a queued batch in two round trips:
//!
//! 1. **take the slot** of the service, until the claim's `until`: only if it is free, or held
//!    by this very batch under a taking that has run out by the server's clock (a retry of an
//!    unknown or delayed batch, or of a taker that died), and only if the batch comes after the
//!    mark. A slot whose batch the ledger is done with is freed first, moving the mark to that
//!    batch (its monitor may have died before doing so); a slot whose batch never went is freed
//!    once its `until` has passed by the server's clock and the batch is fenced (below).
//! 2. together: **claim** the batch and mark it submitted, only if it is not at or done with
//!    the ledger, not with a submitter, unclaimed or its claim expired, not fenced against this
//!    taking (below), its stamp unchanged, and the server's clock before `until`; and **count**
//!    the service's older batches the ledger is not done with (committed or invalid; a valid
//!    one counts). If the claim failed or the count is not zero (a batch added late with an
//!    older stamp goes first), both are given back: the claim, and the slot as it was before
//!    step 1. Otherwise the batch goes.
//!
//! The slot stays with its batch until the ledger is done with it (committed or invalid). A
//! slot whose batch never went is freed by another taker only once the server's clock has
//! passed the taking's `until` (the claim lands only before it), and only after a **fence**:
//! the taker writes on the batch, only while it is unclaimed and not submitted, an expired claim
//! under the taking's token, and a claim under that token never lands on a batch that carries
//! it. The time only decides when to look; the fence decides, so a clock that steps back (a
//! failover to a primary whose clock is behind, or a batches collection whose clock runs behind
//! the services collection's) lets no claim land after its slot was freed. A taking that
//! replaced this batch's own earlier one (whose batch may be at the ledger: only the claim says)
//! is given back by putting the earlier one back, so a claimant working from an old reading
//! never frees the slot of a batch in flight. The mark moves in the same write that frees the
//! slot of a batch the ledger is done with: whenever the slot is free, the mark is at the last
//! batch that went.
//!
//! Adding a batch runs the other half. Its stamp is drawn from the service's counter before
//! the insert (after the newest stamp, the slot's batch and the mark), so it is never claimable
//! out of its place; after the insert the adder reads the slot and mark once, and a batch
//! stamped at or before either (an overlapping add drew later and its batch was taken
//! meanwhile) is stamped again, after them. Either the adder sees the taken slot, or the taker's
//! count (sent after the slot was taken) sees the added batch: so batches reach the ledger in
//! the order of their final stamps, and a slot held from step 1 until the ledger is done with
//! the batch keeps one batch per service in flight.
//!
//! (Over 700 lines: the two steps, the slot's rules and the give-backs are one argument, and
//! reading them apart would hide which write fences which.)

use std::time::{Duration, Instant};

use bson::oid::ObjectId;
use bson::{doc, DateTime, Document};
use mongodb::options::ReturnDocument;

use crate::queue::db::{self, guarded, parse_status};
use crate::queue::error::QueueError;
use crate::queue::model::{Batch, BatchStatus, Place, Service, Strategy};
use crate::queue::stamp;
use crate::queue::store;
use crate::queue::store::{name_problem, shown};
use crate::queue::Batches;
use crate::repo::format::{mark_update, set_mark};
use crate::server::clock::{minus, plus};
use crate::server::codes;

/// Statuses that end a batch's time at the ledger: a slot held by such a batch is free (the mark
/// moves to it), and it no longer keeps a younger batch of its service waiting. Valid is not
/// one: the ledger may still forget a valid batch (it then says unknown), and the batch must be
/// sent again before any younger one goes.
pub(crate) const DONE: [&str; 2] = ["committed", "invalid"];

/// Statuses a submission can no longer change: settled, or pending (accepted by the ledger, to be
/// decided there). A claim and the record of an answer both need a status outside these.
pub(crate) const DECIDED: [&str; 4] = ["pending", "committed", "valid", "invalid"];

/// The longest claim: a longer one would keep a batch whose submitter died, and with it every
/// later batch of its service, from the ledger for days.
pub const MAX_CLAIM: Duration = Duration::from_secs(24 * 3600);

/// A submitter's hold on one batch: it alone may submit the batch and record the answer,
/// until [`deadline`](Claim::deadline).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The batch as claimed.
    pub batch: Batch,
    /// What to submit.
    pub content: String,
    /// The claim's token: every write of the claimant names it.
    pub token: ObjectId,
    /// An instant of this process's monotonic clock before which the server's clock has
    /// surely not reached the claim's stored expiry: the expiry less the uncertainty of this
    /// process's estimate of the server's time (half the round trip of the `hello` it was
    /// sampled with). Submit only before it: a monitor records the ledger's "unknown" for the
    /// batch only from a question asked after the expiry.
    pub deadline: Instant,
}

impl Claim {
    /// Whether there is time left to submit under this claim.
    pub fn usable(&self) -> bool {
        Instant::now() < self.deadline
    }
}

/// What a submission came to, as the submitter records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submission {
    /// The ledger took the batch: it is pending.
    Accepted,
    /// The ledger did not take it (it said so, or could not be reached): retry after the delay
    /// window.
    Delayed,
}

/// Filter: batches of `service` strictly before `place`.
pub(crate) fn before(service: &str, place: &Place) -> Document {
    beside(service, place, "$lt")
}

/// Filter: batches of `service` strictly after `place`.
pub(crate) fn after(service: &str, place: &Place) -> Document {
    beside(service, place, "$gt")
}

/// Filter: batches of `service` on the `side` (`$lt` or `$gt`) of `place`, by stamp, then
/// header.
fn beside(service: &str, place: &Place, side: &str) -> Document {
    let at = DateTime::from_millis(place.at);
    doc! {
        "service_id": service,
        "$or": [
            { "created_at": { side: at } },
            { "created_at": at, "_id": { side: &place.header } },
        ],
    }
}

/// Filter: batches of `service` before `place` that the ledger is not done with (committed or
/// invalid).
pub(crate) fn older_open(service: &str, place: &Place) -> Document {
    let mut older = before(service, place);
    older.insert("status", doc! { "$nin": DONE.to_vec() });
    older
}

/// Whether the slot's taking has run out by the server's clock (a slot without `until`, from
/// before slots had one, has).
fn taking_ran_out() -> Document {
    doc! { "$lt": [{ "$ifNull": ["$holder.until", null] }, "$$NOW"] }
}

/// Filter: `service`'s slot held by `header` (under `token`, when given).
fn held_by(service: &str, header: &str, token: Option<ObjectId>) -> Document {
    let mut filter = doc! { "_id": service, "holder.header": header };
    if let Some(token) = token {
        filter.insert("holder.token", token);
    }
    filter
}

/// How a claim ended: taken, or why not ([`Batches::claim`](crate::queue::Batches::claim)
/// answers `None` for every reason; the queue's claims metric counts each by its label).
pub(crate) enum Claimed {
    /// Taken: the batch goes to the ledger under this claim.
    Yes(Claim),
    /// The service's slot is held: another of its batches is in flight, or another submitter
    /// has this one.
    SlotTaken,
    /// An older batch of the service must go first.
    OlderFirst,
    /// The batch is with a submitter, at the ledger, or done with it.
    Unavailable,
}

impl Claimed {
    /// The `outcome` label of the claims metric (`crate::metrics::QUEUE_CLAIMS`).
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Claimed::Yes(_) => "claimed",
            Claimed::SlotTaken => "slot_taken",
            Claimed::OlderFirst => "older_first",
            Claimed::Unavailable => "unavailable",
        }
    }

    /// The claim, if the batch was taken.
    pub(crate) fn into_claim(self) -> Option<Claim> {
        match self {
            Claimed::Yes(claim) => Some(claim),
            _ => None,
        }
    }
}

/// The body of [`Batches::claim`].
/// A claim's terms, the same for either strategy: its token, its claimant, its expiry by the
/// server's clock, the estimate of that clock it was made at, the deadline for sending (an
/// instant of this process's clock) and the format its writes are in.
pub(crate) struct Terms<'a> {
    pub token: ObjectId,
    pub claimant: &'a str,
    pub until: DateTime,
    pub now: DateTime,
    pub deadline: Instant,
    pub writes: i64,
}

impl Terms<'_> {
    /// The claim's write on the batch: claimed under these terms and marked submitted. The
    /// estimate of the server's time rather than `$currentDate`: it is matched exactly later,
    /// and some servers keep more than milliseconds of the latter.
    pub(crate) fn claiming(&self) -> Document {
        let mut claiming = doc! {
            "claim": { "token": self.token, "by": self.claimant, "until": self.until },
            "submitted": true,
            "last_submitted_at": self.now,
        };
        claiming.extend(set_mark(self.writes));
        doc! { "$set": claiming }
    }

    /// Filter: `batch` as read, still free to claim under these terms (not at or done with the
    /// ledger, not with a submitter, unclaimed or its claim expired, and only before `until` by
    /// the server's clock: a taker judges a taking abandoned only once it has passed), and
    /// `more`.
    pub(crate) fn claimable(&self, batch: &Batch, more: Document) -> Document {
        let mut filter = doc! {
            "_id": &batch.header,
            "created_at": batch.created_at,
            "submitted": false,
            "status": { "$nin": DECIDED.to_vec() },
            "$or": [
                { "claim": { "$exists": false } },
                { "claim.until": { "$lt": self.now } },
            ],
            "$expr": { "$lt": ["$$NOW", self.until] },
        };
        filter.extend(more);
        filter
    }
}

/// The terms of a claim of `batch` by `claimant` for `ttl`, after checking them (a refusal
/// writes nothing).
pub(crate) async fn terms<'a>(
    queue: &Batches,
    batch: &Batch,
    claimant: &'a str,
    ttl: Duration,
) -> Result<Terms<'a>, QueueError> {
    let header = batch.header.as_str();
    store::check_header(queue, header)?;
    if let Some(problem) = name_problem(claimant) {
        return Err(QueueError::Invalid {
            collection: queue.name.clone(),
            reason: format!(
                "batch {}: the claimant name {} is unusable: {problem}",
                shown(header),
                shown(claimant)
            ),
        });
    }
    // Claims expire by the server's clock in whole milliseconds: a shorter one has expired
    // when it is written, and would leave the batch marked submitted for the monitor to sort
    // out.
    if ttl.as_millis() == 0 || ttl > MAX_CLAIM {
        return Err(QueueError::Invalid {
            collection: queue.name.clone(),
            reason: format!(
                "batch {} for {}: a claim of {ttl:?} is not between 1 ms and {MAX_CLAIM:?}",
                shown(header),
                shown(claimant)
            ),
        });
    }
    let writes = db::writes(queue).await?;
    let token = ObjectId::new();
    // The deadline is an instant of this process's clock by which the server's clock has surely
    // not reached `until`: the estimate of the server's time may be behind by `error`.
    let began = Instant::now();
    let (now, error) = db::now_within(queue).await?;
    let until = plus(now, ttl);
    let deadline = began + ttl.saturating_sub(error);
    Ok(Terms {
        token,
        claimant,
        until,
        now,
        deadline,
        writes,
    })
}

/// The body of [`Batches::claim`] for a batch of a serial service.
pub(crate) async fn claim(
    queue: &Batches,
    batch: &Batch,
    terms: &Terms<'_>,
) -> Result<Claimed, QueueError> {
    let header = batch.header.as_str();
    let Terms {
        token,
        claimant,
        until,
        now,
        deadline,
        writes,
    } = *terms;
    let place = Place::of(batch);
    let service = batch.service_id.as_str();
    // Round 1: the slot, which is also the claim's fence (see the module's doc).
    let taking = Taking {
        token,
        claimant,
        until,
        writes,
    };
    let Some(replaced) = take_slot(queue, service, &place, &taking).await? else {
        after_refused_slot(queue, header, writes).await?;
        return Ok(Claimed::SlotTaken);
    };
    // Round 2: the batch, claimed and marked submitted, while the service's older batches
    // are counted. The count must come after the slot was taken (it is the taker's half of
    // the ordering), not after the claim, so both go together.
    let claim = queue.coll.find_one_and_update(
        guarded(
            queue,
            terms.claimable(
                batch,
                doc! {
                    // A batch of a parallel service (its `Batch` said otherwise) takes no slot.
                    "strategy": { "$exists": false },
                    // Not fenced: a taker that judged this taking of the slot abandoned wrote an
                    // expired claim under its token before freeing the slot (see `fence`),
                    // whatever the clocks say.
                    "claim.token": { "$ne": token },
                },
            ),
        ),
        terms.claiming(),
    );
    let (claimed, waiting) = tokio::join!(
        async { claim.return_document(ReturnDocument::Before).await },
        async {
            queue
                .coll
                .count_documents(older_open(service, &place))
                .await
        }
    );
    let claimed = claimed.map_err(|e| db::db_error(queue, header, "claim", e));
    let waiting = waiting.map_err(|e| db::db_error(queue, header, "claim", e));
    match (claimed, waiting) {
        (Ok(Some(before)), Ok(0)) => {
            let mut batch = db::parse(queue, &before)?;
            let content = before.get_str("content").unwrap_or_default().to_string();
            batch.submitted = true;
            batch.last_submitted_at = Some(now.to_chrono());
            Ok(Claimed::Yes(Claim {
                batch,
                content,
                token,
                deadline,
            }))
        }
        (claimed, waiting) => {
            if let Ok(n @ 1..) = waiting {
                tracing::debug!(header, service, waiting = n, "an older batch goes first");
            }
            // Give back what was taken. Either order leaves something the other roles
            // clear if this process dies in between: a slot runs out at its `until`, a
            // batch marked submitted is asked about once its claim has expired.
            // The batch as the claim found it: its last submission and status.
            let previous = match &claimed {
                Ok(Some(before)) => Some((
                    before.get_datetime("last_submitted_at").ok().copied(),
                    before.get_str("status").ok().and_then(parse_status),
                )),
                _ => None,
            };
            // A batch the ledger does not have (unknown, delayed) that an older batch must
            // precede was never sent in order: either this very step left it marked
            // submitted when its claimant died before giving it back, or the older batch's
            // adder died before stamping it again while this one was away. It becomes a
            // batch like any other, so the older one is queued and goes first (its stamp
            // says so; this one follows it).
            let reset = matches!(waiting, Ok(1..))
                && previous.is_some_and(|(_, status)| {
                    matches!(status, Some(BatchStatus::Unknown | BatchStatus::Delayed))
                });
            let (unclaimed, freed) = tokio::join!(
                async {
                    match previous {
                        Some((at, status)) => {
                            let previous = Previous { at, status, reset };
                            unclaim_submitted(queue, header, token, previous, writes).await
                        }
                        None => Ok(()),
                    }
                },
                give_slot_back(queue, service, header, token, replaced, writes)
            );
            unclaimed?;
            freed?;
            match (claimed?, waiting?) {
                // Not claimable after all: only a batch that is not there, or of a newer
                // format (which the claim's guard did not match), is an error.
                (None, _) => {
                    db::check_batch(queue, &db::stored(queue, header).await?)?;
                    Ok(Claimed::Unavailable)
                }
                _ => Ok(Claimed::OlderFirst),
            }
        }
    }
}

/// Who takes a slot, until when, and the format the claim writes in.
struct Taking<'a> {
    token: ObjectId,
    claimant: &'a str,
    until: DateTime,
    writes: i64,
}

/// Takes `service`'s slot for the batch at `place` until `until`: free, or the batch's own
/// and run out (a retry of an unknown or delayed batch, or of a taker that died), and after
/// the mark. A slot held by another batch that is done with it is freed once, then tried
/// again.
async fn take_slot(
    queue: &Batches,
    service: &str,
    place: &Place,
    taking: &Taking<'_>,
) -> Result<Option<Option<Document>>, QueueError> {
    let Taking {
        token,
        claimant,
        until,
        writes,
    } = *taking;
    let header = place.header.as_str();
    let at = DateTime::from_millis(place.at);
    for _ in 0..2 {
        let taken = queue
            .services
            .find_one_and_update(
                guarded(
                    queue,
                    doc! {
                        "_id": service,
                        // After the mark, or the batch at the mark itself: versions before
                        // 2026-11-26 moved the mark to a batch when it was sent, and such a
                        // batch may come back unknown or delayed. (A settled batch at the mark
                        // takes the slot for a moment only: its claim is refused.)
                        "$or": [
                            { "mark_at": { "$exists": false } },
                            { "mark_at": { "$lt": at } },
                            { "mark_at": at, "mark_header": { "$lte": header } },
                        ],
                        // Free, or this batch's and run out by the server's clock.
                        "$expr": { "$or": [
                            { "$eq": [{ "$ifNull": ["$holder", null] }, null] },
                            { "$and": [{ "$eq": ["$holder.header", header] }, taking_ran_out()] },
                        ] },
                    },
                ),
                mark_update(
                    doc! { "$set": { "holder": {
                        "header": header, "at": at, "token": token, "by": claimant, "until": until,
                    } } },
                    writes,
                ),
            )
            .projection(doc! { "holder": 1 })
            .await
            .map_err(|e| db::db_error(queue, header, "take the slot", e))?;
        if let Some(before) = taken {
            return Ok(Some(before.get_document("holder").ok().cloned()));
        }
        let Some(current) = queue
            .services
            .find_one(doc! { "_id": service })
            .await
            .map_err(|e| db::db_error(queue, header, "take the slot", e))?
        else {
            // The batch's adder died between its insert and the service's first write:
            // make that write for it (the newest stamp is at least this batch's).
            let made = queue
                .services
                .update_one(
                    guarded(queue, doc! { "_id": service }),
                    mark_update(doc! { "$max": { "newest": at } }, writes),
                )
                .upsert(true)
                .await;
            match made {
                Ok(_) => continue,
                // Made by someone else meanwhile (the next look refuses it if it is of a newer
                // format).
                Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) => continue,
                Err(e) => return Err(db::db_error(queue, header, "take the slot", e)),
            }
        };
        db::check_service(queue, &current)?;
        let holding = current.get_document("holder").ok().cloned();
        let current = Service::parse(&current);
        let Some(holder) = current.holder.filter(|h| h.header != header) else {
            return Ok(None);
        };
        let holder_token = current.holder_token;
        // The holder is done with the slot if the ledger is done with it (its monitor may have
        // died before freeing the slot): the slot is freed and the mark moves to it. Or if
        // it was never sent and nobody is at work on it (its taker died before sending, or
        // took the slot for a batch that is not there). The latter is judged only once the
        // server's clock has passed the taking's `until` (its taker's claim lands only
        // before), from a reading made then, and made final by the fence: an expired claim
        // under the taking's token, written only over a batch still unclaimed, which the
        // taker's claim can no longer land on. So a clock that steps back (a failover to a
        // primary whose clock is behind) lets no claim in after the slot is freed.
        let mut taking = held_by(service, &holder.header, holder_token);
        taking.insert("$expr", taking_ran_out());
        let ran_out = queue
            .services
            .find_one(taking)
            .projection(doc! { "_id": 1 })
            .await
            .map_err(|e| db::db_error(queue, header, "take the slot", e))?
            .is_some();
        let stored = queue
            .coll
            .find_one(doc! { "_id": &holder.header })
            .projection(doc! { "content": 0 })
            .await
            .map_err(|e| db::db_error(queue, header, "take the slot", e))?;
        if let Some(stored) = &stored {
            db::check_batch(queue, stored)?;
        }
        let now = db::now(queue).await?;
        let settled = stored
            .as_ref()
            .is_some_and(|d| d.get_str("status").is_ok_and(|s| DONE.contains(&s)));
        let abandoned = ran_out
            && match &stored {
                None => true,
                Some(d) => {
                    d.get("status").is_none()
                        && !d.get_bool("submitted").unwrap_or(true)
                        && !d
                            .get_document("claim")
                            .and_then(|c| c.get_datetime("until"))
                            .is_ok_and(|u| *u >= now)
                }
            };
        if settled {
            slot_done(queue, service, &holder, holder_token, writes).await?;
        } else if abandoned && fence(queue, &holder.header, holding.as_ref(), now, writes).await? {
            slot_abandoned(queue, service, &holder.header, holder_token, writes).await?;
        } else {
            return Ok(None);
        }
    }
    Ok(None)
}

/// Makes sure the taking of the slot `holding` (for batch `header`) never leads to a claim: an
/// expired claim under its token goes on the batch, only while the batch is still unsettled,
/// not with a submitter and without a live claim. A claim under that token is refused from
/// then on. Whether the batch could be fenced (or is not there): false when it was claimed
/// meanwhile.
async fn fence(
    queue: &Batches,
    header: &str,
    holding: Option<&Document>,
    now: DateTime,
    writes: i64,
) -> Result<bool, QueueError> {
    let Some(token) = holding.and_then(|h| h.get_object_id("token").ok()) else {
        // A slot without a token (no version wrote one): nothing to fence it by.
        return Ok(true);
    };
    let by = holding
        .and_then(|h| h.get_str("by").ok())
        .unwrap_or("?")
        .to_string();
    let until = holding
        .and_then(|h| h.get_datetime("until").ok().copied())
        .unwrap_or(DateTime::from_millis(0))
        .min(now);
    let fenced = queue
        .coll
        .update_one(
            guarded(
                queue,
                doc! {
                    "_id": header,
                    "status": { "$exists": false },
                    "submitted": false,
                    "$nor": [{ "claim.until": { "$gte": now } }],
                },
            ),
            mark_update(
                doc! { "$set": { "claim": { "token": token, "by": by, "until": until } } },
                writes,
            ),
        )
        .await
        .map_err(|e| db::db_error(queue, header, "fence an abandoned taking", e))?;
    if fenced.matched_count == 1 {
        return Ok(true);
    }
    // Not there at all, or moved on (claimed, or settled).
    Ok(queue
        .coll
        .find_one(doc! { "_id": header })
        .projection(doc! { "_id": 1 })
        .await
        .map_err(|e| db::db_error(queue, header, "fence an abandoned taking", e))?
        .is_none())
}

/// The slot was refused. A batch at or before the mark can never take it, so the claimant
/// stamps it again, after the mark (only while nobody has a live claim on it): a new batch whose
/// adder died before stamping it again, or whose stamp was overtaken by an overlapping add's
/// batch that went first; or a batch the ledger does not have (unknown, delayed) strictly
/// before the mark, which a later batch has passed (a version before 2026-11-28 freed the slot
/// when the ledger said valid, and the ledger may forget a valid batch): it goes again as a new
/// batch, after the mark, rather than keep its service busy for ever. A batch that is not there
/// is [`QueueError::UnknownBatch`].
async fn after_refused_slot(queue: &Batches, header: &str, writes: i64) -> Result<(), QueueError> {
    let batch = db::parse(queue, &db::stored(queue, header).await?)?;
    if batch.submitted {
        return Ok(());
    }
    let place = Place::of(&batch);
    let service = db::service(queue, &batch.service_id).await?;
    let Some(mark) = service.mark else {
        return Ok(());
    };
    let passed = match batch.status {
        None => mark >= place,
        Some(BatchStatus::Unknown | BatchStatus::Delayed) => mark > place,
        Some(_) => false,
    };
    if !passed {
        return Ok(());
    }
    let condition = match batch.status {
        None => doc! { "status": { "$exists": false } },
        Some(status) => doc! { "status": status.as_str() },
    };
    stamp::stamp_again(queue, &batch.service_id, &place, condition, writes).await?;
    if batch.status.is_some() {
        tracing::warn!(
            header,
            service = %batch.service_id,
            "a batch the ledger does not have was passed by a later batch of its service; it goes again, after it"
        );
    }
    Ok(())
}

/// Frees the slot of a batch the ledger has settled, moving the mark to it in the same
/// write: whenever the slot is free, the mark is at the last batch that went.
pub(crate) async fn slot_done(
    queue: &Batches,
    service: &str,
    holder: &Place,
    token: Option<ObjectId>,
    writes: i64,
) -> Result<(), QueueError> {
    queue
        .services
        .update_one(
            guarded(queue, held_by(service, &holder.header, token)),
            mark_update(
                doc! {
                    "$set": {
                        "mark_at": DateTime::from_millis(holder.at),
                        "mark_header": &holder.header,
                    },
                    "$unset": { "holder": "" },
                },
                writes,
            ),
        )
        .await
        .map_err(|e| db::db_error(queue, &holder.header, "free the slot", e))?;
    Ok(())
}

/// Frees the slot of a batch that never went, once its `until` has passed by the server's
/// clock (so its taker can no longer claim the batch), leaving the mark.
async fn slot_abandoned(
    queue: &Batches,
    service: &str,
    header: &str,
    token: Option<ObjectId>,
    writes: i64,
) -> Result<(), QueueError> {
    let mut filter = held_by(service, header, token);
    filter.insert("$expr", taking_ran_out());
    queue
        .services
        .update_one(
            guarded(queue, filter),
            mark_update(doc! { "$unset": { "holder": "" } }, writes),
        )
        .await
        .map_err(|e| db::db_error(queue, header, "free the slot", e))?;
    Ok(())
}

/// Lets `header`'s slot run out now (its batch came back unknown or delayed and may be
/// taken again at once).
async fn slot_runs_out(
    queue: &Batches,
    service: &str,
    header: &str,
    writes: i64,
) -> Result<(), QueueError> {
    queue
        .services
        .update_one(
            guarded(queue, held_by(service, header, None)),
            mark_update(
                doc! { "$set": { "holder.until": DateTime::from_millis(0) } },
                writes,
            ),
        )
        .await
        .map_err(|e| db::db_error(queue, header, "free the slot", e))?;
    Ok(())
}

/// Gives back the slot taken with `token`: as it was before, when the batch's earlier
/// holder was replaced (the batch may be in flight under it: only the claim says, and it
/// was refused), free otherwise.
async fn give_slot_back(
    queue: &Batches,
    service: &str,
    header: &str,
    token: ObjectId,
    replaced: Option<Document>,
    writes: i64,
) -> Result<(), QueueError> {
    let filter = guarded(queue, doc! { "_id": service, "holder.token": token });
    let update = match replaced {
        Some(holder) => doc! { "$set": { "holder": holder } },
        None => doc! { "$unset": { "holder": "" } },
    };
    queue
        .services
        .update_one(filter, mark_update(update, writes))
        .await
        .map_err(|e| db::db_error(queue, header, "give the slot back", e))?;
    Ok(())
}

/// The batch as a claim found it: its last submission and status, and whether giving the
/// claim back also takes back what the ledger last said of it.
pub(crate) struct Previous {
    pub at: Option<DateTime>,
    pub status: Option<BatchStatus>,
    pub reset: bool,
}

/// Gives back a claim that marked the batch submitted, before anything was sent (and takes
/// back what the ledger last said of it, when `reset`).
pub(crate) async fn unclaim_submitted(
    queue: &Batches,
    header: &str,
    token: ObjectId,
    previous: Previous,
    writes: i64,
) -> Result<(), QueueError> {
    let Previous {
        at: last_submitted_at,
        status,
        reset,
    } = previous;
    let mut set = doc! { "submitted": false };
    let mut unset = doc! { "claim": "" };
    match last_submitted_at {
        Some(at) => set.insert("last_submitted_at", at),
        None => unset.insert("last_submitted_at", ""),
    };
    if reset {
        unset.insert("status", "");
    }
    set.extend(set_mark(writes));
    let update = doc! { "$set": set, "$unset": unset };
    // Only over the status the claim found: a monitor that recorded the ledger's word in
    // between keeps it (and the claim, which its next status clears).
    let mut filter = doc! { "_id": header, "claim.token": token };
    match status {
        Some(status) => filter.insert("status", status.as_str()),
        None => filter.insert("status", doc! { "$exists": false }),
    };
    queue
        .coll
        .update_one(guarded(queue, filter), update)
        .await
        .map_err(|e| db::db_error(queue, header, "give the claim back", e))?;
    Ok(())
}

/// Gives a claim back.
async fn unclaim(
    queue: &Batches,
    header: &str,
    token: ObjectId,
    writes: i64,
) -> Result<(), QueueError> {
    queue
        .coll
        .update_one(
            guarded(queue, doc! { "_id": header, "claim.token": token }),
            mark_update(doc! { "$unset": { "claim": "" } }, writes),
        )
        .await
        .map_err(|e| db::db_error(queue, header, "give the claim back", e))?;
    Ok(())
}

/// The body of [`Batches::record`].
pub(crate) async fn record(
    queue: &Batches,
    claim: &Claim,
    outcome: Submission,
) -> Result<Batch, QueueError> {
    let header = claim.batch.header.as_str();
    store::check_header(queue, header)?;
    let writes = db::writes(queue).await?;
    let update = match outcome {
        Submission::Accepted => doc! {
            "$set": { "status": "pending", "submitted": true },
            "$unset": { "claim": "" },
        },
        Submission::Delayed => doc! {
            "$set": { "status": "delayed", "submitted": false },
            "$unset": { "claim": "" },
        },
    };
    // Only over what a submission can change: nothing yet, unknown, delayed. A monitor
    // that already saw the ledger settle it is ahead of us, and keeps its word.
    let recorded = queue
        .coll
        .find_one_and_update(
            guarded(
                queue,
                doc! {
                    "_id": header,
                    "claim.token": claim.token,
                    "status": { "$nin": DECIDED.to_vec() },
                },
            ),
            mark_update(update, writes),
        )
        .return_document(ReturnDocument::After)
        .await
        .map_err(|e| db::db_error(queue, header, "record", e))?;
    if let Some(doc) = recorded {
        let batch = db::parse(queue, &doc)?;
        if outcome == Submission::Delayed && batch.strategy == Strategy::Serial {
            // Sent again after the delay window, by whoever takes it then.
            slot_runs_out(queue, &batch.service_id, header, writes).await?;
        }
        return Ok(batch);
    }
    let stored = db::stored(queue, header).await?;
    // Not matched because it is of a newer format: its claim is not this version's to read.
    db::check_batch(queue, &stored)?;
    let held = stored
        .get_document("claim")
        .ok()
        .and_then(|c| c.get_object_id("token").ok());
    if held != Some(claim.token) {
        return Err(QueueError::NotClaimant {
            collection: queue.name.clone(),
            header: header.to_string(),
            token: claim.token,
            held: held.map_or_else(|| "none".to_string(), |t| t.to_hex()),
        });
    }
    // Ours, and the monitor has recorded the ledger's word already: only give it back.
    unclaim(queue, header, claim.token, writes).await?;
    db::parse(queue, &db::stored(queue, header).await?)
}

/// The body of [`Batches::record_status`] (`asked` unset: the time of the call) and of
/// [`Batches::record_answer`]. `asked` is a time of the server's clock no later than the moment
/// the ledger was asked (an estimate less its error).
pub(crate) async fn record_status(
    queue: &Batches,
    seen: &Batch,
    status: BatchStatus,
    asked: Option<DateTime>,
) -> Result<Batch, QueueError> {
    let header = seen.header.as_str();
    store::check_header(queue, header)?;
    if !seen.needs(status) {
        return queue.get(header).await;
    }
    let allowed = match (seen.status, status) {
        // With a submitter (or one that died): whatever the ledger says of it.
        (None | Some(BatchStatus::Unknown) | Some(BatchStatus::Delayed), s) => {
            seen.submitted && s != BatchStatus::Delayed
        }
        (Some(BatchStatus::Pending), s) => matches!(
            s,
            BatchStatus::Valid
                | BatchStatus::Committed
                | BatchStatus::Invalid
                | BatchStatus::Unknown
        ),
        (Some(BatchStatus::Valid), s) => {
            matches!(s, BatchStatus::Committed | BatchStatus::Unknown)
        }
        _ => false,
    };
    if !allowed {
        return Err(QueueError::InvalidTransition {
            collection: queue.name.clone(),
            header: header.to_string(),
            from: seen.status.map_or("none", BatchStatus::as_str).to_string(),
            to: status.as_str().to_string(),
        });
    }
    let writes = db::writes(queue).await?;
    let mut filter = doc! {
        "_id": header,
        "submitted": seen.submitted,
        "last_submitted_at": seen.last_submitted_at,
    };
    match seen.status {
        Some(s) => filter.insert("status", s.as_str()),
        None => filter.insert("status", doc! { "$exists": false }),
    };
    let with_submitter = !matches!(seen.status, Some(BatchStatus::Pending | BatchStatus::Valid));
    if with_submitter && status == BatchStatus::Unknown {
        // The ledger not knowing a batch whose submitter was still at work when it was asked
        // says nothing: the submitter may have sent it since (it sends only before its claim
        // expires). So the claim must have expired before the question, not merely by now.
        let asked = match asked {
            Some(asked) => asked,
            None => {
                let (now, error) = db::now_within(queue).await?;
                minus(now, error)
            }
        };
        filter.insert(
            "$or",
            vec![
                doc! { "claim": { "$exists": false } },
                doc! { "claim.until": { "$lt": asked } },
            ],
        );
    }
    let mut set = doc! { "status": status.as_str() };
    let mut update = Document::new();
    if status == BatchStatus::Unknown {
        // As the reference design requires of the monitor: recording unknown clears
        // submitted, so the queuer takes the batch again. A submitter that still holds a
        // claim on it has lost it.
        set.insert("submitted", false);
        update.insert("$unset", doc! { "claim": "" });
    } else if status.is_final() {
        // Nothing is left to do under a claim (its submitter may have died after sending).
        update.insert("$unset", doc! { "claim": "" });
    }
    set.extend(set_mark(writes));
    update.insert("$set", set);
    let written = queue
        .coll
        .find_one_and_update(guarded(queue, filter), update)
        .return_document(ReturnDocument::After)
        .await
        .map_err(|e| db::db_error(queue, header, "record the status", e))?;
    let Some(written) = written else {
        // Unknown header, a batch of a newer format (the guard did not match it), or the batch
        // moved on since it was read.
        db::check_batch(queue, &db::stored(queue, header).await?)?;
        return Err(QueueError::Contended {
            collection: queue.name.clone(),
            header: header.to_string(),
            what: "record the status (the batch changed since it was read)",
            tries: 1,
        });
    };
    let batch = db::parse(queue, &written)?;
    if batch.strategy == Strategy::Parallel {
        // No slot: its younger batches look at its status.
    } else if DONE.contains(&status.as_str()) {
        slot_done(queue, &batch.service_id, &Place::of(&batch), None, writes).await?;
    } else if status == BatchStatus::Unknown {
        // To be sent again: its slot may be taken again at once.
        slot_runs_out(queue, &batch.service_id, header, writes).await?;
    }
    Ok(batch)
}
