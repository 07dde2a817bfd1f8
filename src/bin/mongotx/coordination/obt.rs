//! `mongotx obt ID`: an owner-based transaction's owner, stage, token and lease, or the
//! tombstone its release left.

use mongotx::obt::ObtReport;

use crate::coordination::{instant, instant_from, one_line, span};
use crate::{cli, output, Context};

/// The arguments of `mongotx obt`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The OBT id.
    id: String,
    /// The collection of OBTs (one token namespace).
    #[arg(long, default_value = mongotx::collections::OBTS_COLLECTION,
        value_parser = cli::collection_name)]
    collection: String,
}

/// Runs `mongotx obt`.
pub(crate) async fn run(ctx: &Context, args: Args) -> Result<(), String> {
    let report = mongotx::obt::inspect(&ctx.store, &args.collection, &args.id)
        .await
        .map_err(one_line)?;
    output::print(ctx, &report, text)
}

fn text(r: &ObtReport) -> Vec<String> {
    let dash = || "-".to_string();
    let mut lines = vec![
        format!("obt: {} (collection {})", r.id, r.collection),
        format!("state: {}", if r.released { "released" } else { "live" }),
        format!(
            "{}: {}",
            if r.released { "released by" } else { "owner" },
            r.owner.clone().unwrap_or_else(dash)
        ),
        format!("stage: {}", r.stage.map_or_else(dash, |s| s.to_string())),
        format!("token: {}", r.token),
    ];
    if let Some(at) = r.released_at {
        lines.push(format!("released at: {}", instant_from(at, r.now)));
    }
    if !r.released {
        lines.push(match (r.lease_ms, r.lease_until) {
            (Some(lease), Some(until)) => format!(
                "lease: {} from the last heartbeat; {} {}",
                span(lease),
                if r.lease_expired == Some(true) {
                    "ran out"
                } else {
                    "runs out"
                },
                instant_from(until, r.now)
            ),
            _ => "lease: none (only an explicit preemption takes it over)".to_string(),
        });
        if let Some(beat) = r.beat_at {
            lines.push(format!("last heartbeat: {}", instant_from(beat, r.now)));
        }
        lines.push(format!(
            "version: {}",
            r.version.map_or_else(dash, |v| v.to_string())
        ));
    }
    if let Some(txn) = &r.held_by {
        lines.push(format!(
            "held by transaction: {txn} (an owned commit in flight, or left for the GC)"
        ));
    }
    lines.push(format!("server time: {}", instant(r.now)));
    lines
}
