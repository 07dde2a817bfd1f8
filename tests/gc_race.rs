//! Several GC runners next to late coordinators: transactions with a very short deadline stall at
//! random protocol steps while GC loops on other clients claim, roll back and finish whatever
//! expires. Every transfer a coordinator reports committed must be in the final balances exactly
//! once, and every one it reports expired or failed must be absent.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bson::DateTime;
use common::{Account, TestDb};
use mongotx::failpoint::{Failpoint, FaultInjector};
use mongotx::{
    Adjust, Gc, GcOptions, Query, RoundSummary, Store, Transactions, TxnError, TxnOptions,
};
use rand::Rng;

const ACCOUNTS: usize = 6;
const COORDINATORS: usize = 8;
const TRANSFERS: usize = 30;
const GC_RUNNERS: usize = 3;
const START: i64 = 1_000;

/// Never crashes; now and then stalls the coordinator past its deadline at a random step.
struct Stall {
    stalls: AtomicUsize,
}

impl FaultInjector for Stall {
    fn crash_at(&self, _point: Failpoint) -> bool {
        let pause = {
            let mut rng = rand::rng();
            rng.random_bool(0.08)
                .then(|| Duration::from_millis(rng.random_range(20..80)))
        };
        if let Some(pause) = pause {
            self.stalls.fetch_add(1, Ordering::Relaxed);
            // A coordinator that is slow (GC pause, overloaded host), not one that yields.
            tokio::task::block_in_place(|| std::thread::sleep(pause));
        }
        false
    }
}

/// What one transfer attempt reported.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    committed: usize,
    expired: usize,
    conflicts: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 6)]
async fn gc_runners_and_late_coordinators_agree_on_every_outcome() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    for i in 0..ACCOUNTS {
        accounts
            .insert(&Account::new(&format!("acc{i}"), "bank", START))
            .await
            .expect("seed");
    }
    let stall = Arc::new(Stall {
        stalls: AtomicUsize::new(0),
    });
    let done = Arc::new(AtomicBool::new(false));

    let mut gcs = Vec::new();
    for _ in 0..GC_RUNNERS {
        let gc = Gc::new(t.other_client_db().await, GcOptions::default());
        let done = Arc::clone(&done);
        gcs.push(tokio::spawn(async move {
            let mut total = RoundSummary::default();
            while !done.load(Ordering::SeqCst) {
                let round = gc.run_round().await.expect("GC round");
                total.finished += round.finished;
                total.rolled_back += round.rolled_back;
                total.skipped += round.skipped;
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
            total
        }));
    }

    let mut coordinators = Vec::new();
    for _ in 0..COORDINATORS {
        let store = Store::new(t.other_client_db().await);
        let repo = common::open_accounts(&store).await;
        let txns = Transactions::with_options(
            &store,
            TxnOptions::default()
                .timeout(Duration::from_millis(30))
                .fault_injector(Arc::clone(&stall) as Arc<dyn FaultInjector>),
        );
        coordinators.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            let mut applied = [0_i64; ACCOUNTS];
            for _ in 0..TRANSFERS {
                let (from, to, amount) = {
                    let mut rng = rand::rng();
                    let from = rng.random_range(0..ACCOUNTS);
                    (
                        from,
                        (from + rng.random_range(1..ACCOUNTS)) % ACCOUNTS,
                        rng.random_range(1..=40_i64),
                    )
                };
                let (a, b) = (format!("acc{from}"), format!("acc{to}"));
                let tx = txns.begin();
                let staged = async {
                    let va = repo.get(a.as_str()).await?.version;
                    let vb = repo.get(b.as_str()).await?.version;
                    tx.adjust(&repo, a.as_str(), va, &Adjust::new().by("balance", -amount))
                        .await?;
                    tx.adjust(&repo, b.as_str(), vb, &Adjust::new().by("balance", amount))
                        .await?;
                    Ok::<(), TxnError>(())
                }
                .await;
                let result = match staged {
                    Ok(()) => tx.commit().await.map(|_| ()),
                    Err(e) => Err(e),
                };
                match result {
                    Ok(()) => {
                        tally.committed += 1;
                        applied[from] -= amount;
                        applied[to] += amount;
                    }
                    Err(TxnError::Expired { .. } | TxnError::Aborted { .. }) => tally.expired += 1,
                    Err(e) if e.is_retryable() => tally.conflicts += 1,
                    Err(e) => panic!("transfer {a} -> {b}: {e}"),
                }
            }
            (tally, applied)
        }));
    }

    let mut tally = Tally::default();
    let mut expected = [START; ACCOUNTS];
    for coordinator in coordinators {
        let (mine, applied) = coordinator.await.expect("coordinator");
        tally.committed += mine.committed;
        tally.expired += mine.expired;
        tally.conflicts += mine.conflicts;
        for (balance, delta) in expected.iter_mut().zip(applied) {
            *balance += delta;
        }
    }
    done.store(true, Ordering::SeqCst);
    let mut collected = RoundSummary::default();
    for gc in gcs {
        let total = gc.await.expect("GC runner");
        collected.finished += total.finished;
        collected.rolled_back += total.rolled_back;
        collected.skipped += total.skipped;
    }
    // Whatever a background finish or a stalled coordinator left, one more round settles.
    let later = DateTime::from_millis(DateTime::now().timestamp_millis() + 3_600_000);
    Gc::new(t.db.clone(), GcOptions::default())
        .run_round_at(later, &AtomicBool::new(false))
        .await
        .expect("final round");

    println!(
        "{} transfers: {} committed, {} expired under a GC, {} conflicts; {} stalls; GC runners \
         finished {}, rolled back {}, skipped {}",
        COORDINATORS * TRANSFERS,
        tally.committed,
        tally.expired,
        tally.conflicts,
        stall.stalls.load(Ordering::Relaxed),
        collected.finished,
        collected.rolled_back,
        collected.skipped
    );
    let balances: Vec<i64> = {
        let mut all = accounts.find(Query::new()).await.expect("final read");
        all.sort_by(|x, y| x.value.id.cmp(&y.value.id));
        all.iter().map(|a| a.balance).collect()
    };
    assert_eq!(
        balances,
        expected.to_vec(),
        "final balances vs committed transfers"
    );
    common::assert_settled(&t, &["accounts"], "after the race").await;
    assert!(tally.committed > 0, "nothing committed");
    assert!(
        tally.expired > 0,
        "no coordinator was ever late enough to lose to a GC"
    );
    assert!(
        collected.finished + collected.rolled_back > 0,
        "the GC runners never resolved anything"
    );
}

/// Parks the coordinator at one failpoint until the test lets it go.
struct Gate {
    at: Failpoint,
    reached: tokio::sync::mpsc::UnboundedSender<()>,
    release: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
}

impl FaultInjector for Gate {
    fn crash_at(&self, point: Failpoint) -> bool {
        if point == self.at {
            let _ = self.reached.send(());
            tokio::task::block_in_place(|| {
                let release = self.release.lock().unwrap_or_else(|p| p.into_inner());
                let _ = release.recv_timeout(Duration::from_secs(30));
            });
        }
        false
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_apply_after_a_gc_rollback_never_lands() {
    use mongotx::failpoint::APPLY_BEFORE;
    use mongotx::{RepoError, Update};

    for late in ["insert", "update", "adjust", "delete", "check"] {
        let t = TestDb::new().await;
        let accounts = common::open_accounts(&t.store).await;
        common::seed_accounts(&accounts, &[("a", 100)]).await;
        if late != "insert" {
            common::seed_accounts(&accounts, &[("z", 100)]).await;
        }
        let (reached_tx, mut reached) = tokio::sync::mpsc::unbounded_channel();
        let (release, release_rx) = std::sync::mpsc::channel();
        let gate = Gate {
            // "z" sorts after "a": the last entry in lock order.
            at: Failpoint {
                name: APPLY_BEFORE,
                step: 1,
            },
            reached: reached_tx,
            release: std::sync::Mutex::new(release_rx),
        };
        let txns = Transactions::with_options(
            &t.store,
            TxnOptions::default()
                .timeout(Duration::from_millis(50))
                .fault_injector(Arc::new(gate)),
        );
        let tx = txns.begin();
        tx.adjust(&accounts, "a", 1, &Adjust::new().by("balance", -10_i64))
            .await
            .expect("stage");
        match late {
            "insert" => tx
                .insert(&accounts, &Account::new("z", "new", 1))
                .await
                .map(|_| ()),
            "update" => {
                tx.update(&accounts, "z", 1, &Update::new().set("owner", "x"))
                    .await
            }
            "adjust" => {
                tx.adjust(&accounts, "z", 1, &Adjust::new().by("balance", 10_i64))
                    .await
            }
            "delete" => tx.delete(&accounts, "z", 1),
            _ => tx.check(&accounts, "z", 1),
        }
        .expect("stage the late entry");
        let coordinator = tokio::spawn(tx.commit());

        reached
            .recv()
            .await
            .expect("the coordinator reaches the gate");
        tokio::time::sleep(Duration::from_millis(80)).await;
        let round = Gc::new(t.db.clone(), GcOptions::default())
            .run_round()
            .await
            .expect("GC round");
        assert_eq!(round.rolled_back, 1, "{late}: {round:?}");
        release.send(()).expect("release the coordinator");
        let result = coordinator.await.expect("coordinator task");
        assert!(
            matches!(result, Err(TxnError::Expired { .. })),
            "{late}: the late coordinator reported {result:?}"
        );

        common::assert_settled(&t, &["accounts"], late).await;
        assert_eq!(accounts.get("a").await.expect("a").balance, 100, "{late}");
        let z = accounts.get("z").await;
        if late == "insert" {
            assert!(
                matches!(z, Err(RepoError::NotFound { .. })),
                "{late}: {z:?}"
            );
            // The fence does not stand in the way of anyone else inserting that id.
            accounts
                .insert(&Account::new("z", "later", 5))
                .await
                .expect("insert over the fence");
            assert_eq!(accounts.get("z").await.expect("z").version, 1);
        } else {
            let z = z.expect("z");
            assert_eq!((z.owner.as_str(), z.balance), ("Z", 100), "{late}");
            accounts
                .update("z", z.version, &Update::new().set("owner", "later"))
                .await
                .expect("write after the fence");
        }
    }
}
