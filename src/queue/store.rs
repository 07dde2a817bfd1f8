//! Batches in the database: opening the collections, adding batches (idempotent per header,
//! refused if the header is reused for another content, stamped from their service's counter
//! before they are inserted, after everything of their service already added or taken; the
//! serial adder's check) and one queuer round over what is stored.
//!
//! Every write of the queue (here, in `stamp`, `claim` and `parallel`) follows the stored
//! format's rule (`repo::format`): the operation reads the format its store writes before its
//! first write (`db::writes`), marks the batch or service it rewrites with it (nothing for format
//! 1), and matches the document only while it is of a format this store reads (`db::guarded`);
//! every reading of a batch (`db::parse`) or a service (`db::service`) refuses one of a newer
//! format, so a write the guard kept from matching ends in that typed refusal when the caller
//! reads the document to learn why.

use std::time::Duration;

use bson::{doc, DateTime, Document};
use futures::TryStreamExt;
use mongodb::IndexModel;

use crate::server::codes;

use crate::queue::db::{check_batch, db_error, parse, service, stored, writes};
use crate::queue::error::QueueError;
use crate::queue::model::{
    keys_doc, keys_problem, parse_keys, Batch, BatchStatus, Keys, Place, Strategy, DEFAULT_DELAY,
};
use crate::queue::queuer::one_round;
use crate::queue::stamp::{draw, stamp_again};
use crate::queue::Batches;
use crate::repo::format;
use crate::repo::store::Store;

pub(crate) use crate::collections::{BATCHES_COLLECTION, SERVICES_SUFFIX};
use crate::repo::open;

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
    /// The keys it reads and writes, if it declares them (see [`Keys`]); without them it
    /// conflicts with every batch of its service. Only the parallel strategy looks at them.
    pub keys: Option<Keys>,
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
            keys: None,
        }
    }

    /// The same batch, declaring the keys it reads and writes (at most [`MAX_KEYS`](crate::queue::MAX_KEYS) of each).
    pub fn with_keys<R, W>(mut self, reads: R, writes: W) -> NewBatch
    where
        R: IntoIterator,
        R::Item: Into<String>,
        W: IntoIterator,
        W::Item: Into<String>,
    {
        self.keys = Some(Keys::new(reads, writes));
        self
    }

    /// This batch as stored once its adder has placed it at `at`, before anyone took it.
    pub(crate) fn unsent(&self, at: i64, strategy: Strategy) -> Batch {
        Batch {
            header: self.header.clone(),
            service_id: self.service_id.clone(),
            created_at: DateTime::from_millis(at).to_chrono(),
            submitted: false,
            status: None,
            last_submitted_at: None,
            keys: self.keys.clone(),
            strategy,
        }
    }
}

/// The body of [`Batches::open`].
pub(crate) async fn open(store: &Store) -> Result<Batches, QueueError> {
    Batches::with_collection(store, BATCHES_COLLECTION, DEFAULT_DELAY).await
}

/// Refuses a collection the queue cannot use, or a delay over [`MAX_DELAY`].
pub(crate) fn check_collection(
    store: &Store,
    collection: &str,
    delay: Duration,
) -> Result<(), QueueError> {
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
    Ok(())
}

/// The body of [`Batches::with_collection`].
pub(crate) async fn with_collection(
    store: &Store,
    collection: &str,
    delay: Duration,
) -> Result<Batches, QueueError> {
    check_collection(store, collection, delay)?;
    let coll = open::validated_protocol_collection(store, collection, BATCHES_SCHEMA)
        .await
        .map_err(|e| QueueError::database(collection, "*", "open", e))?;
    let services = open::validated_protocol_collection(
        store,
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

/// What `add` did: the batch is in its place, or it is a batch of a parallel service, inserted
/// (`again` false) or found stored and never sent (`again` true), that its adder's check must
/// still place (`parallel::place_after_went`, which `Batches::add` calls: the parallel strategy
/// builds on this module).
pub(crate) enum Added {
    Placed(Batch),
    ToPlace {
        at: DateTime,
        writes: i64,
        again: bool,
    },
}

/// The body of [`Batches::add`], but for a parallel service's check.
pub(crate) async fn add(queue: &Batches, batch: &NewBatch) -> Result<Added, QueueError> {
    check_header(queue, &batch.header)?;
    if let Some(problem) = name_problem(&batch.service_id) {
        return Err(invalid_batch(
            queue,
            format!(
                "batch {}: the service id {} is unusable: {problem}",
                shown(&batch.header),
                shown(&batch.service_id)
            ),
        ));
    }
    // An empty batch has nothing to submit (most likely its content was lost on the way);
    // one over the limit would fail at the server as a database error (its declared keys
    // count towards the limit: they are stored beside it).
    let size = batch.content.len();
    let keys: usize = batch.keys.as_ref().map_or(0, |k| {
        k.reads()
            .iter()
            .chain(k.writes())
            .map(|key| key.len() + 8)
            .sum()
    });
    if size == 0 || size + keys > MAX_CONTENT {
        return Err(invalid_batch(
            queue,
            format!(
                "batch {} of {}: its content has {size} bytes and its keys {keys}, not 1 to {MAX_CONTENT} in all",
                shown(&batch.header),
                shown(&batch.service_id)
            ),
        ));
    }
    if let Some(problem) = batch.keys.as_ref().and_then(keys_problem) {
        return Err(invalid_batch(
            queue,
            format!(
                "batch {} of {}: {problem}",
                shown(&batch.header),
                shown(&batch.service_id)
            ),
        ));
    }
    // Added before (or by someone else): only the stored batch says which. Looked up before
    // the stamp is drawn, so that a refusal writes nothing.
    let found = queue
        .coll
        .find_one(doc! { "_id": &batch.header })
        .await
        .map_err(|e| db_error(queue, &batch.header, "add", e))?;
    if let Some(stored) = found {
        return added_before(queue, batch, &stored).await;
    }
    let writes = writes(queue).await?;
    if batch.keys.is_some() && writes < PARALLEL_FORMAT {
        return Err(before_parallel_format(queue, "declared keys", writes));
    }
    // The stamp comes from the service's counter, after every stamp given to a batch of the
    // service, its slot and its mark: the batch is inserted in its place, so no submitter can
    // find it anywhere else.
    let drawn = draw(queue, &batch.service_id, &batch.header, writes).await?;
    if drawn.strategy == Strategy::Parallel && writes < PARALLEL_FORMAT {
        // Switched back to an older format since the service chose the parallel strategy.
        return Err(before_parallel_format(
            queue,
            "the batches of a parallel service",
            writes,
        ));
    }
    let created_at = drawn.at;
    let mut doc = doc! {
        "_id": &batch.header,
        "service_id": &batch.service_id,
        "content": &batch.content,
        "created_at": created_at,
        "submitted": false,
    };
    if let Some(keys) = &batch.keys {
        doc.insert("keys", keys_doc(keys));
    }
    // The service's strategy goes with each batch: it never changes once a batch of the
    // service has drawn a stamp, and rounds and claims then need not read the service.
    if drawn.strategy == Strategy::Parallel {
        doc.insert("strategy", Strategy::Parallel.as_str());
    }
    format::mark(&mut doc, writes);
    match queue.coll.insert_one(&doc).await {
        Ok(_) if drawn.strategy == Strategy::Parallel => Ok(Added::ToPlace {
            at: created_at,
            writes,
            again: false,
        }),
        Ok(_) => Ok(Added::Placed(
            place_after_the_service(queue, batch, created_at, writes).await?,
        )),
        // Added by someone else meanwhile (the stamp drawn is left unused).
        Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) => {
            added_before(queue, batch, &stored(queue, &batch.header).await?).await
        }
        Err(e) => Err(db_error(queue, &batch.header, "add", e)),
    }
}

/// `batch` found stored: the same batch (the stored one is returned), or its header reused. A
/// batch that a later one may still go ahead of is looked at as its adder would have (its adder
/// may have died, or failed, before it did), so that it is not stamped again after this add
/// returned, behind batches added later.
async fn added_before(
    queue: &Batches,
    batch: &NewBatch,
    stored: &Document,
) -> Result<Added, QueueError> {
    // Of a newer format, it is not compared: its fields may mean something else there.
    check_batch(queue, stored)?;
    let same = stored.get_str("service_id") == Ok(batch.service_id.as_str())
        && stored.get_str("content") == Ok(batch.content.as_str())
        && parse_keys(stored).ok() == Some(batch.keys.clone());
    if !same {
        return Err(QueueError::HeaderReused {
            collection: queue.name.clone(),
            header: batch.header.clone(),
            service_id: stored.get_str("service_id").unwrap_or("?").to_string(),
        });
    }
    let found = parse(queue, stored)?;
    // Whether a batch added later may still go ahead of it, so that a claimant would stamp it
    // again later. Serial: a new batch nobody took (one taken holds the slot, and nothing passes
    // it). Parallel: a batch never marked sent that the ledger never had, a claimant deciding on
    // it or not (the check waits for the claimant).
    let movable = match found.strategy {
        Strategy::Serial => found.status.is_none() && !found.submitted,
        Strategy::Parallel => {
            !stored.get_bool("sent").unwrap_or(false)
                && !found.status.is_some_and(BatchStatus::at_ledger)
        }
    };
    if !movable {
        return Ok(Added::Placed(found));
    }
    let writes = writes(queue).await?;
    let at = DateTime::from_chrono(found.created_at);
    Ok(match found.strategy {
        Strategy::Parallel => Added::ToPlace {
            at,
            writes,
            again: true,
        },
        Strategy::Serial => Added::Placed(place_after_the_service(queue, batch, at, writes).await?),
    })
}

/// The stored format that keeps declared keys and the parallel strategy: a release before it
/// would take a parallel service's batches for serial ones, and its validators refuse the fields.
pub(crate) const PARALLEL_FORMAT: i64 = 2;

/// The refusal of `what` while the database writes format `writes`.
pub(crate) fn before_parallel_format(queue: &Batches, what: &str, writes: i64) -> QueueError {
    QueueError::Invalid {
        collection: queue.name.clone(),
        reason: format!(
            "{what} need stored format {PARALLEL_FORMAT}, and the database writes format \
             {writes}: switch it once every instance runs a release that reads it (`mongotx \
             format set {PARALLEL_FORMAT}`, `Store::set_format`)"
        ),
    }
}

/// The adder's half of the ordering, once the batch is inserted: a batch taken meanwhile
/// (its add overlapping this one, its stamp drawn later) may hold the slot, or have gone and
/// moved the mark, ahead of it. Then it is stamped again, after them. Either this reading
/// (after the insert) sees the taken slot, or the taker's count (sent after the slot was
/// taken) sees the inserted batch; so a batch whose `add` returned never goes after a
/// batch added later.
async fn place_after_the_service(
    queue: &Batches,
    batch: &NewBatch,
    created_at: DateTime,
    writes: i64,
) -> Result<Batch, QueueError> {
    let header = batch.header.as_str();
    let mut place = Place {
        at: created_at.timestamp_millis(),
        header: header.to_string(),
    };
    for _ in 0..STAMPS {
        let service = service(queue, &batch.service_id).await?;
        if service.bound(header).is_none_or(|b| b < place) {
            return Ok(batch.unsent(place.at, Strategy::Serial));
        }
        let condition = doc! { "status": { "$exists": false } };
        if let Some(again) =
            stamp_again(queue, &batch.service_id, &place, condition, writes).await?
        {
            place.at = again.timestamp_millis();
            continue;
        }
        let batch = parse(queue, &stored(queue, header).await?)?;
        // Taken, or settled: its place is fixed now (and was checked by its taker).
        if batch.submitted || batch.status.is_some() {
            return Ok(batch);
        }
        // Stamped again by a claimant, or claimed for a moment (the claimant's taking of the
        // slot fails, since the slot or the mark is ahead, and it gives the claim back).
        place.at = batch.created_at.timestamp_millis();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Err(QueueError::Contended {
        collection: queue.name.clone(),
        header: header.to_string(),
        what: "add",
        tries: STAMPS,
    })
}

/// The body of [`Batches::round`].
pub(crate) async fn round(queue: &Batches) -> Result<Vec<Batch>, QueueError> {
    // Valid batches too: under the parallel strategy they keep the younger batches they
    // conflict with waiting (the ledger may still forget them).
    let open = doc! { "status": { "$nin": ["committed", "invalid"] } };
    let docs: Vec<Document> = queue
        .coll
        .find(open)
        .projection(doc! { "content": 0 })
        .await
        .map_err(|e| QueueError::database(&queue.name, "*", "round", e))?
        .try_collect()
        .await
        .map_err(|e| QueueError::database(&queue.name, "*", "round", e))?;
    let batches = docs
        .iter()
        .map(|d| parse(queue, d))
        .collect::<Result<Vec<_>, _>>()?;
    let now = queue
        .store
        .now()
        .await
        .map_err(|e| QueueError::Clock(Box::new(e)))?;
    Ok(one_round(&batches, now, queue.delay)
        .into_iter()
        .cloned()
        .collect())
}

/// The body of [`Batches::get`].
pub(crate) async fn get(queue: &Batches, header: &str) -> Result<Batch, QueueError> {
    check_header(queue, header)?;
    parse(queue, &stored(queue, header).await?)
}

/// Refuses a header no batch can have, naming it.
pub(crate) fn check_header(queue: &Batches, header: &str) -> Result<(), QueueError> {
    match name_problem(header) {
        None => Ok(()),
        Some(problem) => Err(invalid_batch(
            queue,
            format!("the header {} is unusable: {problem}", shown(header)),
        )),
    }
}

pub(crate) fn invalid_batch(queue: &Batches, reason: String) -> QueueError {
    QueueError::InvalidBatch {
        collection: queue.name.clone(),
        reason,
    }
}
