//! Coordinators that die mid-commit and the GC (what `mongotx-gc` or a `GcRunner` runs) that
//! recovers them: a transfer whose coordinator dies before the commit point is rolled back, one
//! that dies after it rolled forward; meanwhile readers see committed values. The deaths are
//! simulated with failpoints of mongotx's test rig (feature `testkit`): the coordinator stops
//! at a named point as a killed process would. A real service needs none.
//!
//! ```sh
//! cargo run --example crash_recovery                              # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example crash_recovery
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::error::Error;
use std::sync::Arc;
use std::time::Duration;

use bson::{doc, Document};
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::{Finish, TxnOptions};
use mongotx::testkit::failpoint::{CrashAt, Failpoint, APPLY_BEFORE, COMMIT_AFTER}; // test rig
use mongotx::TxnError;
use mongotx::{fields, Adjust, CollectionSpec, RepoError, Repository, Store, Transactions};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Account {
    #[serde(rename = "_id")]
    id: String,
    owner: String,
    balance: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_crash_recovery");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// Moves `amount` from frank to grace with a coordinator that dies at failpoint `name`, entry
/// `step`; the transaction's deadline is 300 ms after it begins.
async fn dying(
    store: &Store,
    (name, step): (&'static str, usize),
    amount: i64,
) -> Result<(), Box<dyn Error>> {
    let accounts = &store.repository::<Account>(accounts_spec()?).await?;
    let crash = Arc::new(CrashAt(Failpoint { name, step }));
    let options = TxnOptions::default().timeout(Duration::from_millis(300));
    let options = options.finish(Finish::BeforeReturning);
    let tx = Transactions::with_options(store, options.fault_injector(crash)).begin();
    let [(_, frank), (_, grace)] = read(accounts).await?;
    let by = |n: i64| Adjust::new().by("balance", n);
    tx.adjust(accounts, "frank", frank, &by(-amount)).await?;
    tx.adjust(accounts, "grace", grace, &by(amount)).await?;
    let error = tx.commit().await.expect_err("the coordinator dies");
    println!("  the coordinator: {error}");
    assert!(matches!(error, TxnError::Crashed { .. }));
    Ok(())
}

fn accounts_spec() -> Result<CollectionSpec, mongotx::schema::SpecError> {
    CollectionSpec::new("accounts", 1, include_str!("../schemas/accounts.json"))
}

/// frank's and grace's committed (balance, version).
async fn read(accounts: &Repository<Account>) -> Result<[(i64, i64); 2], RepoError> {
    let (f, g) = (accounts.get("frank").await?, accounts.get("grace").await?);
    Ok([(f.balance, f.version), (g.balance, g.version)])
}

/// The tour, on `store`'s database (accounts `frank` and `grace`).
pub async fn run(store: &Store) -> Result<(), Box<dyn Error>> {
    let accounts: Repository<Account> = store.repository(accounts_spec()?).await?;
    for (id, owner, balance) in [("frank", "Frank", 180), ("grace", "Grace", 140)] {
        let (id, owner) = (id.to_string(), owner.to_string());
        accounts.insert(&Account { id, owner, balance }).await?;
    }
    let db = store.database();
    let raw = db.collection::<Document>("accounts");
    let holds = doc! { fields::ACTIVE_TXN: { "$exists": true } };
    let records = db.collection::<Document>(store.transactions_collection());
    let gc = Gc::new(store, GcOptions::default());
    let pause = Duration::from_millis(400); // past the transactions' 300 ms deadline

    println!("\n-- A coordinator dies before the commit point: the GC rolls the transfer back");
    // It dies mid-round: frank's apply went out, grace's and the record never did.
    let before = read(&accounts).await?;
    dying(store, (APPLY_BEFORE, 1), 50).await?;
    let held = raw.count_documents(holds.clone()).await?;
    let seen = read(&accounts).await?;
    println!("  {held} held; readers see the committed (balance, version) {seen:?}");
    assert_eq!((held, seen), (1, before), "the pre-images");
    tokio::time::sleep(pause).await;
    let swept = gc.run_round().await?.swept;
    println!("  a GC round undoes the hold (swept={swept}), writes an aborted record");
    assert!(swept >= 1, "a hold undone");
    // The next round deletes that aborted record: its deadline has passed on the server.
    let rolled_back = gc.run_round().await?.rolled_back;
    let left = records.count_documents(doc! {}).await?;
    let after = read(&accounts).await?;
    println!("  next round: rolled_back={rolled_back}; {after:?}, {left} records left");
    assert!(rolled_back >= 1, "a rollback");
    assert_eq!((after, left), (seen, 0), "nothing of it applied");

    println!("\n-- The same death after the commit point: the GC rolls it forward");
    dying(store, (COMMIT_AFTER, 0), 40).await?;
    let [(frank, _), (grace, _)] = read(&accounts).await?;
    println!("  readers already see frank {frank} and grace {grace}, still held");
    assert_eq!((frank, grace), (140, 180), "the post-images");
    tokio::time::sleep(pause).await;
    let round = gc.run_round().await?;
    let held = raw.count_documents(holds).await?;
    let (finished, rolled_back) = (round.finished, round.rolled_back);
    println!("  a GC round: finished={finished} rolled_back={rolled_back}; {held} held");
    assert_eq!((finished, held), (1, 0), "rolled forward and freed");
    Ok(())
}
