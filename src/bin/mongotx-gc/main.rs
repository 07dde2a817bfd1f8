//! The GC runner: finishes or rolls back expired transactions, purges old tombstones, returns
//! expired quota reservations and prunes idle rate limiters, one round per interval, until SIGINT
//! or SIGTERM (the current item is finished first). With `--metrics-addr` it serves Prometheus
//! metrics and a health endpoint.

#[path = "../shared/cli.rs"]
mod cli;
mod metrics;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use mongotx::{parse_duration, Gc, GcOptions, Store};

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
    #[arg(long, value_parser = parse_duration)]
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
    #[arg(long, default_value = mongotx::TRANSACTIONS_COLLECTION, value_parser = cli::collection_name)]
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            tracing::error!("{message}");
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
    let gc = Gc::with_store(
        &store,
        GcOptions::default()
            .batch_size(args.batch_size as usize)
            .tombstone_retention(args.tombstone_retention),
    );
    let metrics = Arc::new(metrics::Metrics::new(args.interval));
    if let Some(addr) = args.metrics_addr {
        let bound = metrics::serve(addr, Arc::clone(&metrics)).await?;
        println!("metrics: http://{bound}/metrics, health: http://{bound}/health");
        tracing::info!(%bound, "serving metrics");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let wake = Arc::new(tokio::sync::Notify::new());
    spawn_signal_watch(Arc::clone(&stop), Arc::clone(&wake))?;
    tracing::info!(db = %args.db, interval = ?args.interval, once = args.once, "GC runner started");

    loop {
        let started = Instant::now();
        let round = match store.server_time().await {
            Ok(now) => gc.run_round_at(now, &stop).await,
            Err(e) => Err(mongotx::TxnError::Clock {
                txn: None,
                source: e,
            }),
        };
        metrics.round(started.elapsed(), round.as_ref().map_err(|_| ()));
        match round {
            Ok(summary) => println!(
                "round: finished={} rolled_back={} swept={} skipped={} purged={}",
                summary.finished,
                summary.rolled_back,
                summary.swept,
                summary.skipped,
                summary.purged
            ),
            Err(e) if args.once => return Err(format!("GC round failed: {e}")),
            // The server was reachable at start: an outage now is waited out, not fatal.
            Err(e) => {
                tracing::warn!(error = %e, "GC round failed; retrying next round");
                println!("round: failed ({e})");
            }
        }
        if !args.no_quota && !stop.load(Ordering::SeqCst) {
            match sweep_quota(&store).await {
                Ok(Some(swept)) => {
                    metrics.quota_sweep(swept.expired, swept.pruned);
                    println!("quota: expired={} pruned={}", swept.expired, swept.pruned)
                }
                Ok(None) => {}
                Err(e) if args.once => return Err(format!("quota sweep failed: {e}")),
                Err(e) => {
                    metrics.sweep_failed();
                    tracing::warn!(error = %e, "quota sweep failed; retrying next round");
                    println!("quota: failed ({e})");
                }
            }
        }
        if !args.no_ratelimit && !stop.load(Ordering::SeqCst) {
            match sweep_ratelimits(&store).await {
                Ok(Some(pruned)) => {
                    metrics.ratelimit_sweep(pruned);
                    println!("ratelimit: pruned={pruned}");
                }
                Ok(None) => {}
                Err(e) if args.once => return Err(format!("rate-limiter sweep failed: {e}")),
                Err(e) => {
                    metrics.sweep_failed();
                    tracing::warn!(error = %e, "rate-limiter sweep failed; retrying next round");
                    println!("ratelimit: failed ({e})");
                }
            }
        }
        if args.once || stop.load(Ordering::SeqCst) {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(args.interval) => {}
            _ = wake.notified() => {}
        }
        if stop.load(Ordering::SeqCst) {
            break;
        }
    }
    tracing::info!("GC runner stopped");
    Ok(())
}

/// Sets `stop` on SIGINT or SIGTERM; the round in progress finishes its current item.
/// Returns expired reservations, if this database has quota providers at all (so that the GC
/// never creates the quota collection where nobody uses it).
async fn sweep_quota(store: &Store) -> Result<Option<mongotx::quota::SweepSummary>, String> {
    let names = store
        .database()
        .list_collection_names()
        .await
        .map_err(|e| format!("list collections: {e}"))?;
    if !names
        .iter()
        .any(|n| n == mongotx::quota::PROVIDERS_COLLECTION)
    {
        return Ok(None);
    }
    let quota = mongotx::quota::Quota::open(store)
        .await
        .map_err(|e| e.to_string())?;
    quota.sweep().await.map(Some).map_err(|e| e.to_string())
}

/// Prunes the limiters, if this database has any (so that the GC never creates the collection).
async fn sweep_ratelimits(store: &Store) -> Result<Option<u64>, String> {
    let names = store
        .database()
        .list_collection_names()
        .await
        .map_err(|e| format!("list collections: {e}"))?;
    if !names
        .iter()
        .any(|n| n == mongotx::ratelimit::LIMITERS_COLLECTION)
    {
        return Ok(None);
    }
    let limits = mongotx::ratelimit::RateLimits::open(store)
        .await
        .map_err(|e| e.to_string())?;
    limits.sweep().await.map(Some).map_err(|e| e.to_string())
}

fn spawn_signal_watch(stop: Arc<AtomicBool>, wake: Arc<tokio::sync::Notify>) -> Result<(), String> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term =
            signal(SignalKind::terminate()).map_err(|e| format!("cannot watch SIGTERM: {e}"))?;
        let mut int =
            signal(SignalKind::interrupt()).map_err(|e| format!("cannot watch SIGINT: {e}"))?;
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::info!("signal received: finishing the current item, then exiting");
            stop.store(true, Ordering::SeqCst);
            wake.notify_one();
        });
    }
    #[cfg(not(unix))]
    {
        tokio::spawn(async move {
            let _ = tokio::signal::ctrl_c().await;
            stop.store(true, Ordering::SeqCst);
            wake.notify_one();
        });
    }
    Ok(())
}
