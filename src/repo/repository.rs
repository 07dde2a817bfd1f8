//! Typed repositories: stamped, versioned, soft-deleted documents with optimistic locking.
//!
//! Every write is a single conditional operation on the happy path: the filter names the id, the
//! version the caller read, and requires the document to be live and free. Only when it matches
//! nothing does the repository read the document to say why (not found, deleted, changed, held, or
//! stored in an older shape that must be upgraded first). A held document is waited for, or, once
//! its holder's outcome is decided or its deadline has passed, resolved on the spot from the hold it
//! carries (see `hold`).

use std::collections::BTreeSet;
use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId, Bson, Document};
use futures::TryStreamExt;
use mongodb::Collection;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::repo::changes::{self, Adjust, Update};
use crate::repo::collection::CollectionSpec;
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields::{self, SystemFields};
use crate::repo::hold::{HoldError, HoldKind, TxnStatus};
use crate::repo::query;
use crate::repo::resolve::{self, Committed, Settled};
use crate::repo::schema::{BsonType, Violation};
use crate::repo::store::Store;
use crate::server::{clock, probe};

/// The version a document has right after insert into a collection that was never purged.
pub const FIRST_VERSION: i64 = 1;

/// A document as read: the caller's value plus its id, version and schema version.
#[derive(Debug, Clone, PartialEq)]
pub struct Stamped<T> {
    /// The document's `_id`.
    pub id: Bson,
    /// The version read: pass it to the next write as the expected version.
    pub version: i64,
    /// The schema version the document was stored with (before any in-memory upgrade).
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
    /// The caller's value, dropping the stamp.
    pub fn into_inner(self) -> T {
        self.value
    }
}

/// A query over live documents, evaluated on committed values: filter, sort and limit.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Query {
    filter: Document,
    sort: Option<Document>,
    limit: Option<i64>,
}

impl Query {
    /// Matches every live document.
    pub fn new() -> Query {
        Query::default()
    }

    /// Restricts to documents matching a MongoDB filter.
    pub fn filter(mut self, filter: Document) -> Query {
        self.filter = filter;
        self
    }

    /// Sorts the results (MongoDB sort document, e.g. `doc! { "name": 1 }`).
    pub fn sort(mut self, sort: Document) -> Query {
        self.sort = Some(sort);
        self
    }

    /// Returns at most `limit` documents (0 means no limit, as in the driver). A negative limit
    /// is refused by [`Repository::find`] (`InvalidQuery`): the driver reads it as "one batch of
    /// that size", which a query on committed values has no use for.
    pub fn limit(mut self, limit: i64) -> Query {
        self.limit = (limit != 0).then_some(limit);
        self
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
    store: Store,
    spec: Arc<CollectionSpec>,
    coll: Collection<Document>,
    id_types: Arc<BTreeSet<BsonType>>,
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
enum Change<'a> {
    Update(&'a Update),
    Adjust(&'a Adjust),
    Replace(Document),
    Delete,
}

/// What a failed conditional write should do next, after looking at the document.
enum Next {
    Retry,
    Wait(ObjectId),
    Fail(RepoError),
    Upgrade(Document, i64),
}

/// Waiting for holders, bounded by the store's lock-wait policy.
struct Waiter {
    started: Instant,
    pauses: u32,
    last_holder: Option<ObjectId>,
}

impl Waiter {
    fn new() -> Waiter {
        Waiter {
            started: Instant::now(),
            pauses: 0,
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

        let mut waiter = Waiter::new();
        loop {
            let error = match self.coll.insert_one(&doc).await {
                Ok(_) => {
                    tracing::debug!(collection = self.name(), id = %shown, version, "inserted");
                    return Ok(id);
                }
                Err(e) => e,
            };
            if probe::error_code(&error) != Some(probe::DUPLICATE_KEY) {
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
            let hold =
                fields::read_hold(&stored).map_err(|reason| self.malformed(&shown, reason))?;
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

    /// Finds live documents matching the query, with filter, sort and limit evaluated on
    /// committed values (tombstones and uncommitted changes are never seen).
    ///
    /// Never waits for a transaction and never fails because a document is held: a held
    /// document reads as its committed value. The cost does not depend on what is held
    /// elsewhere: one command when nothing the filter can match is held; otherwise at most four
    /// plus one per collection that the holders' staging transactions touch (see `repo::query`
    /// and `HoldResolver::statuses`), and one more under a limit when over a thousand held
    /// documents can match. (Long results add the cursor's `getMore`s, as any query's do.)
    pub async fn find(&self, query: Query) -> Result<Vec<Stamped<T>>, RepoError> {
        if let Some(reason) = query::problem(&query.filter, query.sort.as_ref(), query.limit) {
            return Err(RepoError::InvalidQuery {
                collection: self.name().to_string(),
                reason,
            });
        }
        let (filter, sort, limit) = (&query.filter, query.sort.as_ref(), query.limit);
        // Under a limit the whole first pass fits one reply (held candidates are a few bytes).
        let batch = limit.and_then(|l| u32::try_from(l.saturating_add(query::HOLDER_BATCH)).ok());
        let rows = self
            .aggregate(query::holders_pass(filter, sort, limit), batch)
            .await?;
        let mut holders: Vec<ObjectId> = rows.iter().filter_map(query::unknown_holder).collect();
        if holders.is_empty() {
            // The pass left room for held candidates beyond the limit; there were none.
            let limit = limit.map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(0));
            return rows
                .into_iter()
                .take(limit)
                .map(|row| self.decode_row(row))
                .collect();
        }
        // Under a limit the held candidates come first; a pass they filled may have left some.
        if limit.is_some_and(|l| holders.len() as i64 >= l.saturating_add(query::HOLDER_BATCH)) {
            let all = self
                .aggregate(query::holders_of(filter), Some(u32::MAX >> 1))
                .await?;
            holders.extend(all.iter().filter_map(|row| row.get_object_id("_id").ok()));
        }
        holders.sort();
        holders.dedup();
        let mut committed: Vec<ObjectId> = Vec::new();
        if let Some(first) = holders.first().copied() {
            let statuses = self
                .store
                .inner
                .resolver
                .statuses(&self.store, &holders)
                .await
                .map_err(|source| self.hold_error("*", first, source))?;
            committed.extend(
                statuses
                    .into_iter()
                    .filter(|(_, status)| *status == TxnStatus::Committed)
                    .map(|(txn, _)| txn),
            );
        }
        let batch = limit.and_then(|l| u32::try_from(l).ok());
        self.aggregate(query::values_pass(filter, sort, limit, &committed), batch)
            .await?
            .into_iter()
            .map(|row| self.decode_row(row))
            .collect()
    }

    async fn aggregate(
        &self,
        stages: Vec<Document>,
        batch: Option<u32>,
    ) -> Result<Vec<Document>, RepoError> {
        let mut action = self.coll.aggregate(stages);
        if let Some(batch) = batch {
            action = action.batch_size(batch);
        }
        // A filter the server cannot read is refused before it is sent (`query::problem`); what
        // the server still refuses is reported as its error, whole, as the source.
        action
            .await
            .map_err(|e| self.db_error("*", "find", e))?
            .try_collect()
            .await
            .map_err(|e| self.db_error("*", "find", e))
    }

    fn decode_row(&self, mut row: Document) -> Result<Stamped<T>, RepoError> {
        row.remove(query::KNOWN_TAG);
        let id = row.get("_id").cloned().unwrap_or(Bson::Null);
        let shown = show_id(&id);
        self.decode(&id, &shown, row)
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
        self.stamp(&mut check, expected_version + 1);
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

    // ----- the conditional write loop -----

    async fn write(&self, id: Bson, expected: i64, change: Change<'_>) -> Result<i64, RepoError> {
        let shown = show_id(&id);
        let new_version = expected + 1;
        let current = self.spec.schema_version();
        let filter = self.happy_filter(&id, expected, &change);
        let mut waiter = Waiter::new();
        loop {
            let written = match &change {
                Change::Delete => {
                    self.store
                        .write_tombstone(&self.coll, filter.clone(), &id, current, new_version)
                        .await
                }
                Change::Replace(value) => {
                    let mut replacement = value.clone();
                    self.stamp(&mut replacement, new_version);
                    self.coll
                        .replace_one(filter.clone(), replacement)
                        .await
                        .map(|r| r.matched_count)
                }
                Change::Update(_) | Change::Adjust(_) => self
                    .coll
                    .update_one(filter.clone(), self.happy_update(new_version, &change))
                    .await
                    .map(|r| r.matched_count),
            };
            match written {
                Ok(1) => {
                    tracing::debug!(collection = self.name(), id = %shown, version = new_version, "{}", change.verb());
                    return Ok(new_version);
                }
                Ok(_) => {}
                Err(e) if probe::error_code(&e) == Some(probe::DUPLICATE_KEY) => {
                    let index = other_index(&e).unwrap_or_else(|| "_id_".to_string());
                    return Err(self.duplicate_key(&shown, index));
                }
                Err(e) => return Err(self.write_error(&shown, change.verb(), e)),
            }

            match self
                .diagnose(&id, &shown, expected, current, &change)
                .await?
            {
                Next::Fail(error) => return Err(error),
                Next::Upgrade(stored, stored_schema) => {
                    if self
                        .write_upgraded(&id, &shown, expected, stored, stored_schema, &change)
                        .await?
                    {
                        return Ok(new_version);
                    }
                }
                Next::Retry => {}
                Next::Wait(holder) => self.wait_for(&id, &shown, holder, &mut waiter).await?,
            }
            if waiter.started.elapsed() >= self.store.inner.lock_wait.max_wait {
                return Err(self.locked(&shown, &waiter));
            }
        }
    }

    /// Deals with document `id` held by `holder`: resolves it if its outcome is decided or its
    /// deadline passed, else pauses; fails with `Locked` once the lock-wait budget is spent.
    async fn wait_for(
        &self,
        id: &Bson,
        shown: &str,
        holder: ObjectId,
        waiter: &mut Waiter,
    ) -> Result<(), RepoError> {
        let lock_wait = self.store.inner.lock_wait;
        let settled = resolve::settle(&self.store, self.name(), id, holder)
            .await
            .map_err(|source| self.hold_error(shown, holder, source))?;
        // A resolved holder is retried at once, unless the same one is still there.
        let again = waiter.last_holder == Some(holder);
        waiter.last_holder = Some(holder);
        if settled == Settled::Freed && !again {
            return Ok(());
        }
        if waiter.started.elapsed() >= lock_wait.max_wait {
            return Err(self.locked(shown, waiter));
        }
        tokio::time::sleep(lock_wait.backoff(waiter.pauses)).await;
        waiter.pauses += 1;
        Ok(())
    }

    fn locked(&self, shown: &str, waiter: &Waiter) -> RepoError {
        RepoError::Locked {
            collection: self.name().to_string(),
            id: shown.to_string(),
            holder: waiter.last_holder,
            waited: waiter.started.elapsed(),
        }
    }

    /// The filter of the single write attempted first.
    fn happy_filter(&self, id: &Bson, expected: i64, change: &Change<'_>) -> Document {
        let current = self.spec.schema_version();
        let mut filter = doc! {
            "_id": id.clone(),
            fields::VERSION: expected,
            fields::ACTIVE_TXN: null,
            fields::DELETED: null,
        };
        match change {
            // Field-level changes are only safe on documents already in the current shape.
            Change::Update(_) => {
                filter.insert(fields::SCHEMA_VERSION, current);
            }
            Change::Adjust(adjust) => {
                filter.insert(fields::SCHEMA_VERSION, current);
                filter.insert("$and", adjust.applicable());
            }
            // A whole new value (or a tombstone) may replace any older shape.
            Change::Replace(_) | Change::Delete => {
                filter.insert(fields::SCHEMA_VERSION, doc! { "$lte": current });
            }
        }
        filter
    }

    /// The update document of a field-level change.
    fn happy_update(&self, new_version: i64, change: &Change<'_>) -> Document {
        match change {
            Change::Update(update) => {
                let mut set = doc! {};
                for (path, value) in update.sets() {
                    set.insert(path.clone(), value.clone());
                }
                set.insert(fields::VERSION, new_version);
                let mut op = doc! { "$set": set };
                if !update.unsets().is_empty() {
                    let unset: Document = update
                        .unsets()
                        .iter()
                        .map(|p| (p.clone(), Bson::String(String::new())))
                        .collect();
                    op.insert("$unset", unset);
                }
                op
            }
            Change::Adjust(adjust) => {
                let inc: Document = adjust
                    .increments()
                    .iter()
                    .map(|(p, v)| (p.clone(), v.clone()))
                    .collect();
                doc! { "$inc": inc, "$set": { fields::VERSION: new_version } }
            }
            Change::Replace(_) | Change::Delete => doc! {},
        }
    }

    /// Reads the document after a write matched nothing and decides what to do.
    async fn diagnose(
        &self,
        id: &Bson,
        shown: &str,
        expected: i64,
        current: i64,
        change: &Change<'_>,
    ) -> Result<Next, RepoError> {
        let Some(stored) = self.read_raw(id, shown).await? else {
            return Ok(Next::Fail(RepoError::NotFound {
                collection: self.name().to_string(),
                id: shown.to_string(),
            }));
        };
        let sys = self.system_fields(shown, &stored)?;
        if sys.is_deleted() {
            return Ok(Next::Fail(RepoError::Deleted {
                collection: self.name().to_string(),
                id: shown.to_string(),
                version: sys.version,
            }));
        }
        if let Some(holder) = sys.active_txn {
            return Ok(Next::Wait(holder));
        }
        if sys.schema_version > current {
            return Ok(Next::Fail(self.too_new(shown, sys.schema_version)));
        }
        if sys.version != expected {
            return Ok(Next::Fail(RepoError::VersionConflict {
                collection: self.name().to_string(),
                id: shown.to_string(),
                expected,
                actual: sys.version,
            }));
        }
        if sys.schema_version < current && matches!(change, Change::Update(_) | Change::Adjust(_)) {
            return Ok(Next::Upgrade(stored, sys.schema_version));
        }
        if let Change::Adjust(adjust) = change {
            if let Some(error) = self.increment_refused(shown, adjust, &stored) {
                return Ok(Next::Fail(error));
            }
        }
        // The document matches now: a holder came and went between the write and the read.
        Ok(Next::Retry)
    }

    /// Applies a field-level change to an older-shape document by upgrading it in memory and
    /// replacing it whole, still conditional on the version and stored shape read.
    async fn write_upgraded(
        &self,
        id: &Bson,
        shown: &str,
        expected: i64,
        stored: Document,
        stored_schema: i64,
        change: &Change<'_>,
    ) -> Result<bool, RepoError> {
        let mut doc = self.upgrade(shown, stored, stored_schema)?;
        let applied = match change {
            Change::Update(update) => update.apply_to(&mut doc),
            Change::Adjust(adjust) => adjust.apply_to(&mut doc),
            Change::Replace(_) | Change::Delete => Ok(()),
        };
        applied.map_err(|violation| self.invalid(shown, violation))?;
        self.stamp(&mut doc, expected + 1);
        self.validate(shown, &doc)?;
        let filter = doc! {
            "_id": id.clone(),
            fields::VERSION: expected,
            fields::SCHEMA_VERSION: stored_schema,
            fields::ACTIVE_TXN: null,
            fields::DELETED: null,
        };
        let result = match self.coll.replace_one(filter, doc).await {
            Ok(result) => result,
            Err(e) if probe::error_code(&e) == Some(probe::DUPLICATE_KEY) => {
                let index = other_index(&e).unwrap_or_else(|| "_id_".to_string());
                return Err(self.duplicate_key(shown, index));
            }
            Err(e) => return Err(self.write_error(shown, change.verb(), e)),
        };
        if result.matched_count == 1 {
            tracing::info!(collection = self.name(), id = %shown, from = stored_schema, to = self.spec.schema_version(), "upgraded document on write");
        }
        Ok(result.matched_count == 1)
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
    fn decode(&self, id: &Bson, shown: &str, doc: Document) -> Result<Stamped<T>, RepoError> {
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

    // ----- input checks (all run before anything touches the database) -----

    pub(crate) fn check_write(&self, id: &Bson, expected: i64) -> Result<(), RepoError> {
        self.check_id(id)?;
        // i64::MAX has no next version to write.
        if !(FIRST_VERSION..i64::MAX).contains(&expected) {
            return Err(RepoError::InvalidVersion {
                collection: self.name().to_string(),
                id: show_id(id),
                version: expected,
            });
        }
        Ok(())
    }

    pub(crate) fn check_id(&self, id: &Bson) -> Result<(), RepoError> {
        let found = BsonType::of(id);
        if self.id_types.contains(&found) {
            return Ok(());
        }
        Err(RepoError::InvalidId {
            collection: self.name().to_string(),
            id: show_id(id),
            found: found.alias().to_string(),
            expected: self
                .id_types
                .iter()
                .map(|t| t.alias())
                .collect::<Vec<_>>()
                .join(" or "),
        })
    }

    fn check_paths<'a>(
        &self,
        shown: &str,
        paths: impl Iterator<Item = &'a str>,
    ) -> Result<(), RepoError> {
        let paths: Vec<&str> = paths.collect();
        for path in &paths {
            if fields::is_system_path(path) {
                return Err(RepoError::SystemField {
                    collection: self.name().to_string(),
                    id: shown.to_string(),
                    field: path.to_string(),
                });
            }
            let problem = if *path == "_id" || path.starts_with("_id.") {
                Some("`_id` cannot be changed")
            } else {
                changes::path_problem(path)
            };
            if let Some(reason) = problem {
                return Err(self.invalid(
                    shown,
                    Violation {
                        field: path.to_string(),
                        reason: reason.to_string(),
                    },
                ));
            }
        }
        if let Some((a, b)) = changes::overlapping(&paths) {
            return Err(self.invalid(
                shown,
                Violation {
                    field: b.to_string(),
                    reason: format!("conflicts with `{a}` in the same change"),
                },
            ));
        }
        Ok(())
    }

    pub(crate) fn check_update(&self, shown: &str, update: &Update) -> Result<(), RepoError> {
        if update.is_empty() {
            return Err(self.empty(shown));
        }
        self.check_paths(shown, update.paths())?;
        let schema = self.spec.schema();
        for (path, value) in update.sets() {
            if let Some((field, reason)) = fields::bad_name(value, path.split('.').count()) {
                return Err(self.invalid(
                    shown,
                    Violation {
                        field: format!("{path}.{field}"),
                        reason: reason.to_string(),
                    },
                ));
            }
            schema
                .validate_set(path, value)
                .map_err(|v| self.invalid(shown, v))?;
        }
        for path in update.unsets() {
            schema
                .validate_unset(path)
                .map_err(|v| self.invalid(shown, v))?;
        }
        Ok(())
    }

    /// `InvalidIncrement` if one of `adjust`'s increments cannot be added to `stored` (a 64-bit
    /// overflow, or a stored value that is not a number).
    pub(crate) fn increment_refused(
        &self,
        shown: &str,
        adjust: &Adjust,
        stored: &Document,
    ) -> Option<RepoError> {
        adjust
            .problem_on(stored)
            .map(|(field, amount, reason)| RepoError::InvalidIncrement {
                collection: self.name().to_string(),
                id: shown.to_string(),
                field: field.to_string(),
                amount: amount.to_string(),
                reason,
            })
    }

    pub(crate) fn check_adjust(&self, shown: &str, adjust: &Adjust) -> Result<(), RepoError> {
        if adjust.is_empty() {
            return Err(self.empty(shown));
        }
        self.check_paths(shown, adjust.increments().iter().map(|(p, _)| p.as_str()))?;
        let schema = self.spec.schema();
        for (path, amount) in adjust.increments() {
            if let Some(reason) = changes::increment_problem(amount) {
                return Err(RepoError::InvalidIncrement {
                    collection: self.name().to_string(),
                    id: shown.to_string(),
                    field: path.clone(),
                    amount: amount.to_string(),
                    reason: reason.to_string(),
                });
            }
            let by = BsonType::of(amount);
            match schema.allowed_types(path) {
                // Undeclared: the schema may still forbid the field outright.
                None => schema
                    .validate_set(path, amount)
                    .map_err(|v| self.invalid(shown, v))?,
                Some(allowed) => {
                    let numeric: Vec<BsonType> =
                        allowed.iter().copied().filter(|t| t.is_numeric()).collect();
                    let reason = if numeric.is_empty() {
                        Some("the field is not numeric".to_string())
                    } else {
                        numeric
                            .iter()
                            .map(|t| (t, promoted(*t, by)))
                            .find(|(_, result)| !allowed.contains(result))
                            .map(|(t, result)| {
                                format!(
                                    "adding a {} to a {} field gives a {}, which the schema does not allow",
                                    by.alias(),
                                    t.alias(),
                                    result.alias()
                                )
                            })
                    };
                    if let Some(reason) = reason {
                        return Err(self.invalid(
                            shown,
                            Violation {
                                field: path.clone(),
                                reason,
                            },
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    pub(crate) fn encode(&self, value: &T, shown: &str) -> Result<Document, RepoError> {
        let doc = bson::to_document(value).map_err(|e| RepoError::Encode {
            collection: self.name().to_string(),
            reason: e.to_string(),
        })?;
        if let Some(field) = doc.keys().find(|k| fields::is_system_path(k)) {
            return Err(RepoError::SystemField {
                collection: self.name().to_string(),
                id: shown.to_string(),
                field: field.to_string(),
            });
        }
        if let Some((field, reason)) = fields::bad_name_in(&doc) {
            return Err(self.invalid(
                shown,
                Violation {
                    field,
                    reason: reason.to_string(),
                },
            ));
        }
        Ok(doc)
    }

    pub(crate) fn validate(&self, shown: &str, doc: &Document) -> Result<(), RepoError> {
        self.spec
            .schema()
            .validate(doc)
            .map_err(|v| self.invalid(shown, v))
    }

    pub(crate) fn stamp(&self, doc: &mut Document, version: i64) {
        doc.insert(fields::SCHEMA_VERSION, self.spec.schema_version());
        doc.insert(fields::VERSION, version);
    }

    // ----- error helpers -----

    pub(crate) fn system_fields(
        &self,
        shown: &str,
        doc: &Document,
    ) -> Result<SystemFields, RepoError> {
        SystemFields::read(doc).map_err(|reason| RepoError::Malformed {
            collection: self.name().to_string(),
            id: shown.to_string(),
            reason,
        })
    }

    pub(crate) fn invalid(&self, shown: &str, violation: Violation) -> RepoError {
        RepoError::Invalid {
            collection: self.name().to_string(),
            id: shown.to_string(),
            field: violation.field,
            reason: violation.reason,
        }
    }

    fn empty(&self, shown: &str) -> RepoError {
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

    fn hold_error(&self, shown: &str, holder: ObjectId, source: HoldError) -> RepoError {
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
        if let Some((field, rule)) = probe::validation_failure(&source) {
            return RepoError::Refused {
                collection: self.name().to_string(),
                id: shown.to_string(),
                field,
                rule,
                source: Box::new(source),
            };
        }
        // The driver refuses a document over MongoDB's 16 MiB before sending it (the server
        // answers BSONObjectTooLarge, 10334, for one that grows past it): the caller's value is
        // too large, which is bad input, not a database failure.
        let too_large = match &*source.kind {
            mongodb::error::ErrorKind::InvalidArgument { message, .. } => {
                message.contains("within") && message.contains("bytes")
            }
            _ => probe::error_code(&source) == Some(10334),
        };
        if too_large {
            return RepoError::Invalid {
                collection: self.name().to_string(),
                id: shown.to_string(),
                field: "(document)".to_string(),
                reason: "larger than the 16 MiB MongoDB stores in one document".to_string(),
            };
        }
        self.db_error(shown, operation, source)
    }
}

impl Change<'_> {
    fn verb(&self) -> &'static str {
        match self {
            Change::Update(_) => "update",
            Change::Adjust(_) => "adjust",
            Change::Replace(_) => "replace",
            Change::Delete => "delete",
        }
    }
}

/// The index a duplicate-key error names, when it is not the `_id` index.
fn other_index(error: &mongodb::error::Error) -> Option<String> {
    probe::duplicate_key_index(error).filter(|index| index != "_id_")
}

/// The BSON type `$inc` produces when adding a `by` to a `field` (ignoring int overflow).
fn promoted(field: BsonType, by: BsonType) -> BsonType {
    use BsonType::{Double, Int, Long};
    match (field, by) {
        (Double, _) | (_, Double) => Double,
        (Long, _) | (_, Long) => Long,
        (Int, Int) => Int,
        (other, _) => other,
    }
}
