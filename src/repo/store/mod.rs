//! The entry point: a database handle plus the settings every repository shares, and the services
//! the layers above need from one place: the server's time, the durability of protocol writes,
//! version floors. It also defines the one seam between the repository layer and the transaction
//! layer, [`HoldResolver`]: the store is handed one (by default [`RecordResolver`]) for the one
//! thing it cannot decide alone, a holder's outcome.
//!
//! Every method of [`Store`] is declared in this file, delegating where the work is another
//! file's: opening repositories and installing validators to `open`, adopting a collection to
//! `adopt`, writing tombstones to the hold protocol (`hold::tombstone`). The type, its shared
//! state and the seam are in `handle`, the builder in `builder`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, Bson, DateTime, Document};
use mongodb::options::{CollectionOptions, ReadConcern, WriteConcern};
use mongodb::{Collection, Database};

use crate::repo::background::Shutdown;
use crate::repo::collection::CollectionSpec;
use crate::repo::error::RepoError;
use crate::repo::fields;
use crate::repo::format::gate::{self, Switch};
use crate::repo::format::{self, FormatError, FormatStatus, FORMAT};
use crate::repo::hold::record;
use crate::repo::meta::{self, CachedFloor, META_COLLECTION};
use crate::retry::LockWait;
use crate::server::clock::{self, ClockError, Durability, Topology};

pub use crate::collections::TRANSACTIONS_COLLECTION;
use crate::repo::adopt::{self, AdoptOptions, AdoptReport};
use crate::repo::open;
use crate::repo::repository::Repository;
use serde::{de::DeserializeOwned, Serialize};

mod builder;
mod handle;

pub use builder::StoreBuilder;
#[cfg(feature = "testkit")]
pub use handle::NoTransactions;
pub use handle::{HoldResolver, RecordResolver, ServerValidation, Store};

impl Store {
    /// Stops taking background work and waits up to `limit` for the background finishes already
    /// running, as a service does before it exits (on SIGTERM or ctrl-c), so that transactions
    /// committed with [`Finish::InBackground`](crate::options::Finish::InBackground) are not left held
    /// until a reader, a writer or the GC finishes them. From then on every commit through this
    /// store or its clones finishes before returning, whatever its [`Finish`](crate::options::Finish).
    /// Nothing else changes: reads, writes and commits keep working. A second call waits for
    /// whatever is still running. What the store counted for the contention record (see
    /// [`StoreBuilder::contention_record`]) is written at once too, and waited for within the
    /// same `limit` (it is not counted in the report, which is about transactions), and so is
    /// the deletion of the store's announcement of the stored formats it reads (see
    /// [`set_format`](Store::set_format)), which otherwise lapses within six
    /// [`format_refresh`](StoreBuilder::format_refresh) intervals.
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
        let started = Instant::now();
        let report = self.inner.background.shutdown(limit).await;
        // Within what is left of the limit: an announcement not retracted lapses by itself.
        let left = limit.saturating_sub(started.elapsed());
        let _ = tokio::time::timeout(left, gate::retract(self)).await;
        report
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
            contention: true,
            contention_every: Duration::from_secs(5),
            format_refresh: Duration::from_secs(10),
            reads_format: FORMAT,
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

    /// The server's time as [`now`](Store::now) estimates it, and how far off the estimate may
    /// be either way.
    pub(crate) async fn now_within(&self) -> Result<(DateTime, Duration), ClockError> {
        self.inner.clock.now_within(&self.inner.db).await
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

    /// The stored format the database writes, the newest this process reads, and the
    /// announcement of every store that said which formats it reads (see
    /// [`set_format`](Store::set_format)).
    pub async fn format_status(&self) -> Result<FormatStatus, RepoError> {
        gate::status(self).await.map_err(RepoError::from)
    }

    /// Switches the database to write stored format `format`, as MongoDB's
    /// `setFeatureCompatibilityVersion` does, once every instance of the fleet runs a release
    /// that reads it: refused ([`RepoError::FormatRefused`], nothing written) while a live
    /// instance (one that announced itself within the last six
    /// [`format_refresh`](StoreBuilder::format_refresh) intervals) reads only older formats,
    /// and ([`RepoError::FormatUnknown`]) when this release does not read `format`. Every store
    /// writes the new format from its next refresh on; an instance of an older release that
    /// starts afterwards refuses to write ([`ErrorKind::NewerFormat`](crate::ErrorKind)). Going
    /// back to an older format is allowed in the same way; what was written in the newer one
    /// stays so, and only releases that read it can act on it.
    pub async fn set_format(&self, format: i64) -> Result<FormatStatus, RepoError> {
        let reads = self.inner.gate.reads();
        if format < 1 || format > reads {
            return Err(RepoError::FormatUnknown {
                requested: format,
                reads,
            });
        }
        match gate::switch(self, format).await? {
            Switch::Done(status) => Ok(status),
            Switch::Behind(behind) => Err(RepoError::FormatRefused {
                requested: format,
                behind: behind.iter().map(ToString::to_string).collect(),
            }),
        }
    }

    /// The stored format this store writes now (see `repo::format::gate`).
    pub(crate) async fn writes_format(&self) -> Result<i64, FormatError> {
        gate::writes(self).await
    }

    /// The newest stored format this store reads.
    pub(crate) fn reads_format(&self) -> i64 {
        self.inner.gate.reads()
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
    /// A collection whose tombstones are kept for good (an OBT collection's) is left alone.
    pub(crate) async fn purge_tombstones(
        &self,
        collection: &str,
        cutoff: DateTime,
    ) -> Result<u64, RepoError> {
        let fail =
            |operation| move |source| RepoError::database(collection, "*", operation, source);
        let registered = meta::read(&self.meta(), collection)
            .await
            .map_err(fail("read the collection registry"))?;
        if let Some(registered) = &registered {
            // Another release's newer format may keep other things in this collection.
            format::check(registered, self.reads_format(), META_COLLECTION, collection)?;
            if meta::keeps(registered) {
                return Ok(0);
            }
        }
        let writes = self.writes_format().await?;
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
        let raised = meta::raise_floor(&self.meta(), collection, highest, now, writes)
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
        // A transaction that inserted one of these ids and still has a record may still have a
        // copy of its create on its way; arriving before the deadline, it would count, and bring
        // the id back as that transaction's. Its tombstone stays until the record goes (after
        // the deadline, when a copy can only land stamped too late, and then never counts).
        let inserting = record::inserted_ids(self, collection)
            .await
            .map_err(fail("read the transaction records"))?;
        if !inserting.is_empty() {
            filter.insert("_id", doc! { "$nin": inserting });
        }
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

    /// Remembers whether `collection` compares strings by their bytes (see `open`).
    pub(crate) fn remember_binary_collation(&self, collection: &str, binary: bool) {
        self.inner
            .binary_collation
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(collection.to_string(), binary);
    }

    /// Whether `collection` is known to compare strings by their bytes; `false` when this store
    /// has not opened it (the careful answer: its strings are then checked byte for byte).
    pub(crate) fn binary_collation(&self, collection: &str) -> bool {
        self.inner
            .binary_collation
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(collection)
            .copied()
            .unwrap_or(false)
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

    /// Adopts the collection `spec` names: opens it as [`Store::repository`] does (registry,
    /// indexes, server validator) and stamps its plain documents as [`Repository::adopt`] does.
    /// A dry run opens nothing and writes nothing: it reads, checks and reports.
    pub async fn adopt(
        &self,
        spec: CollectionSpec,
        options: AdoptOptions,
    ) -> Result<AdoptReport, RepoError> {
        adopt::open_and_adopt(self, spec, options).await
    }

    /// Opens a typed repository: checks the definition, registers the collection, creates the
    /// system indexes and installs the server-side validator where supported. Idempotent.
    pub async fn repository<T>(&self, spec: CollectionSpec) -> Result<Repository<T>, RepoError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        open::repository(self, spec).await
    }
}
