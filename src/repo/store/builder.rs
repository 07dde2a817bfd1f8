//! [`StoreBuilder`]: a store with non-default settings.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mongodb::Database;
use tokio::sync::OnceCell;

use crate::repo::background::Background;
use crate::repo::contention::tally::Tally;
use crate::repo::format::state::Gate;
use crate::repo::store::handle::{
    HoldResolver, RecordResolver, ServerValidation, Store, StoreInner,
};
use crate::retry::LockWait;
use crate::server::clock::{Durability, ServerClock};

/// Builds a [`Store`] with non-default settings.
pub struct StoreBuilder {
    pub(super) db: Database,
    pub(super) lock_wait: LockWait,
    pub(super) resolver: Option<Arc<dyn HoldResolver>>,
    pub(super) txns_collection: String,
    pub(super) validation: ServerValidation,
    pub(super) check_server: bool,
    pub(super) durability: Durability,
    pub(super) clock_resample: Duration,
    pub(super) floor_grace: Duration,
    pub(super) batch_writes: bool,
    pub(super) contention: bool,
    pub(super) contention_every: Duration,
    pub(super) format_refresh: Duration,
    pub(super) reads_format: i64,
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
    /// server that lacks one is refused with [`RepoError::ServerUnsuitable`], whose message is
    /// the sentence `mongotx-probe`'s verdict prints for it, before anything is written. The
    /// verdict runs these checks and more, the single-document atomicity under contention among
    /// them: run it once against a deployment.
    ///
    /// [`RepoError::ServerUnsuitable`]: crate::repo::error::RepoError::ServerUnsuitable
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

    /// Sets whether the store keeps the contention record (default: yes): it counts the version
    /// conflicts and aborted transaction attempts it meets per collection, with a sample of the
    /// documents involved, and adds them now and then (see
    /// [`contention_flush_every`](StoreBuilder::contention_flush_every)) to the
    /// [`CONTENTION_COLLECTION`](crate::collections::CONTENTION_COLLECTION) it shares with every
    /// other instance, where [`admin::contention`](crate::admin::contention) and `mongotx
    /// contention` read which collections and documents conflict most. On by default because
    /// contention is looked for during an incident, too late to switch a record on; it writes
    /// nothing while nothing conflicts. Off, nothing is counted or written.
    pub fn contention_record(mut self, keep: bool) -> StoreBuilder {
        self.contention = keep;
        self
    }

    /// Sets the shortest time between two writes of the contention record by this store
    /// (default 5 s): what it counts meanwhile goes in one write per collection.
    /// [`Store::shutdown`](crate::Store::shutdown) writes what is pending at once.
    pub fn contention_flush_every(mut self, every: Duration) -> StoreBuilder {
        self.contention_every = every;
        self
    }

    /// Sets how often, at most, the store reads which stored format the database writes and
    /// renews its announcement of the formats it reads (default 10 s; see
    /// [`Store::set_format`](crate::Store::set_format)). An announcement stays live for six of
    /// these intervals.
    pub fn format_refresh(mut self, every: Duration) -> StoreBuilder {
        self.format_refresh = every.max(Duration::from_millis(10));
        self
    }

    /// Plays a version of mongotx that reads stored formats up to `format` (above
    /// [`FORMAT`](crate::format::FORMAT), a future one: it announces so, may switch the database
    /// to it, and then marks what it writes with it), so that a test can check what this version
    /// does with a newer format's records and documents.
    #[cfg(feature = "testkit")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
    pub fn plays_format(mut self, format: i64) -> StoreBuilder {
        self.reads_format = format.max(1);
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
                binary_collation: Mutex::new(HashMap::new()),
                batch_writes: AtomicBool::new(self.batch_writes),
                specs: Mutex::new(HashMap::new()),
                pending_validators: Mutex::new(BTreeMap::new()),
                background: Background::default(),
                contention: Tally::new(self.contention, self.contention_every),
                gate: Gate::new(self.reads_format, self.format_refresh),
            }),
        }
    }
}
