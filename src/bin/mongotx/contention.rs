//! `mongotx contention`: the collections (and, sampled, the documents) with the most conflicts
//! and aborts across every instance, from the contention record the library keeps.

use std::time::Duration;

use mongotx::admin::ContentionReport;

use crate::coordination::{count, duration, instant, one_line};
use crate::{cli, output, Context};

/// The longest `--since`: the record keeps a day.
const MAX_SINCE: Duration = Duration::from_secs(24 * 3600);

/// The arguments of `mongotx contention`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// How far back to count (the record keeps a day), from the start of the minute that
    /// falls in.
    #[arg(long, default_value = "1h", value_parser = since)]
    since: Duration,
    /// How many collections to show, most contended first.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..=1000))]
    top: u16,
}

/// Clap parser of `--since`: more than zero, at most a day.
fn since(text: &str) -> Result<Duration, String> {
    cli::duration_within(text, MAX_SINCE)
}

/// Runs `mongotx contention`.
pub(crate) async fn run(ctx: &Context, args: Args) -> Result<(), String> {
    let report = mongotx::admin::contention(&ctx.store, args.since, usize::from(args.top))
        .await
        .map_err(one_line)?;
    let since = args.since;
    output::print(ctx, &report, |r| text(r, since))
}

fn text(r: &ContentionReport, since: Duration) -> Vec<String> {
    let mut lines = vec![
        format!(
            "contention since {} (the last {}, every instance)",
            instant(r.since),
            duration(since)
        ),
        format!(
            "total: {}, {} in {}",
            count(r.conflicts, "conflict"),
            count(r.aborts, "abort"),
            count(
                u64::try_from(r.collections_seen).unwrap_or(u64::MAX),
                "collection"
            )
        ),
    ];
    if r.collections.len() < r.collections_seen {
        lines.push(format!("showing the top {}", r.collections.len()));
    }
    for (i, c) in r.collections.iter().enumerate() {
        lines.push(format!(
            "{}. {}: {}, {} ({} with any)",
            i + 1,
            c.collection,
            count(c.conflicts, "conflict"),
            count(c.aborts, "abort"),
            count(c.minutes, "minute")
        ));
        if !c.documents.is_empty() {
            let sampled: Vec<String> = c
                .documents
                .iter()
                .map(|d| format!("{} ({})", d.id, d.samples))
                .collect();
            lines.push(format!("   sampled documents: {}", sampled.join(", ")));
        }
    }
    lines.push(format!("server time: {}", instant(r.now)));
    lines
}
