//! Opening collections: [`Store::repository`] checks a collection's definition, registers it,
//! creates its system indexes and installs its schema as the server-side validator; the domain
//! modules' own collections get their validator the same way. Either first checks, once per
//! store, that the server has what the protocol needs.

use std::sync::Arc;

use bson::{doc, Bson, Document};
use mongodb::options::IndexOptions;
use mongodb::{Collection, IndexModel};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::repo::collection::{CollectionSpec, SpecError};
use crate::repo::error::RepoError;
use crate::repo::fields;
use crate::repo::format;
use crate::repo::hold::held;
use crate::repo::hold::tombstone;
use crate::repo::meta::{self, META_COLLECTION};
use crate::repo::plain;
use crate::repo::repository::Repository;
use crate::repo::schema::JsonSchema;
use crate::repo::store::{ServerValidation, Store};
use crate::server::{codes, probe, semantics};

/// The body of [`Store::repository`].
pub(crate) async fn repository<T>(
    store: &Store,
    spec: CollectionSpec,
) -> Result<Repository<T>, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    spec.check_upgrades()?;
    let name = spec.name().to_string();
    crate::repo::collection::check_name(store.transactions_collection())?;
    // A repository there could overwrite the records and registrations the protocol runs on.
    if name == store.transactions_collection() || name == META_COLLECTION {
        return Err(SpecError::Name {
            name,
            reason: "mongotx keeps its own records there (transaction records or the collection registry)",
        }
        .into());
    }
    ensure_server_suits(store).await?;
    let db_error = |operation: &'static str| {
        let collection = name.clone();
        move |source| RepoError::database(&collection, "*", operation, source)
    };

    // The collection's options, read once: its validator and its collation.
    let options = collection_options(store, &name)
        .await
        .map_err(db_error("reading the collection's options"))?;
    if installs_validator(store).await {
        let installed = options
            .as_ref()
            .and_then(|o| o.get_document("validator").ok());
        install_validator(store, &spec, installed)
            .await
            .map_err(db_error("installing the validator"))?;
    } else {
        tracing::info!(
            collection = %name,
            "server does not enforce $jsonSchema validators; documents are validated on the client only"
        );
    }

    // Whether the collection compares strings by bytes (no default collation, or the `simple`
    // one; a collection mongotx creates gets none): a plain document's content condition then
    // needs no byte-by-byte check of its strings. A collection's collation is fixed when it is
    // created, so reading it once is enough.
    let collation = options
        .as_ref()
        .and_then(|o| o.get_document("collation").ok());
    store.remember_binary_collation(
        &name,
        collation.is_none_or(|c| c.get_str("locale").ok() == Some("simple")),
    );

    let coll = store.inner.db.collection::<Document>(&name);
    // Sparse indexes: only tombstones and held documents carry these fields; purge, the GC's
    // sweep and queries on committed values look documents up by them (a query finds the held
    // documents whose pre-image may match it by the fields their holds changed).
    let sparse = |field: &str| {
        IndexModel::builder()
            .keys(doc! { field: 1 })
            .options(IndexOptions::builder().sparse(true).build())
            .build()
    };
    coll.create_indexes([
        sparse(fields::DELETED),
        sparse(fields::ACTIVE_TXN),
        sparse(held::CHANGED_PATH),
    ])
    .await
    .map_err(db_error("creating indexes"))?;
    // Registered in the format this store writes, and refused if another release registered it
    // in a newer one: its documents may then carry what this release would misread.
    let writes = store.writes_format().await.map_err(RepoError::from)?;
    let registered = meta::register(&store.meta(), &name, writes)
        .await
        .map_err(db_error("registering the collection"))?;
    if let Some(registered) = &registered {
        format::check(registered, store.reads_format(), META_COLLECTION, &name)
            .map_err(RepoError::from)?;
    }
    tombstone::refresh_markers(store, &name)
        .await
        .map_err(db_error("listing indexes"))?;

    let spec = Arc::new(spec);
    store.remember_spec(&spec);
    Ok(Repository::new(store.clone(), spec, coll))
}

/// Checks once per store that the server has what the protocol needs (see
/// [`StoreBuilder::check_server`](crate::repo::store::StoreBuilder::check_server)).
pub(crate) async fn ensure_server_suits(store: &Store) -> Result<(), RepoError> {
    if !store.inner.check_server {
        return Ok(());
    }
    let checked = store
        .inner
        .server_checked
        .get_or_try_init(|| semantics::essentials(&store.inner.db))
        .await
        .map_err(|unasked| RepoError::database("*", "*", "checking the server", unasked.source))?;
    match checked {
        Ok(()) => Ok(()),
        Err(missing) => Err(RepoError::ServerUnsuitable {
            name: missing.name,
            what: missing.what,
            detail: missing.evidence.clone(),
        }),
    }
}

async fn installs_validator(store: &Store) -> bool {
    match store.inner.validation {
        ServerValidation::Always => true,
        ServerValidation::Never => false,
        ServerValidation::Auto => {
            *store
                .inner
                .validator_support
                .get_or_init(|| probe::validator_support(&store.inner.db))
                .await
        }
    }
}

/// Installs the collection's schema as its server-side validator, for documents of this
/// code's schema version only.
///
/// Tombstones (user fields cleared) and fence placeholders (never had any) are let through,
/// and so is a plain document under a fence (a transaction that rewrites a plain document whole
/// keeps it plain until its apply lands, so a resolver that finds the apply missing fences the
/// document as it is: `_txn` and `_hold` beside content no schema version claims; the abort's
/// undo makes it the same plain document again). So are plain documents (no system field at all): other writers of the collection (a
/// service not yet on mongotx, a shell, a restore) keep inserting and updating them as
/// before, and the validator applies from their first stamp on (see `repo::plain`).
/// So are documents of *other* schema versions: during a rolling upgrade, processes of the
/// old and the new version write at once, each validated on its own client; refusing the
/// other version's documents would refuse valid writes until every process runs the same
/// code. A validator is never replaced by one of an older version (a process of the old
/// version that restarts late leaves the new one in place); if two installs race, the one
/// that lands last wins, and either of them accepts every valid write of both versions.
async fn install_validator(
    store: &Store,
    spec: &CollectionSpec,
    installed: Option<&Document>,
) -> Result<(), mongodb::error::Error> {
    let version = spec.schema_version();
    if let Some(installed) = installed.and_then(validator_version) {
        if installed > version {
            tracing::info!(
                collection = spec.name(),
                installed,
                version,
                "the server's validator is of a newer schema version; left in place"
            );
            return Ok(());
        }
    }
    let mut schema = spec.schema().to_document();
    // Holds are written by the protocol, not by callers: declare them whatever the schema says.
    if let Ok(properties) = schema.get_document_mut("properties") {
        if !properties.contains_key(fields::HOLD) {
            properties.insert(fields::HOLD, doc! { "bsonType": "object" });
        }
    }
    let validator = doc! {
        "$or": [
            { fields::DELETED: { "$exists": true } },
            { held::FENCE: true, fields::VERSION: 0_i64 },
            {
                held::FENCE: true,
                fields::SCHEMA_VERSION: { "$exists": false },
                fields::VERSION: { "$exists": false },
            },
            plain::plain_filter(),
            { fields::SCHEMA_VERSION: { "$type": "long", "$ne": version } },
            { fields::SCHEMA_VERSION: version, "$jsonSchema": schema },
        ]
    };
    if installed != Some(&validator) {
        put_validator(store, spec.name(), validator).await?;
    }
    Ok(())
}

/// The options `collection` was created with (`listCollections`), if it exists.
async fn collection_options(
    store: &Store,
    collection: &str,
) -> Result<Option<Document>, mongodb::error::Error> {
    let listed = store
        .inner
        .db
        .run_command(doc! { "listCollections": 1, "filter": { "name": collection } })
        .await?;
    let options = listed
        .get_document("cursor")
        .ok()
        .and_then(|c| c.get_array("firstBatch").ok())
        .and_then(|batch| {
            batch
                .iter()
                .filter_map(Bson::as_document)
                .find(|entry| entry.get_str("name").ok() == Some(collection))
        })
        .and_then(|entry| entry.get_document("options").ok());
    Ok(options.cloned())
}

/// The validator `collection` has, if it has one.
async fn installed_validator(
    store: &Store,
    collection: &str,
) -> Result<Option<Document>, mongodb::error::Error> {
    let options = collection_options(store, collection).await?;
    Ok(options.and_then(|o| o.get_document("validator").ok().cloned()))
}

/// Installs `schema` (JSON Schema text) as the validator of a collection that only a
/// protocol writes (no system fields, no tombstones), where the store installs validators;
/// returns the collection with the protocol's concerns.
pub(crate) async fn validated_protocol_collection(
    store: &Store,
    name: &str,
    schema: &str,
) -> mongodb::error::Result<Collection<Document>> {
    // Its validator would replace the one on the transaction records or the registry.
    if name == store.transactions_collection() || name == META_COLLECTION {
        return Err(mongodb::error::Error::custom(format!(
            "collection {name} is mongotx's own and cannot hold another protocol's records"
        )));
    }
    ensure_server_suits(store)
        .await
        .map_err(|e| mongodb::error::Error::custom(e.to_string()))?;
    if installs_validator(store).await {
        let parsed = JsonSchema::parse(name, schema)
            .map_err(|e| mongodb::error::Error::custom(e.to_string()))?;
        let validator = doc! { "$jsonSchema": parsed.to_document() };
        if installed_validator(store, name).await?.as_ref() != Some(&validator) {
            put_validator(store, name, validator).await?;
        }
    }
    store.protocol_collection(name).await
}

/// Creates `collection` with `validator`, or replaces the validator of an existing one.
///
/// A service connecting with the `readWrite` role may create collections (with their
/// validator) but not change an existing one's (`collMod` needs `dbAdmin`): then the command
/// is recorded for an administrator to run ([`Store::pending_validators`]), logged once, and
/// the collection opens all the same, its documents checked on the client as everywhere. (Nothing
/// of mongotx trusts the validator to be in force: an administrator may relax it at any time.)
async fn put_validator(
    store: &Store,
    collection: &str,
    validator: Document,
) -> Result<(), mongodb::error::Error> {
    let create = doc! { "create": collection, "validator": validator.clone() };
    let command = match store.inner.db.run_command(create.clone()).await {
        Ok(_) => return Ok(()),
        Err(e) if codes::error_code(&e) == Some(NAMESPACE_EXISTS) => {
            let change = doc! { "collMod": collection, "validator": validator };
            match store.inner.db.run_command(change.clone()).await {
                Ok(_) => return Ok(()),
                Err(e) if codes::error_code(&e) == Some(codes::UNAUTHORIZED) => change,
                Err(e) => return Err(e),
            }
        }
        Err(e) if codes::error_code(&e) == Some(codes::UNAUTHORIZED) => create,
        Err(e) => return Err(e),
    };
    store.validator_not_installed(collection, command);
    Ok(())
}

const NAMESPACE_EXISTS: i32 = 48;

/// The schema version a validator mongotx installed is for (its "other versions" clause).
fn validator_version(validator: &Document) -> Option<i64> {
    validator
        .get_array("$or")
        .ok()?
        .iter()
        .filter_map(Bson::as_document)
        .find_map(|clause| {
            clause
                .get_document(fields::SCHEMA_VERSION)
                .ok()
                .and_then(|condition| condition.get_i64("$ne").ok())
        })
}
