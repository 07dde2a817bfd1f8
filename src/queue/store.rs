//! Batches in the database: adding them (idempotent per header, refused if the header is reused
//! for another content) and one queuer round over what is stored.

use std::time::Duration;

use bson::{doc, Document};
use futures::TryStreamExt;
use mongodb::Collection;

use crate::queue::error::QueueError;
use crate::queue::model::{Batch, BatchStatus, DEFAULT_DELAY};
use crate::queue::queuer::one_round_serial;
use crate::repo::store::Store;
use crate::server::probe;

/// The default collection of batches.
pub const BATCHES_COLLECTION: &str = "batches";

/// The JSON Schema of a batch document (the project's `schemas/batches.json`).
pub const BATCHES_SCHEMA: &str = include_str!("../../schemas/batches.json");

/// The longest header or service id (they are a document id and an indexed value).
pub const MAX_NAME: usize = 512;

/// A batch to add.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewBatch {
    /// The service it belongs to.
    pub service_id: String,
    /// Its header (unique).
    pub header: String,
    /// What is submitted to the ledger.
    pub content: String,
}

impl NewBatch {
    /// A batch of `service_id` with `header` and `content`.
    pub fn new(
        service_id: impl Into<String>,
        header: impl Into<String>,
        content: impl Into<String>,
    ) -> NewBatch {
        NewBatch {
            service_id: service_id.into(),
            header: header.into(),
            content: content.into(),
        }
    }
}

/// The batches of one collection; cheap to clone.
#[derive(Debug, Clone)]
pub struct Batches {
    store: Store,
    coll: Collection<Document>,
    name: String,
    delay: Duration,
}

impl Batches {
    /// Opens the default collection of batches, with the seed's 15 s delay window.
    pub async fn open(store: &Store) -> Result<Batches, QueueError> {
        Batches::with_collection(store, BATCHES_COLLECTION, DEFAULT_DELAY).await
    }

    /// Opens `collection`, retrying delayed batches `delay` after their last submission.
    pub async fn with_collection(
        store: &Store,
        collection: &str,
        delay: Duration,
    ) -> Result<Batches, QueueError> {
        if collection.is_empty() || collection.contains('$') {
            return Err(QueueError::InvalidBatch {
                reason: format!("{collection:?} cannot name a collection of batches"),
            });
        }
        let coll = store
            .protocol_collection(collection)
            .await
            .map_err(|e| QueueError::database(collection, "*", "open", e))?;
        Ok(Batches {
            store: store.clone(),
            coll,
            name: collection.to_string(),
            delay,
        })
    }

    /// Adds a batch, created now. Adding the same batch again changes nothing; reusing its
    /// header for another service or content is [`QueueError::HeaderReused`].
    pub async fn add(&self, batch: &NewBatch) -> Result<Batch, QueueError> {
        for (what, value) in [("service id", &batch.service_id), ("header", &batch.header)] {
            if value.is_empty() || value.len() > MAX_NAME {
                return Err(QueueError::InvalidBatch {
                    reason: format!(
                        "a batch's {what} must have 1 to {MAX_NAME} bytes, not {}",
                        value.len()
                    ),
                });
            }
        }
        let created_at = self
            .store
            .now()
            .await
            .map_err(|e| QueueError::Clock(Box::new(e)))?;
        let doc = doc! {
            "_id": &batch.header,
            "service_id": &batch.service_id,
            "content": &batch.content,
            "created_at": created_at,
            "submitted": false,
        };
        match self.coll.insert_one(&doc).await {
            Ok(_) => return self.parse(&doc),
            // Added before (or by someone else): only the stored batch says which.
            Err(e) if probe::error_code(&e) == Some(probe::DUPLICATE_KEY) => {}
            Err(e) => return Err(QueueError::database(&self.name, &batch.header, "add", e)),
        }
        let stored = self
            .coll
            .find_one(doc! { "_id": &batch.header })
            .await
            .map_err(|e| QueueError::database(&self.name, &batch.header, "add", e))?
            .ok_or_else(|| QueueError::Malformed {
                collection: self.name.clone(),
                header: batch.header.clone(),
                reason: "the batch its header collided with is gone".into(),
            })?;
        let same = stored.get_str("service_id") == Ok(batch.service_id.as_str())
            && stored.get_str("content") == Ok(batch.content.as_str());
        if !same {
            return Err(QueueError::HeaderReused {
                collection: self.name.clone(),
                header: batch.header.clone(),
                service_id: stored.get_str("service_id").unwrap_or("?").to_string(),
            });
        }
        self.parse(&stored)
    }

    /// One queuer round: the batches to submit now, by the seed's one-round serial strategy,
    /// over every stored batch the ledger has not settled, at the server's time.
    pub async fn round(&self) -> Result<Vec<Batch>, QueueError> {
        let open = doc! { "status": { "$nin": ["committed", "valid", "invalid"] } };
        let docs: Vec<Document> = self
            .coll
            .find(open)
            .await
            .map_err(|e| QueueError::database(&self.name, "*", "round", e))?
            .try_collect()
            .await
            .map_err(|e| QueueError::database(&self.name, "*", "round", e))?;
        let batches = docs
            .iter()
            .map(|d| self.parse(d))
            .collect::<Result<Vec<_>, _>>()?;
        let now = self
            .store
            .now()
            .await
            .map_err(|e| QueueError::Clock(Box::new(e)))?;
        Ok(one_round_serial(&batches, now, self.delay)
            .into_iter()
            .cloned()
            .collect())
    }

    fn parse(&self, d: &Document) -> Result<Batch, QueueError> {
        let header = d.get_str("_id").unwrap_or("?").to_string();
        let malformed = |reason: &str| QueueError::Malformed {
            collection: self.name.clone(),
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
            created_at: *d
                .get_datetime("created_at")
                .map_err(|_| malformed("no creation time"))?,
            submitted: d.get_bool("submitted").unwrap_or(false),
            status,
            last_submitted_at: d.get_datetime("last_submitted_at").ok().copied(),
        })
    }
}

fn parse_status(s: &str) -> Option<BatchStatus> {
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
