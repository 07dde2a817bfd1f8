//! Checks that a server offers the single-document guarantees mongotx is built on.
//!
//! Everything in this crate rests on a few properties: a duplicate `_id` is rejected; a
//! conditional update is atomic (two writers conditioned on the same value cannot both win);
//! find-and-modify returns each caller the document as *its* change left it, even when many
//! callers change the same document at once (fencing tokens and claims hand out values that way);
//! and the server tells its time, by which every deadline is decided. A server that lacks one of
//! them would corrupt data silently, so it is refused up front, with the property named.
//! Beyond those, the server behaviours the protocol relies on (`$expr` and `$$NOW` in filters,
//! pipeline updates and their upserts, one `$$NOW` per statement, numeric `_id` equality,
//! findAndModify with a pipeline) are checked one by one ([`crate::server::semantics`]), and a
//! server without one of them is refused, naming it; the others (validators and their details,
//! comparison order, `$inc` overflow, the shape of errors, `let`, MongoDB 8.0's `bulkWrite`) and
//! the deployment's topology are reported.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bson::{doc, oid::ObjectId, Document};
use futures::future::join_all;
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};
use thiserror::Error;

use crate::server::clock::{self, Topology};
use crate::server::codes::{error_code, DUPLICATE_KEY, VALIDATION_FAILED};
use crate::server::semantics::{self, Semantic};
use crate::server::summarize;

/// What the probe found out about a server that passed it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerCapabilities {
    /// The version string the server reports, if it answers `buildInfo`.
    pub version: Option<String>,
    /// Standalone, replica set or sharded, from the server's `hello` reply.
    pub topology: Topology,
    /// Whether the server enforces `$jsonSchema` collection validators.
    pub json_schema_validation: bool,
    /// Whether the server runs `bulkWrite` (MongoDB 8.0+) and reports each of its writes, so that
    /// a round of protocol writes can go in one message (see `StoreBuilder::batch_writes`).
    pub bulk_write: bool,
    /// How many concurrent callers ran each atomicity check.
    pub contention_tasks: usize,
    /// How many compare-and-set attempts lost the race and retried (shows the check contended).
    pub contention_retries: u64,
    /// Every relied-on behaviour checked, held or not (the needed ones all held, or the probe
    /// would have refused the server).
    pub semantics: Vec<Semantic>,
}

/// A required property the server does not have, or a failure while checking.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// Inserting a second document with an existing `_id` succeeded.
    #[error("server refused: duplicate _id is not rejected (collection {collection}, _id {id})")]
    DuplicateIdAccepted {
        /// The scratch collection used.
        collection: String,
        /// The duplicated id.
        id: String,
    },
    /// Concurrent conditional updates lost increments.
    #[error(
        "server refused: conditional updates are not atomic under contention \
         (collection {collection}: {tasks} compare-and-set increments each reported success, \
         but the counter reached {found})"
    )]
    LostUpdate {
        /// The scratch collection used.
        collection: String,
        /// How many increments succeeded from the clients' point of view.
        tasks: usize,
        /// The final counter value.
        found: i64,
    },
    /// Find-and-modify with `returnDocument: after` returned something other than the new document.
    #[error(
        "server refused: find-and-modify does not return the new document \
         (collection {collection}: expected counter {expected}, got {found})"
    )]
    FindAndModifyStale {
        /// The scratch collection used.
        collection: String,
        /// The value the new document must have.
        expected: i64,
        /// What came back.
        found: String,
    },
    /// Concurrent find-and-modify calls were handed the same post-image.
    #[error(
        "server refused: find-and-modify does not give each caller its own post-image under \
         contention (collection {collection}: {tasks} concurrent increments returned only \
         {distinct} distinct values)"
    )]
    SharedPostImage {
        /// The scratch collection used.
        collection: String,
        /// How many concurrent calls were made.
        tasks: usize,
        /// How many distinct counter values came back.
        distinct: usize,
    },
    /// The server does not report its time, by which mongotx decides every deadline.
    #[error("server refused: its hello reply carries no localTime, and mongotx decides expiry by the server's clock")]
    NoServerTime,
    /// The server lacks a behaviour the transaction protocol cannot do without.
    #[error("server refused: it lacks `{name}` ({what}): {detail}")]
    Lacks {
        /// The behaviour's short name (see [`Semantic::name`]).
        name: &'static str,
        /// What it is.
        what: &'static str,
        /// What the server did instead.
        detail: String,
    },
    /// A probe step failed with a driver error.
    #[error(
        "server probe step `{step}` failed on collection {collection}: {}",
        summarize(source)
    )]
    Database {
        /// Which check was running.
        step: &'static str,
        /// The scratch collection used.
        collection: String,
        /// The driver error.
        #[source]
        source: mongodb::error::Error,
    },
}

impl ProbeError {
    /// Whether probing again may succeed (only a transient failure while checking).
    pub fn is_retryable(&self) -> bool {
        matches!(self, ProbeError::Database { source, .. } if crate::server::is_transient(source))
    }
}

/// Default number of concurrent callers in the atomicity checks.
pub const DEFAULT_CONTENTION_TASKS: usize = 64;

/// Probes the server behind `db` with the default contention level.
pub async fn probe(db: &Database) -> Result<ServerCapabilities, ProbeError> {
    probe_with(db, DEFAULT_CONTENTION_TASKS).await
}

/// Probes the server behind `db`, running each atomicity check with `tasks` concurrent callers.
pub async fn probe_with(db: &Database, tasks: usize) -> Result<ServerCapabilities, ProbeError> {
    let name = format!("mongotx_probe_{}", ObjectId::new().to_hex());
    let coll: Collection<Document> = db.collection(&name);
    let outcome = run_checks(db, &coll, &name, tasks.max(2)).await;
    // Best effort: a leftover scratch collection is harmless and must not mask the verdict.
    let _ = coll.drop().await;
    if let Ok(names) = db.list_collection_names().await {
        for leftover in names.iter().filter(|n| n.starts_with(&name)) {
            let _ = db.collection::<Document>(leftover).drop().await;
        }
    }
    outcome
}

async fn run_checks(
    db: &Database,
    coll: &Collection<Document>,
    name: &str,
    tasks: usize,
) -> Result<ServerCapabilities, ProbeError> {
    let fail = |step: &'static str| {
        let collection = name.to_string();
        move |source| ProbeError::Database {
            step,
            collection,
            source,
        }
    };

    // 1. Duplicate _id.
    coll.insert_one(doc! { "_id": "dup" })
        .await
        .map_err(fail("insert"))?;
    match coll.insert_one(doc! { "_id": "dup" }).await {
        Ok(_) => {
            return Err(ProbeError::DuplicateIdAccepted {
                collection: name.to_string(),
                id: "dup".to_string(),
            })
        }
        Err(e) if error_code(&e) == Some(DUPLICATE_KEY) => {}
        Err(e) => return Err(fail("duplicate insert")(e)),
    }

    // 2. Atomic conditional updates under contention.
    coll.insert_one(doc! { "_id": "counter", "n": 0_i64 })
        .await
        .map_err(fail("insert counter"))?;
    let retries = Arc::new(AtomicU64::new(0));
    let results = join_all((0..tasks).map(|_| {
        let coll = coll.clone();
        let retries = Arc::clone(&retries);
        tokio::spawn(async move { cas_increment(&coll, &retries).await })
    }))
    .await;
    for result in results {
        match result {
            Ok(done) => done.map_err(fail("compare-and-set"))?,
            Err(join) => {
                return Err(fail("compare-and-set")(mongodb::error::Error::custom(
                    join.to_string(),
                )))
            }
        }
    }
    let found = read_counter(coll, "counter")
        .await
        .map_err(fail("read counter"))?;
    if found != tasks as i64 {
        return Err(ProbeError::LostUpdate {
            collection: name.to_string(),
            tasks,
            found,
        });
    }

    // 3. Find-and-modify returns the post-image.
    let after = coll
        .find_one_and_update(doc! { "_id": "counter" }, doc! { "$inc": { "n": 1_i64 } })
        .return_document(ReturnDocument::After)
        .await
        .map_err(fail("find-and-modify"))?;
    let expected = tasks as i64 + 1;
    let returned = after.as_ref().and_then(|d| d.get_i64("n").ok());
    if returned != Some(expected) {
        return Err(ProbeError::FindAndModifyStale {
            collection: name.to_string(),
            expected,
            found: after.map_or_else(|| "no document".to_string(), |d| d.to_string()),
        });
    }

    // 4. ... and each concurrent caller gets its own.
    coll.insert_one(doc! { "_id": "tokens", "n": 0_i64 })
        .await
        .map_err(fail("insert token counter"))?;
    let handed_out = join_all((0..tasks).map(|_| {
        let coll = coll.clone();
        tokio::spawn(async move {
            coll.find_one_and_update(doc! { "_id": "tokens" }, doc! { "$inc": { "n": 1_i64 } })
                .return_document(ReturnDocument::After)
                .await
                .map(|d| d.and_then(|d| d.get_i64("n").ok()))
        })
    }))
    .await;
    let mut distinct = BTreeSet::new();
    for result in handed_out {
        let value = match result {
            Ok(value) => value.map_err(fail("concurrent find-and-modify"))?,
            Err(join) => {
                return Err(fail("concurrent find-and-modify")(
                    mongodb::error::Error::custom(join.to_string()),
                ))
            }
        };
        if let Some(value) = value {
            distinct.insert(value);
        }
    }
    if distinct.len() != tasks {
        return Err(ProbeError::SharedPostImage {
            collection: name.to_string(),
            tasks,
            distinct: distinct.len(),
        });
    }

    // 5. The server's time and topology.
    let hello = clock::hello(db).await.map_err(fail("hello"))?;
    if hello.local_time.is_none() {
        return Err(ProbeError::NoServerTime);
    }

    let found = semantics::all(db, name)
        .await
        .map_err(fail("behaviours mongotx relies on"))?;
    if let Some(missing) = found.iter().find(|s| s.needed && !s.held) {
        return Err(ProbeError::Lacks {
            name: missing.name,
            what: missing.what,
            detail: missing.detail.clone(),
        });
    }
    let json_schema_validation = found
        .iter()
        .any(|s| s.name == "json_schema_validation" && s.held);
    let bulk_write = bulk_write_support(db, coll).await;
    let version = db
        .run_command(doc! { "buildInfo": 1 })
        .await
        .ok()
        .and_then(|d| d.get_str("version").ok().map(str::to_string));

    Ok(ServerCapabilities {
        version,
        topology: hello.topology,
        json_schema_validation,
        bulk_write,
        contention_tasks: tasks,
        contention_retries: retries.load(Ordering::Relaxed),
        semantics: found,
    })
}

async fn read_counter(coll: &Collection<Document>, id: &str) -> mongodb::error::Result<i64> {
    Ok(coll
        .find_one(doc! { "_id": id })
        .await?
        .and_then(|d| d.get_i64("n").ok())
        .unwrap_or(-1))
}

async fn cas_increment(
    coll: &Collection<Document>,
    retries: &AtomicU64,
) -> Result<(), mongodb::error::Error> {
    loop {
        let current = read_counter(coll, "counter").await?.max(0);
        let result = coll
            .update_one(
                doc! { "_id": "counter", "n": current },
                doc! { "$set": { "n": current + 1 } },
            )
            .await?;
        if result.matched_count == 1 {
            return Ok(());
        }
        retries.fetch_add(1, Ordering::Relaxed);
        tokio::task::yield_now().await;
    }
}

/// Whether the server runs a `bulkWrite` of conditional updates and reports each one: the first
/// matches (the counter holds `tasks + 1`), the second cannot (no counter holds -1).
async fn bulk_write_support(db: &Database, coll: &Collection<Document>) -> bool {
    use mongodb::options::UpdateOneModel;
    let bump = |filter: Document| {
        UpdateOneModel::builder()
            .namespace(coll.namespace())
            .filter(filter)
            .update(doc! { "$inc": { "bulk": 1_i64 } })
            .build()
    };
    let models = [
        bump(doc! { "_id": "counter", "n": { "$gte": 0_i64 } }),
        bump(doc! { "_id": "counter", "n": -1_i64 }),
    ];
    match db
        .client()
        .bulk_write(models)
        .ordered(false)
        .verbose_results()
        .await
    {
        Ok(done) => {
            let matched = |i: usize| done.update_results.get(&i).map(|r| r.matched_count);
            matched(0) == Some(1) && matched(1) == Some(0)
        }
        Err(_) => false,
    }
}

/// Whether the server enforces a `$jsonSchema` validator (some accept and silently ignore it).
pub async fn validator_support(db: &Database) -> bool {
    let name = format!("mongotx_probe_validator_{}", ObjectId::new().to_hex());
    let created = db
        .run_command(doc! {
            "create": &name,
            "validator": { "$jsonSchema": { "bsonType": "object", "required": ["must"] } },
        })
        .await;
    if created.is_err() {
        return false;
    }
    let coll: Collection<Document> = db.collection(&name);
    let enforced = match coll.insert_one(doc! { "other": 1 }).await {
        Ok(_) => false,
        Err(e) => error_code(&e) == Some(VALIDATION_FAILED),
    };
    let _ = coll.drop().await;
    enforced
}
