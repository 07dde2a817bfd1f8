//! Several GC runners next to late coordinators: transactions with a very short deadline stall at
//! random protocol steps while GC loops on other clients claim, roll back and finish whatever
//! expires. Every transfer a coordinator reports committed must be in the final balances exactly
//! once, and every one it reports expired or failed must be absent.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{Account, TestDb};
use mongotx::gc::{Gc, GcOptions, RoundSummary};
use mongotx::options::TxnOptions;
use mongotx::testkit::failpoint::{Failpoint, FaultInjector};
use mongotx::{Adjust, Query, Store, Transactions, TxnError};
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
        let gc = Gc::new(
            &mongotx::Store::new(t.other_client_db().await),
            GcOptions::default(),
        );
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
    Gc::new(&mongotx::Store::new(t.db.clone()), GcOptions::default())
        .run_round_at(
            common::hours_from_now(1).to_chrono(),
            &AtomicBool::new(false),
        )
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

/// Parks the coordinator at one failpoint until the test lets it go, and optionally crashes it
/// at another.
struct Gate {
    at: Failpoint,
    crash: Option<Failpoint>,
    reached: tokio::sync::mpsc::UnboundedSender<()>,
    release: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
}

/// The test's side of a [`Gate`].
struct GateControl {
    reached: tokio::sync::mpsc::UnboundedReceiver<()>,
    release: std::sync::mpsc::Sender<()>,
}

impl Gate {
    fn new(at: Failpoint, crash: Option<Failpoint>) -> (Arc<Gate>, GateControl) {
        let (reached_tx, reached) = tokio::sync::mpsc::unbounded_channel();
        let (release, release_rx) = std::sync::mpsc::channel();
        let gate = Gate {
            at,
            crash,
            reached: reached_tx,
            release: std::sync::Mutex::new(release_rx),
        };
        (Arc::new(gate), GateControl { reached, release })
    }
}

impl GateControl {
    async fn reached(&mut self) {
        self.reached
            .recv()
            .await
            .expect("the coordinator reaches the gate");
    }

    fn release(&self) {
        self.release.send(()).expect("release the coordinator");
    }
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
        self.crash == Some(point)
    }
}

/// The apply of entry 1 ("z" sorts after "a", so it is the last in lock order).
fn late_apply(name: &'static str) -> Failpoint {
    Failpoint { name, step: 1 }
}

/// A GC round after `holder`'s deadline has passed.
async fn gc_round_after(t: &TestDb, deadline: Duration) -> RoundSummary {
    tokio::time::sleep(deadline + Duration::from_millis(30)).await;
    Gc::new(&mongotx::Store::new(t.db.clone()), GcOptions::default())
        .run_round()
        .await
        .expect("GC round")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_coordinator_woken_after_its_deadline_changes_nothing() {
    use mongotx::testkit::failpoint::{APPLY_AFTER, APPLY_BEFORE};
    use mongotx::{RepoError, Update};

    let deadline = Duration::from_millis(50);
    let mut cases = 0;
    for late in ["insert", "update", "adjust", "delete", "check"] {
        // The late coordinator either lives on (and must learn it expired and undo its own late
        // apply) or dies right after its late apply (leaving a hold whose record is gone).
        for dies in [false, true] {
            let what = format!("late {late}, coordinator dies after it: {dies}");
            let t = TestDb::new().await;
            let accounts = common::open_accounts(&t.store).await;
            common::seed_accounts(&accounts, &[("a", 100)]).await;
            if late != "insert" {
                common::seed_accounts(&accounts, &[("z", 100)]).await;
            }
            let crash = dies.then(|| late_apply(APPLY_AFTER));
            let (gate, mut control) = Gate::new(late_apply(APPLY_BEFORE), crash);
            let txns = Transactions::with_options(
                &t.store,
                TxnOptions::default().timeout(deadline).fault_injector(gate),
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

            control.reached().await;
            // The coordinator is parked past its deadline; a GC round meanwhile decides whatever
            // of it is there (nothing of it can commit any more).
            gc_round_after(&t, deadline).await;
            control.release();
            let result = coordinator.await.expect("coordinator task");
            if dies {
                // The crash point after the apply is reached if the apply got through at all;
                // one that finds itself too late reports the expiry first.
                assert!(
                    matches!(
                        result,
                        Err(TxnError::Crashed { .. } | TxnError::Expired { .. })
                    ),
                    "{what}: {result:?}"
                );
            } else {
                assert!(
                    matches!(result, Err(TxnError::Expired { .. })),
                    "{what}: the late coordinator reported {result:?}"
                );
            }
            // Its writes went out after the deadline: an update is refused by the server's clock,
            // an insert lands stamped too late and its record arrives aborted. Readers never see
            // any of it, and one GC round (after a writer's grace) clears what is left.
            let z = accounts.get("z").await;
            let a = accounts.get("a").await.expect("a");
            assert_eq!((a.balance, a.version), (100, 1), "{what}");
            let round = Gc::new(&mongotx::Store::new(t.db.clone()), GcOptions::default())
                .run_round()
                .await
                .expect("GC round");
            assert_eq!(round.skipped, 0, "{what}: {round:?}");
            if late == "insert" {
                assert!(
                    matches!(z, Err(RepoError::NotFound { .. })),
                    "{what}: {z:?}"
                );
            } else {
                let z = z.expect("z");
                assert_eq!(
                    (z.owner.as_str(), z.balance, z.version),
                    ("Z", 100, 1),
                    "{what}"
                );
            }

            common::assert_settled(&t, &["accounts"], &what).await;
            let a = accounts.get("a").await.expect("a");
            assert_eq!((a.balance, a.version), (100, 1), "{what}");
            if late == "insert" {
                accounts
                    .insert(&Account::new("z", "later", 5))
                    .await
                    .expect("insert after the late insert was undone");
            } else {
                accounts
                    .update("z", 1, &Update::new().set("owner", "later"))
                    .await
                    .expect("write after the late apply was undone");
            }
            cases += 1;
        }
    }
    println!("{cases} late applies after a GC rollback: none ever read as committed, all undone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_check_after_another_transaction_held_the_document_is_refused() {
    use mongotx::testkit::failpoint::{APPLY_AFTER, APPLY_BEFORE, COMMIT_BEFORE};

    let deadline = Duration::from_millis(50);
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100), ("z", 100)]).await;

    // U checks z and is parked before its commit point, holding z at version 1.
    let (gate_u, mut control_u) = Gate::new(
        Failpoint {
            name: COMMIT_BEFORE,
            step: 0,
        },
        None,
    );
    let u =
        Transactions::with_options(&t.store, TxnOptions::default().fault_injector(gate_u)).begin();
    u.check(&accounts, "z", 1).expect("stage U");
    let u = tokio::spawn(u.commit());
    control_u.reached().await;

    // T adjusts a and checks z (also read at version 1), and is parked before applying z.
    let (gate_t, mut control_t) =
        Gate::new(late_apply(APPLY_BEFORE), Some(late_apply(APPLY_AFTER)));
    let txns = Transactions::with_options(
        &t.store,
        TxnOptions::default()
            .timeout(deadline)
            .fault_injector(gate_t),
    );
    let tx = txns.begin();
    tx.adjust(&accounts, "a", 1, &Adjust::new().by("balance", -10_i64))
        .await
        .expect("stage T");
    tx.check(&accounts, "z", 1).expect("stage T");
    let late = tokio::spawn(tx.commit());
    control_t.reached().await;

    // T's deadline passes while U holds z; a GC round meanwhile.
    gc_round_after(&t, deadline).await;

    // U commits and lets z go; then T's late check arrives and T dies right after it. The check
    // went out after T's deadline, so the server refuses it: z is never held by T.
    control_u.release();
    u.await.expect("U task").expect("U commits");
    control_t.release();
    let result = late.await.expect("T task");
    assert!(
        matches!(
            result,
            Err(TxnError::Crashed { .. } | TxnError::Expired { .. })
        ),
        "{result:?}"
    );
    let z = common::raw_snapshot(&t.db, "accounts")
        .await
        .into_iter()
        .find(|d| d.get_str("_id").ok() == Some("z"))
        .expect("z");
    assert!(!z.contains_key(mongotx::fields::ACTIVE_TXN), "{z}");
    // A writer goes ahead at once.
    let started = std::time::Instant::now();
    accounts
        .update("z", 1, &mongotx::Update::new().set("owner", "writer"))
        .await
        .expect("write z");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    // Whatever else of T landed late, one GC round finds it.
    Gc::new(&mongotx::Store::new(t.db.clone()), GcOptions::default())
        .run_round()
        .await
        .expect("sweep");
    common::assert_settled(&t, &["accounts"], "after T's late check").await;
    assert_eq!(accounts.get("a").await.expect("a").balance, 100);
}

/// Issue 46, case 7: a decision that finds the record gone removes its own fence. GC 1 reads an
/// expired staging transaction (a applied, b missing) and stops before it fences b; GC 2 decides
/// it meanwhile (fences b, aborts, rolls back, and deletes the record past its deadline). GC 1
/// then fences b, and its abort finds no record: the fence has nothing left to guard. It used to
/// stay until a sweep (or a writer) met it; now the decision takes it away at once, and GC 1's
/// round has nothing left to sweep (it dies at its first sweep write, so a fence left behind
/// would still be there).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decision_that_finds_the_record_gone_takes_its_fence_away() {
    use crate::common::{hold_of, millis_from_now, put_hold};
    use bson::{doc, oid::ObjectId, Document};
    use mongotx::collections::TRANSACTIONS_COLLECTION;
    use mongotx::testkit::failpoint::{GC_FENCE_BEFORE, GC_SWEEP_BEFORE};

    // GC 1 decides in a round (a page of records together) or by the transaction's id (one by
    // one, as writers do too).
    for by_id in [false, true] {
        let t = TestDb::new().await;
        let accounts = common::open_accounts(&t.store).await;
        common::seed_accounts(&accounts, &[("a", 100), ("b", 50)]).await;
        let txn = ObjectId::new();
        let deadline = millis_from_now(-1_000);
        t.db.collection::<Document>(TRANSACTIONS_COLLECTION)
        .insert_one(doc! {
            "_id": txn, "state": "staging", "created": millis_from_now(-2_000), "deadline": deadline,
            "entries": [
                { "coll": "accounts", "id": "a", "expected": 1_i64, "applied": 2_i64, "schema": 1_i64,
                  "op": { "kind": "update", "set": [{ "path": "owner", "value": "X" }], "unset": [],
                          "undo": { "restore": { "owner": "A" }, "absent": [] } } },
                { "coll": "accounts", "id": "b", "expected": 1_i64, "applied": 2_i64, "schema": 1_i64,
                  "op": { "kind": "update", "set": [{ "path": "owner", "value": "Y" }], "unset": [],
                          "undo": { "restore": { "owner": "B" }, "absent": [] } } },
            ],
        })
        .await
        .unwrap();
        put_hold(
            &t.db,
            "accounts",
            "a",
            txn,
            doc! { "owner": "X", "_version": 2_i64 },
            hold_of(
                "update",
                deadline,
                doc! { "owner": "A", "_version": 1_i64 },
                &[],
            ),
        )
        .await;

        let (gate, mut control) = Gate::new(
            Failpoint {
                name: GC_FENCE_BEFORE,
                step: 1,
            },
            Some(Failpoint {
                name: GC_SWEEP_BEFORE,
                step: 0,
            }),
        );
        let first = {
            let store = Store::new(t.db.clone());
            tokio::spawn(async move {
                let gc = Gc::new(&store, GcOptions::default().fault_injector(gate));
                if by_id {
                    gc.resolve(txn).await.map(|_| ())
                } else {
                    gc.run_round().await.map(|_| ())
                }
            })
        };
        control.reached().await;
        // (GC 1 holds the record's claim: GC 2 resolves the transaction by its id.)
        let second = Gc::new(&Store::new(t.db.clone()), GcOptions::default())
            .resolve(txn)
            .await
            .expect("GC 2");
        assert!(second, "GC 2 rolled it back");
        control.release();
        let round = first.await.expect("GC 1 task");
        assert!(
            round.is_ok(),
            "by id {by_id}: GC 1 met a hold to sweep: {round:?}"
        );
        let b =
            t.db.collection::<Document>("accounts")
                .find_one(doc! { "_id": "b" })
                .await
                .unwrap()
                .unwrap();
        assert!(
            !b.contains_key("_txn"),
            "by id {by_id}: a fence left on b: {b}"
        );
        common::assert_settled(&t, &["accounts"], "after both rounds").await;
        let b = accounts.get("b").await.expect("b");
        assert_eq!((b.owner.as_str(), b.version), ("B", 1));
    }
}
