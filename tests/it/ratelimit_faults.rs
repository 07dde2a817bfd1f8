//! The rate limiter under the faults of issue 47: clones of one reservation settled at once, a
//! settlement's first sending delivered late after its resend and 32 more settlements, the
//! server's clock stepping forward under a limiter (a failover or a chunk migration to a node
//! whose clock is ahead), a limiter re-defined with a shorter hold under a process that cached
//! the old one, and a worker of the version before slots writing to a limiter `define` moved to
//! slots.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::wire_proxy::{command_name, Action, Rules, WireProxy};
use crate::common::TestDb;
use bson::{doc, Bson, Document};
use mongotx::collections::LIMITERS_COLLECTION;
use mongotx::ratelimit::{
    Attempt, CallReservation, Limit, Priority, RateLimitError, RateLimitOptions, RateLimits,
    Settled,
};
use mongotx::Store;

async fn granted(limits: &RateLimits, names: &[&str], n: u32, p: Priority) -> CallReservation {
    match limits.try_reserve(names, n, p).await.unwrap() {
        Attempt::Granted(r) => r,
        Attempt::Wait { after, .. } => panic!("{names:?}: {n} {p} calls refused, wait {after:?}"),
    }
}

fn is_granted(attempt: &Attempt) -> bool {
    matches!(attempt, Attempt::Granted(_))
}

/// The end slot the limiter recorded for reservation `r` among its recent grants.
async fn end_slot(
    db: &mongodb::Database,
    collection: &str,
    name: &str,
    r: &CallReservation,
) -> i64 {
    let doc = db
        .collection::<Document>(collection)
        .find_one(doc! { "_id": name })
        .await
        .unwrap()
        .unwrap();
    let key = r.id().to_hex();
    doc.get_array("granted")
        .unwrap()
        .iter()
        .filter_map(Bson::as_document)
        .find(|g| g.get_str("k") == Ok(key.as_str()))
        .and_then(|g| g.get_i64("s").ok())
        .unwrap_or_else(|| panic!("{key} is not among the recent grants of {doc}"))
}

/// Case 4: two clones of one reservation settled from two tasks at once. Exactly one settlement
/// is accepted, the other is refused with `AlreadySettled` (without a write), and the limiter
/// counts the calls the accepted one reported. Before the fix the second `settle` found the state
/// `SENT`, took itself for a resend, and wrote with its own `made`: both were accepted in every
/// round, and in most the limiter counted the 0 of the clone, not the 5 made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clones_settled_at_once_exactly_one_is_accepted() {
    let t = TestDb::new().await;
    let limits = RateLimits::open(&t.store).await.unwrap();
    let (mut firsts, mut clones) = (0, 0);
    for round in 0..40 {
        let name = format!("api-{round}");
        limits
            .define(&name, Limit::new(10, Duration::from_secs(60)))
            .await
            .unwrap();
        let r = granted(&limits, &[&name], 5, Priority::Bulk).await;
        let clone = r.clone();
        let start = Arc::new(tokio::sync::Barrier::new(2));
        let (l1, l2) = (limits.clone(), limits.clone());
        let (s1, s2) = (start.clone(), start.clone());
        let one = tokio::spawn(async move {
            s1.wait().await;
            l1.settle(&r, 5).await
        });
        let two = tokio::spawn(async move {
            s2.wait().await;
            l2.settle(&clone, 0).await
        });
        let (one, two) = (one.await.unwrap(), two.await.unwrap());
        let usage = limits.usage(&name).await.unwrap();
        match (&one, &two) {
            (
                Ok(Settled::Returned { unused: 0 }),
                Err(RateLimitError::AlreadySettled { made: 5, .. }),
            ) => {
                firsts += 1;
                assert_eq!(usage.bulk, 5, "round {round}: the 5 made count");
            }
            (
                Err(RateLimitError::AlreadySettled { made: 0, .. }),
                Ok(Settled::Returned { unused: 5 }),
            ) => {
                clones += 1;
                assert_eq!(usage.bulk, 0, "round {round}: the clone's 0 counts");
            }
            other => panic!("round {round}: the clones' settlements ended {other:?} ({usage:?})"),
        }
        assert_eq!(usage.pending, 0, "round {round}");
    }
    println!("the settle(r, 5) won {firsts} rounds, the clone's settle(0) {clones}");
}

/// Delivers the first settling command (its pipeline looks for its key among the recent
/// settlements, `_seen`) `late` after its sender gave up; counts the settling commands.
struct FirstSettleLate {
    late: Duration,
    seen: Arc<AtomicUsize>,
}

/// Whether `command` is a settlement's write (the one that records its key among `_seen`).
fn is_settlement(command: &Document) -> bool {
    command_name(command).eq_ignore_ascii_case("findAndModify")
        && command.get_array("update").is_ok_and(|stages| {
            stages
                .iter()
                .filter_map(|s| s.as_document()?.get_document("$set").ok())
                .any(|set| set.contains_key("_seen"))
        })
}

impl Rules for FirstSettleLate {
    fn command(&self, command: &mut Document) -> Action {
        if is_settlement(command) && self.seen.fetch_add(1, Ordering::SeqCst) == 0 {
            return Action::DeliverLate(self.late);
        }
        Action::Forward
    }
}

/// Case 5: a settlement's first sending is delayed (the client sees an I/O error; the command is
/// still on its way), the settlement's resend lands, 32 more settlements push its key off the
/// recent ones, and then the first sending arrives while the reservation's end slot still counts.
/// It must change nothing. Before the fix it was applied a second time: the end slot lost the
/// reservation's 4 calls again, taken from another reservation pending in the same slot (10
/// counted became 6), and the calls made were counted twice.
#[tokio::test]
async fn a_settlement_delivered_late_after_its_resend_and_32_more_applies_once() {
    let t = TestDb::new().await;
    let direct = RateLimits::open(&t.store).await.unwrap();
    direct
        .define("api", Limit::new(100, Duration::from_secs(60)))
        .await
        .unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let late = Duration::from_millis(4_000);
    let proxy = WireProxy::start(
        &common::server_uri(),
        FirstSettleLate {
            late,
            seen: seen.clone(),
        },
    )
    .await;
    let limits = RateLimits::open(&Store::new(proxy.client().await.database(t.db.name())))
        .await
        .unwrap();
    // The reservation and another one pending in the same end slot (a slot is 548 ms here).
    let (r, other) = loop {
        let r = granted(&limits, &["api"], 4, Priority::Bulk).await;
        let other = granted(&direct, &["api"], 10, Priority::Bulk).await;
        let coll = LIMITERS_COLLECTION;
        if end_slot(&t.db, coll, "api", &r).await == end_slot(&t.db, coll, "api", &other).await {
            break (r, other);
        }
        direct.settle(&r, 0).await.unwrap();
        direct.settle(&other, 0).await.unwrap();
    };
    let started = Instant::now();
    assert_eq!(
        limits.settle(&r, 1).await.unwrap(),
        Settled::Returned { unused: 3 },
        "the resend applied"
    );
    assert_eq!(
        seen.load(Ordering::SeqCst),
        2,
        "the first sending, cut, and one resend"
    );
    for _ in 0..32 {
        let more = granted(&direct, &["api"], 1, Priority::Bulk).await;
        direct.settle(&more, 0).await.unwrap();
    }
    assert!(
        started.elapsed() < late,
        "the 32 settlements took {:?}, the late copy may have come first",
        started.elapsed()
    );
    let before = direct.usage("api").await.unwrap();
    assert_eq!((before.bulk, before.pending), (11, 10), "{before:?}");
    // The first sending arrives now, inside the reservation's end slot.
    tokio::time::sleep(late.saturating_sub(started.elapsed()) + Duration::from_millis(700)).await;
    let after = direct.usage("api").await.unwrap();
    assert_eq!(
        (after.bulk, after.pending),
        (11, 10),
        "the late first sending changed the counts: {after:?}"
    );
    direct.settle(&other, 10).await.unwrap();
}

/// Holds the first settling command `delay` on its way (its sender still waiting for the reply);
/// counts the settling commands.
struct FirstSettleSlow {
    delay: Duration,
    seen: Arc<AtomicUsize>,
}

impl Rules for FirstSettleSlow {
    fn command(&self, command: &mut Document) -> Action {
        if is_settlement(command) && self.seen.fetch_add(1, Ordering::SeqCst) == 0 {
            return Action::Delay(self.delay);
        }
        Action::Forward
    }
}

/// The other side of case 5's fix: a sending that reaches the limiter after its window (a link
/// slower than `send_window`) changes nothing, says so, and the settlement goes again at once,
/// by the limiter's clock as that reply gave it.
#[tokio::test]
async fn a_sending_slower_than_its_window_changes_nothing_and_goes_again() {
    let t = TestDb::new().await;
    let direct = RateLimits::open(&t.store).await.unwrap();
    direct
        .define("api", Limit::new(10, Duration::from_secs(60)))
        .await
        .unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let proxy = WireProxy::start(
        &common::server_uri(),
        FirstSettleSlow {
            delay: Duration::from_millis(600),
            seen: seen.clone(),
        },
    )
    .await;
    let limits = RateLimits::with_options(
        &Store::new(proxy.client().await.database(t.db.name())),
        RateLimitOptions::default().send_window(Duration::from_millis(200)),
    )
    .await
    .unwrap();
    let r = granted(&limits, &["api"], 4, Priority::Bulk).await;
    assert_eq!(
        limits.settle(&r, 1).await.unwrap(),
        Settled::Returned { unused: 3 }
    );
    assert_eq!(
        seen.load(Ordering::SeqCst),
        2,
        "the slow sending and one more"
    );
    let usage = direct.usage("api").await.unwrap();
    assert_eq!((usage.bulk, usage.pending), (1, 0), "{usage:?}");
}

/// Drops (never sends) the first `drops` settling commands on limiter `on`.
struct DropSettlesOn {
    on: &'static str,
    drops: usize,
    seen: Arc<AtomicUsize>,
}

impl Rules for DropSettlesOn {
    fn command(&self, command: &mut Document) -> Action {
        let settling = command_name(command).eq_ignore_ascii_case("findAndModify")
            && command
                .get_document("query")
                .is_ok_and(|q| q.get_str("_id") == Ok(self.on))
            && command.get_array("update").is_ok_and(|stages| {
                stages
                    .iter()
                    .filter_map(|s| s.as_document()?.get_document("$set").ok())
                    .any(|set| set.contains_key("_seen"))
            });
        if settling && self.seen.fetch_add(1, Ordering::SeqCst) < self.drops {
            return Action::Drop;
        }
        Action::Forward
    }
}

/// A settlement across two limiters that lands on one and fails on the other, then 32 more
/// settlements on the first, then the caller's retry: the retry settles the second and leaves the
/// first alone (sent to it again as a first sending, it would apply a second time, the first
/// sending's key being gone from the recent settlements).
#[tokio::test]
async fn a_retry_after_a_failure_on_one_limiter_does_not_settle_the_other_again() {
    let t = TestDb::new().await;
    let direct = RateLimits::open(&t.store).await.unwrap();
    for name in ["a", "b"] {
        direct
            .define(name, Limit::new(100, Duration::from_secs(60)))
            .await
            .unwrap();
    }
    let seen = Arc::new(AtomicUsize::new(0));
    let proxy = WireProxy::start(
        &common::server_uri(),
        DropSettlesOn {
            on: "b",
            drops: 3,
            seen: seen.clone(),
        },
    )
    .await;
    let limits = RateLimits::with_options(
        &Store::new(proxy.client().await.database(t.db.name())),
        RateLimitOptions::default().send_window(Duration::from_millis(200)),
    )
    .await
    .unwrap();
    let (r, other) = loop {
        let r = granted(&limits, &["a", "b"], 4, Priority::Bulk).await;
        let other = granted(&direct, &["a"], 10, Priority::Bulk).await;
        let coll = LIMITERS_COLLECTION;
        if end_slot(&t.db, coll, "a", &r).await == end_slot(&t.db, coll, "a", &other).await {
            break (r, other);
        }
        direct.settle(&r, 0).await.unwrap();
        direct.settle(&other, 0).await.unwrap();
    };
    let err = limits.settle(&r, 1).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert_eq!(
        seen.load(Ordering::SeqCst),
        3,
        "three sendings to b, all dropped"
    );
    for _ in 0..32 {
        let more = granted(&direct, &["a"], 1, Priority::Bulk).await;
        direct.settle(&more, 0).await.unwrap();
    }
    assert_eq!(
        limits.settle(&r, 1).await.unwrap(),
        Settled::Returned { unused: 3 }
    );
    let (a, b) = (
        direct.usage("a").await.unwrap(),
        direct.usage("b").await.unwrap(),
    );
    assert_eq!((a.bulk, a.pending), (11, 10), "{a:?}");
    assert_eq!((b.bulk, b.pending), (1, 0), "{b:?}");
    direct.settle(&other, 10).await.unwrap();
}

/// Case 7: a reservation's deadline is the hold of the limiter that granted it, as the granting
/// write returned it, not the one a process cached. A limiter deleted and defined again with a
/// hold of 300 ms under a process that read it with a hold of 10 s: that process's reservation
/// must be usable for 300 ms, not 10 s (the limiter stops counting its calls after 300 ms + grace
/// + a window).
#[tokio::test]
async fn a_reservations_deadline_is_the_hold_the_granting_write_returned() {
    let t = TestDb::new().await;
    let cached = RateLimits::open(&t.store).await.unwrap();
    let long = Limit::new(10, Duration::from_secs(60)).hold(Duration::from_secs(10));
    cached.define("api", long).await.unwrap();
    assert_eq!(cached.limit("api").await.unwrap(), long);
    // Another process deletes the limiter and defines it again with a shorter hold.
    t.db.collection::<Document>(LIMITERS_COLLECTION)
        .delete_many(doc! {})
        .await
        .unwrap();
    let short = long.hold(Duration::from_millis(300));
    RateLimits::open(&t.store)
        .await
        .unwrap()
        .define("api", short)
        .await
        .unwrap();
    let r = granted(&cached, &["api"], 1, Priority::Bulk).await;
    let answered = Instant::now();
    assert!(
        r.deadline() <= answered + Duration::from_millis(300),
        "deadline {:?} after the grant came back, the limiter's hold is 300 ms",
        r.deadline() - answered
    );
    assert_eq!(
        cached.limit("api").await.unwrap(),
        short,
        "the process now knows the limit the limiter has"
    );
    cached.settle(&r, 1).await.unwrap();
}

/// Case 7: a worker of the version before slots (which counted a `log` of reservations, each
/// grant a conditional update whose `$expr` summed the log's live entries) still running after
/// `define` moved its limiter to slots, with no validator on the collection to refuse its writes
/// (one a service without `dbAdmin` could not install). Its grant must not find room the slots
/// have given away: the move leaves a log that holds the whole limit for it.
#[tokio::test]
async fn a_worker_of_the_version_before_slots_finds_no_room_after_the_move() {
    let t = TestDb::new().await;
    let limits = RateLimits::open(&t.store).await.unwrap();
    let limit = Limit::new(10, Duration::from_secs(60));
    // A limiter as the version before slots left it, with 3 calls pending.
    let coll = t.db.collection::<Document>(LIMITERS_COLLECTION);
    // No validator, as on a collection the service could not change.
    t.db.run_command(doc! { "collMod": LIMITERS_COLLECTION, "validator": {} })
        .await
        .unwrap();
    let end = bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() + 70_000);
    coll.insert_one(doc! {
        "_id": "api",
        "calls": 10_i64, "window_ms": 60_000_i64, "reserved": 0_i64,
        "hold_ms": 10_000_i64, "grace_ms": 100_i64,
        "log": { "r1": { "n": 3_i64, "p": false, "e": end } },
        "wait": {},
    })
    .await
    .unwrap();
    limits.define("api", limit).await.unwrap();
    let usage = limits.usage("api").await.unwrap();
    assert_eq!(usage.bulk, 3, "the log's calls moved to slots");
    // The old worker's grant of 1 bulk call, as it sent it: room if the log's live bulk calls
    // plus max(reserved, live high) plus 1 fit in `calls`.
    let live = |high: bool| {
        doc! { "$sum": { "$map": {
            "input": { "$filter": {
                "input": { "$objectToArray": { "$ifNull": ["$log", {}] } },
                "as": "x",
                "cond": { "$and": [
                    { "$gte": ["$$x.v.e", { "$subtract": ["$$NOW", { "$add": ["$window_ms", 2] }] }] },
                    { "$eq": ["$$x.v.p", high] },
                ] },
            } },
            "as": "x",
            "in": "$$x.v.n",
        } } }
    };
    let old_grant = doc! {
        "_id": "api",
        "$expr": { "$lte": [
            { "$add": [live(false), { "$max": ["$reserved", live(true)] }, 1] },
            "$calls",
        ] },
    };
    let old_grant_lands = |name: &'static str| {
        let mut filter = old_grant.clone();
        filter.insert("_id", name);
        let coll = coll.clone();
        async move {
            let entry = doc! { "n": 1_i64, "p": false, "e": end };
            let result = coll
                .update_one(filter, doc! { "$set": { "log.old-worker": entry } })
                .await
                .unwrap();
            result.matched_count == 1
        }
    };
    assert!(
        !old_grant_lands("api").await,
        "the old worker's grant found room in a limiter moved to slots"
    );
    // The new version still grants from the slots, and a second define changes nothing.
    let r = granted(&limits, &["api"], 7, Priority::Bulk).await;
    limits.define("api", limit).await.unwrap();
    assert_eq!(limits.usage("api").await.unwrap().bulk, 10);
    limits.settle(&r, 0).await.unwrap();
    // A limiter created in slots, and one the previous version (slots, no log) left: define
    // closes its log too.
    limits.define("fresh", limit).await.unwrap();
    limits.define("left", limit).await.unwrap();
    coll.update_one(doc! { "_id": "left" }, doc! { "$unset": { "log": "" } })
        .await
        .unwrap();
    limits.define("left", limit).await.unwrap();
    for name in ["fresh", "left"] {
        assert!(
            !old_grant_lands(name).await,
            "{name}: the old worker's grant found room"
        );
        let r = granted(&limits, &[name], 10, Priority::Bulk).await;
        limits.settle(&r, 0).await.unwrap();
    }
    let schema = mongotx::schema::JsonSchema::parse(
        LIMITERS_COLLECTION,
        mongotx::ratelimit::LIMITERS_SCHEMA,
    )
    .unwrap();
    for doc in common::raw_snapshot(&t.db, LIMITERS_COLLECTION).await {
        schema
            .validate(&doc)
            .unwrap_or_else(|v| panic!("{doc} breaks the schema: {v}"));
    }
}

/// Case 6: the limiter's clock is `$$NOW` of the node that holds its document. A limiter moved to
/// a node whose clock is `d` ahead (a failover, or a chunk migration to another shard) sees every
/// call `d` older than it is: the calls made stop counting `window - d` after they were made, and
/// the limiter grants the whole limit again then, so an interval of one window holds up to twice
/// the limit (in general, the limit plus the calls made in a span of `d`). A node whose clock is
/// behind keeps them counted `d` longer (the limiter only stalls). A limit with a `skew` of at
/// least `d` keeps the bound across the step: its calls count `skew` longer. This is what
/// docs/ratelimit.md states; the test pins it down with the local server's per-collection clocks.
#[tokio::test]
async fn a_limiter_moved_to_a_clock_ahead_forgets_its_calls_early_unless_its_skew_covers_it() {
    let d = Duration::from_millis(2_000);
    let window = Duration::from_millis(3_000);
    let server = tokio::task::spawn_blocking(move || {
        mongotx::testkit::local_server::LocalServer::start_with(&[
            "--clock-offset".to_string(),
            format!(
                "limits_ahead=+{}ms,limits_behind=-{}ms",
                d.as_millis(),
                d.as_millis()
            ),
        ])
    })
    .await
    .expect("join")
    .expect("a local test server with per-collection clocks");
    let client = mongodb::Client::with_uri_str(server.uri()).await.unwrap();
    let db = client.database(&format!(
        "mongotx_test_{}",
        bson::oid::ObjectId::new().to_hex()
    ));
    let store = Store::new(db.clone());
    let on = |collection: &'static str| {
        let store = store.clone();
        async move {
            RateLimits::with_options(&store, RateLimitOptions::default().collection(collection))
                .await
                .unwrap()
        }
    };
    let (here, ahead, behind) = (
        on("limits_here").await,
        on("limits_ahead").await,
        on("limits_behind").await,
    );
    let limit = Limit::new(10, window).hold(Duration::from_millis(500));
    here.define("api", limit).await.unwrap();
    here.define("skewed", limit.skew(d)).await.unwrap();
    for name in ["api", "skewed"] {
        let r = granted(&here, &[name], 10, Priority::Bulk).await;
        here.settle(&r, 10).await.unwrap();
    }
    let made = Instant::now();
    // The documents move, with their clock-stamped slots, to the nodes ahead and behind.
    for name in ["api", "skewed"] {
        let moved = db
            .collection::<Document>("limits_here")
            .find_one(doc! { "_id": name })
            .await
            .unwrap()
            .unwrap();
        for to in ["limits_ahead", "limits_behind"] {
            db.collection::<Document>(to)
                .insert_one(&moved)
                .await
                .unwrap();
        }
    }
    // Which copies grant the whole limit again: (here, ahead, behind) for "api", then for
    // "skewed".
    let try_all = || async {
        let mut granted = Vec::new();
        for name in ["api", "skewed"] {
            for limits in [&here, &ahead, &behind] {
                let attempt = limits
                    .try_reserve(&[name], 10, Priority::Bulk)
                    .await
                    .unwrap();
                if let Attempt::Granted(r) = &attempt {
                    limits.settle(r, 0).await.unwrap();
                }
                granted.push(is_granted(&attempt));
            }
        }
        granted
    };
    let at = |ms: u64| async move {
        tokio::time::sleep(
            (made + Duration::from_millis(ms)).saturating_duration_since(Instant::now()),
        )
        .await;
    };
    const NONE: [bool; 6] = [false; 6];
    // Just after the calls: every copy counts them.
    assert_eq!(try_all().await, NONE, "at once");
    // window - d (1 s) later, give or take a slot (47 ms) and the scheduler: the copy ahead has
    // let them go, 2 s before the window ends; with a skew of d it has not.
    at(700).await;
    assert_eq!(try_all().await, NONE, "0.7 s after the calls");
    at(1_400).await;
    assert_eq!(
        try_all().await,
        [false, true, false, false, false, false],
        "1.4 s after the calls: the copy whose clock is 2 s ahead grants the limit again"
    );
    // One window later the node's own copy lets them go, and so does the skewed copy ahead
    // (window + skew - d); the copy behind d later still.
    at(2_700).await;
    assert_eq!(
        try_all().await,
        [false, true, false, false, false, false],
        "2.7 s after the calls"
    );
    at(3_400).await;
    assert_eq!(
        try_all().await,
        [true, true, false, false, true, false],
        "3.4 s after the calls"
    );
    at(5_400).await;
    assert_eq!(
        try_all().await,
        [true, true, true, true, true, false],
        "5.4 s after the calls: window + d behind, window + skew here"
    );
    at(7_400).await;
    assert_eq!(
        try_all().await,
        [true; 6],
        "7.4 s: window + skew + d behind"
    );
}
