//! Writes the server executes after their sender gave up: the proxy cuts the coordinator's
//! connection as it sends a protocol write and delivers that write later on a connection of its
//! own. Whatever the late write lands on, it is harmless: readers never see it as committed,
//! writers are not blocked by it, and one GC round clears what it left.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::wire_proxy::{command_name, writes_in, Action, Rules, WireProxy};
use crate::common::{raw_snapshot, Account, TestDb};
use bson::Document;
use mongotx::collections::TRANSACTIONS_COLLECTION;
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::TxnOptions;
use mongotx::{fields, Adjust, Query, RepoError, Store, Transactions, Update};

/// Longer than the driver takes to find the server again after a cut connection (it waits for a
/// heartbeat, at least 500 ms apart), so the late write lands after the coordinator is done.
const LATE: Duration = Duration::from_millis(1_500);

/// Delivers the first command `matches` accepts late (a bulkWrite as a whole, when one of its
/// writes matches); forwards everything else.
#[derive(Clone)]
struct LateOnce {
    matches: fn(&Document) -> bool,
    fired: Arc<AtomicUsize>,
}

impl Rules for LateOnce {
    fn command(&self, command: &mut Document) -> Action {
        if writes_in(command).iter().any(|write| (self.matches)(write))
            && self
                .fired
                .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            return Action::DeliverLate(LATE);
        }
        Action::Forward
    }
}

fn update_on<'a>(command: &'a Document, coll: &str) -> Option<&'a Document> {
    if command_name(command) != "update" || command.get_str("update").ok() != Some(coll) {
        return None;
    }
    let statement = command.get_array("updates").ok()?.first()?.as_document()?;
    statement.get_document("u").ok()
}

fn check_apply(c: &Document) -> bool {
    update_on(c, "accounts")
        .and_then(|u| u.get_document("$set").ok())
        .is_some_and(|set| {
            set.contains_key(fields::ACTIVE_TXN) && !set.contains_key(fields::VERSION)
        })
}

fn adjust_apply(c: &Document) -> bool {
    update_on(c, "accounts").is_some_and(|u| u.contains_key("$inc"))
}

fn record_insert(c: &Document) -> bool {
    command_name(c) == "findAndModify"
        && c.get_str("findAndModify").ok() == Some(TRANSACTIONS_COLLECTION)
}

fn commit_point(c: &Document) -> bool {
    update_on(c, TRANSACTIONS_COLLECTION)
        .and_then(|u| u.get_document("$set").ok())
        .is_some_and(|set| set.get_str("state").ok() == Some("committed"))
}

struct Fixture {
    t: TestDb,
    accounts: mongotx::Repository<Account>,
    _proxy: WireProxy,
    store: Store,
    via_proxy: mongotx::Repository<Account>,
    fired: Arc<AtomicUsize>,
}

impl Fixture {
    async fn new(matches: fn(&Document) -> bool) -> Fixture {
        let t = TestDb::new().await;
        let accounts = common::open_accounts(&t.store).await;
        common::seed_accounts(&accounts, &[("a", 100), ("b", 50), ("e", 7)]).await;
        let fired = Arc::new(AtomicUsize::new(0));
        let proxy = WireProxy::start(
            &common::server_uri(),
            LateOnce {
                matches,
                fired: Arc::clone(&fired),
            },
        )
        .await;
        let store = Store::new(proxy.client().await.database(t.db.name()));
        let via_proxy = common::open_accounts(&store).await;
        Fixture {
            t,
            accounts,
            _proxy: proxy,
            store,
            via_proxy,
            fired,
        }
    }

    /// A transfer a → b with a check of e, through the proxy.
    async fn transfer(&self, timeout: Duration) -> Result<mongotx::Outcome, mongotx::TxnError> {
        let txns = Transactions::with_options(
            &self.store,
            TxnOptions::default()
                .finish(mongotx::options::Finish::BeforeReturning)
                .timeout(timeout),
        );
        let tx = txns.begin();
        let repo = &self.via_proxy;
        tx.adjust(repo, "a", 1, &Adjust::new().by("balance", -10_i64))
            .await?;
        tx.adjust(repo, "b", 1, &Adjust::new().by("balance", 10_i64))
            .await?;
        tx.check(repo, "e", 1)?;
        tx.commit().await
    }

    /// Waits until the held-back write has surely been delivered.
    async fn after_the_late_write(&self) {
        assert_eq!(
            self.fired.load(Ordering::SeqCst),
            1,
            "the late write was never sent"
        );
        tokio::time::sleep(LATE + Duration::from_millis(300)).await;
    }

    fn held(&self, doc: &Document) -> bool {
        doc.contains_key(fields::ACTIVE_TXN)
    }

    async fn raw(&self, id: &str) -> Document {
        raw_snapshot(&self.t.db, "accounts")
            .await
            .into_iter()
            .find(|d| d.get_str("_id").ok() == Some(id))
            .unwrap_or_else(|| panic!("{id} is stored"))
    }

    async fn balances(&self) -> Vec<(i64, i64)> {
        let mut out = Vec::new();
        for id in ["a", "b", "e"] {
            let read = self.accounts.get(id).await.expect("read");
            out.push((read.balance, read.version));
        }
        out
    }
}

#[tokio::test]
async fn a_check_delivered_after_its_transaction_committed_does_not_block_anyone() {
    let f = Fixture::new(check_apply).await;
    f.transfer(Duration::from_secs(30))
        .await
        .expect("the transfer commits");
    f.after_the_late_write().await;
    // The late check landed on e (a check does not change the version): a hold without a record.
    assert!(f.held(&f.raw("e").await), "the late check did not land");
    assert!(raw_snapshot(&f.t.db, TRANSACTIONS_COLLECTION)
        .await
        .is_empty());

    // Readers see e as committed; queries too.
    assert_eq!(f.balances().await, vec![(90, 2), (60, 2), (7, 1)]);
    let found = f
        .accounts
        .find(Query::new().filter(bson::doc! { "balance": 7_i64 }))
        .await
        .expect("find");
    assert_eq!(found.len(), 1);
    // A writer is not kept waiting: the hold is undone on the spot.
    let started = Instant::now();
    f.accounts
        .update("e", 1, &Update::new().set("note", "after"))
        .await
        .expect("write e");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    common::assert_settled(&f.t, &["accounts"], "after the late check").await;
}

#[tokio::test]
async fn an_apply_delivered_after_its_transaction_rolled_back_is_swept_in_one_gc_round() {
    let f = Fixture::new(adjust_apply).await;
    // b changes under the transaction, so it rolls back after the applies.
    let txns = common::finishing(&f.store);
    let tx = txns.begin();
    tx.adjust(&f.via_proxy, "a", 1, &Adjust::new().by("balance", -10_i64))
        .await
        .expect("stage");
    tx.adjust(&f.via_proxy, "b", 1, &Adjust::new().by("balance", 10_i64))
        .await
        .expect("stage");
    f.accounts
        .update("b", 1, &Update::new().set("note", "outside"))
        .await
        .expect("outside write");
    let err = tx.commit().await.expect_err("b moved");
    assert!(
        matches!(err.repo_error(), Some(RepoError::VersionConflict { .. })),
        "{err}"
    );
    f.after_the_late_write().await;
    assert!(f.held(&f.raw("a").await), "the late apply did not land");

    // a reads as it was, at its old version, although its stored value is the late apply's.
    assert_eq!(f.balances().await, vec![(100, 1), (50, 2), (7, 1)]);
    let round = Gc::new(&f.t.store, GcOptions::default())
        .run_round()
        .await
        .expect("GC round");
    assert_eq!(round.swept, 1, "{round:?}");
    common::assert_settled(&f.t, &["accounts"], "after the sweep").await;
    assert_eq!(f.balances().await, vec![(100, 1), (50, 2), (7, 1)]);
    assert_eq!(f.raw("a").await.get_i64("balance").ok(), Some(100));
}

#[tokio::test]
async fn a_record_delivered_after_its_transaction_ended_can_never_commit_and_is_collected() {
    let f = Fixture::new(record_insert).await;
    // Long enough for the driver to find the server again and resend the record in time.
    let outcome = f
        .transfer(Duration::from_millis(1_200))
        .await
        .expect("the transfer commits");
    assert!(outcome.finished);
    f.after_the_late_write().await;
    // The first send of the record arrives after the transaction ended. After its deadline the
    // server creates it aborted; before, staging with none of its participants held, which
    // nobody can take for committed and the GC aborts. Either way it never commits.
    let records = raw_snapshot(&f.t.db, TRANSACTIONS_COLLECTION).await;
    assert_eq!(records.len(), 1, "the late record did not land");
    let state = records[0].get_str("state").ok();
    assert!(matches!(state, Some("aborted" | "staging")), "{state:?}");
    assert_eq!(f.balances().await, vec![(90, 2), (60, 2), (7, 1)]);

    tokio::time::sleep(Duration::from_millis(200)).await;
    let round = Gc::new(&f.t.store, GcOptions::default())
        .run_round()
        .await
        .expect("GC round");
    assert_eq!(round.rolled_back, 1, "{round:?}");
    common::assert_settled(&f.t, &["accounts"], "after the GC").await;
    assert_eq!(
        f.balances().await,
        vec![(90, 2), (60, 2), (7, 1)],
        "nothing was undone"
    );
}

#[tokio::test]
async fn a_commit_point_delivered_late_changes_nothing() {
    let f = Fixture::new(commit_point).await;
    f.transfer(Duration::from_secs(30))
        .await
        .expect("the transfer commits");
    f.after_the_late_write().await;
    common::assert_settled(&f.t, &["accounts"], "after the late commit point").await;
    assert_eq!(f.balances().await, vec![(90, 2), (60, 2), (7, 1)]);
}

/// Holds back the first create of a journal entry on the way to the server (a slow link: the
/// coordinator still waits for it) and then its reply, so that the entry is created after its
/// transaction's deadline and the coordinator hears of it only later.
struct SlowCreate {
    fired: Arc<AtomicUsize>,
    hold: Duration,
    reply: Duration,
}

fn journal_create(c: &Document) -> bool {
    command_name(c) == "findAndModify" && c.get_str("findAndModify").ok() == Some("accounts")
}

impl Rules for SlowCreate {
    fn command(&self, command: &mut Document) -> Action {
        if journal_create(command)
            && self
                .fired
                .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            return Action::Delay(self.hold);
        }
        Action::Forward
    }

    fn reply_delay(&self, command: &Document) -> Option<Duration> {
        (journal_create(command) && self.fired.load(Ordering::SeqCst) == 1).then_some(self.reply)
    }
}

/// Issue 46, case 6: an insert created after its transaction's deadline once counted as in place
/// for readers and the GC (only the coordinator looked at the server's creation stamp). A
/// transfer that journals itself: a's apply lands in time, the journal entry's create lands late.
/// Before the coordinator hears back, a reader saw a's new balance (a dirty read) and a GC round
/// committed the transaction; the coordinator then took its late create for a refusal, returned
/// `Expired`, and `run` did the transfer a second time. Every party must now decide from the same
/// stored fact, the creation stamp, and the transfer happen exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_insert_created_after_its_deadline_never_counts_for_anyone() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100)]).await;
    let fired = Arc::new(AtomicUsize::new(0));
    let timeout = Duration::from_millis(1_000);
    let proxy = WireProxy::start(
        &common::server_uri(),
        SlowCreate {
            fired: Arc::clone(&fired),
            hold: timeout + Duration::from_millis(600),
            reply: Duration::from_millis(4_000),
        },
    )
    .await;
    let store = Store::new(proxy.client().await.database(t.db.name()));
    let via_proxy = common::open_accounts(&store).await;
    let attempts = Arc::new(AtomicUsize::new(0));
    let coordinator = {
        let attempts = Arc::clone(&attempts);
        tokio::spawn(async move {
            let txns = Transactions::with_options(&store, TxnOptions::default().timeout(timeout));
            txns.run(|tx| {
                let repo = via_proxy.clone();
                let n = attempts.fetch_add(1, Ordering::SeqCst);
                async move {
                    let a = repo.get("a").await?;
                    tx.adjust(&repo, "a", a.version, &Adjust::new().by("balance", -10_i64))
                        .await?;
                    tx.insert(&repo, &Account::new(&format!("j{n}"), "journal", 10))
                        .await?;
                    Ok(())
                }
            })
            .await
        })
    };
    // The first journal entry lands after the deadline; its reply is still held back.
    let started = Instant::now();
    loop {
        let landed = raw_snapshot(&t.db, "accounts")
            .await
            .iter()
            .any(|d| d.get_str("_id").ok() == Some("j0"));
        if landed {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the held-back create never landed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A reader meanwhile sees a as committed: the transaction cannot commit any more.
    let a = accounts.get("a").await.expect("read a");
    assert_eq!((a.balance, a.version), (100, 1), "a dirty read of a");
    let rich = accounts
        .find(Query::new().filter(bson::doc! { "_id": { "$in": ["a", "j0"] } }))
        .await
        .expect("find");
    assert_eq!(rich.len(), 1, "{rich:?}");
    assert_eq!(rich[0].balance, 100);
    assert!(matches!(
        accounts.get("j0").await,
        Err(RepoError::NotFound { .. })
    ));
    // A GC round aborts it, as the coordinator will.
    let round = Gc::new(&t.store, GcOptions::default())
        .run_round()
        .await
        .expect("GC round");
    assert_eq!(round.finished, 0, "the GC committed it: {round:?}");
    assert_eq!(accounts.get("a").await.expect("a").balance, 100);

    let (_, outcome) = coordinator
        .await
        .expect("coordinator task")
        .expect("the transfer commits on a later attempt");
    assert!(attempts.load(Ordering::SeqCst) >= 2);
    let a = accounts.get("a").await.expect("a");
    assert_eq!(a.balance, 90, "the transfer happened exactly once");
    let journal: Vec<String> = accounts
        .find(Query::new().filter(bson::doc! { "owner": "journal" }))
        .await
        .expect("journal")
        .into_iter()
        .map(|j| j.value.id)
        .collect();
    assert_eq!(journal.len(), 1, "one journal entry: {journal:?}");
    assert_ne!(journal[0], "j0");
    let _ = outcome;
    tokio::time::sleep(Duration::from_millis(300)).await;
    Gc::new(&t.store, GcOptions::default())
        .run_round()
        .await
        .expect("GC round");
    common::assert_settled(&t, &["accounts"], "after the late create").await;
    drop(proxy);
}
