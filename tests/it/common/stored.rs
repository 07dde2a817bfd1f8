//! The stored format (docs/format.md), held to its schemas around every test.
//!
//! When a test database is made, the system collections that mongotx creates without a validator
//! (the transaction records and the registry, under their default names) are created with their
//! schemas as `$jsonSchema` validators, so the server refuses a record or a registry document
//! that breaks them while the test runs. (The coordination modules install their own validators
//! from the same files when they open their collections, and a repository its own.)
//!
//! When a passing test's database goes, every document whose kind is known is read and checked
//! with mongotx's own validator first: the system collections and the coordination defaults
//! against their schemas, and every stamped document of every collection the registry lists
//! against the system fields (`schemas/managed_system_fields.json`). A plain document (no system
//! field at all) is data, not mongotx's, and is left alone. What breaks a schema fails the test,
//! listed by collection and id, unless the test said it leaves foreign data behind on purpose
//! ([`TestDb::keeps_foreign_data`](super::TestDb::keeps_foreign_data)).

use bson::{doc, Bson, Document};
use futures::TryStreamExt;
use mongodb::Database;
use mongotx::schema::JsonSchema;

/// The schema of the system fields of a stamped document in any managed collection.
const SYSTEM_FIELDS: &str = include_str!("../../../schemas/managed_system_fields.json");

/// What a collection under a default name holds, and how its documents are checked.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Written by a protocol alone: every document against the schema.
    Protocol,
    /// A managed collection with a schema of its own: every document but a plain one against the
    /// system fields, and those that are neither tombstones, fence placeholders nor plain
    /// documents under a fence against the schema.
    Managed,
}

/// The collections mongotx uses under their default names, with their schemas.
const KNOWN: &[(&str, &str, Kind)] = &[
    (
        mongotx::collections::TRANSACTIONS_COLLECTION,
        include_str!("../../../schemas/mongotx_transactions.json"),
        Kind::Protocol,
    ),
    (
        mongotx::collections::META_COLLECTION,
        include_str!("../../../schemas/mongotx_meta.json"),
        Kind::Protocol,
    ),
    (
        mongotx::collections::CONTENTION_COLLECTION,
        include_str!("../../../schemas/mongotx_contention.json"),
        Kind::Protocol,
    ),
    (
        mongotx::collections::TOKENS_COLLECTION,
        include_str!("../../../schemas/obt_tokens.json"),
        Kind::Protocol,
    ),
    (
        mongotx::collections::FENCES_COLLECTION,
        include_str!("../../../schemas/obt_fences.json"),
        Kind::Protocol,
    ),
    (
        mongotx::collections::LIMITERS_COLLECTION,
        include_str!("../../../schemas/ratelimits.json"),
        Kind::Protocol,
    ),
    (
        mongotx::collections::BATCHES_COLLECTION,
        include_str!("../../../schemas/batches.json"),
        Kind::Protocol,
    ),
    (
        "batches_services",
        include_str!("../../../schemas/batch_services.json"),
        Kind::Protocol,
    ),
    (
        mongotx::collections::PROVIDERS_COLLECTION,
        include_str!("../../../schemas/quota_providers.json"),
        Kind::Managed,
    ),
    (
        mongotx::collections::OBTS_COLLECTION,
        include_str!("../../../schemas/obts.json"),
        Kind::Managed,
    ),
];

/// The collections the harness gives a validator when it makes a test database: those mongotx
/// writes without one.
const VALIDATED_BY_THE_HARNESS: [&str; 2] = [
    mongotx::collections::TRANSACTIONS_COLLECTION,
    mongotx::collections::META_COLLECTION,
];

fn parsed(collection: &str, text: &str) -> JsonSchema {
    JsonSchema::parse(collection, text)
        .unwrap_or_else(|e| panic!("the schema of {collection} does not parse: {e}"))
}

/// Creates the records' and the registry's collections of `db` with their schemas as validators.
pub async fn install_validators(db: &Database) {
    for name in VALIDATED_BY_THE_HARNESS {
        let (_, text, _) = KNOWN
            .iter()
            .find(|(known, _, _)| *known == name)
            .expect("a schema for every collection the harness validates");
        let schema = parsed(name, text).to_document();
        db.run_command(doc! { "create": name, "validator": { "$jsonSchema": schema } })
            .await
            .unwrap_or_else(|e| panic!("creating {name} with its schema as validator: {e}"));
    }
}

/// Every stored document of `db` of a known kind that breaks its schema, as one line each
/// (collection, id, what is wrong); a collection that cannot be read is a line too.
pub async fn violations(db: &Database) -> Vec<String> {
    let system = parsed("managed_system_fields", SYSTEM_FIELDS);
    let mut found = Vec::new();
    let names = match db.list_collection_names().await {
        Ok(names) => names,
        Err(e) => return vec![format!("listing the collections: {e}")],
    };
    let mut managed: Vec<String> = match read(db, mongotx::collections::META_COLLECTION, None).await
    {
        Ok(docs) => docs
            .iter()
            .filter_map(|d| d.get_str("collection").ok().map(str::to_string))
            .collect(),
        Err(e) => return vec![e],
    };
    managed.retain(|name| names.contains(name));
    for (name, text, kind) in KNOWN {
        if !names.iter().any(|n| n == name) {
            continue;
        }
        let schema = parsed(name, text);
        let docs = match read(db, name, None).await {
            Ok(docs) => docs,
            Err(e) => {
                found.push(e);
                continue;
            }
        };
        for stored in &docs {
            let broken = match kind {
                Kind::Protocol => schema.validate(stored).err(),
                Kind::Managed if is_plain(stored) => None,
                Kind::Managed => system.validate(stored).err().or_else(|| {
                    // Tombstones, placeholders and plain documents under a fence carry no
                    // user fields of a schema version (or none of their own).
                    if is_tombstone(stored) || is_placeholder(stored) || is_fenced_plain(stored) {
                        None
                    } else {
                        schema.validate(stored).err()
                    }
                }),
            };
            if let Some(violation) = broken {
                found.push(line(name, stored, &violation));
            }
        }
        managed.retain(|m| m != name);
    }
    let projection = doc! {
        "_schema": 1, "_version": 1, "_txn": 1, "_deleted": 1, "_deleting": 1, "_hold": 1,
    };
    for name in &managed {
        let docs = match read(db, name, Some(projection.clone())).await {
            Ok(docs) => docs,
            Err(e) => {
                found.push(e);
                continue;
            }
        };
        for stored in docs.iter().filter(|d| !is_plain(d)) {
            if let Err(violation) = system.validate(stored) {
                found.push(line(name, stored, &violation));
            }
        }
    }
    found
}

async fn read(
    db: &Database,
    name: &str,
    projection: Option<Document>,
) -> Result<Vec<Document>, String> {
    let fail = |e: mongodb::error::Error| format!("{name}: reading the documents: {e}");
    let coll = db.collection::<Document>(name);
    let mut find = coll.find(doc! {});
    if let Some(projection) = projection {
        find = find.projection(projection);
    }
    find.await.map_err(fail)?.try_collect().await.map_err(fail)
}

/// No system field at all (with the system fields' projection: nothing but `_id`).
fn is_plain(stored: &Document) -> bool {
    ![
        "_schema",
        "_version",
        "_txn",
        "_deleted",
        "_deleting",
        "_hold",
    ]
    .iter()
    .any(|f| stored.contains_key(f))
}

/// A plain document a resolver fenced (no schema version: its content is the caller's as it was).
fn is_fenced_plain(stored: &Document) -> bool {
    !stored.contains_key("_schema") && stored.contains_key("_txn")
}

fn is_tombstone(stored: &Document) -> bool {
    stored.contains_key("_deleted")
}

/// The document a fence puts where its participant does not exist (see `repo::hold::tombstone`).
fn is_placeholder(stored: &Document) -> bool {
    stored.get("_version") == Some(&Bson::Int64(0))
        && stored
            .get_document("_hold")
            .is_ok_and(|h| h.get_bool("fence") == Ok(true))
}

fn line(collection: &str, stored: &Document, violation: &mongotx::schema::Violation) -> String {
    let id = stored
        .get("_id")
        .map_or_else(|| "(no _id)".to_string(), Bson::to_string);
    let mut shown = stored.to_string();
    if shown.len() > 600 {
        let mut cut = 600;
        while !shown.is_char_boundary(cut) {
            cut -= 1;
        }
        shown.truncate(cut);
        shown.push_str("...");
    }
    format!("{collection} {id}: {violation}\n    {shown}")
}
