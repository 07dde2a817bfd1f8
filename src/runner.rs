//! The GC loop as a library type: [`GcRunner`] runs, on an interval, a transaction [`Gc`] round
//! and the quota and rate-limiter sweeps, until its shutdown future completes, finishing the item
//! in progress first. `mongotx-gc` is this loop with a command line and metrics around it; a
//! service can run the same loop in-process instead.
//!
//! It sits above the domain modules (it opens [`Quota`] and [`RateLimits`] handles), which is
//! why it is not part of the transaction layer's `Gc`.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::collections::{LIMITERS_COLLECTION, PROVIDERS_COLLECTION};
use crate::metrics;
use crate::quota::{Quota, QuotaError, SweepSummary};
use crate::ratelimit::{RateLimitError, RateLimits};
use crate::repo::store::Store;
use crate::txn::error::TxnError;
use crate::txn::gc::{Gc, GcOptions, RoundSummary};

/// Runs the GC of a database on an interval; see the module documentation.
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use mongotx::gc::GcOptions;
/// use mongotx::{GcRunner, Store};
/// # async fn service(store: Store) {
/// let runner = GcRunner::new(&store, GcOptions::default()).interval(Duration::from_secs(10));
/// // Runs until ctrl-c, then finishes the item in progress and returns.
/// runner
///     .run(async { tokio::signal::ctrl_c().await.ok(); }, |pass| {
///         if let Err(e) = &pass.round {
///             tracing::warn!(error = %e, "GC round failed; the next one retries");
///         }
///     })
///     .await;
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct GcRunner {
    store: Store,
    gc: Gc,
    interval: Duration,
    quota: bool,
    ratelimit: bool,
    stop: Arc<AtomicBool>,
    wake: Arc<Notify>,
}

/// What one pass of a [`GcRunner`] did: each part's result on its own, so that one failing
/// part does not hide what the others did.
#[derive(Debug)]
#[non_exhaustive]
pub struct GcPass {
    /// The transaction GC round: expired transactions finished or rolled back, holds swept,
    /// tombstones purged.
    pub round: Result<RoundSummary, TxnError>,
    /// The quota sweep (expired reservations returned); `None` when turned off, when the database
    /// has no quota providers, or when the runner was stopped before it.
    pub quota: Option<Result<SweepSummary, QuotaError>>,
    /// The rate-limiter sweep (how many idle limiters were pruned); `None` as for `quota`.
    pub ratelimit: Option<Result<u64, RateLimitError>>,
    /// How long the pass took.
    pub took: Duration,
}

impl GcPass {
    /// Whether every part that ran succeeded.
    pub fn is_ok(&self) -> bool {
        self.round.is_ok()
            && !matches!(self.quota, Some(Err(_)))
            && !matches!(self.ratelimit, Some(Err(_)))
    }
}

impl GcRunner {
    /// The pause between passes unless set: short enough that a dead coordinator's documents are
    /// free within about a minute of its deadline, long enough to cost an idle database nothing.
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(30);

    /// A runner over `store`'s database (and its transactions collection), with the GC's
    /// `options`, passing every [`DEFAULT_INTERVAL`](GcRunner::DEFAULT_INTERVAL), with both sweeps on.
    pub fn new(store: &Store, options: GcOptions) -> GcRunner {
        GcRunner {
            store: store.clone(),
            gc: Gc::new(store, options),
            interval: GcRunner::DEFAULT_INTERVAL,
            quota: true,
            ratelimit: true,
            stop: Arc::new(AtomicBool::new(false)),
            wake: Arc::new(Notify::new()),
        }
    }

    /// Sets the pause between passes (from the end of one to the start of the next).
    pub fn interval(mut self, interval: Duration) -> GcRunner {
        self.interval = interval;
        self
    }

    /// Turns the quota sweep on or off (on by default; it runs only in a database that has
    /// quota providers, so that the GC never creates the collection).
    pub fn quota_sweep(mut self, on: bool) -> GcRunner {
        self.quota = on;
        self
    }

    /// Turns the rate-limiter sweep on or off (on by default; it runs only in a database that
    /// has limiters).
    pub fn ratelimit_sweep(mut self, on: bool) -> GcRunner {
        self.ratelimit = on;
        self
    }

    /// Asks a running [`run`](GcRunner::run) (of this runner or a clone) to stop: the item in
    /// progress is finished, nothing new is started.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.wake.notify_waiters();
    }

    /// Whether [`stop`](GcRunner::stop) was called (or the shutdown future of `run` completed).
    pub fn is_stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// One pass now: a GC round at the server's time, then the sweeps.
    pub async fn pass(&self) -> GcPass {
        let started = Instant::now();
        let round = match self.store.server_time().await {
            Ok(now) => self.gc.run_round_at(now, &self.stop).await,
            Err(source) => {
                // A round that could not start failed all the same.
                metrics::gc_round(started.elapsed(), None);
                Err(TxnError::Clock { txn: None, source })
            }
        };
        // One listing serves both sweeps: each runs only where its collection exists, so that
        // the GC never creates it.
        let names = if (self.quota || self.ratelimit) && !self.is_stopped() {
            Some(self.store.database().list_collection_names().await)
        } else {
            None
        };
        let quota = match &names {
            Some(names) if self.quota => self.sweep_quota(names).await,
            _ => None,
        };
        let ratelimit = match &names {
            Some(names) if self.ratelimit && !self.is_stopped() => {
                self.sweep_ratelimits(names).await
            }
            _ => None,
        };
        GcPass {
            round,
            quota,
            ratelimit,
            took: started.elapsed(),
        }
    }

    /// Passes every interval until `shutdown` completes (or [`stop`](GcRunner::stop) is called),
    /// handing each pass to `on_pass`; then finishes the item in progress and returns. A failed
    /// pass (an outage, say) is reported and the next one tries again.
    pub async fn run<S, F>(&self, shutdown: S, mut on_pass: F)
    where
        S: Future<Output = ()>,
        F: FnMut(&GcPass),
    {
        let passes = async {
            while !self.is_stopped() {
                let pass = self.pass().await;
                on_pass(&pass);
                if self.is_stopped() {
                    break;
                }
                let woken = self.wake.notified();
                if self.is_stopped() {
                    break;
                }
                tokio::select! {
                    _ = tokio::time::sleep(self.interval) => {}
                    _ = woken => {}
                }
            }
        };
        let watch = async {
            shutdown.await;
            tracing::info!("GC runner: shutting down after the item in progress");
            self.stop();
            std::future::pending::<()>().await
        };
        tokio::select! {
            _ = passes => {}
            _ = watch => {}
        }
    }

    /// Returns expired reservations, if this database has quota providers at all.
    async fn sweep_quota(&self, names: &Names) -> Option<Result<SweepSummary, QuotaError>> {
        match has(names, PROVIDERS_COLLECTION) {
            Ok(false) => None,
            Ok(true) => Some(match Quota::open(&self.store).await {
                Ok(quota) => quota.sweep().await,
                Err(e) => Err(e),
            }),
            Err(e) => Some(Err(QuotaError::from(TxnError::database(
                None,
                "list the collections",
                e.clone(),
            )))),
        }
    }

    /// Prunes the limiters, if this database has any.
    async fn sweep_ratelimits(&self, names: &Names) -> Option<Result<u64, RateLimitError>> {
        match has(names, LIMITERS_COLLECTION) {
            Ok(false) => None,
            Ok(true) => Some(match RateLimits::open(&self.store).await {
                Ok(limits) => limits.sweep().await,
                Err(e) => Err(e),
            }),
            Err(e) => Some(Err(RateLimitError::Database {
                collection: LIMITERS_COLLECTION.to_string(),
                limiter: "*".to_string(),
                op: "list the collections",
                source: Box::new(e.clone()),
            })),
        }
    }
}

/// The database's collection names, as listed once per pass.
type Names = Result<Vec<String>, mongodb::error::Error>;

/// Whether the listing holds `name` (the listing's error, if it failed).
fn has<'a>(names: &'a Names, name: &str) -> Result<bool, &'a mongodb::error::Error> {
    names.as_ref().map(|names| names.iter().any(|n| n == name))
}
