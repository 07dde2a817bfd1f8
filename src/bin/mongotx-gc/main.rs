//! The GC runner: finishes or rolls back expired transactions, purges old tombstones, returns
//! expired quota reservations and prunes idle rate limiters, one round per interval, until SIGINT
//! or SIGTERM (the current item is finished first). With `--metrics-addr` it serves Prometheus
//! metrics (the library's, `mongotx::metrics`, and the runner's own) and a health endpoint.

#[path = "../shared/cli.rs"]
mod cli;
mod metrics;

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use mongotx::gc::{GcOptions, GcPass};
use mongotx::{GcRunner, Store};

/// The longest `--interval` accepted (a GC that runs less than daily leaves dead coordinators'
/// documents held for days).
const MAX_INTERVAL: Duration = Duration::from_secs(24 * 3600);

/// Recovers transactions left behind by dead coordinators.
#[derive(Debug, Parser)]
#[command(name = "mongotx-gc", version)]
struct Args {
    /// MongoDB connection string.
    #[arg(long, env = "MONGODB_URI")]
    uri: String,
    /// Database to collect.
    #[arg(long, value_parser = cli::database_name)]
    db: String,
    /// Pause between rounds (e.g. 30s, 5m; more than zero, at most a day).
    #[arg(long, default_value = "30s", value_parser = interval)]
    interval: Duration,
    /// Run one round and exit.
    #[arg(long)]
    once: bool,
    /// Expired transaction records read and resolved at once (a page; a round goes through
    /// every page).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=GcOptions::MAX_BATCH_SIZE as i64))]
    batch_size: u32,
    /// Purge tombstones deleted longer ago than this (e.g. 7d); tombstones are kept if unset.
    #[arg(long, value_parser = cli::parse_duration)]
    tombstone_retention: Option<Duration>,
    /// How long a raised version floor stands before tombstones under it are purged; other
    /// processes re-read floors four times as often (more than zero: with none, a process that
    /// has not re-read the floor could repeat a purged document's version).
    #[arg(long, default_value = "20s", value_parser = version_floor_grace)]
    version_floor_grace: Duration,
    /// How long to look for the server before giving up (more than zero, at most an hour).
    #[arg(long, default_value = "10s", value_parser = cli::connect_timeout)]
    connect_timeout: Duration,
    /// Collection of ActiveTransaction documents.
    #[arg(long, default_value = mongotx::collections::TRANSACTIONS_COLLECTION, value_parser = cli::collection_name)]
    transactions_collection: String,
    /// Skip the quota sweep (returning expired reservations), which otherwise runs every round
    /// in a database that has quota providers.
    #[arg(long)]
    no_quota: bool,
    /// Skip the rate-limiter sweep (pruning limiters nobody writes to), which otherwise runs
    /// every round in a database that has limiters.
    #[arg(long)]
    no_ratelimit: bool,
    /// Serve Prometheus metrics (`/metrics`) and a health check (`/health`) on this address
    /// (port 0 picks a free one; the address is printed).
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
}

#[tokio::main]
async fn main() -> ExitCode {
    // Logs go to stderr, coloured only on a terminal: stdout carries the summary lines (for
    // scripts and `--once`), and a log collector reading a pipe gets plain text.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            // One line on stderr, where the logs go too: logging it as well would say it twice.
            eprintln!("mongotx-gc: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Parses `--interval`: more than zero (rounds back to back would hammer the server), at most
/// [`MAX_INTERVAL`].
fn interval(text: &str) -> Result<Duration, String> {
    cli::duration_within(text, MAX_INTERVAL)
}

/// Parses `--version-floor-grace`: more than zero, at most a day.
fn version_floor_grace(text: &str) -> Result<Duration, String> {
    cli::duration_within(text, Duration::from_secs(24 * 3600))
}

async fn run(args: Args) -> Result<(), String> {
    let client = cli::connect(&args.uri, "--uri", "mongotx-gc", args.connect_timeout).await?;
    let db = client.database(&args.db);
    cli::ping(&db).await?;

    let store = Store::builder(db)
        .transactions_collection(args.transactions_collection.clone())
        .version_floor_grace(args.version_floor_grace)
        .build();
    let gc_options = GcOptions::default()
        .batch_size(args.batch_size as usize)
        .tombstone_retention(args.tombstone_retention);
    let metrics = Arc::new(metrics::Runner::new(args.interval));
    if let Some(addr) = args.metrics_addr {
        let exporter = metrics::install()?;
        let bound = metrics::serve(addr, Arc::clone(&metrics), exporter).await?;
        println!("metrics: http://{bound}/metrics, health: http://{bound}/health");
        tracing::info!(%bound, "serving metrics");
    }
    let runner = GcRunner::new(&store, gc_options)
        .interval(args.interval)
        .quota_sweep(!args.no_quota)
        .ratelimit_sweep(!args.no_ratelimit);
    tracing::info!(db = %args.db, interval = ?args.interval, once = args.once, "GC runner started");
    if args.once {
        let pass = runner.pass().await;
        report(&pass, &metrics);
        if let Err(e) = &pass.round {
            return Err(format!("GC round failed: {e}"));
        }
        if let Some(Err(e)) = &pass.quota {
            return Err(format!("quota sweep failed: {e}"));
        }
        if let Some(Err(e)) = &pass.ratelimit {
            return Err(format!("rate-limiter sweep failed: {e}"));
        }
    } else {
        // The server was reachable at start: an outage now is waited out, not fatal.
        runner
            .run(shutdown_signal()?, |pass| report(pass, &metrics))
            .await;
    }
    // The runner's own work is done by now; this waits for any background work of the store
    // (none unless a transaction was committed through it), as every service stopping should.
    let report = store.shutdown(Duration::from_secs(10)).await;
    tracing::info!(
        finished = report.finished,
        unfinished = report.unfinished,
        "GC runner stopped"
    );
    Ok(())
}

/// Prints one line per part of a pass and feeds the runner's metrics (the library counted the
/// round itself).
fn report(pass: &GcPass, metrics: &metrics::Runner) {
    metrics.round(pass.round.as_ref().map_err(|_| ()));
    match &pass.round {
        Ok(summary) => println!(
            "round: finished={} rolled_back={} swept={} skipped={} purged={} left_to_claims={}",
            summary.finished,
            summary.rolled_back,
            summary.swept,
            summary.skipped,
            summary.purged,
            summary.left_to_claims
        ),
        Err(e) => {
            tracing::warn!(error = %e, "GC round failed; retrying next round");
            println!("round: failed ({e})");
        }
    }
    match &pass.quota {
        Some(Ok(swept)) => {
            metrics.quota_sweep(swept.expired, swept.pruned);
            println!("quota: expired={} pruned={}", swept.expired, swept.pruned);
        }
        Some(Err(e)) => {
            metrics.sweep_failed();
            tracing::warn!(error = %e, "quota sweep failed; retrying next round");
            println!("quota: failed ({e})");
        }
        None => {}
    }
    match &pass.ratelimit {
        Some(Ok(pruned)) => {
            metrics.ratelimit_sweep(*pruned);
            println!("ratelimit: pruned={pruned}");
        }
        Some(Err(e)) => {
            metrics.sweep_failed();
            tracing::warn!(error = %e, "rate-limiter sweep failed; retrying next round");
            println!("ratelimit: failed ({e})");
        }
        None => {}
    }
    // Last, on a line of its own: the lines above stay as scripts and older parsers read them.
    println!("pass: took_ms={}", pass.took.as_millis());
}

/// Completes on SIGINT or SIGTERM; the runner then finishes its current item and returns.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>, String> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term =
            signal(SignalKind::terminate()).map_err(|e| format!("cannot watch SIGTERM: {e}"))?;
        let mut int =
            signal(SignalKind::interrupt()).map_err(|e| format!("cannot watch SIGINT: {e}"))?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::info!("signal received: finishing the current item, then exiting");
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async move {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}
