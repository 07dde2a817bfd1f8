//! Cost that does not grow with what is held: a query next to thousands of documents held by
//! crashed transactions returns committed values in a bounded number of commands (counted by the
//! driver's command monitoring), and one GC round clears a thousand expired transactions.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{Account, CrashAt, TestDb};
use bson::{doc, oid::ObjectId};
use futures::StreamExt;
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use mongodb::options::ClientOptions;
use mongodb::Client;
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::TxnOptions;
use mongotx::testkit::failpoint::{self, Failpoint};
use mongotx::{Adjust, Query, Repository, Store, Transactions, TxnError};

/// Commands a client sends while counting is on, by name.
#[derive(Clone, Default)]
struct Counter {
    on: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Counter {
    async fn client(&self) -> Client {
        let mut options = ClientOptions::parse(common::server_uri())
            .await
            .expect("uri");
        let counter = self.clone();
        options.command_event_handler = Some(EventHandler::callback(move |event| {
            if let CommandEvent::Started(started) = event {
                if counter.on.load(Ordering::SeqCst) {
                    if let Ok(mut seen) = counter.seen.lock() {
                        seen.push(started.command_name.clone());
                    }
                }
            }
        }));
        Client::with_options(options).expect("client")
    }

    /// Runs `work` and returns its result with the commands it sent.
    async fn count<T>(&self, work: impl std::future::Future<Output = T>) -> (T, Vec<String>) {
        self.seen.lock().expect("counter").clear();
        self.on.store(true, Ordering::SeqCst);
        let out = work.await;
        self.on.store(false, Ordering::SeqCst);
        let seen = self.seen.lock().expect("counter").clone();
        (out, seen)
    }
}

/// Inserts accounts `a00000`.. with balance = their number and owner `owner(i)`.
async fn seed(accounts: &Repository<Account>, n: usize, owner: impl Fn(usize) -> String) {
    let owners: Vec<String> = (0..n).map(owner).collect();
    futures::stream::iter(owners.iter().enumerate())
        .for_each_concurrent(32, |(i, owner)| async move {
            accounts
                .insert(&Account::new(&format!("a{i:05}"), owner, i as i64))
                .await
                .unwrap_or_else(|e| panic!("seed a{i:05}: {e}"));
        })
        .await;
}

/// Adjusts the balance of every account of `ids` (all at version 1) by `by`, and inserts the
/// accounts `new` (which come last in lock order), in one transaction whose coordinator dies at
/// `at`, with `timeout`; returns the transaction's id.
async fn crashed(
    store: &Store,
    accounts: &Repository<Account>,
    (ids, new): (&[String], &[&str]),
    by: i64,
    at: Failpoint,
    timeout: Duration,
) -> ObjectId {
    let txns = Transactions::with_options(
        store,
        TxnOptions::default()
            .timeout(timeout)
            .finish(mongotx::options::Finish::BeforeReturning)
            .fault_injector(Arc::new(CrashAt(at))),
    );
    let tx = txns.begin();
    for id in ids {
        tx.adjust(accounts, id.as_str(), 1, &Adjust::new().by("balance", by))
            .await
            .expect("stage");
    }
    for id in new {
        tx.insert(accounts, &Account::new(id, "new", 0))
            .await
            .expect("stage");
    }
    match tx.commit().await {
        Err(TxnError::Crashed { txn: Some(t), .. }) => t,
        other => panic!("the coordinator should stop at {at:?}, got {other:?}"),
    }
}

fn ids(range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("a{i:05}")).collect()
}

async fn held_count(t: &TestDb) -> u64 {
    t.db.collection::<bson::Document>("accounts")
        .count_documents(doc! { "_txn": { "$exists": true } })
        .await
        .expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_query_next_to_five_thousand_held_documents_reads_committed_values_in_a_few_commands() {
    let t = TestDb::new().await;
    let counter = Counter::default();
    let store = Store::builder(counter.client().await.database(t.db.name())).build();
    let accounts = common::open_accounts(&store).await;
    seed(&accounts, 10_000, |i| match i {
        0..10 => "target".to_string(),
        10..5_000 => format!("crowd{}", i % 97),
        _ => format!("held{}", i % 97),
    })
    .await;

    // Fifty transactions of 101 documents each die before their last apply (and so before their
    // record went out): 5,000 documents (a05000..a09999) held with a change of a million that
    // is not committed.
    let hour = Duration::from_secs(3600);
    let last_apply = Failpoint {
        name: failpoint::APPLY_BEFORE,
        step: 100,
    };
    for chunk in 0..50 {
        let start = 5_000 + chunk * 100;
        // The 101st participant is a new account, last in lock order; its apply never goes out.
        let new = format!("z{chunk:02}");
        let held = ids(start..start + 100);
        crashed(
            &store,
            &accounts,
            (&held, &[&new]),
            1_000_000,
            last_apply,
            hour,
        )
        .await;
    }
    // Three of the targets are held too: a00001 by a transaction that died after its first
    // apply, a00002 by one that committed (every apply landed) and died before its commit point,
    // a00003 by a pending one (its record staging, a participant missing, for an hour).
    crashed(
        &store,
        &accounts,
        (
            &ids(1..2)
                .into_iter()
                .chain(ids(4_000..4_001))
                .collect::<Vec<_>>(),
            &[],
        ),
        1_000_000,
        Failpoint {
            name: failpoint::APPLY_BEFORE,
            step: 1,
        },
        hour,
    )
    .await;
    crashed(
        &store,
        &accounts,
        (&ids(2..3), &[]),
        2_000_000,
        Failpoint {
            name: failpoint::COMMIT_BEFORE,
            step: 0,
        },
        hour,
    )
    .await;
    let pending = ObjectId::new();
    common::put_record(&t.db, pending, "staging", common::hours_from_now(1)).await;
    common::put_hold(
        &t.db,
        "accounts",
        "a00003",
        pending,
        doc! { "balance": 1_000_003_i64, "_version": 2_i64 },
        common::hold_of(
            "update",
            common::hours_from_now(1),
            doc! { "balance": 3_i64, "_version": 1_i64 },
            &[],
        ),
    )
    .await;
    assert_eq!(held_count(&t).await, 5_003, "the holds are in place");

    // The targets: committed values, in one command per pass and one per batch of outcomes.
    let (found, sent) = counter
        .count(accounts.find(Query::new().filter(doc! { "owner": "target" })))
        .await;
    let found = found.expect("find next to 5,000 held documents");
    let balances: HashMap<String, i64> = found
        .iter()
        .map(|a| (a.value.id.clone(), a.value.balance))
        .collect();
    assert_eq!(balances.len(), 10, "every target, once: {balances:?}");
    assert_eq!(balances["a00001"], 1, "a pending change is not seen");
    assert_eq!(balances["a00002"], 2_000_002, "a committed change is seen");
    assert_eq!(balances["a00003"], 3);
    println!("find(owner = target) next to 5,003 held: {sent:?}");
    // The first pass, the records, the participants (of two staging ones, in one collection
    // and the phantoms'), the record of the one that is incomplete read again, the second pass.
    assert!(sent.len() <= 6, "{} commands: {sent:?}", sent.len());

    // A filter no held document can match: one command.
    let (found, sent) = counter
        .count(accounts.find(Query::new().filter(doc! { "owner": "crowd5" })))
        .await;
    assert!(!found.expect("find crowd5").is_empty());
    println!("find(owner = crowd5): {sent:?}");
    assert_eq!(sent, vec!["aggregate".to_string()]);

    // Every document is a candidate: the highest balances, under a limit, still committed.
    let (found, sent) = counter
        .count(accounts.find(Query::new().sort(doc! { "balance": -1, "_id": 1 }).limit(5)))
        .await;
    let top: Vec<(String, i64)> = found
        .expect("find the top five next to 5,003 held")
        .into_iter()
        .map(|a| (a.value.id, a.value.balance))
        .collect();
    assert_eq!(
        top,
        vec![
            ("a00002".to_string(), 2_000_002),
            ("a09999".to_string(), 9_999),
            ("a09998".to_string(), 9_998),
            ("a09997".to_string(), 9_997),
            ("a09996".to_string(), 9_996),
        ]
    );
    println!(
        "find(sort balance desc, limit 5) over 5,003 held: {} commands: {sent:?}",
        sent.len()
    );
    // Two first passes (the first is filled with held candidates), the outcomes of the 53
    // holders (records, participants in two collections, the incomplete one's record again),
    // the second pass.
    assert!(sent.len() <= 7, "{} commands: {sent:?}", sent.len());
    assert_eq!(held_count(&t).await, 5_003, "reading wrote nothing");
}

/// `n` transactions of four accounts each (accounts `g{i}-{j}`, balance 100), committed by
/// their applies and left by coordinators that died around the commit point, with a deadline
/// of `timeout`.
async fn committed_and_left(
    store: &Store,
    accounts: &Repository<Account>,
    n: usize,
    timeout: Duration,
) {
    futures::stream::iter(0..n)
        .for_each_concurrent(16, |i| async move {
            let ids: Vec<String> = (0..4).map(|j| format!("g{i:04}-{j}")).collect();
            for id in &ids {
                accounts
                    .insert(&Account::new(id, "gc", 100))
                    .await
                    .expect("seed");
            }
            // Half before the commit point (staging, every apply in place), half after it.
            let at = if i % 2 == 0 {
                failpoint::COMMIT_BEFORE
            } else {
                failpoint::COMMIT_AFTER
            };
            let at = Failpoint { name: at, step: 0 };
            crashed(store, accounts, (&ids, &[]), 1, at, timeout).await;
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_gc_round_clears_a_thousand_expired_transactions() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    let timeout = Duration::from_secs(3);
    committed_and_left(&t.store, &accounts, 1_000, timeout).await;
    // And 200 that can never commit: staging, a participant never applied, deadline passed.
    for i in 0..200 {
        let id = format!("p{i:03}");
        accounts
            .insert(&Account::new(&id, "gc", 100))
            .await
            .expect("seed");
        let txn = ObjectId::new();
        let past = common::millis_from_now(-1_000);
        common::put_record(&t.db, txn, "staging", past).await;
        common::put_hold(
            &t.db,
            "accounts",
            id.as_str(),
            txn,
            doc! { "balance": 1_000_100_i64, "_version": 2_i64 },
            common::hold_of(
                "update",
                past,
                doc! { "balance": 100_i64, "_version": 1_i64 },
                &[],
            ),
        )
        .await;
    }
    tokio::time::sleep(timeout + Duration::from_millis(500)).await;

    let gc = Gc::new(&t.store, GcOptions::default());
    let started = std::time::Instant::now();
    let summary = gc.run_round().await.expect("round");
    let took = started.elapsed();
    println!(
        "one GC round: {summary:?} in {took:?} ({:.0} transactions/s)",
        1_200.0 / took.as_secs_f64()
    );
    assert_eq!(summary.finished, 1_000, "{summary:?}");
    assert_eq!(summary.rolled_back, 200, "{summary:?}");
    assert_eq!(summary.skipped, 0, "{summary:?}");
    assert_eq!(held_count(&t).await, 0, "no hold left");
    // The hand-made records do not list the accounts they hold, so the same round's sweep undid
    // those holds as orphans and left an aborted record in place of each missing one (deadline
    // passed): the next round takes those.
    assert_eq!(summary.swept, 200, "{summary:?}");
    let next = gc.run_round().await.expect("next round");
    assert_eq!(next.rolled_back, 200, "{next:?}");
    let records =
        t.db.collection::<bson::Document>(mongotx::collections::TRANSACTIONS_COLLECTION)
            .count_documents(doc! {})
            .await
            .expect("count records");
    assert_eq!(records, 0, "no record left");
    // Every committed transfer is there once, every other one is not.
    let all = accounts
        .find(Query::new().filter(doc! { "owner": "gc" }))
        .await
        .expect("find");
    assert_eq!(all.len(), 4_200);
    for account in all {
        let expected = if account.value.id.starts_with('g') {
            101
        } else {
            100
        };
        assert_eq!(account.value.balance, expected, "{}", account.value.id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_gc_round_next_to_five_thousand_pending_holds_costs_a_few_commands() {
    let t = TestDb::new().await;
    let counter = Counter::default();
    let store = Store::builder(counter.client().await.database(t.db.name())).build();
    let accounts = common::open_accounts(&store).await;
    seed(&accounts, 5_000, |_| "idle".to_string()).await;
    // One pending transaction (staging for an hour, a participant missing) holds all of them.
    let pending = ObjectId::new();
    let hour = common::hours_from_now(1);
    common::put_record(&t.db, pending, "staging", hour).await;
    let held =
        t.db.collection::<bson::Document>("accounts")
            .update_many(
                doc! { "owner": "idle" },
                doc! { "$set": {
                    "_txn": pending,
                    "_hold": common::hold_of("check", hour, doc! {}, &[]),
                } },
            )
            .await
            .expect("hold");
    assert_eq!(held.modified_count, 5_000);

    let gc = Gc::new(&store, GcOptions::default());
    gc.run_round()
        .await
        .expect("a first round (opens what it needs)");
    let (summary, sent) = counter.count(gc.run_round()).await;
    let summary = summary.expect("round");
    println!(
        "an idle round next to 5,000 pending holds: {} commands: {sent:?}",
        sent.len()
    );
    assert_eq!(summary, mongotx::gc::RoundSummary::default());
    assert!(sent.len() <= 10, "{} commands: {sent:?}", sent.len());
    assert_eq!(held_count(&t).await, 5_000, "the pending holds stay");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gc_runners_share_a_backlog_without_doing_each_others_work() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    let timeout = Duration::from_secs(3);
    committed_and_left(&t.store, &accounts, 600, timeout).await;
    tokio::time::sleep(timeout + Duration::from_millis(500)).await;
    // Three runners, each its own client, at once.
    let mut runners = Vec::new();
    for _ in 0..3 {
        let db = t.other_client_db().await;
        let store = Store::builder(db).build();
        runners.push(tokio::spawn(async move {
            Gc::new(&store, GcOptions::default().batch_size(50))
                .run_round()
                .await
        }));
    }
    let mut finished = Vec::new();
    for runner in runners {
        finished.push(runner.await.expect("join").expect("round").finished);
    }
    println!("three runners finished {finished:?}");
    assert_eq!(
        finished.iter().sum::<usize>(),
        600,
        "every transaction finished by exactly one runner: {finished:?}"
    );
    assert_eq!(held_count(&t).await, 0);
}
