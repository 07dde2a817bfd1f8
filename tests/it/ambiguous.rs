//! Ambiguous failures: the connection drops after a protocol write was sent (the write ran, its
//! reply is lost) or before it reached the server (it never ran). The client sees the same
//! network error either way; the coordinator and the GC must work out from the documents which
//! one happened, and never apply a change twice or leave a half state.
//!
//! The faults are injected by a wire-protocol proxy between the coordinator's client and the test
//! server; the checks read through a direct client.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::wire_proxy::{command_name, writes_in, Action, Rules, WireProxy};
use crate::common::{Account, CrashAt, TestDb};
use bson::Document;
use mongotx::collections::TRANSACTIONS_COLLECTION;
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::TxnOptions;
use mongotx::testkit::failpoint::{self, Failpoint};
use mongotx::{
    fields, Adjust, RepoError, Repository, Store, Transaction, Transactions, TxnError, Update,
};

/// What the proxy does to a matching command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The command runs; its reply is lost.
    LoseReply,
    /// The command never runs.
    Drop,
    /// Of a bulkWrite, only the first write runs (the server died part-way through it, say);
    /// the reply is lost.
    FirstOnly,
}

type Matcher = fn(&Document) -> bool;

/// One fault: which commands it hits, how, and how many more times.
struct Fault {
    matches: Matcher,
    mode: Mode,
    remaining: AtomicUsize,
}

/// Proxy rules: the first fault that matches a command and has firings left takes it.
#[derive(Clone)]
struct Faults {
    faults: Arc<Vec<Fault>>,
    fired: Arc<AtomicUsize>,
    off: Arc<AtomicBool>,
}

impl Faults {
    fn new(list: Vec<(Matcher, Mode, usize)>) -> Faults {
        Faults {
            faults: Arc::new(
                list.into_iter()
                    .map(|(matches, mode, times)| Fault {
                        matches,
                        mode,
                        remaining: AtomicUsize::new(times),
                    })
                    .collect(),
            ),
            fired: Arc::new(AtomicUsize::new(0)),
            off: Arc::new(AtomicBool::new(false)),
        }
    }

    fn once(matches: Matcher, mode: Mode) -> Faults {
        Faults::new(vec![(matches, mode, 1)])
    }

    fn fired(&self) -> usize {
        self.fired.load(Ordering::SeqCst)
    }
}

impl Rules for Faults {
    fn command(&self, command: &mut Document) -> Action {
        if self.off.load(Ordering::SeqCst) {
            return Action::Forward;
        }
        // A bulkWrite carrying a matching write is hit as a whole: every write in it.
        let writes = writes_in(command);
        for fault in self.faults.iter() {
            if writes.iter().any(|write| (fault.matches)(write))
                && fault
                    .remaining
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
            {
                self.fired.fetch_add(1, Ordering::SeqCst);
                return match fault.mode {
                    Mode::LoseReply => Action::LoseReply,
                    Mode::Drop => Action::Drop,
                    Mode::FirstOnly => {
                        if let Ok(ops) = command.get_array_mut("ops") {
                            ops.truncate(1);
                        }
                        Action::LoseReply
                    }
                };
            }
        }
        Action::Forward
    }
}

// Recognising the protocol's writes on the wire.

fn on(command: &Document, name: &str, coll: &str) -> bool {
    command_name(command) == name && command.get_str(name).ok() == Some(coll)
}

/// The first update statement's filter and update of an `update` command on `coll`.
fn update_on<'a>(command: &'a Document, coll: &str) -> Option<(&'a Document, &'a Document)> {
    if !on(command, "update", coll) {
        return None;
    }
    let statement = command.get_array("updates").ok()?.first()?.as_document()?;
    Some((
        statement.get_document("q").ok()?,
        statement.get_document("u").ok()?,
    ))
}

fn set_of(update: &Document) -> Option<&Document> {
    update.get_document("$set").ok()
}

/// The record's write: a findAndModify upsert.
fn begin_write(c: &Document) -> bool {
    on(c, "findAndModify", TRANSACTIONS_COLLECTION)
}

/// An insert's apply: a findAndModify upsert on the data collection.
fn insert_apply(c: &Document) -> bool {
    on(c, "findAndModify", "accounts")
}

fn adjust_apply(c: &Document) -> bool {
    update_on(c, "accounts").is_some_and(|(_, u)| u.contains_key("$inc"))
}

fn update_apply(c: &Document) -> bool {
    update_on(c, "accounts")
        .and_then(|(_, u)| set_of(u))
        .is_some_and(|set| set.contains_key("note") && set.contains_key(fields::ACTIVE_TXN))
}

fn delete_apply(c: &Document) -> bool {
    update_on(c, "accounts")
        .and_then(|(_, u)| set_of(u))
        .is_some_and(|set| set.contains_key(fields::DELETING))
}

fn check_apply(c: &Document) -> bool {
    update_on(c, "accounts")
        .and_then(|(_, u)| set_of(u))
        .is_some_and(|set| {
            set.contains_key(fields::ACTIVE_TXN) && !set.contains_key(fields::VERSION)
        })
}

fn commit_point(c: &Document) -> bool {
    update_on(c, TRANSACTIONS_COLLECTION)
        .and_then(|(_, u)| set_of(u))
        .is_some_and(|set| set.get_str("state").ok() == Some("committed"))
}

fn gc_claim(c: &Document) -> bool {
    update_on(c, TRANSACTIONS_COLLECTION)
        .and_then(|(_, u)| set_of(u))
        .is_some_and(|set| set.get_str("state").ok() == Some("aborted"))
}

fn finish_write(c: &Document) -> bool {
    update_on(c, "accounts").is_some_and(|(q, u)| {
        q.contains_key(fields::ACTIVE_TXN)
            && u.len() == 1
            && u.get_document("$unset").is_ok_and(|unset| {
                unset.contains_key(fields::ACTIVE_TXN) && !unset.contains_key(fields::DELETING)
            })
    })
}

fn finish_delete(c: &Document) -> bool {
    update_on(c, "accounts")
        .is_some_and(|(q, u)| q.contains_key(fields::ACTIVE_TXN) && u.contains_key(fields::DELETED))
}

fn rollback_write(c: &Document) -> bool {
    update_on(c, "accounts").is_some_and(|(_, u)| {
        set_of(u).is_some_and(|set| set.contains_key(fields::VERSION))
            && u.get_document("$unset")
                .is_ok_and(|unset| unset.contains_key(fields::ACTIVE_TXN))
    })
}

fn end_write(c: &Document) -> bool {
    on(c, "delete", TRANSACTIONS_COLLECTION)
}

/// Any command on the transactions collection but the record's write.
fn after_begin(c: &Document) -> bool {
    !begin_write(c) && c.get_str(command_name(c)).ok() == Some(TRANSACTIONS_COLLECTION)
}

/// A test database seeded with the accounts every case stages against, all at version 1.
struct Fixture {
    t: TestDb,
    accounts: Repository<Account>,
}

impl Fixture {
    async fn new() -> Fixture {
        let t = TestDb::new().await;
        let accounts = common::open_accounts(&t.store).await;
        for (id, balance) in [("a", 100), ("b", 50), ("c", 10), ("d", 10), ("e", 10)] {
            let account = Account {
                note: Some(format!("note of {id}")),
                ..Account::new(id, id, balance)
            };
            accounts.insert(&account).await.expect("seed");
        }
        Fixture { t, accounts }
    }

    /// A store and accounts repository on a client that talks through `proxy`; `batch`: whether
    /// a round's writes go as one bulkWrite where the server has it.
    async fn through(&self, proxy: &WireProxy, batch: bool) -> (Store, Repository<Account>) {
        let store = Store::builder(proxy.client().await.database(self.t.db.name()))
            .batch_writes(batch)
            .build();
        let accounts = store
            .repository::<Account>(common::accounts_spec())
            .await
            .expect("open through the proxy");
        (store, accounts)
    }

    /// A transaction staged through a new proxy applying `faults`; keep the proxy alive.
    async fn staged_through(&self, faults: &Faults, batch: bool) -> (WireProxy, Transaction) {
        let proxy = WireProxy::start(&common::server_uri(), faults.clone()).await;
        let (store, accounts) = self.through(&proxy, batch).await;
        let tx = common::finishing(&store).begin();
        Fixture::stage(&tx, &accounts).await.expect("stage");
        (proxy, tx)
    }

    /// Stages all five actions: a transfer a → b, an update of c, a delete of d, a check of e,
    /// the insert of n.
    async fn stage(tx: &Transaction, accounts: &Repository<Account>) -> Result<(), TxnError> {
        tx.adjust(accounts, "a", 1, &Adjust::new().by("balance", -10_i64))
            .await?;
        tx.adjust(accounts, "b", 1, &Adjust::new().by("balance", 10_i64))
            .await?;
        tx.update(accounts, "c", 1, &Update::new().set("note", "changed"))
            .await?;
        tx.delete(accounts, "d", 1)?;
        tx.check(accounts, "e", 1)?;
        tx.insert(accounts, &Account::new("n", "newcomer", 1))
            .await?;
        Ok(())
    }

    async fn assert_clean(&self, what: &str) {
        common::assert_settled(&self.t, &["accounts"], what).await;
    }

    /// Everything applied exactly once.
    async fn assert_committed(&self, what: &str) {
        self.assert_clean(what).await;
        let get = |id: &'static str| self.accounts.get(id);
        let a = get("a").await.expect("a");
        let b = get("b").await.expect("b");
        assert_eq!((a.balance, a.version), (90, 2), "{what}: a");
        assert_eq!((b.balance, b.version), (60, 2), "{what}: b");
        let c = get("c").await.expect("c");
        assert_eq!(
            (c.note.as_deref(), c.version),
            (Some("changed"), 2),
            "{what}: c"
        );
        assert!(
            matches!(get("d").await, Err(RepoError::Deleted { version: 2, .. })),
            "{what}: d"
        );
        assert_eq!(get("e").await.expect("e").version, 1, "{what}: e");
        let n = get("n").await.expect("n");
        assert_eq!((n.owner.as_str(), n.version), ("newcomer", 1), "{what}: n");
    }

    /// Nothing applied: every document exactly as it was, version included.
    /// Nothing applied (e at `e_version` after outside writes).
    async fn assert_untouched_but_e(&self, what: &str, e_version: i64) {
        self.assert_clean(what).await;
        for (id, balance) in [("a", 100), ("b", 50), ("c", 10), ("d", 10), ("e", 10)] {
            let read = self.accounts.get(id).await.expect("read");
            assert_eq!(read.balance, balance, "{what}: {id}");
            assert_eq!(
                read.note.as_deref(),
                Some(format!("note of {id}").as_str()),
                "{what}: {id}"
            );
            // A rollback puts the version back too: no trace, not even a spurious conflict.
            let version = if id == "e" { e_version } else { 1 };
            assert_eq!(read.version, version, "{what}: {id}");
        }
        assert!(
            matches!(
                self.accounts.get("n").await,
                Err(RepoError::NotFound { .. })
            ),
            "{what}: n"
        );
    }
}

#[tokio::test]
async fn a_lost_reply_or_a_dropped_command_at_any_commit_write_applies_everything_once() {
    let cases: [(&str, Matcher); 10] = [
        ("ActiveTransaction write", begin_write),
        ("insert apply", insert_apply),
        ("adjust apply", adjust_apply),
        ("update apply", update_apply),
        ("delete apply", delete_apply),
        ("check apply", check_apply),
        ("commit point", commit_point),
        ("finish", finish_write),
        ("tombstone finish", finish_delete),
        ("ActiveTransaction delete", end_write),
    ];
    let mut covered = 0;
    // Each write its own command (one of them hit), and the round's writes in one bulkWrite
    // where the server has it (all of them hit together).
    for (batch, (name, matcher)) in [false, true]
        .into_iter()
        .flat_map(|batch| cases.map(|case| (batch, case)))
    {
        let modes: &[Mode] = if batch {
            &[Mode::LoseReply, Mode::Drop, Mode::FirstOnly]
        } else {
            &[Mode::LoseReply, Mode::Drop]
        };
        for &mode in modes {
            let what = format!("{name}, {mode:?}, batch_writes {batch}");
            let f = Fixture::new().await;
            let faults = Faults::once(matcher, mode);
            let (_proxy, tx) = f.staged_through(&faults, batch).await;
            let outcome = tx
                .commit()
                .await
                .unwrap_or_else(|e| panic!("{what}: commit failed: {e}"));
            assert_eq!(faults.fired(), 1, "{what}: the fault never fired");
            assert!(outcome.finished, "{what}: {outcome:?}");
            assert_eq!(outcome.version_of("accounts", "a"), Some(2), "{what}");
            f.assert_committed(&what).await;
            covered += 1;
        }
    }
    println!("{covered} ambiguous commit writes settled without double-applying");
}

#[tokio::test]
async fn a_lost_rollback_write_still_rolls_back_exactly_once() {
    for mode in [Mode::LoseReply, Mode::Drop] {
        let what = format!("rollback write, {mode:?}");
        let f = Fixture::new().await;
        let faults = Faults::once(rollback_write, mode);
        let (_proxy, tx) = f.staged_through(&faults, true).await;
        // An outside write to e makes its check fail once the others have been applied.
        f.accounts
            .update("e", 1, &Update::new().set("owner", "outsider"))
            .await
            .expect("outside write");
        let err = tx.commit().await.expect_err("the check must fail");
        assert!(
            matches!(
                err.repo_error(),
                Some(RepoError::VersionConflict {
                    expected: 1,
                    actual: 2,
                    ..
                })
            ),
            "{what}: {err}"
        );
        assert_eq!(faults.fired(), 1, "{what}: the fault never fired");
        // e keeps the outside write; put its owner back so the common checks apply.
        let e = f.accounts.get("e").await.expect("e");
        assert_eq!((e.owner.as_str(), e.version), ("outsider", 2), "{what}");
        f.accounts
            .update("e", 2, &Update::new().set("owner", "e"))
            .await
            .expect("undo the outside write");
        f.assert_untouched_but_e(&what, 3).await;
    }
}

/// The deadline of the dead coordinators' transactions: an aborted record goes once the server's
/// clock has passed it.
const DEAD_TIMEOUT: Duration = Duration::from_millis(800);

/// Leaves what a coordinator that died at failpoint `at` leaves, then waits for its deadline.
/// With `spoil`, an outside write to e makes e's check fail first.
async fn dead_coordinator(f: &Fixture, at: Failpoint, spoil: bool) {
    let txns = Transactions::with_options(
        &f.t.store,
        TxnOptions::default()
            .finish(mongotx::options::Finish::BeforeReturning)
            .timeout(DEAD_TIMEOUT)
            .fault_injector(Arc::new(CrashAt(at))),
    );
    let tx = txns.begin();
    Fixture::stage(&tx, &f.accounts).await.expect("stage");
    if spoil {
        f.accounts
            .update("e", 1, &Update::new().set("owner", "outsider"))
            .await
            .expect("outside write");
    }
    assert!(matches!(tx.commit().await, Err(TxnError::Crashed { .. })));
    tokio::time::sleep(DEAD_TIMEOUT + Duration::from_millis(100)).await;
}

#[tokio::test]
async fn the_gc_settles_lost_claims_and_lost_recovery_writes() {
    // A coordinator that dies after e's check failed and before aborting leaves a staging
    // transaction with e's apply missing: the GC must fence e and abort it.
    let undecided = Failpoint {
        name: failpoint::ABORT_BEFORE,
        step: 0,
    };
    let committed_point = Failpoint {
        name: failpoint::COMMIT_AFTER,
        step: 0,
    };
    let cases: [(&str, Failpoint, Matcher, bool); 4] = [
        ("claim", undecided, gc_claim, false),
        ("rollback write", undecided, rollback_write, false),
        ("finish write", committed_point, finish_write, true),
        ("ActiveTransaction delete", committed_point, end_write, true),
    ];
    for (name, coordinator_dies_at, matcher, committed) in cases {
        for mode in [Mode::LoseReply, Mode::Drop] {
            let what = format!("GC {name}, {mode:?}");
            let f = Fixture::new().await;
            dead_coordinator(&f, coordinator_dies_at, !committed).await;
            let faults = Faults::once(matcher, mode);
            let proxy = WireProxy::start(&common::server_uri(), faults.clone()).await;
            let gc = Gc::new(
                &mongotx::Store::new(proxy.client().await.database(f.t.db.name())),
                GcOptions::default(),
            );
            let stop = AtomicBool::new(false);
            let first = gc
                .run_round_at(common::hours_from_now(1).to_chrono(), &stop)
                .await
                .expect("round 1");
            assert_eq!(faults.fired(), 1, "{what}: the fault never fired");
            // A claim whose outcome is unknown is skipped and settled next round; recovery
            // writes are idempotent and retried within the round.
            let second = gc
                .run_round_at(common::hours_from_now(1).to_chrono(), &stop)
                .await
                .expect("round 2");
            let resolved =
                first.finished + first.rolled_back + second.finished + second.rolled_back;
            assert_eq!(resolved, 1, "{what}: {first:?} then {second:?}");
            if committed {
                f.assert_committed(&what).await;
            } else {
                // e keeps the outside write; put its owner back so the common checks apply.
                f.accounts
                    .update("e", 2, &Update::new().set("owner", "e"))
                    .await
                    .expect("undo the outside write");
                f.assert_untouched_but_e(&what, 3).await;
            }
        }
    }
}

#[tokio::test]
async fn a_commit_point_that_never_gets_through_leaves_the_implicit_commit_for_others_to_record() {
    let f = Fixture::new().await;
    let faults = Faults::new(vec![(commit_point, Mode::Drop, usize::MAX)]);
    let (_proxy, tx) = f.staged_through(&faults, true).await;
    // The record and every apply landed: the transaction is committed, whatever follows.
    let outcome = tx.commit().await.expect("committed in one round");
    assert!(!outcome.finished, "{outcome:?}");
    assert!(faults.fired() > 1, "the commit point was only tried once");
    // Readers find every participant in place and take it as committed (and write it so).
    assert_eq!(f.accounts.get("a").await.expect("a").balance, 90);
    let round = Gc::new(&mongotx::Store::new(f.t.db.clone()), GcOptions::default())
        .run_round_at(
            common::hours_from_now(1).to_chrono(),
            &AtomicBool::new(false),
        )
        .await
        .expect("GC round");
    assert_eq!(round.finished, 1, "{round:?}");
    f.assert_committed("commit point never written").await;
}

#[tokio::test]
async fn an_unknown_commit_outcome_is_not_retried_and_the_gc_settles_it() {
    let f = Fixture::new().await;
    // The record lands but no reply to it gets back; after that the rest of the transactions
    // collection is unreachable, so the coordinator can neither read the state back nor abort.
    let faults = Faults::new(vec![
        (begin_write, Mode::LoseReply, usize::MAX),
        (after_begin, Mode::Drop, usize::MAX),
    ]);
    let proxy = WireProxy::start(&common::server_uri(), faults.clone()).await;
    let (store, accounts) = f.through(&proxy, true).await;
    let txns = Transactions::with_options(
        &store,
        TxnOptions::default()
            .finish(mongotx::options::Finish::BeforeReturning)
            .timeout(Duration::from_secs(60)),
    );
    let bodies = AtomicUsize::new(0);
    let err = txns
        .run(|tx| {
            bodies.fetch_add(1, Ordering::SeqCst);
            let accounts = accounts.clone();
            async move { Fixture::stage(&tx, &accounts).await }
        })
        .await
        .expect_err("the outcome cannot be known");
    assert!(matches!(err, TxnError::CommitUnknown { .. }), "{err}");
    assert!(!err.is_retryable());
    assert_eq!(bodies.load(Ordering::SeqCst), 1, "the body was rerun");

    // It did commit (the record and every apply landed): readers see the new values, and the GC
    // frees the documents.
    faults.off.store(true, Ordering::SeqCst);
    assert_eq!(f.accounts.get("a").await.expect("a").balance, 90);
    let round = Gc::new(&mongotx::Store::new(f.t.db.clone()), GcOptions::default())
        .run_round_at(
            common::hours_from_now(1).to_chrono(),
            &AtomicBool::new(false),
        )
        .await
        .expect("GC round");
    assert_eq!(round.finished, 1, "{round:?}");
    f.assert_committed("unknown commit outcome").await;
}
