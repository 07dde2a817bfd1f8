//! Batches and services as stored: reading them (refusing one of a newer stored format), the
//! guard that keeps every write off a document of a newer format, the format an operation
//! writes, the server's time, and the error naming the batch and what was being done. Every
//! other file of the queue builds on these.

use std::time::Duration;

use bson::{doc, DateTime, Document};

use crate::queue::error::QueueError;
use crate::queue::model::{parse_keys, Batch, BatchStatus, Service, Strategy};
use crate::queue::Batches;
use crate::repo::format;

/// The server's time, as this process estimates it.
pub(crate) async fn now(queue: &Batches) -> Result<DateTime, QueueError> {
    queue
        .store
        .now()
        .await
        .map_err(|e| QueueError::Clock(Box::new(e)))
}

/// The server's time as this process estimates it, and how far off the estimate may be.
pub(crate) async fn now_within(queue: &Batches) -> Result<(DateTime, Duration), QueueError> {
    queue
        .store
        .now_within()
        .await
        .map_err(|e| QueueError::Clock(Box::new(e)))
}

pub(crate) fn db_error(
    queue: &Batches,
    header: &str,
    op: &'static str,
    e: mongodb::error::Error,
) -> QueueError {
    QueueError::database(&queue.name, header, op, e)
}

/// The stored batch `header`.
pub(crate) async fn stored(queue: &Batches, header: &str) -> Result<Document, QueueError> {
    queue
        .coll
        .find_one(doc! { "_id": header })
        .await
        .map_err(|e| db_error(queue, header, "read", e))?
        .ok_or_else(|| QueueError::UnknownBatch {
            collection: queue.name.clone(),
            header: header.to_string(),
        })
}

/// `service`'s document (empty if it has none yet).
pub(crate) async fn service(queue: &Batches, service: &str) -> Result<Service, QueueError> {
    let found = queue
        .services
        .find_one(doc! { "_id": service })
        .await
        .map_err(|e| db_error(queue, "*", "read the service", e))?;
    match found {
        Some(found) => {
            check_service(queue, &found)?;
            Ok(Service::parse(&found))
        }
        None => Ok(Service::default()),
    }
}

/// The format this store writes batches and services in, read before an operation's first
/// write: an instance of an older release in a fleet switched to a newer format writes
/// nothing.
pub(crate) async fn writes(queue: &Batches) -> Result<i64, QueueError> {
    Ok(queue.store.writes_format().await?)
}

/// `filter` of a write on a batch or a service, matching it only while it is of a format this
/// store reads.
pub(crate) fn guarded(queue: &Batches, filter: Document) -> Document {
    format::guard(filter, queue.store.reads_format())
}

/// Refuses stored batch `d` when it is of a stored format newer than this store reads.
pub(crate) fn check_batch(queue: &Batches, d: &Document) -> Result<(), QueueError> {
    Ok(format::check_doc(
        d,
        queue.store.reads_format(),
        &queue.name,
    )?)
}

/// Refuses stored service `d` when it is of a stored format newer than this store reads.
pub(crate) fn check_service(queue: &Batches, d: &Document) -> Result<(), QueueError> {
    Ok(format::check_doc(
        d,
        queue.store.reads_format(),
        queue.services.name(),
    )?)
}

/// A stored batch as this version reads it; refused when it is of a newer format.
pub(crate) fn parse(queue: &Batches, d: &Document) -> Result<Batch, QueueError> {
    check_batch(queue, d)?;
    let header = d.get_str("_id").unwrap_or("?").to_string();
    let malformed = |reason: &str| QueueError::Malformed {
        collection: queue.name.clone(),
        header: header.clone(),
        reason: reason.to_string(),
    };
    let status = match d.get_str("status") {
        Err(_) => None,
        Ok(s) => Some(parse_status(s).ok_or_else(|| malformed("unknown status"))?),
    };
    Ok(Batch {
        header: header.clone(),
        service_id: d
            .get_str("service_id")
            .map_err(|_| malformed("no service id"))?
            .to_string(),
        created_at: d
            .get_datetime("created_at")
            .map_err(|_| malformed("no creation time"))?
            .to_chrono(),
        submitted: d.get_bool("submitted").unwrap_or(false),
        status,
        last_submitted_at: d
            .get_datetime("last_submitted_at")
            .ok()
            .map(|at| at.to_chrono()),
        keys: parse_keys(d).map_err(|reason| malformed(&reason))?,
        strategy: Strategy::parse(d.get_str("strategy").ok())
            .ok_or_else(|| malformed("unknown strategy"))?,
    })
}

pub(crate) fn parse_status(s: &str) -> Option<BatchStatus> {
    [
        BatchStatus::Pending,
        BatchStatus::Invalid,
        BatchStatus::Valid,
        BatchStatus::Committed,
        BatchStatus::Unknown,
        BatchStatus::Delayed,
    ]
    .into_iter()
    .find(|status| status.as_str() == s)
}
