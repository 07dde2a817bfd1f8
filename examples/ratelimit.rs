//! The rate limiter: a bulk collector (three tasks) and two high-priority updaters share a
//! third-party API (a simulator) allowing 40 calls in any second, through one limiter with 6
//! calls reserved for the updaters: no call is refused, no second sees more than 40, and the
//! updaters wait milliseconds; then one reservation across a per-tenant and a global limiter,
//! granted on both or on neither, whose unused calls return at once when it is settled.
//!
//! ```sh
//! cargo run --example ratelimit                                   # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example ratelimit
//! ```

mod common;

use std::time::{Duration, Instant};

use common::{expect, step, TourResult};
use mongotx::ratelimit::{Attempt, Limit, Priority, RateLimits};
use mongotx::testkit::api_simulator::Simulator;
use mongotx::Store;

#[tokio::main]
async fn main() {
    common::main(
        "ratelimit",
        |example| async move { run(&example.store).await },
    )
    .await;
}

/// Every step of this example, on `store`'s database (about 5 s).
pub async fn run(store: &Store) -> TourResult {
    const CALLS: u32 = 40;
    let window = Duration::from_secs(1);
    let limits = RateLimits::open(store).await?;
    limits
        .define(
            "maps-api",
            Limit::new(CALLS, window)
                .reserved(6)
                .hold(Duration::from_millis(300)),
        )
        .await?;
    let api = Simulator::start(CALLS, window).await?;
    let http = reqwest::Client::new();
    step("Rate limiter: a bulk collector and two priority updaters call an API limited to 40 calls in any second, for 4 s");
    let until = Instant::now() + Duration::from_secs(4);
    let mut collectors = Vec::new();
    for _ in 0..3 {
        let (limits, http, url) = (limits.clone(), http.clone(), api.call_url());
        collectors.push(tokio::spawn(async move {
            let mut made = 0u32;
            while Instant::now() < until {
                let r = limits.reserve(&["maps-api"], 4, Priority::Bulk).await?;
                let mut used = 0;
                while used < r.calls() && r.usable() {
                    used += 1;
                    http.get(&url).send().await?;
                }
                limits.settle(&r, used).await?;
                made += used;
            }
            Ok::<u32, Box<dyn std::error::Error + Send + Sync>>(made)
        }));
    }
    let mut updaters = Vec::new();
    for i in 0..2u64 {
        let (limits, http, url) = (limits.clone(), http.clone(), api.call_url());
        updaters.push(tokio::spawn(async move {
            let mut waits = Vec::new();
            while Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(300 + 70 * i)).await;
                let asked = Instant::now();
                let r = limits.reserve(&["maps-api"], 1, Priority::High).await?;
                waits.push(asked.elapsed());
                http.get(&url).send().await?;
                limits.settle(&r, 1).await?;
            }
            Ok::<Vec<Duration>, Box<dyn std::error::Error + Send + Sync>>(waits)
        }));
    }
    let mut bulk_calls = 0;
    for c in collectors {
        bulk_calls += c.await?.map_err(|e| e.to_string())?;
    }
    let mut waits = Vec::new();
    for u in updaters {
        waits.extend(u.await?.map_err(|e| e.to_string())?);
    }
    waits.sort();
    let report = api.report();
    println!(
        "   the API saw {} calls ({bulk_calls} bulk, {} high priority), answered 429 to {}, \
         at most {} in any second; calls per second: {:?}",
        report.calls,
        waits.len(),
        report.rejected,
        report.max_in_any_window,
        report.per_window
    );
    println!(
        "   high-priority reserve latency while bulk saturates the limit: median {:?}, max {:?} ({} samples)",
        waits[waits.len() / 2],
        waits[waits.len() - 1],
        waits.len()
    );
    expect(report.rejected == 0, "no 429")?;
    expect(
        report.max_in_any_window <= CALLS,
        "no more than 40 calls in any second",
    )?;

    step("Rate limiter: one reservation on a tenant's limiter and the global one, or none");
    limits
        .define("tenant-7", Limit::new(3, Duration::from_secs(60)))
        .await?;
    limits
        .define("global", Limit::new(100, Duration::from_secs(60)))
        .await?;
    let first = limits
        .try_reserve(&["tenant-7", "global"], 3, Priority::Bulk)
        .await?;
    let second = limits
        .try_reserve(&["tenant-7", "global"], 1, Priority::Bulk)
        .await?;
    let global = limits.usage("global").await?;
    println!(
        "   first: {}; second: {}; global counts {} (the refused request took nothing from it)",
        matches!(first, Attempt::Granted(_))
            .then_some("granted")
            .unwrap_or("refused"),
        match second {
            Attempt::Granted(_) => "granted".to_string(),
            Attempt::Wait { after, .. } => format!("refused, room again in {after:?}"),
        },
        global.bulk
    );
    expect(
        global.bulk == 3,
        "the global limiter to count only the granted request",
    )?;
    if let Attempt::Granted(r) = first {
        let settled = limits.settle(&r, 1).await?;
        println!("   settled with 1 call made: {settled:?}");
        expect(
            limits.usage("global").await?.bulk == 1,
            "the unused calls returned at once",
        )?;
    }
    Ok(())
}
