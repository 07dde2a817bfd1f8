//! Ids as the server sees them, and inserts racing a pending transactional insert of the same id.
//!
//! Int32 7, Int64 7 and Double 7.0 are one `_id` to MongoDB; staging, lock order and outcomes must
//! agree. A plain insert of an id that an undecided transaction is inserting waits for it, like
//! any writer meeting a held document: if the transaction commits the id is taken, if not the
//! insert goes ahead.

use crate::common;

use std::time::{Duration, Instant};

use crate::common::{stalled_at, Account, TestDb};
use bson::Bson;
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::LockWait;
use mongotx::testkit::failpoint::{BEGIN_BEFORE, COMMIT_AFTER};
use mongotx::{Adjust, CollectionSpec, RepoError, Repository, Store, Transactions, TxnError};
use serde::{Deserialize, Serialize};

const COUNTERS: &str = include_str!("../../schemas/counters.json");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Counter {
    #[serde(rename = "_id")]
    id: Bson,
    n: i64,
}

async fn counters(store: &Store) -> Repository<Counter> {
    store
        .repository::<Counter>(CollectionSpec::new("counters", 1, COUNTERS).expect("spec"))
        .await
        .expect("open counters")
}

fn sevens() -> [Bson; 3] {
    [Bson::Int32(7), Bson::Int64(7), Bson::Double(7.0)]
}

#[tokio::test]
async fn one_document_under_two_numeric_types_cannot_be_staged_twice() {
    let t = TestDb::new().await;
    let counters = counters(&t.store).await;
    counters
        .insert(&Counter {
            id: Bson::Int32(7),
            n: 0,
        })
        .await
        .expect("seed");
    for other in sevens() {
        let v = counters.get(Bson::Int32(7)).await.expect("read").version;
        let tx = Transactions::new(&t.store).begin();
        tx.adjust(&counters, Bson::Int32(7), v, &Adjust::new().by("n", 1_i64))
            .await
            .expect("stage");
        let err = tx
            .adjust(&counters, other.clone(), v, &Adjust::new().by("n", 1_i64))
            .await
            .expect_err("the same document twice");
        assert!(
            matches!(err, TxnError::DuplicateEntry { .. }),
            "{other:?}: {err:?}"
        );
        let err = tx
            .check(&counters, other.clone(), v)
            .expect_err("nor as a check");
        assert!(
            matches!(err, TxnError::DuplicateEntry { .. }),
            "{other:?}: {err:?}"
        );
        let outcome = tx.commit().await.expect("the first entry commits alone");
        assert!(
            outcome.version_of("counters", other.clone()).is_some(),
            "{other:?}"
        );
    }
    // Three commits of +1, no write lost, whichever type each read or wrote with.
    for id in sevens() {
        let read = counters.get(id.clone()).await.expect("read");
        assert_eq!((read.n, read.version), (3, 4), "{id:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_order_is_the_same_whatever_numeric_type_names_an_id() {
    let t = TestDb::new().await;
    let counters = counters(&t.store).await;
    for id in [1, 2, 3] {
        counters
            .insert(&Counter {
                id: Bson::Int32(id),
                n: 0,
            })
            .await
            .expect("seed");
    }
    // Each task names the same three documents with its own types and in its own order.
    let namings: [[Bson; 3]; 3] = [
        [Bson::Int32(1), Bson::Int64(2), Bson::Double(3.0)],
        [Bson::Double(3.0), Bson::Int32(2), Bson::Int64(1)],
        [Bson::Int64(2), Bson::Double(1.0), Bson::Int32(3)],
    ];
    let mut tasks = Vec::new();
    for naming in namings {
        let counters = counters.clone();
        let txns = Transactions::new(&t.store);
        tasks.push(tokio::spawn(async move {
            for _ in 0..15 {
                txns.run(|tx| {
                    let counters = counters.clone();
                    let naming = naming.clone();
                    async move {
                        for id in naming {
                            let read = counters.get(id.clone()).await?;
                            tx.adjust(&counters, id, read.version, &Adjust::new().by("n", 1_i64))
                                .await?;
                        }
                        Ok(())
                    }
                })
                .await
                .expect("every transaction commits");
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    for id in [1, 2, 3] {
        assert_eq!(counters.get(Bson::Int64(id)).await.expect("read").n, 45);
    }
    common::assert_settled(&t, &["counters"], "after the mixed-type transfers").await;
}

fn patient(store: &TestDb) -> Store {
    Store::builder(store.db.clone())
        .lock_wait(LockWait {
            max_wait: Duration::from_secs(20),
            ..LockWait::default()
        })
        .build()
}

#[tokio::test]
async fn an_insert_waits_for_a_pending_insert_and_takes_the_id_if_it_rolls_back() {
    let t = TestDb::new().await;
    let store = patient(&t);
    let accounts = common::open_accounts(&store).await;
    let repo = accounts.clone();
    stalled_at(&store, BEGIN_BEFORE, |tx| async move {
        tx.insert(&repo, &Account::new("x", "pending", 1))
            .await
            .map(|_| ())
    })
    .await;
    assert!(matches!(
        accounts.get("x").await,
        Err(RepoError::NotFound { .. })
    ));

    let inserter = {
        let accounts = accounts.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let result = accounts.insert(&Account::new("x", "plain", 2)).await;
            (result, started.elapsed())
        })
    };
    // Its record may still be on its way: the insert waits (a writer's grace is 250 ms).
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(
        !inserter.is_finished(),
        "the insert must wait for the undecided holder"
    );
    // Then the hold without a record is undone (by the GC's sweep, or by the waiting insert
    // itself once its grace is over) and the id is free again.
    let round = Gc::new(&store, GcOptions::default())
        .run_round_at(
            common::hours_from_now(2).to_chrono(),
            &std::sync::atomic::AtomicBool::new(false),
        )
        .await
        .expect("GC round");
    assert!(round.swept <= 1 && round.skipped == 0, "{round:?}");
    let (result, waited) = inserter.await.expect("inserter");
    result.expect("the id is free again");
    assert!(waited >= Duration::from_millis(150), "{waited:?}");
    let x = accounts.get("x").await.expect("x");
    assert_eq!((x.owner.as_str(), x.version), ("plain", 1));
    common::assert_settled(&t, &["accounts"], "after the insert").await;
}

#[tokio::test]
async fn an_insert_of_an_id_a_committed_transaction_inserted_is_a_duplicate_at_once() {
    let t = TestDb::new().await;
    let store = patient(&t);
    let accounts = common::open_accounts(&store).await;
    let repo = accounts.clone();
    stalled_at(&store, COMMIT_AFTER, |tx| async move {
        tx.insert(&repo, &Account::new("y", "committed", 1))
            .await
            .map(|_| ())
    })
    .await;
    let started = Instant::now();
    let err = accounts
        .insert(&Account::new("y", "plain", 2))
        .await
        .expect_err("taken");
    assert!(matches!(err, RepoError::DuplicateId { .. }), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(accounts.get("y").await.expect("y").owner, "committed");
}

#[tokio::test]
async fn a_repository_of_another_database_is_refused_and_nothing_is_written() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100)]).await;
    let elsewhere = TestDb::new().await;
    let foreign: Repository<Account> = common::open_accounts(&elsewhere.store).await;
    common::seed_accounts(&foreign, &[("f", 1)]).await;
    let before = (
        common::raw_snapshot(&t.db, "accounts").await,
        common::raw_snapshot(&elsewhere.db, "accounts").await,
    );

    let tx = Transactions::new(&t.store).begin();
    tx.adjust(&accounts, "a", 1, &Adjust::new().by("balance", -1_i64))
        .await
        .expect("stage");
    let err = tx
        .adjust(&foreign, "f", 1, &Adjust::new().by("balance", 1_i64))
        .await
        .expect_err("another database");
    match &err {
        TxnError::ForeignRepository {
            database, expected, ..
        } => {
            assert_eq!(database, elsewhere.db.name());
            assert_eq!(expected, t.db.name());
        }
        other => panic!("expected ForeignRepository, got {other:?}"),
    }
    assert!(err.to_string().contains(elsewhere.db.name()), "{err}");
    for refused in [
        tx.check(&foreign, "f", 1),
        tx.delete(&foreign, "f", 1),
        tx.insert(&foreign, &Account::new("g", "G", 1))
            .await
            .map(|_| ()),
    ] {
        assert!(
            matches!(refused, Err(TxnError::ForeignRepository { .. })),
            "{refused:?}"
        );
    }
    assert_eq!(tx.len(), 1, "nothing of the foreign repository was staged");
    drop(tx);
    let after = (
        common::raw_snapshot(&t.db, "accounts").await,
        common::raw_snapshot(&elsewhere.db, "accounts").await,
    );
    assert_eq!(after, before);
    assert!(
        common::raw_snapshot(&elsewhere.db, mongotx::collections::TRANSACTIONS_COLLECTION)
            .await
            .is_empty()
    );
}
