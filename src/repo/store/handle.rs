//! What a [`Store`] is made of: the handle and the state its clones share, the server-validation
//! setting, and the one seam between the repository layer and the transaction layer,
//! [`HoldResolver`] (by default [`RecordResolver`]). The store's methods are all in `store/mod.rs`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bson::{doc, oid::ObjectId, DateTime, Document};
use mongodb::Database;
use tokio::sync::OnceCell;

use crate::repo::background::Background;
use crate::repo::collection::CollectionSpec;
use crate::repo::contention::tally::Tally;
use crate::repo::format::state::Gate;
use crate::repo::meta::CachedFloor;
use crate::repo::outcome::{HoldError, TxnStatus};
use crate::retry::LockWait;
use crate::server::clock::{Durability, ServerClock, Topology};
use crate::server::semantics::Semantic;

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
/// let spec = CollectionSpec::new("accounts", 1, include_str!("../../../schemas/accounts.json"))?;
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
    pub(super) txns_collection: String,
    pub(crate) validation: ServerValidation,
    pub(crate) validator_support: OnceCell<bool>,
    pub(crate) check_server: bool,
    /// What the server check found, once it could ask the server (an unreachable server is
    /// asked again next time).
    pub(crate) server_checked: OnceCell<Result<(), Semantic>>,
    pub(super) durability: Durability,
    pub(super) topology: OnceCell<Topology>,
    pub(super) clock: ServerClock,
    pub(super) floor_refresh: Duration,
    pub(super) floor_grace: Duration,
    pub(super) floors: Mutex<HashMap<String, CachedFloor>>,
    /// The unique-index paths of each collection that tombstones mark (see `hold::tombstone`).
    pub(crate) markers: Mutex<HashMap<String, Arc<Vec<String>>>>,
    /// When this process first met a hold of each transaction whose record was absent.
    pub(super) absent_since: Mutex<HashMap<bson::oid::ObjectId, Instant>>,
    /// The collections known to compare strings by bytes (no default collation), by name.
    pub(super) binary_collation: Mutex<HashMap<String, bool>>,
    /// Whether a round of writes goes as one `bulkWrite`: the setting, until the server turns out
    /// not to have the command.
    pub(super) batch_writes: AtomicBool,
    /// The definition of each collection this store has opened or staged changes on, for the
    /// protocol steps that stamp a plain document they meet (see `repo::plain`).
    pub(super) specs: Mutex<HashMap<String, Arc<CollectionSpec>>>,
    /// The background finishes of transactions committed through this store, and the flushes
    /// of its contention record.
    pub(crate) background: Background,
    /// What this store counted for the contention record since its last flush.
    pub(crate) contention: Tally,
    /// Validators this store could not install for lack of privileges, by collection: the
    /// command an administrator runs.
    pub(super) pending_validators: Mutex<BTreeMap<String, Document>>,
    /// This store's part in the stored format's gate (see `repo::format::gate`).
    pub(crate) gate: Gate,
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
