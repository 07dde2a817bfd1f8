//! The rate limiter's public types: limits, priorities, reservations and outcomes.

use std::fmt;
use std::time::{Duration, Instant};

use std::sync::{Arc, Mutex};

use bson::oid::ObjectId;
use bson::{doc, Document};

/// Where a reservation's settlement is. A reservation has one settlement, whichever of its
/// clones settles it: the first `settle` starts it, and it is identified by the calls it reports
/// made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Not settled.
    Open,
    /// A `settle` call is sending it: any other is refused.
    Sending { made: u32 },
    /// A `settle` call failed after sending it (it may have landed, or may still): a call
    /// reporting the same `made` sends it again, any other is refused.
    Sent { made: u32 },
    /// Settled.
    Done { made: u32 },
}

/// What the sendings of a settlement to one limiter so far require of the next.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Track {
    /// The latest `until` (server time, ms) of every sending so far: the next one is valid only
    /// after it, so no two sendings can ever apply at the same server time.
    pub after: Option<i64>,
    /// Sendings whose fate is unknown (an I/O error, or a call dropped while it waited): the
    /// next one is a resend, which checks whether such a one may have landed and been forgotten.
    pub unknown: u32,
    /// What the limiter answered, once it did: a `settle` that failed on another limiter and is
    /// called again does not send to this one again (a sending that is not a resend would apply
    /// a second time once the limiter forgot the first).
    pub outcome: Option<Settled>,
}

/// A reservation's settlement, shared by its clones.
#[derive(Debug)]
pub(crate) struct Settling {
    pub phase: Phase,
    /// One per limiter, in the order of the reservation's `limiters`.
    pub tracks: Vec<Track>,
}

impl Settling {
    pub(crate) fn new(limiters: usize) -> Settling {
        Settling {
            phase: Phase::Open,
            tracks: vec![Track::default(); limiters],
        }
    }
}

/// The JSON Schema of a limiter document (the project's `schemas/ratelimits.json`).
pub const LIMITERS_SCHEMA: &str = include_str!("../../schemas/ratelimits.json");

const DAY: Duration = Duration::from_secs(24 * 3600);

/// A limit: at most `calls` calls in **any** interval of length `window`, by the server's clock.
///
/// ```
/// use std::time::Duration;
/// use mongotx::ratelimit::Limit;
///
/// // 100 calls a second, 10 of them kept for high-priority callers; a reservation's calls must
/// // be sent within 200 ms of the grant.
/// let limit = Limit::new(100, Duration::from_secs(1))
///     .reserved(10)
///     .hold(Duration::from_millis(200));
/// assert_eq!(limit.bulk_max(), 90);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limit {
    /// Calls allowed in any interval of length `window`.
    pub calls: u32,
    /// The length of the sliding window.
    pub window: Duration,
    /// The part of `calls` kept for high-priority callers: bulk callers never take it.
    pub reserved: u32,
    /// How long after its grant a reservation's calls may still be sent
    /// ([`CallReservation::deadline`]). An unsettled reservation counts in full until
    /// `hold + grace` after its grant, then for one more window.
    pub hold: Duration,
    /// How long a call sent just before the deadline may take to reach the API; it widens what
    /// an unsettled reservation covers.
    pub grace: Duration,
    /// How far the clock of the node that holds the limiter's document may jump ahead, at
    /// most: the limiter's clock is `$$NOW` on its primary, and a primary change (or a chunk
    /// migration to another shard) to a node whose clock is `d` ahead makes every call look `d`
    /// older. Calls count `skew` longer than the window, so a step of up to `skew` keeps the
    /// bound; a longer one lets calls stop counting early by the excess (an interval of one
    /// window may then hold the limit plus the calls of a span that long). Set it from the
    /// deployment's clock discipline (how far apart NTP keeps the nodes); 0 by default. A step
    /// backwards only keeps calls counted longer; a settlement's sendings, whose windows of
    /// server time must not overlap across such a step either, start each window `skew` after
    /// the previous one's end.
    pub skew: Duration,
}

impl Limit {
    /// `calls` per `window`, nothing reserved, a hold of one window (at most 10 s) and a grace
    /// of 100 ms.
    pub fn new(calls: u32, window: Duration) -> Limit {
        Limit {
            calls,
            window,
            reserved: 0,
            hold: window.min(Duration::from_secs(10)),
            grace: Duration::from_millis(100),
            skew: Duration::ZERO,
        }
    }

    /// Sets [`reserved`](Limit::reserved).
    pub fn reserved(mut self, calls: u32) -> Limit {
        self.reserved = calls;
        self
    }

    /// Sets [`hold`](Limit::hold).
    pub fn hold(mut self, hold: Duration) -> Limit {
        self.hold = hold;
        self
    }

    /// Sets [`grace`](Limit::grace).
    pub fn grace(mut self, grace: Duration) -> Limit {
        self.grace = grace;
        self
    }

    /// Sets [`skew`](Limit::skew).
    pub fn skew(mut self, skew: Duration) -> Limit {
        self.skew = skew;
        self
    }

    /// The most a bulk caller can be granted at once.
    pub fn bulk_max(&self) -> u32 {
        self.calls.saturating_sub(self.reserved)
    }

    /// The most a caller of `priority` can be granted at once.
    pub fn max_for(&self, priority: Priority) -> u32 {
        match priority {
            Priority::High => self.calls,
            Priority::Bulk => self.bulk_max(),
        }
    }

    /// How long a reservation that is never settled keeps capacity, at most: until no interval
    /// of one window (and the skew) can contain a call made under it, and the slot its end falls
    /// in has aged out (a slot is a 128th of window + skew + hold + grace).
    pub fn dead_worker_cost(&self) -> Duration {
        let slot = u64::try_from(self.slot_ms()).unwrap_or(u64::MAX / 4);
        self.hold + self.grace + self.span() + Duration::from_millis(slot)
    }

    /// How long after its end a call counts: the window, the skew and [`SLACK`].
    pub(crate) fn span(&self) -> Duration {
        self.window + self.skew + SLACK
    }

    /// The width in milliseconds of one slot of its limiter: its reach (window + skew + hold +
    /// grace + slack) over [`SLOTS`], rounded up.
    pub(crate) fn slot_ms(&self) -> i64 {
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4);
        let reach = ms(self.span()) + ms(self.hold) + ms(self.grace);
        ((reach + SLOTS - 1) / SLOTS).max(1)
    }

    /// Why this limit cannot be used, if it cannot.
    pub(crate) fn problem(&self) -> Option<String> {
        let ms = |d: Duration| d.as_millis();
        if self.calls == 0 {
            return Some("a limit of 0 calls grants nothing".into());
        }
        if self.calls > 1_000_000 {
            return Some(format!(
                "{} calls per window is more than 1,000,000",
                self.calls
            ));
        }
        // The limit is stored in whole milliseconds; a fraction would not read back as defined,
        // so `define` would write the limiter and then find it different.
        for (what, d) in [
            ("window", self.window),
            ("hold", self.hold),
            ("grace", self.grace),
            ("skew", self.skew),
        ] {
            if d.subsec_nanos() % 1_000_000 != 0 {
                return Some(format!(
                    "{what} {d:?} is not a whole number of milliseconds"
                ));
            }
        }
        if ms(self.window) == 0 || self.window > DAY {
            return Some(format!(
                "window {:?} must be from 1 ms to one day",
                self.window
            ));
        }
        if self.reserved >= self.calls {
            return Some(format!(
                "reserving {} of {} calls leaves nothing for bulk callers",
                self.reserved, self.calls
            ));
        }
        if ms(self.hold) == 0 || self.hold > DAY {
            return Some(format!("hold {:?} must be from 1 ms to one day", self.hold));
        }
        if self.grace > DAY {
            return Some(format!("grace {:?} must be at most one day", self.grace));
        }
        if self.skew > DAY {
            return Some(format!("skew {:?} must be at most one day", self.skew));
        }
        None
    }

    pub(crate) fn to_fields(self) -> Document {
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        doc! {
            "calls": i64::from(self.calls),
            "window_ms": ms(self.window),
            "reserved": i64::from(self.reserved),
            "hold_ms": ms(self.hold),
            "grace_ms": ms(self.grace),
            "skew_ms": ms(self.skew),
        }
    }

    pub(crate) fn from_fields(doc: &Document) -> Option<Limit> {
        let int = |k: &str| doc.get_i64(k).ok().and_then(|v| u32::try_from(v).ok());
        let dur = |k: &str| {
            doc.get_i64(k)
                .ok()
                .and_then(|v| u64::try_from(v).ok())
                .map(Duration::from_millis)
        };
        Some(Limit {
            calls: int("calls")?,
            window: dur("window_ms")?,
            reserved: int("reserved")?,
            hold: dur("hold_ms")?,
            grace: dur("grace_ms")?,
            // Limiters defined before the skew have none.
            skew: match doc.get("skew_ms") {
                None => Duration::ZERO,
                Some(_) => dur("skew_ms")?,
            },
        })
    }
}

/// The slots a limiter's reach (window + skew + hold + grace + slack) is cut into.
pub(crate) const SLOTS: i64 = 128;

/// What a settlement needs to know of the grant it settles on one limiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    /// The slot of its pending end.
    pub end: i64,
    /// The limiter's sequence number of the grant.
    pub seq: i64,
    /// The limiter's clock (server time, ms) when the granting write ran, and when its reply
    /// came: the sender's estimate of that clock, for its settlement's windows.
    pub clock: (i64, Instant),
    /// The limit's skew in milliseconds: a sending after another starts its window this much
    /// after the other's ended, so that a node whose clock is behind by up to that after a
    /// primary change does not still find the other inside its window.
    pub skew_ms: i64,
}

/// Added to every window: the server's clock reads whole milliseconds, so a call at most a
/// millisecond after a time read as `t` may be stamped `t`.
pub(crate) const SLACK: Duration = Duration::from_millis(2);

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} calls per {:?} ({} reserved, hold {:?}, grace {:?}",
            self.calls, self.window, self.reserved, self.hold, self.grace
        )?;
        if !self.skew.is_zero() {
            write!(f, ", skew {:?}", self.skew)?;
        }
        f.write_str(")")
    }
}

/// Who is asking: high-priority callers may use the reserved part and never queue behind bulk
/// callers; bulk callers queue among themselves, first come first served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Priority {
    /// A caller that makes a call or two and must go at once.
    High,
    /// A caller that makes many calls and may wait.
    Bulk,
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Priority::High => "high-priority",
            Priority::Bulk => "bulk",
        })
    }
}

/// Calls granted on one or more limiters: make at most [`calls`](CallReservation::calls) calls,
/// each sent before [`deadline`](CallReservation::deadline), then
/// [`settle`](crate::ratelimit::RateLimits::settle) with the number made.
#[derive(Debug, Clone)]
pub struct CallReservation {
    pub(crate) id: ObjectId,
    /// The collection of limiters that granted it (`database.collection`): settled through
    /// another, it is unknown there.
    pub(crate) namespace: String,
    pub(crate) limiters: Vec<String>,
    /// Where each limiter (in the order of `limiters`) counted it.
    pub(crate) grants: Vec<Grant>,
    /// Its settlement, shared by its clones: a second settlement is refused whichever clone
    /// sends it, and the sendings of the one settlement never overlap in server time.
    pub(crate) settling: Arc<Mutex<Settling>>,
    pub(crate) calls: u32,
    pub(crate) priority: Priority,
    pub(crate) deadline: Instant,
    /// How long after the deadline the limiter goes on counting it, at most (grace, then one
    /// window).
    pub(crate) counted_for: Duration,
}

impl CallReservation {
    /// Its id, the same on every limiter it spans.
    pub fn id(&self) -> ObjectId {
        self.id
    }

    /// The limiters it was granted on.
    pub fn limiters(&self) -> &[String] {
        &self.limiters
    }

    /// Calls granted.
    pub fn calls(&self) -> u32 {
        self.calls
    }

    /// The priority it was asked with.
    pub fn priority(&self) -> Priority {
        self.priority
    }

    /// The instant, on this process's monotonic clock, after which no call may be sent under
    /// it. It is counted from before the request left, so it is never later than the limiter
    /// assumes.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether calls may still be sent under it.
    pub fn usable(&self) -> bool {
        Instant::now() < self.deadline
    }

    /// Whether its hold, grace and one window have passed on this process's clock: the limiter
    /// no longer counts it, settled or not, and settling it changes nothing.
    pub fn expired(&self) -> bool {
        Instant::now() > self.deadline + self.counted_for
    }
}

/// What one reservation attempt gave.
#[derive(Debug, Clone)]
#[must_use = "a granted reservation must be settled"]
pub enum Attempt {
    /// Granted.
    Granted(CallReservation),
    /// No room now. `after` is how long until the log shows room (capacity freed earlier by a
    /// settlement may come sooner); `at` is that instant in server time.
    Wait {
        /// When, by the server's clock.
        at: chrono::DateTime<chrono::Utc>,
        /// How long from now.
        after: Duration,
    },
}

/// What settling did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settled {
    /// The calls made are recorded; `unused` calls were returned at once.
    Returned {
        /// Calls given back.
        unused: u32,
    },
    /// The reservation was past its expiry: it was counted in full and nothing was changed.
    Expired,
    /// A reply was lost, and the limiter can no longer tell whether the settlement it answered
    /// had landed (too many settlements since): nothing more was changed. Either the unused
    /// calls came back then, or the reservation counts in full until it ages out; both are
    /// safe, the second only wastes its unused calls for a while.
    Unconfirmed,
}

/// A limiter's state as seen at one instant of the server's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Usage {
    /// The limit.
    pub limit: Limit,
    /// The server's time of the reading.
    pub now: chrono::DateTime<chrono::Utc>,
    /// Calls counted for bulk callers in the window ending now.
    pub bulk: u32,
    /// Calls counted for high-priority callers in the window ending now.
    pub high: u32,
    /// Calls of reservations granted and not settled yet: those counted after the current slot
    /// (a reservation granted moments ago may share the current slot with settled calls, and is
    /// not in this count).
    pub pending: u32,
    /// Bulk callers queued for capacity.
    pub waiting: usize,
}
