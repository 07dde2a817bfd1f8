//! A held document: a transaction whose coordinator stalls mid-commit holds a document; readers
//! see its committed value and never wait, writers wait (at most the store's `LockWait`) and
//! then fail `Locked`, until, past the transaction's deadline on the server's clock, the GC rolls
//! it back and the same write succeeds.
//!
//! The stall is simulated with a failpoint of mongotx's test rig (feature `testkit`): the
//! coordinator stops at a named point as a killed process would. A real service needs none.
//!
//! ```sh
//! cargo run --example holds                                       # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example holds
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::sync::Arc;
use std::time::{Duration, Instant};

use mongotx::gc::{Gc, GcOptions};
use mongotx::options::{Finish, LockWait, TxnOptions};
use mongotx::testkit::failpoint::{CrashAt, Failpoint, ABORT_BEFORE}; // test rig: a crash
use mongotx::{CollectionSpec, RepoError, Repository, Store, Transactions, TxnError, Update};
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
    let db = client.database("mongotx_example_holds");
    db.drop().await?;
    // A writer waits at most 800 ms for a held document (2 s by default).
    let wait = LockWait {
        max_wait: Duration::from_millis(800),
        ..LockWait::default()
    };
    let store = Store::builder(db).lock_wait(wait).build();
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database (accounts `heidi` and `ivan`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!("\n-- A document held by a live transaction makes writers wait, then fail Locked");
    let spec = CollectionSpec::new("accounts", 1, include_str!("../schemas/accounts.json"))?;
    let accounts: Repository<Account> = store.repository(spec).await?;
    for (id, owner) in [("heidi", "Heidi"), ("ivan", "Ivan")] {
        let (id, owner) = (id.to_string(), owner.to_string());
        accounts
            .insert(&Account {
                id,
                owner,
                balance: 100,
            })
            .await?;
    }
    let owner = |name: &str| Update::new().set("owner", name);
    let (h, i) = (
        accounts.get("heidi").await?.version,
        accounts.get("ivan").await?.version,
    );
    // A coordinator that stops for good after ivan changed under it and before it could abort:
    // heidi is held, ivan's apply is missing, so the transaction is undecided until its deadline.
    let timeout = Duration::from_secs(2);
    let crash = CrashAt(Failpoint {
        name: ABORT_BEFORE,
        step: 0,
    });
    let options = TxnOptions::default()
        .timeout(timeout)
        .finish(Finish::BeforeReturning);
    let tx = Transactions::with_options(store, options.fault_injector(Arc::new(crash))).begin();
    let begun = Instant::now();
    tx.update(&accounts, "heidi", h, &owner("Uncommitted"))
        .await?;
    tx.update(&accounts, "ivan", i, &owner("Ivan I.")).await?;
    accounts
        .update("ivan", i, &owner("changed meanwhile"))
        .await?;
    assert!(matches!(tx.commit().await, Err(TxnError::Crashed { .. })));

    let read = accounts.get("heidi").await?;
    println!(
        "  a transaction holds heidi with owner \"Uncommitted\"; readers see {:?}",
        read.owner
    );
    assert_eq!(
        (&*read.owner, read.version),
        ("Heidi", h),
        "the committed value"
    );
    let started = Instant::now();
    match accounts.update("heidi", h, &owner("x")).await {
        Err(error @ RepoError::Locked { .. }) => {
            println!("  after {:?}: {error}", started.elapsed())
        }
        other => return Err(format!("expected Locked, got {other:?}").into()),
    }
    // Past its deadline anyone may fence the missing participant and abort the transaction;
    // a GC round does so for every such transaction.
    let deadline = timeout + Duration::from_millis(100);
    tokio::time::sleep(deadline.saturating_sub(begun.elapsed())).await;
    let round = Gc::new(store, GcOptions::default()).run_round().await?;
    println!(
        "  a GC round past the deadline: rolled_back={}",
        round.rolled_back
    );
    assert_eq!(round.rolled_back, 1, "the stalled transaction rolled back");
    let version = accounts.update("heidi", h, &owner("Heidi H.")).await?;
    println!("  once it is rolled back, the same write succeeds -> version {version}");
    Ok(())
}
