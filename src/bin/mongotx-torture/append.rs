//! The list-append worker of the isolation tests (`tests/it/isolation.rs`): random transactions
//! of reads and appends over a few keys, each key a document holding a list, run through
//! [`Transactions`] by several tasks, with every transaction written to a history file in the
//! form Jepsen's Elle reads (an `invoke` line before it starts, an `ok`, `fail` or `info` line
//! when it ends). The test merges the files of every process and hands them to an independent
//! checker, which infers from the values read alone which isolation anomalies happened.
//!
//! An append reads the key's list (the committed value) and stages the list plus one new value,
//! conditional on the version read; a read is a `get`, and with `--checked` also a staged
//! `check` of the version read, so that the commit fails if the key changed meanwhile.
//! Lines carry the time of a monotonic clock shared by every process on the machine (the
//! clock-skew shim shifts only the wall clock), by which the test orders them: an operation
//! that ended before another began must come first in the merged history.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bson::doc;
use clap::Args;
use mongotx::options::{LockWait, TxnOptions};
use mongotx::{CollectionSpec, Repository, Store, Transaction, Transactions, TxnError, Update};
use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// A key of the workload: a document holding the values appended to it, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct List {
    #[serde(rename = "_id")]
    pub(crate) id: i64,
    #[serde(default)]
    pub(crate) list: Vec<i64>,
}

/// The schema of the lists' collections (`schemas/lists.json`).
pub(crate) fn lists_spec(name: &str) -> Result<CollectionSpec, String> {
    CollectionSpec::new(name, 1, include_str!("../../../schemas/lists.json"))
        .map_err(|e| format!("schemas/lists.json: {e}"))
}

/// The raw collection beside `lists` naming the keys in use (`{_id: "window", lo, hi}`): the run
/// moves it on so that every list stays short, as Elle's workloads retire their keys.
pub(crate) fn window_collection(lists: &str) -> String {
    format!("{lists}_window")
}

/// Arguments of a list-append worker.
#[derive(Debug, Args)]
pub(crate) struct AppendArgs {
    /// Connection string.
    #[arg(long)]
    uri: String,
    /// Database of the lists.
    #[arg(long, value_parser = crate::cli::database_name)]
    db: String,
    /// The lists' collection.
    #[arg(long, value_parser = crate::cli::collection_name)]
    collection: String,
    /// Stage a check of every key read, so the commit fails if one changed since.
    #[arg(long)]
    checked: bool,
    /// Directory of the history files (this process writes one of its own there).
    #[arg(long)]
    history: PathBuf,
    /// Concurrent transactions, each from a logical process of the history (1 to 32).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=32))]
    tasks: u8,
    /// A transaction's timeout.
    #[arg(long, default_value = "3s", value_parser = crate::duration)]
    txn_timeout: Duration,
}

/// One micro-operation as the history writes it.
#[derive(Debug, Clone)]
enum Mop {
    Read { key: i64, seen: Option<Vec<i64>> },
    Append { key: i64, value: i64 },
}

impl Mop {
    fn to_json(&self) -> Value {
        match self {
            Mop::Read { key, seen } => json!(["r", key, seen]),
            Mop::Append { key, value } => json!(["append", key, value]),
        }
    }
}

/// How a transaction ended, as Elle names it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Ending {
    Ok,
    /// Certainly not committed.
    Fail,
    /// Maybe committed.
    Info,
}

/// The history file of this process: one whole line per `write` (an unbuffered file opened to
/// append, so a SIGKILL leaves whole lines only).
struct HistoryFile(Mutex<std::fs::File>);

impl HistoryFile {
    fn write(&self, line: &Value) -> Result<(), String> {
        let mut text = line.to_string();
        text.push('\n');
        let mut file = self.0.lock().map_err(|_| "history lock poisoned")?;
        file.write_all(text.as_bytes())
            .map_err(|e| format!("write the history: {e}"))
    }
}

/// Nanoseconds on the machine's monotonic clock, which every process shares and no clock-skew
/// shim shifts.
fn now_ns() -> i64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_nsec)
}

#[derive(Default)]
struct Counters {
    committed: AtomicU64,
    unknown: AtomicU64,
    failed: AtomicU64,
    /// Of the failed: aborted past their deadline by another party (a GC runner, a reader).
    expired: AtomicU64,
}

/// Runs list-append transactions from `--tasks` tasks until killed or stdin closes.
pub(crate) async fn append_worker(args: AppendArgs) -> Result<(), String> {
    let client = crate::client(&args.uri).await?;
    let db = client.database(&args.db);
    let store = Store::builder(db.clone())
        .lock_wait(LockWait {
            max_wait: Duration::from_secs(2),
            ..LockWait::default()
        })
        .build();
    let repo = store
        .repository::<List>(lists_spec(&args.collection)?)
        .await
        .map_err(|e| format!("open {}: {e}", args.collection))?;
    let txns = Transactions::with_options(&store, TxnOptions::default().timeout(args.txn_timeout));
    std::fs::create_dir_all(&args.history)
        .map_err(|e| format!("create {}: {e}", args.history.display()))?;
    let path = args.history.join(format!(
        "{}-{}.jsonl",
        std::process::id(),
        rand::rng().random_range(0..u32::MAX)
    ));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| format!("open {}: {e}", path.display()))?;
    let history = Arc::new(HistoryFile(Mutex::new(file)));
    let window = Arc::new(Window::new(
        db.collection::<bson::Document>(&window_collection(&args.collection)),
    ));
    let counters = Arc::new(Counters::default());
    let stop = Arc::new(AtomicBool::new(false));
    crate::roles::watch_stdin(Arc::clone(&stop));
    {
        let (counters, stop) = (Arc::clone(&counters), Arc::clone(&stop));
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                println!(
                    "stats committed={} unknown={} failed={} expired={}",
                    counters.committed.load(Ordering::Relaxed),
                    counters.unknown.load(Ordering::Relaxed),
                    counters.failed.load(Ordering::Relaxed),
                    counters.expired.load(Ordering::Relaxed),
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
    }
    let mut tasks = Vec::new();
    for _ in 0..args.tasks {
        let task = Task {
            repo: repo.clone(),
            txns: txns.clone(),
            checked: args.checked,
            history: Arc::clone(&history),
            window: Arc::clone(&window),
            counters: Arc::clone(&counters),
        };
        let stop = Arc::clone(&stop);
        tasks.push(tokio::spawn(async move { task.run(&stop).await }));
    }
    for task in tasks {
        task.await.map_err(|e| format!("a task panicked: {e}"))??;
    }
    Ok(())
}

/// The keys in use, read from the window document at most every 300 ms.
struct Window {
    coll: mongodb::Collection<bson::Document>,
    seen: Mutex<Option<(std::time::Instant, i64, i64)>>,
}

impl Window {
    fn new(coll: mongodb::Collection<bson::Document>) -> Window {
        Window {
            coll,
            seen: Mutex::new(None),
        }
    }

    async fn keys(&self) -> Result<(i64, i64), String> {
        let cached = *self.seen.lock().map_err(|_| "window lock poisoned")?;
        if let Some((at, lo, hi)) = cached {
            if at.elapsed() < Duration::from_millis(300) {
                return Ok((lo, hi));
            }
        }
        let read = self.coll.find_one(doc! { "_id": "window" }).await;
        let (lo, hi) = match read {
            Ok(Some(w)) => (
                w.get_i64("lo").map_err(|e| format!("window: {e}"))?,
                w.get_i64("hi").map_err(|e| format!("window: {e}"))?,
            ),
            Ok(None) => return Err("no window document".into()),
            // Through the faults: keep to the keys last seen.
            Err(e) => return cached.map(|(_, lo, hi)| (lo, hi)).ok_or(e.to_string()),
        };
        *self.seen.lock().map_err(|_| "window lock poisoned")? =
            Some((std::time::Instant::now(), lo, hi));
        Ok((lo, hi))
    }
}

/// One logical process of the history: one transaction at a time.
struct Task {
    repo: Repository<List>,
    txns: Transactions,
    checked: bool,
    history: Arc<HistoryFile>,
    window: Arc<Window>,
    counters: Arc<Counters>,
}

impl Task {
    async fn run(&self, stop: &AtomicBool) -> Result<(), String> {
        let mut process = new_process();
        while !stop.load(Ordering::SeqCst) {
            let Ok((lo, hi)) = self.window.keys().await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let mops = random_mops(lo, hi);
            let line = |kind: &str, mops: &[Mop]| {
                json!({
                    "type": kind, "f": "txn", "process": process, "time": now_ns(),
                    "value": mops.iter().map(Mop::to_json).collect::<Vec<_>>(),
                })
            };
            self.history.write(&line("invoke", &mops))?;
            let (ending, done) = self.transact(mops.clone()).await;
            let (kind, counter) = match ending {
                Ending::Ok => ("ok", &self.counters.committed),
                Ending::Fail => ("fail", &self.counters.failed),
                Ending::Info => ("info", &self.counters.unknown),
            };
            self.history.write(&line(kind, &done))?;
            counter.fetch_add(1, Ordering::Relaxed);
            // A process whose operation may still take effect is not used again (Elle's rule):
            // its next operation could otherwise seem to follow the unknown one.
            if ending == Ending::Info {
                process = new_process();
            }
        }
        Ok(())
    }

    /// Runs one transaction; returns how it ended and the micro-operations with what the reads
    /// saw (unknown for one that did not commit).
    async fn transact(&self, mops: Vec<Mop>) -> (Ending, Vec<Mop>) {
        let tx = self.txns.begin();
        match self.stage(&tx, &mops).await {
            // Nothing is written before the commit: a failure while staging commits nothing.
            Err(_) => (Ending::Fail, mops),
            Ok(done) => match tx.commit().await {
                Ok(_) => (Ending::Ok, done),
                Err(e) => {
                    if matches!(e, TxnError::Expired { .. }) {
                        self.counters.expired.fetch_add(1, Ordering::Relaxed);
                    }
                    (ending_of(&e), mops)
                }
            },
        }
    }

    /// Reads and stages every micro-operation; returns them with what the reads saw.
    async fn stage(&self, tx: &Transaction, mops: &[Mop]) -> Result<Vec<Mop>, TxnError> {
        // What this transaction read of a key (version, list), and its own appends since.
        let mut read: HashMap<i64, (i64, Vec<i64>)> = HashMap::new();
        let mut mine: HashMap<i64, Vec<i64>> = HashMap::new();
        let mut done = Vec::with_capacity(mops.len());
        for mop in mops {
            match *mop {
                Mop::Read { key, .. } => {
                    let seen = match (mine.get(&key), read.get(&key)) {
                        (Some(list), _) => list.clone(),
                        (None, Some((_, list))) => list.clone(),
                        (None, None) => {
                            let got = self.repo.get(key).await?;
                            if self.checked {
                                tx.check(&self.repo, key, got.version)?;
                            }
                            read.insert(key, (got.version, got.value.list.clone()));
                            got.value.list
                        }
                    };
                    done.push(Mop::Read {
                        key,
                        seen: Some(seen),
                    });
                }
                Mop::Append { key, value } => {
                    let (version, mut list) = match read.get(&key) {
                        Some(known) => known.clone(),
                        None => {
                            let got = self.repo.get(key).await?;
                            (got.version, got.value.list)
                        }
                    };
                    list.push(value);
                    tx.update(
                        &self.repo,
                        key,
                        version,
                        &Update::new().set("list", list.clone()),
                    )
                    .await?;
                    mine.insert(key, list);
                    done.push(mop.clone());
                }
            }
        }
        Ok(done)
    }
}

/// How a failed commit ended: a conflict (a version moved, a holder in the way, aborted by
/// another party past its deadline) is documented as rolled back and safe to retry, so not
/// committed; anything else may have committed.
fn ending_of(error: &TxnError) -> Ending {
    if error.kind() == mongotx::ErrorKind::Conflict {
        Ending::Fail
    } else {
        Ending::Info
    }
}

/// A fresh logical process id (random: the files of many processes and incarnations merge).
fn new_process() -> i64 {
    rand::rng().random_range(1..1_i64 << 50)
}

/// One to four micro-operations over the keys `lo..hi`, at most one append per key.
fn random_mops(lo: i64, hi: i64) -> Vec<Mop> {
    let mut rng = rand::rng();
    let n = rng.random_range(1..=4);
    let mut appended = Vec::new();
    let mut mops = Vec::with_capacity(n);
    for _ in 0..n {
        let key = rng.random_range(lo..hi.max(lo + 1));
        if rng.random_bool(0.5) && !appended.contains(&key) {
            appended.push(key);
            // Unique per key with overwhelming odds (2^53 values).
            let value = rng.random_range(1..1_i64 << 53);
            mops.push(Mop::Append { key, value });
        } else {
            mops.push(Mop::Read { key, seen: None });
        }
    }
    mops
}
