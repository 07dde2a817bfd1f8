//! Tombstones and placeholders: the document a delete leaves in place of a live one, and the one a
//! fence puts in place of an absent one. Both carry, at the first path of every unique index, a
//! marker of their own id, so that no user's unique index refuses them; the store keeps those
//! paths per collection and reads them again when an index made since refuses a write.

use std::sync::Arc;

use bson::{doc, Bson, DateTime, Document};
use futures::TryStreamExt;
use mongodb::{Collection, IndexModel};

use crate::repo::changes::set_path;
use crate::repo::fields;
use crate::repo::hold::write::{self, Write};
use crate::repo::store::Store;
use crate::server::codes;

/// The paths tombstones of `collection` fill with a per-document marker: the first key of every
/// unique index that would otherwise index all tombstones under one missing (null) key.
pub(crate) async fn refresh_markers(
    store: &Store,
    collection: &str,
) -> mongodb::error::Result<Arc<Vec<String>>> {
    let indexes: Vec<IndexModel> = store
        .inner
        .db
        .collection::<Document>(collection)
        .list_indexes()
        .await?
        .try_collect()
        .await?;
    let paths: Vec<String> = indexes
        .iter()
        .filter(|index| {
            let options = index.options.as_ref();
            options.and_then(|o| o.unique) == Some(true)
                && options.and_then(|o| o.sparse) != Some(true)
                && options
                    .and_then(|o| o.partial_filter_expression.as_ref())
                    .is_none()
        })
        .filter_map(|index| index.keys.keys().next().cloned())
        .filter(|path| path != "_id")
        .collect();
    let paths = Arc::new(paths);
    if let Ok(mut markers) = store.inner.markers.lock() {
        markers.insert(collection.to_string(), Arc::clone(&paths));
    }
    Ok(paths)
}

fn markers(store: &Store, collection: &str) -> Arc<Vec<String>> {
    store
        .inner
        .markers
        .lock()
        .ok()
        .and_then(|markers| markers.get(collection).cloned())
        .unwrap_or_default()
}

/// Replaces what `filter` matches in `coll` by the tombstone of `id` at `version`; refreshes
/// the tombstone's unique-index markers and tries again if a unique index refuses it.
pub(crate) async fn write_tombstone(
    store: &Store,
    coll: &Collection<Document>,
    filter: Document,
    id: &Bson,
    schema_version: i64,
    version: i64,
) -> mongodb::error::Result<u64> {
    let write = tombstone_write(
        store,
        coll.name(),
        filter.clone(),
        id,
        schema_version,
        version,
    )
    .await?;
    let sent = write::run(coll, &write).await;
    after_tombstone(store, coll, filter, id, schema_version, version, sent).await
}

/// The replacement of what `filter` matches in collection `name` by the tombstone of `id` at
/// `version`, with the unique-index markers this process knows of (see
/// [`after_tombstone`](Store::after_tombstone) for when they are out of date).
pub(crate) async fn tombstone_write(
    store: &Store,
    name: &str,
    filter: Document,
    id: &Bson,
    schema_version: i64,
    version: i64,
) -> mongodb::error::Result<Write> {
    let deleted_at = store
        .now()
        .await
        .map_err(|e| mongodb::error::Error::custom(e.to_string()))?;
    let paths = markers(store, name);
    Ok(Write::Replace(
        filter,
        tombstone(id, schema_version, version, deleted_at, &paths),
    ))
}

/// What a tombstone write that came back `sent` comes to: a unique index that refused it
/// (an index made after this process read the markers) gets the markers read again and the
/// tombstone sent once more.
pub(crate) async fn after_tombstone(
    store: &Store,
    coll: &Collection<Document>,
    filter: Document,
    id: &Bson,
    schema_version: i64,
    version: i64,
    sent: mongodb::error::Result<u64>,
) -> mongodb::error::Result<u64> {
    match sent {
        Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) => {
            refresh_markers(store, coll.name()).await?;
            let write =
                tombstone_write(store, coll.name(), filter, id, schema_version, version).await?;
            match write::run(coll, &write).await {
                Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) => Err(
                    mongodb::error::Error::custom("a unique index refused the tombstone twice"),
                ),
                other => other,
            }
        }
        other => other,
    }
}

/// Inserts the placeholder fence of transaction `txn` for the absent document `id` of `coll`:
/// system fields, the fence hold and, at each unique-index path, a per-id marker (as a
/// tombstone has), so that no unique index refuses it. Returns whether it was inserted (`false`:
/// the id is taken).
pub(crate) async fn write_placeholder(
    store: &Store,
    coll: &Collection<Document>,
    id: &Bson,
    schema_version: i64,
    txn: bson::oid::ObjectId,
    hold: Document,
) -> mongodb::error::Result<bool> {
    let name = coll.name().to_string();
    let mut paths = markers(store, &name);
    for attempt in 0..2 {
        let mut placeholder = tombstone(id, schema_version, 0, DateTime::MIN, &paths);
        placeholder.remove(fields::DELETED);
        placeholder.insert(fields::ACTIVE_TXN, txn);
        placeholder.insert(fields::HOLD, hold.clone());
        match coll.insert_one(placeholder).await {
            Ok(_) => return Ok(true),
            Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) => {
                if codes::duplicate_key_index(&e).is_none_or(|index| index == "_id_") || attempt > 0
                {
                    return Ok(false);
                }
                paths = refresh_markers(store, &name).await?;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

/// Marks a tombstone's unique-index fields with a value no other document can have.
const TOMBSTONE_MARKER: &str = "_mongotx_tombstone";

/// The tombstone of `id`: system fields only, plus a per-id marker at each of `paths` so that
/// tombstones never collide in a user's unique index.
pub(crate) fn tombstone(
    id: &Bson,
    schema_version: i64,
    version: i64,
    deleted_at: DateTime,
    paths: &[String],
) -> Document {
    let mut doc = doc! {
        "_id": id.clone(),
        fields::SCHEMA_VERSION: schema_version,
        fields::VERSION: version,
        fields::DELETED: deleted_at,
    };
    for path in paths {
        // A path under another marked path lands inside that marker document; still unique per id.
        let _ = set_path(
            &mut doc,
            path,
            Bson::Document(doc! { TOMBSTONE_MARKER: id.clone() }),
        );
    }
    doc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tombstones_mark_unique_fields_per_id() {
        let at = DateTime::from_millis(1);
        let plain = tombstone(&Bson::from("a"), 1, 3, at, &[]);
        assert_eq!(
            plain,
            doc! { "_id": "a", "_schema": 1_i64, "_version": 3_i64, "_deleted": at }
        );
        let marked = tombstone(
            &Bson::from("a"),
            1,
            3,
            at,
            &["email".to_string(), "login.name".to_string()],
        );
        assert_eq!(
            marked.get_document("email").expect("email marker"),
            &doc! { TOMBSTONE_MARKER: "a" }
        );
        assert_eq!(
            marked
                .get_document("login")
                .and_then(|l| l.get_document("name"))
                .expect("nested marker"),
            &doc! { TOMBSTONE_MARKER: "a" }
        );
    }
}
