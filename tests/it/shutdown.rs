//! `Store::shutdown`: a service stopping for a deploy waits (bounded) for the background finishes
//! of what it committed with `Finish::InBackground`, and leaves no hold behind without killing
//! anything; after it, commits finish before returning.
//!
//! The store under test talks to the server through a wire proxy that holds every reply to a
//! write for a while, so that the background finishes (the commit point, the freeing of each
//! document, the end) are certainly still running when the commits have returned.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::Document;
use mongotx::{fields, Adjust, Repository, Store, Transactions};

use crate::common::wire_proxy::{command_name, Rules, WireProxy};
use crate::common::{self, raw_snapshot, Account, TestDb};

const ACCOUNTS: usize = 16;

/// Holds the reply to every write for `delay` while `on`.
struct SlowWrites {
    on: Arc<AtomicBool>,
    delay: Duration,
}

impl Rules for SlowWrites {
    fn reply_delay(&self, command: &Document) -> Option<Duration> {
        let write = matches!(
            command_name(command),
            "insert" | "update" | "delete" | "findAndModify" | "bulkWrite"
        );
        (write && self.on.load(Ordering::SeqCst)).then_some(self.delay)
    }
}

/// `ACCOUNTS` seeded accounts, and a store on them through a proxy whose writes turn slow once
/// the returned switch is set.
async fn slow_store(t: &TestDb, delay: Duration) -> (WireProxy, Store, Arc<AtomicBool>) {
    let direct = common::open_accounts(&t.store).await;
    let seeds: Vec<(String, i64)> = (0..ACCOUNTS).map(|i| (format!("a{i}"), 100)).collect();
    let seeds: Vec<(&str, i64)> = seeds.iter().map(|(id, b)| (id.as_str(), *b)).collect();
    common::seed_accounts(&direct, &seeds).await;
    let on = Arc::new(AtomicBool::new(false));
    let rules = SlowWrites {
        on: Arc::clone(&on),
        delay,
    };
    let proxy = WireProxy::start(&common::server_uri(), rules).await;
    let store = Store::new(proxy.client().await.database(t.db.name()));
    (proxy, store, on)
}

/// Commits one adjustment of each account, concurrently, with the default finishing (in the
/// background); each returns before its documents are freed.
async fn commit_each(store: &Store, accounts: &Repository<Account>) {
    let txns = Transactions::new(store);
    let commits = (0..ACCOUNTS).map(|i| {
        let (txns, accounts) = (txns.clone(), accounts.clone());
        tokio::spawn(async move {
            let tx = txns.begin();
            tx.adjust(
                &accounts,
                &format!("a{i}"),
                1,
                &Adjust::new().by("balance", -1_i64),
            )
            .await
            .expect("stage");
            tx.commit().await.expect("commit")
        })
    });
    for outcome in futures::future::join_all(commits).await {
        let outcome = outcome.expect("commit task");
        assert!(
            !outcome.finished,
            "a commit with Finish::InBackground should return before finishing: {outcome:?}"
        );
    }
}

/// The accounts a raw reader finds held, and the transaction records left.
async fn left_behind(t: &TestDb) -> (Vec<Document>, Vec<Document>) {
    let held = raw_snapshot(&t.db, "accounts")
        .await
        .into_iter()
        .filter(|d| d.contains_key(fields::ACTIVE_TXN) || d.contains_key(fields::HOLD))
        .collect();
    let records = raw_snapshot(&t.db, t.store.transactions_collection()).await;
    (held, records)
}

#[tokio::test]
async fn shutdown_waits_for_every_background_finish_and_leaves_no_hold() {
    let t = TestDb::new().await;
    let (_proxy, store, slow) = slow_store(&t, Duration::from_millis(300)).await;
    let accounts = common::open_accounts(&store).await;
    slow.store(true, Ordering::SeqCst);
    commit_each(&store, &accounts).await;

    // What a process exiting now would leave: the finishes are still running (each waits 300 ms
    // for its commit point alone).
    let (held, _) = left_behind(&t).await;
    assert!(
        !held.is_empty(),
        "the background finishes should still be running right after the commits"
    );

    let report = store.shutdown(Duration::from_secs(60)).await;
    assert_eq!(report.finished, ACCOUNTS, "{report:?}");
    assert_eq!(report.unfinished, 0, "{report:?}");
    // Read at once, with no waiting: shutdown returned only after every finish ended.
    let (held, records) = left_behind(&t).await;
    assert!(
        held.is_empty(),
        "accounts still held after shutdown: {held:?}"
    );
    assert!(
        records.is_empty(),
        "records left after shutdown: {records:?}"
    );
    for d in raw_snapshot(&t.db, "accounts").await {
        assert_eq!(d.get_i64("balance").ok(), Some(99), "{d}");
    }
}

#[tokio::test]
async fn shutdown_waits_no_longer_than_its_limit_and_a_second_call_waits_for_the_rest() {
    let t = TestDb::new().await;
    let (_proxy, store, slow) = slow_store(&t, Duration::from_millis(1_500)).await;
    let accounts = common::open_accounts(&store).await;
    slow.store(true, Ordering::SeqCst);
    commit_each(&store, &accounts).await;

    let started = Instant::now();
    let report = store.shutdown(Duration::from_millis(100)).await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(1_000),
        "shutdown took {took:?}"
    );
    assert_eq!(report.finished, 0, "{report:?}");
    assert_eq!(report.unfinished, ACCOUNTS, "{report:?}");

    let report = store.shutdown(Duration::from_secs(60)).await;
    assert_eq!(report.finished, ACCOUNTS, "{report:?}");
    assert_eq!(report.unfinished, 0, "{report:?}");
    let (held, records) = left_behind(&t).await;
    assert!(
        held.is_empty() && records.is_empty(),
        "{held:?} {records:?}"
    );
}

#[tokio::test]
async fn after_shutdown_every_clone_commits_and_finishes_before_returning() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 10), ("b", 10)]).await;
    let clone = t.store.clone();
    let report = t.store.shutdown(Duration::from_secs(5)).await;
    assert_eq!((report.finished, report.unfinished), (0, 0), "{report:?}");

    let txns = Transactions::new(&clone);
    let tx = txns.begin();
    tx.adjust(&accounts, "a", 1, &Adjust::new().by("balance", -3_i64))
        .await
        .expect("stage a");
    tx.adjust(&accounts, "b", 1, &Adjust::new().by("balance", 3_i64))
        .await
        .expect("stage b");
    let outcome = tx.commit().await.expect("commit after shutdown");
    assert!(outcome.finished, "{outcome:?}");
    let (held, records) = left_behind(&t).await;
    assert!(
        held.is_empty() && records.is_empty(),
        "{held:?} {records:?}"
    );
    assert_eq!(accounts.get("a").await.expect("a").value.balance, 7);
    assert_eq!(accounts.get("b").await.expect("b").value.balance, 13);
}
