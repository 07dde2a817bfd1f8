//! `mongotx queue SERVICE`: a service's open batches in order, what a submitter sends next by
//! the queue's one-round rule, the service's slot, and how far behind it is.

use std::time::Duration;

use mongotx::queue::{BatchReport, BatchState, QueueReport};

use crate::coordination::{instant, instant_from, one_line, span};
use crate::{cli, output, Context};

/// The arguments of `mongotx queue`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The service id.
    service: String,
    /// The collection of batches.
    #[arg(long, default_value = mongotx::collections::BATCHES_COLLECTION,
        value_parser = cli::collection_name)]
    collection: String,
    /// The queue's delay window (as its `Batches` was opened with): when a delayed batch is
    /// sent again.
    #[arg(long, default_value = "15s", value_parser = delay)]
    delay: Duration,
}

/// Clap parser of `--delay`: any duration up to the queue's longest.
fn delay(text: &str) -> Result<Duration, String> {
    let delay = cli::parse_duration(text)?;
    if delay > mongotx::queue::MAX_DELAY {
        return Err(format!(
            "{text:?}: must be at most {:?}",
            mongotx::queue::MAX_DELAY
        ));
    }
    Ok(delay)
}

/// Runs `mongotx queue`.
pub(crate) async fn run(ctx: &Context, args: Args) -> Result<(), String> {
    let report = mongotx::queue::inspect(&ctx.store, &args.collection, args.delay, &args.service)
        .await
        .map_err(one_line)?;
    output::print(ctx, &report, text)
}

/// Where `b` stands, in words.
fn state(b: &BatchReport, now: chrono::DateTime<chrono::Utc>) -> String {
    let by = b.claimed_by.as_deref().unwrap_or("?");
    let until = || {
        b.claimed_until
            .map_or_else(|| "?".to_string(), |u| instant_from(u, now))
    };
    match b.state {
        BatchState::Queued => "never sent; queued now".to_string(),
        BatchState::Waiting => "never sent; waits for an earlier batch".to_string(),
        BatchState::InFlight => format!("in flight: claimed by {by} until {}", until()),
        BatchState::ClaimExpired => format!(
            "claimed by {by}, whose claim ran out {} with no answer recorded: a monitor asks the ledger",
            until()
        ),
        BatchState::Pending => "at the ledger (pending)".to_string(),
        BatchState::Valid => "valid at the ledger, not committed yet (keeps the slot)".to_string(),
        BatchState::Unknown => "unknown to the ledger: queued now, to be sent again".to_string(),
        BatchState::Delayed => match b.retry_at {
            Some(at) if at > now => format!("delayed: queued again {}", instant_from(at, now)),
            _ => "delayed: queued now, to be sent again".to_string(),
        },
        _ => "?".to_string(),
    }
}

fn text(r: &QueueReport) -> Vec<String> {
    let head = r.open.first();
    let mut lines = vec![
        format!("service: {} (collection {})", r.service, r.collection),
        format!("open batches: {} ({} done)", r.open.len(), r.done),
        format!(
            "behind: {}",
            r.behind_ms.map_or_else(
                || "no (nothing open)".to_string(),
                |ms| format!("{} (the oldest open batch's age)", span(ms))
            )
        ),
    ];
    let next = r
        .next
        .as_ref()
        .and_then(|h| r.open.iter().find(|b| &b.header == h));
    lines.push(match (next, head) {
        (Some(b), _) => {
            let mut line = format!("next: {}: {}", b.header, state(b, r.now));
            if let Some(slot) = r.slot.as_ref().filter(|s| s.header != b.header) {
                line.push_str(&format!(
                    "; its claim is refused at the slot until {} is done",
                    slot.header
                ));
            }
            line
        }
        (None, Some(b)) => format!(
            "next: none queued now; first in line is {}: {}",
            b.header,
            state(b, r.now)
        ),
        (None, None) => "next: none (nothing open)".to_string(),
    });
    lines.push(match &r.slot {
        Some(slot) => format!(
            "slot: {} (taken by {}{})",
            slot.header,
            slot.by.as_deref().unwrap_or("?"),
            match slot.until {
                // The queue lets a taking run out at once by setting it to the epoch, when its
                // batch came back unknown or delayed: printed as a date that would read as noise.
                Some(u) if u.timestamp_millis() <= 0 => {
                    "; let run out for the batch to be taken again".to_string()
                }
                Some(u) => format!(" until {}", instant_from(u, r.now)),
                None => String::new(),
            }
        ),
        None => "slot: free".to_string(),
    });
    lines.push(format!("mark: {}", r.mark.as_deref().unwrap_or("-")));
    lines.push(format!("delay window: {}", span(r.delay_ms)));
    if !r.open.is_empty() {
        lines.push("batches in order:".to_string());
    }
    for b in &r.open {
        lines.push(format!(
            "  {} (created {}): {}",
            b.header,
            instant(b.created_at),
            state(b, r.now)
        ));
    }
    lines.push(format!("server time: {}", instant(r.now)));
    lines
}
