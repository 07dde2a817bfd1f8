//! Rate-limiter rows: reserve and settle latency next to one conditional update, with the round
//! trips a reserve sends; reserve + settle throughput with 32 workers next to 32 workers doing
//! the two raw updates a counter would need (take one if there is one, give it back).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, Document};
use mongodb::Collection;
use mongotx::ratelimit::{Attempt, Limit, Priority, RateLimits};
use mongotx::testkit::test_server::TestServer;
use mongotx::Store;

use crate::{counting_client, micros, plain_client, stats};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Concurrent workers of the throughput row.
const WORKERS: usize = 32;
/// How long each throughput contender runs.
const RUN: Duration = Duration::from_secs(2);

/// One size row: reserve and settle medians as ratios to one conditional update of the same run.
pub(crate) struct SizeRow {
    /// Calls per window (N).
    pub(crate) calls: u32,
    /// Granted, unsettled reservations on the limiter.
    pub(crate) outstanding: usize,
    /// High-priority reserve / one update.
    pub(crate) reserve: f64,
    /// Settle / one update.
    pub(crate) settle: f64,
}

/// The rows; returns the size rows for the chart.
pub(crate) async fn rows(
    server: &TestServer,
    db_name: &str,
    n: usize,
) -> Result<Vec<SizeRow>, Error> {
    let commands = Arc::new(AtomicU64::new(0));
    let client = plain_client(server).await?;
    let db = client.database(&format!("{db_name}_ratelimit"));
    let limits = RateLimits::open(&Store::new(db.clone())).await?;
    // The same limiters through a counting client: round trips are counted there, untimed.
    let counting = counting_client(server, Arc::clone(&commands)).await?;
    let counted = RateLimits::open(&Store::new(counting.database(db.name()))).await?;
    let raw: Collection<Document> = db.collection("raw_counter");
    raw.insert_one(doc! { "_id": "c", "available": i64::MAX / 2 })
        .await?;

    println!("\nrate limiter ({n} samples each, interleaved with one conditional update):");
    println!(
        "{:<46} {:>10} {:>10} {:>14} {:>12}",
        "operation", "median µs", "p90 µs", "/ one update", "round trips"
    );
    // An hour's window, so nothing ages out during a row: N calls per hour with `outstanding`
    // reservations granted and never settled (a worker fleet's calls in flight, or dead
    // workers'), the sizes a service meets; each sample's own grants are settled with none made,
    // so the limiter keeps exactly that load.
    let mut measured = Vec::new();
    let sizes: [(u32, usize); 7] = [
        (10, 0),
        (1_000, 0),
        (1_000, 100),
        (100_000, 0),
        (100_000, 100),
        (100_000, 1_000),
        (100_000, 5_000),
    ];
    for (calls, outstanding) in sizes {
        let name = format!("api-{calls}-{outstanding}");
        limits
            .define(
                &name,
                Limit::new(calls, Duration::from_secs(3600))
                    .reserved(calls / 10)
                    .hold(Duration::from_secs(3600)),
            )
            .await?;
        let filling = Instant::now();
        // Never settled: dropping a reservation leaves it counted until it ages out.
        let mut kept = Vec::with_capacity(outstanding);
        for _ in 0..outstanding {
            kept.push(limits.reserve(&[&name], 1, Priority::Bulk).await?);
        }
        let filled = filling.elapsed();
        let (mut high, mut bulk, mut settle, mut base) = (vec![], vec![], vec![], vec![]);
        let mut sent = 0u64;
        let warmup = (n / 5).max(20);
        for i in 0..n + warmup {
            let t = Instant::now();
            let granted = limits.try_reserve(&[&name], 1, Priority::High).await?;
            let reserved = t.elapsed();
            let Attempt::Granted(r) = granted else {
                return Err("a reserve was refused on an idle limiter".into());
            };
            let before = commands.load(Ordering::Relaxed);
            let Attempt::Granted(c) = counted.try_reserve(&[&name], 1, Priority::High).await?
            else {
                return Err("a reserve was refused on an idle limiter".into());
            };
            let after = commands.load(Ordering::Relaxed);
            counted.settle(&c, 0).await?;
            let t = Instant::now();
            limits.settle(&r, 0).await?;
            let settled = t.elapsed();
            let t = Instant::now();
            let b = limits.reserve(&[&name], 1, Priority::Bulk).await?;
            let bulked = t.elapsed();
            limits.settle(&b, 0).await?;
            let t = Instant::now();
            raw.update_one(
                doc! { "_id": "c", "available": { "$gte": 1_i64 } },
                doc! { "$inc": { "available": -1_i64 } },
            )
            .await?;
            let one = t.elapsed();
            if i >= warmup {
                high.push(reserved);
                settle.push(settled);
                bulk.push(bulked);
                base.push(one);
                sent += after - before;
            }
        }
        let base = stats(base);
        let (high, settle) = (stats(high), stats(settle));
        let ratio = |s: &crate::Stats| s.median.as_secs_f64() / base.median.as_secs_f64();
        measured.push(SizeRow {
            calls,
            outstanding,
            reserve: ratio(&high),
            settle: ratio(&settle),
        });
        let row = |label: String, s: &crate::Stats, trips: String| {
            println!(
                "{:<46} {:>10.1} {:>10.1} {:>13.2}x {:>12}",
                label,
                micros(s.median),
                micros(s.p90),
                s.median.as_secs_f64() / base.median.as_secs_f64(),
                trips
            );
        };
        row("conditional update (driver)".into(), &base, "1".into());
        let size = format!("N {calls}, {outstanding} outstanding");
        row(
            format!("reserve, high priority ({size})"),
            &high,
            format!("{:.2}", sent as f64 / n as f64),
        );
        row(
            format!("reserve, bulk ({size})"),
            &stats(bulk),
            String::new(),
        );
        row(format!("settle ({size})"), &settle, String::new());
        if outstanding > 0 {
            println!(
                "  (granting the {outstanding} outstanding reservations took {:.1} s)",
                filled.as_secs_f64()
            );
        }
    }

    // Throughput: a limit far above what the workers can use, and a short window, so the log
    // stays small and nothing is refused; what is measured is the cost of the protocol.
    limits
        .define("hot", Limit::new(1_000_000, Duration::from_millis(100)))
        .await?;
    let hot = limits.clone();
    let ours = for_run(move || {
        let limits = hot.clone();
        async move {
            let r = limits.reserve(&["hot"], 1, Priority::Bulk).await?;
            limits.settle(&r, 1).await?;
            Ok(())
        }
    })
    .await?;
    let counter = raw.clone();
    let theirs = for_run(move || {
        let raw = counter.clone();
        async move {
            raw.update_one(
                doc! { "_id": "c", "available": { "$gte": 1_i64 } },
                doc! { "$inc": { "available": -1_i64 } },
            )
            .await?;
            raw.update_one(doc! { "_id": "c" }, doc! { "$inc": { "available": 1_i64 } })
                .await?;
            Ok(())
        }
    })
    .await?;
    let per_second = |n: u64| n as f64 / RUN.as_secs_f64();
    println!(
        "reserve + settle, {WORKERS} workers for {} s on one limiter: {:.0}/s vs two raw conditional updates {:.0}/s = {:.2}x",
        RUN.as_secs(),
        per_second(ours),
        per_second(theirs),
        per_second(ours) / per_second(theirs).max(f64::MIN_POSITIVE)
    );
    utilisation(&limits).await?;
    db.drop().await?;
    Ok(measured)
}

/// Steady-state utilisation: workers keep a limiter busy, each reserving a few calls and making
/// a random part of them (a call that fails early, a batch cut short); unused calls go back at
/// once. What counts is how many calls were made per window against the N the limit allows: the
/// slots count a call until the end of its slot is a window old, so the limiter may grant a
/// little less than N in some windows.
async fn utilisation(limits: &RateLimits) -> Result<(), Error> {
    const CALLS: u32 = 100;
    const WINDOW: Duration = Duration::from_secs(1);
    const WARM: Duration = Duration::from_secs(2);
    const MEASURED: Duration = Duration::from_secs(8);
    limits.define("steady", Limit::new(CALLS, WINDOW)).await?;
    // When each made call was granted, by this process's clock.
    let made: Arc<std::sync::Mutex<Vec<Instant>>> = Arc::default();
    let start = Instant::now();
    let until = start + WARM + MEASURED;
    let mut tasks = Vec::new();
    for worker in 0..16_u64 {
        let (limits, made) = (limits.clone(), Arc::clone(&made));
        tasks.push(tokio::spawn(async move {
            // A small deterministic generator per worker (xorshift): the bench wants no extra
            // crate for a handful of random numbers.
            let mut x = 0x9E37_79B9_7F4A_7C15_u64 ^ (worker + 1);
            let mut next = move |below: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % below
            };
            while Instant::now() < until {
                let want = 1 + next(4) as u32;
                let r = limits.reserve(&["steady"], want, Priority::Bulk).await?;
                let granted = Instant::now();
                let used = next(u64::from(want) + 1) as u32;
                tokio::time::sleep(Duration::from_millis(2 + next(6))).await;
                limits.settle(&r, used).await?;
                if let Ok(mut made) = made.lock() {
                    made.extend(std::iter::repeat_n(granted, used as usize));
                }
            }
            Ok::<(), Error>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let made = made.lock().map(|m| m.clone()).unwrap_or_default();
    let from = start + WARM;
    let in_run = made.iter().filter(|t| **t >= from && **t < until).count();
    let windows = MEASURED.as_secs_f64() / WINDOW.as_secs_f64();
    let mean = in_run as f64 / windows / f64::from(CALLS);
    // The fullest and the emptiest window of the measured part, in 100 ms steps.
    let mut sorted = made.clone();
    sorted.sort_unstable();
    let (mut fullest, mut emptiest) = (0_usize, usize::MAX);
    let mut at = from;
    while at + WINDOW <= until {
        let lo = sorted.partition_point(|t| *t < at);
        let hi = sorted.partition_point(|t| *t < at + WINDOW);
        fullest = fullest.max(hi - lo);
        emptiest = emptiest.min(hi - lo);
        at += Duration::from_millis(100);
    }
    println!(
        "steady state, {CALLS} calls per {WINDOW:?}, 16 workers reserving 1-4 and making a random part: \
         {:.1} % of N made per window on average (emptiest window {:.1} %, fullest {:.1} %, by this process's clock)",
        mean * 100.0,
        emptiest as f64 * 100.0 / f64::from(CALLS),
        fullest as f64 * 100.0 / f64::from(CALLS),
    );
    Ok(())
}

/// Runs `op` in a loop from `WORKERS` tasks for `RUN`; returns how many completed (an error
/// ends the run with it).
async fn for_run<F, Fut>(op: F) -> Result<u64, Error>
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), Error>> + Send,
{
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + RUN;
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let (op, done) = (op.clone(), Arc::clone(&done));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < until {
                op().await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<(), Error>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(done.load(Ordering::Relaxed))
}
