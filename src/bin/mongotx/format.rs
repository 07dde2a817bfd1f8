//! `mongotx format`: the stored format the database writes and which formats every instance
//! reads; `mongotx format set N` switches the written format once every live instance reads it
//! (the gate of `mongotx::format`, docs/format.md).

use std::time::Duration;

use mongotx::format::FormatStatus;

use crate::coordination::{instant, one_line};
use crate::{output, Context};

/// The arguments of `mongotx format`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    action: Option<Action>,
}

/// What to do besides showing the format.
#[derive(Debug, clap::Subcommand)]
enum Action {
    /// Switches the database to write stored format N: refused (nothing written) while a live
    /// instance reads only older formats, or when this release does not read N.
    Set {
        /// The format to write from now on.
        #[arg(value_parser = clap::value_parser!(i64).range(1..))]
        format: i64,
    },
}

/// Runs `mongotx format`.
pub(crate) async fn run(ctx: &Context, args: Args) -> Result<(), String> {
    let (status, switched) = match args.action {
        None => (ctx.store.format_status().await, false),
        Some(Action::Set { format }) => (ctx.store.set_format(format).await, true),
    };
    // Switching announced this command as an instance: it is not one that keeps running.
    ctx.store.shutdown(Duration::from_secs(2)).await;
    let status = status.map_err(one_line)?;
    output::print(ctx, &status, |s| text(s, switched))
}

fn text(s: &FormatStatus, switched: bool) -> Vec<String> {
    let mut lines = Vec::new();
    if switched {
        lines.push(format!(
            "switched: the database writes format {} from now on",
            s.writes
        ));
    }
    lines.push(format!("writes: format {}", s.writes));
    lines.push(format!("reads:  formats 1 to {} (this mongotx)", s.reads));
    // This command's own announcement (made to switch) is gone once it exits.
    let others: Vec<_> = s.instances.iter().filter(|i| i.id != s.instance).collect();
    let live = others.iter().filter(|i| i.live).count();
    lines.push(format!(
        "instances: {live} live, {} lapsed",
        others.len() - live
    ));
    for i in others {
        lines.push(format!(
            "  {} {}: reads 1 to {}, writes {}; mongotx {} on {} (pid {}), seen {}",
            if i.live { "live  " } else { "lapsed" },
            i.id,
            i.reads,
            i.writes,
            i.release,
            i.host,
            i.pid,
            instant(i.seen)
        ));
    }
    lines
}
