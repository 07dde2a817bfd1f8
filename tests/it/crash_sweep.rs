//! The crash sweep: a coordinator or GC that dies at any failpoint of commit, active rollback or GC,
//! for transactions of 1 to 4 documents across two collections mixing all five actions. After the
//! crash and a GC round, each transaction is all-or-nothing, no document is still held, versions
//! are consistent and no ActiveTransaction document remains.
//!
//! Every failpoint name the library declares must be reached by at least one scenario, and each
//! scenario asserts that its crash really happened where it was planned, so a failpoint that moves
//! or disappears fails the sweep instead of shrinking it.

use crate::common;

use std::collections::BTreeSet;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{raw_snapshot, Account, CrashAt, TestDb};
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::TxnOptions;
use mongotx::testkit::failpoint::{self as fp, Failpoint};
use mongotx::{fields, Adjust, RepoError, Repository, Transaction, Transactions, TxnError, Update};

/// The coordinators' timeout: a GC aborts an undecided transaction, and deletes an aborted record,
/// only once the server's clock has passed the deadline, so scenarios that need it wait that long.
const TIMEOUT: Duration = Duration::from_millis(1_000);

/// The five actions a transaction can stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Insert,
    Update,
    Adjust,
    Delete,
    Check,
}

const ACTIONS: [Action; 5] = [
    Action::Insert,
    Action::Update,
    Action::Adjust,
    Action::Delete,
    Action::Check,
];

/// Where the scenario crashes.
#[derive(Debug, Clone, Copy)]
enum Plan {
    /// The coordinator dies during a commit that would otherwise succeed.
    Coordinator(Failpoint),
    /// One entry conflicts, and the coordinator dies while aborting or rolling back.
    Rollback(Failpoint),
    /// The coordinator dies at `coordinator` (after a conflict in its last entry if `spoil`),
    /// then the first GC round dies at `gc`.
    Gc {
        coordinator: Failpoint,
        spoil: bool,
        gc: Failpoint,
    },
    /// The coordinator dies before its record was sent, every entry applied: holds without a
    /// record. The GC's sweep dies at `gc`.
    Orphan(Failpoint),
}

impl Plan {
    /// Whether the transaction must end up committed: it is once its record and every apply
    /// have been sent (a crash stops every later step, but what was sent lands).
    fn commits(&self) -> bool {
        let everything_sent =
            |p: &Failpoint| ![fp::BEGIN_BEFORE, fp::APPLY_BEFORE].contains(&p.name);
        match self {
            Plan::Coordinator(p) => everything_sent(p),
            Plan::Rollback(_) | Plan::Orphan(_) => false,
            Plan::Gc {
                coordinator, spoil, ..
            } => !spoil && everything_sent(coordinator),
        }
    }

    fn spoiled(&self) -> bool {
        matches!(self, Plan::Rollback(_) | Plan::Gc { spoil: true, .. })
    }

    fn points(&self) -> Vec<Failpoint> {
        match *self {
            Plan::Coordinator(p) | Plan::Rollback(p) => vec![p],
            Plan::Gc {
                coordinator, gc, ..
            } => vec![coordinator, gc],
            Plan::Orphan(gc) => vec![at(fp::BEGIN_BEFORE, 0), gc],
        }
    }
}

fn at(name: &'static str, step: usize) -> Failpoint {
    Failpoint { name, step }
}

/// Every crash plan for a transaction of `k` documents whose spoiled (last staged) entry is at
/// `spoiled` in lock order.
fn plans(k: usize, spoiled: usize) -> Vec<Plan> {
    let each = |name: &'static str| (0..k).map(move |i| at(name, i));
    let mut plans = Vec::new();
    let coordinator = [at(fp::BEGIN_BEFORE, 0), at(fp::BEGIN_AFTER, 0)]
        .into_iter()
        .chain(each(fp::APPLY_BEFORE))
        .chain(each(fp::APPLY_AFTER))
        .chain([at(fp::COMMIT_BEFORE, 0), at(fp::COMMIT_AFTER, 0)])
        .chain(each(fp::FINISH_BEFORE))
        .chain(each(fp::FINISH_AFTER))
        .chain([at(fp::END_BEFORE, 0), at(fp::END_AFTER, 0)]);
    plans.extend(coordinator.map(Plan::Coordinator));
    let rollback = [at(fp::ABORT_BEFORE, 0), at(fp::ABORT_AFTER, 0)]
        .into_iter()
        .chain(each(fp::ROLLBACK_BEFORE))
        .chain(each(fp::ROLLBACK_AFTER))
        .chain([
            at(fp::ROLLBACK_END_BEFORE, 0),
            at(fp::ROLLBACK_END_AFTER, 0),
        ]);
    plans.extend(rollback.map(Plan::Rollback));
    // Staging with the spoiled entry missing: the GC fences it, aborts and rolls back.
    let undecided = [
        at(fp::GC_FENCE_BEFORE, spoiled),
        at(fp::GC_FENCE_AFTER, spoiled),
        at(fp::GC_CLAIM_BEFORE, 0),
        at(fp::GC_CLAIM_AFTER, 0),
    ]
    .into_iter()
    .chain(each(fp::GC_ROLLBACK_BEFORE))
    .chain(each(fp::GC_ROLLBACK_AFTER))
    .chain([at(fp::GC_END_BEFORE, 0), at(fp::GC_END_AFTER, 0)]);
    plans.extend(undecided.map(|gc| Plan::Gc {
        coordinator: at(fp::ABORT_BEFORE, 0),
        spoil: true,
        gc,
    }));
    // Staging with every entry applied (committed, not yet written so): the GC commits it.
    let implicit = [at(fp::GC_CLAIM_BEFORE, 0), at(fp::GC_CLAIM_AFTER, 0)]
        .into_iter()
        .chain(each(fp::GC_FINISH_BEFORE))
        .chain(each(fp::GC_FINISH_AFTER))
        .chain([at(fp::GC_END_BEFORE, 0), at(fp::GC_END_AFTER, 0)]);
    plans.extend(implicit.map(|gc| Plan::Gc {
        coordinator: at(fp::COMMIT_BEFORE, 0),
        spoil: false,
        gc,
    }));
    // Committed but not finished.
    let gc = each(fp::GC_FINISH_BEFORE)
        .chain(each(fp::GC_FINISH_AFTER))
        .chain([at(fp::GC_END_BEFORE, 0), at(fp::GC_END_AFTER, 0)]);
    plans.extend(gc.map(|gc| Plan::Gc {
        coordinator: at(fp::COMMIT_AFTER, 0),
        spoil: false,
        gc,
    }));
    // Holds without a record: the sweep undoes them one by one.
    plans.extend(
        [at(fp::GC_SWEEP_BEFORE, 0), at(fp::GC_SWEEP_AFTER, 0)]
            .into_iter()
            .map(Plan::Orphan),
    );
    plans
}

/// Transactions of 1 to 4 documents; for each size, five rotations of the actions, so every
/// action sits at every position, with documents alternating between the two collections.
fn shapes() -> Vec<Shape> {
    let mut shapes = Vec::new();
    for k in 1..=4 {
        for r in 0..ACTIONS.len() {
            shapes.push(
                (0..k)
                    .map(|i| (ACTIONS[(r + i) % ACTIONS.len()], (r + i) % 2))
                    .collect(),
            );
        }
    }
    shapes
}

/// A transaction's documents: each one's action and collection (0 or 1).
type Shape = Vec<(Action, usize)>;

/// One document of a scenario: what was staged against what.
struct Staged {
    action: Action,
    coll: usize,
    id: String,
    /// The version the transaction staged against (0 for an insert).
    expected: i64,
    /// The committed value before the transaction (`None` for an insert).
    before: Option<Account>,
    /// The value the insert stages.
    inserted: Option<Account>,
}

/// One worker: its own database, so that its GC rounds only see its own transactions.
struct Worker {
    t: TestDb,
    repos: [Repository<Account>; 2],
}

impl Worker {
    async fn new() -> Worker {
        let t = TestDb::new().await;
        let schema = include_str!("../../schemas/accounts.json");
        let mut repos = Vec::new();
        for name in ["accounts", "ledger"] {
            let spec = mongotx::CollectionSpec::new(name, 1, schema).expect("spec");
            repos.push(t.store.repository::<Account>(spec).await.expect("open"));
        }
        let Ok(repos) = <[Repository<Account>; 2]>::try_from(repos) else {
            unreachable!("two repositories were opened")
        };
        Worker { t, repos }
    }

    fn txns(&self, injector: Option<Failpoint>) -> Transactions {
        let options = TxnOptions::default()
            .finish(mongotx::options::Finish::BeforeReturning)
            .timeout(TIMEOUT);
        let options = match injector {
            Some(point) => options.fault_injector(Arc::new(CrashAt(point))),
            None => options,
        };
        Transactions::with_options(&self.t.store, options)
    }

    fn gc(&self, injector: Option<Failpoint>) -> Gc {
        let options = GcOptions::default();
        let options = match injector {
            Some(point) => options.fault_injector(Arc::new(CrashAt(point))),
            None => options,
        };
        Gc::new(&mongotx::Store::new(self.t.db.clone()), options)
    }

    /// A GC round as if every deadline had passed.
    async fn gc_round(&self, injector: Option<Failpoint>) -> Result<(), TxnError> {
        self.gc(injector)
            .run_round_at(
                common::hours_from_now(1).to_chrono(),
                &AtomicBool::new(false),
            )
            .await
            .map(|_| ())
    }

    /// Creates the documents of `shape` (each existing one once updated, so versions start at 2)
    /// and stages the transaction.
    async fn stage(&self, n: usize, shape: &[(Action, usize)], tx: &Transaction) -> Vec<Staged> {
        let mut staged = Vec::new();
        for (i, &(action, coll)) in shape.iter().enumerate() {
            let repo = &self.repos[coll];
            let id = format!("s{n}d{i}");
            if action == Action::Insert {
                let value = Account {
                    note: Some("inserted".into()),
                    ..Account::new(&id, "newcomer", 7)
                };
                tx.insert(repo, &value).await.expect("stage insert");
                staged.push(Staged {
                    action,
                    coll,
                    id,
                    expected: 0,
                    before: None,
                    inserted: Some(value),
                });
                continue;
            }
            repo.insert(&Account::new(&id, "owner", 100))
                .await
                .expect("seed");
            let expected = repo
                .update(id.as_str(), 1, &Update::new().set("note", "before"))
                .await
                .expect("seed update");
            let before = repo.get(id.as_str()).await.expect("seed read").into_inner();
            match action {
                Action::Update => tx
                    .update(
                        repo,
                        id.as_str(),
                        expected,
                        &Update::new().set("owner", "changed").unset("note"),
                    )
                    .await
                    .expect("stage update"),
                Action::Adjust => tx
                    .adjust(
                        repo,
                        id.as_str(),
                        expected,
                        &Adjust::new().by("balance", 25_i64),
                    )
                    .await
                    .expect("stage adjust"),
                Action::Delete => tx
                    .delete(repo, id.as_str(), expected)
                    .expect("stage delete"),
                Action::Check => tx.check(repo, id.as_str(), expected).expect("stage check"),
                Action::Insert => unreachable!("handled above"),
            }
            staged.push(Staged {
                action,
                coll,
                id,
                expected,
                before: Some(before),
                inserted: None,
            });
        }
        staged
    }

    /// Makes a staged entry conflict with a write from outside the transaction, and records the
    /// value and version that document must keep.
    async fn spoil(&self, doc: &mut Staged) {
        let repo = &self.repos[doc.coll];
        let value = Account::new(&doc.id, "outsider", 1);
        if doc.action == Action::Insert {
            repo.insert(&value).await.expect("conflicting insert");
            doc.before = Some(value);
            doc.expected = 1;
        } else {
            let v = repo
                .update(
                    doc.id.as_str(),
                    doc.expected,
                    &Update::new().set("owner", "outsider"),
                )
                .await
                .expect("conflicting update");
            doc.expected = v;
            doc.before = Some(repo.get(doc.id.as_str()).await.expect("read").into_inner());
        }
    }

    /// Asserts the all-or-nothing end state of one scenario.
    async fn verify(&self, what: &str, staged: &[Staged], committed: bool, spoiled: bool) {
        // An aborted record may wait for the server's clock to pass its deadline; nothing else
        // may remain.
        let txns: Vec<_> = raw_snapshot(&self.t.db, self.t.store.transactions_collection())
            .await
            .into_iter()
            .filter(|r| r.get_str("state") != Ok("aborted"))
            .collect();
        assert!(
            txns.is_empty(),
            "{what}: ActiveTransaction documents remain: {txns:?}"
        );
        for (i, doc) in staged.iter().enumerate() {
            let repo = &self.repos[doc.coll];
            let raw = repo
                .raw_collection()
                .find_one(bson::doc! { "_id": doc.id.as_str() })
                .await
                .expect("raw read");
            if let Some(raw) = &raw {
                assert!(
                    !raw.contains_key(fields::ACTIVE_TXN) && !raw.contains_key(fields::DELETING),
                    "{what}: {} is still held: {raw}",
                    doc.id
                );
            }
            let read = repo.get(doc.id.as_str()).await;
            let e = doc.expected;
            let was_spoiled = spoiled && i + 1 == staged.len();
            let ok = match (doc.action, committed) {
                _ if was_spoiled => matches!(&read,
                    Ok(s) if Some(&s.value) == doc.before.as_ref() && s.version == e),
                (Action::Insert, true) => matches!(&read,
                    Ok(s) if Some(&s.value) == doc.inserted.as_ref() && s.version == 1),
                (Action::Insert, false) => matches!(read, Err(RepoError::NotFound { .. })),
                (Action::Update, true) => {
                    let after = doc.before.clone().map(|b| Account {
                        owner: "changed".into(),
                        note: None,
                        ..b
                    });
                    matches!(&read, Ok(s) if Some(&s.value) == after.as_ref() && s.version == e + 1)
                }
                (Action::Adjust, true) => {
                    let after = doc.before.clone().map(|b| Account {
                        balance: b.balance + 25,
                        ..b
                    });
                    matches!(&read, Ok(s) if Some(&s.value) == after.as_ref() && s.version == e + 1)
                }
                (Action::Delete, true) => {
                    matches!(read, Err(RepoError::Deleted { version, .. }) if version == e + 1)
                }
                // A check never changes anything; a transaction that did not commit leaves every
                // document exactly as it was, version included.
                (Action::Check, _) | (Action::Update | Action::Adjust | Action::Delete, false) => {
                    matches!(&read, Ok(s) if Some(&s.value) == doc.before.as_ref() && s.version == e)
                }
            };
            assert!(
                ok,
                "{what}: {:?} of {} ({}) expected {} from version {e}, read {read:?}",
                doc.action,
                doc.id,
                self.repos[doc.coll].name(),
                if committed {
                    "committed"
                } else {
                    "not committed"
                },
            );
        }
    }
}

/// Runs one scenario; returns the failpoints it crashed at, and whether a plan meant to commit
/// rolled back because its sends arrived after the deadline.
async fn scenario(
    w: &Worker,
    n: usize,
    shape: &[(Action, usize)],
    plan: Plan,
) -> (Vec<Failpoint>, bool) {
    let what = format!("scenario {n} {shape:?} {plan:?}");
    let (coordinator_point, gc_point) = match plan {
        Plan::Coordinator(p) | Plan::Rollback(p) => (p, None),
        Plan::Gc {
            coordinator, gc, ..
        } => (coordinator, Some(gc)),
        Plan::Orphan(gc) => (at(fp::BEGIN_BEFORE, 0), Some(gc)),
    };
    let tx = w.txns(Some(coordinator_point)).begin();
    let mut staged = w.stage(n, shape, &tx).await;
    let spoiled = plan.spoiled();
    if spoiled {
        let last = staged.len() - 1;
        w.spoil(&mut staged[last]).await;
    }

    let begun = Instant::now();
    // On a loaded machine the coordinator itself may see its deadline pass before it reaches a
    // failpoint past its round (then it rolls back, and so must everyone else).
    let mut expired = false;
    let txn = match tx.commit().await {
        Err(TxnError::Crashed { at, txn }) if at == coordinator_point => txn,
        Err(TxnError::Expired { txn }) if plan.commits() => {
            expired = true;
            Some(txn)
        }
        other => {
            panic!("{what}: the coordinator should crash at {coordinator_point}, got {other:?}")
        }
    };
    let records = raw_snapshot(&w.t.db, w.t.store.transactions_collection()).await;
    // A plan whose coordinator sent everything commits when its sends arrived in time: the record
    // created `staging` and every participant held. On a loaded machine a send can reach the
    // server after the one-second deadline, and then the protocol must roll the transaction back
    // instead; which of the two is decided here from what the crash left, not assumed.
    // (A crash after the round, at its commit point or later, comes after the coordinator saw
    // every send land in time.)
    let mut commits = plan.commits();
    let mut late = false;
    let in_round = [fp::BEGIN_AFTER, fp::APPLY_AFTER].contains(&coordinator_point.name);
    if expired || (commits && in_round && !everything_in_time(w, txn, &staged, &records).await) {
        commits = false;
        late = true;
    }
    // Aborting an undecided transaction waits for the server's clock to pass its deadline.
    if !commits && records.iter().any(|r| r.get_str("state") == Ok("staging")) {
        tokio::time::sleep((TIMEOUT + Duration::from_millis(100)).saturating_sub(begun.elapsed()))
            .await;
    }
    if let Some(gc_point) = gc_point {
        match w.gc_round(Some(gc_point)).await {
            Err(TxnError::Crashed { at, .. }) if at == gc_point => {}
            // A transaction rolled back for lateness takes the GC down another path, which
            // may not pass the planned failpoint.
            Ok(()) if late => {}
            other => panic!("{what}: the GC should crash at {gc_point}, got {other:?}"),
        }
    }
    w.gc_round(None)
        .await
        .unwrap_or_else(|e| panic!("{what}: recovery round failed: {e}"));
    w.verify(&what, &staged, commits, spoiled).await;
    if late {
        // Its failpoints were not all reached.
        return (Vec::new(), late);
    }
    (plan.points(), late)
}

/// Whether transaction `txn`'s record was created `staging` (in `records`, read right after the
/// crash) and every staged document carries its hold: its sends all arrived before its deadline.
async fn everything_in_time(
    w: &Worker,
    txn: Option<bson::oid::ObjectId>,
    staged: &[Staged],
    records: &[bson::Document],
) -> bool {
    let Some(txn) = txn else { return false };
    let staging = records
        .iter()
        .any(|r| r.get_object_id("_id") == Ok(txn) && r.get_str("state") == Ok("staging"));
    if !staging {
        return false;
    }
    for doc in staged {
        let raw = w.repos[doc.coll]
            .raw_collection()
            .find_one(bson::doc! { "_id": doc.id.as_str() })
            .await
            .expect("raw read");
        if raw.and_then(|r| r.get_object_id(fields::ACTIVE_TXN).ok()) != Some(txn) {
            return false;
        }
    }
    true
}

/// Where the last staged entry of `shape` stands in lock order (collection name, then id).
fn last_in_lock_order(shape: &[(Action, usize)]) -> usize {
    const NAMES: [&str; 2] = ["accounts", "ledger"];
    let last = shape.len() - 1;
    let mut order: Vec<usize> = (0..shape.len()).collect();
    order.sort_by_key(|&i| (NAMES[shape[i].1], i));
    order.iter().position(|&i| i == last).unwrap_or(last)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn a_crash_at_every_failpoint_leaves_every_transaction_all_or_nothing() {
    const WORKERS: usize = 8;
    let mut work: Vec<(usize, Shape, Plan)> = Vec::new();
    for shape in shapes() {
        for plan in plans(shape.len(), last_in_lock_order(&shape)) {
            work.push((work.len(), shape.clone(), plan));
        }
    }
    let total = work.len();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let mine: Vec<_> = work.iter().skip(w).step_by(WORKERS).cloned().collect();
        tasks.push(tokio::spawn(async move {
            let worker = Worker::new().await;
            let mut reached = Vec::new();
            let mut late = 0;
            for (n, shape, plan) in mine {
                let (points, was_late) = scenario(&worker, n, &shape, plan).await;
                reached.extend(points);
                late += usize::from(was_late);
            }
            (worker, reached, late)
        }));
    }
    let mut reached = BTreeSet::new();
    let mut workers = Vec::new();
    let mut late = 0;
    for task in tasks {
        let (worker, points, was_late) = task.await.expect("sweep worker");
        reached.extend(points);
        late += was_late;
        workers.push(worker);
    }
    let meant_to_commit = work.iter().filter(|(_, _, plan)| plan.commits()).count();
    // A late send is the exception even on a busy machine: most plans meant to commit must have
    // committed, or the sweep would no longer test the roll-forward at all.
    assert!(
        late * 10 <= meant_to_commit,
        "{late} of {meant_to_commit} transactions meant to commit arrived after their deadline"
    );
    // The aborted records left waiting for their deadline are gone after it, in one round.
    tokio::time::sleep(TIMEOUT + Duration::from_millis(100)).await;
    for worker in &workers {
        worker
            .gc_round(None)
            .await
            .expect("the last round after every deadline");
        let left = raw_snapshot(&worker.t.db, worker.t.store.transactions_collection()).await;
        assert!(
            left.is_empty(),
            "records left after every deadline: {left:?}"
        );
    }

    let names: BTreeSet<&str> = reached.iter().map(|p| p.name).collect();
    let missing: Vec<&&str> = fp::ALL.iter().filter(|n| !names.contains(**n)).collect();
    assert!(missing.is_empty(), "failpoints never reached: {missing:?}");
    let shapes = shapes();
    println!(
        "crash sweep: {total} crashed transactions ({} shapes of 1 to 4 documents, all five actions), \
         {} distinct failpoints ({} names), in {:.1?}; {late} of {meant_to_commit} meant to \
         commit arrived after their deadline and rolled back",
        shapes.len(),
        reached.len(),
        names.len(),
        started.elapsed()
    );
    assert_eq!(names.len(), fp::ALL.len());
}
