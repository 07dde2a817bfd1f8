//! The processes the torture run starts: workers that move money between accounts and checkers
//! that read every account in one transaction. Each prints one `stats` line per half second on
//! stdout (the run keeps the last line of every process it starts), and exits when killed or when
//! its stdin closes.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use mongotx::options::{LockWait, TxnOptions};
use mongotx::{Adjust, CollectionSpec, Query, Repository, Store, Transactions, TxnError, Update};
use rand::Rng;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

/// An account of the torture bank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Account {
    #[serde(rename = "_id")]
    pub(crate) id: String,
    pub(crate) owner: String,
    pub(crate) balance: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) note: Option<String>,
}

/// The id of account `i`.
pub(crate) fn account_id(i: usize) -> String {
    format!("acc{i:03}")
}

/// The name of the bank's `k`-th accounts collection.
pub(crate) fn accounts_collection(k: usize) -> String {
    if k == 0 {
        "accounts".to_string()
    } else {
        format!("accounts_{k}")
    }
}

/// A transfer as the journal records it: inserted by the transfer's own transaction, so it is in
/// the journal exactly when the transfer committed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Transfer {
    #[serde(rename = "_id")]
    pub(crate) id: String,
    pub(crate) from: String,
    pub(crate) to: String,
    pub(crate) amount: i64,
}

/// The journal's collection.
pub(crate) const TRANSFERS: &str = "transfers";

/// The bank's accounts, spread over one or more collections (account `i` in collection
/// `i % collections`), so that a transfer may span collections whose clocks disagree, and the
/// journal of transfers.
#[derive(Clone)]
pub(crate) struct Accounts {
    repos: Vec<Repository<Account>>,
    pub(crate) transfers: Repository<Transfer>,
}

impl Accounts {
    /// The repository holding account `i`.
    pub(crate) fn of(&self, i: usize) -> &Repository<Account> {
        &self.repos[i % self.repos.len()]
    }

    /// Every collection's repository.
    pub(crate) fn all(&self) -> &[Repository<Account>] {
        &self.repos
    }
}

/// What every process needs to reach the bank.
#[derive(Debug, Clone, Args)]
pub(crate) struct Bank {
    /// Connection string.
    #[arg(long)]
    pub(crate) uri: String,
    /// Database of the bank.
    #[arg(long, value_parser = crate::cli::database_name)]
    pub(crate) db: String,
    /// Number of accounts (2 to 100000: a transfer needs two).
    #[arg(long, value_parser = crate::chaos::accounts)]
    pub(crate) accounts: usize,
    /// A transaction's timeout (after it, anyone may abort it).
    #[arg(long, default_value = "3s", value_parser = crate::duration)]
    pub(crate) txn_timeout: Duration,
    /// Collections the accounts are spread over (1 to 64).
    #[arg(long, default_value_t = 1, value_parser = crate::chaos::collections)]
    pub(crate) collections: usize,
}

impl Bank {
    /// Opens the accounts repositories on a store of its own client.
    pub(crate) async fn open(&self) -> Result<(Store, Accounts), String> {
        self.open_waiting(Duration::from_secs(2)).await
    }

    /// Opens the accounts repositories on a store whose writers wait up to `lock_wait` for a
    /// document held by another transaction.
    async fn open_waiting(&self, lock_wait: Duration) -> Result<(Store, Accounts), String> {
        let client = crate::client(&self.uri).await?;
        let store = Store::builder(client.database(&self.db))
            .lock_wait(LockWait {
                max_wait: lock_wait,
                ..LockWait::default()
            })
            .build();
        let mut repos = Vec::new();
        for k in 0..self.collections.max(1) {
            let name = accounts_collection(k);
            repos.push(
                store
                    .repository::<Account>(accounts_spec(&name)?)
                    .await
                    .map_err(|e| format!("open {name}: {e}"))?,
            );
        }
        let transfers = store
            .repository::<Transfer>(
                CollectionSpec::new(
                    TRANSFERS,
                    1,
                    include_str!("../../../schemas/transfers.json"),
                )
                .map_err(|e| format!("schemas/transfers.json: {e}"))?,
            )
            .await
            .map_err(|e| format!("open {TRANSFERS}: {e}"))?;
        Ok((store, Accounts { repos, transfers }))
    }

    /// Transactions with this bank's timeout, each retried for up to `budget`.
    fn transactions_retrying(&self, store: &Store, budget: Duration) -> Transactions {
        Transactions::with_options(
            store,
            TxnOptions::default()
                .timeout(self.txn_timeout)
                .retry(LockWait {
                    max_wait: budget,
                    initial_backoff: Duration::from_millis(2),
                    max_backoff: Duration::from_millis(100),
                }),
        )
    }
}

/// An accounts collection (the project's `schemas/accounts.json`).
pub(crate) fn accounts_spec(name: &str) -> Result<CollectionSpec, String> {
    CollectionSpec::new(name, 1, include_str!("../../../schemas/accounts.json"))
        .map_err(|e| format!("schemas/accounts.json: {e}"))
}

/// Arguments of a worker process.
#[derive(Debug, Args)]
pub(crate) struct WorkerArgs {
    #[command(flatten)]
    bank: Bank,
    /// Print the durations of committed transfers this often (`latencies` lines, for the soak).
    #[arg(long, value_parser = crate::duration)]
    latency_every: Option<Duration>,
}

/// Arguments of a checker process.
#[derive(Debug, Args)]
pub(crate) struct CheckerArgs {
    #[command(flatten)]
    bank: Bank,
    /// The total every consistent snapshot must see.
    #[arg(long)]
    total: i64,
}

/// Counters a process reports.
#[derive(Default)]
struct Counters {
    committed: AtomicU64,
    unknown: AtomicU64,
    expired: AtomicU64,
    failed: AtomicU64,
    plain: AtomicU64,
    snapshots: AtomicU64,
    bad: AtomicU64,
}

/// Stops the process when its stdin closes (the run ends it that way when it does not kill it).
pub(crate) fn watch_stdin(stop: Arc<AtomicBool>) {
    tokio::spawn(async move {
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 64];
        while let Ok(n) = stdin.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
        stop.store(true, Ordering::SeqCst);
    });
}

/// Prints the counters every half second, with this process's clock offset from the server's.
fn report(counters: Arc<Counters>, offset_ms: i64, stop: Arc<AtomicBool>) {
    tokio::spawn(async move {
        loop {
            let c = &counters;
            println!(
                "stats committed={} unknown={} expired={} failed={} plain={} snapshots={} bad={} clock_offset_ms={offset_ms}",
                c.committed.load(Ordering::Relaxed),
                c.unknown.load(Ordering::Relaxed),
                c.expired.load(Ordering::Relaxed),
                c.failed.load(Ordering::Relaxed),
                c.plain.load(Ordering::Relaxed),
                c.snapshots.load(Ordering::Relaxed),
                c.bad.load(Ordering::Relaxed),
            );
            if stop.load(Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
}

/// This process's wall clock minus the server's time, in milliseconds.
async fn clock_offset(store: &Store) -> i64 {
    let local = bson::DateTime::now().timestamp_millis();
    match store.server_time().await {
        Ok(server) => local - server.timestamp_millis(),
        Err(_) => 0,
    }
}

/// What a worker or checker process runs with.
struct Process {
    accounts: Accounts,
    txns: Transactions,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
}

impl Process {
    /// Opens the bank and starts the stdin watch and the reports.
    async fn start(bank: &Bank) -> Result<Process, String> {
        Process::start_waiting(bank, Duration::from_secs(2), Duration::from_secs(5)).await
    }

    /// [`Process::start`], with writers waiting up to `lock_wait` for a held document and each
    /// transaction retried for up to `budget`.
    async fn start_waiting(
        bank: &Bank,
        lock_wait: Duration,
        budget: Duration,
    ) -> Result<Process, String> {
        let (store, accounts) = bank.open_waiting(lock_wait).await?;
        let process = Process {
            txns: bank.transactions_retrying(&store, budget),
            accounts,
            counters: Arc::new(Counters::default()),
            stop: Arc::new(AtomicBool::new(false)),
        };
        watch_stdin(Arc::clone(&process.stop));
        report(
            Arc::clone(&process.counters),
            clock_offset(&store).await,
            Arc::clone(&process.stop),
        );
        Ok(process)
    }

    fn running(&self) -> bool {
        !self.stop.load(Ordering::SeqCst)
    }
}

/// Moves random amounts between random accounts until stopped; now and then writes an account's
/// note outside any transaction.
pub(crate) async fn worker(args: WorkerArgs) -> Result<(), String> {
    let process = Process::start(&args.bank).await?;
    let (accounts, txns, counters) = (&process.accounts, &process.txns, &process.counters);
    let latencies = crate::latency::Latencies::every(args.latency_every);
    let n = args.bank.accounts;
    while process.running() {
        let (from_i, to_i, amount, plain) = {
            let mut rng = rand::rng();
            let from = rng.random_range(0..n);
            (
                from,
                (from + rng.random_range(1..n)) % n,
                rng.random_range(1..=50_i64),
                rng.random_bool(0.1),
            )
        };
        let (from, to) = (account_id(from_i), account_id(to_i));
        let (from_repo, to_repo) = (accounts.of(from_i).clone(), accounts.of(to_i).clone());
        let journal = accounts.transfers.clone();
        let transfer = Transfer {
            id: bson::oid::ObjectId::new().to_hex(),
            from: from.clone(),
            to: to.clone(),
            amount,
        };
        if plain {
            if let Ok(read) = from_repo.get(from.as_str()).await {
                let note = Update::new().set("note", format!("touched by {}", std::process::id()));
                if from_repo
                    .update(from.as_str(), read.version, &note)
                    .await
                    .is_ok()
                {
                    counters.plain.fetch_add(1, Ordering::Relaxed);
                }
            }
            continue;
        }
        let started = std::time::Instant::now();
        let result = txns
            .run(|tx| {
                let (from_repo, to_repo) = (from_repo.clone(), to_repo.clone());
                let (from, to) = (from.clone(), to.clone());
                let (journal, transfer) = (journal.clone(), transfer.clone());
                async move {
                    tx.insert(&journal, &transfer).await?;
                    let a = from_repo.get(from.as_str()).await?;
                    let b = to_repo.get(to.as_str()).await?;
                    tx.adjust(
                        &from_repo,
                        from.as_str(),
                        a.version,
                        &Adjust::new().by("balance", -amount),
                    )
                    .await?;
                    tx.adjust(
                        &to_repo,
                        to.as_str(),
                        b.version,
                        &Adjust::new().by("balance", amount),
                    )
                    .await
                }
            })
            .await;
        if result.is_ok() {
            latencies.since("transfer.commit", started);
            // The run checks that every transfer reported here is in the journal at the end.
            println!("committed-transfer {}", transfer.id);
        }
        let counter = match &result {
            Ok(_) => &counters.committed,
            Err(TxnError::CommitUnknown { .. }) => &counters.unknown,
            Err(e) if expired(e) => &counters.expired,
            Err(_) => &counters.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Whether a transaction (or its last attempt) was aborted by someone else past its deadline.
fn expired(error: &TxnError) -> bool {
    match error {
        TxnError::Expired { .. } => true,
        TxnError::GaveUp { last, .. } => expired(last),
        _ => false,
    }
}

/// Reads every account in one transaction (a check per account) until stopped; each committed
/// snapshot must add up to the total.
pub(crate) async fn checker(args: CheckerArgs) -> Result<(), String> {
    // A check holds every account at once, so it nearly always meets a document held by a
    // coordinator that was killed, and such a hold lasts until the transaction's deadline passes
    // (a transaction timeout at most). Giving up after the writers' two seconds, it would rarely
    // commit while kills come every few seconds (a run once ended with no check committed): it
    // waits out a dead holder instead, as a service that needs a snapshot of every account would.
    let patience = args.bank.txn_timeout + Duration::from_secs(1);
    let process = Process::start_waiting(&args.bank, patience, patience * 2).await?;
    let (accounts, txns, counters) = (&process.accounts, &process.txns, &process.counters);
    while process.running() {
        let snapshot = txns
            .run(|tx| {
                let accounts = accounts.clone();
                async move {
                    // One query per collection rather than one read per account, the queries
                    // at once: the shorter the time between the first read and the commit, the
                    // fewer writes land in between, so that checks still commit while writers
                    // run flat out (with a read per account, a check of 18 accounts could starve
                    // under 30 s skews).
                    let reads = futures::future::try_join_all(
                        accounts.all().iter().map(|repo| repo.find(Query::new())),
                    )
                    .await?;
                    let mut total = 0;
                    for (repo, found) in accounts.all().iter().zip(reads) {
                        for read in found {
                            tx.check(repo, read.value.id.as_str(), read.version)?;
                            total += read.balance;
                        }
                    }
                    Ok(total)
                }
            })
            .await;
        match snapshot {
            Ok((total, _)) if total == args.total => {
                counters.snapshots.fetch_add(1, Ordering::Relaxed);
            }
            Ok((total, outcome)) => {
                counters.bad.fetch_add(1, Ordering::Relaxed);
                println!(
                    "bad-snapshot total={total} expected={} txn={:?}",
                    args.total, outcome.txn
                );
            }
            Err(TxnError::CommitUnknown { .. }) => {
                counters.unknown.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                counters.failed.fetch_add(1, Ordering::Relaxed);
                // Why, for the run's results: a check that never commits must say what stopped it.
                println!("failed {}", e.to_string().replace('\n', " "));
            }
        }
    }
    Ok(())
}
