//! `mongotx limiter NAME`: a rate limiter's limit, the calls it counts now, the reservations it
//! still counts, the bulk callers waiting, and when the next call would be admitted.

use mongotx::ratelimit::{LimiterReport, ReservationState};

use crate::coordination::{count, instant, instant_from, one_line, span};
use crate::{cli, output, Context};

/// The arguments of `mongotx limiter`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The limiter's name.
    name: String,
    /// The collection of limiters.
    #[arg(long, default_value = mongotx::collections::LIMITERS_COLLECTION,
        value_parser = cli::collection_name)]
    collection: String,
}

/// Runs `mongotx limiter`.
pub(crate) async fn run(ctx: &Context, args: Args) -> Result<(), String> {
    let report = mongotx::ratelimit::inspect(&ctx.store, &args.collection, &args.name)
        .await
        .map_err(one_line)?;
    output::print(ctx, &report, text)
}

fn next(
    what: &str,
    at: Option<chrono::DateTime<chrono::Utc>>,
    now: chrono::DateTime<chrono::Utc>,
) -> String {
    match at {
        Some(at) if at <= now => format!("next {what} call: now"),
        Some(at) => format!("next {what} call: {}", instant_from(at, now)),
        None => format!("next {what} call: after the bulk callers queued ahead of it"),
    }
}

fn text(r: &LimiterReport) -> Vec<String> {
    let mut lines = vec![
        format!("limiter: {} (collection {})", r.limiter, r.collection),
        format!(
            "limit: {} per {} ({} reserved for high priority; hold {}, grace {}, skew {})",
            count(r.calls, "call"),
            span(r.window_ms),
            r.reserved,
            span(r.hold_ms),
            span(r.grace_ms),
            span(r.skew_ms)
        ),
        format!(
            "counted: {} of {} in the window ending now (bulk {}, high {})",
            r.counted_bulk + r.counted_high,
            r.calls,
            r.counted_bulk,
            r.counted_high
        ),
        format!(
            "pending: {} of reservations not settled",
            count(r.pending, "call")
        ),
        format!("room now: bulk {}, high {}", r.room_bulk, r.room_high),
        next("bulk", r.next_bulk, r.now),
        next("high-priority", r.next_high, r.now),
        format!(
            "reservations: {} unsettled among the last 32 grants",
            r.reservations.len()
        ),
    ];
    for g in &r.reservations {
        let state = match g.state {
            ReservationState::Pending => "pending",
            ReservationState::Overdue => "overdue (ended without a settlement)",
            ReservationState::Unconfirmed => "unconfirmed (its settlement may have been forgotten)",
            _ => "unknown",
        };
        lines.push(format!(
            "  {}: {} {}, {state}, ends by {}, counted until {}",
            g.id,
            g.priority,
            count(g.calls, "call"),
            instant(g.ends_by),
            instant_from(g.counted_until, r.now)
        ));
    }
    lines.push(format!(
        "waiting: {}",
        count(
            u64::try_from(r.waiting.len()).unwrap_or(u64::MAX),
            "bulk caller"
        )
    ));
    for w in &r.waiting {
        lines.push(format!(
            "  {}: {}, queued since {}, leaves the queue {}",
            w.key,
            count(w.calls, "call"),
            instant(w.since),
            instant_from(w.expires, r.now)
        ));
    }
    lines.push(format!("server time: {}", instant(r.now)));
    lines
}
