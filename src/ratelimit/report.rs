//! What an operator asks about a limiter ([`RateLimits::report`], and [`inspect`] without a
//! handle): its limit, the calls it counts now, the reservations it still counts, the bulk
//! callers waiting, and when the next call would be admitted, all from one reading at one
//! instant of the limiter's clock.

use std::collections::HashSet;

use bson::{Bson, DateTime, Document};
use serde::Serialize;

use crate::ratelimit::error::RateLimitError;
use crate::ratelimit::limit::Priority;
use crate::ratelimit::ops;
use crate::ratelimit::plan::{self, View};
use crate::ratelimit::{RateLimitOptions, RateLimits};
use crate::repo::store::Store;

/// A limiter as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct LimiterReport {
    /// The limiter's name.
    pub limiter: String,
    /// The collection it is kept in.
    pub collection: String,
    /// The limiter's clock (the server's `$$NOW`) at the reading.
    pub now: chrono::DateTime<chrono::Utc>,
    /// Calls allowed in any interval of `window_ms`.
    pub calls: u32,
    /// The window, in milliseconds.
    pub window_ms: u64,
    /// Calls bulk callers never take (kept for high-priority callers).
    pub reserved: u32,
    /// How long after its grant a reservation's calls may be sent, in milliseconds.
    pub hold_ms: u64,
    /// How long a call sent at its deadline may take to arrive, in milliseconds.
    pub grace_ms: u64,
    /// How much longer than the window every call counts (for clock steps), in milliseconds.
    pub skew_ms: u64,
    /// Calls of bulk callers counted in the window ending now.
    pub counted_bulk: u32,
    /// Calls of high-priority callers counted in the window ending now.
    pub counted_high: u32,
    /// Calls of reservations granted and not settled yet whose end is still ahead (part of the
    /// counts above).
    pub pending: u32,
    /// The most a bulk caller would be granted now (after the live queued callers).
    pub room_bulk: u32,
    /// The most a high-priority caller would be granted now.
    pub room_high: u32,
    /// When one bulk call would be admitted, by the limiter's clock, as counted calls age out
    /// (the queue ahead staying as it is): `now` when there is room now, `None` when only the
    /// queue moving first can make room. A settlement returning calls may make it sooner.
    pub next_bulk: Option<chrono::DateTime<chrono::Utc>>,
    /// `next_bulk - now`, in milliseconds.
    pub next_bulk_in_ms: Option<u64>,
    /// When one high-priority call would be admitted (see `next_bulk`).
    pub next_high: Option<chrono::DateTime<chrono::Utc>>,
    /// `next_high - now`, in milliseconds.
    pub next_high_in_ms: Option<u64>,
    /// The reservations among the limiter's last 32 grants that it still counts and has no
    /// settlement of (older grants are counted in `pending` but not listed: the limiter keeps
    /// calls per slot of time, not per reservation).
    pub reservations: Vec<LimiterReservation>,
    /// Bulk callers queued for room, first come first served.
    pub waiting: Vec<WaitingCaller>,
}

/// Where an unsettled reservation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ReservationState {
    /// Its end is still ahead: its worker may still be making its calls.
    Pending,
    /// Its end has passed without a settlement: its worker died or did not settle. Its calls
    /// count in full until `counted_until`.
    Overdue,
    /// No settlement of it is among the limiter's last 32, but settlements made after its
    /// grant have left that list: it may have been settled.
    Unconfirmed,
}

/// A reservation the limiter still counts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct LimiterReservation {
    /// Its id (the same on every limiter it spans).
    pub id: String,
    /// Calls granted.
    pub calls: u32,
    /// `high` or `bulk`.
    pub priority: String,
    /// See [`ReservationState`].
    pub state: ReservationState,
    /// By when its calls reach the API (grant + hold + grace, rounded up to the limiter's slot);
    /// they had to be sent `grace_ms` before.
    pub ends_by: chrono::DateTime<chrono::Utc>,
    /// When the limiter stops counting it if it is never settled.
    pub counted_until: chrono::DateTime<chrono::Utc>,
}

/// A bulk caller waiting in the limiter's queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct WaitingCaller {
    /// Its queue key.
    pub key: String,
    /// Calls it asks for.
    pub calls: u32,
    /// When it first queued (its place).
    pub since: chrono::DateTime<chrono::Utc>,
    /// When the queue forgets it unless it comes back.
    pub expires: chrono::DateTime<chrono::Utc>,
}

/// Reads limiter `name` of `collection` in `store`'s database as [`RateLimits::report`] does,
/// without opening the collection: nothing is created or written (the `mongotx limiter`
/// command reads this way). An unknown limiter is [`RateLimitError::UnknownLimiter`].
pub async fn inspect(
    store: &Store,
    collection: &str,
    name: &str,
) -> Result<LimiterReport, RateLimitError> {
    let options = RateLimitOptions::default().collection(collection);
    RateLimits::unopened(store, options)?.report(name).await
}

/// The body of [`RateLimits::report`].
pub(crate) async fn report(rate: &RateLimits, name: &str) -> Result<LimiterReport, RateLimitError> {
    ops::check_name(rate, name)?;
    let doc = ops::read_doc(rate, name).await?;
    let view = ops::reading(rate, name, &doc)?;
    let reservations = unsettled(&view, &doc).map_err(|r| ops::malformed(rate, name, &r))?;
    let limit = view.limit;
    let usage = view.usage();
    let ms = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let ahead = view.ahead(None, view.now);
    let calls = limit.calls;
    let next = |priority| {
        let at = view.fits_at(1, priority, None);
        let after = at.map(|at| {
            u64::try_from(at.timestamp_millis() - view.now.timestamp_millis()).unwrap_or(0)
        });
        (at.map(DateTime::to_chrono), after)
    };
    let (next_bulk, next_bulk_in_ms) = next(Priority::Bulk);
    let (next_high, next_high_in_ms) = next(Priority::High);
    let mut waiting: Vec<WaitingCaller> = view
        .wait
        .iter()
        .filter(|w| w.exp >= view.now)
        .map(|w| WaitingCaller {
            key: w.key.clone(),
            calls: w.n,
            since: w.since.to_chrono(),
            expires: w.exp.to_chrono(),
        })
        .collect();
    waiting.sort_by(|a, b| (a.since, &a.key).cmp(&(b.since, &b.key)));
    Ok(LimiterReport {
        limiter: name.to_string(),
        collection: rate.options.collection.clone(),
        now: view.now.to_chrono(),
        calls,
        window_ms: ms(limit.window),
        reserved: limit.reserved,
        hold_ms: ms(limit.hold),
        grace_ms: ms(limit.grace),
        skew_ms: ms(limit.skew),
        counted_bulk: usage.bulk,
        counted_high: usage.high,
        pending: usage.pending,
        room_bulk: calls
            .saturating_sub(usage.bulk)
            .saturating_sub(limit.reserved.max(usage.high))
            .saturating_sub(ahead),
        room_high: calls.saturating_sub(usage.bulk).saturating_sub(usage.high),
        next_bulk,
        next_bulk_in_ms,
        next_high,
        next_high_in_ms,
        reservations,
        waiting,
    })
}

/// The recent grants of `doc` that still count and have no settlement among the recent ones.
fn unsettled(view: &View, doc: &Document) -> Result<Vec<LimiterReservation>, String> {
    let int = |d: &Document, k: &str| match d.get(k) {
        Some(Bson::Int64(v)) => Some(*v),
        Some(Bson::Int32(v)) => Some(i64::from(*v)),
        _ => None,
    };
    let settled: HashSet<&str> = doc
        .get_array("settled")
        .into_iter()
        .flatten()
        .filter_map(Bson::as_document)
        .filter_map(|s| s.get_str("k").ok())
        .collect();
    let evicted = int(doc, "evicted").unwrap_or(-1);
    let now = view.now.timestamp_millis();
    let span = plan::span_ms(&view.limit);
    let mut found = Vec::new();
    for (i, grant) in doc.get_array("granted").into_iter().flatten().enumerate() {
        let g = grant
            .as_document()
            .ok_or_else(|| format!("grant {i} is not a document"))?;
        let (Ok(key), Some(slot), Some(n), Ok(high), Some(seq)) = (
            g.get_str("k"),
            int(g, "s"),
            int(g, "n"),
            g.get_bool("p"),
            int(g, "q"),
        ) else {
            return Err(format!("grant {i} is incomplete"));
        };
        if settled.contains(key) {
            continue;
        }
        let ends_by = slot.saturating_add(1).saturating_mul(view.slot_ms) - 1;
        let counted_until = ends_by.saturating_add(span).saturating_add(1);
        if counted_until <= now {
            continue;
        }
        let state = if evicted > seq {
            ReservationState::Unconfirmed
        } else if ends_by >= now {
            ReservationState::Pending
        } else {
            ReservationState::Overdue
        };
        found.push(LimiterReservation {
            id: key.to_string(),
            calls: u32::try_from(n).unwrap_or(0),
            priority: if high { "high" } else { "bulk" }.to_string(),
            state,
            ends_by: DateTime::from_millis(ends_by).to_chrono(),
            counted_until: DateTime::from_millis(counted_until).to_chrono(),
        });
    }
    found.sort_by(|a, b| (a.ends_by, &a.id).cmp(&(b.ends_by, &b.id)));
    Ok(found)
}
