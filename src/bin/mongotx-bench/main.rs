//! Latency benchmarks: mongotx operations against the raw driver baseline, measured in one run.

mod adoption;
#[path = "../shared/cli.rs"]
mod cli;
#[path = "../shared/font.rs"]
mod font;
mod gc;
mod network;
mod obt;
mod plots;
mod queue;
mod quota;
mod ratelimit;
mod scale;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, Document};
use clap::Parser;
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use mongodb::options::ClientOptions;
use mongodb::Client;
use mongotx::testkit::test_server::TestServer;
use mongotx::{Adjust, CollectionSpec, Store, Transactions, Update};
use serde::{Deserialize, Serialize};

/// Measures per-operation round-trip latency of mongotx and of the raw driver on the same server.
#[derive(Debug, Parser)]
#[command(name = "mongotx-bench", version)]
struct Args {
    /// Operations per measurement (1 to 10,000,000).
    #[arg(long, default_value_t = 1000, value_parser = count(1))]
    n: usize,
    /// Warm-up operations before each measurement, not counted (0 to 10,000,000).
    #[arg(long, default_value_t = 200, value_parser = count(0))]
    warmup: usize,
    /// Run only these rows (all by default).
    #[arg(long, value_enum)]
    only: Option<Section>,
    /// One-way latencies (ms, at most 10000) toxiproxy adds for the network rows.
    #[arg(long, value_delimiter = ',', default_value = "0,1,5",
          value_parser = clap::value_parser!(u64).range(0..=10_000))]
    latencies: Vec<u64>,
    /// Samples per network row, after a fifth as many warm-up ones (1 to 10,000,000).
    #[arg(long, default_value_t = 100, value_parser = count(1))]
    net_samples: usize,
    /// Seconds each transfer-throughput measurement runs (1 to 3600).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=3600))]
    seconds: u64,
    /// How long to look for the server (MONGODB_URI's, or the local one) before giving up.
    #[arg(long, default_value = "10s", value_parser = cli::connect_timeout)]
    connect_timeout: Duration,
    /// Where the network rows' charts go (SVG and PNG).
    #[arg(long, default_value = "tools/bench-results")]
    plots: std::path::PathBuf,
    /// A TrueType font for the charts' text (DejaVu Sans is looked for by default).
    #[arg(long)]
    font: Option<std::path::PathBuf>,
    /// Plain documents the adoption row adopts (1,000 to 10,000,000).
    #[arg(long, default_value_t = 100_000, value_parser = count(1_000))]
    adopt_docs: usize,
}

/// Groups of rows that can be run alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Section {
    /// Repository operations and transaction commits.
    Core,
    /// The quota module.
    Quota,
    /// Owner-based transactions.
    Obt,
    /// The rate limiter.
    Ratelimit,
    /// The batch queue.
    Queue,
    /// Commits, domain operations and transfer throughput behind toxiproxy at set latencies.
    Network,
    /// Query cost next to held documents, commits up to 256 documents.
    Scale,
    /// GC throughput by backlog and by where the coordinators died, one and two runners.
    Gc,
    /// Adopting existing data: explicit adoption against a raw updateMany, plain against
    /// stamped reads.
    Adoption,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Account {
    #[serde(rename = "_id")]
    pub(crate) id: String,
    pub(crate) owner: String,
    pub(crate) balance: i64,
}

/// Latency percentiles of one measurement.
pub(crate) struct Stats {
    pub(crate) median: Duration,
    pub(crate) p90: Duration,
    pub(crate) p99: Duration,
}

pub(crate) fn stats(mut samples: Vec<Duration>) -> Stats {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    Stats {
        median: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
    }
}

/// A client that counts the commands it starts (handshakes and heartbeats are not command
/// events; a `hello` counted is a server-clock sample, a round trip of the operation like any
/// other). Only for counting: with a command monitor the driver builds an owned copy of every
/// command and reply for it, which cost a rate-limiter reserve (a 2.5 KB pipeline) some 150 µs
/// of client CPU, so latencies are timed on a [`plain_client`] and round trips counted on this
/// one, in untimed operations beside the timed ones.
pub(crate) async fn counting_client(
    server: &TestServer,
    commands: Arc<AtomicU64>,
) -> Result<Client, Box<dyn std::error::Error + Send + Sync>> {
    let mut options = ClientOptions::parse(server.uri()).await?;
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(_) = event {
            commands.fetch_add(1, Ordering::Relaxed);
        }
    }));
    Ok(Client::with_options(options)?)
}

/// A client with no command monitor, the one latencies are timed on.
pub(crate) async fn plain_client(
    server: &TestServer,
) -> Result<Client, Box<dyn std::error::Error + Send + Sync>> {
    Ok(Client::with_uri_str(server.uri()).await?)
}

pub(crate) fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The most operations or samples a count flag takes: more would run for days, and the samples
/// of one measurement are kept in memory.
const MAX_COUNT: u64 = 10_000_000;

/// A clap parser of a count from `min` to [`MAX_COUNT`].
fn count(min: u64) -> impl clap::builder::TypedValueParser<Value = usize> {
    use clap::builder::TypedValueParser;
    clap::value_parser!(u64)
        .range(min..=MAX_COUNT)
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
}

/// Prints the charts written, or why they were not.
fn report_charts(written: Result<Vec<std::path::PathBuf>, String>) {
    match written {
        Ok(files) => {
            println!("\ncharts:");
            for file in files {
                println!("  {}", file.display());
            }
        }
        Err(e) => println!("\ncharts not drawn: {e}"),
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match bench(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Display, on one line: `main` returning the error would print its Debug form.
            eprintln!("mongotx-bench: {}", cli::one_line(&e.to_string()));
            std::process::ExitCode::FAILURE
        }
    }
}

async fn bench(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let server = TestServer::start()?;
    let client = cli::connect(
        server.uri(),
        "MONGODB_URI",
        "mongotx-bench",
        args.connect_timeout,
    )
    .await?;
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

    let run = |section| args.only.is_none() || args.only == Some(section);
    if run(Section::Core) {
        core_rows(&db, &args).await?;
    }
    if run(Section::Quota) {
        let rows = quota::rows(&server, &db, args.n)
            .await
            .map_err(|e| -> Box<dyn std::error::Error> { e })?;
        report_charts(plots::write_quota(&args.plots, args.font.as_deref(), &rows));
    }
    if run(Section::Obt) {
        obt::rows(&db, args.n)
            .await
            .map_err(|e| -> Box<dyn std::error::Error> { e })?;
    }
    if run(Section::Ratelimit) {
        let rows = ratelimit::rows(&server, db.name(), args.n)
            .await
            .map_err(|e| -> Box<dyn std::error::Error> { e })?;
        report_charts(plots::write_ratelimit(
            &args.plots,
            args.font.as_deref(),
            &rows,
        ));
    }
    if run(Section::Queue) {
        queue::rows(&db)
            .await
            .map_err(|e| -> Box<dyn std::error::Error> { e })?;
    }
    if run(Section::Adoption) {
        adoption::rows(&db, args.n, args.adopt_docs)
            .await
            .map_err(|e| -> Box<dyn std::error::Error> { e })?;
    }
    if run(Section::Scale) {
        let measured = scale::rows(server.uri(), db.name(), 50)
            .await
            .map_err(|e| -> Box<dyn std::error::Error> { e })?;
        report_charts(plots::write_scale(
            &args.plots,
            args.font.as_deref(),
            &measured,
        ));
    }
    if run(Section::Gc) {
        let rows = gc::rows(server.uri(), db.name())
            .await
            .map_err(|e| -> Box<dyn std::error::Error> { e })?;
        report_charts(plots::write_gc(&args.plots, args.font.as_deref(), &rows));
    }
    if run(Section::Network) {
        let runs = network::rows(
            server.uri(),
            db.name(),
            &args.latencies,
            args.net_samples,
            args.seconds,
        )
        .await
        .map_err(|e| -> Box<dyn std::error::Error> { e })?;
        report_charts(plots::write(&args.plots, args.font.as_deref(), &runs));
    }
    db.drop().await?;
    Ok(())
}

/// Repository operations next to the raw driver, then transaction commit latency.
async fn core_rows(db: &mongodb::Database, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let store = Store::new(db.clone());
    let spec = CollectionSpec::new(
        "accounts",
        1,
        include_str!("../../../schemas/accounts.json"),
    )?;
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
            include_str!("../../../schemas/accounts.json"),
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
    Ok(())
}
