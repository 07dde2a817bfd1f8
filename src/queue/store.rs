//! Batches in the database: adding them (idempotent per header, refused if the header is reused
//! for another content, stamped after everything of their service already taken) and one
//! queuer round over what is stored.

use std::time::Duration;

use bson::{doc, DateTime, Document};
use futures::TryStreamExt;
use mongodb::options::ReturnDocument;
use mongodb::{Collection, IndexModel};

use crate::server::codes;

use crate::queue::error::QueueError;
use crate::queue::model::{Batch, BatchStatus, Place, Service, DEFAULT_DELAY};
use crate::queue::queuer::one_round_serial;
use crate::repo::store::Store;

pub(crate) use crate::collections::{BATCHES_COLLECTION, SERVICES_SUFFIX};

/// The JSON Schema of a service document (the project's `schemas/batch_services.json`).
pub const SERVICES_SCHEMA: &str = include_str!("../../schemas/batch_services.json");

/// How many times adding a batch stamps it again before giving up (each time, a batch of its
/// service was taken or added in between).
const STAMPS: u32 = 32;

/// The JSON Schema of a batch document (the project's `schemas/batches.json`).
pub const BATCHES_SCHEMA: &str = include_str!("../../schemas/batches.json");

/// The longest content of a batch, in bytes: the server's 16 MiB document limit, less room for
/// the batch's other fields.
pub const MAX_CONTENT: usize = 16 * 1024 * 1024 - 16 * 1024;

/// The longest delay window: a longer one would hold a delayed batch, and with it every later
/// batch of its service, for days.
pub const MAX_DELAY: Duration = Duration::from_secs(24 * 3600);

pub(crate) use crate::repo::names::{name_problem, shown};

/// What is wrong with `name` as a collection of batches, if anything: a name MongoDB refuses, one
/// that holds mongotx's own records, or one ending in [`SERVICES_SUFFIX`] (it would be, or look
/// like, the services collection of another collection of batches, whose validator opening it
/// would replace).
fn collection_problem(store: &Store, name: &str) -> Option<String> {
    crate::repo::names::collection_problem(store, name, BATCHES_COLLECTION).or_else(|| {
        name.ends_with(SERVICES_SUFFIX)
            .then(|| "names ending in the services suffix are kept for services collections".into())
    })
}

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
    pub(crate) coll: Collection<Document>,
    pub(crate) services: Collection<Document>,
    pub(crate) name: String,
    delay: Duration,
}

impl Batches {
    /// Opens the default collection of batches, with a 15 s delay window ([`DEFAULT_DELAY`], the
    /// default of the queuer's reference design).
    pub async fn open(store: &Store) -> Result<Batches, QueueError> {
        Batches::with_collection(store, BATCHES_COLLECTION, DEFAULT_DELAY).await
    }

    /// Opens `collection`, retrying delayed batches `delay` after their last submission (zero:
    /// at once). A collection name the queue cannot use, or a delay over [`MAX_DELAY`], is
    /// [`QueueError::Invalid`], before anything is created.
    pub async fn with_collection(
        store: &Store,
        collection: &str,
        delay: Duration,
    ) -> Result<Batches, QueueError> {
        if let Some(problem) = collection_problem(store, collection) {
            return Err(QueueError::Invalid {
                collection: shown(collection),
                reason: format!("cannot keep batches there: {problem}"),
            });
        }
        if delay > MAX_DELAY {
            return Err(QueueError::Invalid {
                collection: collection.to_string(),
                reason: format!("a delay window of {delay:?} is over the {MAX_DELAY:?} allowed"),
            });
        }
        let coll = store
            .validated_protocol_collection(collection, BATCHES_SCHEMA)
            .await
            .map_err(|e| QueueError::database(collection, "*", "open", e))?;
        let services = store
            .validated_protocol_collection(
                &format!("{collection}{SERVICES_SUFFIX}"),
                SERVICES_SCHEMA,
            )
            .await
            .map_err(|e| QueueError::database(collection, "*", "open", e))?;
        // The queries of a round, of the monitor and of a taker's check that nothing older of
        // the service is open.
        for keys in [
            doc! { "service_id": 1, "created_at": 1, "_id": 1 },
            doc! { "status": 1, "submitted": 1 },
        ] {
            coll.create_index(IndexModel::builder().keys(keys).build())
                .await
                .map_err(|e| QueueError::database(collection, "*", "create an index", e))?;
        }
        Ok(Batches {
            store: store.clone(),
            coll,
            services,
            name: collection.to_string(),
            delay,
        })
    }

    /// Adds a batch, created now. Adding the same batch again changes nothing; reusing its
    /// header for another service or content is [`QueueError::HeaderReused`].
    ///
    /// Its stamp (`created_at`) comes after every batch of its service already added or taken
    /// for submission, so the order of stamps is the order of `add` calls that did not overlap,
    /// and no batch is ever stamped before one that went to the ledger ahead of it.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(batches: mongotx::queue::Batches) -> Result<(), mongotx::queue::QueueError> {
    /// use mongotx::queue::NewBatch;
    ///
    /// let batch = batches.add(&NewBatch::new("service-a", "batch-0001", "payload")).await?;
    /// // Submitters take each service's batches one at a time, oldest first:
    /// for next in batches.round().await? {
    ///     println!("submit {} of {}", next.header, next.service_id);
    /// }
    /// # let _ = batch;
    /// # Ok(()) }
    /// ```
    pub async fn add(&self, batch: &NewBatch) -> Result<Batch, QueueError> {
        self.check_header(&batch.header)?;
        if let Some(problem) = name_problem(&batch.service_id) {
            return Err(self.invalid_batch(format!(
                "batch {}: the service id {} is unusable: {problem}",
                shown(&batch.header),
                shown(&batch.service_id)
            )));
        }
        // An empty batch has nothing to submit (most likely its content was lost on the way);
        // one over the limit would fail at the server as a database error.
        let size = batch.content.len();
        if size == 0 || size > MAX_CONTENT {
            return Err(self.invalid_batch(format!(
                "batch {} of {}: its content has {size} bytes, not 1 to {MAX_CONTENT}",
                shown(&batch.header),
                shown(&batch.service_id)
            )));
        }
        let created_at = self.now().await?;
        let doc = doc! {
            "_id": &batch.header,
            "service_id": &batch.service_id,
            "content": &batch.content,
            "created_at": created_at,
            "submitted": false,
        };
        match self.coll.insert_one(&doc).await {
            Ok(_) => return self.place_after_the_service(&batch.header).await,
            // Added before (or by someone else): only the stored batch says which.
            Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) => {}
            Err(e) => return Err(self.db_error(&batch.header, "add", e)),
        }
        let stored = self.stored(&batch.header).await?;
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

    /// The adder's half of the ordering: a batch just inserted is stamped again
    /// while its service has a newer (or equal) stamp, a batch in its slot or a mark at or
    /// after it.
    async fn place_after_the_service(&self, header: &str) -> Result<Batch, QueueError> {
        let mut first = true;
        for _ in 0..STAMPS {
            let stored = self.stored(header).await?;
            let batch = self.parse(&stored)?;
            // Taken, or settled: its place is fixed now (and was checked by its taker).
            if batch.submitted || batch.status.is_some() {
                return Ok(batch);
            }
            let at = DateTime::from_chrono(batch.created_at);
            let before = self
                .services
                .find_one_and_update(
                    doc! { "_id": &batch.service_id },
                    doc! { "$max": { "newest": at } },
                )
                .upsert(true)
                .return_document(ReturnDocument::Before)
                .await
                .map_err(|e| self.db_error(header, "add", e))?;
            let service = before.as_ref().map(Service::parse).unwrap_or_default();
            let place = Place::of(&batch);
            // After a batch added earlier (first look only: later, the newest stamp may be this
            // batch's own previous one, or that of an add overlapping this one, unordered).
            let mut after: Option<i64> = service.newest.filter(|&n| first && n >= place.at);
            // After the batch in the slot and the mark, strictly.
            if let Some(bound) = service.bound(header).filter(|b| *b >= place) {
                after = after.max(Some(bound.at));
            }
            first = false;
            let Some(after) = after else {
                return Ok(batch);
            };
            let now = self.now().await?;
            let again = DateTime::from_millis(after.saturating_add(1).max(now.timestamp_millis()));
            let claimed_live = doc! { "claim.until": { "$gte": now } };
            let stamped = self
                .coll
                .update_one(
                    doc! {
                        "_id": header,
                        "created_at": at,
                        "submitted": false,
                        "status": { "$exists": false },
                        "$nor": [claimed_live],
                    },
                    doc! { "$set": { "created_at": again } },
                )
                .await
                .map_err(|e| self.db_error(header, "add", e))?;
            if stamped.matched_count == 0 {
                // A submitter has a claim on it: its taking will fail (the slot or the mark is
                // ahead), and it gives the claim back.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        Err(QueueError::Contended {
            collection: self.name.clone(),
            header: header.to_string(),
            what: "add",
            tries: STAMPS,
        })
    }

    /// One queuer round: the batches to submit now, by the one-round serial strategy (batches
    /// the ledger does not know, delayed batches past their window, then the oldest batch of each
    /// service with nothing in flight), over every stored batch the ledger has not settled, at the
    /// server's time.
    pub async fn round(&self) -> Result<Vec<Batch>, QueueError> {
        let open = doc! { "status": { "$nin": ["committed", "valid", "invalid"] } };
        let docs: Vec<Document> = self
            .coll
            .find(open)
            .projection(doc! { "content": 0 })
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

    /// The stored batch `header`.
    pub async fn get(&self, header: &str) -> Result<Batch, QueueError> {
        self.check_header(header)?;
        self.parse(&self.stored(header).await?)
    }

    /// Refuses a header no batch can have, naming it.
    pub(crate) fn check_header(&self, header: &str) -> Result<(), QueueError> {
        match name_problem(header) {
            None => Ok(()),
            Some(problem) => Err(self.invalid_batch(format!(
                "the header {} is unusable: {problem}",
                shown(header)
            ))),
        }
    }

    pub(crate) fn invalid_batch(&self, reason: String) -> QueueError {
        QueueError::InvalidBatch {
            collection: self.name.clone(),
            reason,
        }
    }

    /// The server's time, as this process estimates it.
    pub(crate) async fn now(&self) -> Result<DateTime, QueueError> {
        self.store
            .now()
            .await
            .map_err(|e| QueueError::Clock(Box::new(e)))
    }

    pub(crate) fn db_error(
        &self,
        header: &str,
        op: &'static str,
        e: mongodb::error::Error,
    ) -> QueueError {
        QueueError::database(&self.name, header, op, e)
    }

    /// The stored batch `header`.
    pub(crate) async fn stored(&self, header: &str) -> Result<Document, QueueError> {
        self.coll
            .find_one(doc! { "_id": header })
            .await
            .map_err(|e| self.db_error(header, "read", e))?
            .ok_or_else(|| QueueError::UnknownBatch {
                collection: self.name.clone(),
                header: header.to_string(),
            })
    }

    /// `service`'s document (empty if it has none yet).
    pub(crate) async fn service(&self, service: &str) -> Result<Service, QueueError> {
        Ok(self
            .services
            .find_one(doc! { "_id": service })
            .await
            .map_err(|e| self.db_error("*", "read the service", e))?
            .as_ref()
            .map(Service::parse)
            .unwrap_or_default())
    }

    pub(crate) fn parse(&self, d: &Document) -> Result<Batch, QueueError> {
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
        })
    }
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
