//! The batch queue's parallel strategy: declared keys, the strategy chosen per service before
//! its first batch, batches that do not conflict in flight together, conflicting ones in order
//! (the older final at the ledger before the younger is sent) through unknown, delayed and
//! invalid answers and lost replies, with many submitters and monitors, and a property over
//! random declarations and ledger answers. The ledger simulator is told each batch's place and
//! keys, and records any send that breaks the rule.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::TestDb;
use bson::{doc, Document};
use mongotx::collections::BATCHES_COLLECTION;
use mongotx::queue::{
    conflicts, Batch, BatchStatus, Batches, Keys, Monitor, NewBatch, QueueError,
    Strategy as QueueStrategy, Submission, Submitter, MAX_KEYS,
};
use mongotx::testkit::ledger::{Fate, Faults, Ledger, LedgerStatus};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const TTL: Duration = Duration::from_secs(10);

/// Switches the test's database to stored format 2, the one that keeps keys and strategies
/// (every live instance is of this release).
pub(crate) async fn format_two(t: &TestDb) {
    t.store.set_format(2).await.expect("switch to format 2");
}

async fn parallel(t: &TestDb, services: &[&str]) -> Batches {
    format_two(t).await;
    let batches = Batches::with_collection(&t.store, "batches", Duration::from_millis(50))
        .await
        .unwrap();
    for s in services {
        batches
            .set_strategy(s, QueueStrategy::Parallel)
            .await
            .unwrap();
    }
    batches
}

fn keyed(service: &str, header: &str, reads: &[&str], writes: &[&str]) -> NewBatch {
    NewBatch::new(service, header, header).with_keys(reads.to_vec(), writes.to_vec())
}

#[tokio::test]
async fn declared_keys_are_stored_and_bad_declarations_are_refused_without_writing() {
    let t = TestDb::new().await;
    let batches = parallel(&t, &["s"]).await;
    let added = batches
        .add(&keyed("s", "h1", &["b", "a", "a"], &["c"]))
        .await
        .unwrap();
    assert_eq!(
        added.keys,
        Some(Keys::new(["a", "b"], ["c"])),
        "sorted, no repeats"
    );
    assert_eq!(added.strategy, QueueStrategy::Parallel);
    assert_eq!(batches.get("h1").await.unwrap(), added);
    let plain = batches.add(&NewBatch::new("s", "h2", "x")).await.unwrap();
    assert_eq!(plain.keys, None);
    let before = common::raw_snapshot(&t.db, BATCHES_COLLECTION).await;
    // The same header with other keys is another batch.
    let err = batches
        .add(&keyed("s", "h1", &["a"], &["c"]))
        .await
        .unwrap_err();
    assert!(matches!(err, QueueError::HeaderReused { .. }), "{err}");
    let many: Vec<String> = (0..=MAX_KEYS).map(|i| format!("k{i}")).collect();
    for bad in [
        keyed("s", "h3", &[""], &[]),
        keyed("s", "h3", &[], &["a\0b"]),
        NewBatch::new("s", "h3", "x").with_keys(Vec::<String>::new(), many.clone()),
        NewBatch::new("s", "h3", "x").with_keys(many, Vec::<String>::new()),
    ] {
        let err = batches.add(&bad).await.unwrap_err();
        assert!(matches!(err, QueueError::InvalidBatch { .. }), "{err}");
        assert!(err.to_string().contains("key"), "{err}");
    }
    let after = common::raw_snapshot(&t.db, BATCHES_COLLECTION).await;
    assert_eq!(after, before, "nothing written by a refusal");
    crate::queue::assert_schema_kept(&after);
}

#[tokio::test]
async fn keys_and_the_parallel_strategy_wait_for_the_format_that_stores_them() {
    let t = TestDb::new().await;
    let batches = Batches::with_collection(&t.store, "batches", Duration::from_millis(50))
        .await
        .unwrap();
    let stored = || async {
        (
            common::raw_snapshot(&t.db, BATCHES_COLLECTION).await,
            common::raw_snapshot(&t.db, "batches_services").await,
        )
    };
    let before = stored().await;
    let err = batches
        .set_strategy("p", QueueStrategy::Parallel)
        .await
        .unwrap_err();
    assert!(matches!(err, QueueError::Invalid { .. }), "{err}");
    assert!(err.to_string().contains("format set 2"), "{err}");
    let err = batches
        .add(&keyed("p", "h1", &["a"], &[]))
        .await
        .unwrap_err();
    assert!(matches!(err, QueueError::Invalid { .. }), "{err}");
    assert!(err.to_string().contains("format 2"), "{err}");
    assert_eq!(stored().await, before, "nothing written");
    // Serial services and batches without keys are as before.
    batches
        .set_strategy("s", QueueStrategy::Serial)
        .await
        .unwrap();
    batches.add(&NewBatch::new("s", "s1", "x")).await.unwrap();
    format_two(&t).await;
    batches
        .set_strategy("p", QueueStrategy::Parallel)
        .await
        .unwrap();
    let added = batches.add(&keyed("p", "h1", &["a"], &[])).await.unwrap();
    assert_eq!(added.strategy, QueueStrategy::Parallel);
    // Switched back to format 1, a parallel service takes no new batch.
    t.store.set_format(1).await.expect("back to 1");
    let err = batches
        .add(&NewBatch::new("p", "h2", "x"))
        .await
        .unwrap_err();
    assert!(matches!(err, QueueError::Invalid { .. }), "{err}");
    assert!(
        matches!(
            batches.get("h2").await,
            Err(QueueError::UnknownBatch { .. })
        ),
        "not added"
    );
}

#[tokio::test]
async fn a_service_chooses_its_strategy_before_its_first_batch() {
    let t = TestDb::new().await;
    let batches = parallel(&t, &["p"]).await;
    batches
        .set_strategy("p", QueueStrategy::Serial)
        .await
        .unwrap();
    batches
        .set_strategy("p", QueueStrategy::Parallel)
        .await
        .unwrap();
    let b = batches.add(&NewBatch::new("p", "p1", "x")).await.unwrap();
    assert_eq!(b.strategy, QueueStrategy::Parallel);
    batches
        .set_strategy("p", QueueStrategy::Parallel)
        .await
        .unwrap();
    let s = batches.add(&NewBatch::new("s", "s1", "x")).await.unwrap();
    assert_eq!(s.strategy, QueueStrategy::Serial, "serial unless chosen");
    let services = t.db.collection::<Document>("batches_services");
    let before = common::raw_snapshot(&t.db, "batches_services").await;
    for (service, strategy) in [("p", QueueStrategy::Serial), ("s", QueueStrategy::Parallel)] {
        let err = batches.set_strategy(service, strategy).await.unwrap_err();
        assert!(matches!(err, QueueError::Invalid { .. }), "{err}");
        assert!(err.to_string().contains("before its first batch"), "{err}");
    }
    let err = batches
        .set_strategy("", QueueStrategy::Parallel)
        .await
        .unwrap_err();
    assert!(matches!(err, QueueError::Invalid { .. }), "{err}");
    assert_eq!(
        common::raw_snapshot(&t.db, "batches_services").await,
        before
    );
    let p = services
        .find_one(doc! { "_id": "p" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.get_str("strategy"), Ok("parallel"));
}

/// Claims `header` (as a round would hand it out).
async fn take(batches: &Batches, header: &str) -> Option<mongotx::queue::Claim> {
    let b = batches.get(header).await.unwrap();
    batches.claim(&b, "t", TTL).await.unwrap()
}

fn headers(batches: &[Batch]) -> Vec<&str> {
    batches.iter().map(|b| b.header.as_str()).collect()
}

#[tokio::test]
async fn batches_that_do_not_conflict_go_together_and_conflicting_ones_wait_for_the_older() {
    let t = TestDb::new().await;
    let batches = parallel(&t, &["s"]).await;
    batches.add(&keyed("s", "a", &[], &["x"])).await.unwrap();
    batches.add(&keyed("s", "b", &[], &["y"])).await.unwrap();
    batches.add(&keyed("s", "c", &["x"], &["z"])).await.unwrap();
    batches.add(&keyed("s", "d", &["y"], &[])).await.unwrap();
    batches
        .add(&keyed("s", "e", &["z", "q"], &[]))
        .await
        .unwrap();
    batches.add(&NewBatch::new("s", "f", "f")).await.unwrap();
    assert_eq!(
        headers(&batches.round().await.unwrap()),
        ["a", "b"],
        "c reads what a writes, d what b writes, e what c writes, f declares nothing"
    );
    let a = take(&batches, "a").await.expect("a");
    let b = take(&batches, "b").await.expect("b goes beside a");
    assert!(take(&batches, "c").await.is_none(), "a is in flight");
    assert!(take(&batches, "f").await.is_none(), "f conflicts with all");
    batches.record(&a, Submission::Accepted).await.unwrap();
    batches.record(&b, Submission::Accepted).await.unwrap();
    // Valid is not final: the ledger may still forget it.
    let a_now = batches.get("a").await.unwrap();
    batches
        .record_status(&a_now, BatchStatus::Valid)
        .await
        .unwrap();
    assert!(take(&batches, "c").await.is_none(), "a is only valid");
    let a_now = batches.get("a").await.unwrap();
    batches
        .record_status(&a_now, BatchStatus::Committed)
        .await
        .unwrap();
    // b invalid: final too.
    let b_now = batches.get("b").await.unwrap();
    batches
        .record_status(&b_now, BatchStatus::Invalid)
        .await
        .unwrap();
    assert_eq!(headers(&batches.round().await.unwrap()), ["c", "d"]);
    let c = take(&batches, "c").await.expect("a is committed");
    let d = take(&batches, "d").await.expect("b is invalid");
    assert!(take(&batches, "e").await.is_none(), "c writes what e reads");
    batches.record(&c, Submission::Delayed).await.unwrap();
    batches.record(&d, Submission::Accepted).await.unwrap();
    // Delayed: c is not at the ledger, and e still waits for it.
    assert!(take(&batches, "e").await.is_none(), "c was delayed");
    assert_eq!(
        headers(&batches.round().await.unwrap()),
        Vec::<&str>::new(),
        "c waits out its window"
    );
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(headers(&batches.round().await.unwrap()), ["c"]);
    let c = take(&batches, "c").await.expect("c again");
    batches.record(&c, Submission::Accepted).await.unwrap();
    // Unknown (the ledger forgot it): e still waits, and c goes again.
    let c_now = batches.get("c").await.unwrap();
    batches
        .record_status(&c_now, BatchStatus::Unknown)
        .await
        .unwrap();
    assert!(take(&batches, "e").await.is_none(), "c is unknown");
    let c = take(&batches, "c").await.expect("c again after unknown");
    batches.record(&c, Submission::Accepted).await.unwrap();
    let c_now = batches.get("c").await.unwrap();
    batches
        .record_status(&c_now, BatchStatus::Committed)
        .await
        .unwrap();
    assert!(take(&batches, "e").await.is_some(), "c is committed");
    assert!(take(&batches, "f").await.is_none(), "d and e are in flight");
}

/// As in the serial queue: an add that finds its batch stored and never sent (the first add died
/// between its insert and its check, while a younger conflicting batch went) does the check
/// itself, and returns the batch's final place, after the one that went and before a
/// conflicting batch added after it returned. So does one that finds its batch recorded unknown
/// but never marked sent (a claimant took it and died before it was clear to send; a monitor
/// then found the ledger without it): a claimant would otherwise stamp it again later.
#[tokio::test]
async fn adding_again_a_batch_whose_adder_died_places_it_after_the_conflicting_batch_that_went() {
    let t = TestDb::new().await;
    let batches = parallel(&t, &["s"]).await;
    let went = batches.add(&keyed("s", "went", &[], &["k"])).await.unwrap();
    let claim = take(&batches, "went").await.expect("went");
    batches.record(&claim, Submission::Accepted).await.unwrap();
    // The dead adds' inserts, with the stamps they drew before "went" drew its own.
    for (header, ago, status) in [("late", 2_000, None), ("lost", 1_000, Some("unknown"))] {
        let old = bson::DateTime::from_millis(went.created_at.timestamp_millis() - ago);
        let mut stored = doc! {
            "_id": header, "service_id": "s", "content": header,
            "created_at": old, "submitted": false, "strategy": "parallel",
            "keys": { "reads": ["k"], "writes": [] }, "_format": 2_i64,
        };
        if let Some(status) = status {
            stored.insert("status", status);
        }
        t.db.collection::<Document>("batches")
            .insert_one(stored)
            .await
            .unwrap();
    }
    let mut placed = Vec::new();
    for header in ["late", "lost"] {
        let b = batches.add(&keyed("s", header, &["k"], &[])).await.unwrap();
        assert!(
            b.created_at > went.created_at,
            "{header} placed after the batch that went: {} <= {}",
            b.created_at,
            went.created_at
        );
        assert_eq!(b.status, None, "{header}: a new batch in its new place");
        assert_eq!(batches.get(header).await.unwrap(), b, "as stored");
        placed.push(b);
    }
    let after = batches
        .add(&keyed("s", "after", &[], &["k"]))
        .await
        .unwrap();
    assert!(after.created_at > placed[1].created_at);
    let went_now = batches.get("went").await.unwrap();
    batches
        .record_status(&went_now, BatchStatus::Committed)
        .await
        .unwrap();
    assert_eq!(headers(&batches.round().await.unwrap()), ["late", "lost"]);
    assert!(
        take(&batches, "after").await.is_none(),
        "late and lost are older"
    );
    for b in &placed {
        assert!(take(&batches, &b.header).await.is_some());
        let now = batches.get(&b.header).await.unwrap();
        assert_eq!(now.created_at, b.created_at, "never stamped again");
    }
}

#[tokio::test]
async fn a_claim_that_names_another_strategy_than_the_stored_batch_takes_nothing() {
    let t = TestDb::new().await;
    let batches = parallel(&t, &["p"]).await;
    batches.add(&keyed("p", "p1", &[], &["x"])).await.unwrap();
    batches.add(&NewBatch::new("s", "s1", "x")).await.unwrap();
    let before = common::raw_snapshot(&t.db, BATCHES_COLLECTION).await;
    let mut p1 = batches.get("p1").await.unwrap();
    p1.strategy = QueueStrategy::Serial;
    assert!(batches.claim(&p1, "t", TTL).await.unwrap().is_none());
    let mut s1 = batches.get("s1").await.unwrap();
    s1.strategy = QueueStrategy::Parallel;
    assert!(batches.claim(&s1, "t", TTL).await.unwrap().is_none());
    assert_eq!(
        common::raw_snapshot(&t.db, BATCHES_COLLECTION).await,
        before,
        "nothing taken"
    );
}

/// Checks that the ledger committed every valid batch once, and each service's conflicting
/// batches in the order of their stamps.
pub(crate) fn check_order(ledger: &Ledger, added: &[Batch], invalid: &[String]) {
    assert!(ledger.breaches().is_empty(), "{:?}", ledger.breaches());
    let committed = ledger.committed();
    let mut at: BTreeMap<&str, usize> = BTreeMap::new();
    for list in committed.values() {
        for (i, h) in list.iter().enumerate() {
            assert!(at.insert(h.as_str(), i).is_none(), "{h} committed twice");
        }
    }
    for b in added {
        if !invalid.contains(&b.header) {
            assert!(
                at.contains_key(b.header.as_str()),
                "{} not committed",
                b.header
            );
        }
    }
    for x in added {
        for y in added {
            let older = (x.created_at, &x.header) < (y.created_at, &y.header);
            if x.service_id != y.service_id
                || !older
                || !conflicts(x.keys.as_ref(), y.keys.as_ref())
            {
                continue;
            }
            if let (Some(i), Some(j)) = (at.get(x.header.as_str()), at.get(y.header.as_str())) {
                assert!(
                    i < j,
                    "{} committed after the younger {} it conflicts with",
                    x.header,
                    y.header
                );
            }
        }
    }
}

/// The stored headers found invalid.
async fn invalid_of(t: &TestDb) -> Vec<String> {
    common::raw_snapshot(&t.db, BATCHES_COLLECTION)
        .await
        .into_iter()
        .filter(|d| d.get_str("status") == Ok("invalid"))
        .map(|d| d.get_str("_id").unwrap().to_string())
        .collect()
}

/// Waits for every batch of the collection to be committed or invalid.
async fn settled(t: &TestDb, limit: Duration) {
    let started = std::time::Instant::now();
    loop {
        let open =
            t.db.collection::<Document>(BATCHES_COLLECTION)
                .count_documents(doc! { "status": { "$nin": ["committed", "invalid"] } })
                .await
                .unwrap();
        if open == 0 {
            return;
        }
        assert!(started.elapsed() < limit, "{open} batches still open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submitters_and_monitors_keep_every_conflict_chain_in_order_under_faults() {
    let t = TestDb::new().await;
    let batches = parallel(&t, &["s1", "s2"]).await;
    let faults = Faults {
        invalid: 0.05,
        unknown: 0.05,
        delayed: 0.05,
        lost: 0.05,
    };
    let ledger = Ledger::new(Duration::from_millis(5), faults, 23);
    let stop = Arc::new(AtomicBool::new(false));
    let ran_out = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks = crate::queue::crew(&batches, &ledger, &stop, &ran_out);
    // Adds while they run: keys from a small set, so chains form and cross.
    let keys = ["k0", "k1", "k2", "k3", "k4", "k5"];
    let adders: Vec<_> = ["s1", "s2"]
        .into_iter()
        .map(|s| {
            let (batches, ledger) = (batches.clone(), ledger.clone());
            tokio::spawn(async move {
                let mut added = Vec::new();
                for i in 0..40 {
                    let h = format!("{s}-{i:03}");
                    let pick = |n: u64| keys[usize::try_from(n % 6).unwrap()];
                    let r = rand::random::<u64>();
                    let batch = match r % 8 {
                        0 => NewBatch::new(s, &h, &h),
                        1 => NewBatch::new(s, &h, &h).with_keys([pick(r >> 3)], Vec::<&str>::new()),
                        _ => NewBatch::new(s, &h, &h).with_keys([pick(r >> 3)], [pick(r >> 9)]),
                    };
                    let b = batches.add(&batch).await.unwrap();
                    ledger.declare(&b);
                    added.push(b);
                }
                added
            })
        })
        .collect();
    let mut added = Vec::new();
    for adder in adders {
        added.extend(adder.await.unwrap());
    }
    settled(&t, Duration::from_secs(120)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    let invalid = invalid_of(&t).await;
    assert!(!invalid.is_empty(), "the ledger found some batches invalid");
    check_order(&ledger, &added, &invalid);
    println!(
        "{} submissions for {} batches ({} invalid, {} repeats); {} claims ran out before their \
         batch was sent",
        ledger.submissions(),
        added.len(),
        invalid.len(),
        ledger.repeats().len(),
        ran_out.load(Ordering::Relaxed),
    );
}

/// One generated case: each batch's keys over three keys (`None`: undeclared) and the ledger's
/// answer to its first submission.
#[derive(Debug, Clone)]
struct Case {
    batches: Vec<(Declared, Fate)>,
}

/// Keys read and written, by number (`None`: none declared).
type Declared = Option<(Vec<u8>, Vec<u8>)>;

fn case() -> impl Strategy<Value = Case> {
    let keys = prop::collection::vec(0_u8..3, 0..3);
    let declared = prop_oneof![1 => Just(None), 5 => (keys.clone(), keys).prop_map(Some)];
    let fate = prop_oneof![
        4 => Just(Fate::Commit),
        1 => Just(Fate::Invalid),
        1 => Just(Fate::Forget),
        1 => Just(Fate::Delay),
        1 => Just(Fate::Lose),
    ];
    prop::collection::vec((declared, fate), 2..7).prop_map(|batches| Case { batches })
}

/// Over random declarations and ledger answers (unknown, delayed, invalid, lost replies), a
/// submitter and a monitor bring every batch to committed or invalid, conflicting batches in
/// order, with no breach at the ledger.
#[test]
fn random_declarations_and_answers_keep_the_order_of_every_conflict() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let t = rt.block_on(async {
        let t = TestDb::new().await;
        format_two(&t).await;
        t
    });
    let n = std::cell::Cell::new(0_u32);
    let mut runner = TestRunner::new(Config {
        cases: 12,
        failure_persistence: None,
        ..Config::default()
    });
    let outcome = runner.run(&case(), |case| {
        n.set(n.get() + 1);
        let service = format!("svc{}", n.get());
        rt.block_on(async {
            let batches = Batches::with_collection(&t.store, "batches", Duration::ZERO)
                .await
                .unwrap();
            batches
                .set_strategy(&service, QueueStrategy::Parallel)
                .await
                .unwrap();
            let ledger = Ledger::new(Duration::ZERO, Faults::NONE, u64::from(n.get()));
            let mut added = Vec::new();
            for (i, (keys, fate)) in case.batches.iter().enumerate() {
                let h = format!("{service}-{i}");
                let mut batch = NewBatch::new(&service, &h, &h);
                if let Some((r, w)) = keys {
                    let name = |k: &u8| format!("k{k}");
                    batch = batch.with_keys(r.iter().map(name), w.iter().map(name));
                }
                let b = batches.add(&batch).await.unwrap();
                ledger.declare(&b);
                ledger.force(&h, *fate);
                added.push(b);
            }
            // Claims short enough that a lost reply is asked about soon.
            let submitter = Submitter::new(
                batches.clone(),
                ledger.clone(),
                "sub",
                Duration::from_millis(30),
            );
            let monitor = Monitor::new(batches.clone(), ledger.clone());
            let started = std::time::Instant::now();
            loop {
                let open: Vec<String> = {
                    let mut open = Vec::new();
                    for b in &added {
                        let now = batches.get(&b.header).await.unwrap();
                        if !matches!(
                            now.status,
                            Some(BatchStatus::Committed | BatchStatus::Invalid)
                        ) {
                            open.push(format!("{}: {:?}", now.header, now.status));
                        }
                    }
                    open
                };
                if open.is_empty() {
                    break;
                }
                prop_assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "stuck: {open:?}"
                );
                submitter.run_once().await.unwrap();
                monitor.run_once().await.unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let invalid: Vec<String> = added
                .iter()
                .filter(|b| ledger.status(&b.header) == LedgerStatus::Invalid)
                .map(|b| b.header.clone())
                .collect();
            prop_assert!(ledger.breaches().is_empty(), "{:?}", ledger.breaches());
            check_order(&ledger, &added, &invalid);
            Ok::<(), TestCaseError>(())
        })
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
}
