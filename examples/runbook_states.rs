//! The states docs/operations.md's runbooks inspect, left in a database for `mongotx`: dead
//! coordinators (one after its commit point, one while staging, both live 15 s more; one expired,
//! claimed by a GC runner that died mid-round), a full quota provider with an expired reservation,
//! a full rate limiter with a dead worker's reservation, batch queues stuck on a dead submitter and
//! on a batch the ledger forgot, and conflicts for the contention record.
//!
//! `tools/runbook.sh` runs it, then the admin command. Crashes are failpoints of mongotx's test
//! rig (feature `testkit`): a coordinator or GC stops at a named point as a killed process would.
//! The states are for another process, so the server must outlive this one: `MONGODB_URI`.
//!
//! ```sh
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example runbook_states -- bank
//! ```
//!
//! It prints `name=value` lines for the script: the transactions' ids and `live_until_ms`, the
//! live ones' deadline (server time, Unix milliseconds).

use std::error::Error;
use std::sync::Arc;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Document};
use mongotx::collections::TRANSACTIONS_COLLECTION;
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::{Finish, TxnOptions};
use mongotx::queue::{BatchStatus, Batches, NewBatch, Submission};
use mongotx::quota::{NewProvider, Quota, Request};
use mongotx::ratelimit::{Limit, Priority, RateLimits};
use mongotx::testkit::failpoint::{CrashAt, Failpoint}; // test rig: simulated crashes
use mongotx::testkit::failpoint::{ABORT_BEFORE, COMMIT_AFTER, GC_FINISH_BEFORE};
use mongotx::{Adjust, CollectionSpec, Repository, Store, Transactions, TxnError, Update};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Account {
    #[serde(rename = "_id")]
    id: String,
    owner: String,
    balance: i64,
}

type Result<T> = std::result::Result<T, Box<dyn Error>>;

#[tokio::main]
async fn main() -> Result<()> {
    let uri = std::env::var("MONGODB_URI").map_err(|_| "set MONGODB_URI")?;
    let name = std::env::args().nth(1).unwrap_or("mongotx_runbook".into());
    let db = mongodb::Client::with_uri_str(&uri).await?.database(&name);
    db.drop().await?;
    let store = Store::new(db);
    let spec = CollectionSpec::new("accounts", 1, include_str!("../schemas/accounts.json"))?;
    let accounts: Repository<Account> = store.repository(spec).await?;
    for id in ["alice", "bob", "carol", "dave", "erin", "frank", "hot"] {
        let (id, owner, balance) = (id.to_string(), id.to_uppercase(), 100);
        accounts.insert(&Account { id, owner, balance }).await?;
    }

    // A committed transfer whose deadline passes (1 s), then a GC runner that claims it and
    // dies before finishing it: its claim keeps other runners off it for 60 s.
    let claimed = dying(&store, &accounts, ("erin", "frank"), COMMIT_AFTER, 1).await?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let dies = GcOptions::default().fault_injector(crash(GC_FINISH_BEFORE));
    let died = Gc::new(&store, dies).run_round().await;
    assert!(matches!(died, Err(TxnError::Crashed { .. })), "{died:?}");
    println!("claimed={claimed}");

    full_quota(&store).await?;
    let limits = RateLimits::open(&store).await?;
    let limit = Limit::new(10, Duration::from_secs(60)).reserved(2);
    // 10 calls a minute (2 kept for high priority), sent within 4 s of their grant: 5 made and
    // settled, 3 reserved by a worker that dies (never settled).
    limits
        .define("maps", limit.hold(Duration::from_secs(4)))
        .await?;
    let settled = limits.reserve(&["maps"], 5, Priority::Bulk).await?;
    limits.settle(&settled, 5).await?;
    limits.reserve(&["maps"], 3, Priority::Bulk).await?;
    stuck_queues(&store).await?;
    conflicts(&store, &accounts).await?;
    // Past the dead worker's hold plus a slot, its reservation is overdue; then a live
    // high-priority one fills the limiter.
    tokio::time::sleep(Duration::from_millis(5500)).await;
    limits.reserve(&["maps"], 2, Priority::High).await?;

    // Coordinators dead 15 s before their deadline: alice->bob after its commit point,
    // carol->dave while staging (dave changed under it, so its change never landed).
    let committed = dying(&store, &accounts, ("alice", "bob"), COMMIT_AFTER, 15).await?;
    let staging = dying(&store, &accounts, ("carol", "dave"), ABORT_BEFORE, 15).await?;
    let records = store
        .database()
        .collection::<Document>(TRANSACTIONS_COLLECTION);
    let record = records.find_one(doc! { "_id": staging }).await?;
    let record = record.ok_or("no record")?;
    let deadline = record.get_datetime("deadline")?.timestamp_millis();
    println!("committed={committed}\nstaging={staging}\nlive_until_ms={deadline}");

    // Writes what the contention record counted (it is flushed every 5 s, and at shutdown).
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// Stops whoever has it (a coordinator, a GC) at failpoint `name`, as a kill would.
fn crash(name: &'static str) -> Arc<CrashAt> {
    Arc::new(CrashAt(Failpoint { name, step: 0 }))
}

/// Moves 30 between accounts `from` and `to` in a transaction whose coordinator dies at
/// failpoint `at`, its deadline `timeout_s` seconds away; returns the transaction's id. To die
/// at `ABORT_BEFORE` it needs a reason to abort: `to` changes under it after staging.
async fn dying(
    store: &Store,
    accounts: &Repository<Account>,
    (from, to): (&str, &str),
    at: &'static str,
    timeout_s: u64,
) -> Result<ObjectId> {
    let options = TxnOptions::default().timeout(Duration::from_secs(timeout_s));
    let options = options
        .finish(Finish::BeforeReturning)
        .fault_injector(crash(at));
    let tx = Transactions::with_options(store, options).begin();
    let (a, b) = (
        accounts.get(from).await?.version,
        accounts.get(to).await?.version,
    );
    tx.adjust(accounts, from, a, &Adjust::new().by("balance", -30_i64))
        .await?;
    tx.adjust(accounts, to, b, &Adjust::new().by("balance", 30_i64))
        .await?;
    if at == ABORT_BEFORE {
        accounts
            .update(to, b, &Update::new().set("note", "changed outside"))
            .await?;
    }
    match tx.commit().await {
        Err(TxnError::Crashed { txn: Some(txn), .. }) => Ok(txn),
        other => Err(format!("the coordinator should die at {at}: {other:?}").into()),
    }
}

/// A full provider of 10 cores: 4 consumed, 3 reserved for an hour, 3 whose reservation
/// expired (still counted: only the GC's sweep returns them), so a consume of 2 is refused.
async fn full_quota(store: &Store) -> Result<()> {
    let quota = Quota::open(store).await?;
    let cores = ("project/42", "cores");
    quota.create(NewProvider::new(cores, 10)).await?;
    quota
        .consume(&Request::with_id("vm-a", "start").take(cores, 4))
        .await?;
    let (hour, second) = (Duration::from_secs(3600), Duration::from_secs(1));
    quota
        .reserve(&Request::with_id("job-b", "r1").take(cores, 3), hour)
        .await?;
    quota
        .reserve(&Request::with_id("job-c", "r2").take(cores, 3), second)
        .await?;
    let refused = quota
        .consume(&Request::with_id("vm-d", "start").take(cores, 2))
        .await;
    println!(
        "# quota: {}",
        refused.err().ok_or("the consume should be refused")?
    );
    Ok(())
}

/// billing's first batch claimed (for 1 s) by a submitter that dies before sending it;
/// payments' first batch accepted by the ledger, which then forgets it (unknown).
async fn stuck_queues(store: &Store) -> Result<()> {
    let batches = Batches::open(store).await?;
    for (service, n) in [("billing", 3), ("payments", 2)] {
        for i in 1..=n {
            let header = format!("{service}/{i}");
            batches
                .add(&NewBatch::new(service, header, "payload"))
                .await?;
        }
    }
    let first = batches.get("billing/1").await?;
    let ttl = Duration::from_secs(1);
    batches
        .claim(&first, "submitter-7", ttl)
        .await?
        .ok_or("billing/1 not claimed")?;
    let first = batches.get("payments/1").await?;
    let ttl = Duration::from_secs(30);
    let claim = batches
        .claim(&first, "submitter-2", ttl)
        .await?
        .ok_or("not claimed")?;
    let pending = batches.record(&claim, Submission::Accepted).await?;
    batches
        .record_status(&pending, BatchStatus::Unknown)
        .await?;
    Ok(())
}

/// Contention on account "hot": three writes naming a version it no longer has, and two
/// transactions whose document changed between staging and commit (each aborted).
async fn conflicts(store: &Store, accounts: &Repository<Account>) -> Result<()> {
    for _ in 0..3 {
        let version = accounts.get("hot").await?.version;
        accounts
            .update("hot", version, &Update::new().set("note", "first"))
            .await?;
        let stale = Update::new().set("note", "second");
        let refused = accounts.update("hot", version, &stale).await;
        refused.err().ok_or("the stale write should conflict")?;
    }
    for _ in 0..2 {
        let tx = Transactions::new(store).begin();
        let version = accounts.get("hot").await?.version;
        tx.adjust(
            accounts,
            "hot",
            version,
            &Adjust::new().by("balance", 1_i64),
        )
        .await?;
        accounts
            .update("hot", version, &Update::new().set("note", "outside"))
            .await?;
        tx.commit()
            .await
            .err()
            .ok_or("the commit should conflict")?;
    }
    Ok(())
}
