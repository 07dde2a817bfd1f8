//! The orchestrator of a torture run: server, wire proxy, toxiproxy, processes, faults, and the
//! verification at the end.
//!
//! (Over 700 lines on purpose: the run is one timeline, from starting the server to checking the
//! ledger at the end, and reads best in that order; the roles it starts are in `roles`, the
//! processes and the builds they run from in `children`, its quota consumes in `quota_run`.)

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId, Document};
use clap::Args;
use futures::TryStreamExt;
use mongotx::collections::TRANSACTIONS_COLLECTION;
use mongotx::gc::{Gc, GcOptions};
use mongotx::testkit::local_server::LocalServer;
use mongotx::testkit::test_server::TestServer;
use mongotx::testkit::toxiproxy::Toxiproxy;
use mongotx::{fields, Query};
use rand::Rng;

use crate::append_run::AppendRun;
use crate::children::{add, version_summary, Kind, Programs, Recipe, Report, Slot, Version};
use crate::quota_run::QuotaRun;
use crate::roles::{account_id, accounts_collection, Account, Bank, TRANSFERS};
use crate::wire_proxy::{command_name, writes_in, Action, Rules, WireProxy};

/// Arguments of a torture run.
#[derive(Debug, Clone, Args)]
pub(crate) struct RunArgs {
    /// How long the faults last, in seconds (1 to 30 days' worth).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=30 * 24 * 3600))]
    seconds: u64,
    /// Worker processes (transfers; 1 to 64).
    #[arg(long, default_value_t = 3, value_parser = processes(1))]
    workers: usize,
    /// Checker processes (read-only check transactions over every account; 0 to 64).
    #[arg(long, default_value_t = 1, value_parser = processes(0))]
    checkers: usize,
    /// `mongotx-gc` runner processes (0 to 64).
    #[arg(long, default_value_t = 2, value_parser = processes(0))]
    gc_runners: usize,
    /// Accounts in the bank (2 to 100000: a transfer needs two).
    #[arg(long, default_value_t = 10, value_parser = accounts)]
    accounts: usize,
    /// Every account's opening balance.
    #[arg(long, default_value_t = 1_000)]
    balance: i64,
    /// A transaction's timeout.
    #[arg(long, default_value = "3s", value_parser = crate::duration)]
    txn_timeout: Duration,
    /// Run without kills, resets or late deliveries (the clock-skew test).
    #[arg(long)]
    no_faults: bool,
    /// Clock skews in milliseconds, given to the processes in turn (e.g. `60000,-60000`).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
    skews: Vec<i64>,
    /// Mean pause between two SIGKILLs.
    #[arg(long, default_value = "2s", value_parser = crate::duration)]
    kill_every: Duration,
    /// Mean pause between two toxiproxy faults (connection resets or stalls).
    #[arg(long, default_value = "1500ms", value_parser = crate::duration)]
    fault_every: Duration,
    /// Share of write commands the wire proxy delivers late (0 to 1).
    #[arg(long, default_value_t = 0.01, value_parser = share)]
    late_rate: f64,
    /// Collections the accounts are spread over (`accounts`, `accounts_1`, ...; 1 to 64).
    #[arg(long, default_value_t = 1, value_parser = collections)]
    collections: usize,
    /// Clocks of their own for collections, as the shards of a cluster whose clocks disagree:
    /// the run starts its own local test server with `--clock-offset <this>` (for example
    /// `mongotx_transactions=+30s,accounts=-30s,accounts_1=+30s`; `*` names the clock `hello`
    /// reports). Needs MONGODB_URI unset.
    #[arg(long)]
    clock_offsets: Option<String>,
    /// Shard every collection of the run on a hashed `_id` before it starts (the accounts'
    /// collections and mongotx's own), so that a run through a sharded cluster's `mongos` spreads
    /// each transaction's documents over the shards. Needs a sharded cluster.
    #[arg(long)]
    shard_collections: bool,
    /// A directory holding the previous version's `mongotx-torture` and `mongotx-gc`
    /// (`tools/previous-version.sh` prints it): every other process of each kind runs those, so
    /// that both versions work on the same documents at once, as during a rolling deployment.
    #[arg(long)]
    previous: Option<PathBuf>,
    /// Quota worker processes (consumes and releases across a two-level hierarchy in the bank's
    /// database, checked at the end; 0 to 64).
    #[arg(long, default_value_t = 0, value_parser = processes(0))]
    quota_workers: usize,
    /// List-append worker processes for each of the two workloads, reads unchecked and reads
    /// checked (`append_run`; 0 to 64 each): their histories go to `--history`.
    #[arg(long, default_value_t = 0, value_parser = processes(0), requires = "history")]
    append_workers: usize,
    /// The directory the list-append workers write their histories in (`unchecked/`,
    /// `checked/`).
    #[arg(long)]
    history: Option<PathBuf>,
    /// Write the list-append keys as plain documents and adopt them while they are in use.
    #[arg(long, requires = "append_workers")]
    adoption: bool,
    /// No SIGKILLs (the network faults stay, unless `--no-network`).
    #[arg(long)]
    no_kills: bool,
    /// No connection resets, stalls or late deliveries (the kills stay, unless `--no-kills`).
    #[arg(long)]
    no_network: bool,
}

/// Clap parser of a process count from `min` to 64 (more would only starve the two cores).
fn processes(min: i64) -> impl clap::builder::TypedValueParser<Value = usize> {
    use clap::builder::TypedValueParser;
    clap::value_parser!(i64)
        .range(min..=64)
        .map(|n| usize::try_from(n).unwrap_or(0))
}

/// Clap parser of `--accounts`: 2 (a transfer moves money between two) to 100000.
pub(crate) fn accounts(text: &str) -> Result<usize, String> {
    within(text, 2, 100_000)
}

/// Clap parser of `--collections`: 1 to 64.
pub(crate) fn collections(text: &str) -> Result<usize, String> {
    within(text, 1, 64)
}

fn within(text: &str, min: usize, max: usize) -> Result<usize, String> {
    let n: usize = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a whole number"))?;
    if n < min || n > max {
        return Err(format!("{n} is not in {min}..={max}"));
    }
    Ok(n)
}

/// Clap parser of a share: a number from 0 to 1 (not NaN).
fn share(text: &str) -> Result<f64, String> {
    let x: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number"))?;
    if !(0.0..=1.0).contains(&x) {
        return Err(format!("{text:?} is not between 0 and 1"));
    }
    Ok(x)
}

/// The longest a command is held back.
const MAX_LATE: Duration = Duration::from_millis(3_000);

/// Delivers a share of the bank's write commands late, counting them.
struct LateRules {
    db: String,
    rate: f64,
    on: AtomicBool,
    count: AtomicU64,
}

impl Rules for LateRules {
    fn command(&self, command: &mut Document) -> Action {
        if !self.on.load(Ordering::Relaxed) {
            return Action::Forward;
        }
        // A bulkWrite goes to `admin`; the writes inside it name the bank's database.
        let write = writes_in(command).iter().any(|write| {
            write.get_str("$db").ok() == Some(self.db.as_str())
                && matches!(
                    command_name(write),
                    "insert" | "update" | "delete" | "findAndModify"
                )
        });
        let mut rng = rand::rng();
        if write && rng.random_bool(self.rate) {
            self.count.fetch_add(1, Ordering::Relaxed);
            let ms = rng.random_range(600..=MAX_LATE.as_millis() as u64);
            return Action::DeliverLate(Duration::from_millis(ms));
        }
        Action::Forward
    }
}

/// Builds the clock-skew shim and returns its path.
async fn skew_library() -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let built = tokio::process::Command::new("bash")
        .arg(root.join("tools/skew.sh"))
        .output()
        .await
        .map_err(|e| format!("run tools/skew.sh: {e}"))?;
    if !built.status.success() {
        return Err(format!(
            "tools/skew.sh failed: {}",
            String::from_utf8_lossy(&built.stderr)
        ));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&built.stdout).trim()))
}

/// What the faults did.
#[derive(Debug, Default)]
struct Faults {
    kills: u64,
    resets: u64,
    stalls: u64,
    restarts: u64,
}

/// The server of a run, kept alive until the run ends.
enum Server {
    Chosen(TestServer),
    Skewed(LocalServer),
}

impl Server {
    fn uri(&self) -> String {
        match self {
            Server::Chosen(server) => server.uri().to_string(),
            Server::Skewed(server) => server.uri(),
        }
    }
}

async fn start_server(args: &RunArgs) -> Result<Server, String> {
    let Some(offsets) = args.clock_offsets.clone() else {
        return tokio::task::spawn_blocking(TestServer::start)
            .await
            .map_err(|e| format!("start the server: {e}"))?
            .map(Server::Chosen)
            .map_err(|e| e.to_string());
    };
    if std::env::var(mongotx::testkit::test_server::URI_ENV).is_ok_and(|uri| !uri.trim().is_empty())
    {
        return Err(
            "--clock-offsets needs the local test server (per-collection clocks); unset MONGODB_URI"
                .into(),
        );
    }
    tokio::task::spawn_blocking(move || {
        LocalServer::start_with(&["--clock-offset".to_string(), offsets])
    })
    .await
    .map_err(|e| format!("start the server: {e}"))?
    .map(Server::Skewed)
    .map_err(|e| e.to_string())
}

pub(crate) async fn run(args: RunArgs) -> Result<(), String> {
    // Refused before anything starts: a total past 64 bits could not be checked.
    let total = i64::try_from(args.accounts)
        .ok()
        .and_then(|n| args.balance.checked_mul(n))
        .ok_or_else(|| {
            format!(
                "--balance {} times --accounts {} does not fit in 64 bits",
                args.balance, args.accounts
            )
        })?;
    // Found before anything starts: a wrong --previous is a bad command line, not a failed run.
    let programs = Programs::find(args.previous.as_deref())?;
    let server = start_server(&args).await?;
    let db_name = format!("mongotx_torture_{}", ObjectId::new().to_hex());
    let direct = crate::cli::connect(
        &server.uri(),
        "MONGODB_URI",
        "mongotx-torture",
        Duration::from_secs(10),
    )
    .await?;
    let db = direct.database(&db_name);

    println!(
        "torture: {}s, {} workers, {} checkers, {} GC runners, {} accounts, total {total}, faults {}{}",
        args.seconds,
        args.workers,
        args.checkers,
        args.gc_runners,
        args.accounts,
        match (args.no_faults, args.no_kills, args.no_network) {
            (true, _, _) | (_, true, true) => "off",
            (_, true, false) => "network only (no kills)",
            (_, false, true) => "kills only (no network faults)",
            _ => "on",
        },
        if args.skews.is_empty() {
            String::new()
        } else {
            format!(", clock skews {:?} ms", args.skews)
        }
    );
    if let Some(previous) = &args.previous {
        println!(
            "torture: odd processes of each kind run the previous version, from {}",
            previous.display()
        );
    }
    if let Some(offsets) = &args.clock_offsets {
        println!(
            "torture: accounts over {} collections, collection clocks {offsets}, transaction timeout {:?}",
            args.collections.max(1),
            args.txn_timeout
        );
    }

    // The bank.
    let bank_direct = Bank {
        uri: server.uri().to_string(),
        db: db_name.clone(),
        accounts: args.accounts,
        txn_timeout: args.txn_timeout,
        collections: args.collections.max(1),
    };
    if args.shard_collections {
        shard_collections(&direct, &db_name, args.collections.max(1)).await?;
    }
    let (store, accounts) = bank_direct.open().await?;
    for i in 0..args.accounts {
        accounts
            .of(i)
            .insert(&Account {
                id: account_id(i),
                owner: format!("owner {i}"),
                balance: args.balance,
                note: None,
            })
            .await
            .map_err(|e| format!("seed: {e}"))?;
    }

    // The network between the processes and the server.
    let network = !args.no_faults && !args.no_network;
    let late = Arc::new(LateRules {
        db: db_name.clone(),
        rate: if network { args.late_rate } else { 0.0 },
        on: AtomicBool::new(network),
        count: AtomicU64::new(0),
    });
    let proxy =
        WireProxy::try_start(&server.uri(), "127.0.0.1:0", SharedRules(Arc::clone(&late))).await?;
    let toxiproxy = if !network {
        None
    } else {
        Some(
            Toxiproxy::start(proxy.addr())
                .await
                .map_err(|e| e.to_string())?,
        )
    };
    let entry = toxiproxy.as_ref().map_or(proxy.addr(), |t| t.listen());
    let uri = format!("mongodb://{entry}/?directConnection=true");

    // The processes.
    let skew_lib = if args.skews.is_empty() {
        None
    } else {
        Some(skew_library().await?)
    };
    let quota = match args.quota_workers {
        0 => None,
        _ => Some(QuotaRun::create(&store, &db).await?),
    };
    let mut append = match (&args.history, args.append_workers) {
        (Some(history), 1..) => Some(AppendRun::create(&store, &db, history, args.adoption).await?),
        _ => None,
    };
    // These command lines are the previous version's as much as this build's: with --previous,
    // its binaries parse them (and children.rs reads what they print). Keep every flag a child
    // gets here one that the pinned commit of tools/previous-version.sh accepts, with the same
    // meaning, until that pin moves past the change.
    let bank_args = |role: &str| {
        vec![
            role.to_string(),
            "--uri".into(),
            uri.clone(),
            "--db".into(),
            db_name.clone(),
            "--accounts".into(),
            args.accounts.to_string(),
            "--txn-timeout".into(),
            format!("{}ms", args.txn_timeout.as_millis()),
            "--collections".into(),
            args.collections.max(1).to_string(),
        ]
    };
    let mut recipes = Vec::new();
    let mut add_recipe = |kind: Kind, n: usize, args: Vec<String>| {
        let (version, build) = programs.nth(n);
        let program = match kind {
            Kind::Gc => build.gc.clone(),
            _ => build.torture.clone(),
        };
        recipes.push(Recipe {
            kind,
            version,
            program,
            args,
            skew: None,
        });
    };
    for n in 0..args.workers {
        add_recipe(Kind::Worker, n, bank_args("worker"));
    }
    for n in 0..args.checkers {
        let mut a = bank_args("checker");
        a.extend(["--total".to_string(), total.to_string()]);
        add_recipe(Kind::Checker, n, a);
    }
    for n in 0..args.gc_runners {
        add_recipe(
            Kind::Gc,
            n,
            vec![
                "--uri".into(),
                uri.clone(),
                "--db".into(),
                db_name.clone(),
                "--interval".into(),
                "300ms".into(),
                "--connect-timeout".into(),
                "3s".into(),
            ],
        );
    }
    for n in 0..args.quota_workers {
        add_recipe(
            Kind::Quota,
            n,
            QuotaRun::worker_args(&uri, &db_name, args.txn_timeout),
        );
    }
    if let Some(append) = &append {
        for checked in [false, true] {
            for n in 0..args.append_workers {
                add_recipe(
                    Kind::Append,
                    n,
                    append.worker_args(&uri, &db_name, checked, args.txn_timeout),
                );
            }
        }
    }
    let mut slots: Vec<Slot> = recipes
        .into_iter()
        .enumerate()
        .map(|(i, mut recipe)| {
            if let (Some(lib), false) = (&skew_lib, args.skews.is_empty()) {
                recipe.skew = Some((lib.clone(), args.skews[i % args.skews.len()]));
            }
            Slot::new(recipe)
        })
        .collect();
    for slot in &mut slots {
        slot.start()?;
    }

    // The faults.
    let mut faults = Faults::default();
    let started = Instant::now();
    let end = started + Duration::from_secs(args.seconds);
    let mut next_kill = started + jitter(args.kill_every);
    let mut next_fault = started + jitter(args.fault_every);
    let mut toxic: Option<(String, Instant)> = None;
    let mut toxic_serial = 0_u64;
    let mut last_progress = started;
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = Instant::now();
        for slot in &mut slots {
            if let Some(why) = slot.exited() {
                // A process that cannot reach the server through the faults at start-up gives
                // up; it is started again, as a supervisor would.
                tracing::info!("{why}; starting it again");
                faults.restarts += 1;
                slot.kill().await;
                slot.start()?;
            }
        }
        if let Some(append) = &mut append {
            append.tick().await?;
        }
        if args.no_faults {
            continue;
        }
        if now >= next_kill && !args.no_kills {
            let i = rand::rng().random_range(0..slots.len());
            slots[i].kill().await;
            slots[i].start()?;
            faults.kills += 1;
            next_kill = now + jitter(args.kill_every);
        }
        if let (Some(tp), Some((name, until))) = (&toxiproxy, &toxic) {
            if now >= *until {
                tp.remove_toxic(name).await;
                toxic = None;
            }
        }
        if let (Some(tp), None) = (&toxiproxy, &toxic) {
            if now >= next_fault {
                toxic_serial += 1;
                let name = format!("fault{toxic_serial}");
                let (reset, toxicity, timeout_ms, lasts) = {
                    let mut rng = rand::rng();
                    (
                        rng.random_bool(0.5),
                        rng.random_range(0.3..1.0),
                        rng.random_range(0..800),
                        Duration::from_millis(rng.random_range(150..700)),
                    )
                };
                let added = if reset {
                    tp.add_toxic(
                        &name,
                        "reset_peer",
                        "downstream",
                        toxicity,
                        &format!(r#"{{"timeout":{}}}"#, timeout_ms % 100),
                    )
                    .await
                } else {
                    tp.add_toxic(
                        &name,
                        "timeout",
                        "upstream",
                        toxicity,
                        &format!(r#"{{"timeout":{}}}"#, 200 + timeout_ms),
                    )
                    .await
                };
                if added.is_ok() {
                    if reset {
                        faults.resets += 1;
                    } else {
                        faults.stalls += 1;
                    }
                    toxic = Some((name, now + lasts));
                }
                next_fault = now + jitter(args.fault_every);
            }
        }
        if now.duration_since(last_progress) >= Duration::from_secs(60) {
            last_progress = now;
            let (workers, _) = summed(&slots, Kind::Worker);
            println!(
                "  {:>4}s: {} transfers committed, {} kills, {} resets, {} stalls, {} late deliveries",
                now.duration_since(started).as_secs(),
                workers.get("committed").copied().unwrap_or(0),
                faults.kills,
                faults.resets,
                faults.stalls,
                late.count.load(Ordering::Relaxed)
            );
        }
    }

    // Wind down: faults off, workers and checkers killed mid-flight, GC runners stopped.
    late.on.store(false, Ordering::SeqCst);
    if let (Some(tp), Some((name, _))) = (&toxiproxy, &toxic) {
        tp.remove_toxic(name).await;
    }
    for slot in &mut slots {
        match slot.recipe.kind {
            Kind::Gc => slot.stop().await,
            _ => slot.kill().await,
        }
    }
    // Let every held-back command land before recovering.
    tokio::time::sleep(MAX_LATE + Duration::from_millis(500)).await;
    // Where a killed coordinator may leave a hold: the accounts, the journal, the providers.
    let mut held_in: Vec<String> = (0..args.collections.max(1))
        .map(accounts_collection)
        .chain([TRANSFERS.to_string()])
        .collect();
    if quota.is_some() {
        held_in.push(mongotx::collections::PROVIDERS_COLLECTION.to_string());
    }
    if let Some(append) = &append {
        held_in.extend(append.collections());
    }
    let recovery = recover(&store, &db, &held_in, args.txn_timeout).await?;
    let (quota_lines, quota_problems) = match &quota {
        Some(quota) => quota.verify(&slots).await?,
        None => (Vec::new(), Vec::new()),
    };

    // Verify.
    let (workers, _) = summed(&slots, Kind::Worker);
    let (checkers, alarms) = summed(&slots, Kind::Checker);
    let gc_rounds = {
        let mut rounds = Report::new();
        for slot in slots.iter().filter(|s| s.recipe.kind == Kind::Gc) {
            if let Ok(reports) = slot.reports.lock() {
                add(&mut rounds, &reports.rounds);
            }
        }
        rounds
    };
    let mut committed_total: i64 = 0;
    let mut balances = std::collections::BTreeMap::new();
    let mut raw: Vec<Document> = Vec::new();
    for (k, repo) in accounts.all().iter().enumerate() {
        let found = repo
            .find(Query::new())
            .await
            .map_err(|e| format!("final read: {e}"))?;
        committed_total += found.iter().map(|a| a.balance).sum::<i64>();
        balances.extend(found.iter().map(|a| (a.value.id.clone(), a.balance)));
        let stored: Vec<Document> = db
            .collection::<Document>(&accounts_collection(k))
            .find(doc! {})
            .await
            .map_err(|e| format!("final raw read: {e}"))?
            .try_collect()
            .await
            .map_err(|e| format!("final raw read: {e}"))?;
        raw.extend(stored);
    }
    let stored_total: i64 = raw.iter().filter_map(|d| d.get_i64("balance").ok()).sum();
    // The journal: every transfer a worker saw commit is there, and every balance is the
    // opening balance moved by exactly the journal's transfers (so no committed transfer was
    // lost and none was applied in part).
    let journal = accounts
        .transfers
        .find(Query::new())
        .await
        .map_err(|e| format!("read the journal: {e}"))?;
    let recorded: std::collections::BTreeSet<String> =
        journal.iter().map(|t| t.value.id.clone()).collect();
    let mut expected_balances: std::collections::BTreeMap<String, i64> = (0..args.accounts)
        .map(|i| (account_id(i), args.balance))
        .collect();
    for t in &journal {
        *expected_balances.entry(t.from.clone()).or_insert(0) -= t.amount;
        *expected_balances.entry(t.to.clone()).or_insert(0) += t.amount;
    }
    let reported: Vec<String> = slots
        .iter()
        .filter(|s| s.recipe.kind == Kind::Worker)
        .filter_map(|s| s.reports.lock().ok().map(|r| r.committed.clone()))
        .flatten()
        .collect();
    let lost: Vec<&String> = reported
        .iter()
        .filter(|id| !recorded.contains(*id))
        .collect();
    let off_balances: Vec<String> = expected_balances
        .iter()
        .filter(|(id, want)| balances.get(*id) != Some(*want))
        .map(|(id, want)| format!("{id}: {:?} (journal says {want})", balances.get(id)))
        .collect();
    let journal_raw: Vec<Document> = db
        .collection::<Document>(TRANSFERS)
        .find(doc! { fields::ACTIVE_TXN: { "$exists": true } })
        .await
        .map_err(|e| format!("read the journal: {e}"))?
        .try_collect()
        .await
        .map_err(|e| format!("read the journal: {e}"))?;
    raw.extend(journal_raw);
    let held = raw
        .iter()
        .filter(|d| d.contains_key(fields::ACTIVE_TXN) || d.contains_key(fields::DELETING))
        .count();
    let records = db
        .collection::<Document>(TRANSACTIONS_COLLECTION)
        .count_documents(doc! {})
        .await
        .map_err(|e| format!("count records: {e}"))?;
    let get = |r: &Report, k: &str| r.get(k).copied().unwrap_or(0);

    println!("results after {:.0?}:", started.elapsed());
    println!(
        "  transfers: committed {}, outcome unknown {}, expired under another party {}, failed (conflicts, faults) {}, plain writes {}",
        get(&workers, "committed"),
        get(&workers, "unknown"),
        get(&workers, "expired"),
        get(&workers, "failed"),
        get(&workers, "plain")
    );
    println!(
        "  snapshots: {} consistent check transactions, {} inconsistent, {} failed",
        get(&checkers, "snapshots"),
        get(&checkers, "bad"),
        get(&checkers, "failed")
    );
    let failures = failures_of(&slots, Kind::Checker);
    if !failures.is_empty() {
        println!("  check failures (the first {}):", failures.len().min(5));
        for cause in failures.iter().take(5) {
            println!("    {cause}");
        }
    }
    println!(
        "  faults: {} SIGKILLs, {} connection resets, {} stalls, {} late deliveries, {} restarts after start-up failures",
        faults.kills,
        faults.resets,
        faults.stalls,
        late.count.load(Ordering::Relaxed),
        faults.restarts
    );
    println!(
        "  GC runners: {} rounds, finished {}, rolled back {}, swept {}, skipped {}; recovery: {} rounds",
        get(&gc_rounds, "rounds"),
        get(&gc_rounds, "finished"),
        get(&gc_rounds, "rolled_back"),
        get(&gc_rounds, "swept"),
        get(&gc_rounds, "skipped"),
        recovery
    );
    let offsets: Vec<String> = slots
        .iter()
        .filter(|s| s.recipe.skew.is_some() && s.recipe.kind != Kind::Gc)
        .filter_map(|s| s.reports.lock().ok().map(|r| r.total()))
        .map(|r| format!("{}", get(&r, "clock_offset_ms") / 1_000 * 1_000))
        .collect();
    if !offsets.is_empty() {
        println!(
            "  measured clock offsets of skewed processes (ms, rounded): {}",
            offsets.join(", ")
        );
    }
    println!(
        "  journal: {} transfers recorded, {} seen committed by their workers, {} of those missing; {} balances off the journal",
        journal.len(),
        reported.len(),
        lost.len(),
        off_balances.len()
    );
    println!(
        "  end state: total {committed_total} (stored {stored_total}, expected {total}), {held} held documents, {records} records left"
    );
    for line in &quota_lines {
        println!("{line}");
    }
    if let Some(append) = &append {
        for line in append.summary(&slots) {
            println!("{line}");
        }
    }
    let mut problems = quota_problems;
    if args.previous.is_some() {
        for version in [Version::Current, Version::Previous] {
            let (summary, trouble) = version_summary(&slots, version);
            println!("  {} version: {summary}", version.name());
            problems.extend(trouble);
        }
    }

    if committed_total != total || stored_total != total {
        problems.push(format!(
            "the total is {committed_total} (stored {stored_total}), not {total}"
        ));
    }
    if held != 0 {
        problems.push(format!("{held} documents are still held"));
    }
    if !lost.is_empty() {
        problems.push(format!(
            "{} transfers seen committed are not in the journal (lost): {:?}",
            lost.len(),
            &lost[..lost.len().min(5)]
        ));
    }
    if !off_balances.is_empty() {
        problems.push(format!(
            "balances differ from the journal: {:?}",
            &off_balances[..off_balances.len().min(5)]
        ));
    }
    if records != 0 {
        problems.push(format!("{records} transaction records are left"));
    }
    if get(&checkers, "bad") != 0 || !alarms.is_empty() {
        problems.push(format!("inconsistent snapshots: {alarms:?}"));
    }
    if get(&workers, "committed") == 0 {
        problems.push("no transfer committed".into());
    }
    if args.checkers > 0 && get(&checkers, "snapshots") == 0 {
        problems.push("no check transaction committed".into());
    }
    if args.no_faults && get(&workers, "expired") != 0 {
        problems.push(format!(
            "{} transactions were aborted as expired while their coordinators were alive",
            get(&workers, "expired")
        ));
    }
    drop(proxy);
    if problems.is_empty() {
        let _ = db.drop().await;
        println!("RESULT ok");
        Ok(())
    } else {
        // The database stays for inspection.
        println!(
            "RESULT failed (database {db_name} kept): {}",
            problems.join("; ")
        );
        Err(problems.join("; "))
    }
}

/// Forwards to shared rules (the run keeps a handle to switch them off and read the count).
struct SharedRules(Arc<LateRules>);

impl Rules for SharedRules {
    fn command(&self, command: &mut Document) -> Action {
        self.0.command(command)
    }
}

/// A pause around `mean` (between half and one and a half of it).
pub(crate) fn jitter(mean: Duration) -> Duration {
    let ms = mean.as_millis().max(2) as u64;
    Duration::from_millis(rand::rng().random_range(ms / 2..=ms + ms / 2))
}

/// The reports of every slot of `kind`, summed, and their alarms.
fn summed(slots: &[Slot], kind: Kind) -> (Report, Vec<String>) {
    let mut total = Report::new();
    let mut alarms = Vec::new();
    for slot in slots.iter().filter(|s| s.recipe.kind == kind) {
        if let Ok(reports) = slot.reports.lock() {
            add(&mut total, &reports.total());
            alarms.extend(reports.alarms.iter().cloned());
        }
    }
    (total, alarms)
}

/// Why the transactions of every slot of `kind` failed, as they reported it.
fn failures_of(slots: &[Slot], kind: Kind) -> Vec<String> {
    slots
        .iter()
        .filter(|s| s.recipe.kind == kind)
        .filter_map(|slot| slot.reports.lock().ok().map(|r| r.failures.clone()))
        .flatten()
        .collect()
}

/// GC rounds as if every deadline had passed, until nothing is left to do; returns the rounds.
/// Undecided and aborted records are decided and deleted by the server's own clock, so rounds
/// are spaced out until the last deadline (a transaction timeout at most) has really passed.
pub(crate) async fn recover(
    store: &mongotx::Store,
    db: &mongodb::Database,
    held_in: &[String],
    timeout: Duration,
) -> Result<u32, String> {
    let gc = Gc::new(store, GcOptions::default());
    let mut last = String::new();
    // 15 s, or a whole transaction timeout and 15 s more when that is longer.
    let rounds = 60.max(((timeout.as_millis() + 15_000) / 250) as u32);
    for round in 1..=rounds {
        if round > 1 {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let now = store.server_time().await.map_err(|e| e.to_string())?;
        let later = now + chrono::Duration::hours(1);
        let summary = gc
            .run_round_at(later, &AtomicBool::new(false))
            .await
            .map_err(|e| format!("recovery round: {e}"))?;
        let records = db
            .collection::<Document>(TRANSACTIONS_COLLECTION)
            .count_documents(doc! {})
            .await
            .map_err(|e| e.to_string())?;
        let mut held = 0;
        for name in held_in {
            held += db
                .collection::<Document>(name)
                .count_documents(doc! { fields::ACTIVE_TXN: { "$exists": true } })
                .await
                .map_err(|e| e.to_string())?;
        }
        if records == 0 && held == 0 && summary.skipped == 0 {
            return Ok(round);
        }
        last = format!("{records} records, {held} held, last round {summary:?}");
    }
    let left = leftovers(db, held_in)
        .await
        .unwrap_or_else(|e| e.to_string());
    Err(format!(
        "recovery did not settle within {rounds} GC rounds: {last}\n{left}"
    ))
}

/// The records and held accounts still there, for the failure message.
async fn leftovers(db: &mongodb::Database, held_in: &[String]) -> mongodb::error::Result<String> {
    let mut out = String::new();
    let mut places = vec![(TRANSACTIONS_COLLECTION.to_string(), doc! {})];
    for name in held_in {
        places.push((
            name.clone(),
            doc! { fields::ACTIVE_TXN: { "$exists": true } },
        ));
    }
    for (name, filter) in places {
        let docs: Vec<Document> = db
            .collection::<Document>(&name)
            .find(filter)
            .await?
            .try_collect()
            .await?;
        for d in docs {
            out.push_str(&format!("{name}: {d}\n"));
        }
    }
    Ok(out)
}

/// Shards the run's collections on a hashed `_id` (`enableSharding` first, which MongoDB before
/// 6.0 needs and later versions accept).
async fn shard_collections(
    client: &mongodb::Client,
    db: &str,
    collections: usize,
) -> Result<(), String> {
    let admin = client.database("admin");
    admin
        .run_command(bson::doc! { "enableSharding": db })
        .await
        .map_err(|e| format!("enableSharding {db}: {e}"))?;
    let names = (0..collections)
        .map(crate::roles::accounts_collection)
        .chain([
            mongotx::collections::TRANSACTIONS_COLLECTION.to_string(),
            mongotx::collections::META_COLLECTION.to_string(),
        ]);
    for name in names {
        admin
            .run_command(bson::doc! {
                "shardCollection": format!("{db}.{name}"),
                "key": { "_id": "hashed" },
            })
            .await
            .map_err(|e| format!("shardCollection {db}.{name}: {e}"))?;
    }
    println!(
        "torture: {collections} account collections and mongotx's own sharded on a hashed _id"
    );
    Ok(())
}
