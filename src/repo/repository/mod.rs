//! Typed repositories: stamped, versioned, soft-deleted documents with optimistic locking.
//!
//! Every write is a single conditional operation on the happy path: the filter names the id, the
//! version the caller read, and requires the document to be live and free. Only when it matches
//! nothing does the repository read the document to say why (not found, deleted, changed, held, or
//! stored in an older shape that must be upgraded first). A held document is waited for, or, once
//! its holder's outcome is decided or its deadline has passed, resolved on the spot from the hold it
//! carries (see `hold`).
//!
//! Every method of [`Repository`] is declared in this file, so a call can be followed from here:
//! each delegates to the file that does the work. The type itself and [`Stamped`] are in
//! `handle`; reads of many documents in `find`; the lock-wait write path behind update, adjust,
//! replace and delete in `write_path`; the input checks in `checks`; adoption in `adopt`.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, Document};
use mongodb::Collection;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::metrics::{self, Access};
use crate::repo::adopt::{self, AdoptOptions, AdoptReport};
use crate::repo::changes::{Adjust, Update};
use crate::repo::collection::CollectionSpec;
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields::{self, SystemFields};
use crate::repo::find::{self, Query};
use crate::repo::hold::held::{self, HoldKind};
use crate::repo::hold::resolve::{self, Committed};
use crate::repo::outcome::HoldError;
use crate::repo::schema::{BsonType, Violation};
use crate::repo::store::Store;
use crate::repo::{checks, write_path};
use crate::server::clock;
use crate::server::codes;
use futures::Stream;

mod handle;

pub(super) use handle::{other_index, Change, Waiter};
pub use handle::{Repository, Stamped};

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
        checks::stamp(self, &mut doc, version);
        checks::validate(self, &shown, &doc)?;

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
            write_path::wait_for(self, &id, &shown, holder, &mut waiter).await?;
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
        let mut doc = checks::encode(self, value, "(new)")?;
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
        checks::check_id(self, &id)?;
        Ok((id, doc))
    }

    /// Reads a document by id: its committed value, or `NotFound` / `Deleted`.
    pub async fn get(&self, id: impl Into<Bson>) -> Result<Stamped<T>, RepoError> {
        let id = id.into();
        checks::check_id(self, &id)?;
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
        checks::check_write(self, &id, expected_version)?;
        checks::check_update(self, &show_id(&id), update)?;
        write_path::write(self, id, expected_version, Change::Update(update)).await
    }

    /// Increments numeric fields of the document at `expected_version`; returns the new version.
    pub async fn adjust(
        &self,
        id: impl Into<Bson>,
        expected_version: i64,
        adjust: &Adjust,
    ) -> Result<i64, RepoError> {
        let id = id.into();
        checks::check_write(self, &id, expected_version)?;
        checks::check_adjust(self, &show_id(&id), adjust)?;
        write_path::write(self, id, expected_version, Change::Adjust(adjust)).await
    }

    /// Replaces the whole value of the document at `expected_version`; returns the new version.
    pub async fn replace(
        &self,
        id: impl Into<Bson>,
        expected_version: i64,
        value: &T,
    ) -> Result<i64, RepoError> {
        let id = id.into();
        checks::check_write(self, &id, expected_version)?;
        let shown = show_id(&id);
        let mut doc = checks::encode(self, value, &shown)?;
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
        checks::stamp(self, &mut check, next);
        checks::validate(self, &shown, &check)?;
        write_path::write(self, id, expected_version, Change::Replace(doc)).await
    }

    /// Deletes the document at `expected_version`, leaving a tombstone; returns its version.
    pub async fn delete(
        &self,
        id: impl Into<Bson>,
        expected_version: i64,
    ) -> Result<i64, RepoError> {
        let id = id.into();
        checks::check_write(self, &id, expected_version)?;
        write_path::write(self, id, expected_version, Change::Delete).await
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
        if holder.is_some() {
            metrics::holds_met(self.name(), Access::Read, 1);
        }
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

    /// Finds live documents matching the query, with filter, sort, skip and limit evaluated on
    /// committed values (tombstones and uncommitted changes are never seen).
    ///
    /// Never waits for a transaction and never fails because a document is held: a held
    /// document reads as its committed value. The cost does not depend on what is held
    /// elsewhere: one command when nothing the filter can match is held; otherwise at most four
    /// plus one per collection that the holders' staging transactions touch (see `repo::query`
    /// and `HoldResolver::statuses`), and one more under a limit when over a thousand held
    /// documents can match. (Long results add the cursor's `getMore`s, as any query's do.)
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[derive(serde::Serialize, serde::Deserialize)]
    /// # struct Account { #[serde(rename = "_id")] id: String, balance: i64 }
    /// # async fn demo(accounts: mongotx::Repository<Account>) -> Result<(), mongotx::RepoError> {
    /// use bson::doc;
    /// use mongotx::Query;
    ///
    /// let page = accounts
    ///     .find(Query::new().filter(doc! { "balance": { "$gt": 100_i64 } }).sort(doc! { "_id": 1 }).skip(20).limit(10))
    ///     .await?;
    /// for account in &page {
    ///     println!("{} has {} (version {})", account.id, account.balance, account.version);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn find(&self, query: Query) -> Result<Vec<Stamped<T>>, RepoError> {
        find::find(self, query).await
    }

    /// Like [`find`](Repository::find), as a stream: results arrive as the server's cursor
    /// delivers them, so a large result never sits in memory whole. The holders of matching
    /// documents are read first (one command when there are none, one or two more when there
    /// are), then the committed values stream from one cursor.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[derive(serde::Serialize, serde::Deserialize)]
    /// # struct Account { #[serde(rename = "_id")] id: String, balance: i64 }
    /// # async fn demo(accounts: mongotx::Repository<Account>) -> Result<(), mongotx::RepoError> {
    /// use futures::TryStreamExt;
    /// use mongotx::Query;
    ///
    /// let mut total = 0_i64;
    /// let mut all = accounts.find_stream(Query::new()).await?;
    /// while let Some(account) = all.try_next().await? {
    ///     total += account.balance;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn find_stream(
        &self,
        query: Query,
    ) -> Result<impl Stream<Item = Result<Stamped<T>, RepoError>> + Send + 'static, RepoError>
    where
        T: 'static,
    {
        find::find_stream(self, query).await
    }

    /// How many live documents match the query's filter, on committed values (after its skip
    /// and limit, if it has them, as the driver's `count_documents` does).
    pub async fn count(&self, query: Query) -> Result<u64, RepoError> {
        find::count(self, query).await
    }

    /// Stamps every plain document of the collection (one written without system fields: before
    /// the collection was adopted, or by another writer since), in batches, while other writers
    /// keep working; returns what it did. Each document is checked against the schema as it will
    /// read (upgraded from [`CollectionSpec::plain_documents`](crate::CollectionSpec::plain_documents)'s
    /// version) and stamped only while its content is the one checked; refused documents stay
    /// plain and are reported. Nothing but `_schema` and `_version` is added to any document.
    ///
    /// Idempotent and resumable: a run stopped anywhere (the process killed, the future
    /// dropped) leaves every document stamped or plain, and the next run stamps the plain ones.
    /// Documents read before the adoption are not needed: every document reads the same way
    /// stamped or plain (a plain one's first write stamps it, see [`Stamped::is_plain`](crate::Stamped::is_plain)).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(accounts: mongotx::Repository<bson::Document>) -> Result<(), mongotx::RepoError> {
    /// use mongotx::adopt::AdoptOptions;
    ///
    /// let planned = accounts.adopt(AdoptOptions::new().dry_run(true)).await?;
    /// println!("{} to stamp, {} refused", planned.stamped, planned.refused);
    /// let done = accounts.adopt(AdoptOptions::new()).await?;
    /// for refusal in &done.refusals {
    ///     println!("left plain: {} ({}: {})", refusal.id, refusal.field, refusal.rule);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn adopt(&self, options: AdoptOptions) -> Result<AdoptReport, RepoError> {
        adopt::adopt(self, options).await
    }
}
