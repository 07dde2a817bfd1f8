//! Coordinators that crash mid-commit (a failpoint, `CrashAt`, stops them as a killed process
//! would) and the GC that recovers them: before the commit point the transfer is rolled back,
//! after it rolled forward; meanwhile readers see committed values. A hold whose transaction has
//! no record (what a write delivered after its sender gave up leaves) carries its own undo and
//! harms nobody.
//!
//! ```sh
//! cargo run --example crash_recovery                              # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example crash_recovery
//! ```

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, Document};
use common::{account, balances, expect, held_accounts, stage_transfer, step, Account, TourResult};
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::{Finish, TxnOptions};
use mongotx::testkit::failpoint::{self, CrashAt, Failpoint};
use mongotx::{Adjust, Repository, Store, Transactions, TxnError, Update};

#[tokio::main]
async fn main() {
    common::main("crash_recovery", |example| async move {
        run(&example.store).await
    })
    .await;
}

/// Every step of this example, on `store`'s database (accounts `frank` and `grace`).
pub async fn run(store: &Store) -> TourResult {
    let accounts = common::accounts(store).await?;
    accounts.insert(&account("frank", 180)).await?;
    accounts.insert(&account("grace", 140)).await?;
    crash_recovery(store, &accounts).await?;
    orphan(store, &accounts).await
}

/// Transactions whose coordinator crashes at failpoint `name`, step `step`, with a deadline
/// `timeout` after they begin.
fn dying(store: &Store, timeout: Duration, name: &'static str, step: usize) -> Transactions {
    Transactions::with_options(
        store,
        TxnOptions::default()
            .timeout(timeout)
            .finish(Finish::BeforeReturning)
            .fault_injector(Arc::new(CrashAt(Failpoint { name, step }))),
    )
}

async fn crash_recovery(store: &Store, accounts: &Repository<Account>) -> TourResult {
    step("A coordinator dies mid-commit; the GC (what mongotx-gc runs each round) recovers it");
    let db = store.database();
    let timeout = Duration::from_millis(300);
    let transfer = |txns: Transactions, amount: i64| {
        let accounts = accounts.clone();
        async move {
            let tx = txns.begin();
            let frank = accounts.get("frank").await?;
            let grace = accounts.get("grace").await?;
            stage_transfer(&tx, &accounts, (&frank, &grace), amount).await?;
            tx.commit().await.map(|_| ())
        }
    };

    let before = balances(accounts, &["frank", "grace"]).await?;
    // It dies mid-round: frank's apply went out, grace's and the record never did.
    match transfer(dying(store, timeout, failpoint::APPLY_BEFORE, 1), 50).await {
        Err(error @ TxnError::Crashed { .. }) => println!("  first coordinator: {error}"),
        other => return Err(format!("expected a crash, got {other:?}").into()),
    }
    let held = held_accounts(db).await?;
    let seen = balances(accounts, &["frank", "grace"]).await?;
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
    let gc = Gc::new(store, GcOptions::default());
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
    let after = balances(accounts, &["frank", "grace"]).await?;
    let left = db
        .collection::<Document>(store.transactions_collection())
        .count_documents(doc! {})
        .await?;
    println!(
        "  frank {} (version {}), grace {} (version {}): nothing of the dead transfer applied; {left} ActiveTransaction documents left",
        after[0].0, after[0].1, after[1].0, after[1].1
    );
    expect(round.rolled_back >= 1, "a rollback")?;
    expect(
        after[0].0 == before[0].0 && after[1].0 == before[1].0,
        "balances unchanged",
    )?;
    expect(left == 0, "no ActiveTransaction left")?;

    // The same crash after the commit point: the GC rolls it forward instead.
    match transfer(dying(store, timeout, failpoint::COMMIT_AFTER, 0), 40).await {
        Err(error @ TxnError::Crashed { .. }) => println!("  second coordinator: {error}"),
        other => return Err(format!("expected a crash, got {other:?}").into()),
    }
    let seen = balances(accounts, &["frank", "grace"]).await?;
    println!(
        "  past the commit point, readers already see frank {} and grace {} while the documents are still held",
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

async fn orphan(store: &Store, accounts: &Repository<Account>) -> TourResult {
    step("A hold whose transaction is gone (what a late-delivered write leaves) harms nobody");
    let db = store.database();
    let before = accounts.get("grace").await?;
    let stalled = dying(store, Duration::from_secs(3600), failpoint::BEGIN_BEFORE, 0);
    let tx = stalled.begin();
    tx.adjust(
        accounts,
        "grace",
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
        .find_one(doc! { "_id": "grace" })
        .await?
        .ok_or("grace is stored")?;
    println!(
        "  grace is stored with balance {} and held by a transaction that has no record; its hold carries its own undo",
        stored.get_i64("balance").unwrap_or_default()
    );
    let read = accounts.get("grace").await?;
    println!(
        "  get(grace) -> balance {} at version {} (not committed: the hold is ignored)",
        read.balance, read.version
    );
    expect(
        read.balance == before.balance && read.version == before.version,
        "the committed value",
    )?;
    let started = Instant::now();
    let version = accounts
        .update("grace", before.version, &Update::new().set("note", "fine"))
        .await?;
    println!(
        "  a writer waits 250 ms for a record that may be on its way, writes an aborted one in its place, undoes the hold and writes, in {:?} -> version {version}",
        started.elapsed()
    );
    expect(held_accounts(db).await? == 0, "no hold left")?;
    Ok(())
}
