//! The `mongotx_meta` collection: one document per managed collection, which says that the
//! collection holds stamped documents (so the GC knows where to sweep for holds and purge
//! tombstones) and carries its **version floor**.
//!
//! # Why a version floor
//!
//! Versions are the optimistic lock, so a version must never repeat for an id: a caller holding a
//! stale version from an old document must not match a new one. Tombstones keep the last version
//! of a deleted id, but once a tombstone is purged the id could be inserted again from version 1.
//! So before tombstones are purged, the collection's floor is raised to at least their highest
//! version, and every insert starts at `floor + 1`. A collection that was never purged has floor 0
//! and inserts start at 1.
//!
//! Processes cache the floor for at most `refresh`; a purge deletes tombstones only once the floor
//! covering them has been in place for `grace` (server time), longer than any cache lives, so no
//! insert sent after the purge can use a floor that is too low. (An insert sent before the purge
//! and delivered more than `grace - refresh` later could; docs/guarantees.md lists this limit.)

use std::time::{Duration, Instant};

use bson::{doc, Bson, DateTime, Document};
use futures::TryStreamExt;
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};

use crate::repo::fields;
use crate::repo::format;
use crate::server::codes;

pub use crate::collections::META_COLLECTION;

const PREFIX: &str = "collection:";
const FLOOR: &str = "floor";
const RAISED: &str = "raised";
const NAME: &str = "collection";
/// Set on a collection whose tombstones are state, not garbage: the purge leaves them.
const KEEP_TOMBSTONES: &str = "keep_tombstones";

fn meta_id(collection: &str) -> String {
    format!("{PREFIX}{collection}")
}

/// Records that `collection` holds stamped documents (idempotent), of stored format `writes` or
/// a newer one already recorded (see `repo::format`); returns its registry document.
pub(crate) async fn register(
    meta: &Collection<Document>,
    collection: &str,
    writes: i64,
) -> mongodb::error::Result<Option<Document>> {
    meta.find_one_and_update(
        doc! { "_id": meta_id(collection) },
        doc! {
            "$setOnInsert": { NAME: collection, FLOOR: 0_i64 },
            "$max": { format::FIELD: writes },
        },
    )
    .upsert(true)
    .return_document(ReturnDocument::After)
    .await
}

/// The registry document of `collection`, if it has one.
pub(crate) async fn read(
    meta: &Collection<Document>,
    collection: &str,
) -> mongodb::error::Result<Option<Document>> {
    meta.find_one(doc! { "_id": meta_id(collection) }).await
}

/// Whether the registry document `found` says its collection's tombstones are kept for good.
pub(crate) fn keeps(found: &Document) -> bool {
    found.get_bool(KEEP_TOMBSTONES) == Ok(true)
}

/// Records that the tombstones of `collection` must never be purged (idempotent): an OBT
/// collection's tombstones keep each released id's last fencing token.
pub(crate) async fn keep_tombstones(
    meta: &Collection<Document>,
    collection: &str,
) -> mongodb::error::Result<()> {
    meta.update_one(
        doc! { "_id": meta_id(collection), KEEP_TOMBSTONES: { "$ne": true } },
        doc! { "$set": { KEEP_TOMBSTONES: true } },
    )
    .await
    .map(|_| ())
}

/// The collections that hold stamped documents.
pub(crate) async fn managed(db: &Database) -> mongodb::error::Result<Vec<String>> {
    let docs: Vec<Document> = db
        .collection::<Document>(META_COLLECTION)
        .find(doc! { NAME: { "$exists": true } })
        .projection(doc! { NAME: 1 })
        .await?
        .try_collect()
        .await?;
    Ok(docs
        .iter()
        .filter_map(|d| d.get_str(NAME).ok().map(str::to_string))
        .collect())
}

/// Reads the version floor of `collection` (0 when none was ever raised).
pub(crate) async fn read_floor(
    meta: &Collection<Document>,
    collection: &str,
) -> mongodb::error::Result<i64> {
    Ok(meta
        .find_one(doc! { "_id": meta_id(collection) })
        .await?
        .and_then(|d| match d.get(FLOOR) {
            Some(Bson::Int64(v)) => Some(*v),
            Some(Bson::Int32(v)) => Some(i64::from(*v)),
            _ => None,
        })
        .unwrap_or(0))
}

/// A cached floor.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CachedFloor {
    pub(crate) floor: i64,
    pub(crate) read_at: Instant,
}

impl CachedFloor {
    /// Whether the cached value may still be used.
    pub(crate) fn fresh(&self, refresh: Duration) -> bool {
        self.read_at.elapsed() < refresh
    }
}

/// The filter of tombstones eligible for purging: deleted before `cutoff`, not held.
pub(crate) fn purgeable(cutoff: DateTime) -> Document {
    doc! {
        fields::DELETED: { "$lt": cutoff },
        fields::ACTIVE_TXN: null,
        fields::VERSION: { "$exists": true },
        fields::SCHEMA_VERSION: { "$exists": true },
    }
}

/// Raises the floor of `collection` to cover `version` (writing stored format `writes`); returns
/// when the floor covering it was raised (server time), or `None` if that is not recorded
/// (raised long ago).
pub(crate) async fn raise_floor(
    meta: &Collection<Document>,
    collection: &str,
    version: i64,
    now: DateTime,
    writes: i64,
) -> mongodb::error::Result<Option<DateTime>> {
    for _ in 0..3 {
        let raised = meta
            .update_one(
                doc! { "_id": meta_id(collection), FLOOR: { "$lt": version } },
                doc! {
                    "$set": { FLOOR: version, RAISED: now, NAME: collection },
                    "$max": { format::FIELD: writes },
                },
            )
            .await?;
        if raised.matched_count == 1 {
            return Ok(Some(now));
        }
        if let Some(current) = meta.find_one(doc! { "_id": meta_id(collection) }).await? {
            // Already at or above `version`: covered since it was last raised.
            return Ok(current.get_datetime(RAISED).ok().copied());
        }
        // Never registered (a collection purged by hand): create it raised, then look again.
        let created = meta
            .insert_one(doc! {
                "_id": meta_id(collection),
                NAME: collection,
                FLOOR: version,
                RAISED: now,
                format::FIELD: writes,
            })
            .await;
        match created {
            Ok(_) => return Ok(Some(now)),
            Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(mongodb::error::Error::custom(
        "the version floor kept changing while it was being raised",
    ))
}
