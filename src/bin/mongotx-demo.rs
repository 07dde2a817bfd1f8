//! A guided tour of mongotx's features against a real server.
//!
//! Uses `MONGODB_URI` when set, otherwise starts the local test server from `tools/`. Every step
//! prints what happens and checks that it happened; any surprise exits non-zero.

#[path = "shared/cli.rs"]
mod cli;

use std::error::Error;
use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId, Document};
use clap::Parser;
use mongotx::failpoint::{self, CrashAt, Failpoint};
use mongotx::test_server::TestServer;
use mongotx::{
    fields, Adjust, CollectionSpec, Finish, Gc, GcOptions, LockWait, Query, RepoError, Repository,
    Stamped, Store, Transaction, Transactions, TxnError, TxnOptions, Update,
};
use serde::{Deserialize, Serialize};

/// Walks through every mongotx feature, printing what happens.
#[derive(Debug, Parser)]
#[command(name = "mongotx-demo", version)]
struct Args {
    /// Database to use (a fresh uniquely named one by default, dropped at the end).
    #[arg(long, value_parser = cli::database_name)]
    db: Option<String>,
    /// Keep the database after the tour.
    #[arg(long)]
    keep: bool,
    /// How long to look for the server (MONGODB_URI's, or the local one) before giving up.
    #[arg(long, default_value = "10s", value_parser = cli::connect_timeout)]
    connect_timeout: Duration,
}

type DemoResult<T = ()> = Result<T, Box<dyn Error>>;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Account {
    #[serde(rename = "_id")]
    id: String,
    owner: String,
    balance: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Profile {
    #[serde(rename = "_id")]
    id: String,
    given_name: String,
    family_name: String,
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,mongotx::failpoint=off")
            }),
        )
        .init();
    let args = Args::parse();
    if let Err(error) = run(args).await {
        eprintln!("\nDEMO FAILED: {}", cli::one_line(&error.to_string()));
        std::process::exit(1);
    }
}

async fn run(args: Args) -> DemoResult {
    let server = TestServer::start()?;
    println!("== mongotx demo ==");
    println!("server: {} at {}", server.kind(), server.uri());

    let client = cli::connect(
        server.uri(),
        "MONGODB_URI",
        "mongotx-demo",
        args.connect_timeout,
    )
    .await?;
    let db_name = args
        .db
        .clone()
        .unwrap_or_else(|| format!("mongotx_demo_{}", ObjectId::new().to_hex()));
    let db = client.database(&db_name);
    println!("database: {db_name}\n");

    let caps = mongotx::probe(&db).await?;
    step("Server probe");
    println!(
        "  duplicate _id rejected, {} concurrent compare-and-set increments lost nothing ({} retries), \
         {} concurrent find-and-modify calls each got their own post-image",
        caps.contention_tasks, caps.contention_retries, caps.contention_tasks
    );
    println!(
        "  server version {}, topology {}, server-side $jsonSchema validation: {}",
        caps.version.as_deref().unwrap_or("unknown"),
        caps.topology,
        if caps.json_schema_validation {
            "enforced"
        } else {
            "not enforced (validated on the client)"
        }
    );
    println!(
        "  bulkWrite (MongoDB 8.0+): {}",
        if caps.bulk_write {
            "yes: the writes of a commit round go in one message"
        } else {
            "no: the writes of a commit round go as one command each, all at once"
        }
    );
    let needed = caps.semantics.iter().filter(|s| s.needed).count();
    let held = caps.semantics.iter().filter(|s| s.held).count();
    let missing: Vec<&str> = caps
        .semantics
        .iter()
        .filter(|s| !s.held)
        .map(|s| s.name)
        .collect();
    println!(
        "  behaviours mongotx relies on: {held} of {} held, all {needed} it cannot do without among them; not held: {}",
        caps.semantics.len(),
        if missing.is_empty() {
            "none".to_string()
        } else {
            missing.join(", ")
        }
    );

    let store = Store::builder(db.clone())
        .lock_wait(LockWait {
            max_wait: Duration::from_millis(800),
            ..LockWait::default()
        })
        // Purged tombstones wait for this long under a raised version floor (20 s by default).
        .version_floor_grace(Duration::from_millis(500))
        .build();
    let accounts_spec =
        CollectionSpec::new("accounts", 1, include_str!("../../schemas/accounts.json"))?;
    let accounts: Repository<Account> = store.repository(accounts_spec).await?;

    tour_clock(&store).await?;
    tour_basics(&accounts).await?;
    tour_conflict(&accounts).await?;
    tour_delete(&accounts).await?;
    tour_upgrade(&store, &db).await?;
    tour_bad_input(&accounts, &db).await?;
    tour_locked(&store, &accounts).await?;
    tour_transfer(&store, &accounts).await?;
    tour_crash_recovery(&store, &accounts, &db).await?;
    tour_orphan(&store, &accounts, &db).await?;
    tour_unique(&store, &db).await?;
    tour_ids(&store).await?;
    tour_quota(&store).await?;
    let second_client = cli::connect(
        server.uri(),
        "MONGODB_URI",
        "mongotx-demo",
        args.connect_timeout,
    )
    .await?;
    tour_obt(&store, &Store::new(second_client.database(db.name()))).await?;
    tour_ratelimit(&store).await?;
    tour_queue(&store).await?;

    if !args.keep {
        db.drop().await?;
    }
    println!("\nAll steps behaved as described.");
    Ok(())
}

fn step(title: &str) {
    println!("\n-- {title}");
}

fn expect(condition: bool, what: &str) -> DemoResult {
    if condition {
        Ok(())
    } else {
        Err(format!("expected {what}").into())
    }
}

async fn tour_basics(accounts: &Repository<Account>) -> DemoResult {
    step("Insert and read stamped documents");
    for (id, owner, balance) in [("alice", "Alice", 100), ("bob", "Bob", 50)] {
        let account = Account {
            id: id.into(),
            owner: owner.into(),
            balance,
            note: None,
        };
        accounts.insert(&account).await?;
    }
    let alice = accounts.get("alice").await?;
    println!(
        "  inserted alice and bob; get(alice) -> owner {:?}, balance {}, version {}",
        alice.owner, alice.balance, alice.version
    );
    expect(alice.version == 1, "version 1 after insert")?;

    let version = accounts
        .adjust("alice", 1, &Adjust::new().by("balance", 25_i64))
        .await?;
    let alice = accounts.get("alice").await?;
    println!(
        "  adjust(alice, balance += 25) -> balance {}, version {version}",
        alice.balance
    );
    expect(
        alice.balance == 125 && version == 2,
        "balance 125 at version 2",
    )?;

    let rich = accounts
        .find(
            Query::new()
                .filter(doc! { "balance": { "$gt": 60_i64 } })
                .sort(doc! { "_id": 1 }),
        )
        .await?;
    let ids: Vec<&str> = rich.iter().filter_map(|a| a.id.as_str()).collect();
    println!("  find(balance > 60) -> {ids:?}");
    expect(ids == ["alice"], "only alice above 60")
}

async fn tour_conflict(accounts: &Repository<Account>) -> DemoResult {
    step("Two concurrent updates of the same version: one wins, one gets VersionConflict");
    let read = accounts.get("alice").await?;
    println!("  both writers read alice at version {}", read.version);
    let rename = Update::new().set("owner", "Alice A.");
    let tag = Update::new().set("note", "VIP");
    let first = accounts.update("alice", read.version, &rename);
    let second = accounts.update("alice", read.version, &tag);
    let (a, b) = tokio::join!(first, second);
    let (winner, loser) = match (&a, &b) {
        (Ok(_), Err(_)) => ("owner -> \"Alice A.\"", &b),
        (Err(_), Ok(_)) => ("note -> \"VIP\"", &a),
        _ => return Err(format!("expected exactly one winner, got {a:?} and {b:?}").into()),
    };
    println!("  winner: {winner}");
    match loser {
        Err(
            error @ RepoError::VersionConflict {
                expected, actual, ..
            },
        ) => {
            println!("  loser: {error}");
            expect(actual == &(expected + 1), "actual = expected + 1")?;
        }
        other => return Err(format!("expected VersionConflict, got {other:?}").into()),
    }
    let reread = accounts.get("alice").await?;
    let retry = if reread.owner == "Alice A." {
        Update::new().set("note", "VIP")
    } else {
        Update::new().set("owner", "Alice A.")
    };
    let version = accounts.update("alice", reread.version, &retry).await?;
    let alice = accounts.get("alice").await?;
    println!(
        "  the loser re-reads (version {}) and retries -> version {version}: owner {:?}, note {:?}",
        reread.version, alice.owner, alice.note
    );
    expect(
        alice.owner == "Alice A." && alice.note.as_deref() == Some("VIP"),
        "both changes kept",
    )
}

async fn tour_delete(accounts: &Repository<Account>) -> DemoResult {
    step("Soft delete: Deleted is not NotFound");
    let bob = accounts.get("bob").await?;
    let version = accounts.delete("bob", bob.version).await?;
    println!("  delete(bob) -> tombstone at version {version}");
    match accounts.get("bob").await {
        Err(error @ RepoError::Deleted { .. }) => println!("  get(bob)   -> {error}"),
        other => return Err(format!("expected Deleted, got {other:?}").into()),
    }
    match accounts.get("carol").await {
        Err(error @ RepoError::NotFound { .. }) => println!("  get(carol) -> {error}"),
        other => return Err(format!("expected NotFound, got {other:?}").into()),
    }
    match accounts
        .update("bob", version, &Update::new().set("owner", "Zombie"))
        .await
    {
        Err(error @ RepoError::Deleted { .. }) => println!("  update(bob) -> {error}"),
        other => return Err(format!("expected Deleted, got {other:?}").into()),
    }
    tokio::time::sleep(Duration::from_millis(5)).await;
    let purged = accounts.purge_tombstones(Duration::ZERO).await?;
    let after = accounts.get("bob").await;
    println!(
        "  purge_tombstones(retention 0) removed {purged}; get(bob) -> {}",
        after
            .as_ref()
            .err()
            .map(ToString::to_string)
            .unwrap_or_default()
    );
    expect(
        matches!(after, Err(RepoError::NotFound { .. })),
        "NotFound after purge",
    )?;
    accounts.insert(&account("bob", 50)).await?;
    let again = accounts.get("bob").await?;
    println!(
        "  insert(bob) again -> version {}: above the purged tombstone's {version}, so no stale version can match",
        again.version
    );
    expect(again.version > version, "a version above the purged one")
}

async fn tour_upgrade(store: &Store, db: &mongodb::Database) -> DemoResult {
    step("Schema upgrade on read");
    // A profile written by an older release, in schema version 1: one `name` field.
    db.collection::<Document>("profiles")
        .insert_one(doc! {
            "_id": "ada", "name": "Ada Lovelace",
            fields::SCHEMA_VERSION: 1_i64, fields::VERSION: 1_i64,
        })
        .await?;
    println!("  stored (version 1 shape): {{ _id: \"ada\", name: \"Ada Lovelace\" }}");
    let spec = CollectionSpec::new("profiles", 2, include_str!("../../schemas/profiles.json"))?
        .upgrade(1, |mut d: Document| {
            let name = d.get_str("name").map_err(|e| e.to_string())?.to_string();
            d.remove("name");
            let mut words = name.splitn(2, ' ');
            d.insert("given_name", words.next().unwrap_or_default());
            d.insert("family_name", words.next().unwrap_or_default());
            Ok(d)
        });
    let profiles: Repository<Profile> = store.repository(spec).await?;
    let ada = profiles.get("ada").await?;
    println!(
        "  get(ada) with code at schema version 2 -> given_name {:?}, family_name {:?} (stored as version {})",
        ada.given_name, ada.family_name, ada.stored_schema_version
    );
    expect(
        ada.given_name == "Ada" && ada.family_name == "Lovelace",
        "the split name",
    )?;
    let version = profiles
        .update(
            "ada",
            ada.version,
            &Update::new().set("family_name", "King"),
        )
        .await?;
    let stored = db
        .collection::<Document>("profiles")
        .find_one(doc! { "_id": "ada" })
        .await?;
    let stamped = stored
        .as_ref()
        .and_then(|d| d.get_i64(fields::SCHEMA_VERSION).ok());
    println!("  update(ada) -> version {version}; the document is now stored in schema version {stamped:?}");
    expect(stamped == Some(2), "the write to stamp schema version 2")
}

async fn tour_bad_input(accounts: &Repository<Account>, db: &mongodb::Database) -> DemoResult {
    step("Bad input gets a typed error and changes nothing");
    let accounts_raw = db.collection::<Document>("accounts");
    let count = || accounts_raw.count_documents(doc! {});
    let before = count().await?;
    let bad = Account {
        id: "dora".into(),
        owner: String::new(),
        balance: 1,
        note: None,
    };
    let results = [
        accounts.insert(&bad).await.map(|_| 0),
        accounts
            .update("alice", 0, &Update::new().set("owner", "x"))
            .await,
        accounts
            .update("alice", 4, &Update::new().set("balance", "lots"))
            .await,
        accounts
            .adjust("alice", 4, &Adjust::new().by("balance", f64::NAN))
            .await,
        accounts
            .update("alice", 4, &Update::new().set("_version", 9_i64))
            .await,
        accounts.get(7).await.map(|_| 0),
    ];
    for result in results {
        match result {
            Err(error) => println!("  {error}"),
            Ok(_) => return Err("bad input was accepted".into()),
        }
    }
    expect(count().await? == before, "no document count change")?;
    // Where the server enforces the schema too, a write that bypasses mongotx is refused there.
    let raw = accounts_raw
        .insert_one(doc! { "_id": "raw", "owner": "", "balance": "lots", "_schema": 1_i64, "_version": 1_i64 })
        .await;
    match raw {
        Err(e) => println!(
            "  a raw driver insert of the same kind of document: refused by the server's validator ({})",
            mongotx_code(&e)
        ),
        Ok(_) => println!(
            "  a raw driver insert of the same kind of document: stored (this server does not enforce validators; mongotx's client-side check is the only one)"
        ),
    }
    Ok(())
}

/// The server's error code in a driver error, for display.
fn mongotx_code(error: &mongodb::error::Error) -> String {
    use mongodb::error::{ErrorKind, WriteFailure};
    match error.kind.as_ref() {
        ErrorKind::Write(WriteFailure::WriteError(e)) => format!("code {}", e.code),
        ErrorKind::Command(e) => format!("code {}", e.code),
        _ => error.to_string(),
    }
}

async fn tour_locked(store: &Store, accounts: &Repository<Account>) -> DemoResult {
    step("A document held by a live transaction makes writers wait, then fail Locked");
    let alice = accounts.get("alice").await?;
    let bob = accounts.get("bob").await?;
    // A coordinator that stops for good after bob changed under it and before it could abort:
    // alice is held, bob's apply is missing, so the transaction is undecided until its deadline.
    let timeout = Duration::from_secs(2);
    let stalled = Transactions::with_options(
        store,
        TxnOptions::default()
            .timeout(timeout)
            .finish(Finish::BeforeReturning)
            .fault_injector(std::sync::Arc::new(CrashAt(Failpoint {
                name: failpoint::ABORT_BEFORE,
                step: 0,
            }))),
    );
    let tx = stalled.begin();
    tx.update(
        accounts,
        "alice",
        alice.version,
        &Update::new().set("owner", "Uncommitted"),
    )
    .await?;
    tx.update(
        accounts,
        "bob",
        bob.version,
        &Update::new().set("note", "x"),
    )
    .await?;
    let begun = Instant::now();
    accounts
        .update(
            "bob",
            bob.version,
            &Update::new().set("note", "changed meanwhile"),
        )
        .await?;
    expect(
        matches!(tx.commit().await, Err(TxnError::Crashed { .. })),
        "a stalled coordinator",
    )?;
    let read = accounts.get("alice").await?;
    println!(
        "  a transaction holds alice with owner \"Uncommitted\"; readers see the committed owner {:?}",
        read.owner
    );
    expect(
        read.owner == alice.owner && read.version == alice.version,
        "the committed value",
    )?;
    let started = Instant::now();
    let result = accounts
        .update("alice", alice.version, &Update::new().set("owner", "x"))
        .await;
    match result {
        Err(error @ RepoError::Locked { .. }) => {
            println!("  after {:?}: {error}", started.elapsed());
        }
        other => return Err(format!("expected Locked, got {other:?}").into()),
    }
    // Past its deadline (on the server's clock) anyone may fence the missing participant and
    // abort it; a GC round does so for every such transaction.
    tokio::time::sleep((timeout + Duration::from_millis(100)).saturating_sub(begun.elapsed()))
        .await;
    let round = Gc::with_store(store, GcOptions::default())
        .run_round()
        .await?;
    expect(
        round.rolled_back == 1,
        "the stalled transaction rolled back",
    )?;
    let version = accounts
        .update("alice", alice.version, &Update::new().set("owner", "Alice"))
        .await?;
    println!("  once its deadline passed and it was rolled back, the same write succeeds -> version {version}");
    Ok(())
}

fn account(id: &str, balance: i64) -> Account {
    Account {
        id: id.into(),
        owner: id.to_uppercase(),
        balance,
        note: None,
    }
}

async fn balances(accounts: &Repository<Account>, ids: &[&str]) -> DemoResult<Vec<(i64, i64)>> {
    let mut out = Vec::new();
    for id in ids {
        let read = accounts.get(*id).await?;
        out.push((read.balance, read.version));
    }
    Ok(out)
}

/// How many accounts a transaction holds right now.
async fn held_accounts(db: &mongodb::Database) -> DemoResult<u64> {
    let held = doc! { fields::ACTIVE_TXN: { "$exists": true } };
    Ok(db
        .collection::<Document>("accounts")
        .count_documents(held)
        .await?)
}

/// Stages moving `amount` between two accounts as read.
async fn stage_transfer(
    tx: &Transaction,
    accounts: &Repository<Account>,
    (from, to): (&Stamped<Account>, &Stamped<Account>),
    amount: i64,
) -> Result<(), TxnError> {
    let by = |amount: i64| Adjust::new().by("balance", amount);
    tx.adjust(accounts, from.id.clone(), from.version, &by(-amount))
        .await?;
    tx.adjust(accounts, to.id.clone(), to.version, &by(amount))
        .await
}

async fn tour_transfer(store: &Store, accounts: &Repository<Account>) -> DemoResult {
    step("A transfer between two accounts: one all-or-nothing transaction, retried on conflict");
    accounts.insert(&account("dave", 300)).await?;
    accounts.insert(&account("erin", 20)).await?;
    let txns = Transactions::new(store);
    let mut attempts = 0;
    let (moved, outcome) = txns
        .run(|tx| {
            attempts += 1;
            let first = attempts == 1;
            let accounts = accounts.clone();
            async move {
                let dave = accounts.get("dave").await?;
                let erin = accounts.get("erin").await?;
                if first {
                    // Someone else changes dave between our read and our commit.
                    accounts
                        .update("dave", dave.version, &Update::new().set("note", "audited"))
                        .await?;
                }
                let amount = 120_i64;
                stage_transfer(&tx, &accounts, (&dave, &erin), amount).await?;
                Ok(amount)
            }
        })
        .await?;
    let after = balances(accounts, &["dave", "erin"]).await?;
    println!(
        "  moved {moved} from dave to erin in {attempts} attempts (the first met a VersionConflict and was rerun)"
    );
    println!(
        "  dave {} (version {}), erin {} (version {}); the commit wrote 2k + 3 = {} times: ActiveTransaction, 2 applies, commit point, 2 finishes, end",
        after[0].0, after[0].1, after[1].0, after[1].1, 2 * 2 + 3
    );
    expect(attempts == 2, "one retry after the conflict")?;
    expect(
        after[0].0 == 180 && after[1].0 == 140,
        "dave 180 and erin 140",
    )?;
    expect(
        outcome.version_of("accounts", "erin") == Some(after[1].1),
        "outcome has erin's version",
    )?;

    let (total, _) = txns
        .run(|tx| {
            let accounts = accounts.clone();
            async move {
                let mut total = 0;
                for id in ["dave", "erin"] {
                    let read = accounts.get(id).await?;
                    tx.check(&accounts, id, read.version)?;
                    total += read.balance;
                }
                Ok(total)
            }
        })
        .await?;
    println!("  a read-only transaction of two checks confirms a consistent total of {total}");
    expect(total == 320, "total 320")
}

async fn tour_crash_recovery(
    store: &Store,
    accounts: &Repository<Account>,
    db: &mongodb::Database,
) -> DemoResult {
    step("A coordinator dies mid-commit; the GC (what mongotx-gc runs each round) recovers it");
    let timeout = Duration::from_millis(300);
    let dying = |at: &'static str, step: usize| {
        Transactions::with_options(
            store,
            TxnOptions::default()
                .timeout(timeout)
                .finish(Finish::BeforeReturning)
                .fault_injector(std::sync::Arc::new(CrashAt(Failpoint { name: at, step }))),
        )
    };
    let transfer = |txns: Transactions, amount: i64| {
        let accounts = accounts.clone();
        async move {
            let tx = txns.begin();
            let dave = accounts.get("dave").await?;
            let erin = accounts.get("erin").await?;
            stage_transfer(&tx, &accounts, (&dave, &erin), amount).await?;
            tx.commit().await.map(|_| ())
        }
    };

    let before = balances(accounts, &["dave", "erin"]).await?;
    // It dies mid-round: dave's apply went out, erin's and the record never did.
    match transfer(dying(failpoint::APPLY_BEFORE, 1), 50).await {
        Err(error @ TxnError::Crashed { .. }) => println!("  first coordinator: {error}"),
        other => return Err(format!("expected a crash, got {other:?}").into()),
    }
    let held = held_accounts(db).await?;
    let seen = balances(accounts, &["dave", "erin"]).await?;
    println!(
        "  {held} documents are left held; readers still see the committed balances {} and {}",
        seen[0].0, seen[1].0
    );
    expect(held == 1, "one held document")?;
    expect(
        seen[0].0 == before[0].0 && seen[1].0 == before[1].0,
        "pre-images",
    )?;

    tokio::time::sleep(timeout + Duration::from_millis(100)).await;
    let gc = Gc::new(db.clone(), GcOptions::default());
    let round = gc.run_round().await?;
    println!(
        "  GC round past the deadline: a hold without a record undone (swept={}), an aborted record written in the missing one's place",
        round.swept
    );
    expect(round.swept >= 1, "a hold undone")?;
    // The next round deletes that aborted record: its deadline has passed on the server.
    let round = gc.run_round().await?;
    println!(
        "  next GC round: rolled_back={} (the aborted record goes)",
        round.rolled_back
    );
    let after = balances(accounts, &["dave", "erin"]).await?;
    let left = db
        .collection::<Document>(store.transactions_collection())
        .count_documents(doc! {})
        .await?;
    println!(
        "  dave {} (version {}), erin {} (version {}): nothing of the dead transfer applied; {left} ActiveTransaction documents left",
        after[0].0, after[0].1, after[1].0, after[1].1
    );
    expect(round.rolled_back >= 1, "a rollback")?;
    expect(
        after[0].0 == before[0].0 && after[1].0 == before[1].0,
        "balances unchanged",
    )?;
    expect(left == 0, "no ActiveTransaction left")?;

    // The same crash after the commit point: the GC rolls it forward instead.
    match transfer(dying(failpoint::COMMIT_AFTER, 0), 40).await {
        Err(error @ TxnError::Crashed { .. }) => println!("  second coordinator: {error}"),
        other => return Err(format!("expected a crash, got {other:?}").into()),
    }
    let seen = balances(accounts, &["dave", "erin"]).await?;
    println!(
        "  past the commit point, readers already see dave {} and erin {} while the documents are still held",
        seen[0].0, seen[1].0
    );
    expect(
        seen[0].0 == before[0].0 - 40,
        "post-image after the commit point",
    )?;
    tokio::time::sleep(timeout + Duration::from_millis(100)).await;
    let round = gc.run_round().await?;
    let held = held_accounts(db).await?;
    println!(
        "  GC round: finished={} rolled_back={}; {held} documents still held",
        round.finished, round.rolled_back
    );
    expect(round.finished == 1 && held == 0, "rolled forward and freed")
}

async fn tour_clock(store: &Store) -> DemoResult {
    step("One clock for every deadline: the server's");
    let server = store.server_time().await?;
    let local = bson::DateTime::now();
    println!(
        "  server time {server}, this host's clock differs by {} ms; deadlines are set and compared in server time",
        local.timestamp_millis() - server.timestamp_millis()
    );
    println!(
        "  durability {:?} on a {}: protocol writes {}",
        store.durability(),
        store.topology().await?,
        if store.topology().await?.is_replicated() {
            "are majority-acknowledged"
        } else {
            "use the client's write concern (a standalone server has no failover)"
        }
    );
    Ok(())
}

async fn tour_orphan(
    store: &Store,
    accounts: &Repository<Account>,
    db: &mongodb::Database,
) -> DemoResult {
    step("A hold whose transaction is gone (what a late-delivered write leaves) harms nobody");
    let before = accounts.get("erin").await?;
    let stalled = Transactions::with_options(
        store,
        TxnOptions::default()
            .timeout(Duration::from_secs(3600))
            .finish(Finish::BeforeReturning)
            .fault_injector(std::sync::Arc::new(CrashAt(Failpoint {
                name: failpoint::BEGIN_BEFORE,
                step: 0,
            }))),
    );
    let tx = stalled.begin();
    tx.adjust(
        accounts,
        "erin",
        before.version,
        &Adjust::new().by("balance", 1_000_i64),
    )
    .await?;
    expect(
        matches!(tx.commit().await, Err(TxnError::Crashed { .. })),
        "a crash",
    )?;
    // Its apply landed, its record never did: as if the transaction had ended long ago and this
    // apply had arrived afterwards.
    let stored = db
        .collection::<Document>("accounts")
        .find_one(doc! { "_id": "erin" })
        .await?
        .ok_or("erin is stored")?;
    println!(
        "  erin is stored with balance {} and held by a transaction that has no record; its hold carries its own undo",
        stored.get_i64("balance").unwrap_or_default()
    );
    let read = accounts.get("erin").await?;
    println!(
        "  get(erin) -> balance {} at version {} (not committed: the hold is ignored)",
        read.balance, read.version
    );
    expect(
        read.balance == before.balance && read.version == before.version,
        "the committed value",
    )?;
    let started = Instant::now();
    let version = accounts
        .update("erin", before.version, &Update::new().set("note", "fine"))
        .await?;
    println!(
        "  a writer waits 250 ms for a record that may be on its way, writes an aborted one in its place, undoes the hold and writes, in {:?} -> version {version}",
        started.elapsed()
    );
    expect(held_accounts(db).await? == 0, "no hold left")?;
    Ok(())
}

async fn tour_unique(store: &Store, db: &mongodb::Database) -> DemoResult {
    step("Tombstones next to a plain unique index");
    db.collection::<Document>("members")
        .create_index(
            mongodb::IndexModel::builder()
                .keys(doc! { "owner": 1 })
                .options(
                    mongodb::options::IndexOptions::builder()
                        .unique(true)
                        .build(),
                )
                .build(),
        )
        .await?;
    let spec = CollectionSpec::new("members", 1, include_str!("../../schemas/accounts.json"))?;
    let members: Repository<Account> = store.repository(spec).await?;
    for id in ["m1", "m2", "m3"] {
        members.insert(&account(id, 1)).await?;
    }
    members.delete("m1", 1).await?;
    members.delete("m2", 1).await?;
    println!("  unique index on owner; deleted two members: both tombstones fit the index");
    members.insert(&account("m4", 1).renamed("M1")).await?;
    println!("  a new member takes the deleted member's owner \"M1\": the key is free again");
    match members.insert(&account("m5", 1).renamed("M3")).await {
        Err(error @ RepoError::DuplicateKey { .. }) => {
            println!("  a clash with a live member: {error}")
        }
        other => return Err(format!("expected DuplicateKey, got {other:?}").into()),
    }
    Ok(())
}

async fn tour_ids(store: &Store) -> DemoResult {
    step("Ids as the server compares them: Int32 7, Int64 7 and Double 7.0 are one document");
    let spec = CollectionSpec::new("counters", 1, COUNTERS)?;
    let counters: Repository<Counter> = store.repository(spec).await?;
    counters
        .insert(&Counter {
            id: bson::Bson::Int32(7),
            n: 0,
        })
        .await?;
    let read = counters.get(bson::Bson::Double(7.0)).await?;
    println!(
        "  inserted id Int32 7; get(Double 7.0) -> n {} at version {}",
        read.n, read.version
    );
    let tx = Transactions::new(store).begin();
    tx.adjust(
        &counters,
        bson::Bson::Int32(7),
        1,
        &Adjust::new().by("n", 1_i64),
    )
    .await?;
    match tx
        .adjust(
            &counters,
            bson::Bson::Int64(7),
            1,
            &Adjust::new().by("n", 1_i64),
        )
        .await
    {
        Err(error @ TxnError::DuplicateEntry { .. }) => {
            println!("  staging Int64 7 as well: {error}")
        }
        other => return Err(format!("expected DuplicateEntry, got {other:?}").into()),
    }
    tx.commit().await?;
    expect(
        counters.get(bson::Bson::Int64(7)).await?.n == 1,
        "one increment",
    )
}

const COUNTERS: &str = include_str!("../../schemas/counters.json");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Counter {
    #[serde(rename = "_id")]
    id: bson::Bson,
    n: i64,
}

impl Account {
    fn renamed(self, owner: &str) -> Account {
        Account {
            owner: owner.into(),
            ..self
        }
    }
}

/// Quotas: a race for the last units, an all-or-nothing claim, a parent's limit, an expiring
/// reservation returned by the GC.
/// The seed's story: two API servers, four storage nodes, a stalled attach and a detach.
async fn tour_obt(server1: &Store, server2: &Store) -> DemoResult {
    use mongotx::obt::{Fence, FenceError, MemoryFence, NewObt, Obt, ObtError};

    #[derive(Debug, Serialize, Deserialize)]
    struct Dlv {
        #[serde(rename = "_id")]
        name: String,
        size: i64,
        status: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        token: Option<i64>,
    }
    let spec = CollectionSpec::new("dlvs", 1, include_str!("../../schemas/dlvs.json"))?;
    let dlvs1: Repository<Dlv> = server1.repository(spec.clone()).await?;
    let dlvs2: Repository<Dlv> = server2.repository(spec).await?;
    dlvs1
        .insert(&Dlv {
            name: "dlv0".into(),
            size: 3_000_000_000,
            status: "available".into(),
            token: None,
        })
        .await?;
    let (obt1, obt2) = (Obt::open(server1).await?, Obt::open(server2).await?);
    let (txns1, txns2) = (Transactions::new(server1), Transactions::new(server2));
    let nodes: Vec<MemoryFence> = (0..4).map(|_| MemoryFence::new()).collect();

    step("OBT: API server 1 starts attaching dlv0, reaches two of four storage nodes, then stalls");
    let api1 = obt1
        .create(NewObt::new("t0", "api-1").lease(Duration::from_secs(30)))
        .await?;
    for (i, node) in nodes.iter().enumerate().take(2) {
        node.admit("dlv0", api1.token).await?;
        println!("  dpv{i}: attach step with token {} admitted", api1.token);
    }
    obt1.advance("t0", "api-1", 1).await?;

    step("OBT: API server 2 preempts the OBT and detaches dlv0 on all four nodes and in the database");
    let api2 = obt2.preempt("t0", "api-1", "api-2").await?;
    println!(
        "  preempted: owner api-2, token {} (was {})",
        api2.token, api1.token
    );
    for node in &nodes {
        node.admit("dlv0", api2.token).await?;
    }
    let tx = txns2.begin();
    let current = dlvs2.get("dlv0").await?;
    tx.update(
        &dlvs2,
        "dlv0",
        current.version,
        &Update::new()
            .set("status", "detached")
            .set("token", api2.token.get()),
    )
    .await?;
    obt2.commit_owned(tx, &api2).await?;
    obt2.release("t0", "api-2").await?;
    println!("  dlv0 detached on dpv0-3, recorded, OBT released");

    step("OBT: API server 1 wakes up and carries on with its attach: every call is rejected");
    for (i, node) in nodes.iter().enumerate() {
        match node.admit("dlv0", api1.token).await {
            Err(e @ FenceError::StaleToken { .. }) => println!("  dpv{i}: {e}"),
            other => {
                return Err(format!("dpv{i} should refuse token {}: {other:?}", api1.token).into())
            }
        }
    }
    let tx = txns1.begin();
    let seen = dlvs1.get("dlv0").await?;
    tx.update(
        &dlvs1,
        "dlv0",
        seen.version,
        &Update::new()
            .set("status", "attached")
            .set("token", api1.token.get()),
    )
    .await?;
    match obt1.commit_owned(tx, &api1).await {
        Err(e @ ObtError::Preempted { .. }) => println!("  database: {e}"),
        other => return Err(format!("server 1's write should be refused: {other:?}").into()),
    }
    let last = dlvs1.get("dlv0").await?;
    println!(
        "  dlv0 is {} (written under token {:?})",
        last.value.status, last.value.token
    );
    expect(
        last.value.status == "detached",
        "the volume to end detached",
    )?;
    Ok(())
}

async fn tour_quota(store: &Store) -> DemoResult {
    use mongotx::quota::{NewProvider, Quota, QuotaError, Request};

    let quota = Quota::open(store).await?;
    step("Quota: two consumers race for the last units of a provider");
    quota
        .create(NewProvider::new(("project/42", "cores"), 16))
        .await?;
    quota
        .consume(&Request::new("vm-0").take(("project/42", "cores"), 12))
        .await?;
    let (a, b) = (
        Request::new("vm-a").take(("project/42", "cores"), 3),
        Request::new("vm-b").take(("project/42", "cores"), 3),
    );
    let (ra, rb) = tokio::join!(quota.consume(&a), quota.consume(&b));
    for (name, result) in [("vm-a", &ra), ("vm-b", &rb)] {
        match result {
            Ok(done) => println!("  {name}: consumed 3 cores in {} write", done.writes),
            Err(e) => println!("  {name}: {e}"),
        }
    }
    expect(
        ra.is_ok() != rb.is_ok(),
        "exactly one of the two to get 3 of the last 4 cores",
    )?;
    let p = quota.provider(("project/42", "cores")).await?;
    println!(
        "  project/42 cores: usage {} of {}, generation {}",
        p.usage, p.limit, p.generation
    );
    expect(p.usage == 15, "usage 15")?;

    step("Quota: a claim on three resources that fails on one leaves the other two untouched");
    quota
        .create(NewProvider::new(("project/42", "ram_gb"), 64))
        .await?;
    quota
        .create(NewProvider::new(("project/42", "disk_gb"), 100))
        .await?;
    let before = (
        quota.provider(("project/42", "ram_gb")).await?.generation,
        quota.provider(("project/42", "disk_gb")).await?.generation,
    );
    let claim = Request::new("db-1")
        .take(("project/42", "ram_gb"), 32)
        .take(("project/42", "disk_gb"), 50)
        .take(("project/42", "cores"), 4);
    match quota.consume(&claim).await {
        Err(e @ QuotaError::QuotaExceeded { .. }) => println!("  refused: {e}"),
        other => return Err(format!("expected QuotaExceeded, got {other:?}").into()),
    }
    let after = (
        quota.provider(("project/42", "ram_gb")).await?.generation,
        quota.provider(("project/42", "disk_gb")).await?.generation,
    );
    println!("  ram and disk generations before {before:?}, after {after:?}: nothing taken");
    expect(before == after, "ram and disk unchanged")?;

    step("Quota: a child project is stopped by its parent's limit");
    quota
        .create(NewProvider::new(("domain/7", "seats"), 10))
        .await?;
    for project in ["project/a", "project/b"] {
        quota
            .create(NewProvider::new((project, "seats"), 8).parent(("domain/7", "seats")))
            .await?;
    }
    quota
        .consume(&Request::new("team-a").take(("project/a", "seats"), 7))
        .await?;
    match quota
        .consume(&Request::new("team-b").take(("project/b", "seats"), 5))
        .await
    {
        Err(e @ QuotaError::QuotaExceeded { .. }) => println!("  project/b asks 5: {e}"),
        other => return Err(format!("expected the domain to refuse, got {other:?}").into()),
    }
    let released = quota.release("team-a").await?;
    let returned: Vec<String> = released
        .returned
        .iter()
        .map(|(p, n)| format!("{n} to {p}"))
        .collect();
    println!("  team-a releases: {}", returned.join(", "));
    quota
        .consume(&Request::new("team-b").take(("project/b", "seats"), 5))
        .await?;
    let domain = quota.provider(("domain/7", "seats")).await?;
    println!(
        "  now project/b gets its 5; domain/7 usage {}",
        domain.usage
    );
    expect(domain.usage == 5, "the domain counts its children")?;

    step("Quota: a reservation expires and the GC returns it");
    let reservation = quota
        .reserve(
            &Request::new("batch-job").take(("project/42", "ram_gb"), 48),
            Duration::from_millis(300),
        )
        .await?;
    let p = quota.provider(("project/42", "ram_gb")).await?;
    println!(
        "  reserved 48 GB until {} (server time): usage {}, reserved {}",
        reservation.expires, p.usage, p.reserved
    );
    println!("  the job dies without confirming; 300 ms pass");
    tokio::time::sleep(Duration::from_millis(500)).await;
    match quota.confirm(&reservation).await {
        Err(e @ QuotaError::ReservationExpired { .. }) => println!("  a late confirm: {e}"),
        other => return Err(format!("expected ReservationExpired, got {other:?}").into()),
    }
    let swept = quota.sweep().await?;
    let p = quota.provider(("project/42", "ram_gb")).await?;
    println!(
        "  GC quota sweep: expired={} -> ram usage {}, reserved {}",
        swept.expired, p.usage, p.reserved
    );
    expect(
        swept.expired == 1 && p.usage == 0,
        "the reservation returned",
    )
}

/// The rate limiter: a bulk collector (three tasks) and two high-priority updaters share a
/// third-party API allowing 40 calls in any second, through one limiter with 6 calls reserved
/// for the updaters; then one reservation across a per-tenant and a global limiter.
async fn tour_ratelimit(store: &Store) -> DemoResult {
    use mongotx::ratelimit::simulator::Simulator;
    use mongotx::ratelimit::{Attempt, Limit, Priority, RateLimits};
    use std::time::Instant;

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

/// The batch queue: three services' batches go to a ledger simulator through two submitters and
/// a monitor; the ledger finds one batch invalid and forgets another (unknown), and a third
/// submitter dies between claiming a batch and sending it. Each service's batches reach the
/// ledger in the order they were created.
async fn tour_queue(store: &Store) -> DemoResult {
    use mongotx::queue::ledger::{Fate, Faults, Ledger};
    use mongotx::queue::{BatchStatus, Batches, Monitor, NewBatch, Submitter};
    use std::collections::BTreeMap;
    use std::time::Instant;

    step("Batch queue: 3 services × 4 batches to a ledger; one invalid, one unknown, one submitter dies mid-submission");
    // A short delay window for delayed batches (the seed's default is 15 s).
    let batches =
        Batches::with_collection(store, "demo_batches", Duration::from_millis(200)).await?;
    let ledger = Ledger::new(Duration::from_millis(30), Faults::NONE, 7);
    ledger.force("billing-2", Fate::Invalid);
    ledger.force("search-3", Fate::Forget);
    let mut created: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for i in 1..=4 {
        for service in ["billing", "search", "mail"] {
            let header = format!("{service}-{i}");
            batches
                .add(&NewBatch::new(
                    service,
                    &header,
                    format!("{service} events, part {i}"),
                ))
                .await?;
            created.entry(service.to_string()).or_default().push(header);
        }
    }
    println!("   added, per service in creation order: {created:?}");

    // The submitter that dies: it claims mail-1 (marking it submitted) and never sends it.
    let doomed = Submitter::new(
        batches.clone(),
        ledger.clone(),
        "doomed",
        Duration::from_millis(300),
    );
    let queued = batches.round().await?;
    let mail_1 = queued
        .iter()
        .find(|b| b.header == "mail-1")
        .ok_or("mail-1 was not queued first")?;
    let claim = doomed
        .take(mail_1)
        .await?
        .ok_or("the doomed submitter got no claim")?;
    println!(
        "   submitter \"doomed\" claimed {} (submitted = {}) and died before sending it",
        claim.batch.header, claim.batch.submitted
    );
    drop(claim);

    let submitters: Vec<_> = ["alpha", "beta"]
        .into_iter()
        .map(|name| {
            Submitter::new(
                batches.clone(),
                ledger.clone(),
                name,
                Duration::from_secs(5),
            )
        })
        .collect();
    let monitor = Monitor::new(batches.clone(), ledger.clone());
    let started = Instant::now();
    loop {
        for s in &submitters {
            s.run_once().await?;
        }
        for b in monitor.run_once().await? {
            if matches!(b.status, Some(BatchStatus::Invalid | BatchStatus::Unknown)) {
                println!(
                    "   monitor: the ledger says {} is {}",
                    b.header,
                    b.status.map_or("?", BatchStatus::as_str)
                );
            }
        }
        let open = ["billing", "search", "mail"]
            .iter()
            .flat_map(|s| (1..=4).map(move |i| format!("{s}-{i}")))
            .collect::<Vec<_>>();
        let mut left = 0;
        for header in &open {
            let b = batches.get(header).await?;
            if !matches!(
                b.status,
                Some(BatchStatus::Committed | BatchStatus::Invalid)
            ) {
                left += 1;
            }
        }
        if left == 0 {
            break;
        }
        if started.elapsed() > Duration::from_secs(30) {
            return Err(format!("{left} batches still open after 30 s").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let committed = ledger.committed();
    for (service, headers) in &committed {
        println!("   ledger, {service}: committed in this order: {headers:?}");
    }
    let expected = |service: &str| -> Vec<String> {
        created[service]
            .iter()
            .filter(|h| h.as_str() != "billing-2")
            .cloned()
            .collect()
    };
    for service in ["billing", "search", "mail"] {
        expect(
            committed.get(service) == Some(&expected(service)),
            &format!("{service}'s batches committed once each, in creation order"),
        )?;
    }
    expect(
        batches.get("billing-2").await?.status == Some(BatchStatus::Invalid),
        "billing-2 settled as invalid (and never sent again)",
    )?;
    expect(
        ledger.breaches().is_empty(),
        "no breach of the submitters' rules",
    )?;
    println!(
        "   {} submissions in {:.1} s; billing-2 invalid and not resubmitted; search-3 and mail-1 submitted again; no breach",
        ledger.submissions(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
