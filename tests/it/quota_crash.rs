//! Quota under crashes: a consumer that dies between reserve and confirm, a coordinator that
//! dies at every step of a multi-provider consume, and worker processes killed mid-consume.
//! After expiry and the GC, usage equals the allocations everywhere and nothing is half-taken.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{raw_snapshot, TestDb};
use bson::Document;
use mongotx::collections::PROVIDERS_COLLECTION;
use mongotx::gc::{Gc, GcOptions};
use mongotx::quota::{failpoint, NewProvider, Quota, QuotaError, QuotaOptions, Request};
use mongotx::testkit::failpoint::{self as txn_failpoint, CrashAt, Failpoint};

const RESOURCES: [&str; 3] = ["cores", "ram", "disk"];
const PROJECTS: [&str; 2] = ["project/a", "project/b"];

async fn hierarchy(quota: &Quota, limit: i64) {
    for resource in RESOURCES {
        quota
            .create(NewProvider::new(("domain", resource), limit * 2))
            .await
            .unwrap();
        for project in PROJECTS {
            quota
                .create(NewProvider::new((project, resource), limit).parent(("domain", resource)))
                .await
                .unwrap();
        }
    }
}

/// Checks the stored providers: usage = sum of entries, domain = sum of projects, every request
/// on all six of its providers or on none, nothing held, no transaction record left.
async fn assert_consistent(t: &TestDb, limit: i64) -> BTreeSet<String> {
    let docs = raw_snapshot(&t.db, PROVIDERS_COLLECTION).await;
    let mut usage: BTreeMap<(String, String), i64> = BTreeMap::new();
    let mut limits: BTreeMap<(String, String), i64> = BTreeMap::new();
    let mut places: BTreeMap<(String, String), usize> = BTreeMap::new();
    for doc in &docs {
        assert!(!doc.contains_key("_txn"), "left held: {doc}");
        let id = doc.get_document("_id").unwrap();
        let key = (
            id.get_str("scope").unwrap().to_string(),
            id.get_str("resource").unwrap().to_string(),
        );
        let mut sum = 0;
        for e in doc.get_array("held").unwrap() {
            let e: &Document = e.as_document().unwrap();
            let n = e.get_i64("n").unwrap();
            sum += n;
            if n > 0 {
                *places
                    .entry((
                        e.get_str("c").unwrap().into(),
                        e.get_str("r").unwrap().into(),
                    ))
                    .or_default() += 1;
            }
        }
        assert_eq!(doc.get_i64("usage").unwrap(), sum, "usage = entries: {doc}");
        // A provider may be spread over several stripes, each within its share of the limit.
        assert!(
            sum <= doc.get_i64("limit").unwrap(),
            "over the limit: {doc}"
        );
        *limits.entry(key.clone()).or_default() += doc.get_i64("limit").unwrap();
        *usage.entry(key).or_default() += sum;
    }
    for ((scope, resource), shares) in &limits {
        let configured = if scope == "domain" { 2 * limit } else { limit };
        assert_eq!(
            *shares, configured,
            "{scope}:{resource}: the stripes' shares add up to the limit"
        );
    }
    for resource in RESOURCES {
        let children: i64 = PROJECTS
            .iter()
            .map(|p| usage[&(p.to_string(), resource.to_string())])
            .sum();
        assert_eq!(
            usage[&("domain".to_string(), resource.to_string())],
            children,
            "{resource}: domain = sum of projects"
        );
    }
    for ((c, r), n) in &places {
        assert_eq!(*n, 6, "request {c}/{r} is on {n} of its 6 providers");
    }
    assert!(
        raw_snapshot(&t.db, t.store.transactions_collection())
            .await
            .is_empty(),
        "transaction records left"
    );
    places.into_keys().map(|(c, _)| c).collect()
}

/// The transaction layer's failpoints on a coordinator's side (the GC's left out).
pub(crate) fn coordinator_points() -> Vec<&'static str> {
    txn_failpoint::ALL
        .iter()
        .copied()
        .filter(|name| !name.starts_with("gc."))
        .collect()
}

/// A quota handle whose transactions' coordinator dies at failpoint `name`, step `step`; they
/// expire after 300 ms, so the GC can settle them soon after.
pub(crate) async fn dying_at(t: &TestDb, name: &'static str, step: usize) -> Quota {
    Quota::with_options(
        &t.store,
        QuotaOptions::default()
            .txn_timeout(Duration::from_millis(300))
            .fault_injector(Arc::new(CrashAt(Failpoint { name, step }))),
    )
    .await
    .unwrap()
}

/// Runs GC rounds (transactions, then the quota sweep) until nothing is left to resolve.
pub(crate) async fn collect(t: &TestDb, quota: &Quota) {
    let gc = Gc::new(&t.store, GcOptions::default());
    for _ in 0..20 {
        let round = gc.run_round().await.unwrap();
        quota.sweep().await.unwrap();
        if round.finished + round.rolled_back + round.swept == 0 {
            break;
        }
    }
}

#[tokio::test]
async fn a_consumer_killed_between_reserve_and_confirm_gets_its_quota_back_from_the_gc() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    hierarchy(&quota, 100).await;
    let dying = Quota::with_options(
        &t.store,
        QuotaOptions::default().fault_injector(Arc::new(CrashAt(Failpoint {
            name: failpoint::RESERVE_AFTER,
            step: 0,
        }))),
    )
    .await
    .unwrap();
    let request = Request::new("vm")
        .take(("project/a", "cores"), 10)
        .take(("project/a", "ram"), 20);
    match dying.reserve(&request, Duration::from_millis(400)).await {
        Err(QuotaError::Crashed { at }) => assert_eq!(at.name, failpoint::RESERVE_AFTER),
        other => panic!("expected the injected crash, got {other:?}"),
    }
    assert_eq!(quota.provider(("domain", "cores")).await.unwrap().usage, 10);
    // Before the expiry the sweep leaves it alone.
    assert_eq!(quota.sweep().await.unwrap().expired, 0);
    assert_eq!(quota.provider(("domain", "ram")).await.unwrap().usage, 20);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(quota.sweep().await.unwrap().expired, 1);
    for scope in ["domain", "project/a"] {
        for resource in ["cores", "ram"] {
            assert_eq!(quota.provider((scope, resource)).await.unwrap().usage, 0);
        }
    }
    assert!(assert_consistent(&t, 100).await.is_empty());
}

#[tokio::test]
async fn a_coordinator_dying_at_any_step_of_a_multi_provider_consume_leaves_all_or_nothing() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    hierarchy(&quota, 1_000_000).await;
    let mut crashed = 0;
    let mut committed = 0;
    for name in coordinator_points() {
        for step in 0..6 {
            let dying = dying_at(&t, name, step).await;
            let consumer = format!("{name}#{step}");
            let request = Request::new(&consumer)
                .take(("project/a", "cores"), 1)
                .take(("project/a", "ram"), 2)
                .take(("project/a", "disk"), 3);
            match dying.consume(&request).await {
                Err(QuotaError::Transaction { source })
                    if source.to_string().contains("injected crash") =>
                {
                    crashed += 1
                }
                Ok(_) => continue, // this step does not exist for this transaction
                Err(other) => panic!("{consumer}: {other}"),
            }
            tokio::time::sleep(Duration::from_millis(350)).await;
            collect(&t, &quota).await;
            let holders = assert_consistent(&t, 1_000_000).await;
            // Retrying the same request completes it, exactly once.
            let retried = quota.consume(&request).await.unwrap();
            if holders.contains(&consumer) {
                assert!(retried.replayed, "{consumer}: committed before the crash");
                committed += 1;
            } else {
                assert!(!retried.replayed, "{consumer}: rolled back by the GC");
            }
            assert_eq!(
                quota
                    .provider(("domain", "disk"))
                    .await
                    .unwrap()
                    .allocations
                    .iter()
                    .filter(|a| a.consumer == consumer)
                    .count(),
                1
            );
        }
    }
    assert_consistent(&t, 1_000_000).await;
    println!("crashed at {crashed} points; {committed} had passed the commit point");
    assert!(crashed >= 20, "only {crashed} crashes");
    assert!(committed > 0 && committed < crashed);
}

/// A release spanning two providers whose coordinator dies at any step, released again at once
/// (the dead transaction's holds still in place): between them they return everything, once.
/// While one provider is held with the consumer's entry only in its undo, the other alone must
/// not be mistaken for all the consumer holds.
#[tokio::test]
async fn a_release_retried_over_a_dead_coordinators_holds_returns_everything_once() {
    let t = TestDb::new().await;
    let quota = Quota::with_options(
        &t.store,
        QuotaOptions::default().txn_timeout(Duration::from_millis(300)),
    )
    .await
    .unwrap();
    for resource in ["x", "y"] {
        quota
            .create(NewProvider::new(("flat", resource), 1_000))
            .await
            .unwrap();
    }
    let (mut crashed, mut committed) = (0, 0);
    for name in coordinator_points() {
        for step in 0..6 {
            let consumer = format!("{name}#{step}");
            quota
                .consume(
                    &Request::new(&consumer)
                        .take(("flat", "x"), 2)
                        .take(("flat", "y"), 5),
                )
                .await
                .unwrap();
            let dying = dying_at(&t, name, step).await;
            match dying.release(&consumer).await {
                Err(QuotaError::Transaction { source })
                    if source.to_string().contains("injected crash") =>
                {
                    crashed += 1
                }
                Ok(released) => {
                    // This step does not exist for this transaction.
                    assert_eq!(released.returned.len(), 2, "{consumer}");
                    continue;
                }
                Err(other) => panic!("{consumer}: {other}"),
            }
            let mut returned: Vec<_> = match quota.release(&consumer).await {
                Ok(released) => released.returned,
                Err(QuotaError::UnknownConsumer { .. }) => {
                    committed += 1;
                    Vec::new()
                }
                Err(other) => panic!("{consumer}: the second release: {other}"),
            };
            returned.sort();
            assert!(
                returned.is_empty()
                    || returned == vec![(("flat", "x").into(), 2), (("flat", "y").into(), 5)],
                "{consumer}: the second release returned {returned:?}"
            );
            collect(&t, &quota).await;
            for resource in ["x", "y"] {
                let provider = quota.provider(("flat", resource)).await.unwrap();
                assert_eq!(provider.usage, 0, "{consumer}: {resource} still used");
                assert!(provider.allocations.is_empty(), "{consumer}: {resource}");
            }
        }
    }
    println!("crashed at {crashed} points; {committed} had passed the commit point");
    assert!(crashed >= 10, "only {crashed} crashes");
    assert!(committed > 0 && committed < crashed);
}

fn spawn_worker(t: &TestDb) -> Child {
    Command::new(env!("CARGO_BIN_EXE_mongotx-torture"))
        .args([
            "quota-worker",
            "--uri",
            &common::server_uri(),
            "--db",
            t.db.name(),
            "--projects",
            &PROJECTS.join(","),
            "--resources",
            &RESOURCES.join(","),
            "--txn-timeout",
            "500ms",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start a quota worker")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_processes_killed_mid_consume_leave_usage_equal_to_allocations() {
    let _turn = common::fleet_turn(module_path!());
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    hierarchy(&quota, 400).await;
    let mut workers: Vec<Child> = (0..3).map(|_| spawn_worker(&t)).collect();
    let mut kills = 0;
    for round in 0..8_usize {
        let pause = Duration::from_millis(700 + 150 * (round as u64 % 3));
        tokio::time::sleep(pause).await;
        let victim = round % workers.len();
        workers[victim].kill().expect("kill");
        workers[victim].wait().expect("reap");
        kills += 1;
        workers[victim] = spawn_worker(&t);
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    for mut w in workers {
        w.kill().expect("kill");
        w.wait().expect("reap");
        kills += 1;
    }
    // Past every transaction's deadline; then the GC settles what the dead left.
    tokio::time::sleep(Duration::from_millis(700)).await;
    collect(&t, &quota).await;
    let holders = assert_consistent(&t, 400).await;
    let stripes = raw_snapshot(&t.db, PROVIDERS_COLLECTION)
        .await
        .iter()
        .filter(|d| {
            d.get_document("_id")
                .is_ok_and(|id| id.contains_key("stripe"))
        })
        .count();
    println!(
        "{kills} kills; {} consumers hold quota afterwards; {stripes} stripes beyond the providers' own documents",
        holders.len()
    );
    assert!(!holders.is_empty(), "the workers consumed something");
    // Releasing every survivor brings every provider back to zero.
    for consumer in &holders {
        quota.release(consumer).await.unwrap();
    }
    for doc in raw_snapshot(&t.db, PROVIDERS_COLLECTION).await {
        assert_eq!(doc.get_i64("usage").unwrap(), 0, "{doc}");
    }
}
