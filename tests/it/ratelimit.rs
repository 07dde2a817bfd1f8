//! The rate limiter against the test server: grants, settlements, priorities, the queue,
//! all-or-nothing across limiters, dead workers, lost replies, and bad input.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::TestDb;
use bson::Document;
use mongotx::collections::LIMITERS_COLLECTION;
use mongotx::ratelimit::{
    Attempt, CallReservation, Limit, Priority, RateLimitError, RateLimitOptions, RateLimits,
    Settled, LIMITERS_SCHEMA,
};
use mongotx::schema::JsonSchema;
use mongotx::Store;

async fn limits(t: &TestDb) -> RateLimits {
    RateLimits::open(&t.store).await.unwrap()
}

async fn granted(limits: &RateLimits, names: &[&str], n: u32, p: Priority) -> CallReservation {
    match limits.try_reserve(names, n, p).await.unwrap() {
        Attempt::Granted(r) => r,
        Attempt::Wait { after, .. } => panic!("{names:?}: {n} {p} calls refused, wait {after:?}"),
    }
}

async fn refused(limits: &RateLimits, names: &[&str], n: u32, p: Priority) -> Duration {
    match limits.try_reserve(names, n, p).await.unwrap() {
        Attempt::Granted(r) => panic!("{names:?}: {n} {p} calls granted: {r:?}"),
        Attempt::Wait { after, .. } => after,
    }
}

async fn reserve_err(limits: &RateLimits, names: &[&str], n: u32, p: Priority) -> RateLimitError {
    match limits.try_reserve(names, n, p).await {
        Ok(attempt) => panic!("{names:?}: {n} {p} calls were not refused: {attempt:?}"),
        Err(e) => e,
    }
}

async fn snapshot(t: &TestDb) -> Vec<Document> {
    common::raw_snapshot(&t.db, LIMITERS_COLLECTION).await
}

#[tokio::test]
async fn a_settlement_returns_unused_calls_at_once_and_the_document_keeps_its_schema() {
    let t = TestDb::new().await;
    let limits = limits(&t).await;
    limits
        .define("api", Limit::new(10, Duration::from_secs(60)))
        .await
        .unwrap();
    let r = granted(&limits, &["api"], 8, Priority::Bulk).await;
    assert!(r.usable() && r.calls() == 8 && r.limiters() == ["api".to_string()]);
    refused(&limits, &["api"], 3, Priority::Bulk).await;
    let usage = limits.usage("api").await.unwrap();
    assert_eq!((usage.bulk, usage.high, usage.pending), (8, 0, 8));

    assert_eq!(
        limits.settle(&r, 5).await.unwrap(),
        Settled::Returned { unused: 3 }
    );
    let usage = limits.usage("api").await.unwrap();
    assert_eq!(
        (usage.bulk, usage.pending),
        (5, 0),
        "made calls still count"
    );
    let again = granted(&limits, &["api"], 5, Priority::Bulk).await;
    refused(&limits, &["api"], 1, Priority::Bulk).await;
    limits.settle(&again, 0).await.unwrap();

    let schema = JsonSchema::parse(LIMITERS_COLLECTION, LIMITERS_SCHEMA).unwrap();
    for doc in snapshot(&t).await {
        schema
            .validate(&doc)
            .unwrap_or_else(|v| panic!("{doc} breaks the schema: {v}"));
    }
}

#[tokio::test]
async fn define_is_idempotent_and_never_changes_a_live_limit() {
    let t = TestDb::new().await;
    let limits = limits(&t).await;
    let limit = Limit::new(10, Duration::from_secs(1)).reserved(2);
    limits.define("api", limit).await.unwrap();
    limits.define("api", limit).await.unwrap();
    let before = snapshot(&t).await;
    let err = limits.define("api", limit.reserved(3)).await.unwrap_err();
    assert!(matches!(err, RateLimitError::LimitMismatch { .. }), "{err}");
    assert!(err.to_string().contains("ratelimits/api"), "{err}");
    for bad in [
        Limit::new(0, Duration::from_secs(1)),
        Limit::new(5, Duration::ZERO),
        Limit::new(5, Duration::from_secs(1)).reserved(5),
        Limit::new(5, Duration::from_secs(1)).hold(Duration::ZERO),
        Limit::new(5, Duration::from_secs(1)).grace(Duration::from_secs(90_000)),
    ] {
        let err = limits.define("other", bad).await.unwrap_err();
        assert!(
            matches!(err, RateLimitError::InvalidLimit { .. }),
            "{bad}: {err}"
        );
    }
    assert_eq!(snapshot(&t).await, before, "nothing written");
    assert_eq!(
        limits.limit("api").await.unwrap(),
        limit,
        "the stored limit"
    );
}

#[tokio::test]
async fn bad_input_is_refused_with_typed_errors_and_writes_nothing() {
    let t = TestDb::new().await;
    let limits = limits(&t).await;
    limits
        .define("api", Limit::new(10, Duration::from_secs(60)).reserved(2))
        .await
        .unwrap();
    limits
        .define("tenant", Limit::new(10, Duration::from_secs(60)))
        .await
        .unwrap();
    let r = granted(&limits, &["api"], 4, Priority::Bulk).await;
    let before = snapshot(&t).await;

    let err = reserve_err(&limits, &["api"], 0, Priority::Bulk).await;
    assert!(matches!(err, RateLimitError::ZeroCalls { .. }), "{err}");
    let err = reserve_err(&limits, &["api"], 9, Priority::Bulk).await;
    assert!(
        matches!(
            err,
            RateLimitError::TooManyCalls {
                requested: 9,
                most: 8,
                ..
            }
        ),
        "bulk callers never get the reserved part: {err}"
    );
    let err = reserve_err(&limits, &["api"], 11, Priority::High).await;
    assert!(
        matches!(err, RateLimitError::TooManyCalls { most: 10, .. }),
        "{err}"
    );
    let err = reserve_err(&limits, &["nope"], 1, Priority::Bulk).await;
    assert!(
        matches!(err, RateLimitError::UnknownLimiter { .. }),
        "{err}"
    );
    let err = reserve_err(&limits, &["api", "nope"], 1, Priority::Bulk).await;
    assert!(
        matches!(err, RateLimitError::UnknownLimiter { .. }),
        "{err}"
    );
    let err = reserve_err(&limits, &["api", "api"], 1, Priority::Bulk).await;
    assert!(
        matches!(err, RateLimitError::InvalidRequest { .. }),
        "{err}"
    );
    let err = reserve_err(&limits, &[], 1, Priority::Bulk).await;
    assert!(
        matches!(err, RateLimitError::InvalidRequest { .. }),
        "{err}"
    );
    let err = reserve_err(&limits, &[""], 1, Priority::Bulk).await;
    assert!(
        matches!(err, RateLimitError::InvalidRequest { .. }),
        "{err}"
    );

    // made > reserved.
    let err = limits.settle(&r, 5).await.unwrap_err();
    assert!(
        matches!(
            err,
            RateLimitError::MadeExceedsReserved {
                made: 5,
                reserved: 4,
                ..
            }
        ),
        "{err}"
    );
    // A reservation this limiter never granted: one from another collection of limiters.
    let elsewhere = RateLimits::with_options(
        &t.store,
        RateLimitOptions::default().collection("other_limits"),
    )
    .await
    .unwrap();
    elsewhere
        .define("api", Limit::new(10, Duration::from_secs(60)).reserved(2))
        .await
        .unwrap();
    let foreign = granted(&elsewhere, &["api"], 1, Priority::Bulk).await;
    let err = limits.settle(&foreign, 1).await.unwrap_err();
    assert!(
        matches!(err, RateLimitError::UnknownReservation { .. }),
        "{err}"
    );
    assert!(err.to_string().contains(&foreign.id().to_hex()), "{err}");
    assert_eq!(snapshot(&t).await, before, "nothing written by any refusal");

    // Settling twice: the first settlement stands.
    limits.settle(&r, 3).await.unwrap();
    let settled_once = snapshot(&t).await;
    let err = limits.settle(&r, 1).await.unwrap_err();
    assert!(
        matches!(err, RateLimitError::AlreadySettled { made: 3, .. }),
        "{err}"
    );
    let err = limits.settle(&r, 3).await.unwrap_err();
    assert!(
        matches!(err, RateLimitError::AlreadySettled { .. }),
        "{err}"
    );
    assert!(!err.is_retryable());
    assert_eq!(snapshot(&t).await, settled_once, "nothing written");
}

#[tokio::test]
async fn high_priority_never_waits_behind_bulk_while_its_part_remains() {
    let t = TestDb::new().await;
    let limits = limits(&t).await;
    limits
        .define("api", Limit::new(20, Duration::from_secs(60)).reserved(4))
        .await
        .unwrap();
    // Bulk callers take everything they may: 16.
    let mut bulk = Vec::new();
    for _ in 0..16 {
        bulk.push(granted(&limits, &["api"], 1, Priority::Bulk).await);
    }
    refused(&limits, &["api"], 1, Priority::Bulk).await;
    // High priority: the reserved 4, in ones and twos, at once.
    let a = granted(&limits, &["api"], 2, Priority::High).await;
    let b = granted(&limits, &["api"], 1, Priority::High).await;
    let c = granted(&limits, &["api"], 1, Priority::High).await;
    refused(&limits, &["api"], 1, Priority::High).await;
    // A high-priority settlement with nothing made gives its part back to high priority, not to
    // bulk (bulk still counts high priority as at least the reserved part).
    limits.settle(&c, 0).await.unwrap();
    refused(&limits, &["api"], 1, Priority::Bulk).await;
    granted(&limits, &["api"], 1, Priority::High).await;
    // When high priority holds less than its part, the difference stays free for it even
    // while bulk waits; bulk settling with calls unused frees room for bulk.
    limits.settle(&a, 0).await.unwrap();
    limits.settle(&b, 0).await.unwrap();
    for r in bulk.drain(..4) {
        limits.settle(&r, 0).await.unwrap();
    }
    granted(&limits, &["api"], 4, Priority::Bulk).await;
    refused(&limits, &["api"], 1, Priority::Bulk).await;
    granted(&limits, &["api"], 2, Priority::High).await;
    granted(&limits, &["api"], 1, Priority::High).await;
}

#[tokio::test]
async fn a_dead_workers_reservation_counts_in_full_then_frees_itself() {
    let t = TestDb::new().await;
    let limits = limits(&t).await;
    let limit = Limit::new(5, Duration::from_millis(400))
        .hold(Duration::from_millis(200))
        .grace(Duration::from_millis(50));
    limits.define("api", limit).await.unwrap();
    // The worker dies: the reservation is never settled.
    let dead = granted(&limits, &["api"], 5, Priority::Bulk).await;
    let started = Instant::now();
    refused(&limits, &["api"], 1, Priority::Bulk).await;
    // Still counted after its hold and grace (its calls may be arriving)...
    tokio::time::sleep(limit.hold + limit.grace + Duration::from_millis(50)).await;
    let after = refused(&limits, &["api"], 1, Priority::Bulk).await;
    assert!(
        after <= limit.window + Duration::from_millis(50),
        "told when: {after:?}"
    );
    // ...and no longer once a window has passed after that.
    tokio::time::sleep(after + Duration::from_millis(20)).await;
    let next = granted(&limits, &["api"], 5, Priority::Bulk).await;
    let cost = started.elapsed();
    assert!(
        cost <= limit.dead_worker_cost() + Duration::from_millis(300),
        "a dead worker costs at most hold + grace + window: {cost:?}"
    );
    // A settlement that comes after the expiry changes nothing.
    assert_eq!(limits.settle(&dead, 5).await.unwrap(), Settled::Expired);
    limits.settle(&next, 5).await.unwrap();
}

#[tokio::test]
async fn all_or_nothing_across_limiters() {
    let t = TestDb::new().await;
    let limits = limits(&t).await;
    limits
        .define("global", Limit::new(10, Duration::from_secs(60)))
        .await
        .unwrap();
    limits
        .define("tenant-a", Limit::new(3, Duration::from_secs(60)))
        .await
        .unwrap();
    limits
        .define("tenant-b", Limit::new(6, Duration::from_secs(60)))
        .await
        .unwrap();
    let a = granted(&limits, &["tenant-a", "global"], 3, Priority::Bulk).await;
    // What each limiter counts (the documents themselves also record the refused attempts and
    // the grants taken back, for lost replies).
    let counts = || async {
        let mut all = Vec::new();
        for name in ["global", "tenant-a", "tenant-b"] {
            let u = limits.usage(name).await.unwrap();
            all.push((name, u.bulk, u.high, u.pending));
        }
        all
    };
    let before = counts().await;
    // tenant-a is full: nothing is taken from global either.
    refused(&limits, &["tenant-a", "global"], 1, Priority::Bulk).await;
    refused(&limits, &["global", "tenant-a"], 1, Priority::Bulk).await;
    assert_eq!(counts().await, before, "the partial grants were taken back");
    let b = granted(&limits, &["tenant-b", "global"], 6, Priority::Bulk).await;
    // global has 1 left, tenant-b none.
    refused(&limits, &["tenant-b", "global"], 1, Priority::Bulk).await;
    assert_eq!(limits.usage("global").await.unwrap().bulk, 9);
    let global_only = granted(&limits, &["global"], 1, Priority::Bulk).await;
    limits.settle(&b, 2).await.unwrap();
    assert_eq!(limits.usage("global").await.unwrap().bulk, 6);
    assert_eq!(limits.usage("tenant-b").await.unwrap().bulk, 2);
    for r in [a, global_only] {
        limits.settle(&r, r.calls()).await.unwrap();
    }

    // Concurrently: 16 tasks on 4 clients take one call on (a tenant, global) at a time and
    // never settle; the counts must add up on every limiter, with no partial grant left.
    let t2 = TestDb::new().await;
    let mut handles = Vec::new();
    for c in 0..4 {
        let store = Store::new(t2.other_client_db().await);
        let limits = RateLimits::open(&store).await.unwrap();
        if c == 0 {
            limits
                .define("global", Limit::new(40, Duration::from_secs(60)))
                .await
                .unwrap();
            for tenant in ["t0", "t1", "t2"] {
                limits
                    .define(tenant, Limit::new(15, Duration::from_secs(60)))
                    .await
                    .unwrap();
            }
        }
        handles.push(limits);
    }
    let grants = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let limits = handles[i % 4].clone();
        let grants = grants.clone();
        tasks.push(tokio::spawn(async move {
            let tenant = ["t0", "t1", "t2"][i % 3];
            for _ in 0..30 {
                if let Attempt::Granted(_) = limits
                    .try_reserve(&[tenant, "global"], 1, Priority::Bulk)
                    .await
                    .unwrap()
                {
                    grants.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let limits = &handles[0];
    let global = limits.usage("global").await.unwrap();
    let tenants: u32 = [
        limits.usage("t0").await.unwrap().bulk,
        limits.usage("t1").await.unwrap().bulk,
        limits.usage("t2").await.unwrap().bulk,
    ]
    .iter()
    .sum();
    let total = grants.load(Ordering::SeqCst) as u32;
    assert_eq!(global.bulk, total, "global counts exactly the grants");
    assert_eq!(tenants, total, "the tenants count exactly the grants");
    assert_eq!(total, 40, "the global limit was reached, not passed");
}

#[tokio::test]
async fn a_large_bulk_request_is_not_starved_by_small_ones() {
    let t = TestDb::new().await;
    let limits = limits(&t).await;
    let limit = Limit::new(10, Duration::from_millis(300)).hold(Duration::from_millis(100));
    limits.define("api", limit).await.unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Eight callers on two clients keep taking one call each and settling it made.
    let mut small = Vec::new();
    for i in 0..8 {
        let store = Store::new(t.other_client_db().await);
        let limits = if i % 2 == 0 {
            limits.clone()
        } else {
            RateLimits::open(&store).await.unwrap()
        };
        let stop = stop.clone();
        small.push(tokio::spawn(async move {
            let mut made = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let r = limits.reserve(&["api"], 1, Priority::Bulk).await.unwrap();
                limits.settle(&r, 1).await.unwrap();
                made += 1;
            }
            made
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let big = limits
        .reserve_within(&["api"], 10, Priority::Bulk, Duration::from_secs(5))
        .await
        .expect("the whole limit, asked while small callers keep it busy, is granted in time");
    let waited = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    let mut small_made = 0;
    for s in small {
        small_made += s.await.unwrap();
    }
    println!("the request for the whole limit waited {waited:?}; small callers made {small_made} calls meanwhile");
    limits.settle(&big, 10).await.unwrap();
    assert!(small_made > 0);
}

/// Loses the reply of the first command matching `which`: "reserve" (the granting
/// `findAndModify`, whose pipeline looks for its key among the recent grants, `_i`) or
/// "settle" (the settling one, which looks among the recent settlements, `_seen`).
struct LoseFirst {
    which: &'static str,
    lost: Arc<AtomicUsize>,
}

/// The temporary fields the stages of a `findAndModify` pipeline set.
fn pipeline_fields(command: &Document) -> Vec<String> {
    let Ok(stages) = command.get_array("update") else {
        return Vec::new();
    };
    stages
        .iter()
        .filter_map(|stage| stage.as_document()?.get_document("$set").ok())
        .flat_map(|set| set.keys().cloned())
        .collect()
}

impl common::wire_proxy::Rules for LoseFirst {
    fn command(&self, command: &mut Document) -> common::wire_proxy::Action {
        use crate::common::wire_proxy::{command_name, Action};
        if !command_name(command).eq_ignore_ascii_case("findAndModify") {
            return Action::Forward;
        }
        let marker = match self.which {
            "reserve" => "_i",
            _ => "_seen",
        };
        let matches = pipeline_fields(command).iter().any(|f| f == marker);
        if matches && self.lost.fetch_add(1, Ordering::SeqCst) == 0 {
            return Action::LoseReply;
        }
        Action::Forward
    }
}

#[tokio::test]
async fn lost_replies_neither_double_a_grant_nor_fail_a_settlement() {
    let t = TestDb::new().await;
    let direct = limits(&t).await;
    direct
        .define("api", Limit::new(10, Duration::from_secs(60)))
        .await
        .unwrap();
    for which in ["reserve", "settle"] {
        let lost = Arc::new(AtomicUsize::new(0));
        let proxy = common::wire_proxy::WireProxy::start(
            &common::server_uri(),
            LoseFirst {
                which,
                lost: lost.clone(),
            },
        )
        .await;
        let limits = RateLimits::open(&Store::new(proxy.client().await.database(t.db.name())))
            .await
            .unwrap();
        let r = granted(&limits, &["api"], 4, Priority::Bulk).await;
        let usage = direct.usage("api").await.unwrap();
        assert_eq!(usage.bulk, 4, "{which}: one grant of 4, not two");
        assert_eq!(
            limits.settle(&r, 1).await.unwrap(),
            Settled::Returned { unused: 3 },
            "{which}"
        );
        assert!(
            lost.load(Ordering::SeqCst) >= 1,
            "{which}: a reply was lost"
        );
        assert_eq!(direct.usage("api").await.unwrap().bulk, 1);
        assert!(matches!(
            limits.settle(&r, 1).await,
            Err(RateLimitError::AlreadySettled { .. })
        ));
        // Make room for the next round: the window is long, so start from a fresh limiter.
        t.db.collection::<Document>(LIMITERS_COLLECTION)
            .delete_many(bson::doc! {})
            .await
            .unwrap();
        direct
            .define("api", Limit::new(10, Duration::from_secs(60)))
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn a_sweep_prunes_only_entries_that_stopped_counting() {
    let t = TestDb::new().await;
    let limits = limits(&t).await;
    limits
        .define("idle", Limit::new(10, Duration::from_millis(100)))
        .await
        .unwrap();
    limits
        .define("busy", Limit::new(10, Duration::from_secs(3600)))
        .await
        .unwrap();
    for name in ["idle", "busy"] {
        let r = granted(&limits, &[name], 2, Priority::High).await;
        limits.settle(&r, 2).await.unwrap();
    }
    let slots = |doc: &Document| doc.get_array("slots").map(|l| l.len()).unwrap_or(99);
    // Everything still counts (or counted too recently): nothing to prune.
    assert_eq!(limits.sweep().await.unwrap(), 0);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(limits.sweep().await.unwrap(), 1, "only the idle limiter");
    let docs = snapshot(&t).await;
    let by = |name: &str| {
        docs.iter()
            .find(|d| d.get_str("_id") == Ok(name))
            .unwrap_or_else(|| panic!("no {name} in {docs:?}"))
    };
    assert_eq!(slots(by("idle")), 0, "{:?}", by("idle"));
    assert_eq!(slots(by("busy")), 1, "{:?}", by("busy"));
    assert_eq!(limits.usage("busy").await.unwrap().high, 2);
    assert_eq!(
        limits.sweep().await.unwrap(),
        0,
        "a second sweep finds nothing"
    );
}
