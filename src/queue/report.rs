//! What an operator asks about a service's queue ([`Batches::report`], and [`inspect`] without
//! a handle): its open batches in order, each with where it stands, what a submitter sends next
//! by the one-round serial rule (`queuer`), the service's slot and mark, and how far behind it
//! is.

use std::time::Duration;

use bson::{doc, Document};
use futures::TryStreamExt;
use serde::Serialize;

use crate::queue::claim::DONE;
use crate::queue::db;
use crate::queue::error::QueueError;
use crate::queue::model::{Batch, BatchStatus, Service};
use crate::queue::queuer::one_round;
use crate::queue::store;
use crate::queue::Batches;
use crate::repo::store::Store;

/// A service's queue as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct QueueReport {
    /// The service.
    pub service: String,
    /// The collection of batches.
    pub collection: String,
    /// The server's time the report judges claims and delays by (this process's estimate).
    pub now: chrono::DateTime<chrono::Utc>,
    /// The delay window, in milliseconds: a delayed batch is sent again this long after its
    /// last submission.
    pub delay_ms: u64,
    /// Batches the ledger is done with (committed or invalid).
    pub done: u64,
    /// Every batch the ledger is not done with, in the order they must reach it.
    pub open: Vec<BatchReport>,
    /// What a submitter takes next by the one-round serial rule (the first of the service's
    /// batches a queuer round queues now); `None` when the rule queues nothing now (see the
    /// head's state for why).
    pub next: Option<String>,
    /// The oldest open batch's age (`now - created_at`), in milliseconds: how far behind the
    /// service is.
    pub behind_ms: Option<u64>,
    /// The batch in the service's slot (the one that may be with a submitter or at the ledger),
    /// if one holds it.
    pub slot: Option<SlotReport>,
    /// The place of the last batch that went to the ledger: only later batches may take the
    /// slot.
    pub mark: Option<String>,
}

/// Where an open batch stands, and so what happens to it next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum BatchState {
    /// Never sent, and the queuer offers it now: a submitter takes it next.
    Queued,
    /// Never sent; an earlier batch of its service must go (or be done) first.
    Waiting,
    /// A submitter claimed it and may be sending it, until its claim's `until`.
    InFlight,
    /// A submitter took it and its claim ran out with no answer recorded (it died, or is
    /// late): a monitor asks the ledger, and an "unknown" answer queues it again.
    ClaimExpired,
    /// At the ledger, not decided yet.
    Pending,
    /// Valid at the ledger, not committed yet: it keeps its service's slot (the ledger may
    /// still forget it, and it then goes again first).
    Valid,
    /// The ledger does not know it: queued again at once.
    Unknown,
    /// Its submission got no answer from the ledger: queued again once the delay window has
    /// passed (`retry_at`).
    Delayed,
}

/// One open batch of the service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct BatchReport {
    /// Its header.
    pub header: String,
    /// Its stamp: its place in the service's order.
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// See [`BatchState`].
    pub state: BatchState,
    /// What the ledger last said (`None`: nothing yet).
    pub status: Option<String>,
    /// Whether a submitter has it.
    pub submitted: bool,
    /// When a submitter last tried to send it.
    pub last_submitted_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Who claimed it last.
    pub claimed_by: Option<String>,
    /// Until when that claim runs, by the server's clock.
    pub claimed_until: Option<chrono::DateTime<chrono::Utc>>,
    /// For a delayed batch, when the queuer takes it again.
    pub retry_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Whether a queuer round queues it now.
    pub queued: bool,
}

/// The service's slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct SlotReport {
    /// The batch holding it.
    pub header: String,
    /// The submitter that took it.
    pub by: Option<String>,
    /// Until when nobody else may take or free it while its batch was not sent (server time).
    pub until: Option<chrono::DateTime<chrono::Utc>>,
}

/// Reads service `service` of the batches in `collection` of `store`'s database as
/// [`Batches::report`] does, without opening the collection: nothing is created or written
/// (the `mongotx queue` command reads this way). `delay` is the queue's delay window
/// ([`DEFAULT_DELAY`](crate::queue::DEFAULT_DELAY) unless it was opened with another). A service
/// that has no batch and no slot is [`QueueError::UnknownService`].
pub async fn inspect(
    store: &Store,
    collection: &str,
    delay: Duration,
    service: &str,
) -> Result<QueueReport, QueueError> {
    Batches::unopened(store, collection, delay)?
        .report(service)
        .await
}

/// The body of [`Batches::report`].
pub(crate) async fn report(queue: &Batches, service: &str) -> Result<QueueReport, QueueError> {
    if let Some(problem) = store::name_problem(service) {
        return Err(QueueError::Invalid {
            collection: queue.name.clone(),
            reason: format!(
                "the service id {} is unusable: {problem}",
                store::shown(service)
            ),
        });
    }
    let fail = |e| db::db_error(queue, "*", "read the service's batches", e);
    let docs: Vec<Document> = queue
        .coll
        .find(doc! { "service_id": service, "status": { "$nin": DONE.to_vec() } })
        .projection(doc! { "content": 0 })
        .sort(doc! { "created_at": 1, "_id": 1 })
        .await
        .map_err(fail)?
        .try_collect()
        .await
        .map_err(fail)?;
    let done = queue
        .coll
        .count_documents(doc! { "service_id": service, "status": { "$in": DONE.to_vec() } })
        .await
        .map_err(fail)?;
    let slot_doc = queue
        .services
        .find_one(doc! { "_id": service })
        .await
        .map_err(|e| db::db_error(queue, "*", "read the service", e))?;
    if let Some(slot_doc) = &slot_doc {
        db::check_service(queue, slot_doc)?;
    }
    if docs.is_empty() && done == 0 && slot_doc.is_none() {
        return Err(QueueError::UnknownService {
            collection: queue.name.clone(),
            service: service.to_string(),
        });
    }
    let now = db::now(queue).await?;
    let batches = docs
        .iter()
        .map(|d| db::parse(queue, d))
        .collect::<Result<Vec<Batch>, _>>()?;
    let queued: Vec<&str> = one_round(&batches, now, queue.delay)
        .into_iter()
        .map(|b| b.header.as_str())
        .collect();
    let delay_ms = i64::try_from(queue.delay.as_millis()).unwrap_or(i64::MAX);
    let open: Vec<BatchReport> = batches
        .iter()
        .zip(&docs)
        .map(|(b, d)| {
            let claim = d.get_document("claim").ok();
            let claimed_until = claim.and_then(|c| c.get_datetime("until").ok()).copied();
            let is_queued = queued.contains(&b.header.as_str());
            let retry_at = (b.status == Some(BatchStatus::Delayed))
                .then(|| {
                    b.last_submitted_at
                        .map(|at| at.timestamp_millis() + delay_ms)
                })
                .flatten()
                .map(|ms| bson::DateTime::from_millis(ms).to_chrono());
            BatchReport {
                header: b.header.clone(),
                created_at: b.created_at,
                state: state_of(b, is_queued, claimed_until.is_some_and(|u| u > now)),
                status: b.status.map(|s| s.as_str().to_string()),
                submitted: b.submitted,
                last_submitted_at: b.last_submitted_at,
                claimed_by: claim.and_then(|c| c.get_str("by").ok()).map(str::to_string),
                claimed_until: claimed_until.map(bson::DateTime::to_chrono),
                retry_at,
                queued: is_queued,
            }
        })
        .collect();
    let holder = slot_doc
        .as_ref()
        .and_then(|d| d.get_document("holder").ok());
    let place = slot_doc.as_ref().map(Service::parse).unwrap_or_default();
    let slot = holder.zip(place.holder.as_ref()).map(|(h, p)| SlotReport {
        header: p.header.clone(),
        by: h.get_str("by").ok().map(str::to_string),
        until: h.get_datetime("until").ok().map(|u| u.to_chrono()),
    });
    let behind_ms = batches.first().map(|b| {
        u64::try_from(now.timestamp_millis() - b.created_at.timestamp_millis()).unwrap_or(0)
    });
    Ok(QueueReport {
        service: service.to_string(),
        collection: queue.name.clone(),
        now: now.to_chrono(),
        delay_ms: u64::try_from(delay_ms).unwrap_or(u64::MAX),
        done,
        next: queued.first().map(|h| (*h).to_string()),
        behind_ms,
        slot,
        mark: place.mark.map(|m| m.header),
        open,
    })
}

/// Where `batch` stands: `queued` by this round, its claim `live` at the report's time.
fn state_of(batch: &Batch, queued: bool, live: bool) -> BatchState {
    match batch.status {
        Some(BatchStatus::Pending) => BatchState::Pending,
        Some(BatchStatus::Valid) => BatchState::Valid,
        _ if batch.submitted && live => BatchState::InFlight,
        _ if batch.submitted => BatchState::ClaimExpired,
        Some(BatchStatus::Unknown) => BatchState::Unknown,
        Some(BatchStatus::Delayed) => BatchState::Delayed,
        // Committed and invalid batches are not open; a new one is queued or waits its turn.
        _ if queued => BatchState::Queued,
        _ => BatchState::Waiting,
    }
}
