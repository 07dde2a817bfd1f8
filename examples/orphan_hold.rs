//! A hold whose transaction is gone harms nobody: a write of a transaction delivered after its
//! sender gave up (the transaction long decided) leaves a document held by a transaction with no
//! record. The hold carries its own undo: readers see the committed value, and the next writer
//! waits briefly for a record that may be on its way, writes an aborted one in its place, undoes
//! the hold and writes.
//!
//! The late write is simulated with a failpoint of mongotx's test rig (feature `testkit`): the
//! coordinator stops right after its apply, before its record, as a killed process would.
//!
//! ```sh
//! cargo run --example orphan_hold                                 # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example orphan_hold
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, Document};
use mongotx::options::{Finish, TxnOptions};
use mongotx::testkit::failpoint::{CrashAt, Failpoint, BEGIN_BEFORE}; // test rig: a crash
use mongotx::{fields, Adjust, CollectionSpec, Repository, Store, Transactions, TxnError, Update};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Account {
    #[serde(rename = "_id")]
    id: String,
    owner: String,
    balance: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_orphan_hold");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database (account `judy`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "\n-- A hold whose transaction is gone (what a late-delivered write leaves) harms nobody"
    );
    let spec = CollectionSpec::new("accounts", 1, include_str!("../schemas/accounts.json"))?;
    let accounts: Repository<Account> = store.repository(spec).await?;
    let (id, owner) = ("judy".to_string(), "Judy".to_string());
    accounts
        .insert(&Account {
            id,
            owner,
            balance: 140,
        })
        .await?;
    let v = accounts.get("judy").await?.version;
    let crash = CrashAt(Failpoint {
        name: BEGIN_BEFORE,
        step: 0,
    });
    let options = TxnOptions::default()
        .timeout(Duration::from_secs(3600))
        .finish(Finish::BeforeReturning)
        .fault_injector(Arc::new(crash));
    let tx = Transactions::with_options(store, options).begin();
    let plus = Adjust::new().by("balance", 1_000_i64);
    tx.adjust(&accounts, "judy", v, &plus).await?;
    assert!(matches!(tx.commit().await, Err(TxnError::Crashed { .. })));

    // Its apply landed, its record never did: as if it had come after the transaction ended.
    let raw = store.database().collection::<Document>("accounts");
    let stored = raw
        .find_one(doc! { "_id": "judy" })
        .await?
        .ok_or("judy is stored")?;
    let balance = stored.get_i64("balance")?;
    let held = stored.contains_key(fields::ACTIVE_TXN);
    println!(
        "  stored: judy with balance {balance}, held: {held}, by a transaction with no record"
    );
    let read = accounts.get("judy").await?;
    println!(
        "  get(judy) -> balance {} at version {}: the hold is ignored",
        read.balance, read.version
    );
    assert_eq!(
        (read.balance, read.version),
        (140, v),
        "the committed value"
    );

    let started = Instant::now();
    let version = accounts
        .update("judy", v, &Update::new().set("note", "fine"))
        .await?;
    println!(
        "  a writer waits 250 ms for a record that may be on its way, writes an aborted one in its \
         place, undoes the hold and writes, in {:?} -> version {version}",
        started.elapsed()
    );
    let holds = doc! { fields::ACTIVE_TXN: { "$exists": true } };
    assert_eq!(raw.count_documents(holds).await?, 0, "no hold left");
    assert_eq!(
        accounts.get("judy").await?.balance,
        140,
        "the late write undone"
    );
    Ok(())
}
