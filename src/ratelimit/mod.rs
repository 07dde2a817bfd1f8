//! A rate limiter shared by workers on different hosts: N calls per window W, for **every**
//! interval of length W, by the server's clock, with reservations, priorities and
//! all-or-nothing grants across several limiters, at a cost that does not grow with W, N or
//! the reservations outstanding.
//!
//! # The protocol
//!
//! A limiter is one document: its limit, how many calls end in each *slot* of server time, its
//! last grants and settlements, and a queue of waiting bulk callers. A worker reserves calls
//! before making them ([`RateLimits::try_reserve`], [`RateLimits::reserve`]); the grant is **one
//! write** whose pipeline evaluates the admission rule itself, on the server, with the server's
//! clock (`$$NOW`), and adds the calls only if they fit, so two workers can never both take the
//! last room; the document it returns says whether they were granted, and if not, when there
//! will be room. The worker makes its calls before the reservation's
//! [`deadline`](CallReservation::deadline), then settles with the number made
//! ([`RateLimits::settle`], one write too), which returns the unused calls at once.
//!
//! A reservation's calls reach the API by its end: grant + hold + grace while pending, the settle
//! time once settled. The limiter counts calls by the slot their end falls in (a slot is the
//! limiter's reach, window + hold + grace, over 128), and a slot counts while its last
//! millisecond is less than one window ago, so every interval of one window that can contain a
//! call sees it, for at most one slot longer than needed. A reservation is granted only if the
//! calls counted now plus the new ones fit, which (grants being ordered by the server) bounds
//! every interval of one window, aligned or not. A worker that dies holding a reservation leaves
//! its calls counted in full until its end's slot has aged out: it costs at most its calls for
//! hold + grace + one window and a slot, and can never cause an overrun.
//!
//! The document holds at most `ceil((reach + 100 ms) / slot) + 1` slots (131 for a 1 s window
//! with the default hold; slots are kept 100 ms after they stop counting), the last 32 grants
//! and settlements and the waiting callers, whatever the limit and however many reservations are
//! outstanding, so a grant or a settlement costs the same at 10 calls per window as at
//! 1,000,000.
//!
//! A reservation has one settlement, shared by its clones: the first `settle` owns it, any other
//! is refused without a write. Each sending of it may apply only inside a window of server time
//! that starts after every earlier sending's window, so a copy delayed in the network can never
//! apply after its resend (see [`RateLimitOptions::send_window`]).
//!
//! Every time that counts is the server's: the writes are update pipelines that read `$$NOW`
//! themselves. No worker's clock is compared with another's; a worker only measures its own
//! deadline, on its monotonic clock, from before its request left. (The bulk queue's order and
//! liveness use the worker's estimate of the server's clock, which only affects fairness, never
//! the bound; a settlement's windows use the limiter's clock as its last reply gave it, which
//! only affects how soon a settlement after an error lands.) The server's clock is that of the node holding the document: a primary
//! change to a node whose clock is ahead makes calls stop counting early by the difference,
//! unless the limit's [`skew`](Limit::skew) covers it.
//!
//! Priorities and the queue are described on [`RateLimits`]; the exhaustive model of the protocol
//! (`testkit::ratelimit_model`) comes with the `testkit` feature.
//!
//! Every method of [`RateLimits`] is declared in this file and delegates to `ops` (one conditional
//! write per operation, and the read that explains a refusal), whose writes `plan` computes, or
//! to `report` (the operator's view of a limiter, also read without opening the collection by
//! [`inspect`]).

use crate::repo::open;

mod error;
mod limit;
mod ops;
mod plan;
mod report;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bson::{doc, Document};
use mongodb::Collection;
use tokio::sync::Notify;

use crate::collections::LIMITERS_COLLECTION;
use crate::repo::names::collection_problem;
use crate::repo::store::Store;

pub use error::RateLimitError;
pub use limit::{Attempt, CallReservation, Limit, Priority, Settled, Usage, LIMITERS_SCHEMA};
pub use report::{inspect, LimiterReport, LimiterReservation, ReservationState, WaitingCaller};

/// How a [`RateLimits`] handle behaves.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RateLimitOptions {
    /// The collection of limiters.
    pub collection: String,
    /// The longest a waiting caller sleeps before looking again when nothing in this process
    /// wakes it (a settlement in another process frees capacity without telling this one).
    /// `None`: an eighth of the window, from 5 ms to 5 s (a dead waiter leaves the queue
    /// after 1.5 polls + 200 ms, so this also bounds what it holds up).
    pub poll: Option<Duration>,
    /// How long [`RateLimits::reserve`] waits before giving up with
    /// [`RateLimitError::TimedOut`].
    pub max_wait: Duration,
    /// How long after it leaves, by the limiter's clock (as the limiter's last reply gave it),
    /// one sending of a settlement may still apply. A sending whose fate is unknown (an I/O error) is sent again only once the
    /// server's clock has passed its window, so that no copy of it still on the way can apply
    /// after the resend: this is how long a settlement takes after such an error. A sending
    /// slower than this does nothing and is sent again.
    pub send_window: Duration,
}

impl Default for RateLimitOptions {
    fn default() -> RateLimitOptions {
        RateLimitOptions {
            collection: LIMITERS_COLLECTION.to_string(),
            poll: None,
            max_wait: Duration::from_secs(60),
            send_window: Duration::from_secs(1),
        }
    }
}

impl RateLimitOptions {
    /// Sets [`collection`](RateLimitOptions::collection).
    pub fn collection(mut self, name: impl Into<String>) -> RateLimitOptions {
        self.collection = name.into();
        self
    }

    /// Sets [`poll`](RateLimitOptions::poll).
    pub fn poll(mut self, poll: Duration) -> RateLimitOptions {
        self.poll = Some(poll);
        self
    }

    /// Sets [`max_wait`](RateLimitOptions::max_wait).
    pub fn max_wait(mut self, max_wait: Duration) -> RateLimitOptions {
        self.max_wait = max_wait;
        self
    }

    /// Sets [`send_window`](RateLimitOptions::send_window).
    pub fn send_window(mut self, window: Duration) -> RateLimitOptions {
        self.send_window = window;
        self
    }

    /// Refuses options that make no sense for `store`, with
    /// [`RateLimitError::InvalidOption`] (whether the collection already holds other documents
    /// is checked by [`RateLimits::with_options`]):
    ///
    /// - `collection` must be a name the server accepts (not empty, no `$` or NUL, not starting
    ///   or ending with `.`, not a `system.` collection, at most 235 bytes with the database
    ///   name, the bound for a sharded namespace) and not one of mongotx's own collections;
    /// - `poll` must be from 1 ms (waiters sleep in whole milliseconds; zero is a busy loop) to
    ///   one day;
    /// - `send_window` must be from 1 ms (a window of server time in whole milliseconds) to one
    ///   day.
    ///
    /// `max_wait` takes any value: zero means one try, then [`RateLimitError::TimedOut`].
    pub fn validate(&self, store: &Store) -> Result<(), RateLimitError> {
        let name = self.collection.as_str();
        let invalid = |option: &'static str, value: String, reason: String| {
            Err(RateLimitError::InvalidOption {
                collection: name.to_string(),
                option,
                value,
                reason,
            })
        };
        if let Some(reason) = collection_problem(store, name, LIMITERS_COLLECTION) {
            return invalid("collection", format!("{name:?}"), reason);
        }
        if let Some(poll) = self.poll {
            if poll < Duration::from_millis(1) || poll > Duration::from_secs(24 * 3600) {
                return invalid(
                    "poll",
                    format!("{poll:?}"),
                    "it must be from 1 ms to one day".into(),
                );
            }
        }
        let window = self.send_window;
        if window < Duration::from_millis(1) || window > Duration::from_secs(24 * 3600) {
            return invalid(
                "send_window",
                format!("{window:?}"),
                "it must be from 1 ms to one day".into(),
            );
        }
        Ok(())
    }
}

/// The rate limiter handle: cheap to clone, shared by all tasks of a process.
///
/// **Priorities.** A limit may keep part of its calls ([`Limit::reserved`]) for high-priority
/// callers. Bulk callers count high-priority use as at least that part, so while high-priority
/// callers hold less than it, a high-priority request for what remains of it is granted at once,
/// whatever bulk callers do. High-priority callers may also use any other free capacity.
///
/// **Waiting.** [`reserve`](RateLimits::reserve) waits for room: it sleeps until the log shows
/// room (entries age out at known times), or until a settlement in this process frees some, and
/// at most [`RateLimitOptions::poll`]. Bulk callers that wait queue in the limiter document, first
/// come first served: a bulk request is granted only if it also leaves room for every live bulk
/// caller queued before it, so a large request is not starved by small ones. A queued caller that
/// dies leaves the queue when its entry expires.
///
/// ```no_run
/// # async fn demo(store: mongotx::Store) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use mongotx::ratelimit::{Limit, Priority, RateLimits};
///
/// let limits = RateLimits::open(&store).await?;
/// limits.define("maps-api", Limit::new(50, Duration::from_secs(1)).reserved(5)).await?;
/// let reservation = limits.reserve(&["maps-api"], 10, Priority::Bulk).await?;
/// let mut made = 0;
/// while made < reservation.calls() && reservation.usable() {
///     // call the API here
///     made += 1;
/// }
/// limits.settle(&reservation, made).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RateLimits {
    store: Store,
    coll: Collection<Document>,
    options: Arc<RateLimitOptions>,
    shared: Arc<Shared>,
}

/// What the tasks of one process share about each limiter.
#[derive(Debug, Default)]
struct Shared {
    limits: Mutex<HashMap<String, Limit>>,
    /// Woken when this process returns capacity to a limiter.
    wakers: Mutex<HashMap<String, Arc<Notify>>>,
}

impl RateLimits {
    /// Opens the default collection of limiters in `store`'s database.
    #[tracing::instrument(name = "mongotx.ratelimit.open", skip_all)]
    pub async fn open(store: &Store) -> Result<RateLimits, RateLimitError> {
        RateLimits::with_options(store, RateLimitOptions::default()).await
    }

    /// Opens it with `options`.
    #[tracing::instrument(name = "mongotx.ratelimit.open", skip_all, fields(collection = %options.collection))]
    pub async fn with_options(
        store: &Store,
        options: RateLimitOptions,
    ) -> Result<RateLimits, RateLimitError> {
        options.validate(store)?;
        // Opening installs the limiters' validator on the collection, which would break a
        // collection that holds anything else: refuse one holding a document that is not a
        // limiter (a limiter has every field below).
        let missing: Vec<Document> = [
            "calls",
            "window_ms",
            "reserved",
            "hold_ms",
            "grace_ms",
            "wait",
        ]
        .iter()
        .map(|field| doc! { *field: { "$exists": false } })
        .collect();
        let foreign = store
            .database()
            .collection::<Document>(&options.collection)
            .find_one(doc! { "$or": missing })
            .projection(doc! { "_id": 1 })
            .await
            .map_err(|e| RateLimitError::database(&options.collection, "*", "open", e))?;
        if let Some(found) = foreign {
            return Err(RateLimitError::InvalidOption {
                collection: options.collection.clone(),
                option: "collection",
                value: format!("{:?}", options.collection),
                reason: format!(
                    "it holds documents that are not limiters (_id {}); opening would install \
                     the limiters' validator on it",
                    found
                        .get("_id")
                        .map_or_else(|| "?".to_string(), ToString::to_string)
                ),
            });
        }
        let coll = open::validated_protocol_collection(store, &options.collection, LIMITERS_SCHEMA)
            .await
            .map_err(|e| RateLimitError::database(&options.collection, "*", "open", e))?;
        Ok(RateLimits {
            store: store.clone(),
            coll,
            options: Arc::new(options),
            shared: Arc::new(Shared::default()),
        })
    }

    /// A handle that opened nothing (no validator installed, nothing written), for reading a
    /// database that must not change ([`inspect`]); never handed out, since its writes would
    /// go to a collection nobody set up.
    pub(crate) fn unopened(
        store: &Store,
        options: RateLimitOptions,
    ) -> Result<RateLimits, RateLimitError> {
        options.validate(store)?;
        Ok(RateLimits {
            store: store.clone(),
            coll: store.database().collection(&options.collection),
            options: Arc::new(options),
            shared: Arc::new(Shared::default()),
        })
    }

    /// The options in force.
    pub fn options(&self) -> &RateLimitOptions {
        &self.options
    }

    /// What an operator asks about limiter `name`: its limit, the calls counted in the window
    /// ending now, the reservations it still counts (pending, or overdue: a worker that died
    /// holding them), the bulk callers queued, and when the next call of each priority would be
    /// admitted. One read, at one instant of the limiter's clock.
    pub async fn report(&self, name: &str) -> Result<LimiterReport, RateLimitError> {
        report::report(self, name).await
    }

    /// Prunes every limiter's log of entries that stopped counting and its queue of callers
    /// gone (what each grant does to the limiter it writes), for limiters nobody writes to now;
    /// the GC runner calls it each round. One read of the limiter names, then one conditional
    /// write per limiter; returns how many limiters it changed. It never changes what counts.
    #[tracing::instrument(name = "mongotx.ratelimit.sweep", skip_all)]
    pub async fn sweep(&self) -> Result<u64, RateLimitError> {
        ops::sweep(self).await
    }

    /// Defines a limiter, or confirms an existing one has exactly this limit
    /// ([`RateLimitError::LimitMismatch`] otherwise: a live limit is never changed under the
    /// workers counting by it).
    #[tracing::instrument(name = "mongotx.ratelimit.define", skip_all, fields(limiter = name))]
    pub async fn define(&self, name: &str, limit: Limit) -> Result<(), RateLimitError> {
        ops::define(self, name, limit).await
    }

    /// The limit of `name` (read once, then remembered: a limit never changes).
    #[tracing::instrument(name = "mongotx.ratelimit.limit", skip_all, fields(limiter = name))]
    pub async fn limit(&self, name: &str) -> Result<Limit, RateLimitError> {
        ops::limit(self, name).await
    }

    /// What `name` counts now, by the server's clock.
    #[tracing::instrument(name = "mongotx.ratelimit.usage", skip_all, fields(limiter = name))]
    pub async fn usage(&self, name: &str) -> Result<Usage, RateLimitError> {
        ops::usage(self, name).await
    }

    /// Asks once for `n` calls on every limiter in `limiters` (all of them or none): granted, or
    /// when the log will have room. Nothing is left behind when refused.
    #[tracing::instrument(name = "mongotx.ratelimit.try_reserve", skip_all, fields(limiters = %limiters.join(","), calls = n, priority = ?priority))]
    pub async fn try_reserve(
        &self,
        limiters: &[&str],
        n: u32,
        priority: Priority,
    ) -> Result<Attempt, RateLimitError> {
        ops::try_reserve(self, limiters, n, priority).await
    }

    /// Reserves `n` calls on every limiter in `limiters` (all of them or none), waiting for
    /// room up to [`RateLimitOptions::max_wait`](crate::ratelimit::RateLimitOptions::max_wait).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(limits: mongotx::ratelimit::RateLimits)
    /// # -> Result<(), mongotx::ratelimit::RateLimitError> {
    /// use std::time::Duration;
    /// use mongotx::ratelimit::{Limit, Priority};
    ///
    /// limits.define("partner-api", Limit::new(100, Duration::from_secs(60))).await?;
    /// let reservation = limits.reserve(&["partner-api"], 1, Priority::High).await?;
    /// // ... make the call, then say how many were made (unused calls go back):
    /// limits.settle(&reservation, 1).await?;
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(name = "mongotx.ratelimit.reserve", skip_all, fields(limiters = %limiters.join(","), calls = n, priority = ?priority))]
    pub async fn reserve(
        &self,
        limiters: &[&str],
        n: u32,
        priority: Priority,
    ) -> Result<CallReservation, RateLimitError> {
        ops::reserve(self, limiters, n, priority).await
    }

    /// [`reserve`](RateLimits::reserve), waiting at most `max_wait`.
    #[tracing::instrument(name = "mongotx.ratelimit.reserve_within", skip_all, fields(limiters = %limiters.join(","), calls = n, priority = ?priority, max_wait = ?max_wait))]
    pub async fn reserve_within(
        &self,
        limiters: &[&str],
        n: u32,
        priority: Priority,
        max_wait: Duration,
    ) -> Result<CallReservation, RateLimitError> {
        ops::reserve_within(self, limiters, n, priority, max_wait).await
    }

    /// Settles `reservation`: `made` calls were made (and have completed), the rest return to
    /// every limiter at once. A reservation past its expiry was counted in full and is left
    /// alone ([`Settled::Expired`]). One write per limiter, all sent at once.
    ///
    /// A reservation is settled once, whichever of its clones settles it: the first call
    /// starts its settlement, and a call made while that one runs, or after it settled it, is
    /// [`RateLimitError::AlreadySettled`] (with the calls the first reported made) and writes
    /// nothing. A settlement that failed with a retryable error may be sent again by a call
    /// reporting the same calls made (any other count is refused the same way); the limiter then
    /// applies it only if it can tell no earlier sending landed ([`Settled::Unconfirmed`]
    /// otherwise), and a copy of an earlier sending still on its way never applies after it
    /// (see [`RateLimitOptions::send_window`]).
    #[tracing::instrument(name = "mongotx.ratelimit.settle", skip_all, fields(reservation = %reservation.id, limiters = %reservation.limiters.join(","), made = made))]
    pub async fn settle(
        &self,
        reservation: &CallReservation,
        made: u32,
    ) -> Result<Settled, RateLimitError> {
        ops::settle(self, reservation, made).await
    }
}
