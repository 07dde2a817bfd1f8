//! Quotas shared by every instance of a service: providers with limits, consumption recorded per
//! consumer, all-or-nothing across providers, hierarchies, and reservations that expire.
//!
//! # Design
//!
//! A provider (scope, resource) is one document in [`PROVIDERS_COLLECTION`] holding its limit,
//! its usage, `available = limit - usage`, and one entry per (consumer, request) that holds part
//! of it; once those entries outgrow one document it is spread over several, each with a share
//! of the limit (`stripes`, whose doc says how). Its document version (the sum of its documents'
//! versions) is its *generation*: every change bumps it, so a reader that sees the same
//! generation twice knows nothing changed. This is the generation id of the reference
//! design, a proposal for ordering concurrent quota consumptions with a per-provider counter that
//! only grows.
//!
//! **That design's algorithm** (read availability and generation, write only if the generation is
//! unchanged, otherwise re-read and retry) is how every change that spans several providers is
//! made: the decision is computed from what was read (`decide`), and the writes go through the
//! transaction layer, each conditional on the generation read, so they land all together or not
//! at all. A child provider lists its ancestors; consuming from it consumes the same amount from
//! each of them, and the entry is mirrored in each, so an ancestor's usage is always its own
//! allocations plus its descendants'.
//!
//! **Beyond it**: a consume from a single provider without a parent is one conditional update
//! whose condition is the decision itself (`available >= amount`, this request not already
//! recorded, the document not held by a transaction). Two consumers writing the same provider
//! both succeed while the limit allows both; no one retries because someone else wrote. The
//! update still bumps the generation.
//!
//! **Idempotency**: the entry's key is (consumer, request id), so a request sent twice counts
//! once. Each send carries a deadline the server checks (`$$NOW`), so a copy delivered late
//! cannot land after it; a request that may have a copy in flight stores that deadline in its
//! entry, and releasing it keeps the entry at 0 until the deadline passes, so a late copy finds
//! it and does nothing.
//!
//! **Reservations** are entries with an expiry in server time. They count as usage until they
//! are confirmed (the expiry is removed), cancelled, or expire; only the GC's sweep
//! ([`Quota::sweep`], run by `mongotx-gc`) returns an expired one, so a caller's clock never
//! decides. Confirming one that has expired is [`QuotaError::ReservationExpired`] and changes
//! nothing.
//!
//! Every method of [`Quota`] is declared in this file and delegates: consuming and reserving to
//! `consume`, giving back to `release`, the provider operations to `providers`, reading providers
//! and writing decisions to `access`, the operator's report to `report` (which also reads a
//! provider without opening the collection, [`inspect`]); the decisions themselves are
//! `decide`'s, free of I/O.

mod access;
mod consume;
mod decide;
mod error;
mod model;
mod ops;
mod providers;
mod release;
mod report;
mod stripes;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::field::Empty;
use tracing::Span;

use crate::collections::PROVIDERS_COLLECTION;
use crate::repo::collection::CollectionSpec;
use crate::repo::repository::Repository;
use crate::repo::store::Store;
use crate::retry::LockWait;
use crate::txn::failpoint::Faults;
use crate::txn::transaction::{Finish, Transactions, TxnOptions};

pub use error::{QuotaError, Refusal};
pub use model::{
    Allocation, Consumed, NewProvider, Provider, ProviderId, Released, Request, Reservation,
    SweepSummary, PROVIDERS_SCHEMA,
};
pub use report::{inspect, ProviderReport, ReservationReport, StripeReport};

use model::ProviderDoc;

/// Failpoints of the quota module (consulted through [`QuotaOptions::fault_injector`], which
/// also reaches the transaction layer's own failpoints on multi-provider changes).
#[cfg(feature = "testkit")]
#[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
pub mod failpoint {
    pub use crate::txn::failpoint::{
        QUOTA_CONSUME_AFTER as CONSUME_AFTER, QUOTA_RESERVE_AFTER as RESERVE_AFTER,
    };
    /// Every quota failpoint name.
    pub const ALL: &[&str] = &[RESERVE_AFTER, CONSUME_AFTER];
}

/// Lock stripes of a handle (see `Quota::stripes`).
const STRIPES: usize = 64;

/// How a [`Quota`] handle behaves.
#[derive(Clone)]
#[non_exhaustive]
pub struct QuotaOptions {
    /// The longest a single send of a consume may take to reach the server; a copy arriving
    /// later is refused by the server. It is also how long a released request that may have had
    /// a copy in flight is remembered.
    pub send_window: Duration,
    /// How long the generation-checked path keeps re-reading and retrying under contention
    /// before [`QuotaError::Contended`], and how it backs off meanwhile.
    pub retry: LockWait,
    /// Deadline of the transactions that change several providers at once.
    pub txn_timeout: Duration,
    pub(crate) faults: crate::txn::failpoint::Injector,
}

impl Default for QuotaOptions {
    fn default() -> QuotaOptions {
        QuotaOptions {
            send_window: Duration::from_secs(30),
            retry: LockWait {
                max_wait: Duration::from_secs(20),
                initial_backoff: Duration::from_millis(1),
                max_backoff: Duration::from_millis(50),
            },
            txn_timeout: Duration::from_secs(10),
            faults: Default::default(),
        }
    }
}

impl std::fmt::Debug for QuotaOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuotaOptions")
            .field("send_window", &self.send_window)
            .field("retry", &self.retry)
            .field("txn_timeout", &self.txn_timeout)
            .field("faults", &crate::txn::failpoint::installed(&self.faults))
            .finish()
    }
}

impl QuotaOptions {
    /// Sets [`send_window`](QuotaOptions::send_window).
    pub fn send_window(mut self, window: Duration) -> QuotaOptions {
        self.send_window = window;
        self
    }

    /// Sets [`retry`](QuotaOptions::retry).
    pub fn retry(mut self, retry: LockWait) -> QuotaOptions {
        self.retry = retry;
        self
    }

    /// Sets [`txn_timeout`](QuotaOptions::txn_timeout).
    pub fn txn_timeout(mut self, timeout: Duration) -> QuotaOptions {
        self.txn_timeout = timeout;
        self
    }

    #[cfg(feature = "testkit")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
    /// Installs a fault injector (tests): consulted at the quota [`failpoint`]s and at the
    /// transaction layer's.
    pub fn fault_injector(
        mut self,
        injector: std::sync::Arc<dyn crate::txn::failpoint::FaultInjector>,
    ) -> QuotaOptions {
        self.faults = Some(injector);
        self
    }

    /// Refuses options that make no sense, with [`QuotaError::InvalidOption`]:
    ///
    /// - `send_window`, `txn_timeout` and `retry.max_wait` must be from 1 ms to one day: times
    ///   are kept in whole milliseconds (a zero window would refuse every send), and a day
    ///   already keeps released requests, stuck transactions or retrying callers far too long;
    /// - `retry.initial_backoff` must be positive (zero is a busy loop against the server) and
    ///   at most `retry.max_backoff`, itself at most `retry.max_wait`.
    pub fn validate(&self) -> Result<(), QuotaError> {
        const DAY: Duration = Duration::from_secs(24 * 3600);
        const MS: Duration = Duration::from_millis(1);
        let invalid = |option: &'static str, value: Duration, reason: String| {
            Err(QuotaError::InvalidOption {
                option,
                value: format!("{value:?}"),
                reason,
            })
        };
        for (option, value) in [
            ("send_window", self.send_window),
            ("txn_timeout", self.txn_timeout),
            ("retry.max_wait", self.retry.max_wait),
        ] {
            if value < MS || value > DAY {
                return invalid(option, value, "it must be from 1 ms to one day".into());
            }
        }
        let retry = &self.retry;
        if retry.initial_backoff.is_zero() {
            return invalid(
                "retry.initial_backoff",
                retry.initial_backoff,
                "a zero backoff retries in a busy loop".into(),
            );
        }
        if retry.max_backoff < retry.initial_backoff {
            return invalid(
                "retry.max_backoff",
                retry.max_backoff,
                format!(
                    "it is shorter than retry.initial_backoff ({:?})",
                    retry.initial_backoff
                ),
            );
        }
        if retry.max_backoff > retry.max_wait {
            return invalid(
                "retry.max_backoff",
                retry.max_backoff,
                format!(
                    "it is longer than the whole budget, retry.max_wait ({:?})",
                    retry.max_wait
                ),
            );
        }
        Ok(())
    }
}

/// The quota handle: cheap to clone, shared by all tasks of a process.
///
/// ```no_run
/// # async fn demo(store: mongotx::Store) -> Result<(), mongotx::quota::QuotaError> {
/// use mongotx::quota::{NewProvider, Quota, Request};
///
/// let quota = Quota::open(&store).await?;
/// quota.create(NewProvider::new(("domain/7", "cores"), 64)).await?;
/// quota.create(NewProvider::new(("project/42", "cores"), 16).parent(("domain/7", "cores"))).await?;
///
/// let request = Request::new("vm-1").take(("project/42", "cores"), 4);
/// quota.consume(&request).await?; // a retry of the same request counts once
/// let released = quota.release("vm-1").await?;
/// assert_eq!(released.returned.len(), 2); // the project and its domain
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Quota {
    store: Store,
    repo: Repository<ProviderDoc>,
    txns: Transactions,
    options: QuotaOptions,
    faults: Faults,
    /// Providers known to have a parent (parents never change), so their consumes skip the
    /// single-provider write that could not match.
    with_parent: Arc<Mutex<HashSet<ProviderId>>>,
    /// The layouts of the striped providers this handle has met (see `stripes`); a provider
    /// not here is addressed as one document, and a stale layout is found out by the write.
    layouts: Arc<Mutex<HashMap<ProviderId, Arc<stripes::Layout>>>>,
    /// Generation-checked changes of one process that touch the same providers would only make
    /// each other retry (they all read a generation that the first writer then moves); they queue
    /// here instead, by stripes of provider ids taken in order. Only an optimisation: processes
    /// still race, and the generation check keeps that correct.
    stripes: Arc<Vec<Arc<tokio::sync::Mutex<()>>>>,
}

impl std::fmt::Debug for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quota")
            .field("collection", &PROVIDERS_COLLECTION)
            .field("options", &self.options)
            .finish()
    }
}

impl Quota {
    /// Opens the quota collection in `store`'s database (creating it and its indexes if needed).
    #[tracing::instrument(name = "mongotx.quota.open", skip_all)]
    pub async fn open(store: &Store) -> Result<Quota, QuotaError> {
        Quota::with_options(store, QuotaOptions::default()).await
    }

    /// Opens it with `options`, refused first if they make no sense
    /// ([`QuotaOptions::validate`]).
    #[tracing::instrument(name = "mongotx.quota.open", skip_all)]
    pub async fn with_options(store: &Store, options: QuotaOptions) -> Result<Quota, QuotaError> {
        options.validate()?;
        let repo = store.repository::<ProviderDoc>(Quota::spec()?).await?;
        let quota = Quota::assemble(store, repo, options);
        ops::create_indexes(&quota).await?;
        Ok(quota)
    }

    /// The providers' collection definition. Version 2 adds stripes (`stripes`); a version 1
    /// provider is a version 2 provider of one stripe, and the bump keeps a handle of an older
    /// release, which would see only stripe 0, from writing a striped one.
    fn spec() -> Result<CollectionSpec, QuotaError> {
        CollectionSpec::new(PROVIDERS_COLLECTION, 2, PROVIDERS_SCHEMA)
            .map(|spec| spec.upgrade(1, Ok))
            .map_err(|e| QuotaError::InvalidRequest {
                reason: format!("the built-in provider schema is unusable: {e}"),
            })
    }

    /// A handle that opened nothing (no collection, index or validator made), for reading a
    /// database that must not change ([`inspect`]); its writes would go to a collection nobody
    /// set up, so it is never handed out.
    pub(crate) fn unopened(store: &Store) -> Result<Quota, QuotaError> {
        let coll = store.database().collection(PROVIDERS_COLLECTION);
        let repo = Repository::new(store.clone(), Arc::new(Quota::spec()?), coll);
        Ok(Quota::assemble(store, repo, QuotaOptions::default()))
    }

    /// The handle over `repo`, with no I/O.
    fn assemble(store: &Store, repo: Repository<ProviderDoc>, options: QuotaOptions) -> Quota {
        // Providers are hot documents, shared by every consumer: returning before the finish
        // gains nothing there (the next consumer would meet the hold and finish it itself), and
        // a consume that returns with its providers free keeps their usage readable raw.
        let mut txn_options = TxnOptions::default()
            .timeout(options.txn_timeout)
            .retry(options.retry)
            .finish(Finish::BeforeReturning);
        txn_options.faults = options.faults.clone();
        Quota {
            store: store.clone(),
            txns: Transactions::with_options(store, txn_options),
            faults: Faults::new(options.faults.clone()),
            repo,
            options,
            with_parent: Arc::new(Mutex::new(HashSet::new())),
            layouts: Arc::new(Mutex::new(HashMap::new())),
            stripes: Arc::new(
                (0..STRIPES)
                    .map(|_| Arc::new(tokio::sync::Mutex::new(())))
                    .collect(),
            ),
        }
    }

    /// The options in force.
    pub fn options(&self) -> &QuotaOptions {
        &self.options
    }

    /// Takes the request's amounts from its providers and their ancestors, all or nothing, and
    /// records them under the request's consumer. Applying the same request again (a retry after
    /// a lost reply) counts once and returns `replayed`.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(quota: mongotx::quota::Quota) -> Result<(), mongotx::quota::QuotaError> {
    /// use mongotx::quota::{ProviderId, Request};
    ///
    /// let cores = ProviderId::new("team-a", "cores");
    /// // An id the caller keeps: the same request sent again after a lost reply counts once.
    /// let request = Request::with_id("job-7", "job-7-start").take(cores, 4);
    /// let consumed = quota.consume(&request).await?;
    /// println!("replayed: {}", consumed.replayed);
    /// quota.release("job-7").await?; // every unit job-7 holds goes back
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(name = "mongotx.quota.consume", skip_all, fields(consumer = %request.consumer, request = %request.id))]
    pub async fn consume(&self, request: &Request) -> Result<Consumed, QuotaError> {
        ops::counted("consume", consume::consume(self, request).await)
    }

    /// Holds the request's amounts like [`consume`](Quota::consume) until
    /// [`confirm`](Quota::confirm)ed or [`cancel`](Quota::cancel)led; after `ttl` (server time)
    /// the GC returns them. Reserving the same request again returns the same reservation.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(quota: mongotx::quota::Quota) -> Result<(), mongotx::quota::QuotaError> {
    /// use std::time::Duration;
    /// use mongotx::quota::{ProviderId, Request};
    ///
    /// let seats = ProviderId::new("tenant-9", "seats");
    /// let request = Request::new("checkout-41").take(seats, 2);
    /// let held = quota.reserve(&request, Duration::from_secs(300)).await?;
    /// // ... payment succeeded:
    /// quota.confirm(&held).await?; // or quota.cancel(&held), or let the GC return it
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(name = "mongotx.quota.reserve", skip_all, fields(consumer = %request.consumer, request = %request.id))]
    pub async fn reserve(
        &self,
        request: &Request,
        ttl: Duration,
    ) -> Result<Reservation, QuotaError> {
        ops::counted("reserve", consume::reserve(self, request, ttl).await)
    }

    // ----- providers -----

    /// Creates a provider. A parent must exist already; parents never change afterwards, so a
    /// hierarchy can have no cycle.
    #[tracing::instrument(name = "mongotx.quota.create", skip_all, fields(provider = %new.id))]
    pub async fn create(&self, new: NewProvider) -> Result<Provider, QuotaError> {
        providers::create(self, new).await
    }

    /// Reads a provider: limit, usage, generation and who holds what, all of one moment.
    #[tracing::instrument(name = "mongotx.quota.provider", skip_all, fields(provider = Empty))]
    pub async fn provider(&self, id: impl Into<ProviderId>) -> Result<Provider, QuotaError> {
        let id = id.into();
        Span::current().record("provider", tracing::field::display(&id));
        providers::provider(self, id).await
    }

    /// Sets a provider's limit. Lowering it below the usage is allowed: nothing is taken back,
    /// only new consumption is refused until usage falls under it.
    #[tracing::instrument(name = "mongotx.quota.set_limit", skip_all, fields(provider = Empty, limit = limit))]
    pub async fn set_limit(
        &self,
        id: impl Into<ProviderId>,
        limit: i64,
    ) -> Result<Provider, QuotaError> {
        let id = id.into();
        Span::current().record("provider", tracing::field::display(&id));
        providers::set_limit(self, id, limit).await
    }

    /// Every provider of `scope`, by resource.
    #[tracing::instrument(name = "mongotx.quota.usage", skip_all, fields(scope = scope))]
    pub async fn usage(&self, scope: &str) -> Result<Vec<Provider>, QuotaError> {
        providers::usage(self, scope).await
    }

    /// Returns everything `consumer` holds (allocations and reservations, on every provider and
    /// ancestor), all at once. A consumer holding nothing is [`QuotaError::UnknownConsumer`],
    /// so a second release returns nothing twice.
    #[tracing::instrument(name = "mongotx.quota.release", skip_all, fields(consumer = consumer))]
    pub async fn release(&self, consumer: &str) -> Result<Released, QuotaError> {
        ops::counted("release", release::release(self, consumer).await)
    }

    /// Returns what one consume took (from its providers and their ancestors), all at once,
    /// leaving the consumer's other requests as they are. The [`Consumed`] names the providers,
    /// so on one provider without a parent this is a single conditional update, where
    /// [`release`](Quota::release) first has to find what the consumer holds. Releasing the same
    /// request again is [`QuotaError::UnknownRequest`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(quota: mongotx::quota::Quota) -> Result<(), mongotx::quota::QuotaError> {
    /// use mongotx::quota::{ProviderId, Request};
    ///
    /// let slots = ProviderId::new("team-a", "upload-slots");
    /// let taken = quota.consume(&Request::new("upload-9").take(slots, 1)).await?;
    /// // ... the upload ends:
    /// quota.release_consumed(&taken).await?;
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(name = "mongotx.quota.release_consumed", skip_all, fields(consumer = %consumed.consumer, request = %consumed.request))]
    pub async fn release_consumed(&self, consumed: &Consumed) -> Result<Released, QuotaError> {
        let released = release::release_consumed(self, consumed).await;
        ops::counted("release_consumed", released)
    }

    /// Turns a live reservation into an allocation (released with the consumer). Confirming it
    /// again is a no-op; after its expiry (server time) it is
    /// [`QuotaError::ReservationExpired`] and nothing changes.
    #[tracing::instrument(name = "mongotx.quota.confirm", skip_all, fields(consumer = %reservation.consumer, request = %reservation.request))]
    pub async fn confirm(&self, reservation: &Reservation) -> Result<(), QuotaError> {
        ops::counted("confirm", release::confirm(self, reservation).await)
    }

    /// Returns a reservation that was not confirmed. Once it has expired and the GC returned it,
    /// this is [`QuotaError::ReservationExpired`]. A reservation this handle's `reserve` returned
    /// on one provider without a parent goes back in a single conditional update; one rebuilt
    /// with [`Reservation::new`] is first looked up.
    #[tracing::instrument(name = "mongotx.quota.cancel", skip_all, fields(consumer = %reservation.consumer, request = %reservation.request))]
    pub async fn cancel(&self, reservation: &Reservation) -> Result<Released, QuotaError> {
        ops::counted("cancel", release::cancel(self, reservation).await)
    }

    /// What an operator asks about a provider: its usage against its limit (per stripe, with the
    /// `over` mark), the reservations outstanding with their expiries by the server's clock, and
    /// those past their expiry that only the GC's sweep returns (stuck while no runner sweeps).
    /// One reading of one moment, as [`provider`](Quota::provider) reads.
    pub async fn report(&self, id: impl Into<ProviderId>) -> Result<ProviderReport, QuotaError> {
        report::report(self, id.into()).await
    }

    /// One GC pass: returns every reservation past its expiry (server time), each across all its
    /// providers at once, and forgets released requests whose late copies can no longer land.
    /// Safe to run from any number of processes at once.
    #[tracing::instrument(name = "mongotx.quota.sweep", skip_all)]
    pub async fn sweep(&self) -> Result<SweepSummary, QuotaError> {
        release::sweep(self).await
    }
}
