//! Multi-document transactions: commit, all-or-nothing on failure, read committed while pending,
//! recovery by the GC, and the bank-transfer invariant under real concurrency.

use crate::common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{raw_snapshot, Account, CrashAt, Note, TestDb};
use bson::doc;
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::TxnOptions;
use mongotx::testkit::failpoint::{self, Failpoint};
use mongotx::{fields, Adjust, Query, RepoError, Repository, Transactions, TxnError, Update};

async fn accounts(t: &TestDb) -> Repository<Account> {
    t.store
        .repository::<Account>(common::accounts_spec())
        .await
        .expect("open accounts")
}

async fn assert_no_transaction_left(t: &TestDb) {
    common::assert_settled(t, &["accounts", "notes"], "after the transaction").await;
}

#[tokio::test]
async fn a_transaction_applies_all_five_actions_across_collections() {
    let t = TestDb::new().await;
    let accounts = accounts(&t).await;
    let notes = t
        .store
        .repository::<Note>(common::notes_spec())
        .await
        .expect("open notes");
    for (id, balance) in [("a", 100), ("b", 50), ("c", 10), ("d", 1)] {
        accounts
            .insert(&Account::new(id, id, balance))
            .await
            .expect("seed");
    }
    let txns = common::finishing(&t.store);
    let tx = txns.begin();
    let note_id = tx
        .insert(
            &notes,
            &Note {
                id: None,
                text: "moved 30".into(),
                tags: vec![],
            },
        )
        .await
        .expect("stage insert");
    tx.adjust(&accounts, "a", 1, &Adjust::new().by("balance", -30_i64))
        .await
        .expect("stage adjust");
    tx.update(
        &accounts,
        "b",
        1,
        &Update::new()
            .set("balance", 80_i64)
            .set("note", "topped up"),
    )
    .await
    .expect("stage update");
    tx.delete(&accounts, "c", 1).expect("stage delete");
    tx.check(&accounts, "d", 1).expect("stage check");
    let outcome = tx.commit().await.expect("commit");

    assert!(outcome.finished);
    assert_eq!(outcome.version_of("accounts", "a"), Some(2));
    assert_eq!(outcome.version_of("accounts", "c"), Some(2));
    assert_eq!(outcome.version_of("accounts", "d"), Some(1));
    assert_eq!(outcome.version_of("notes", note_id.clone()), Some(1));
    let a = accounts.get("a").await.expect("a");
    assert_eq!((a.balance, a.version), (70, 2));
    let b = accounts.get("b").await.expect("b");
    assert_eq!(
        (b.balance, b.note.as_deref(), b.version),
        (80, Some("topped up"), 2)
    );
    assert!(matches!(
        accounts.get("c").await,
        Err(RepoError::Deleted { version: 2, .. })
    ));
    assert_eq!(accounts.get("d").await.expect("d").version, 1);
    assert_eq!(notes.get(note_id).await.expect("note").text, "moved 30");
    assert_no_transaction_left(&t).await;
}

#[tokio::test]
async fn one_failing_entry_leaves_every_document_as_it_was() {
    let t = TestDb::new().await;
    let accounts = accounts(&t).await;
    for (id, balance) in [("a", 100), ("b", 50), ("c", 10)] {
        accounts
            .insert(&Account::new(id, id, balance))
            .await
            .expect("seed");
    }
    accounts
        .update("c", 1, &Update::new().set("owner", "moved on"))
        .await
        .expect("bump c to version 2");
    let before = raw_snapshot(&t.db, "accounts").await;

    let txns = common::finishing(&t.store);
    let tx = txns.begin();
    tx.adjust(&accounts, "a", 1, &Adjust::new().by("balance", -5_i64))
        .await
        .expect("stage");
    tx.insert(&accounts, &Account::new("new", "N", 5))
        .await
        .expect("stage");
    tx.delete(&accounts, "b", 1).expect("stage");
    tx.check(&accounts, "c", 1).expect("stage (stale version)");
    let err = tx.commit().await.expect_err("c is at version 2");
    match err.repo_error() {
        Some(RepoError::VersionConflict {
            expected: 1,
            actual: 2,
            id,
            ..
        }) => assert_eq!(id, "\"c\""),
        other => panic!("expected a version conflict on c, got {other:?}"),
    }
    assert!(err.is_retryable());

    // Rolled back: same user fields; versions moved past the applied ones so that a delayed
    // apply can never land; the insert left a placeholder that reads as not found.
    for d in raw_snapshot(&t.db, "accounts").await {
        let id = d.get_str("_id").expect("id").to_string();
        let old = before.iter().find(|b| b.get_str("_id") == Ok(id.as_str()));
        match (id.as_str(), old) {
            ("new", None) => assert_eq!(d.get_i64(fields::VERSION), Ok(0), "{d}"),
            (_, Some(old)) => {
                let mut mine = d.clone();
                let mut theirs = old.clone();
                mine.remove(fields::VERSION);
                theirs.remove(fields::VERSION);
                assert_eq!(mine, theirs, "{id} changed");
            }
            other => panic!("unexpected document {other:?}"),
        }
    }
    assert!(matches!(
        accounts.get("new").await,
        Err(RepoError::NotFound { .. })
    ));
    assert_eq!(accounts.get("a").await.expect("a").balance, 100);
    assert_no_transaction_left(&t).await;
    // The placeholder does not block a later insert of the same id.
    accounts
        .insert(&Account::new("new", "N", 5))
        .await
        .expect("insert over placeholder");
    assert_eq!(accounts.get("new").await.expect("new").version, 1);
}

#[tokio::test]
async fn readers_see_pre_images_until_the_commit_point_and_post_images_after() {
    // Crashed before its record went out (its applies did): not committed. Crashed after its
    // round (here after the commit point too): committed.
    for (crash, committed) in [
        (failpoint::BEGIN_BEFORE, false),
        (failpoint::COMMIT_AFTER, true),
    ] {
        let t = TestDb::new().await;
        let accounts = accounts(&t).await;
        for (id, balance) in [("a", 100), ("b", 50)] {
            accounts
                .insert(&Account::new(id, id, balance))
                .await
                .expect("seed");
        }
        let txns = Transactions::with_options(
            &t.store,
            TxnOptions::default()
                .finish(mongotx::options::Finish::BeforeReturning)
                .fault_injector(Arc::new(CrashAt(Failpoint {
                    name: crash,
                    step: 0,
                }))),
        );
        let tx = txns.begin();
        tx.adjust(&accounts, "a", 1, &Adjust::new().by("balance", -30_i64))
            .await
            .expect("stage");
        tx.delete(&accounts, "b", 1).expect("stage");
        tx.insert(&accounts, &Account::new("c", "C", 30))
            .await
            .expect("stage");
        let err = tx.commit().await.expect_err("crash");
        assert!(matches!(err, TxnError::Crashed { .. }), "{err:?}");

        let a = accounts.get("a").await.expect("a");
        let b = accounts.get("b").await;
        let c = accounts.get("c").await;
        let listed = accounts.find(Query::new()).await.expect("find");
        if committed {
            assert_eq!((a.balance, a.version), (70, 2), "after {crash}");
            assert!(
                matches!(b, Err(RepoError::Deleted { version: 2, .. })),
                "{b:?}"
            );
            assert_eq!(c.expect("c visible after the commit point").balance, 30);
        } else {
            assert_eq!((a.balance, a.version), (100, 1), "before {crash}");
            assert_eq!(b.expect("b still there").version, 1);
            assert!(matches!(c, Err(RepoError::NotFound { .. })), "{c:?}");
            let ids: HashSet<String> = listed.iter().map(|s| s.value.id.clone()).collect();
            assert!(ids.contains("b") && !ids.contains("c"), "{ids:?}");
        }

        // A GC round after the deadline ends it either way.
        let summary = Gc::new(&mongotx::Store::new(t.db.clone()), GcOptions::default())
            .run_round_at(
                chrono::Utc::now() + chrono::Duration::seconds(60),
                &AtomicBool::new(false),
            )
            .await
            .expect("gc");
        if committed {
            assert_eq!((summary.finished, summary.rolled_back), (1, 0));
        } else {
            // Holds without a record, undone by the sweep.
            assert_eq!(summary.swept, 3, "{summary:?}");
        }
        let a = accounts.get("a").await.expect("a");
        assert_eq!(a.balance, if committed { 70 } else { 100 });
        common::assert_settled(&t, &["accounts"], "after the GC round").await;
    }
}

#[tokio::test]
async fn the_gc_counts_as_swept_only_holds_it_undid() {
    // A coordinator dead after its commit point leaves its documents held by a committed,
    // unexpired transaction. A GC round before the deadline finishes those holds (the record pass
    // waits for the deadline, the hold pass meets them); that is no orphan undone.
    let t = TestDb::new().await;
    let accounts = accounts(&t).await;
    for (id, balance) in [("a", 100), ("b", 50)] {
        accounts
            .insert(&Account::new(id, id, balance))
            .await
            .expect("seed");
    }
    // Moves `amount` from a to b (both at `version`) in a transaction that dies at `crash`.
    let crashed_transfer = |options: TxnOptions, crash, version, amount: i64| {
        let (store, accounts) = (t.store.clone(), accounts.clone());
        async move {
            let txns = Transactions::with_options(
                &store,
                options.fault_injector(Arc::new(CrashAt(Failpoint {
                    name: crash,
                    step: 0,
                }))),
            );
            let tx = txns.begin();
            tx.adjust(
                &accounts,
                "a",
                version,
                &Adjust::new().by("balance", -amount),
            )
            .await
            .expect("stage");
            tx.adjust(
                &accounts,
                "b",
                version,
                &Adjust::new().by("balance", amount),
            )
            .await
            .expect("stage");
            let err = tx.commit().await.expect_err("crash");
            assert!(matches!(err, TxnError::Crashed { .. }), "{err:?}");
        }
    };
    let unexpired = TxnOptions::default()
        .finish(mongotx::options::Finish::BeforeReturning)
        .timeout(Duration::from_secs(600));
    crashed_transfer(unexpired, failpoint::FINISH_BEFORE, 1, 30).await;
    let held = |id: &'static str| {
        let db = t.db.clone();
        async move {
            raw_snapshot(&db, "accounts")
                .await
                .iter()
                .any(|d| d.get_str("_id") == Ok(id) && d.contains_key(fields::ACTIVE_TXN))
        }
    };
    assert!(
        held("a").await && held("b").await,
        "the crash left the holds"
    );

    let gc = Gc::new(&mongotx::Store::new(t.db.clone()), GcOptions::default());
    let summary = gc
        .run_round_at(chrono::Utc::now(), &AtomicBool::new(false))
        .await
        .expect("gc");
    assert_eq!(
        (summary.finished, summary.rolled_back, summary.swept),
        (0, 0, 0),
        "{summary:?}"
    );
    assert!(
        !held("a").await && !held("b").await,
        "the holds were finished"
    );
    assert_eq!(accounts.get("a").await.expect("a").balance, 70);
    assert_eq!(accounts.get("b").await.expect("b").balance, 80);

    // A transaction whose record never went out: its holds are orphans, each undone and counted.
    crashed_transfer(
        TxnOptions::default().finish(mongotx::options::Finish::BeforeReturning),
        failpoint::BEGIN_BEFORE,
        2,
        1,
    )
    .await;
    let summary = gc
        .run_round_at(
            chrono::Utc::now() + chrono::Duration::seconds(60),
            &AtomicBool::new(false),
        )
        .await
        .expect("gc");
    assert_eq!(summary.swept, 2, "{summary:?}");
    assert_eq!(accounts.get("a").await.expect("a").balance, 70);
    assert_eq!(accounts.get("b").await.expect("b").balance, 80);
}

#[tokio::test]
async fn a_writer_resolves_an_expired_holder_instead_of_waiting() {
    let t = TestDb::new().await;
    let accounts = accounts(&t).await;
    for (id, balance) in [("a", 100), ("b", 5)] {
        accounts
            .insert(&Account::new(id, id, balance))
            .await
            .expect("seed");
    }
    accounts
        .update("a", 1, &Update::new().set("owner", "A"))
        .await
        .expect("seed");
    // The coordinator dies after b changed under it and before it could abort: staging, a held,
    // b's apply missing.
    let timeout = Duration::from_millis(300);
    let txns = Transactions::with_options(
        &t.store,
        TxnOptions::default()
            .finish(mongotx::options::Finish::BeforeReturning)
            .timeout(timeout)
            .fault_injector(Arc::new(CrashAt(Failpoint {
                name: failpoint::ABORT_BEFORE,
                step: 0,
            }))),
    );
    let tx = txns.begin();
    tx.adjust(&accounts, "a", 2, &Adjust::new().by("balance", 1_i64))
        .await
        .expect("stage");
    tx.adjust(&accounts, "b", 1, &Adjust::new().by("balance", 1_i64))
        .await
        .expect("stage");
    accounts
        .update("b", 1, &Update::new().set("note", "outside"))
        .await
        .expect("outside write");
    assert!(matches!(tx.commit().await, Err(TxnError::Crashed { .. })));
    tokio::time::sleep(timeout + Duration::from_millis(100)).await;
    // The dead transaction's deadline passed: the writer fences b, aborts it and undoes its hold
    // on "a" inline (the version goes back to 2), then writes, rather than waiting out the lock
    // timeout.
    let started = std::time::Instant::now();
    let version = accounts
        .update("a", 2, &Update::new().set("owner", "B"))
        .await
        .expect("the writer goes ahead");
    assert_eq!(version, 3);
    assert!(started.elapsed() < Duration::from_secs(1));
    let a = accounts.get("a").await.expect("a");
    assert_eq!((a.balance, a.owner.as_str()), (100, "B"));
    let records = common::raw_snapshot(&t.db, t.store.transactions_collection()).await;
    assert_eq!(records.len(), 1);
    assert_eq!(
        records[0].get_str("state").ok(),
        Some("aborted"),
        "the writer decided it"
    );
    // The aborted record itself is the GC's to clean up.
    Gc::new(&mongotx::Store::new(t.db.clone()), GcOptions::default())
        .run_round()
        .await
        .expect("GC round");
    assert_no_transaction_left(&t).await;
}

#[tokio::test]
async fn bank_transfers_keep_the_total_and_consistent_readers_see_it() {
    const ACCOUNTS: usize = 10;
    const TASKS: usize = 16;
    const TRANSFERS: usize = 100;
    const START: i64 = 1_000;
    let t = TestDb::new().await;
    let repo = accounts(&t).await;
    for i in 0..ACCOUNTS {
        repo.insert(&Account::new(&format!("acc{i}"), "bank", START))
            .await
            .expect("seed");
    }
    let total = START * ACCOUNTS as i64;
    let done = Arc::new(AtomicBool::new(false));
    let conflicts = Arc::new(AtomicUsize::new(0));

    let mut workers = Vec::new();
    for task in 0..TASKS {
        // Several clients, so the contention crosses connection pools.
        let db = if task % 4 == 0 {
            t.other_client_db().await
        } else {
            t.db.clone()
        };
        let store = mongotx::Store::new(db);
        let repo = common::open_accounts(&store).await;
        let txns = Transactions::with_options(
            &store,
            TxnOptions::default().retry(mongotx::options::LockWait {
                max_wait: Duration::from_secs(120),
                ..TxnOptions::default().retry
            }),
        );
        let conflicts = Arc::clone(&conflicts);
        workers.push(tokio::spawn(async move {
            use rand::Rng;
            for _ in 0..TRANSFERS {
                let (from, to, amount) = {
                    let mut rng = rand::rng();
                    let from = rng.random_range(0..ACCOUNTS);
                    let to = (from + rng.random_range(1..ACCOUNTS)) % ACCOUNTS;
                    (
                        format!("acc{from}"),
                        format!("acc{to}"),
                        rng.random_range(1..=50_i64),
                    )
                };
                let mut attempts = 0;
                txns.run(|tx| {
                    attempts += 1;
                    if attempts > 1 {
                        conflicts.fetch_add(1, Ordering::Relaxed);
                    }
                    let (repo, from, to) = (repo.clone(), from.clone(), to.clone());
                    async move {
                        let a = repo.get(from.as_str()).await?;
                        let b = repo.get(to.as_str()).await?;
                        tx.adjust(
                            &repo,
                            from.as_str(),
                            a.version,
                            &Adjust::new().by("balance", -amount),
                        )
                        .await?;
                        tx.adjust(
                            &repo,
                            to.as_str(),
                            b.version,
                            &Adjust::new().by("balance", amount),
                        )
                        .await?;
                        Ok(())
                    }
                })
                .await
                .expect("transfer");
            }
        }));
    }

    let reader = {
        let repo = repo.clone();
        let txns = common::finishing(&t.store);
        let done = Arc::clone(&done);
        tokio::spawn(async move {
            let seen = Arc::new(Mutex::new(Vec::new()));
            while !done.load(Ordering::SeqCst) {
                let snapshot = Arc::clone(&seen);
                let result = txns
                    .run(|tx| {
                        let repo = repo.clone();
                        async move {
                            let all = repo.find(Query::new()).await?;
                            let mut sum = 0;
                            for account in &all {
                                tx.check(&repo, account.id.clone(), account.version)?;
                                sum += account.balance;
                            }
                            Ok(sum)
                        }
                    })
                    .await;
                if let Ok((sum, _)) = result {
                    snapshot.lock().expect("lock").push(sum);
                }
            }
            let sums = seen.lock().expect("lock").clone();
            sums
        })
    };

    for worker in workers {
        worker.await.expect("worker");
    }
    done.store(true, Ordering::SeqCst);
    let sums = reader.await.expect("reader");

    let all = repo.find(Query::new()).await.expect("final read");
    assert_eq!(all.len(), ACCOUNTS);
    assert_eq!(all.iter().map(|a| a.balance).sum::<i64>(), total);
    assert!(
        !sums.is_empty(),
        "the reader never committed a consistent snapshot"
    );
    assert!(
        sums.iter().all(|s| *s == total),
        "a checked snapshot saw a wrong total: {sums:?}"
    );
    assert!(
        conflicts.load(Ordering::Relaxed) > 0,
        "no transfer ever had to retry"
    );
    println!(
        "{} transfers, {} retried bodies, {} consistent snapshots",
        TASKS * TRANSFERS,
        conflicts.load(Ordering::Relaxed),
        sums.len()
    );
    assert_no_transaction_left(&t).await;
}

/// The default commit returns after its one round: the caller's own reads and the next writer
/// see the committed values at once, and the background task frees the documents soon after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_commit_returns_after_one_round_and_its_documents_are_freed_behind_it() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100), ("b", 0)]).await;
    let txns = Transactions::new(&t.store);
    for round in 0..20_i64 {
        let (a, b) = (
            accounts.get("a").await.expect("a"),
            accounts.get("b").await.expect("b"),
        );
        let tx = txns.begin();
        tx.adjust(
            &accounts,
            "a",
            a.version,
            &Adjust::new().by("balance", -1_i64),
        )
        .await
        .expect("stage");
        tx.adjust(
            &accounts,
            "b",
            b.version,
            &Adjust::new().by("balance", 1_i64),
        )
        .await
        .expect("stage");
        let outcome = tx.commit().await.expect("commit");
        assert!(!outcome.finished, "the default returns before finishing");
        // Read back at once, and write again at once: no wait, committed values.
        let a = accounts.get("a").await.expect("a after");
        assert_eq!(a.value.balance, 99 - round);
        assert_eq!(a.version, 2 + round);
        let found = accounts
            .find(Query::new().filter(doc! { "balance": { "$gte": 50_i64 } }))
            .await
            .expect("find");
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].value.balance, 99 - round);
    }
    // Behind the caller, every document is freed and every record ended.
    let mut clean = false;
    for _ in 0..100 {
        let held = raw_snapshot(&t.db, "accounts")
            .await
            .iter()
            .filter(|d| d.contains_key("_txn"))
            .count();
        let records =
            t.db.collection::<bson::Document>(mongotx::collections::TRANSACTIONS_COLLECTION)
                .count_documents(doc! {})
                .await
                .expect("count");
        if held == 0 && records == 0 {
            clean = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(clean, "the background finishes freed everything");
    let b = accounts.get("b").await.expect("b");
    assert_eq!(b.value.balance, 20);
}
