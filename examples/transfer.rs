//! A transfer between two accounts as one all-or-nothing transaction, rerun by the retry helper
//! `Transactions::run` when another writer changes an account under it, and a read-only
//! transaction of checks; a document held by a transaction that stalls: readers see the committed
//! value, writers wait and then fail `Locked`, until the GC rolls the transaction back. Every
//! deadline is set and compared on one clock, the server's.
//!
//! ```sh
//! cargo run --example transfer                                    # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example transfer
//! ```

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{account, balances, expect, stage_transfer, step, Account, TourResult};
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::{Finish, TxnOptions};
use mongotx::testkit::failpoint::{self, CrashAt, Failpoint};
use mongotx::{RepoError, Repository, Store, Transactions, TxnError, Update};

#[tokio::main]
async fn main() {
    common::main(
        "transfer",
        |example| async move { run(&example.store).await },
    )
    .await;
}

/// Every step of this example, on `store`'s database (accounts `dave` and `erin`).
pub async fn run(store: &Store) -> TourResult {
    let accounts = common::accounts(store).await?;
    clock(store).await?;
    transfer(store, &accounts).await?;
    locked(store, &accounts).await
}

async fn clock(store: &Store) -> TourResult {
    step("One clock for every deadline: the server's");
    let server = store.server_time().await?;
    let local = bson::DateTime::now();
    println!(
        "  server time {server}, this host's clock differs by {} ms; deadlines are set and compared in server time",
        local.timestamp_millis() - server.timestamp_millis()
    );
    let topology = store.topology().await?;
    println!(
        "  durability {:?} on a {topology}: protocol writes {}",
        store.durability(),
        if topology.is_replicated() {
            "are majority-acknowledged"
        } else {
            "use the client's write concern (a standalone server has no failover)"
        }
    );
    Ok(())
}

async fn transfer(store: &Store, accounts: &Repository<Account>) -> TourResult {
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

async fn locked(store: &Store, accounts: &Repository<Account>) -> TourResult {
    step("A document held by a live transaction makes writers wait, then fail Locked");
    let dave = accounts.get("dave").await?;
    let erin = accounts.get("erin").await?;
    // A coordinator that stops for good after erin changed under it and before it could abort:
    // dave is held, erin's apply is missing, so the transaction is undecided until its deadline.
    let timeout = Duration::from_secs(2);
    let stalled = Transactions::with_options(
        store,
        TxnOptions::default()
            .timeout(timeout)
            .finish(Finish::BeforeReturning)
            .fault_injector(Arc::new(CrashAt(Failpoint {
                name: failpoint::ABORT_BEFORE,
                step: 0,
            }))),
    );
    let tx = stalled.begin();
    tx.update(
        accounts,
        "dave",
        dave.version,
        &Update::new().set("owner", "Uncommitted"),
    )
    .await?;
    tx.update(
        accounts,
        "erin",
        erin.version,
        &Update::new().set("note", "x"),
    )
    .await?;
    let begun = Instant::now();
    accounts
        .update(
            "erin",
            erin.version,
            &Update::new().set("note", "changed meanwhile"),
        )
        .await?;
    expect(
        matches!(tx.commit().await, Err(TxnError::Crashed { .. })),
        "a stalled coordinator",
    )?;
    let read = accounts.get("dave").await?;
    println!(
        "  a transaction holds dave with owner \"Uncommitted\"; readers see the committed owner {:?}",
        read.owner
    );
    expect(
        read.owner == dave.owner && read.version == dave.version,
        "the committed value",
    )?;
    let started = Instant::now();
    let result = accounts
        .update("dave", dave.version, &Update::new().set("owner", "x"))
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
    let round = Gc::new(store, GcOptions::default()).run_round().await?;
    expect(
        round.rolled_back == 1,
        "the stalled transaction rolled back",
    )?;
    let version = accounts
        .update("dave", dave.version, &Update::new().set("owner", "Dave D."))
        .await?;
    println!("  once its deadline passed and it was rolled back, the same write succeeds -> version {version}");
    Ok(())
}
