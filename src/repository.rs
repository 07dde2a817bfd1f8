//! Typed repositories: stamped, versioned, soft-deleted documents with optimistic locking.
//!
//! Every write is a single conditional operation on the happy path: the filter names the id, the
//! version the caller read, and requires the document to be live and free. Only when it matches
//! nothing does the repository read the document to say why (not found, deleted, changed, held, or
//! stored in an older shape that must be upgraded first).

use std::collections::BTreeSet;
use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId, Bson, Document};
use mongodb::Collection;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::changes::{self, Adjust, Update};
use crate::collection::CollectionSpec;
use crate::error::{show_id, HoldError, RepoError};
use crate::fields::{self, SystemFields};
use crate::hold::CommittedView;
use crate::probe;
use crate::schema::{BsonType, Violation};
use crate::store::Store;

/// The version every document has right after insert.
pub const FIRST_VERSION: i64 = 1;

/// How often a read follows a holder that finished meanwhile before giving up.
const MAX_REREADS: usize = 8;

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

/// A query over live documents: filter, sort and limit.
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

    /// Returns at most `limit` documents.
    pub fn limit(mut self, limit: i64) -> Query {
        self.limit = Some(limit);
        self
    }
}

/// A typed collection of stamped documents.
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

/// A stored document after the committed-view and tombstone rules.
enum Visible<T> {
    Found(Stamped<T>),
    Deleted(i64),
    Absent,
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

    /// The raw driver collection (system fields included), for tools and the transaction layer.
    pub fn raw_collection(&self) -> &Collection<Document> {
        &self.coll
    }

    /// Inserts a new document at version 1 and returns its id (generated when the value has
    /// none and the schema allows an ObjectId).
    pub async fn insert(&self, value: &T) -> Result<Bson, RepoError> {
        let (id, mut doc) = self.prepare_insert(value)?;
        let shown = show_id(&id);
        self.stamp(&mut doc, FIRST_VERSION);
        self.validate(&shown, &doc)?;

        match self.coll.insert_one(&doc).await {
            Ok(_) => {}
            Err(e) if probe::error_code(&e) == Some(probe::DUPLICATE_KEY) => {
                if !self.take_placeholder(&id, &shown, &doc).await? {
                    return Err(RepoError::DuplicateId {
                        collection: self.name().to_string(),
                        id: shown,
                    });
                }
            }
            Err(e) => return Err(self.write_error(&shown, "insert", e)),
        }
        tracing::debug!(collection = self.name(), id = %shown, "inserted");
        Ok(id)
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

    /// Replaces the placeholder a rolled-back transactional insert left under `id` (a free
    /// version-0 tombstone) with `doc`; `false` when the id is taken by anything else.
    pub(crate) async fn take_placeholder(
        &self,
        id: &Bson,
        shown: &str,
        doc: &Document,
    ) -> Result<bool, RepoError> {
        let result = self
            .coll
            .replace_one(fields::free_placeholder_filter(id), doc)
            .await
            .map_err(|e| self.write_error(shown, "insert", e))?;
        Ok(result.matched_count == 1)
    }

    /// Reads a document by id: its committed value, or `NotFound` / `Deleted`.
    pub async fn get(&self, id: impl Into<Bson>) -> Result<Stamped<T>, RepoError> {
        let id = id.into();
        self.check_id(&id)?;
        let shown = show_id(&id);
        let stored = self
            .coll
            .find_one(doc! { "_id": id.clone() })
            .await
            .map_err(|e| self.db_error(&shown, "find by id", e))?;
        let not_found = || RepoError::NotFound {
            collection: self.name().to_string(),
            id: shown.clone(),
        };
        let stored = stored.ok_or_else(not_found)?;
        match self.visible(stored).await? {
            Visible::Found(found) => Ok(found),
            Visible::Deleted(version) => Err(RepoError::Deleted {
                collection: self.name().to_string(),
                id: shown,
                version,
            }),
            Visible::Absent => Err(not_found()),
        }
    }

    /// Finds live documents matching the query (tombstones are skipped).
    pub async fn find(&self, query: Query) -> Result<Vec<Stamped<T>>, RepoError> {
        use futures::TryStreamExt;

        let filter = if query.filter.is_empty() {
            fields::live_filter()
        } else {
            doc! { "$and": [query.filter, fields::live_filter()] }
        };
        let mut find = self.coll.find(filter);
        if let Some(sort) = query.sort {
            find = find.sort(sort);
        }
        if let Some(limit) = query.limit {
            find = find.limit(limit);
        }
        let docs: Vec<Document> = find
            .await
            .map_err(|e| self.db_error("*", "find", e))?
            .try_collect()
            .await
            .map_err(|e| self.db_error("*", "find", e))?;

        let mut out = Vec::with_capacity(docs.len());
        for stored in docs {
            if let Visible::Found(found) = self.visible(stored).await? {
                out.push(found);
            }
        }
        Ok(out)
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
            Some(own) if *own == id => {}
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

    /// Removes tombstones deleted more than `older_than` ago; returns how many were removed.
    pub async fn purge_tombstones(&self, older_than: Duration) -> Result<u64, RepoError> {
        let age = chrono::Duration::from_std(older_than).unwrap_or(chrono::Duration::MAX);
        let cutoff = chrono::Utc::now()
            .checked_sub_signed(age)
            .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC);
        let filter = doc! {
            fields::DELETED: { "$lt": bson::DateTime::from_chrono(cutoff) },
            fields::ACTIVE_TXN: null,
        };
        let result = self
            .coll
            .delete_many(filter)
            .await
            .map_err(|e| self.db_error("*", "purge tombstones", e))?;
        tracing::info!(
            collection = self.name(),
            purged = result.deleted_count,
            "purged tombstones"
        );
        Ok(result.deleted_count)
    }

    // ----- the conditional write loop -----

    async fn write(&self, id: Bson, expected: i64, change: Change<'_>) -> Result<i64, RepoError> {
        let shown = show_id(&id);
        let new_version = expected + 1;
        let current = self.spec.schema_version();
        let (filter, operation) = self.happy_path(&id, expected, new_version, &change);

        let lock_wait = self.store.inner.lock_wait;
        let started = Instant::now();
        let mut waits = 0_u32;
        let mut last_holder = None;
        loop {
            let matched = match &operation {
                Operation::Update(update) => self
                    .coll
                    .update_one(filter.clone(), update.clone())
                    .await
                    .map(|r| r.matched_count),
                Operation::Replace(replacement) => self
                    .coll
                    .replace_one(filter.clone(), replacement.clone())
                    .await
                    .map(|r| r.matched_count),
            }
            .map_err(|e| self.write_error(&shown, change.verb(), e))?;
            if matched == 1 {
                tracing::debug!(collection = self.name(), id = %shown, version = new_version, "{}", change.verb());
                return Ok(new_version);
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
                Next::Wait(holder) => {
                    let resolved = self
                        .store
                        .inner
                        .holds
                        .resolve_holder(&self.store.inner.db, self.name(), &id, &holder)
                        .await
                        .map_err(|source| self.hold_error(&shown, holder, source))?;
                    // A resolved holder is retried at once, unless the same one is still there.
                    let again = last_holder == Some(holder);
                    last_holder = Some(holder);
                    if (!resolved || again) && started.elapsed() < lock_wait.max_wait {
                        tokio::time::sleep(lock_wait.backoff(waits)).await;
                        waits += 1;
                    }
                }
            }
            if started.elapsed() >= lock_wait.max_wait {
                return Err(RepoError::Locked {
                    collection: self.name().to_string(),
                    id: shown,
                    holder: last_holder,
                    waited: started.elapsed(),
                });
            }
        }
    }

    /// The filter and operation of the single write attempted first.
    fn happy_path(
        &self,
        id: &Bson,
        expected: i64,
        new_version: i64,
        change: &Change<'_>,
    ) -> (Document, Operation) {
        let current = self.spec.schema_version();
        let mut filter = doc! {
            "_id": id.clone(),
            fields::VERSION: expected,
            fields::ACTIVE_TXN: null,
            fields::DELETED: null,
        };
        match change {
            Change::Update(update) => {
                // Field-level changes are only safe on documents already in the current shape.
                filter.insert(fields::SCHEMA_VERSION, current);
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
                (filter, Operation::Update(op))
            }
            Change::Adjust(adjust) => {
                filter.insert(fields::SCHEMA_VERSION, current);
                let inc: Document = adjust
                    .increments()
                    .iter()
                    .map(|(p, v)| (p.clone(), v.clone()))
                    .collect();
                let op = doc! { "$inc": inc, "$set": { fields::VERSION: new_version } };
                (filter, Operation::Update(op))
            }
            Change::Replace(value) => {
                // A whole new value in the current shape may replace any older shape.
                filter.insert(fields::SCHEMA_VERSION, doc! { "$lte": current });
                let mut replacement = value.clone();
                self.stamp(&mut replacement, new_version);
                (filter, Operation::Replace(replacement))
            }
            Change::Delete => {
                filter.insert(fields::SCHEMA_VERSION, doc! { "$lte": current });
                let tombstone = doc! {
                    "_id": id.clone(),
                    fields::SCHEMA_VERSION: current,
                    fields::VERSION: new_version,
                    fields::DELETED: bson::DateTime::now(),
                };
                (filter, Operation::Replace(tombstone))
            }
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
        let stored = self
            .coll
            .find_one(doc! { "_id": id.clone() })
            .await
            .map_err(|e| self.db_error(shown, "find by id", e))?;
        let Some(stored) = stored else {
            return Ok(Next::Fail(RepoError::NotFound {
                collection: self.name().to_string(),
                id: shown.to_string(),
            }));
        };
        let sys = self.system_fields(shown, &stored)?;
        if sys.is_placeholder() {
            return Ok(Next::Fail(RepoError::NotFound {
                collection: self.name().to_string(),
                id: shown.to_string(),
            }));
        }
        if sys.is_deleted() {
            return Ok(Next::Fail(RepoError::Deleted {
                collection: self.name().to_string(),
                id: shown.to_string(),
                version: sys.version,
            }));
        }
        if sys.schema_version > current {
            return Ok(Next::Fail(self.too_new(shown, sys.schema_version)));
        }
        if let Some(holder) = sys.active_txn {
            return Ok(Next::Wait(holder));
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
        let result = self
            .coll
            .replace_one(filter, doc)
            .await
            .map_err(|e| self.write_error(shown, change.verb(), e))?;
        if result.matched_count == 1 {
            tracing::info!(collection = self.name(), id = %shown, from = stored_schema, to = self.spec.schema_version(), "upgraded document on write");
        }
        Ok(result.matched_count == 1)
    }

    // ----- reading -----

    /// Applies the committed-view, tombstone, schema and decoding rules to a stored document.
    async fn visible(&self, mut stored: Document) -> Result<Visible<T>, RepoError> {
        let id = stored.get("_id").cloned().unwrap_or(Bson::Null);
        let shown = show_id(&id);
        let mut rereads = 0;
        let (doc, sys) = loop {
            let sys = self.system_fields(&shown, &stored)?;
            if sys.is_placeholder() {
                return Ok(Visible::Absent);
            }
            if sys.is_deleted() {
                return Ok(Visible::Deleted(sys.version));
            }
            let Some(holder) = sys.active_txn else {
                break (stored, sys);
            };
            let view = self
                .store
                .inner
                .holds
                .committed_view(&self.store.inner.db, self.name(), &stored, &holder)
                .await
                .map_err(|source| self.hold_error(&shown, holder, source))?;
            match view {
                // Past the commit point a pending delete is a delete.
                CommittedView::Stored if sys.deleting => return Ok(Visible::Deleted(sys.version)),
                CommittedView::Stored => break (stored, sys),
                CommittedView::PreImage(pre) => {
                    let pre_sys = self.system_fields(&shown, &pre)?;
                    if pre_sys.is_deleted() {
                        return Ok(Visible::Deleted(pre_sys.version));
                    }
                    break (pre, pre_sys);
                }
                CommittedView::Absent => return Ok(Visible::Absent),
                CommittedView::Reread if rereads < MAX_REREADS => {
                    rereads += 1;
                    match self
                        .coll
                        .find_one(doc! { "_id": id.clone() })
                        .await
                        .map_err(|e| self.db_error(&shown, "find by id", e))?
                    {
                        Some(fresh) => stored = fresh,
                        None => return Ok(Visible::Absent),
                    }
                }
                CommittedView::Reread => {
                    return Err(self.hold_error(
                        &shown,
                        holder,
                        "the document kept changing while it was read".into(),
                    ))
                }
            }
        };
        if sys.schema_version > self.spec.schema_version() {
            return Err(self.too_new(&shown, sys.schema_version));
        }
        let user = self.upgrade(&shown, doc, sys.schema_version)?;
        let value = bson::from_document::<T>(user).map_err(|source| RepoError::Decode {
            collection: self.name().to_string(),
            id: shown.clone(),
            source,
        })?;
        Ok(Visible::Found(Stamped {
            id,
            version: sys.version,
            stored_schema_version: sys.schema_version,
            value,
        }))
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
        if expected < FIRST_VERSION {
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
        if let Some(field) = fields::ALL.iter().find(|f| doc.contains_key(**f)) {
            return Err(RepoError::SystemField {
                collection: self.name().to_string(),
                id: shown.to_string(),
                field: field.to_string(),
            });
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
        RepoError::Database {
            collection: self.name().to_string(),
            id: shown.to_string(),
            operation,
            source: Box::new(source),
        }
    }

    fn write_error(
        &self,
        shown: &str,
        operation: &'static str,
        source: mongodb::error::Error,
    ) -> RepoError {
        if probe::error_code(&source) == Some(probe::VALIDATION_FAILED) {
            return self.invalid(
                shown,
                Violation {
                    field: "(server validator)".into(),
                    reason: source.to_string(),
                },
            );
        }
        self.db_error(shown, operation, source)
    }
}

/// The operation of a conditional write.
enum Operation {
    Update(Document),
    Replace(Document),
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
