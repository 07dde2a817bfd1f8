//! Latency benchmarks: mongotx operations against the raw driver baseline, measured in one run.

use std::time::{Duration, Instant};

use bson::{doc, Document};
use clap::Parser;
use mongodb::Client;
use mongotx::test_server::TestServer;
use mongotx::{Adjust, CollectionSpec, Store, Transactions, Update};
use serde::{Deserialize, Serialize};

/// Measures per-operation round-trip latency of mongotx and of the raw driver on the same server.
#[derive(Debug, Parser)]
#[command(name = "mongotx-bench", version)]
struct Args {
    /// Operations per measurement.
    #[arg(long, default_value_t = 1000)]
    n: usize,
    /// Warm-up operations before each measurement (not counted).
    #[arg(long, default_value_t = 200)]
    warmup: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Account {
    #[serde(rename = "_id")]
    id: String,
    owner: String,
    balance: i64,
}

/// Latency percentiles of one measurement.
struct Stats {
    median: Duration,
    p90: Duration,
    p99: Duration,
}

fn stats(mut samples: Vec<Duration>) -> Stats {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    Stats {
        median: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
    }
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.n == 0 {
        return Err("--n must be at least 1".into());
    }
    let server = TestServer::start()?;
    let client = Client::with_uri_str(server.uri()).await?;
    let db = client.database(&format!(
        "mongotx_bench_{}",
        bson::oid::ObjectId::new().to_hex()
    ));
    println!(
        "server: {} at {}; n = {} per operation (after {} warm-up)",
        server.kind(),
        server.uri(),
        args.n,
        args.warmup
    );

    let store = Store::new(db.clone());
    let spec = CollectionSpec::new("accounts", 1, include_str!("../../schemas/accounts.json"))?;
    let repo = store.repository::<Account>(spec).await?;
    let raw = db.collection::<Document>("raw_accounts");

    let total = args.n + args.warmup;
    let mut results: Vec<(&str, Stats)> = Vec::new();
    // Each phase interleaves the raw driver baseline (same document shapes, no stamping, checks or
    // validation) with the mongotx call, alternating which goes first, so server warm-up (the
    // local server is a JVM) and drift affect both sides equally.
    let first = |i: usize| i.is_multiple_of(2);

    let (mut base, mut ours) = (Vec::with_capacity(total), Vec::with_capacity(total));
    for i in 0..total {
        let d = doc! { "_id": format!("r{i}"), "owner": "O", "balance": 0_i64, "_schema": 1_i64, "_version": 1_i64 };
        let a = Account {
            id: format!("m{i}"),
            owner: "O".into(),
            balance: 0,
        };
        for turn in [first(i), !first(i)] {
            let t = Instant::now();
            if turn {
                raw.insert_one(&d).await?;
                base.push(t.elapsed());
            } else {
                repo.insert(&a).await?;
                ours.push(t.elapsed());
            }
        }
    }
    results.push(("driver insert_one", stats(base.split_off(args.warmup))));
    results.push(("mongotx insert", stats(ours.split_off(args.warmup))));

    let (mut base, mut ours) = (Vec::with_capacity(total), Vec::with_capacity(total));
    for i in 0..total {
        for turn in [first(i), !first(i)] {
            let t = Instant::now();
            if turn {
                raw.find_one(doc! { "_id": format!("r{i}") }).await?;
                base.push(t.elapsed());
            } else {
                repo.get(format!("m{i}")).await?;
                ours.push(t.elapsed());
            }
        }
    }
    results.push(("driver find_one by _id", stats(base.split_off(args.warmup))));
    results.push(("mongotx get", stats(ours.split_off(args.warmup))));

    let (mut base, mut ours) = (Vec::with_capacity(total), Vec::with_capacity(total));
    let update = Update::new().set("owner", "P");
    for i in 0..total {
        for turn in [first(i), !first(i)] {
            let t = Instant::now();
            if turn {
                let r = raw
                    .update_one(
                        doc! { "_id": format!("r{i}"), "_version": 1_i64, "_txn": null, "_deleted": null },
                        doc! { "$set": { "owner": "P", "_version": 2_i64 } },
                    )
                    .await?;
                base.push(t.elapsed());
                if r.matched_count != 1 {
                    return Err("raw conditional update matched nothing".into());
                }
            } else {
                repo.update(format!("m{i}"), 1, &update).await?;
                ours.push(t.elapsed());
            }
        }
    }
    results.push((
        "driver conditional update_one",
        stats(base.split_off(args.warmup)),
    ));
    results.push((
        "mongotx update (conditional)",
        stats(ours.split_off(args.warmup)),
    ));

    println!(
        "\n{:<32} {:>12} {:>12} {:>12}",
        "operation", "median µs", "p90 µs", "p99 µs"
    );
    for (name, s) in &results {
        println!(
            "{:<32} {:>12.1} {:>12.1} {:>12.1}",
            name,
            micros(s.median),
            micros(s.p90),
            micros(s.p99)
        );
    }
    println!("\nmedian ratio mongotx / driver (same run):");
    for (theirs, ours) in [(0, 1), (2, 3), (4, 5)] {
        let ratio = results[ours].1.median.as_secs_f64() / results[theirs].1.median.as_secs_f64();
        println!(
            "  {:<30} {:>6.2}x  (vs {})",
            results[ours].0, ratio, results[theirs].0
        );
    }

    // Transaction commit latency for k documents, against one conditional update (same run).
    let txns = Transactions::new(&store);
    let rounds = (args.n / 5).max(20);
    let single = results[5].1.median.as_secs_f64();
    println!("\ncommit latency (commit() only, staging excluded), {rounds} commits each:");
    println!(
        "{:<32} {:>12} {:>12} {:>14}",
        "transaction", "median µs", "p90 µs", "/ one update"
    );
    // The last row spreads 16 documents over 16 collections: a server that serializes writes per
    // collection (mongo-java-server) can then overlap the concurrent applies and finishes, as
    // MongoDB does within one collection.
    let mut spread = Vec::new();
    for c in 0..16 {
        let spec = CollectionSpec::new(
            format!("spread{c}"),
            1,
            include_str!("../../schemas/accounts.json"),
        )?;
        spread.push(store.repository::<Account>(spec).await?);
    }
    let rows = [
        ("k = 1 adjusts", vec![repo.clone()]),
        ("k = 4 adjusts", vec![repo.clone(); 4]),
        ("k = 16 adjusts", vec![repo.clone(); 16]),
        ("k = 16, 16 collections", spread),
    ];
    for (label, repos) in rows {
        let k = repos.len();
        let ids: Vec<String> = (0..k).map(|i| format!("{label}-{i}")).collect();
        for (repo, id) in repos.iter().zip(&ids) {
            repo.insert(&Account {
                id: id.clone(),
                owner: "T".into(),
                balance: 0,
            })
            .await?;
        }
        let mut samples = Vec::with_capacity(rounds);
        let warmup = rounds / 5;
        for round in 0..rounds + warmup {
            let tx = txns.begin();
            let version = round as i64 + 1;
            for (repo, id) in repos.iter().zip(&ids) {
                tx.adjust(
                    repo,
                    id.as_str(),
                    version,
                    &Adjust::new().by("balance", 1_i64),
                )
                .await?;
            }
            let t = Instant::now();
            tx.commit().await?;
            samples.push(t.elapsed());
        }
        let s = stats(samples.split_off(warmup));
        println!(
            "{:<32} {:>12.1} {:>12.1} {:>13.2}x",
            label,
            micros(s.median),
            micros(s.p90),
            s.median.as_secs_f64() / single
        );
    }
    quota_rows(&server, &db, args.n).await?;
    db.drop().await?;
    Ok(())
}

/// Quota rows: single-provider consume latency and round trips against one conditional update,
/// 32 consumers on one hot provider against raw `$inc` updates, and a 3-resource consume.
async fn quota_rows(
    server: &TestServer,
    db: &mongodb::Database,
    n: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    use mongotx::quota::{NewProvider, Quota, Request};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    let commands = Arc::new(AtomicU64::new(0));
    let mut options = mongodb::options::ClientOptions::parse(server.uri()).await?;
    let seen = Arc::clone(&commands);
    options.command_event_handler = Some(mongodb::event::EventHandler::callback(move |event| {
        if let mongodb::event::command::CommandEvent::Started(started) = event {
            if !matches!(
                started.command_name.as_str(),
                "hello" | "isMaster" | "ismaster"
            ) {
                seen.fetch_add(1, Ordering::Relaxed);
            }
        }
    }));
    let client = Client::with_options(options)?;
    let db = client.database(db.name());
    let store = Store::new(db.clone());
    let quota = Quota::open(&store).await?;
    let raw = db.collection::<Document>("raw_providers");
    let one = NewProvider::new(("bench", "single"), i64::MAX / 4);
    quota.create(one).await?;
    raw.insert_one(bson::doc! { "_id": "single", "available": i64::MAX / 4, "usage": 0_i64 })
        .await?;

    let warmup = (n / 5).max(20);
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    let mut round_trips = 0;
    for i in 0..n + warmup {
        let request = Request::new(format!("c{i}")).take(("bench", "single"), 1);
        let before = commands.load(Ordering::Relaxed);
        let t = Instant::now();
        quota.consume(&request).await?;
        let took = t.elapsed();
        let sent = commands.load(Ordering::Relaxed) - before;
        let t = Instant::now();
        raw.update_one(
            bson::doc! { "_id": "single", "available": { "$gte": 1_i64 } },
            bson::doc! { "$inc": { "available": -1_i64, "usage": 1_i64 } },
        )
        .await?;
        let base_took = t.elapsed();
        if i >= warmup {
            ours.push(took);
            base.push(base_took);
            round_trips += sent;
        }
        // Keep the provider small, as a real one is: release every 50 consumes.
        if i % 50 == 49 {
            for j in i - 49..=i {
                quota.release(&format!("c{j}")).await?;
            }
        }
    }
    let (ours, base) = (stats(ours), stats(base));
    println!("\nquota ({n} samples each, interleaved):");
    println!(
        "{:<40} {:>12} {:>12} {:>14}",
        "operation", "median µs", "p90 µs", "/ one update"
    );
    println!(
        "{:<40} {:>12.1} {:>12.1} {:>13.2}x",
        "conditional update (driver)",
        micros(base.median),
        micros(base.p90),
        1.0
    );
    println!(
        "{:<40} {:>12.1} {:>12.1} {:>13.2}x   round trips per consume: {:.2}",
        "consume, one provider",
        micros(ours.median),
        micros(ours.p90),
        ours.median.as_secs_f64() / base.median.as_secs_f64(),
        round_trips as f64 / n as f64
    );

    // A 3-resource consume (one transaction), released after each sample.
    for resource in ["cores", "ram", "disk"] {
        quota
            .create(NewProvider::new(("bench3", resource), i64::MAX / 4))
            .await?;
    }
    let mut three = Vec::new();
    for i in 0..(n / 5).max(20) {
        let request = Request::new(format!("m{i}"))
            .take(("bench3", "cores"), 1)
            .take(("bench3", "ram"), 1)
            .take(("bench3", "disk"), 1);
        let t = Instant::now();
        quota.consume(&request).await?;
        three.push(t.elapsed());
        quota.release(&format!("m{i}")).await?;
    }
    let three = stats(three);
    println!(
        "{:<40} {:>12.1} {:>12.1} {:>13.2}x",
        "consume, three providers",
        micros(three.median),
        micros(three.p90),
        three.median.as_secs_f64() / base.median.as_secs_f64()
    );

    // 32 consumers on one hot provider against 32 raw `$inc` writers, 2 s each, same run.
    let window = Duration::from_secs(2);
    quota
        .create(NewProvider::new(("bench", "hot"), i64::MAX / 4))
        .await?;
    raw.insert_one(bson::doc! { "_id": "hot", "available": i64::MAX / 4, "usage": 0_i64 })
        .await?;
    let (consumes, writes) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let until = Instant::now() + window;
    let mut tasks = Vec::new();
    for task in 0..32 {
        let (quota, consumes, writes) = (quota.clone(), consumes.clone(), writes.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = 0;
            while Instant::now() < until {
                i += 1;
                let request = Request::new(format!("h{task}-{i}")).take(("bench", "hot"), 1);
                if let Ok(done) = quota.consume(&request).await {
                    consumes.fetch_add(1, Ordering::Relaxed);
                    writes.fetch_add(u64::from(done.writes), Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let incs = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + window;
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (raw, incs) = (raw.clone(), incs.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < until {
                if raw
                    .update_one(
                        bson::doc! { "_id": "hot", "available": { "$gte": 1_i64 } },
                        bson::doc! { "$inc": { "available": -1_i64, "usage": 1_i64 } },
                    )
                    .await
                    .is_ok()
                {
                    incs.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let secs = window.as_secs_f64();
    let (consumes, writes, incs) = (
        consumes.load(Ordering::Relaxed),
        writes.load(Ordering::Relaxed),
        incs.load(Ordering::Relaxed),
    );
    println!(
        "32 consumers, one hot provider: {:.0} consumes/s vs {:.0} raw $inc/s = {:.2}x; retries per consume {:.3}",
        consumes as f64 / secs,
        incs as f64 / secs,
        consumes as f64 / incs.max(1) as f64,
        writes.saturating_sub(consumes) as f64 / consumes.max(1) as f64
    );
    Ok(())
}
