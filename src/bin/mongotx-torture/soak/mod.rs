//! The soak run (`mongotx-torture soak --minutes N`): every system of mongotx at once for a long
//! time, sampled every `--interval`, and judged on trends rather than on one moment.
//!
//! At work together, in one database of the local test server (or `MONGODB_URI`'s), with no
//! network faults (the torture run is the place for those; the soak looks for what builds up):
//!
//! - two bank workers making transfers (killed with SIGKILL at random and started again, as in
//!   the torture run) and a checker whose read-only transactions must see the exact total;
//! - a quota worker consuming and releasing across a two-level hierarchy (`quota_run`);
//! - a rate-limited worker, bulk and high-priority reservations through one limiter to the API
//!   simulator served here;
//! - two OBT owners, each killed now and then and started again, which then preempts the OBT
//!   from its dead predecessor and heartbeats;
//! - a batch-queue worker submitting the batches added here (five a second, over five services)
//!   to the ledger simulator served here;
//! - two `mongotx-gc` runners (one of them purging tombstones after 20 s);
//! - adoption: every 5 s, plain documents inserted raw into the `plain` collection, adopted by a
//!   `mongotx-adopt` process, and those adopted before deleted through mongotx (tombstones for
//!   the GC to purge);
//! - retention: the journal's entries and settled batches deleted after 20 s (`load`).
//!
//! Every sample (`sample`) goes to `samples.jsonl` in `--out` and as a line to stdout; at the end
//! the faults stop, the run recovers and checks as the torture run does (total exact, nothing
//! held, no record, the quota invariants, no ledger breach, no 429 from the API), the trend rules
//! (`trend`) judge the samples, and the charts (`charts`) are drawn beside them.

pub(crate) mod charts;
mod load;
mod sample;
mod trend;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::oid::ObjectId;
use clap::Args;
use mongotx::queue::Batches;
use mongotx::ratelimit::{Limit, RateLimits};
use mongotx::testkit::api_simulator::Simulator;
use mongotx::testkit::ledger::{Faults, Ledger};
use mongotx::testkit::ledger_http::LedgerServer;
use mongotx::testkit::test_server::TestServer;
use mongotx::Query;
use rand::Rng;

use crate::chaos::{jitter, recover};
use crate::children::{Kind, Programs, Recipe, Slot, Version};
use crate::quota_run::QuotaRun;
use crate::roles::{account_id, accounts_spec, Account, Bank};
use load::{add_batches, adoption, retention, Adoption, Timings};
use sample::{Sample, Window};

/// Arguments of a soak run.
#[derive(Debug, Clone, Args)]
pub(crate) struct SoakArgs {
    /// How long the systems run, in minutes (1 to 30 days' worth).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=30 * 24 * 60))]
    minutes: u64,
    /// Time between two samples.
    #[arg(long, default_value = "10s", value_parser = crate::duration)]
    interval: Duration,
    /// Directory for `samples.jsonl` and the charts (default `target/soak/<time>`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Mean pause between two SIGKILLs (of an OBT owner and of a bank worker in turn, one of the
    /// kind at random).
    #[arg(long, default_value = "10s", value_parser = crate::duration)]
    kill_every: Duration,
    /// A TrueType font for the charts (DejaVu Sans is looked for by default).
    #[arg(long)]
    font: Option<PathBuf>,
}

const ACCOUNTS: usize = 10;
const BALANCE: i64 = 1_000;
const TXN_TIMEOUT: Duration = Duration::from_secs(3);
const OBT_LEASE: Duration = Duration::from_secs(2);
/// The limiter: below the bulk tasks' demand, so reservations queue.
const CALLS: u32 = 100;
const WINDOW: Duration = Duration::from_secs(2);

pub(crate) async fn run(args: SoakArgs) -> Result<(), String> {
    let programs = Programs::find(None)?;
    let (torture, gc) = {
        let (_, build) = programs.nth(0);
        (build.torture.clone(), build.gc.clone())
    };
    let adopt = torture.with_file_name("mongotx-adopt");
    if !adopt.is_file() {
        return Err(format!(
            "{} not found (cargo build --bin mongotx-adopt)",
            adopt.display()
        ));
    }
    let out = args.out.clone().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("target/soak/{secs}"))
    });
    std::fs::create_dir_all(&out).map_err(|e| format!("create {}: {e}", out.display()))?;
    let samples_path = out.join("samples.jsonl");
    let mut samples_file = std::fs::File::create(&samples_path)
        .map_err(|e| format!("create {}: {e}", samples_path.display()))?;

    let server = tokio::task::spawn_blocking(TestServer::start)
        .await
        .map_err(|e| format!("start the server: {e}"))?
        .map_err(|e| e.to_string())?;
    let uri = server.uri().to_string();
    let db_name = format!("mongotx_soak_{}", ObjectId::new().to_hex());
    let direct = crate::cli::connect(
        &uri,
        "MONGODB_URI",
        "mongotx-torture",
        Duration::from_secs(10),
    )
    .await?;
    let db = direct.database(&db_name);
    println!(
        "soak: {} minutes, a sample every {:?}, samples in {}",
        args.minutes,
        args.interval,
        samples_path.display()
    );

    // The systems' data.
    let bank = Bank {
        uri: uri.clone(),
        db: db_name.clone(),
        accounts: ACCOUNTS,
        txn_timeout: TXN_TIMEOUT,
        collections: 1,
    };
    let (store, accounts) = bank.open().await?;
    for i in 0..ACCOUNTS {
        accounts
            .of(i)
            .insert(&Account {
                id: account_id(i),
                owner: format!("owner {i}"),
                balance: BALANCE,
                note: None,
            })
            .await
            .map_err(|e| format!("seed: {e}"))?;
    }
    let total = BALANCE * ACCOUNTS as i64;
    let quota = QuotaRun::create(&store, &db).await?;
    let limits = RateLimits::open(&store)
        .await
        .map_err(|e| format!("open the limiters: {e}"))?;
    let limit = Limit::new(CALLS, WINDOW)
        .reserved(10)
        .hold(Duration::from_millis(500))
        .grace(Duration::from_millis(100));
    limits
        .define("api", limit)
        .await
        .map_err(|e| format!("define the limiter: {e}"))?;
    let api = Simulator::start_with_latency(CALLS, WINDOW, Duration::from_millis(10))
        .await
        .map_err(|e| format!("start the API simulator: {e}"))?;
    let faults = Faults {
        invalid: 0.02,
        unknown: 0.02,
        delayed: 0.02,
        lost: 0.0,
    };
    let ledger = LedgerServer::start(Ledger::new(Duration::from_millis(20), faults, 2026))
        .await
        .map_err(|e| format!("start the ledger: {e}"))?;
    let batches = Batches::open(&store)
        .await
        .map_err(|e| format!("open the batches: {e}"))?;
    let plain = store
        .repository::<Account>(accounts_spec("plain")?.plain_documents(1))
        .await
        .map_err(|e| format!("open plain: {e}"))?;

    // The processes.
    let run_for = format!("{}s", args.minutes * 60 + 600);
    let every = format!("{}ms", args.interval.as_millis().min(1_000));
    let with = |role: &str, rest: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = vec![role.into(), "--uri".into(), uri.clone()];
        v.extend(["--db".into(), db_name.clone()]);
        v.extend(rest.iter().map(|s| s.to_string()));
        v
    };
    let bank_args = |role: &str| {
        with(
            role,
            &[
                "--accounts",
                &ACCOUNTS.to_string(),
                "--txn-timeout",
                &format!("{}ms", TXN_TIMEOUT.as_millis()),
            ],
        )
    };
    let mut recipes: Vec<(Kind, PathBuf, Vec<String>)> = Vec::new();
    for _ in 0..2 {
        let mut a = bank_args("worker");
        a.extend(["--latency-every".into(), every.clone()]);
        recipes.push((Kind::Worker, torture.clone(), a));
    }
    let mut a = bank_args("checker");
    a.extend(["--total".into(), total.to_string()]);
    recipes.push((Kind::Checker, torture.clone(), a));
    for n in 0..2 {
        let mut a = with("", &["--interval", "1s", "--connect-timeout", "3s"]);
        a.remove(0);
        // One runner purges tombstones: a purge waits out the version floor's grace, and with
        // two purging, one would wait and find the other had purged, a slow pass that its
        // `round:` line cannot tell apart (the soak times purging passes as a series apart).
        if n == 0 {
            a.extend(
                [
                    "--tombstone-retention",
                    "20s",
                    "--version-floor-grace",
                    "1s",
                ]
                .map(String::from),
            );
        }
        recipes.push((Kind::Gc, gc.clone(), a));
    }
    let mut a = QuotaRun::worker_args(&uri, &db_name, TXN_TIMEOUT);
    a.extend(["--latency-every".into(), every.clone()]);
    recipes.push((Kind::Quota, torture.clone(), a));
    let rate = with(
        "rate-worker",
        &[
            "--limiter",
            "api",
            "--api",
            &api.call_url(),
            "--for",
            &run_for,
            "--bulk-tasks",
            "2",
            "--chunk",
            "5",
            "--priority-tasks",
            "1",
            "--priority-every",
            "1s",
        ],
    );
    recipes.push((Kind::Rate, torture.clone(), rate));
    for k in 0..2 {
        let id = format!("obt-{k}");
        let lease = format!("{}ms", OBT_LEASE.as_millis());
        let a = with(
            "obt-owner",
            &[
                "--id",
                &id,
                "--owner",
                "",
                "--lease",
                &lease,
                "--latency-every",
                &every,
            ],
        );
        recipes.push((Kind::Obt, torture.clone(), a));
    }
    let queue = with(
        "queue-worker",
        &[
            "--ledger",
            &ledger.url(),
            "--name",
            "queue-0",
            "--claim-ttl",
            "5s",
            "--delay",
            "2s",
            "--poll",
            "50ms",
            "--for",
            &run_for,
            "--latency-every",
            &every,
        ],
    );
    recipes.push((Kind::Queue, torture.clone(), queue));
    let mut names = BTreeMap::<Kind, usize>::new();
    let mut slots: Vec<(String, Slot)> = recipes
        .into_iter()
        .map(|(kind, program, args)| {
            let n = names.entry(kind).or_default();
            let name = format!("{}-{n}", kind.name());
            *n += 1;
            let recipe = Recipe {
                kind,
                version: Version::Current,
                program,
                args,
                skew: None,
            };
            (name, Slot::new(recipe))
        })
        .collect();
    let killable = |kind: Kind| matches!(kind, Kind::Worker | Kind::Obt);
    for (name, slot) in &mut slots {
        start(name, slot)?;
    }

    // The soak's own load: batches to the queue, plain documents to adopt.
    let timings: Timings = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let adding = tokio::spawn(add_batches(
        batches,
        Arc::clone(&timings),
        Arc::clone(&stop),
    ));
    let trimming = tokio::spawn(retention(db.clone(), Arc::clone(&stop)));
    let adopting = tokio::spawn(adoption(
        Adoption {
            program: adopt,
            uri: uri.clone(),
            db: db.clone(),
            plain,
            schema: Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas/accounts.json"),
        },
        Arc::clone(&timings),
        Arc::clone(&stop),
    ));

    // The run: restarts, kills, samples.
    let started = Instant::now();
    let end = started + Duration::from_secs(args.minutes * 60);
    let mut next_kill = started + jitter(args.kill_every);
    let mut next_sample = started + args.interval;
    let (mut kills, mut restarts) = (0_u64, BTreeMap::<String, u64>::new());
    let mut samples = Vec::new();
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = Instant::now();
        for (name, slot) in &mut slots {
            if let Some(why) = slot.exited() {
                tracing::info!("{why}; starting it again");
                // An OBT owner that lost its OBT exits; a long-lived process should never.
                if !killable(slot.recipe.kind) {
                    println!("soak: {name}: {why}");
                }
                *restarts.entry(name.clone()).or_default() += 1;
                slot.kill().await;
                start(name, slot)?;
            }
        }
        if now >= next_kill {
            // Bank workers and OBT owners in turn (one of the kind at random): every kind is
            // killed within two kills, so even a minute's run sees an OBT preempted. Drawn from
            // all four, about one run of a minute in thirty would kill no OBT owner, and the
            // short soak test, which needs a preemption, would fail by chance.
            let kind = if kills % 2 == 0 {
                Kind::Obt
            } else {
                Kind::Worker
            };
            let victims: Vec<usize> = (0..slots.len())
                .filter(|i| slots[*i].1.recipe.kind == kind)
                .collect();
            let i = victims[rand::rng().random_range(0..victims.len())];
            let (name, slot) = &mut slots[i];
            slot.kill().await;
            start(name, slot)?;
            kills += 1;
            next_kill = now + jitter(args.kill_every);
        }
        if now >= next_sample {
            next_sample += args.interval;
            let s = take_sample(started, &slots, &killable, &timings, &db).await?;
            let line = serde_json::to_string(&s).map_err(|e| format!("a sample: {e}"))?;
            writeln!(samples_file, "{line}")
                .and_then(|()| samples_file.flush())
                .map_err(|e| format!("write {}: {e}", samples_path.display()))?;
            println!("{}", summary(&s));
            samples.push(s);
        }
    }

    // Wind down: the load stops, every process stops, the GC settles what the kills left.
    stop.store(true, Ordering::SeqCst);
    let mut problems = Vec::new();
    for (what, task) in [
        ("adding batches", adding),
        ("adoption", adopting),
        ("retention", trimming),
    ] {
        match task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => problems.push(format!("{what}: {e}")),
            Err(e) => problems.push(format!("{what}: {e}")),
        }
    }
    for (_, slot) in &mut slots {
        match slot.recipe.kind {
            Kind::Gc => slot.stop().await,
            _ => slot.kill().await,
        }
    }
    let held_in: Vec<String> = sample::MANAGED.iter().map(|s| s.to_string()).collect();
    let recovery = recover(&store, &db, &held_in, TXN_TIMEOUT).await?;
    let only_slots: Vec<Slot> = slots.into_iter().map(|(_, slot)| slot).collect();
    let (quota_lines, quota_problems) = quota.verify(&only_slots).await?;
    problems.extend(quota_problems);
    let mut committed_total = 0;
    for repo in accounts.all() {
        let found = repo
            .find(Query::new())
            .await
            .map_err(|e| format!("final read: {e}"))?;
        committed_total += found.iter().map(|a| a.balance).sum::<i64>();
    }
    let end_counts = sample::count_collections(&db).await?;
    let held: u64 = end_counts
        .iter()
        .filter(|(k, _)| k.starts_with("held."))
        .map(|(_, v)| v)
        .sum();
    let records = end_counts.get("records").copied().unwrap_or(0);
    let breaches = ledger.ledger().breaches();
    let api_report = api.report();

    println!("results after {:.0?}:", started.elapsed());
    println!(
        "  {} samples, {kills} SIGKILLs, restarts after exits {restarts:?}, recovery {recovery} GC rounds",
        samples.len()
    );
    println!(
        "  end state: total {committed_total} (expected {total}), {held} held documents, {records} records left; API calls {}, 429s {}; ledger breaches {}",
        api_report.calls,
        api_report.rejected,
        breaches.len()
    );
    for line in &quota_lines {
        println!("{line}");
    }
    if committed_total != total {
        problems.push(format!("the total is {committed_total}, not {total}"));
    }
    if held != 0 || records != 0 {
        problems.push(format!("{held} documents held and {records} records left"));
    }
    if api_report.rejected != 0 {
        problems.push(format!(
            "the API answered 429 {} times",
            api_report.rejected
        ));
    }
    if !breaches.is_empty() {
        problems.push(format!(
            "ledger breaches: {:?}",
            &breaches[..breaches.len().min(3)]
        ));
    }
    let long_lived_exits: Vec<String> = restarts
        .iter()
        .filter(|(name, _)| !name.starts_with("worker") && !name.starts_with("obt-owner"))
        .map(|(name, n)| format!("{name} exited {n} times"))
        .collect();
    if !long_lived_exits.is_empty() {
        problems.push(format!("long-lived processes exited: {long_lived_exits:?}"));
    }
    let verdict = trend::judge(&samples);
    for note in &verdict.notes {
        println!("  note: {note}");
    }
    problems.extend(verdict.failures);
    match charts::write(&samples, &out, args.font.as_deref()) {
        Ok(paths) => {
            for path in paths {
                println!("  chart: {}", path.display());
            }
        }
        Err(e) => println!("  charts not drawn: {e}"),
    }
    if problems.is_empty() {
        let _ = db.drop().await;
        println!("RESULT ok");
        Ok(())
    } else {
        println!(
            "RESULT failed (database {db_name} kept): {}",
            problems.join("; ")
        );
        Err(problems.join("; "))
    }
}

/// Starts a slot's next incarnation; an OBT owner gets a new name each time, so that it preempts
/// the OBT from the one before (dead, or about to be: it exits once it sees it lost).
fn start(name: &str, slot: &mut Slot) -> Result<(), String> {
    if slot.recipe.kind == Kind::Obt {
        let owner = format!("{name}-{}", slot.starts);
        if let Some(i) = slot.recipe.args.iter().position(|a| a == "--owner") {
            if let Some(value) = slot.recipe.args.get_mut(i + 1) {
                *value = owner;
            }
        }
    }
    slot.start()
}

/// The sample at this moment: memory of the long-lived processes and the soak's own, the
/// durations every process reported since the last sample, the collections' sizes.
async fn take_sample(
    started: Instant,
    slots: &[(String, Slot)],
    killable: &dyn Fn(Kind) -> bool,
    timings: &Timings,
    db: &mongodb::Database,
) -> Result<Sample, String> {
    let mut s = Sample {
        t: started.elapsed().as_secs_f64(),
        ..Sample::default()
    };
    let mut pooled: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (name, slot) in slots {
        if !killable(slot.recipe.kind) {
            if let Some(kib) = slot.pid().and_then(sample::rss_kib) {
                s.rss_kib.insert(name.clone(), kib);
            }
        }
        if let Ok(mut reports) = slot.reports.lock() {
            for (op, values) in std::mem::take(&mut reports.latencies) {
                pooled.entry(op).or_default().extend(values);
            }
            // The chaos run checks each committed transfer against the journal at its end;
            // the soak trims the journal as it goes and reads neither list, which would
            // otherwise grow with every transfer (about 1 MiB a minute of this process's
            // memory, found by the first 60-minute run).
            drop(std::mem::take(&mut reports.committed));
            drop(std::mem::take(&mut reports.failures));
        }
    }
    if let Ok(mut own) = timings.lock() {
        for (op, values) in std::mem::take(&mut *own) {
            pooled.entry(op).or_default().extend(values);
        }
    }
    if let Some(kib) = sample::rss_kib(std::process::id()) {
        s.rss_kib.insert("soak".into(), kib);
    }
    s.latency = pooled
        .into_iter()
        .filter_map(|(op, values)| Some((op, Window::of(values)?)))
        .collect();
    s.count = sample::count_collections(db).await?;
    Ok(s)
}

/// One line per sample: memory in MiB, p99 in ms, and the collections that should stay flat.
fn summary(s: &Sample) -> String {
    let rss: Vec<String> = s
        .rss_kib
        .iter()
        .map(|(k, v)| format!("{k} {:.0}", *v as f64 / 1024.0))
        .collect();
    let p99: Vec<String> = s
        .latency
        .iter()
        .map(|(k, w)| format!("{k} {:.1}", w.p99_us as f64 / 1000.0))
        .collect();
    let get = |k: &str| s.count.get(k).copied().unwrap_or(0);
    let held: u64 = s
        .count
        .iter()
        .filter(|(k, _)| k.starts_with("held."))
        .map(|(_, v)| v)
        .sum();
    format!(
        "sample {:>6.0}s | MiB: {} | p99 ms: {} | records {} held {held} tombstones {} open batches {} unadopted {} journal {}",
        s.t,
        rss.join(", "),
        p99.join(", "),
        get("records"),
        get("tombstones"),
        get("batches.open"),
        get("plain.unadopted"),
        get("transfers"),
    )
}
