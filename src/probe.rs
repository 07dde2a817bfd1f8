//! Checks that a server offers the single-document guarantees mongotx is built on.
//!
//! Everything in this crate rests on three properties: a duplicate `_id` is rejected, a
//! conditional update is atomic (two writers conditioned on the same value cannot both win), and
//! find-and-modify can return the document as it is after the change. A server that lacks one
//! of them would corrupt data silently, so it is refused up front. Server-side `$jsonSchema`
//! validation is probed too, but only reported: its absence is tolerated.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bson::{doc, oid::ObjectId, Document};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};
use thiserror::Error;

/// Error code MongoDB uses for a duplicate key.
pub(crate) const DUPLICATE_KEY: i32 = 11000;
/// Error code MongoDB uses when a server-side validator rejects a document.
pub(crate) const VALIDATION_FAILED: i32 = 121;

/// What the probe found out about a server that passed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerCapabilities {
    /// The version string the server reports, if it answers `buildInfo`.
    pub version: Option<String>,
    /// Whether the server enforces `$jsonSchema` collection validators.
    pub json_schema_validation: bool,
    /// How many concurrent compare-and-set tasks were run in the atomicity check.
    pub contention_tasks: usize,
    /// How many of their attempts lost the race and retried (shows the check really contended).
    pub contention_retries: u64,
}

/// A required property the server does not have, or a failure while checking.
#[derive(Debug, Error)]
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
    /// A probe step failed with a driver error.
    #[error("server probe step `{step}` failed on collection {collection}: {source}")]
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

/// Default number of concurrent compare-and-set tasks in the atomicity check.
pub const DEFAULT_CONTENTION_TASKS: usize = 64;

/// Probes the server behind `db` with the default contention level.
pub async fn probe(db: &Database) -> Result<ServerCapabilities, ProbeError> {
    probe_with(db, DEFAULT_CONTENTION_TASKS).await
}

/// Probes the server behind `db`, running `tasks` concurrent compare-and-set increments.
pub async fn probe_with(db: &Database, tasks: usize) -> Result<ServerCapabilities, ProbeError> {
    let name = format!("mongotx_probe_{}", ObjectId::new().to_hex());
    let coll: Collection<Document> = db.collection(&name);
    let outcome = run_checks(db, &coll, &name, tasks).await;
    // Best effort: a leftover scratch collection is harmless and must not mask the verdict.
    let _ = coll.drop().await;
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
    let mut handles = Vec::with_capacity(tasks);
    for _ in 0..tasks {
        let coll = coll.clone();
        let retries = Arc::clone(&retries);
        handles.push(tokio::spawn(
            async move { cas_increment(&coll, &retries).await },
        ));
    }
    for handle in handles {
        match handle.await {
            Ok(result) => result.map_err(fail("compare-and-set"))?,
            Err(join) => {
                return Err(ProbeError::Database {
                    step: "compare-and-set",
                    collection: name.to_string(),
                    source: mongodb::error::Error::custom(join.to_string()),
                })
            }
        }
    }
    let found = coll
        .find_one(doc! { "_id": "counter" })
        .await
        .map_err(fail("read counter"))?
        .and_then(|d| d.get_i64("n").ok())
        .unwrap_or(-1);
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
            found: format!("{after:?}"),
        });
    }

    let json_schema_validation = validator_support(db).await;
    let version = db
        .run_command(doc! { "buildInfo": 1 })
        .await
        .ok()
        .and_then(|d| d.get_str("version").ok().map(str::to_string));

    Ok(ServerCapabilities {
        version,
        json_schema_validation,
        contention_tasks: tasks,
        contention_retries: retries.load(Ordering::Relaxed),
    })
}

async fn cas_increment(
    coll: &Collection<Document>,
    retries: &AtomicU64,
) -> Result<(), mongodb::error::Error> {
    loop {
        let current = coll
            .find_one(doc! { "_id": "counter" })
            .await?
            .and_then(|d| d.get_i64("n").ok())
            .unwrap_or(0);
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

/// The server error code inside a driver error, if any.
pub(crate) fn error_code(error: &mongodb::error::Error) -> Option<i32> {
    use mongodb::error::{ErrorKind, WriteFailure};
    match error.kind.as_ref() {
        ErrorKind::Write(WriteFailure::WriteError(e)) => Some(e.code),
        ErrorKind::Write(WriteFailure::WriteConcernError(e)) => Some(e.code),
        ErrorKind::Command(e) => Some(e.code),
        ErrorKind::InsertMany(e) => e
            .write_errors
            .as_ref()
            .and_then(|errors| errors.first().map(|w| w.code)),
        _ => None,
    }
}
