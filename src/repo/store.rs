//! The entry point: a database handle plus the settings every repository shares, and the services
//! the layers above need from one place: the server's time, the durability of protocol writes,
//! version floors and tombstone shapes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::{doc, Bson, DateTime, Document};
use futures::TryStreamExt;
use mongodb::options::{CollectionOptions, IndexOptions, ReadConcern, WriteConcern};
use mongodb::{Collection, Database, IndexModel};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::OnceCell;

use crate::repo::changes::set_path;
use crate::repo::collection::{CollectionSpec, SpecError};
use crate::repo::error::RepoError;
use crate::repo::fields;
use crate::repo::hold::{self, HoldResolver, RecordResolver};
use crate::repo::meta::{self, CachedFloor, META_COLLECTION};
use crate::repo::repository::Repository;
use crate::repo::schema::JsonSchema;
use crate::repo::write::{self, Write};
use crate::server::clock::{self, ClockError, Durability, ServerClock, Topology};
use crate::server::probe;
use crate::server::semantics::{self, Semantic};

/// Default name of the collection holding ActiveTransaction records.
pub const TRANSACTIONS_COLLECTION: &str = "mongotx_transactions";

/// Whether to install each collection's schema as a server-side `$jsonSchema` validator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ServerValidation {
    /// Install it when the server is found to enforce validators (checked once per store).
    #[default]
    Auto,
    /// Always install it (for servers known to support it).
    Always,
    /// Never install it; validate on the client only.
    Never,
}

/// The shortest pause [`LockWait::backoff`] gives.
const MIN_PAUSE: Duration = Duration::from_millis(1);

/// How writers wait for a held document, and how they back off meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockWait {
    /// Total time to wait before failing with `Locked`.
    pub max_wait: Duration,
    /// First pause between attempts.
    pub initial_backoff: Duration,
    /// Longest pause between attempts.
    pub max_backoff: Duration,
}

impl Default for LockWait {
    fn default() -> LockWait {
        LockWait {
            max_wait: Duration::from_secs(2),
            initial_backoff: Duration::from_millis(2),
            max_backoff: Duration::from_millis(100),
        }
    }
}

impl LockWait {
    /// The pause before attempt `attempt` (0-based): exponential, capped, jittered so that writers
    /// queued on one document do not retry in lockstep, and at least 1 ms (a zero
    /// backoff would send attempts back to back against the server for the whole wait).
    pub fn backoff(&self, attempt: u32) -> Duration {
        use rand::Rng;
        let ceiling = self
            .initial_backoff
            .saturating_mul(1_u32 << attempt.min(16))
            .min(self.max_backoff)
            .max(MIN_PAUSE);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rand::rng().random_range(nanos / 2..=nanos)).max(MIN_PAUSE)
    }
}

/// A database plus shared settings; opens typed repositories. Cheap to clone.
///
/// ```no_run
/// # async fn demo(client: mongodb::Client) -> Result<(), mongotx::RepoError> {
/// use std::time::Duration;
/// use mongotx::{CollectionSpec, Durability, LockWait, Store};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Account { #[serde(rename = "_id")] id: String, balance: i64 }
///
/// let store = Store::builder(client.database("bank"))
///     .lock_wait(LockWait { max_wait: Duration::from_secs(1), ..LockWait::default() })
///     .durability(Durability::Majority)
///     .build();
/// let spec = CollectionSpec::new("accounts", 1, include_str!("../../schemas/accounts.json"))?;
/// let accounts = store.repository::<Account>(spec).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Store {
    pub(crate) inner: Arc<StoreInner>,
}

pub(crate) struct StoreInner {
    pub(crate) db: Database,
    pub(crate) lock_wait: LockWait,
    pub(crate) resolver: Arc<dyn HoldResolver>,
    txns_collection: String,
    validation: ServerValidation,
    validator_support: OnceCell<bool>,
    check_server: bool,
    /// What the server check found, once it could ask the server (an unreachable server is
    /// asked again next time).
    server_checked: OnceCell<Result<(), Semantic>>,
    durability: Durability,
    topology: OnceCell<Topology>,
    clock: ServerClock,
    floor_refresh: Duration,
    floor_grace: Duration,
    floors: Mutex<HashMap<String, CachedFloor>>,
    markers: Mutex<HashMap<String, Arc<Vec<String>>>>,
    /// When this process first met a hold of each transaction whose record was absent.
    absent_since: Mutex<HashMap<bson::oid::ObjectId, Instant>>,
    /// Whether a round of writes goes as one `bulkWrite`: the setting, until the server turns out
    /// not to have the command.
    batch_writes: AtomicBool,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("database", &self.inner.db.name())
            .field("lock_wait", &self.inner.lock_wait)
            .field("validation", &self.inner.validation)
            .field("durability", &self.inner.durability)
            .finish()
    }
}

/// Builds a [`Store`] with non-default settings.
pub struct StoreBuilder {
    db: Database,
    lock_wait: LockWait,
    resolver: Option<Arc<dyn HoldResolver>>,
    txns_collection: String,
    validation: ServerValidation,
    check_server: bool,
    durability: Durability,
    clock_resample: Duration,
    floor_grace: Duration,
    batch_writes: bool,
}

impl StoreBuilder {
    /// Sets how writers wait for documents held by transactions.
    pub fn lock_wait(mut self, lock_wait: LockWait) -> StoreBuilder {
        self.lock_wait = lock_wait;
        self
    }

    /// Replaces the resolver that reads and decides holders' outcomes (for tests and tools).
    pub fn hold_resolver(mut self, resolver: Arc<dyn HoldResolver>) -> StoreBuilder {
        self.resolver = Some(resolver);
        self
    }

    /// Sets the collection of ActiveTransaction records (default `mongotx_transactions`).
    pub fn transactions_collection(mut self, name: impl Into<String>) -> StoreBuilder {
        self.txns_collection = name.into();
        self
    }

    /// Sets whether schemas are installed as server-side validators.
    pub fn server_validation(mut self, validation: ServerValidation) -> StoreBuilder {
        self.validation = validation;
        self
    }

    /// Sets whether the store checks, when it opens its first collection, that the server has
    /// the behaviours the transaction protocol cannot do without (`$expr` with `$$NOW`, pipeline
    /// updates and their upserts, one `$$NOW` per statement, numeric `_id` equality,
    /// findAndModify with a pipeline: a few commands on a scratch collection). Default: yes; a
    /// server that lacks one is refused with [`RepoError::ServerUnsuitable`] naming it, before
    /// anything is written. `mongotx-probe` runs these checks and more.
    pub fn check_server(mut self, check: bool) -> StoreBuilder {
        self.check_server = check;
        self
    }

    /// Sets the write and read concerns of the transaction protocol (default: majority on
    /// replica sets and sharded clusters).
    pub fn durability(mut self, durability: Durability) -> StoreBuilder {
        self.durability = durability;
        self
    }

    /// Sets how often the server's time is sampled again (default 30 s); between samples it is
    /// advanced by this process's monotonic clock.
    pub fn clock_resample(mut self, every: Duration) -> StoreBuilder {
        self.clock_resample = every;
        self
    }

    /// Sets how long a raised version floor must stand before tombstones under it are purged
    /// (default 20 s); processes re-read floors four times as often.
    pub fn version_floor_grace(mut self, grace: Duration) -> StoreBuilder {
        self.floor_grace = grace;
        self
    }

    /// Sets whether the writes of one protocol round (a commit's applies, its finishes) go to the
    /// server as one `bulkWrite` command (default: yes, where the server has it: MongoDB 8.0 and
    /// later; older servers get one command per write, all sent at once, as with `false`).
    pub fn batch_writes(mut self, batch: bool) -> StoreBuilder {
        self.batch_writes = batch;
        self
    }

    /// Finishes the store.
    pub fn build(self) -> Store {
        Store {
            inner: Arc::new(StoreInner {
                db: self.db,
                lock_wait: self.lock_wait,
                resolver: self.resolver.unwrap_or_else(|| Arc::new(RecordResolver)),
                txns_collection: self.txns_collection,
                validation: self.validation,
                validator_support: OnceCell::new(),
                check_server: self.check_server,
                server_checked: OnceCell::new(),
                durability: self.durability,
                topology: OnceCell::new(),
                clock: ServerClock::new(self.clock_resample),
                floor_refresh: self.floor_grace / 4,
                floor_grace: self.floor_grace,
                floors: Mutex::new(HashMap::new()),
                markers: Mutex::new(HashMap::new()),
                absent_since: Mutex::new(HashMap::new()),
                batch_writes: AtomicBool::new(self.batch_writes),
            }),
        }
    }
}

impl Store {
    /// A store on `db` with default settings.
    pub fn new(db: Database) -> Store {
        Store::builder(db).build()
    }

    /// A builder for a store on `db`.
    pub fn builder(db: Database) -> StoreBuilder {
        StoreBuilder {
            db,
            lock_wait: LockWait::default(),
            resolver: None,
            txns_collection: TRANSACTIONS_COLLECTION.to_string(),
            validation: ServerValidation::default(),
            check_server: true,
            durability: Durability::default(),
            clock_resample: Duration::from_secs(30),
            floor_grace: Duration::from_secs(20),
            batch_writes: true,
        }
    }

    /// The underlying database handle.
    pub fn database(&self) -> &Database {
        &self.inner.db
    }

    /// The lock-wait policy writers use.
    pub fn lock_wait(&self) -> LockWait {
        self.inner.lock_wait
    }

    /// The collection holding ActiveTransaction records.
    pub fn transactions_collection(&self) -> &str {
        &self.inner.txns_collection
    }

    /// The resolver that reads and decides holders' outcomes.
    pub fn resolver(&self) -> &dyn HoldResolver {
        self.inner.resolver.as_ref()
    }

    /// The durability setting of the transaction protocol.
    pub fn durability(&self) -> Durability {
        self.inner.durability
    }

    /// Whether a round of protocol writes goes to the server as one `bulkWrite` command: as set
    /// by [`StoreBuilder::batch_writes`], and `false` once the server has refused the command.
    pub fn batches_writes(&self) -> bool {
        self.inner.batch_writes.load(Ordering::Relaxed)
    }

    /// Remembers that the server has no `bulkWrite`.
    pub(crate) fn no_bulk_write(&self) {
        if self.inner.batch_writes.swap(false, Ordering::Relaxed) {
            tracing::info!(
                database = self.inner.db.name(),
                "the server has no bulkWrite (MongoDB 8.0+); each write of a round goes as its own command"
            );
        }
    }

    /// The server's current time, as this store estimates it (see [`ServerClock`]).
    pub async fn server_time(&self) -> Result<DateTime, ClockError> {
        self.now().await
    }

    /// The deployment's topology, from the server's `hello` reply (asked once per store).
    pub async fn topology(&self) -> Result<Topology, ClockError> {
        self.inner
            .topology
            .get_or_try_init(|| async {
                clock::hello(&self.inner.db)
                    .await
                    .map(|h| h.topology)
                    .map_err(|source| ClockError::Database {
                        source: Box::new(source),
                    })
            })
            .await
            .cloned()
    }

    pub(crate) async fn now(&self) -> Result<DateTime, ClockError> {
        self.inner.clock.now(&self.inner.db).await
    }

    /// Whether protocol writes and deciding reads use majority concerns.
    pub(crate) async fn majority(&self) -> mongodb::error::Result<bool> {
        match self.inner.durability {
            Durability::Auto => match self.topology().await {
                Ok(topology) => Ok(topology.is_replicated()),
                Err(ClockError::Database { source }) => Err(*source),
                Err(other) => Err(mongodb::error::Error::custom(other.to_string())),
            },
            other => Ok(other.majority_on(&Topology::Standalone)),
        }
    }

    /// A handle on `name` for the transaction protocol: majority writes and reads where the
    /// durability setting asks for them.
    pub(crate) async fn protocol_collection(
        &self,
        name: &str,
    ) -> mongodb::error::Result<Collection<Document>> {
        if !self.majority().await? {
            return Ok(self.inner.db.collection(name));
        }
        let options = CollectionOptions::builder()
            .write_concern(WriteConcern::majority())
            .read_concern(ReadConcern::majority())
            .build();
        Ok(self.inner.db.collection_with_options(name, options))
    }

    /// Opens a typed repository: checks the definition, registers the collection, creates the
    /// system indexes and installs the server-side validator where supported. Idempotent.
    pub async fn repository<T>(&self, spec: CollectionSpec) -> Result<Repository<T>, RepoError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        spec.check_upgrades()?;
        let name = spec.name().to_string();
        crate::repo::collection::check_name(self.transactions_collection())?;
        // A repository there could overwrite the records and registrations the protocol runs on.
        if name == self.transactions_collection() || name == META_COLLECTION {
            return Err(SpecError::Name {
                name,
                reason: "mongotx keeps its own records there (transaction records or the collection registry)",
            }
            .into());
        }
        self.ensure_server_suits().await?;
        let db_error = |operation: &'static str| {
            let collection = name.clone();
            move |source| RepoError::database(&collection, "*", operation, source)
        };

        if self.installs_validator().await {
            self.install_validator(&spec)
                .await
                .map_err(db_error("installing the validator"))?;
        } else {
            tracing::info!(
                collection = %name,
                "server does not enforce $jsonSchema validators; documents are validated on the client only"
            );
        }

        let coll = self.inner.db.collection::<Document>(&name);
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
            sparse(hold::CHANGED_PATH),
        ])
        .await
        .map_err(db_error("creating indexes"))?;
        meta::register(&self.meta(), &name)
            .await
            .map_err(db_error("registering the collection"))?;
        self.refresh_markers(&name)
            .await
            .map_err(db_error("listing indexes"))?;

        Ok(Repository::new(self.clone(), Arc::new(spec), coll))
    }

    fn meta(&self) -> Collection<Document> {
        self.inner.db.collection(META_COLLECTION)
    }

    /// The version a new document of `collection` gets: one above its version floor.
    pub(crate) async fn first_version(&self, collection: &str) -> mongodb::error::Result<i64> {
        let cached = self
            .inner
            .floors
            .lock()
            .ok()
            .and_then(|floors| floors.get(collection).copied())
            .filter(|c| c.fresh(self.inner.floor_refresh));
        let floor = match cached {
            Some(c) => c.floor,
            None => {
                let floor = meta::read_floor(&self.meta(), collection).await?;
                self.remember_floor(collection, floor);
                floor
            }
        };
        Ok(floor.saturating_add(1))
    }

    fn remember_floor(&self, collection: &str, floor: i64) {
        if let Ok(mut floors) = self.inner.floors.lock() {
            let entry = floors.entry(collection.to_string()).or_insert(CachedFloor {
                floor,
                read_at: Instant::now(),
            });
            entry.floor = entry.floor.max(floor);
            entry.read_at = Instant::now();
        }
    }

    /// Purges the free tombstones of `collection` deleted before `cutoff` (server time), after
    /// raising its version floor over them and letting the raise stand for the grace period.
    pub(crate) async fn purge_tombstones(
        &self,
        collection: &str,
        cutoff: DateTime,
    ) -> Result<u64, RepoError> {
        let fail =
            |operation| move |source| RepoError::database(collection, "*", operation, source);
        let coll = self.inner.db.collection::<Document>(collection);
        let highest = coll
            .find_one(meta::purgeable(cutoff))
            .sort(doc! { fields::VERSION: -1 })
            .projection(doc! { fields::VERSION: 1 })
            .await
            .map_err(fail("purge tombstones"))?;
        let Some(highest) = highest.and_then(|d| match d.get(fields::VERSION) {
            Some(Bson::Int64(v)) => Some(*v),
            Some(Bson::Int32(v)) => Some(i64::from(*v)),
            _ => None,
        }) else {
            return Ok(0);
        };
        let now = self.now().await.map_err(|e| RepoError::Clock {
            collection: collection.to_string(),
            source: e,
        })?;
        let raised = meta::raise_floor(&self.meta(), collection, highest, now)
            .await
            .map_err(fail("raise the version floor"))?;
        self.remember_floor(collection, highest);
        if let Some(raised) = raised {
            let ready = clock::plus(raised, self.inner.floor_grace);
            let wait = ready.timestamp_millis() - now.timestamp_millis();
            if wait > 0 {
                tracing::debug!(
                    collection,
                    wait_ms = wait,
                    "letting the raised version floor stand before purging"
                );
                tokio::time::sleep(Duration::from_millis(wait.unsigned_abs())).await;
            }
        }
        let mut filter = meta::purgeable(cutoff);
        filter.insert(fields::VERSION, doc! { "$lte": highest });
        let purged = coll
            .delete_many(filter)
            .await
            .map_err(fail("purge tombstones"))?
            .deleted_count;
        tracing::info!(collection, purged, floor = highest, "purged tombstones");
        Ok(purged)
    }

    /// The paths tombstones of `collection` fill with a per-document marker: the first key of every
    /// unique index that would otherwise index all tombstones under one missing (null) key.
    async fn refresh_markers(&self, collection: &str) -> mongodb::error::Result<Arc<Vec<String>>> {
        let indexes: Vec<IndexModel> = self
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
        if let Ok(mut markers) = self.inner.markers.lock() {
            markers.insert(collection.to_string(), Arc::clone(&paths));
        }
        Ok(paths)
    }

    fn markers(&self, collection: &str) -> Arc<Vec<String>> {
        self.inner
            .markers
            .lock()
            .ok()
            .and_then(|markers| markers.get(collection).cloned())
            .unwrap_or_default()
    }

    /// Replaces what `filter` matches in `coll` by the tombstone of `id` at `version`; refreshes
    /// the tombstone's unique-index markers and tries again if a unique index refuses it.
    pub(crate) async fn write_tombstone(
        &self,
        coll: &Collection<Document>,
        filter: Document,
        id: &Bson,
        schema_version: i64,
        version: i64,
    ) -> mongodb::error::Result<u64> {
        let write = self
            .tombstone_write(coll.name(), filter.clone(), id, schema_version, version)
            .await?;
        let sent = write::run(coll, &write).await;
        self.after_tombstone(coll, filter, id, schema_version, version, sent)
            .await
    }

    /// The replacement of what `filter` matches in collection `name` by the tombstone of `id` at
    /// `version`, with the unique-index markers this process knows of (see
    /// [`after_tombstone`](Store::after_tombstone) for when they are out of date).
    pub(crate) async fn tombstone_write(
        &self,
        name: &str,
        filter: Document,
        id: &Bson,
        schema_version: i64,
        version: i64,
    ) -> mongodb::error::Result<Write> {
        let deleted_at = self
            .now()
            .await
            .map_err(|e| mongodb::error::Error::custom(e.to_string()))?;
        let paths = self.markers(name);
        Ok(Write::Replace(
            filter,
            tombstone(id, schema_version, version, deleted_at, &paths),
        ))
    }

    /// What a tombstone write that came back `sent` comes to: a unique index that refused it
    /// (an index made after this process read the markers) gets the markers read again and the
    /// tombstone sent once more.
    pub(crate) async fn after_tombstone(
        &self,
        coll: &Collection<Document>,
        filter: Document,
        id: &Bson,
        schema_version: i64,
        version: i64,
        sent: mongodb::error::Result<u64>,
    ) -> mongodb::error::Result<u64> {
        match sent {
            Err(e) if probe::error_code(&e) == Some(probe::DUPLICATE_KEY) => {
                self.refresh_markers(coll.name()).await?;
                let write = self
                    .tombstone_write(coll.name(), filter, id, schema_version, version)
                    .await?;
                match write::run(coll, &write).await {
                    Err(e) if probe::error_code(&e) == Some(probe::DUPLICATE_KEY) => Err(
                        mongodb::error::Error::custom("a unique index refused the tombstone twice"),
                    ),
                    other => other,
                }
            }
            other => other,
        }
    }

    /// How long (on this process's monotonic clock) transaction `txn` has been seen holding a
    /// document without a record; the first call starts the count.
    pub(crate) fn absent_for(&self, txn: bson::oid::ObjectId) -> Duration {
        let mut seen = self
            .inner
            .absent_since
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = Instant::now();
        // Entries are only useful for a few seconds; keep the map small.
        if seen.len() > 4_096 {
            seen.retain(|_, at| now.duration_since(*at) < Duration::from_secs(60));
        }
        now.duration_since(*seen.entry(txn).or_insert(now))
    }

    /// Inserts the placeholder fence of transaction `txn` for the absent document `id` of `coll`:
    /// system fields, the fence hold and, at each unique-index path, a per-id marker (as a
    /// tombstone has), so that no unique index refuses it. Returns whether it was inserted (`false`:
    /// the id is taken).
    pub(crate) async fn write_placeholder(
        &self,
        coll: &Collection<Document>,
        id: &Bson,
        schema_version: i64,
        txn: bson::oid::ObjectId,
        hold: Document,
    ) -> mongodb::error::Result<bool> {
        let name = coll.name().to_string();
        let mut paths = self.markers(&name);
        for attempt in 0..2 {
            let mut placeholder = tombstone(id, schema_version, 0, DateTime::MIN, &paths);
            placeholder.remove(fields::DELETED);
            placeholder.insert(fields::ACTIVE_TXN, txn);
            placeholder.insert(fields::HOLD, hold.clone());
            match coll.insert_one(placeholder).await {
                Ok(_) => return Ok(true),
                Err(e) if probe::error_code(&e) == Some(probe::DUPLICATE_KEY) => {
                    if probe::duplicate_key_index(&e).is_none_or(|index| index == "_id_")
                        || attempt > 0
                    {
                        return Ok(false);
                    }
                    paths = self.refresh_markers(&name).await?;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }

    /// Checks once per store that the server has what the protocol needs (see
    /// [`StoreBuilder::check_server`]).
    pub(crate) async fn ensure_server_suits(&self) -> Result<(), RepoError> {
        if !self.inner.check_server {
            return Ok(());
        }
        let checked = self
            .inner
            .server_checked
            .get_or_try_init(|| semantics::essentials(&self.inner.db))
            .await
            .map_err(|source| RepoError::database("*", "*", "checking the server", source))?;
        match checked {
            Ok(()) => Ok(()),
            Err(missing) => Err(RepoError::ServerUnsuitable {
                name: missing.name,
                what: missing.what,
                detail: missing.detail.clone(),
            }),
        }
    }

    async fn installs_validator(&self) -> bool {
        match self.inner.validation {
            ServerValidation::Always => true,
            ServerValidation::Never => false,
            ServerValidation::Auto => {
                *self
                    .inner
                    .validator_support
                    .get_or_init(|| probe::validator_support(&self.inner.db))
                    .await
            }
        }
    }

    /// Installs the collection's schema as its server-side validator, for documents of this
    /// code's schema version only.
    ///
    /// Tombstones (user fields cleared) and fence placeholders (never had any) are let through.
    /// So are documents of *other* schema versions: during a rolling upgrade, processes of the
    /// old and the new version write at once, each validated on its own client; refusing the
    /// other version's documents would refuse valid writes until every process runs the same
    /// code. A validator is never replaced by one of an older version (a process of the old
    /// version that restarts late leaves the new one in place); if two installs race, the one
    /// that lands last wins, and either of them accepts every valid write of both versions.
    async fn install_validator(&self, spec: &CollectionSpec) -> Result<(), mongodb::error::Error> {
        let version = spec.schema_version();
        if let Some(installed) = self.installed_validator_version(spec.name()).await? {
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
                { hold::FENCE: true, fields::VERSION: 0_i64 },
                { fields::SCHEMA_VERSION: { "$type": "long", "$ne": version } },
                { fields::SCHEMA_VERSION: version, "$jsonSchema": schema },
            ]
        };
        self.put_validator(spec.name(), validator).await
    }

    /// The schema version whose validator `collection` has, if mongotx installed one.
    async fn installed_validator_version(
        &self,
        collection: &str,
    ) -> Result<Option<i64>, mongodb::error::Error> {
        let listed = self
            .inner
            .db
            .run_command(doc! { "listCollections": 1, "filter": { "name": collection } })
            .await?;
        let validator = listed
            .get_document("cursor")
            .ok()
            .and_then(|c| c.get_array("firstBatch").ok())
            .and_then(|batch| {
                batch
                    .iter()
                    .filter_map(Bson::as_document)
                    .find(|entry| entry.get_str("name").ok() == Some(collection))
            })
            .and_then(|entry| entry.get_document("options").ok())
            .and_then(|options| options.get_document("validator").ok());
        let Some(clauses) = validator.and_then(|v| v.get_array("$or").ok()) else {
            return Ok(None);
        };
        Ok(clauses
            .iter()
            .filter_map(Bson::as_document)
            .find_map(|clause| {
                clause
                    .get_document(fields::SCHEMA_VERSION)
                    .ok()
                    .and_then(|condition| condition.get_i64("$ne").ok())
            }))
    }

    /// Installs `schema` (JSON Schema text) as the validator of a collection that only a
    /// protocol writes (no system fields, no tombstones), where the store installs validators;
    /// returns the collection with the protocol's concerns.
    pub(crate) async fn validated_protocol_collection(
        &self,
        name: &str,
        schema: &str,
    ) -> mongodb::error::Result<Collection<Document>> {
        // Its validator would replace the one on the transaction records or the registry.
        if name == self.transactions_collection() || name == META_COLLECTION {
            return Err(mongodb::error::Error::custom(format!(
                "collection {name} is mongotx's own and cannot hold another protocol's records"
            )));
        }
        self.ensure_server_suits()
            .await
            .map_err(|e| mongodb::error::Error::custom(e.to_string()))?;
        if self.installs_validator().await {
            let parsed = JsonSchema::parse(name, schema)
                .map_err(|e| mongodb::error::Error::custom(e.to_string()))?;
            self.put_validator(name, doc! { "$jsonSchema": parsed.to_document() })
                .await?;
        }
        self.protocol_collection(name).await
    }

    /// Creates `collection` with `validator`, or replaces the validator of an existing one.
    async fn put_validator(
        &self,
        collection: &str,
        validator: Document,
    ) -> Result<(), mongodb::error::Error> {
        let created = self
            .inner
            .db
            .run_command(doc! { "create": collection, "validator": validator.clone() })
            .await;
        match created {
            Ok(_) => Ok(()),
            Err(e) if probe::error_code(&e) == Some(NAMESPACE_EXISTS) => self
                .inner
                .db
                .run_command(doc! { "collMod": collection, "validator": validator })
                .await
                .map(|_| ()),
            Err(e) => Err(e),
        }
    }
}

const NAMESPACE_EXISTS: i32 = 48;

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
