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
//!   and every process: one `findAndModify` on the namespace's counter document, which also lifts
//!   the counter over the highest token stored in the namespace, so a counter deleted or restored
//!   from an old backup never hands out a token an OBT or a fence may hold. An OBT's own token
//!   only ever grows too: a preemption applies only over a lower token.
//! - A released OBT stays as a tombstone with its last owner and token: no copy of an earlier
//!   write delivered late can bring it back or act on it (a late create collides with it; every
//!   other write names an ownership it no longer has), and a release sent again after an error
//!   can tell its own release from another owner's.
//! - Leases without trusting clocks. An owner may hold a lease that it renews by heartbeat. A
//!   contender takes over either after it has itself seen the OBT unchanged for the whole lease on
//!   its own monotonic clock ([`Obt::observe`] then [`Obt::take_over`], the DynamoDB lock client's
//!   rule), or when the server's clock says the last heartbeat is older than the lease
//!   ([`Obt::take_over_expired`]). No wall clock of any caller is compared with another's; the
//!   latter compares the clocks of the server's nodes across a failover, within
//!   [`ObtOptions::clock_slack`].
//! - A heartbeat whose reply is lost is settled by sending it again and reading back, never by
//!   assuming it was lost or that it landed.
//! - Stages only move forward; a call with an older stage is a replay ([`ObtError::StageReplayed`]).
//! - Losing ownership ([`ObtError::is_lost_ownership`]) is told apart from the database being
//!   unreachable ([`ObtError::is_retryable`]).
//!
//! Every operation is one conditional write on the happy path (create and preempt also take a
//! token from the counter first). When the write matches nothing, the OBT is read to say why.
//!
//! Every method of [`Obt`] is declared in this file and delegates to `ops` (the operations),
//! `steps` (tokens, reads, the conditional write), `checks` (input checks, errors) or `report`
//! (the operator's view of an OBT, also read without opening the collection by [`inspect`]).

use crate::repo::open;

mod checks;
mod error;
mod fence;
mod model;
mod ops;
mod report;
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
use crate::txn::transaction::{Outcome, Transaction};

pub use error::{FenceError, ObtError};
pub use fence::{Fence, MemoryFence, MongoFence};
pub use model::{
    NewObt, Observation, ObtState, Ownership, Token, FENCES_SCHEMA, OBTS_SCHEMA, TOKENS_SCHEMA,
};
pub use report::{inspect, ObtReport};

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
    /// How far ahead the clock of the node that is primary for the OBT collection may be of the
    /// clock of the node that stamped an owner's last heartbeat, for
    /// [`take_over_expired`](Obt::take_over_expired): it takes over only after the lease plus
    /// this slack by the server's clock. A failover to a primary whose clock is `d` ahead
    /// shortens a silent owner's lease by `d` minus the slack when `d` is larger; a slack of at
    /// least `d` keeps the whole lease, and delays every take-over by the slack. At most
    /// [`MAX_LEASE`]. Default zero: trust the nodes' clocks to agree.
    pub clock_slack: Duration,
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
            clock_slack: Duration::ZERO,
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

    /// Sets [`clock_slack`](ObtOptions::clock_slack).
    pub fn clock_slack(mut self, slack: Duration) -> ObtOptions {
        self.clock_slack = slack;
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
    #[tracing::instrument(name = "mongotx.obt.open", skip_all)]
    pub async fn open(store: &Store) -> Result<Obt, ObtError> {
        Obt::with_options(store, ObtOptions::default()).await
    }

    /// Opens it with `options`. A collection name MongoDB refuses, or one that holds something
    /// else (the token counters, the default fences, the transaction records, the collection
    /// registry), is [`ObtError::Invalid`], before anything is created.
    #[tracing::instrument(name = "mongotx.obt.open", skip_all, fields(collection = %options.collection))]
    pub async fn with_options(store: &Store, options: ObtOptions) -> Result<Obt, ObtError> {
        let spec = Obt::spec(store, &options)?;
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
        let coll = protocol(&options.collection).await?;
        // The highest token of the namespace is read before each one is issued (the floor of a
        // counter that was lost or restored), and released OBTs stay as tombstones that keep
        // their last token: the GC must not purge them.
        let setup = |e| {
            ObtError::from(crate::repo::error::RepoError::database(
                &options.collection,
                "*",
                "open",
                e,
            ))
        };
        coll.create_index(
            mongodb::IndexModel::builder()
                .keys(bson::doc! { "token": -1 })
                .build(),
        )
        .await
        .map_err(setup)?;
        crate::repo::meta::keep_tombstones(&store.meta(), &options.collection)
            .await
            .map_err(setup)?;
        Ok(Obt {
            store: store.clone(),
            repo,
            coll,
            tokens: open::validated_protocol_collection(store, TOKENS_COLLECTION, TOKENS_SCHEMA)
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

    /// The definition of the OBT collection `options` name, after checking them.
    fn spec(store: &Store, options: &ObtOptions) -> Result<CollectionSpec, ObtError> {
        if let Some(reason) = collection_problem(store, &options.collection, OBTS_COLLECTION) {
            return Err(ObtError::Invalid {
                collection: shown(&options.collection),
                reason: format!("cannot keep OBTs there: {reason}"),
            });
        }
        if options.clock_slack > MAX_LEASE {
            return Err(ObtError::Invalid {
                collection: shown(&options.collection),
                reason: format!(
                    "clock slack {:?} is over the longest lease, {MAX_LEASE:?}",
                    options.clock_slack
                ),
            });
        }
        CollectionSpec::new(&options.collection, 1, OBTS_SCHEMA).map_err(|e| ObtError::Invalid {
            collection: options.collection.clone(),
            reason: format!("the built-in OBT schema is unusable: {e}"),
        })
    }

    /// A handle that opened nothing (no collection, index or validator made, nothing
    /// registered), for reading a database that must not change ([`inspect`]); never handed
    /// out, since its writes would go to collections nobody set up.
    pub(crate) fn unopened(store: &Store, options: ObtOptions) -> Result<Obt, ObtError> {
        let spec = Arc::new(Obt::spec(store, &options)?);
        let coll = store.database().collection::<Document>(&options.collection);
        Ok(Obt {
            store: store.clone(),
            repo: Repository::new(store.clone(), spec, coll.clone()),
            coll,
            tokens: store.database().collection(TOKENS_COLLECTION),
            options: Arc::new(options),
        })
    }

    /// The options in force.
    pub fn options(&self) -> &ObtOptions {
        &self.options
    }

    /// What an operator asks about OBT `id`: its owner, stage and token, its lease by the
    /// server's clock (until when, how long left), the transaction holding it if one does, or,
    /// once released, the tombstone: who released it, when, and its last token.
    pub async fn report(&self, id: &str) -> Result<ObtReport, ObtError> {
        report::report(self, id).await
    }

    /// Creates OBT `id` owned by `new.owner` at stage 0 with a fresh token: one upsert that
    /// inserts it, or takes the place of a released OBT of that id with a lower token, and never
    /// changes a live one, stamped with the server's time. Sending the same create again after a
    /// lost reply returns the same ownership; an id that is taken is [`ObtError::Exists`]. A copy
    /// of it delivered late, after the OBT was preempted or released, changes nothing.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(obts: mongotx::obt::Obt) -> Result<(), mongotx::obt::ObtError> {
    /// use std::time::Duration;
    /// use mongotx::obt::NewObt;
    ///
    /// let new = NewObt::new("volume-7", "server-a").lease(Duration::from_secs(30));
    /// let mut owned = obts.create(new).await?;
    /// // Carry owned.token() to every downstream write (see `Fence`), renew the lease while
    /// // working, and move through the stages of the operation.
    /// obts.heartbeat(&mut owned).await?;
    /// obts.advance_owned(&mut owned, 1).await?;
    /// obts.release_owned(&owned).await?;
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(name = "mongotx.obt.create", skip_all, fields(obt = %new.id, owner = %new.owner))]
    pub async fn create(&self, new: NewObt) -> Result<Ownership, ObtError> {
        ops::create(self, new).await
    }

    /// Preemption as in the reference design: takes OBT `id` from `current_owner` (who must own
    /// it now) for `new_owner`, with a new token. No waiting: the previous owner is fenced off
    /// from here on.
    #[tracing::instrument(name = "mongotx.obt.preempt", skip_all, fields(obt = id, owner = current_owner, new_owner = new_owner))]
    pub async fn preempt(
        &self,
        id: &str,
        current_owner: &str,
        new_owner: &str,
    ) -> Result<Ownership, ObtError> {
        ops::preempt(self, id, current_owner, new_owner).await
    }

    /// Takes over an OBT whose owner this process has seen silent for its whole lease on its own
    /// monotonic clock: `observed` must be at least the lease old, and the OBT must be exactly as
    /// observed (no heartbeat, stage change or other owner since). Never compares wall clocks.
    /// The lease counted is the committed OBT's, whatever the observation says.
    #[tracing::instrument(name = "mongotx.obt.take_over", skip_all, fields(obt = %observed.state.id, owner = %observed.state.owner, new_owner = new_owner))]
    pub async fn take_over(
        &self,
        observed: &Observation,
        new_owner: &str,
    ) -> Result<Ownership, ObtError> {
        ops::take_over(self, observed, new_owner).await
    }

    /// Takes over an OBT whose last heartbeat is older than its lease (plus
    /// [`clock_slack`](ObtOptions::clock_slack)) by the server's clock: the write itself carries
    /// the condition (`beat_at <= $$NOW - lease - clock_slack`), so no caller's clock is
    /// involved. The stamp is the clock of the node that took the heartbeat, `$$NOW` that of the
    /// node that is primary now: after a failover to a node whose clock is `d` ahead, a silent
    /// owner's lease is shortened by `d` less the slack (its token still fences it).
    /// [`take_over`](Obt::take_over) compares no clocks.
    #[tracing::instrument(name = "mongotx.obt.take_over_expired", skip_all, fields(obt = id, new_owner = new_owner))]
    pub async fn take_over_expired(
        &self,
        id: &str,
        new_owner: &str,
    ) -> Result<Ownership, ObtError> {
        ops::take_over_expired(self, id, new_owner).await
    }

    /// Renews the lease: one conditional write (this owner, this token). A reply that is lost is
    /// settled by sending it again and reading back; a preempted owner gets
    /// [`ObtError::Preempted`].
    #[tracing::instrument(name = "mongotx.obt.heartbeat", skip_all, fields(obt = %owned.id, owner = %owned.owner, token = owned.token.0))]
    pub async fn heartbeat(&self, owned: &mut Ownership) -> Result<(), ObtError> {
        ops::heartbeat(self, owned).await
    }

    /// Moves OBT `id` of `owner` forward to `stage`. The same stage again is a no-op (a retry); an
    /// older one is [`ObtError::StageReplayed`].
    #[tracing::instrument(name = "mongotx.obt.advance", skip_all, fields(obt = id, owner = owner, stage = stage))]
    pub async fn advance(&self, id: &str, owner: &str, stage: i64) -> Result<ObtState, ObtError> {
        ops::advance(self, id, owner, stage).await
    }

    /// Moves this ownership's OBT forward to `stage`, conditioned on the token as well as the
    /// owner, so no late copy can move a later OBT of the same id and owner name.
    #[tracing::instrument(name = "mongotx.obt.advance_owned", skip_all, fields(obt = %owned.id, owner = %owned.owner, token = owned.token.0, stage = stage))]
    pub async fn advance_owned(&self, owned: &mut Ownership, stage: i64) -> Result<(), ObtError> {
        ops::advance_owned(self, owned, stage).await
    }

    /// Releases OBT `id`, which `owner` must own: the reference design's delete call, which
    /// identifies the owner by name only. The OBT then reads as gone ([`ObtError::NotFound`]);
    /// its document stays as a tombstone keeping `owner` and its last token. A release sent again
    /// after an error succeeds only if its own earlier send released the OBT. A release delivered
    /// late could release a later OBT of the same id and owner name; owners that reuse names
    /// should use [`release_owned`](Obt::release_owned).
    #[tracing::instrument(name = "mongotx.obt.release", skip_all, fields(obt = id, owner = owner))]
    pub async fn release(&self, id: &str, owner: &str) -> Result<(), ObtError> {
        ops::release(self, id, owner).await
    }

    /// Releases the OBT this ownership holds (owner and token), so that no copy of the release
    /// can release a later OBT of the same id, and a release sent again after an error succeeds
    /// only if this ownership's own release landed.
    #[tracing::instrument(name = "mongotx.obt.release_owned", skip_all, fields(obt = %owned.id, owner = %owned.owner, token = owned.token.0))]
    pub async fn release_owned(&self, owned: &Ownership) -> Result<(), ObtError> {
        ops::release_owned(self, owned).await
    }

    // ----- the database fence -----

    /// Commits `tx` only if `owned` still owns its OBT at the commit point: the transaction
    /// carries a guard on the OBT (this owner, this token) that holds it until the transaction
    /// ends, so a preemption either happens before (the commit writes nothing and fails
    /// [`ObtError::Preempted`]) or waits until after. Heartbeats and stage changes by the owner
    /// itself do not break the guard.
    ///
    /// An ownership already lost when the call is made is refused after one read of the OBT,
    /// before the commit starts: the commit would otherwise write a transaction record and hold
    /// the transaction's documents, only to roll them back at the guard.
    #[tracing::instrument(name = "mongotx.obt.commit_owned", skip_all, fields(obt = %owned.id, owner = %owned.owner, token = owned.token.0))]
    pub async fn commit_owned(
        &self,
        tx: Transaction,
        owned: &Ownership,
    ) -> Result<Outcome, ObtError> {
        ops::commit_owned(self, tx, owned).await
    }

    // ----- tokens -----

    /// Issues the namespace's next fencing token: a read of the highest token stored in the
    /// namespace's OBTs, then one `findAndModify` setting the counter to the greater of the two
    /// plus one. Strictly greater than every token issued before it in this namespace, by any
    /// process, and than every token an OBT holds even if the counter was deleted or restored
    /// from an old backup. A token whose reply was lost is simply never used, and neither is one
    /// taken by a call that a racing call beat (tokens may have gaps: fencing needs them to
    /// grow, not to be dense). A call whose input is wrong (a taken id, a missing OBT, another
    /// owner, no lease, a lease still running, an observation the OBT has moved past) is refused
    /// before it takes one.
    #[tracing::instrument(name = "mongotx.obt.issue_token", skip_all)]
    pub async fn issue_token(&self) -> Result<Token, ObtError> {
        steps::issue_token(self).await
    }

    /// The OBT as committed now.
    #[tracing::instrument(name = "mongotx.obt.get", skip_all, fields(obt = id))]
    pub async fn get(&self, id: &str) -> Result<ObtState, ObtError> {
        steps::get(self, id).await
    }

    /// Reads the OBT as a contender: the start of its own count towards a
    /// [`take_over`](Obt::take_over).
    #[tracing::instrument(name = "mongotx.obt.observe", skip_all, fields(obt = id))]
    pub async fn observe(&self, id: &str) -> Result<Observation, ObtError> {
        steps::observe(self, id).await
    }

    /// Checks a call made under the OBT (the `t_id`, `t_owner` and `t_stage` that the reference
    /// design's HTTP interface passes with every call): `owner` owns it and `stage` is not older
    /// than its stage. Returns the OBT, whose token the call then carries to downstream fences.
    #[tracing::instrument(name = "mongotx.obt.check", skip_all, fields(obt = id, owner = owner, stage = stage))]
    pub async fn check(&self, id: &str, owner: &str, stage: i64) -> Result<ObtState, ObtError> {
        steps::check(self, id, owner, stage).await
    }
}

pub(crate) use crate::repo::names::{collection_problem, name_problem, shown};
