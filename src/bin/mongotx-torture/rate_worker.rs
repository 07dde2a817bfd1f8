//! A rate-limited worker process: bulk tasks that reserve a few calls at a time and make them,
//! and high-priority tasks that make one or two calls now and then, all against one HTTP API
//! through one limiter. It reports on stdout, a line per event, so a parent that kills it knows
//! what it held:
//!
//! - `grant <id> <calls> <bulk|high>` when a reservation is granted (before any call);
//! - `settle <id> <made>` when it is settled;
//! - `wait <µs> <unix ms> <bulk|high>` for each reservation: the time it took to be granted,
//!   and when it was asked;
//! - `status <code>` for any answer of the API other than 200.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use mongodb::Client;
use mongotx::ratelimit::{CallReservation, Priority, RateLimitError, RateLimits};
use mongotx::Store;

/// Arguments of a rate-limited worker.
#[derive(Debug, Args, Clone)]
pub(crate) struct RateWorkerArgs {
    /// Connection string of the server.
    #[arg(long)]
    uri: String,
    /// Database holding the limiters.
    #[arg(long, value_parser = crate::cli::database_name)]
    db: String,
    /// The limiter.
    #[arg(long)]
    limiter: String,
    /// The URL of one API call.
    #[arg(long)]
    api: String,
    /// Bulk tasks (0 to 1024).
    #[arg(long, default_value_t = 4, value_parser = tasks)]
    bulk_tasks: usize,
    /// Calls per bulk reservation (at least 1).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    chunk: u32,
    /// High-priority tasks (0 to 1024).
    #[arg(long, default_value_t = 1, value_parser = tasks)]
    priority_tasks: usize,
    /// Calls per high-priority reservation: 1 up to this many (at least 1).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    priority_calls: u32,
    /// Mean time between two high-priority reservations of one task.
    #[arg(long, value_parser = crate::duration, default_value = "1s")]
    priority_every: Duration,
    /// How long to run (killed processes stop sooner).
    #[arg(long = "for", value_parser = crate::duration, default_value = "1h")]
    run_for: Duration,
}

/// Clap parser of a task count: 0 to 1024 (each task keeps a pooled connection warm).
fn tasks(text: &str) -> Result<usize, String> {
    let n: usize = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a whole number"))?;
    if n > 1024 {
        return Err(format!("{n} is not in 0..=1024"));
    }
    Ok(n)
}

/// Runs a worker process until `--for` has passed.
pub(crate) async fn rate_worker(args: RateWorkerArgs) -> Result<(), String> {
    // A warm pool: a high-priority call should not wait for a connection to be opened.
    let mut options = mongodb::options::ClientOptions::parse(&args.uri)
        .await
        .map_err(|e| format!("bad --uri: {}", crate::cli::describe(&e)))?;
    // Looks for a server for 5 s, as the other processes do (they are restarted when they give up).
    options.server_selection_timeout = Some(Duration::from_secs(5));
    options.min_pool_size =
        Some(u32::try_from(args.bulk_tasks + args.priority_tasks + 1).unwrap_or(4));
    let client = Client::with_options(options)
        .map_err(|e| format!("bad --uri: {}", crate::cli::describe(&e)))?;
    client
        .database("admin")
        .run_command(bson::doc! { "ping": 1 })
        .await
        .map_err(|e| {
            format!(
                "cannot reach the server within 5s: {}",
                crate::cli::describe(&e)
            )
        })?;
    let store = Store::new(client.database(&args.db));
    let limits = RateLimits::open(&store)
        .await
        .map_err(|e| format!("open: {e}"))?;
    let http = reqwest::Client::new();
    let until = Instant::now() + args.run_for;
    let args = Arc::new(args);
    let mut tasks = Vec::new();
    for _ in 0..args.bulk_tasks {
        let (limits, http, args) = (limits.clone(), http.clone(), args.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < until {
                let asked = Instant::now();
                let r = limits
                    .reserve(&[&args.limiter], args.chunk, Priority::Bulk)
                    .await;
                say_wait(asked, Priority::Bulk);
                use_reservation(&limits, &http, &args.api, r).await?;
            }
            Ok::<(), String>(())
        }));
    }
    for task in 0..args.priority_tasks {
        let (limits, http, args) = (limits.clone(), http.clone(), args.clone());
        tasks.push(tokio::spawn(async move {
            // Seeded per process and task: workers started together must not ask together.
            let mut i = (u64::from(std::process::id()) << 8) | task as u64;
            while Instant::now() < until {
                // Spread the callers: 0.5 to 1.5 times the mean, varied by a simple sequence.
                i = i
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let spread = 0.5 + (i >> 40) as f64 / (1u64 << 24) as f64;
                tokio::time::sleep(args.priority_every.mul_f64(spread)).await;
                let calls = 1 + (i >> 20) as u32 % args.priority_calls.max(1);
                let asked = Instant::now();
                let r = limits
                    .reserve(&[&args.limiter], calls, Priority::High)
                    .await;
                say_wait(asked, Priority::High);
                use_reservation(&limits, &http, &args.api, r).await?;
            }
            Ok::<(), String>(())
        }));
    }
    for task in tasks {
        task.await.map_err(|e| format!("task: {e}"))??;
    }
    Ok(())
}

/// Makes the calls of a reservation (each sent before its deadline), then settles it.
async fn use_reservation(
    limits: &RateLimits,
    http: &reqwest::Client,
    api: &str,
    reservation: Result<CallReservation, RateLimitError>,
) -> Result<(), String> {
    let reservation = match reservation {
        Ok(r) => r,
        Err(e) if e.is_retryable() => {
            eprintln!("rate worker: {e}; trying again");
            return Ok(());
        }
        Err(e) => return Err(format!("reserve: {e}")),
    };
    let kind = priority_name(reservation.priority());
    say(&format!(
        "grant {} {} {kind}",
        reservation.id().to_hex(),
        reservation.calls()
    ));
    let mut made = 0;
    while made < reservation.calls() && reservation.usable() {
        // A call sent counts as made whatever its answer; one that fails to send may still
        // have reached the API, so it counts too.
        made += 1;
        match http.get(api).send().await {
            Ok(answer) if answer.status().is_success() => {}
            Ok(answer) => say(&format!("status {}", answer.status().as_u16())),
            Err(e) => eprintln!("rate worker: call failed: {e}"),
        }
    }
    match limits.settle(&reservation, made).await {
        Ok(_) => say(&format!("settle {} {made}", reservation.id().to_hex())),
        Err(e) => eprintln!("rate worker: settle: {e}"),
    }
    Ok(())
}

/// The word a line says for `priority`.
fn priority_name(priority: Priority) -> &'static str {
    match priority {
        Priority::High => "high",
        Priority::Bulk => "bulk",
    }
}

/// Says how long a reservation of `priority` asked at `asked` took to be granted (or refused),
/// and when it was asked (unix ms).
fn say_wait(asked: Instant, priority: Priority) {
    let waited = asked.elapsed();
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
        .saturating_sub(waited.as_millis());
    say(&format!(
        "wait {} {at} {}",
        waited.as_micros(),
        priority_name(priority)
    ));
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}
