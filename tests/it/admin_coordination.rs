//! `mongotx quota`, `limiter`, `queue` and `obt` against states each test builds (a full
//! provider with outstanding and expired reservations, a striped one, a full limiter with a
//! dead worker's reservation and a bulk caller waiting, a batch whose submitter died, an OBT
//! preempted then released): every printed field is compared with the stored truth, read
//! directly with the driver, and a few text lines are checked as printed. Bad arguments are
//! refused with one line and the database is left as it was.

use std::time::Duration;

use bson::{doc, Bson, Document};
use chrono::{DateTime, Utc};
use serde_json::Value;
use tokio::process::Command;

use crate::common::{self, TestDb};
use mongotx::obt::{NewObt, Obt};
use mongotx::queue::{Batches, NewBatch, Submission};
use mongotx::quota::{NewProvider, Quota, Request};
use mongotx::ratelimit::{Limit, Priority, RateLimits};

const MONGOTX: &str = env!("CARGO_BIN_EXE_mongotx");

/// What a run of `mongotx` printed.
pub(crate) struct Run {
    pub(crate) code: Option<i32>,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    /// The stderr lines that say something: clap's hints after its error line (usage, help,
    /// and its indented lists, such as the arguments missing) left out.
    pub(crate) fn error_lines(&self) -> Vec<&str> {
        self.stderr
            .lines()
            .filter(|l| {
                !l.trim().is_empty()
                    && !l.starts_with("Usage:")
                    && !l.starts_with("For more information")
                    && !l.starts_with("  ")
            })
            .collect()
    }
}

/// Runs `mongotx --uri <test server> --db <db> args...`.
pub(crate) async fn mongotx(db: &str, args: &[&str]) -> Run {
    let output = tokio::time::timeout(
        Duration::from_secs(120),
        Command::new(MONGOTX)
            .args(["--uri", &common::server_uri(), "--db", db])
            .args(args)
            .env_remove("MONGODB_URI")
            .env_remove("RUST_LOG")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("mongotx {args:?} still running after 120 s"))
    .unwrap_or_else(|e| panic!("cannot run mongotx: {e}"));
    Run {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Runs `mongotx ... --json`, which must succeed, and parses what it printed.
pub(crate) async fn json(db: &str, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let run = mongotx(db, &all).await;
    assert_eq!(run.code, Some(0), "mongotx {args:?}: {}", run.stderr);
    serde_json::from_str(&run.stdout)
        .unwrap_or_else(|e| panic!("mongotx {args:?}: not JSON ({e}): {}", run.stdout))
}

/// Runs `mongotx ...` (text), which must succeed; its lines.
pub(crate) async fn text(db: &str, args: &[&str]) -> Vec<String> {
    let run = mongotx(db, args).await;
    assert_eq!(run.code, Some(0), "mongotx {args:?}: {}", run.stderr);
    run.stdout.lines().map(str::to_string).collect()
}

/// Asserts `lines` has a line starting with `start`, and returns it.
pub(crate) fn line<'a>(lines: &'a [String], start: &str) -> &'a str {
    lines
        .iter()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no line starting {start:?} in:\n{}", lines.join("\n")))
}

/// A JSON instant as the report prints it.
pub(crate) fn at(v: &Value) -> DateTime<Utc> {
    let text = v.as_str().unwrap_or_else(|| panic!("not an instant: {v}"));
    DateTime::parse_from_rfc3339(text)
        .unwrap_or_else(|e| panic!("{text}: {e}"))
        .with_timezone(&Utc)
}

fn date(d: &Document, field: &str) -> DateTime<Utc> {
    d.get_datetime(field)
        .unwrap_or_else(|e| panic!("{field} of {d}: {e}"))
        .to_chrono()
}

async fn docs(t: &TestDb, collection: &str, filter: Document) -> Vec<Document> {
    use futures::TryStreamExt;
    t.db.collection::<Document>(collection)
        .find(filter)
        .await
        .expect("find")
        .try_collect()
        .await
        .expect("read")
}

/// The stored stripes of provider (`scope`, `resource`), stripe 0 first.
async fn stripes(t: &TestDb, scope: &str, resource: &str) -> Vec<Document> {
    let mut found = docs(
        t,
        "quota_providers",
        doc! { "_id.scope": scope, "_id.resource": resource },
    )
    .await;
    found.sort_by_key(|d| {
        d.get_document("_id")
            .unwrap()
            .get_i64("stripe")
            .unwrap_or(0)
    });
    found
}

/// `mongotx quota` on a full provider with a confirmed allocation, a live reservation and an
/// expired one the GC has not swept, then with its limit lowered below its usage (`over`); and
/// on a full provider spread over stripes.
#[tokio::test]
async fn quota_reports_usage_reservations_and_what_is_stuck() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.expect("open");
    quota
        .create(NewProvider::new(("project/42", "cores"), 10))
        .await
        .expect("create");
    quota
        .consume(&Request::with_id("vm-a", "start").take(("project/42", "cores"), 4))
        .await
        .expect("consume");
    let live = quota
        .reserve(
            &Request::with_id("job-b", "r1").take(("project/42", "cores"), 3),
            Duration::from_secs(3600),
        )
        .await
        .expect("reserve");
    quota
        .reserve(
            &Request::with_id("job-c", "r2").take(("project/42", "cores"), 3),
            Duration::from_millis(200),
        )
        .await
        .expect("reserve");
    tokio::time::sleep(Duration::from_millis(600)).await;

    let db = t.db.name();
    let report = json(db, &["quota", "project/42:cores"]).await;
    let stored = stripes(&t, "project/42", "cores").await;
    assert_eq!(stored.len(), 1);
    let s = &stored[0];
    assert_eq!(report["provider"]["scope"], "project/42");
    assert_eq!(report["provider"]["resource"], "cores");
    assert_eq!(report["limit"], s.get_i64("limit").unwrap());
    assert_eq!(report["usage"], s.get_i64("usage").unwrap());
    assert_eq!(report["available"], s.get_i64("available").unwrap());
    assert_eq!(
        (report["limit"].as_i64(), report["usage"].as_i64()),
        (Some(10), Some(10))
    );
    assert_eq!(report["reserved"], 6);
    assert_eq!(report["generation"], s.get_i64("_version").unwrap());
    assert_eq!(report["over"], false);
    assert_eq!(report["allocations"], 1);
    assert_eq!(report["consumers"], 3);
    assert_eq!(report["stripes"].as_array().unwrap().len(), 1);
    let held = s.get_array("held").unwrap();
    let stored_exp = |consumer: &str| {
        held.iter()
            .filter_map(Bson::as_document)
            .find(|e| e.get_str("c").unwrap() == consumer)
            .map(|e| date(e, "exp"))
            .unwrap()
    };
    let reservations = report["reservations"].as_array().unwrap();
    assert_eq!(reservations.len(), 1, "{report:#}");
    assert_eq!(reservations[0]["consumer"], "job-b");
    assert_eq!(reservations[0]["request"], "r1");
    assert_eq!(reservations[0]["amount"], 3);
    assert_eq!(at(&reservations[0]["expires"]), stored_exp("job-b"));
    assert_eq!(at(&reservations[0]["expires"]), live.expires);
    let expired = report["expired"].as_array().unwrap();
    assert_eq!(expired.len(), 1, "{report:#}");
    assert_eq!(expired[0]["consumer"], "job-c");
    assert_eq!(expired[0]["amount"], 3);
    assert_eq!(at(&expired[0]["expires"]), stored_exp("job-c"));
    assert!(at(&expired[0]["expires"]) <= at(&report["now"]));

    let lines = text(db, &["quota", "project/42:cores"]).await;
    println!("{}", lines.join("\n"));
    assert_eq!(line(&lines, "provider: "), "provider: project/42:cores");
    assert_eq!(line(&lines, "usage: "), "usage: 10 (reserved 6)");
    assert_eq!(line(&lines, "available: "), "available: 0");
    assert_eq!(line(&lines, "reservations: "), "reservations: 1");
    assert!(line(&lines, "  job-b request r1: 3 until ").contains(" (in 59m "));
    assert!(line(&lines, "expired: ").starts_with("expired: 1 (still counted"));
    assert!(line(&lines, "  job-c request r2: 3 expired ").ends_with(" ago)"));

    // The GC's sweep returns the expired reservation: nothing is stuck any more.
    quota.sweep().await.expect("sweep");
    let report = json(db, &["quota", "project/42:cores"]).await;
    assert_eq!(report["expired"].as_array().unwrap().len(), 0);
    assert_eq!(report["usage"], 7);

    // A limit lowered below the usage marks the provider over.
    quota
        .set_limit(("project/42", "cores"), 5)
        .await
        .expect("set limit");
    let report = json(db, &["quota", "project/42:cores"]).await;
    let s = &stripes(&t, "project/42", "cores").await[0];
    assert_eq!(report["over"], s.get_bool("over").unwrap());
    assert_eq!(report["over"], true);
    assert_eq!(report["available"], -2);
    let lines = text(db, &["quota", "project/42:cores"]).await;
    assert!(line(&lines, "over: ").starts_with("over: yes (the limit was lowered"));

    // A full provider of 40 allocations, spread over stripes whose shares add up to its limit.
    quota
        .create(NewProvider::new(("team", "seats"), 40))
        .await
        .expect("create");
    for i in 0..40 {
        quota
            .consume(&Request::with_id(format!("user-{i}"), "seat").take(("team", "seats"), 1))
            .await
            .expect("consume");
    }
    let report = json(db, &["quota", "team:seats"]).await;
    let stored = stripes(&t, "team", "seats").await;
    assert!(stored.len() > 1, "not striped: {stored:?}");
    let shown = report["stripes"].as_array().unwrap();
    assert_eq!(shown.len(), stored.len());
    for (s, d) in shown.iter().zip(&stored) {
        let number = d
            .get_document("_id")
            .unwrap()
            .get_i64("stripe")
            .unwrap_or(0);
        assert_eq!(s["stripe"], number);
        assert_eq!(s["bits"], d.get_i64("bits").unwrap_or(0));
        assert_eq!(s["limit"], d.get_i64("limit").unwrap());
        assert_eq!(s["usage"], d.get_i64("usage").unwrap());
        assert_eq!(s["available"], d.get_i64("available").unwrap());
        assert_eq!(s["entries"], d.get_array("held").unwrap().len());
        assert_eq!(s["version"], d.get_i64("_version").unwrap());
    }
    let versions: i64 = stored.iter().map(|d| d.get_i64("_version").unwrap()).sum();
    assert_eq!(report["generation"], versions);
    assert_eq!(
        (report["limit"].as_i64(), report["usage"].as_i64()),
        (Some(40), Some(40))
    );
    assert_eq!(report["allocations"], 40);
    let lines = text(db, &["quota", "team:seats"]).await;
    println!("{}", lines.join("\n"));
    assert_eq!(
        line(&lines, "stripes: "),
        format!("stripes: {}", stored.len())
    );
    assert!(line(&lines, "  stripe 0 ").contains("limit "));
}

/// `mongotx limiter` on a full limiter: calls settled, a reservation whose worker died (its end
/// passed without a settlement), a live high-priority one, and a bulk caller waiting.
#[tokio::test]
async fn limiter_reports_a_full_limiter_with_its_reservations() {
    let t = TestDb::new().await;
    let limits = RateLimits::open(&t.store).await.expect("open");
    let hold = Duration::from_secs(4);
    limits
        .define(
            "maps",
            Limit::new(10, Duration::from_secs(60))
                .reserved(2)
                .hold(hold),
        )
        .await
        .expect("define");
    let settled = limits
        .reserve(&["maps"], 5, Priority::Bulk)
        .await
        .expect("reserve");
    limits.settle(&settled, 5).await.expect("settle");
    // A worker that reserves 3 calls and dies: its end passes without a settlement.
    let dead = limits
        .reserve(&["maps"], 3, Priority::Bulk)
        .await
        .expect("reserve");
    // Past its end by more than a slot (about 500 ms here), so past the slot it ends in too.
    tokio::time::sleep(hold + Duration::from_millis(1500)).await;
    let live = limits
        .reserve(&["maps"], 2, Priority::High)
        .await
        .expect("reserve");
    // A bulk caller that waits for room, queued in the limiter.
    let waiter = {
        let limits = limits.clone();
        tokio::spawn(async move { limits.reserve(&["maps"], 1, Priority::Bulk).await })
    };
    let coll = t.db.collection::<Document>("ratelimits");
    let stored = loop {
        let d = coll
            .find_one(doc! { "_id": "maps" })
            .await
            .expect("read")
            .expect("limiter");
        if !d.get_document("wait").unwrap().is_empty() {
            break d;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };

    let db = t.db.name();
    let report = json(db, &["limiter", "maps"]).await;
    waiter.abort();
    let now = at(&report["now"]).timestamp_millis();
    assert_eq!(report["calls"], 10);
    assert_eq!(report["window_ms"], 60_000);
    assert_eq!(report["reserved"], 2);
    assert_eq!(report["hold_ms"], 4_000);
    assert_eq!(report["grace_ms"], 100);
    assert_eq!(report["skew_ms"], 0);
    // The stored slots, counted at the report's instant.
    let slot_ms = stored.get_i64("slot_ms").unwrap();
    let span = 60_000 + 2;
    let slots: Vec<(i64, i64, i64)> = stored
        .get_array("slots")
        .unwrap()
        .iter()
        .filter_map(Bson::as_document)
        .map(|s| {
            (
                s.get_i64("s").unwrap(),
                s.get_i64("b").unwrap(),
                s.get_i64("h").unwrap(),
            )
        })
        .filter(|(s, _, _)| (s + 1) * slot_ms > now - span)
        .collect();
    let bulk: i64 = slots.iter().map(|(_, b, _)| b).sum();
    let high: i64 = slots.iter().map(|(_, _, h)| h).sum();
    assert_eq!((bulk, high), (8, 2));
    assert_eq!(report["counted_bulk"], bulk);
    assert_eq!(report["counted_high"], high);
    let current = now.div_euclid(slot_ms);
    let pending: i64 = slots
        .iter()
        .filter(|(s, _, _)| *s > current)
        .map(|(_, b, h)| b + h)
        .sum();
    assert_eq!(report["pending"], pending);
    assert_eq!(pending, 2, "only the live reservation's end is ahead");
    assert_eq!(report["room_bulk"], 0);
    assert_eq!(report["room_high"], 0);
    // Room comes back when the earliest slot (the settled calls) ages out.
    let first = slots.iter().map(|(s, _, _)| *s).min().unwrap();
    let leaves = (first + 1) * slot_ms - 1 + span + 1;
    assert_eq!(at(&report["next_bulk"]).timestamp_millis(), leaves);
    assert_eq!(at(&report["next_high"]).timestamp_millis(), leaves);
    assert_eq!(report["next_bulk_in_ms"], leaves - now);

    // The two unsettled reservations, as the stored grants have them.
    let granted: Vec<&Document> = stored
        .get_array("granted")
        .unwrap()
        .iter()
        .filter_map(Bson::as_document)
        .collect();
    let grant = |id: &str| {
        *granted
            .iter()
            .find(|g| g.get_str("k").unwrap() == id)
            .unwrap()
    };
    let shown = report["reservations"].as_array().unwrap();
    assert_eq!(shown.len(), 2, "{report:#}");
    for (r, (id, calls, priority, state)) in shown.iter().zip([
        (dead.id().to_hex(), 3, "bulk", "overdue"),
        (live.id().to_hex(), 2, "high", "pending"),
    ]) {
        let g = grant(&id);
        let ends_by = (g.get_i64("s").unwrap() + 1) * slot_ms - 1;
        assert_eq!(r["id"], id.as_str());
        assert_eq!(r["calls"], calls);
        assert_eq!(g.get_i64("n").unwrap(), calls);
        assert_eq!(r["priority"], priority);
        assert_eq!(r["state"], state);
        assert_eq!(at(&r["ends_by"]).timestamp_millis(), ends_by);
        assert_eq!(
            at(&r["counted_until"]).timestamp_millis(),
            ends_by + span + 1
        );
    }
    let waiting = report["waiting"].as_array().unwrap();
    let (key, entry) = stored.get_document("wait").unwrap().iter().next().unwrap();
    let entry = entry.as_document().unwrap();
    assert_eq!(waiting.len(), 1);
    assert_eq!(waiting[0]["key"], key.as_str());
    assert_eq!(waiting[0]["calls"], entry.get_i64("n").unwrap());
    assert_eq!(at(&waiting[0]["since"]), date(entry, "since"));

    let lines = text(db, &["limiter", "maps"]).await;
    println!("{}", lines.join("\n"));
    assert_eq!(
        line(&lines, "limit: "),
        "limit: 10 calls per 1m 0s (2 reserved for high priority; hold 4.0s, grace 100ms, skew 0ms)"
    );
    assert_eq!(
        line(&lines, "counted: "),
        "counted: 10 of 10 in the window ending now (bulk 8, high 2)"
    );
    assert_eq!(line(&lines, "room now: "), "room now: bulk 0, high 0");
    assert!(line(&lines, "next bulk call: ").contains(" (in "));
    line(
        &lines,
        &format!("  {}: bulk 3 calls, overdue", dead.id().to_hex()),
    );
    line(
        &lines,
        &format!("  {}: high 2 calls, pending", live.id().to_hex()),
    );
    assert_eq!(line(&lines, "waiting: "), "waiting: 1 bulk caller");
    line(&lines, &format!("  {key}: 1 call, queued since "));
}

/// `mongotx queue` on a service whose first batch was claimed by a submitter that died before
/// sending it (its claim ran out with no answer), and on one whose batch the ledger forgot
/// (unknown: sent again first).
#[tokio::test]
async fn queue_reports_a_stuck_batch_and_what_goes_next() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.expect("open");
    // Adds `headers` to `service` and claims the first for `ttl` by `claimant`.
    let claimed = |service: &'static str, headers: &'static [&'static str], claimant, ttl| {
        let batches = batches.clone();
        async move {
            for header in headers {
                batches
                    .add(&NewBatch::new(service, *header, "payload"))
                    .await
                    .expect("add");
            }
            let first = batches.get(headers[0]).await.expect("get");
            batches
                .claim(&first, claimant, ttl)
                .await
                .expect("claim")
                .expect("claimed")
        }
    };
    // The submitter dies before sending.
    claimed(
        "svc",
        &["svc/1", "svc/2", "svc/3"],
        "dead-host",
        Duration::from_millis(300),
    )
    .await;
    let claim = claimed(
        "other",
        &["other/1", "other/2"],
        "host-a",
        Duration::from_secs(30),
    )
    .await;
    let pending = batches
        .record(&claim, Submission::Accepted)
        .await
        .expect("record");
    batches
        .record_status(&pending, mongotx::queue::BatchStatus::Unknown)
        .await
        .expect("unknown");
    tokio::time::sleep(Duration::from_millis(500)).await;

    let db = t.db.name();
    let report = json(db, &["queue", "svc"]).await;
    let now = at(&report["now"]);
    let stored = docs(&t, "batches", doc! { "service_id": "svc" }).await;
    let by_header = |h: &str| {
        stored
            .iter()
            .find(|d| d.get_str("_id").unwrap() == h)
            .unwrap()
    };
    let open = report["open"].as_array().unwrap();
    let headers: Vec<&str> = open.iter().map(|b| b["header"].as_str().unwrap()).collect();
    assert_eq!(headers, ["svc/1", "svc/2", "svc/3"]);
    for b in open {
        let d = by_header(b["header"].as_str().unwrap());
        assert_eq!(at(&b["created_at"]), date(d, "created_at"));
        assert_eq!(b["submitted"], d.get_bool("submitted").unwrap());
    }
    let d1 = by_header("svc/1");
    let c1 = d1.get_document("claim").unwrap();
    assert_eq!(open[0]["state"], "claim_expired");
    assert_eq!(open[0]["claimed_by"], c1.get_str("by").unwrap());
    assert_eq!(open[0]["claimed_by"], "dead-host");
    assert_eq!(at(&open[0]["claimed_until"]), date(c1, "until"));
    assert_eq!(open[1]["state"], "waiting");
    assert_eq!(open[2]["state"], "waiting");
    // The queue's own round queues nothing of the service: its first batch is with a submitter.
    let round = batches.round().await.expect("round");
    assert!(round.iter().all(|b| b.service_id != "svc"));
    assert_eq!(report["next"], Value::Null);
    let service =
        t.db.collection::<Document>("batches_services")
            .find_one(doc! { "_id": "svc" })
            .await
            .expect("read")
            .expect("service");
    let holder = service.get_document("holder").unwrap();
    assert_eq!(report["slot"]["header"], holder.get_str("header").unwrap());
    assert_eq!(report["slot"]["by"], "dead-host");
    assert_eq!(at(&report["slot"]["until"]), date(holder, "until"));
    assert_eq!(report["mark"], Value::Null);
    assert_eq!(report["done"], 0);
    assert_eq!(
        report["behind_ms"].as_i64().unwrap(),
        (now - date(d1, "created_at")).num_milliseconds()
    );
    let lines = text(db, &["queue", "svc"]).await;
    println!("{}", lines.join("\n"));
    let next = line(&lines, "next: ");
    assert!(
        next.starts_with("next: none queued now; first in line is svc/1: claimed by dead-host, whose claim ran out ")
            && next.ends_with(" ago) with no answer recorded: a monitor asks the ledger"),
        "{next}"
    );
    assert_eq!(line(&lines, "open batches: "), "open batches: 3 (0 done)");
    assert!(line(&lines, "slot: svc/1 (taken by dead-host until ").ends_with(" ago))"));

    // The forgotten batch goes again first, as the round says.
    let report = json(db, &["queue", "other"]).await;
    let round = batches.round().await.expect("round");
    let next = round.iter().find(|b| b.service_id == "other").unwrap();
    assert_eq!(report["next"], next.header.as_str());
    assert_eq!(report["next"], "other/1");
    let open = report["open"].as_array().unwrap();
    assert_eq!(open[0]["state"], "unknown");
    assert_eq!(open[0]["status"], "unknown");
    assert_eq!(open[0]["queued"], true);
    assert_eq!(open[1]["state"], "waiting");
    let lines = text(db, &["queue", "other"]).await;
    assert_eq!(
        line(&lines, "next: "),
        "next: other/1: unknown to the ledger: queued now, to be sent again"
    );
}

/// `mongotx obt` on an OBT owned with a lease, then preempted and moved on, then released (its
/// tombstone).
#[tokio::test]
async fn obt_reports_owner_token_lease_and_tombstone() {
    let t = TestDb::new().await;
    let obts = Obt::open(&t.store).await.expect("open");
    let owned = obts
        .create(NewObt::new("attach/dlv0", "api-1").lease(Duration::from_secs(10)))
        .await
        .expect("create");
    let db = t.db.name();
    let coll = t.db.collection::<Document>("obts");
    let stored = || async {
        coll.find_one(doc! { "_id": "attach/dlv0" })
            .await
            .expect("read")
            .expect("obt")
    };

    let report = json(db, &["obt", "attach/dlv0"]).await;
    let d = stored().await;
    assert_eq!(report["released"], false);
    assert_eq!(report["owner"], "api-1");
    assert_eq!(report["token"], owned.token.get());
    assert_eq!(report["token"], d.get_i64("token").unwrap());
    assert_eq!(report["stage"], 0);
    assert_eq!(report["version"], d.get_i64("_version").unwrap());
    assert_eq!(report["lease_ms"], 10_000);
    assert_eq!(at(&report["beat_at"]), date(&d, "beat_at"));
    let until = date(&d, "beat_at") + chrono::Duration::seconds(10);
    assert_eq!(at(&report["lease_until"]), until);
    assert_eq!(
        report["lease_left_ms"].as_i64().unwrap(),
        (until - at(&report["now"])).num_milliseconds()
    );
    assert_eq!(report["lease_expired"], false);
    assert_eq!(report["held_by"], Value::Null);

    let taken = obts
        .preempt("attach/dlv0", "api-1", "api-2")
        .await
        .expect("preempt");
    obts.advance("attach/dlv0", "api-2", 2)
        .await
        .expect("advance");
    let report = json(db, &["obt", "attach/dlv0"]).await;
    let d = stored().await;
    assert!(taken.token > owned.token);
    assert_eq!(report["owner"], "api-2");
    assert_eq!(report["owner"], d.get_str("owner").unwrap());
    assert_eq!(report["token"], taken.token.get());
    assert_eq!(report["token"], d.get_i64("token").unwrap());
    assert_eq!(report["stage"], 2);
    assert_eq!(report["version"], d.get_i64("_version").unwrap());
    assert_eq!(at(&report["beat_at"]), date(&d, "beat_at"));
    let lines = text(db, &["obt", "attach/dlv0"]).await;
    println!("{}", lines.join("\n"));
    assert_eq!(line(&lines, "state: "), "state: live");
    assert_eq!(line(&lines, "owner: "), "owner: api-2");
    assert_eq!(line(&lines, "stage: "), "stage: 2");
    assert_eq!(
        line(&lines, "token: "),
        format!("token: {}", taken.token.get())
    );
    assert!(line(&lines, "lease: 10.0s from the last heartbeat; runs out ").contains(" (in "));

    obts.release("attach/dlv0", "api-2").await.expect("release");
    let report = json(db, &["obt", "attach/dlv0"]).await;
    let d = stored().await;
    assert_eq!(report["released"], true);
    assert_eq!(report["owner"], "api-2");
    assert_eq!(report["token"], taken.token.get());
    assert_eq!(report["stage"], 2);
    assert_eq!(at(&report["released_at"]), date(&d, "_deleted"));
    assert_eq!(report["lease_ms"], Value::Null);
    let lines = text(db, &["obt", "attach/dlv0"]).await;
    println!("{}", lines.join("\n"));
    assert_eq!(line(&lines, "state: "), "state: released");
    assert_eq!(line(&lines, "released by: "), "released by: api-2");
    assert!(line(&lines, "released at: ").ends_with(" ago)"));
}

/// Unknown names are one line and exit status 1, malformed arguments one line and exit status
/// 2, and none of them writes anything (the database's every collection is compared).
#[tokio::test]
async fn bad_arguments_are_one_line_and_write_nothing() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.expect("open");
    quota
        .create(NewProvider::new(("p", "r"), 1))
        .await
        .expect("create");
    RateLimits::open(&t.store)
        .await
        .expect("open")
        .define("l", Limit::new(1, Duration::from_secs(1)))
        .await
        .expect("define");
    Batches::open(&t.store).await.expect("open");
    Obt::open(&t.store).await.expect("open");
    let before = common::refusals::snapshot(&t.db).await;
    let db = t.db.name();
    let cases: [(&[&str], i32, &str); 15] = [
        (
            &["quota", "p:nope"],
            1,
            "quota_providers/p:nope: no such quota provider",
        ),
        (&["quota", "nope:r"], 1, "no such quota provider"),
        (&["limiter", "nope"], 1, "ratelimits/nope: no such limiter"),
        (
            &["limiter", "l", "--collection", "limits2"],
            1,
            "limits2/l: no such limiter",
        ),
        (
            &["queue", "nope"],
            1,
            "batches: no batch of service nope was ever added",
        ),
        (&["obt", "nope"], 1, "obts/nope: no such OBT"),
        (
            &["obt", "x", "--collection", "obt_tokens"],
            1,
            "cannot keep OBTs there",
        ),
        (&["quota", "no-colon"], 2, "is not SCOPE:RESOURCE"),
        (
            &["quota"],
            2,
            "the following required arguments were not provided",
        ),
        (
            &["limiter", "l", "--collection", ""],
            2,
            "a collection name cannot be empty",
        ),
        (&["queue", "svc", "--delay", "2d"], 2, "must be at most"),
        (
            &["obt", "x", "--collection", "system.x"],
            2,
            "the system. prefix is reserved",
        ),
        (
            &["contention", "--since", "0s"],
            2,
            "must be more than zero",
        ),
        (&["contention", "--since", "2d"], 2, "must be at most"),
        (&["contention", "--top", "0"], 2, "0 is not in 1..=1000"),
    ];
    for (args, code, says) in cases {
        let run = mongotx(db, args).await;
        assert_eq!(run.code, Some(code), "{args:?}: {}", run.stderr);
        assert!(run.stdout.is_empty(), "{args:?} printed: {}", run.stdout);
        let lines = run.error_lines();
        assert_eq!(lines.len(), 1, "{args:?}: {lines:?}");
        assert!(lines[0].contains(says), "{args:?}: {:?}", lines[0]);
    }
    assert_eq!(common::refusals::snapshot(&t.db).await, before);

    // A database where nothing was ever opened: still nothing is created (beside the records'
    // and the registry's collections the harness makes with their validators).
    let empty = TestDb::new().await;
    let mut made = empty.db.list_collection_names().await.expect("list");
    made.sort();
    for args in [
        &["quota", "p:r"][..],
        &["limiter", "l"],
        &["queue", "s"],
        &["obt", "o"],
    ] {
        let run = mongotx(empty.db.name(), args).await;
        assert_eq!(run.code, Some(1), "{args:?}: {}", run.stderr);
    }
    let mut names = empty.db.list_collection_names().await.expect("list");
    names.sort();
    assert_eq!(names, made, "created");
}
