//! Typed repositories: stamped, versioned, soft-deleted documents with optimistic locking.
//!
//! Every write is a single conditional operation on the happy path: the filter names the id, the
//! version the caller read, and requires the document to be live and free. Only when it matches
//! nothing does the repository read the document to say why (not found, deleted, changed, held, or
//! stored in an older shape that must be upgraded first). A held document is waited for, or, once
//! its holder's outcome is decided or its deadline has passed, resolved on the spot from the hold it
//! carries (see `hold`).
//!
//! The type, its public calls, its reads and its errors are here; the lock-wait write path behind
//! update, adjust, replace and delete is in `write_path`, the input checks are in `checks`.

use std::collections::BTreeSet;
use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, Document};
use mongodb::Collection;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::repo::changes::{Adjust, Update};
use crate::repo::collection::CollectionSpec;
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields::{self, SystemFields};
use crate::repo::hold::held::{self, HoldKind};
use crate::repo::hold::resolve::{self, Committed};
use crate::repo::outcome::HoldError;
use crate::repo::schema::{BsonType, Violation};
use crate::repo::store::Store;
use crate::retry::LockWait;
use crate::retry::Retry;
use crate::server::clock;
use crate::server::codes;

/// A document as read: the caller's value plus its id, version and schema version.
#[derive(Debug, Clone, PartialEq)]
pub struct Stamped<T> {
    /// The document's `_id`.
    pub id: Bson,
    /// The version read: pass it to the next write as the expected version. For a plain document
    /// (stored without system fields) it is a fingerprint of its content, a negative number no
    /// stamped document has: a write at it goes through only while the content is unchanged, and
    /// stamps the document (see [`is_plain`](Stamped::is_plain)).
    pub version: i64,
    /// The schema version the document was stored with (before any in-memory upgrade); for a
    /// plain document, the one its collection declares for plain documents.
    pub stored_schema_version: i64,
    /// The caller's value (upgraded to the current schema version).
    pub value: T,
}

impl<T> Deref for Stamped<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> Stamped<T> {
    /// Whether the document was read without system fields (written by something other than
    /// mongotx, or before the collection was adopted): its version is then a fingerprint of its
    /// content, and its first write stamps it.
    pub fn is_plain(&self) -> bool {
        fields::is_plain_version(self.version)
    }

    /// The caller's value, dropping the stamp.
    pub fn into_inner(self) -> T {
        self.value
    }
}

/// A typed collection of stamped documents.
///
/// ```no_run
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct Account { #[serde(rename = "_id")] id: String, balance: i64 }
/// # async fn demo(accounts: mongotx::Repository<Account>) -> Result<(), mongotx::RepoError> {
/// use mongotx::{Adjust, Query, RepoError};
///
/// let alice = accounts.get("alice").await?;
/// match accounts.adjust("alice", alice.version, &Adjust::new().by("balance", -5_i64)).await {
///     Ok(version) => println!("now at version {version}"),
///     Err(RepoError::VersionConflict { actual, .. }) => println!("changed meanwhile: {actual}"),
///     Err(other) => return Err(other),
/// }
/// let _rich = accounts
///     .find(Query::new().filter(bson::doc! { "balance": { "$gt": 100_i64 } }).limit(10))
///     .await?;
/// # Ok(()) }
/// ```
pub struct Repository<T> {
    pub(super) store: Store,
    pub(super) spec: Arc<CollectionSpec>,
    pub(super) coll: Collection<Document>,
    pub(super) id_types: Arc<BTreeSet<BsonType>>,
    _type: PhantomData<fn() -> T>,
}

impl<T> Clone for Repository<T> {
    fn clone(&self) -> Self {
        Repository {
            store: self.store.clone(),
            spec: Arc::clone(&self.spec),
            coll: self.coll.clone(),
            id_types: Arc::clone(&self.id_types),
            _type: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for Repository<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Repository")
            .field("collection", &self.spec.name())
            .field("schema_version", &self.spec.schema_version())
            .finish()
    }
}

/// The change a conditional write applies.
pub(super) enum Change<'a> {
    Update(&'a Update),
    Adjust(&'a Adjust),
    Replace(Document),
    Delete,
}

/// Waiting for holders, paced and bounded by the store's lock-wait policy.
pub(super) struct Waiter {
    pub(super) retry: Retry,
    pub(super) last_holder: Option<ObjectId>,
}

impl Waiter {
    pub(super) fn new(policy: LockWait) -> Waiter {
        Waiter {
            retry: Retry::until_deadline(policy),
            last_holder: None,
        }
    }
}

impl<T> Repository<T>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    pub(crate) fn new(store: Store, spec: Arc<CollectionSpec>, coll: Collection<Document>) -> Self {
        let id_types = spec.schema().allowed_types("_id").unwrap_or_default();
        Repository {
            store,
            spec,
            coll,
            id_types: Arc::new(id_types),
            _type: PhantomData,
        }
    }

    /// The collection name.
    pub fn name(&self) -> &str {
        self.spec.name()
    }

    /// The collection definition.
    pub fn spec(&self) -> &CollectionSpec {
        &self.spec
    }

    /// The collection definition, shared.
    pub(crate) fn spec_arc(&self) -> &Arc<CollectionSpec> {
        &self.spec
    }

    /// The store this repository belongs to.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The raw driver collection (system fields included), for tools and the transaction layer.
    pub fn raw_collection(&self) -> &Collection<Document> {
        &self.coll
    }

    /// Inserts a new document and returns its id (generated when the value has none and the
    /// schema allows an ObjectId). Its version is 1, or one above the collection's version floor
    /// once tombstones were purged, so that no version ever repeats for an id.
    ///
    /// An id that a pending transactional insert is creating is waited for like a held document:
    /// if that transaction commits the id is taken (`DuplicateId`), if not this insert goes ahead.
    pub async fn insert(&self, value: &T) -> Result<Bson, RepoError> {
        let (id, mut doc) = self.prepare_insert(value)?;
        let shown = show_id(&id);
        let version = self.first_version(&shown).await?;
        self.stamp(&mut doc, version);
        self.validate(&shown, &doc)?;

        let mut waiter = Waiter::new(self.store.inner.lock_wait);
        loop {
            let error = match self.coll.insert_one(&doc).await {
                Ok(_) => {
                    tracing::debug!(collection = self.name(), id = %shown, version, "inserted");
                    return Ok(id);
                }
                Err(e) => e,
            };
            if codes::error_code(&error) != Some(codes::DUPLICATE_KEY) {
                return Err(self.write_error(&shown, "insert", error));
            }
            if let Some(index) = other_index(&error) {
                return Err(self.duplicate_key(&shown, index));
            }
            let taken = || RepoError::DuplicateId {
                collection: self.name().to_string(),
                id: shown.clone(),
            };
            let Some(stored) = self.read_raw(&id, &shown).await? else {
                continue; // the document that held the id went away: try again
            };
            let sys = self.system_fields(&shown, &stored)?;
            let Some(holder) = sys.active_txn else {
                return Err(taken());
            };
            let hold = held::read_hold(&stored).map_err(|reason| self.malformed(&shown, reason))?;
            if hold.op != HoldKind::Insert {
                return Err(taken());
            }
            self.wait_for(&id, &shown, holder, &mut waiter).await?;
        }
    }

    /// The version a new document starts at.
    pub(crate) async fn first_version(&self, shown: &str) -> Result<i64, RepoError> {
        self.store
            .first_version(self.name())
            .await
            .map_err(|e| self.db_error(shown, "read the version floor", e))
    }

    /// The id and user fields of a value about to be inserted, checked but not yet stamped.
    pub(crate) fn prepare_insert(&self, value: &T) -> Result<(Bson, Document), RepoError> {
        let mut doc = self.encode(value, "(new)")?;
        let id = match doc.get("_id") {
            Some(id) => id.clone(),
            None if self.id_types.contains(&BsonType::ObjectId) => {
                let id = Bson::ObjectId(ObjectId::new());
                doc.insert("_id", id.clone());
                id
            }
            None => {
                return Err(self.invalid(
                    "(new)",
                    Violation {
                        field: "_id".into(),
                        reason: "required field is missing".into(),
                    },
                ))
            }
        };
        self.check_id(&id)?;
        Ok((id, doc))
    }

    /// Reads a document by id: its committed value, or `NotFound` / `Deleted`.
    pub async fn get(&self, id: impl Into<Bson>) -> Result<Stamped<T>, RepoError> {
        let id = id.into();
        self.check_id(&id)?;
        let shown = show_id(&id);
        let not_found = || RepoError::NotFound {
            collection: self.name().to_string(),
            id: shown.clone(),
        };
        let stored = self.read_raw(&id, &shown).await?.ok_or_else(not_found)?;
        match self.committed(&shown, stored).await? {
            Committed::Live(doc) => self.decode(&id, &shown, doc),
            Committed::Deleted(version) => Err(RepoError::Deleted {
                collection: self.name().to_string(),
                id: shown,
                version,
            }),
            Committed::Absent => Err(not_found()),
        }
    }

    /// Sets and unsets fields of the document at `expected_version`; returns the new version.
    pub async fn update(
        &self,
        id: impl Into<Bson>,
        expected_version: i64,
        update: &Update,
    ) -> Result<i64, RepoError> {
        let id = id.into();
        self.check_write(&id, expected_version)?;
        self.check_update(&show_id(&id), update)?;
        self.write(id, expected_version, Change::Update(update))
            .await
    }

    /// Increments numeric fields of the document at `expected_version`; returns the new version.
    pub async fn adjust(
        &self,
        id: impl Into<Bson>,
        expected_version: i64,
        adjust: &Adjust,
    ) -> Result<i64, RepoError> {
        let id = id.into();
        self.check_write(&id, expected_version)?;
        self.check_adjust(&show_id(&id), adjust)?;
        self.write(id, expected_version, Change::Adjust(adjust))
            .await
    }

    /// Replaces the whole value of the document at `expected_version`; returns the new version.
    pub async fn replace(
        &self,
        id: impl Into<Bson>,
        expected_version: i64,
        value: &T,
    ) -> Result<i64, RepoError> {
        let id = id.into();
        self.check_write(&id, expected_version)?;
        let shown = show_id(&id);
        let mut doc = self.encode(value, &shown)?;
        match doc.get("_id") {
            None => {
                doc.insert("_id", id.clone());
            }
            Some(own) if crate::repo::ids::same(own, &id) => {}
            Some(own) => {
                return Err(self.invalid(
                    &shown,
                    Violation {
                        field: "_id".into(),
                        reason: format!(
                            "the value's _id {} differs from the id written",
                            show_id(own)
                        ),
                    },
                ))
            }
        }
        let mut check = doc.clone();
        // A plain document's replacement starts at the collection's first version (at least 1).
        let next = if fields::is_plain_version(expected_version) {
            fields::FIRST_VERSION
        } else {
            expected_version + 1
        };
        self.stamp(&mut check, next);
        self.validate(&shown, &check)?;
        self.write(id, expected_version, Change::Replace(doc)).await
    }

    /// Deletes the document at `expected_version`, leaving a tombstone; returns its version.
    pub async fn delete(
        &self,
        id: impl Into<Bson>,
        expected_version: i64,
    ) -> Result<i64, RepoError> {
        let id = id.into();
        self.check_write(&id, expected_version)?;
        self.write(id, expected_version, Change::Delete).await
    }

    /// Removes tombstones deleted more than `older_than` ago (server time); returns how many were
    /// removed. The collection's version floor is raised over them first, and the call waits for
    /// the raise to stand for the store's floor grace before deleting, so that re-inserted ids
    /// never repeat a version.
    pub async fn purge_tombstones(&self, older_than: Duration) -> Result<u64, RepoError> {
        let now = self.store.now().await.map_err(|source| RepoError::Clock {
            collection: self.name().to_string(),
            source,
        })?;
        self.store
            .purge_tombstones(self.name(), clock::minus(now, older_than))
            .await
    }

    // ----- reading -----

    /// The stored document under `id`, exactly as stored.
    pub(crate) async fn read_raw(
        &self,
        id: &Bson,
        shown: &str,
    ) -> Result<Option<Document>, RepoError> {
        self.coll
            .find_one(doc! { "_id": id.clone() })
            .await
            .map_err(|e| self.db_error(shown, "find by id", e))
    }

    /// Gets the hold of `holder` on `id` out of the way if its outcome is decided or its deadline
    /// has passed: `true` when the document is free to write again, `false` when the holder is
    /// alive and the writer should wait.
    pub(crate) async fn settle_hold(
        &self,
        id: &Bson,
        shown: &str,
        holder: ObjectId,
    ) -> Result<bool, RepoError> {
        resolve::settle(&self.store, self.name(), id, holder)
            .await
            .map(|settled| settled == resolve::Settled::Freed)
            .map_err(|source| self.hold_error(shown, holder, source))
    }

    /// The committed value of a stored document.
    pub(crate) async fn committed(
        &self,
        shown: &str,
        stored: Document,
    ) -> Result<Committed, RepoError> {
        let holder = stored.get_object_id(fields::ACTIVE_TXN).ok();
        resolve::committed(&self.store, self.name(), stored)
            .await
            .map_err(|source| match holder {
                Some(holder) => self.hold_error(shown, holder, source),
                None => self.malformed(shown, source.to_string()),
            })
    }

    /// Turns a committed document (system fields included, no hold) into the caller's value.
    pub(super) fn decode(
        &self,
        id: &Bson,
        shown: &str,
        doc: Document,
    ) -> Result<Stamped<T>, RepoError> {
        let sys = self.system_fields(shown, &doc)?;
        if sys.schema_version > self.spec.schema_version() {
            return Err(self.too_new(shown, sys.schema_version));
        }
        let user = self.upgrade(shown, doc, sys.schema_version)?;
        let value = bson::from_document::<T>(user).map_err(|source| RepoError::Decode {
            collection: self.name().to_string(),
            id: shown.to_string(),
            source,
        })?;
        Ok(Stamped {
            id: id.clone(),
            version: sys.version,
            stored_schema_version: sys.schema_version,
            value,
        })
    }

    /// Strips system fields and upgrades the caller's fields to the current schema version.
    pub(crate) fn upgrade(
        &self,
        shown: &str,
        mut doc: Document,
        from: i64,
    ) -> Result<Document, RepoError> {
        fields::strip(&mut doc);
        if from == self.spec.schema_version() {
            return Ok(doc);
        }
        let id = doc.get("_id").cloned();
        let upgraded = self
            .spec
            .upgrade_document(doc, from)
            .map_err(|(at, reason)| RepoError::Upgrade {
                collection: self.name().to_string(),
                id: shown.to_string(),
                from: at,
                reason,
            })?;
        if upgraded.get("_id").cloned() != id {
            return Err(RepoError::Upgrade {
                collection: self.name().to_string(),
                id: shown.to_string(),
                from,
                reason: "an upgrade step changed or removed `_id`".into(),
            });
        }
        Ok(upgraded)
    }

    // ----- error helpers -----

    pub(crate) fn system_fields(
        &self,
        shown: &str,
        doc: &Document,
    ) -> Result<SystemFields, RepoError> {
        let mut sys = SystemFields::read(doc).map_err(|reason| RepoError::Malformed {
            collection: self.name().to_string(),
            id: shown.to_string(),
            reason,
        })?;
        if sys.plain {
            sys.schema_version = self.spec.plain_schema_version();
        }
        Ok(sys)
    }

    pub(crate) fn invalid(&self, shown: &str, violation: Violation) -> RepoError {
        RepoError::Invalid {
            collection: self.name().to_string(),
            id: shown.to_string(),
            field: violation.field,
            reason: violation.reason,
        }
    }

    pub(super) fn empty(&self, shown: &str) -> RepoError {
        RepoError::EmptyChange {
            collection: self.name().to_string(),
            id: shown.to_string(),
        }
    }

    pub(crate) fn malformed(&self, shown: &str, reason: String) -> RepoError {
        RepoError::Malformed {
            collection: self.name().to_string(),
            id: shown.to_string(),
            reason,
        }
    }

    pub(crate) fn duplicate_key(&self, shown: &str, index: String) -> RepoError {
        if index == "_id_" {
            return RepoError::DuplicateId {
                collection: self.name().to_string(),
                id: shown.to_string(),
            };
        }
        RepoError::DuplicateKey {
            collection: self.name().to_string(),
            id: shown.to_string(),
            index,
        }
    }

    pub(super) fn hold_error(&self, shown: &str, holder: ObjectId, source: HoldError) -> RepoError {
        RepoError::Hold {
            collection: self.name().to_string(),
            id: shown.to_string(),
            holder,
            source,
        }
    }

    pub(crate) fn too_new(&self, shown: &str, found: i64) -> RepoError {
        RepoError::SchemaTooNew {
            collection: self.name().to_string(),
            id: shown.to_string(),
            found,
            supported: self.spec.schema_version(),
        }
    }

    pub(crate) fn db_error(
        &self,
        shown: &str,
        operation: &'static str,
        source: mongodb::error::Error,
    ) -> RepoError {
        RepoError::database(self.name(), shown, operation, source)
    }

    pub(crate) fn write_error(
        &self,
        shown: &str,
        operation: &'static str,
        source: mongodb::error::Error,
    ) -> RepoError {
        RepoError::written(self.name(), shown, operation, source)
    }
}

impl Change<'_> {
    pub(super) fn verb(&self) -> &'static str {
        match self {
            Change::Update(_) => "update",
            Change::Adjust(_) => "adjust",
            Change::Replace(_) => "replace",
            Change::Delete => "delete",
        }
    }
}

/// The index a duplicate-key error names, when it is not the `_id` index.
pub(super) fn other_index(error: &mongodb::error::Error) -> Option<String> {
    codes::duplicate_key_index(error).filter(|index| index != "_id_")
}
