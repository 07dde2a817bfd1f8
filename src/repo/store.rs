//! The entry point: a database handle plus the settings every repository shares, and the services
//! the layers above need from one place: the server's time, the durability of protocol writes,
//! version floors. It also defines the one seam between the repository layer and the transaction
//! layer, [`HoldResolver`]: the store is handed one (by default [`RecordResolver`]) for the one
//! thing it cannot decide alone, a holder's outcome. Opening repositories is `open`'s; writing
//! tombstones is the hold protocol's (`hold::tombstone`).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use mongodb::options::{CollectionOptions, ReadConcern, WriteConcern};
use mongodb::{Collection, Database};
use tokio::sync::OnceCell;

use crate::repo::background::{Background, Shutdown};
use crate::repo::collection::CollectionSpec;
use crate::repo::error::RepoError;
use crate::repo::fields;
use crate::repo::meta::{self, CachedFloor, META_COLLECTION};
use crate::repo::outcome::{HoldError, TxnStatus};
use crate::retry::LockWait;
use crate::server::clock::{self, ClockError, Durability, ServerClock, Topology};
use crate::server::semantics::Semantic;

pub use crate::collections::TRANSACTIONS_COLLECTION;

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

/// A database plus shared settings; opens typed repositories. Cheap to clone.
///
/// ```no_run
/// # async fn demo(client: mongodb::Client) -> Result<(), mongotx::RepoError> {
/// use std::time::Duration;
/// use mongotx::options::{Durability, LockWait};
/// use mongotx::{CollectionSpec, Store};
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
    pub(crate) validation: ServerValidation,
    pub(crate) validator_support: OnceCell<bool>,
    pub(crate) check_server: bool,
    /// What the server check found, once it could ask the server (an unreachable server is
    /// asked again next time).
    pub(crate) server_checked: OnceCell<Result<(), Semantic>>,
    durability: Durability,
    topology: OnceCell<Topology>,
    clock: ServerClock,
    floor_refresh: Duration,
    floor_grace: Duration,
    floors: Mutex<HashMap<String, CachedFloor>>,
    /// The unique-index paths of each collection that tombstones mark (see `hold::tombstone`).
    pub(crate) markers: Mutex<HashMap<String, Arc<Vec<String>>>>,
    /// When this process first met a hold of each transaction whose record was absent.
    absent_since: Mutex<HashMap<bson::oid::ObjectId, Instant>>,
    /// Whether a round of writes goes as one `bulkWrite`: the setting, until the server turns out
    /// not to have the command.
    batch_writes: AtomicBool,
    /// The definition of each collection this store has opened or staged changes on, for the
    /// protocol steps that stamp a plain document they meet (see `repo::plain`).
    specs: Mutex<HashMap<String, Arc<CollectionSpec>>>,
    /// The background finishes of transactions committed through this store.
    pub(crate) background: Background,
    /// Validators this store could not install for lack of privileges, by collection: the
    /// command an administrator runs.
    pending_validators: Mutex<BTreeMap<String, Document>>,
    /// The collections whose server validator this store installed or found in place, with the
    /// schema version it checks in full.
    validators: Mutex<HashMap<String, i64>>,
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

    /// Replaces the resolver that reads and decides holders' outcomes (tests only).
    #[cfg(feature = "testkit")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
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
    /// findAndModify with a pipeline: a dozen commands on a scratch collection). Default: yes; a
    /// server that lacks one is refused with [`RepoError::ServerUnsuitable`], whose message is the
    /// sentence `mongotx-probe`'s verdict prints for it, before anything is written. The verdict
    /// runs these checks and more, the single-document atomicity under contention among them:
    /// run it once against a deployment.
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
                specs: Mutex::new(HashMap::new()),
                pending_validators: Mutex::new(BTreeMap::new()),
                validators: Mutex::new(HashMap::new()),
                background: Background::default(),
            }),
        }
    }
}

impl Store {
    /// Stops taking background work and waits up to `limit` for the background finishes already
    /// running, as a service does before it exits (on SIGTERM or ctrl-c), so that transactions
    /// committed with [`Finish::InBackground`](crate::options::Finish::InBackground) are not left held
    /// until a reader, a writer or the GC finishes them. From then on every commit through this
    /// store or its clones finishes before returning, whatever its [`Finish`](crate::options::Finish).
    /// Nothing else changes: reads, writes and commits keep working. A second call waits for
    /// whatever is still running.
    ///
    /// ```no_run
    /// # async fn demo(store: mongotx::Store) {
    /// use std::time::Duration;
    /// tokio::signal::ctrl_c().await.ok();
    /// let report = store.shutdown(Duration::from_secs(10)).await;
    /// if report.unfinished > 0 {
    ///     eprintln!("{} committed transactions left for the GC to finish", report.unfinished);
    /// }
    /// # }
    /// ```
    pub async fn shutdown(&self, limit: Duration) -> Shutdown {
        self.inner.background.shutdown(limit).await
    }

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
    pub(crate) fn resolver(&self) -> &dyn HoldResolver {
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

    /// The server's current time, as this store estimates it (from samples of the server's clock,
    /// so that no two hosts' clocks are compared).
    pub async fn server_time(&self) -> Result<chrono::DateTime<chrono::Utc>, ClockError> {
        Ok(self.now().await?.to_chrono())
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

    /// The registry of managed collections (see `meta`).
    pub(crate) fn meta(&self) -> Collection<Document> {
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

    /// The server validators this store could not install because its user lacks the privilege
    /// (a service with the `readWrite` role may create a collection with its validator, but not
    /// change an existing collection's: `collMod` needs `dbAdmin`), each with the command an
    /// administrator runs, by collection. Their collections work all the same: every write is
    /// checked on the client; the server's validator adds the check for other writers. Each is
    /// also logged once, as a warning.
    pub fn pending_validators(&self) -> Vec<(String, Document)> {
        self.inner
            .pending_validators
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .map(|(name, command)| (name.clone(), command.clone()))
            .collect()
    }

    /// Records (and logs, the first time) a validator the server refused to let this store install.
    pub(crate) fn validator_not_installed(&self, collection: &str, command: Document) {
        let mut pending = self
            .inner
            .pending_validators
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let first = pending
            .insert(collection.to_string(), command.clone())
            .is_none();
        if first {
            tracing::warn!(
                database = self.inner.db.name(),
                collection,
                command = %Bson::Document(command).into_relaxed_extjson(),
                "not authorized to install the collection's validator (collMod needs the dbAdmin role); \
                 documents are checked on the client only until an administrator runs this command on the database"
            );
        }
    }

    /// Remembers that `collection`'s server validator, as this store installs it, is in place:
    /// the server checks documents of schema version `version` against the schema on every write.
    pub(crate) fn validator_in_place(&self, collection: &str, version: i64) {
        self.inner
            .validators
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(collection.to_string(), version);
    }

    /// Whether the server checks `collection`'s documents of schema version `version` against
    /// this store's schema on every write (its validator was installed or found in place).
    pub(crate) fn server_validates(&self, collection: &str, version: i64) -> bool {
        self.inner
            .validators
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(collection)
            == Some(&version)
    }

    /// Remembers the definition of a collection this store works on.
    pub(crate) fn remember_spec(&self, spec: &Arc<CollectionSpec>) {
        let mut specs = self
            .inner
            .specs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        specs.insert(spec.name().to_string(), Arc::clone(spec));
    }

    /// The definition of `collection`, if this store has opened it.
    pub(crate) fn spec_of(&self, collection: &str) -> Option<Arc<CollectionSpec>> {
        self.inner
            .specs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(collection)
            .cloned()
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
}

/// Reads and decides transaction outcomes for holds; the seam between the repository layer and
/// the transaction layer (whose records these are). [`RecordResolver`] is the standard one.
#[async_trait]
pub trait HoldResolver: Send + Sync + 'static {
    /// What the record of `txn` says now (a staging record whose participants are all in place
    /// is committed, and is written so).
    async fn status(&self, store: &Store, txn: ObjectId) -> Result<TxnStatus, HoldError>;

    /// What the records of `txns` say, for a reader: nothing is written, and a staging record
    /// whose participants are all in place reads as committed. The standard resolver reads them
    /// all in a bounded number of commands (see `RecordResolver`); this default asks
    /// [`HoldResolver::status`] for each, all at once.
    async fn statuses(
        &self,
        store: &Store,
        txns: &[ObjectId],
    ) -> Result<HashMap<ObjectId, TxnStatus>, HoldError> {
        let found = futures::future::join_all(txns.iter().map(|t| self.status(store, *t))).await;
        txns.iter()
            .zip(found)
            .map(|(t, status)| status.map(|s| (*t, s)))
            .collect()
    }

    /// Decides `txn` if it is still undecided with a deadline at or before `now` (server time):
    /// commits it if every participant is in place, else fences the missing ones and aborts it.
    /// Returns the status after the attempt.
    async fn abort_expired(
        &self,
        store: &Store,
        txn: ObjectId,
        now: DateTime,
    ) -> Result<TxnStatus, HoldError>;
}

// Declared here, beside the seam, so that the builder can default to it; what it does (its
// `HoldResolver` impl) is the hold protocol's, in `hold::staging`.
/// The resolver that reads ActiveTransaction records from the store's transactions collection.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordResolver;

/// The resolver used without a transaction layer: every hold counts as pending forever (tests).
#[cfg(feature = "testkit")]
#[derive(Debug, Clone, Copy, Default)]
pub struct NoTransactions;

#[cfg(feature = "testkit")]
#[async_trait]
impl HoldResolver for NoTransactions {
    async fn status(&self, _store: &Store, _txn: ObjectId) -> Result<TxnStatus, HoldError> {
        Ok(TxnStatus::Pending {
            deadline: DateTime::MAX,
        })
    }

    async fn abort_expired(
        &self,
        store: &Store,
        txn: ObjectId,
        _now: DateTime,
    ) -> Result<TxnStatus, HoldError> {
        self.status(store, txn).await
    }
}
