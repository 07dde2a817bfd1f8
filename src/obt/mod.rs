//! Owner-based transactions (OBT): one owner at a time for a long operation on one resource,
//! and two fences that stop an owner who lost it from doing harm.
//!
//! # The reference design
//!
//! OBTs come from a storage volume manager, whose API servers use them to keep concurrent
//! requests from acting on the same volume. An OBT is a record `(id, owner, stage, token)`. A
//! caller creates it before operating on a resource, passes `id`, `owner` and `stage` with every
//! call, and deletes it at the end. Another caller takes it over by *preempting* it, naming the
//! owner it replaces. Two fences keep the old owner, which may only be slow, from interfering
//! afterwards:
//!
//! 1. **Downstream**: every call to a downstream resource carries the ownership's token; the
//!    resource remembers the highest token it has admitted and refuses lower ones ([`Fence`]).
//! 2. **Database**: the owner's database writes succeed only while it still owns the OBT. Here an
//!    *owned transaction* ([`Obt::commit_owned`]) carries a guard on the OBT (this owner, this
//!    token) that is checked at the commit point and holds the OBT until the transaction ends,
//!    so a preempted owner's commit writes nothing and fails [`ObtError::Preempted`].
//!
//! # What this adds
//!
//! - Tokens are unique and strictly increasing across every OBT of a namespace (one collection)
//!   and every process: one `findAndModify` `$inc` on the namespace's counter document. An OBT's
//!   own token only ever grows too: a preemption applies only over a lower token.
//! - Leases without trusting clocks. An owner may hold a lease that it renews by heartbeat. A
//!   contender takes over either after it has itself seen the OBT unchanged for the whole lease on
//!   its own monotonic clock ([`Obt::observe`] then [`Obt::take_over`], the DynamoDB lock client's
//!   rule), or when the server's clock says the last heartbeat is older than the lease
//!   ([`Obt::take_over_expired`]). No wall clock of any caller is compared with another's.
//! - A heartbeat whose reply is lost is settled by sending it again and reading back, never by
//!   assuming it was lost or that it landed.
//! - Stages only move forward; a call with an older stage is a replay ([`ObtError::StageReplayed`]).
//! - Losing ownership ([`ObtError::is_lost_ownership`]) is told apart from the database being
//!   unreachable ([`ObtError::is_retryable`]).
//!
//! Every operation is one conditional write on the happy path (create and preempt also take a
//! token from the counter first). When the write matches nothing, the OBT is read to say why.

mod checks;
mod error;
mod fence;
mod model;
mod ops;
mod steps;

use std::sync::Arc;
use std::time::Duration;

use bson::Document;
use mongodb::Collection;

use crate::collections::{OBTS_COLLECTION, TOKENS_COLLECTION};
use crate::repo::collection::CollectionSpec;
use crate::repo::repository::Repository;
use crate::repo::store::Store;
use crate::retry::LockWait;

pub use error::{FenceError, ObtError};
pub use fence::{Fence, MemoryFence, MongoFence};
pub use model::{
    NewObt, Observation, ObtState, Ownership, Token, FENCES_SCHEMA, OBTS_SCHEMA, TOKENS_SCHEMA,
};

use model::ObtDoc;

/// The longest lease an OBT may carry.
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 3600);

/// How an [`Obt`] handle behaves.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ObtOptions {
    /// The collection of OBTs; each collection is a namespace with its own token counter.
    pub collection: String,
    /// How long an operation waits for an owned transaction's guard on the OBT to go away (it is
    /// normally held for one commit), and how it backs off meanwhile.
    pub retry: LockWait,
}

impl Default for ObtOptions {
    fn default() -> ObtOptions {
        ObtOptions {
            collection: OBTS_COLLECTION.to_string(),
            retry: LockWait {
                max_wait: Duration::from_secs(20),
                initial_backoff: Duration::from_millis(1),
                max_backoff: Duration::from_millis(50),
            },
        }
    }
}

impl ObtOptions {
    /// Sets [`collection`](ObtOptions::collection).
    pub fn collection(mut self, name: impl Into<String>) -> ObtOptions {
        self.collection = name.into();
        self
    }

    /// Sets [`retry`](ObtOptions::retry).
    pub fn retry(mut self, retry: LockWait) -> ObtOptions {
        self.retry = retry;
        self
    }
}

/// The OBT handle: cheap to clone, shared by all tasks of a process.
///
/// ```no_run
/// # async fn demo(store: mongotx::Store) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use mongotx::obt::{Fence, MemoryFence, NewObt, Obt};
///
/// let obts = Obt::open(&store).await?;
/// let mut owned = obts.create(NewObt::new("attach/dlv0", "api-1").lease(Duration::from_secs(10))).await?;
/// let node = MemoryFence::new(); // a storage node's fence
/// node.admit("dlv0", owned.token).await?; // every downstream call carries the token
/// obts.heartbeat(&mut owned).await?;
/// obts.advance("attach/dlv0", "api-1", 1).await?;
/// obts.release("attach/dlv0", "api-1").await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Obt {
    store: Store,
    repo: Repository<ObtDoc>,
    /// The OBT collection with the store's protocol concerns (majority on replica sets): an
    /// acknowledged ownership change must survive a failover.
    coll: Collection<Document>,
    /// The token counters, likewise: a token acknowledged and then rolled back could be issued
    /// twice.
    tokens: Collection<Document>,
    options: Arc<ObtOptions>,
}

impl Obt {
    /// Opens the default OBT collection in `store`'s database.
    pub async fn open(store: &Store) -> Result<Obt, ObtError> {
        Obt::with_options(store, ObtOptions::default()).await
    }

    /// Opens it with `options`. A collection name MongoDB refuses, or one that holds something
    /// else (the token counters, the default fences, the transaction records, the collection
    /// registry), is [`ObtError::Invalid`], before anything is created.
    pub async fn with_options(store: &Store, options: ObtOptions) -> Result<Obt, ObtError> {
        if let Some(reason) = collection_problem(store, &options.collection, OBTS_COLLECTION) {
            return Err(ObtError::Invalid {
                collection: shown(&options.collection),
                reason: format!("cannot keep OBTs there: {reason}"),
            });
        }
        let spec = CollectionSpec::new(&options.collection, 1, OBTS_SCHEMA).map_err(|e| {
            ObtError::Invalid {
                collection: options.collection.clone(),
                reason: format!("the built-in OBT schema is unusable: {e}"),
            }
        })?;
        let repo = store.repository::<ObtDoc>(spec).await?;
        let protocol = |name: &str| {
            let name = name.to_string();
            async move {
                store.protocol_collection(&name).await.map_err(|e| {
                    ObtError::from(crate::repo::error::RepoError::database(
                        &name, "*", "open", e,
                    ))
                })
            }
        };
        Ok(Obt {
            store: store.clone(),
            repo,
            coll: protocol(&options.collection).await?,
            tokens: store
                .validated_protocol_collection(TOKENS_COLLECTION, TOKENS_SCHEMA)
                .await
                .map_err(|e| {
                    ObtError::from(crate::repo::error::RepoError::database(
                        TOKENS_COLLECTION,
                        "*",
                        "open",
                        e,
                    ))
                })?,
            options: Arc::new(options),
        })
    }

    /// The options in force.
    pub fn options(&self) -> &ObtOptions {
        &self.options
    }
}

pub(crate) use crate::repo::names::{collection_problem, name_problem, shown};
