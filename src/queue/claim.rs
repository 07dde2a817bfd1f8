//! Taking a batch for submission and recording what became of it.
//!
//! Three documents decide whether a batch may go to the ledger: the batch (its claim, its status,
//! its `submitted` flag) and its service's document in the services collection, which holds the
//! service's **slot** (the one batch of the service that may be at the ledger) and the **mark**
//! (the place in the service's order, `(created_at, header)`, of the last batch that went).
//!
//! A submitter takes a queued batch in five conditional writes and one count:
//!
//! 1. **claim** the batch: only if it is unsettled, not with a submitter, and unclaimed or its
//!    claim has expired. The claim carries a fresh token; every later write of the claimant
//!    names it, so a submitter whose claim was taken over changes nothing.
//! 2. **take the slot** of the service: only if it is free (or already this batch's: a retry of
//!    an unknown or delayed batch) and the batch comes after the mark. A slot whose batch the
//!    ledger has settled is freed first (its monitor may have died before freeing it).
//! 3. **check** that no unsettled batch of the service is older. A batch added late with an
//!    older stamp is found here; the slot is given back and the older batch goes first.
//! 4. **mark it submitted** (`submitted`, `last_submitted_at`), only while the claim and the
//!    batch's stamp are unchanged.
//! 5. **move the mark** to the batch; only then is it sent.
//!
//! Adding a batch runs the other half: after the insert it reads the service's slot and mark,
//! and a batch stamped at or before either (it was stamped before a later batch was taken) is
//! stamped again, after them. Either the adder sees the taken batch, or the taker's check sees
//! the added one: so batches reach the ledger in the order of their final stamps, and a slot
//! held from step 2 until the ledger settles the batch keeps one batch per service in flight.

use std::time::{Duration, Instant};

use bson::oid::ObjectId;
use bson::{doc, DateTime, Document};
use mongodb::options::ReturnDocument;

use crate::queue::error::QueueError;
use crate::queue::model::{Batch, BatchStatus, Place};
use crate::queue::store::{name_problem, shown, Batches};
use crate::server::clock::plus;

/// Statuses the ledger has settled for good: the queuer leaves them out, and a slot held by
/// such a batch is free.
pub(crate) const SETTLED: [&str; 3] = ["committed", "valid", "invalid"];

/// Statuses a submission can no longer change: settled, or pending (accepted by the ledger, to be
/// decided there). A claim and the record of an answer both need a status outside these.
const DECIDED: [&str; 4] = ["pending", "committed", "valid", "invalid"];

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
    /// When the claim expires by this process's monotonic clock (the stored expiry is the
    /// server's time): submit only before it.
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
fn before(service: &str, place: &Place) -> Document {
    let at = DateTime::from_millis(place.at);
    doc! {
        "service_id": service,
        "$or": [
            { "created_at": { "$lt": at } },
            { "created_at": at, "_id": { "$lt": &place.header } },
        ],
    }
}

impl Batches {
    /// Takes `batch` (from a queuer round) for submission, for at most `ttl`. `None` when it
    /// is not this caller's to submit now: another submitter has it, its service has another
    /// batch in flight, an older batch of its service must go first, or it moved on. Nothing
    /// is left taken when it answers `None`.
    ///
    /// A batch that does not exist is [`QueueError::UnknownBatch`]; an unusable claimant name
    /// (empty, over [`MAX_NAME`](crate::queue::MAX_NAME) bytes, with a NUL) or a `ttl` under a
    /// millisecond or over [`MAX_CLAIM`] is [`QueueError::Invalid`]; nothing is written.
    pub async fn claim(
        &self,
        batch: &Batch,
        claimant: &str,
        ttl: Duration,
    ) -> Result<Option<Claim>, QueueError> {
        let header = batch.header.as_str();
        self.check_header(header)?;
        if let Some(problem) = name_problem(claimant) {
            return Err(QueueError::Invalid {
                collection: self.name.clone(),
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
                collection: self.name.clone(),
                reason: format!(
                    "batch {} for {}: a claim of {ttl:?} is not between 1 ms and {MAX_CLAIM:?}",
                    shown(header),
                    shown(claimant)
                ),
            });
        }
        let token = ObjectId::new();
        let now = self.now().await?;
        let until = plus(now, ttl);
        let deadline = Instant::now() + ttl;
        // 1. The claim.
        let claimed = self
            .coll
            .find_one_and_update(
                doc! {
                    "_id": header,
                    "submitted": false,
                    "status": { "$nin": DECIDED.to_vec() },
                    "$or": [
                        { "claim": { "$exists": false } },
                        { "claim.until": { "$lt": now } },
                    ],
                },
                doc! { "$set": { "claim": { "token": token, "by": claimant, "until": until } } },
            )
            .return_document(ReturnDocument::After)
            .await
            .map_err(|e| self.db_error(header, "claim", e))?;
        let Some(claimed) = claimed else {
            // Not claimable now, or not there at all: only the latter is the caller's mistake.
            self.stored(header).await?;
            return Ok(None);
        };
        let batch = self.parse(&claimed)?;
        let content = claimed.get_str("content").unwrap_or_default().to_string();
        let place = Place::of(&batch);
        let service = batch.service_id.clone();
        // 2. The slot.
        if !self.take_slot(&service, &place, token).await? {
            self.after_refused_slot(&batch, &place, token).await?;
            self.unclaim(header, token).await?;
            return Ok(None);
        }
        // 3. Nothing older of the service is unsettled.
        let mut older = before(&service, &place);
        older.insert("status", doc! { "$nin": SETTLED.to_vec() });
        let waiting = self
            .coll
            .count_documents(older)
            .await
            .map_err(|e| self.db_error(header, "claim", e))?;
        if waiting > 0 {
            tracing::debug!(header, service, waiting, "an older batch goes first");
            self.free_slot(&service, header, Some(token)).await?;
            self.unclaim(header, token).await?;
            return Ok(None);
        }
        // 4. Submitted, while the claim and the stamp are still ours.
        let marked = self
            .coll
            .find_one_and_update(
                doc! {
                    "_id": header,
                    "claim.token": token,
                    "created_at": batch.created_at,
                },
                // The estimate of the server's time rather than `$currentDate`: it is matched
                // exactly later, and some servers keep more than milliseconds of the latter.
                doc! { "$set": { "submitted": true, "last_submitted_at": self.now().await? } },
            )
            .return_document(ReturnDocument::After)
            .await
            .map_err(|e| self.db_error(header, "claim", e))?;
        let Some(marked) = marked else {
            // The claim expired and was taken over: the new claimant has the slot too.
            return Ok(None);
        };
        // 5. The mark, then it may go.
        let moved = self
            .services
            .update_one(
                doc! { "_id": &service, "holder.header": header },
                doc! { "$set": {
                    "mark_at": batch.created_at,
                    "mark_header": header,
                } },
            )
            .await
            .map_err(|e| self.db_error(header, "claim", e))?;
        if moved.matched_count == 0 {
            // Freed under us as abandoned (we were slower than our claim): it is marked
            // submitted but was not sent, which the monitor sorts out once the claim expires.
            tracing::debug!(
                header,
                service,
                "the slot was freed before the batch was sent"
            );
            return Ok(None);
        }
        Ok(Some(Claim {
            batch: self.parse(&marked)?,
            content,
            token,
            deadline,
        }))
    }

    /// Takes `service`'s slot for the batch at `place`: free (or already its own) and after
    /// the mark. A slot held by a batch the ledger has settled is freed once, then tried again.
    async fn take_slot(
        &self,
        service: &str,
        place: &Place,
        token: ObjectId,
    ) -> Result<bool, QueueError> {
        let header = place.header.as_str();
        let at = DateTime::from_millis(place.at);
        for _ in 0..2 {
            let taken = self
                .services
                .update_one(
                    doc! {
                        "_id": service,
                        "$and": [
                            { "$or": [
                                { "holder": { "$exists": false } },
                                { "holder.header": header },
                            ] },
                            { "$or": [
                                { "mark_at": { "$exists": false } },
                                { "mark_at": { "$lt": at } },
                                { "mark_at": at, "mark_header": { "$lte": header } },
                            ] },
                        ],
                    },
                    doc! { "$set": { "holder": { "header": header, "at": at, "token": token } } },
                )
                .await
                .map_err(|e| self.db_error(header, "take the slot", e))?;
            if taken.matched_count == 1 {
                return Ok(true);
            }
            let current = self.service(service).await?;
            let Some(holder) = current.holder.filter(|h| h.header != header) else {
                return Ok(false);
            };
            let holder_token = current.holder_token;
            // The holder is done with the slot if the ledger settled it (its monitor may have
            // died before freeing the slot), or if it was never sent and nobody is at work on
            // it (its taker died before sending, and it is not the next batch any more).
            let now = self.now().await?;
            let done = self
                .coll
                .find_one(doc! { "_id": &holder.header, "$or": [
                    { "status": { "$in": SETTLED.to_vec() } },
                    {
                        "status": { "$exists": false },
                        "submitted": false,
                        "$nor": [{ "claim.until": { "$gte": now } }],
                    },
                ] })
                .await
                .map_err(|e| self.db_error(header, "take the slot", e))?
                .is_some();
            if !done {
                return Ok(false);
            }
            // Only the slot as read: a new taker of the holder would hold it with its own claim.
            self.free_slot(service, &holder.header, holder_token)
                .await?;
        }
        Ok(false)
    }

    /// The slot was refused. A batch at or before the mark can never take it: its adder died
    /// before stamping it again, so the claimant does it, under its claim.
    async fn after_refused_slot(
        &self,
        batch: &Batch,
        place: &Place,
        token: ObjectId,
    ) -> Result<(), QueueError> {
        if batch.status.is_some() {
            return Ok(());
        }
        let service = self.service(&batch.service_id).await?;
        match service.mark {
            Some(mark) if mark >= *place => {
                let at = DateTime::from_millis(mark.at.saturating_add(1).max(place.at));
                let now = self.now().await?;
                let at = at.max(now);
                self.coll
                    .update_one(
                        doc! {
                            "_id": &batch.header,
                            "claim.token": token,
                            "created_at": batch.created_at,
                            "submitted": false,
                            "status": { "$exists": false },
                        },
                        doc! { "$set": { "created_at": at } },
                    )
                    .await
                    .map_err(|e| self.db_error(&batch.header, "stamp", e))?;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Frees `service`'s slot if `header` holds it (with `token`, when given).
    pub(crate) async fn free_slot(
        &self,
        service: &str,
        header: &str,
        token: Option<ObjectId>,
    ) -> Result<(), QueueError> {
        let mut filter = doc! { "_id": service, "holder.header": header };
        if let Some(token) = token {
            filter.insert("holder.token", token);
        }
        self.services
            .update_one(filter, doc! { "$unset": { "holder": "" } })
            .await
            .map_err(|e| self.db_error(header, "free the slot", e))?;
        Ok(())
    }

    /// Gives a claim back.
    async fn unclaim(&self, header: &str, token: ObjectId) -> Result<(), QueueError> {
        self.coll
            .update_one(
                doc! { "_id": header, "claim.token": token },
                doc! { "$unset": { "claim": "" } },
            )
            .await
            .map_err(|e| self.db_error(header, "give the claim back", e))?;
        Ok(())
    }

    /// Records what the submission under `claim` came to, and gives the claim back. Accepted:
    /// the batch is pending and stays with the ledger (`submitted`). Delayed: it is retried
    /// after the delay window. A claim taken over meanwhile is [`QueueError::NotClaimant`], and
    /// nothing is written.
    pub async fn record(&self, claim: &Claim, outcome: Submission) -> Result<Batch, QueueError> {
        let header = claim.batch.header.as_str();
        self.check_header(header)?;
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
        let recorded = self
            .coll
            .find_one_and_update(
                doc! {
                    "_id": header,
                    "claim.token": claim.token,
                    "status": { "$nin": DECIDED.to_vec() },
                },
                update,
            )
            .return_document(ReturnDocument::After)
            .await
            .map_err(|e| self.db_error(header, "record", e))?;
        if let Some(doc) = recorded {
            return self.parse(&doc);
        }
        let stored = self.stored(header).await?;
        let held = stored
            .get_document("claim")
            .ok()
            .and_then(|c| c.get_object_id("token").ok());
        if held != Some(claim.token) {
            return Err(QueueError::NotClaimant {
                collection: self.name.clone(),
                header: header.to_string(),
                token: claim.token,
                held: held.map_or_else(|| "none".to_string(), |t| t.to_hex()),
            });
        }
        // Ours, and the monitor has recorded the ledger's word already: only give it back.
        self.unclaim(header, claim.token).await?;
        self.parse(&self.stored(header).await?)
    }

    /// Records the ledger's status of a batch with a submitter or at the ledger (the monitor's
    /// write). `seen` is the batch as read before the ledger was asked: the status is written
    /// only if the batch is still so (same status, `submitted` and last submission), since an
    /// answer about an earlier state says nothing about a later one; otherwise
    /// [`QueueError::Contended`], and the next pass asks again. Unknown clears `submitted`, so
    /// the batch is queued again; a settled status frees the service's slot. The statuses go
    /// one way only:
    ///
    /// - with a submitter (`submitted`, and nothing yet, unknown or delayed) → pending, valid,
    ///   committed, invalid, unknown (unknown only once the submitter's claim has expired:
    ///   until then it may still be sending; it clears `submitted`, also of an unknown batch
    ///   whose new submitter died);
    /// - pending → valid, committed, invalid, unknown; valid → committed, unknown;
    /// - unknown or delayed without a submitter → only by a new submission
    ///   ([`record`](Batches::record)).
    ///
    /// Recording the status a batch already has changes nothing. Anything else is
    /// [`QueueError::InvalidTransition`], and nothing is written.
    pub async fn record_status(
        &self,
        seen: &Batch,
        status: BatchStatus,
    ) -> Result<Batch, QueueError> {
        let header = seen.header.as_str();
        self.check_header(header)?;
        if !seen.needs(status) {
            return self.get(header).await;
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
                collection: self.name.clone(),
                header: header.to_string(),
                from: seen.status.map_or("none", BatchStatus::as_str).to_string(),
                to: status.as_str().to_string(),
            });
        }
        let mut filter = doc! {
            "_id": header,
            "submitted": seen.submitted,
            "last_submitted_at": seen.last_submitted_at,
        };
        match seen.status {
            Some(s) => filter.insert("status", s.as_str()),
            None => filter.insert("status", doc! { "$exists": false }),
        };
        let with_submitter =
            !matches!(seen.status, Some(BatchStatus::Pending | BatchStatus::Valid));
        if with_submitter && status == BatchStatus::Unknown {
            // The ledger not knowing a batch whose submitter is still at work says nothing.
            let now = self.now().await?;
            filter.insert(
                "$or",
                vec![
                    doc! { "claim": { "$exists": false } },
                    doc! { "claim.until": { "$lt": now } },
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
        update.insert("$set", set);
        let written = self
            .coll
            .find_one_and_update(filter, update)
            .return_document(ReturnDocument::After)
            .await
            .map_err(|e| self.db_error(header, "record the status", e))?;
        let Some(written) = written else {
            // Unknown header, or the batch moved on since it was read.
            self.stored(header).await?;
            return Err(QueueError::Contended {
                collection: self.name.clone(),
                header: header.to_string(),
                what: "record the status (the batch changed since it was read)",
                tries: 1,
            });
        };
        let batch = self.parse(&written)?;
        if status.is_final() {
            self.free_slot(&batch.service_id, header, None).await?;
        }
        Ok(batch)
    }
}
