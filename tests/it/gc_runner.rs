//! The GC loop: `GcRunner` in-process (it recovers a dead coordinator's transaction on its own
//! interval and returns once its shutdown future completes), and the `mongotx-gc` binary that
//! wraps it as a process: it recovers a transaction whose coordinator died, exits cleanly on
//! SIGTERM, and refuses bad configuration or an unreachable server.

use crate::common;

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use crate::common::{raw_snapshot, CrashAt, TestDb};
use mongotx::options::TxnOptions;
use mongotx::testkit::failpoint::{self, Failpoint};
use mongotx::{fields, Adjust, Transactions, TxnError};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const GC: &str = env!("CARGO_BIN_EXE_mongotx-gc");

/// Stages a transfer a → b and kills its coordinator (an injected crash before its abort, after
/// b changed under it): a staging transaction holding `a` that only a GC can roll back once its
/// 300 ms deadline has passed.
async fn dead_transfer(t: &TestDb, accounts: &mongotx::Repository<common::Account>) {
    let txns = Transactions::with_options(
        &t.store,
        TxnOptions::default()
            .timeout(Duration::from_millis(300))
            .fault_injector(Arc::new(CrashAt(Failpoint {
                name: failpoint::ABORT_BEFORE,
                step: 0,
            }))),
    );
    let tx = txns.begin();
    tx.adjust(accounts, "a", 1, &Adjust::new().by("balance", -30_i64))
        .await
        .expect("stage");
    tx.adjust(accounts, "b", 1, &Adjust::new().by("balance", 30_i64))
        .await
        .expect("stage");
    accounts
        .update("b", 1, &mongotx::Update::new().set("note", "outside"))
        .await
        .expect("outside write");
    assert!(matches!(tx.commit().await, Err(TxnError::Crashed { .. })));
}

#[tokio::test]
async fn an_in_process_gc_runner_recovers_a_dead_transaction_and_shuts_down_gracefully() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100), ("b", 50)]).await;
    dead_transfer(&t, &accounts).await;
    let held = raw_snapshot(&t.db, "accounts").await;
    assert!(
        held.iter().any(|d| d.contains_key(fields::ACTIVE_TXN)),
        "the dead transaction holds a: {held:?}"
    );

    let runner = mongotx::GcRunner::new(&t.store, mongotx::gc::GcOptions::default())
        .interval(Duration::from_millis(100));
    let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
    let (passes, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn({
        let runner = runner.clone();
        async move {
            runner
                .run(
                    async {
                        let _ = stop.await;
                    },
                    move |pass| {
                        let _ = passes.send((
                            pass.round
                                .as_ref()
                                .map(|r| r.rolled_back)
                                .map_err(|e| e.to_string()),
                            pass.quota.is_some(),
                        ));
                    },
                )
                .await
        }
    });
    let mut rolled_back = 0;
    let mut count = 0;
    tokio::time::timeout(Duration::from_secs(30), async {
        while rolled_back == 0 {
            let (round, quota) = seen.recv().await.expect("the runner stopped early");
            rolled_back += round.expect("a GC round failed");
            assert!(
                !quota,
                "no quota providers here: the quota sweep must not run"
            );
            count += 1;
        }
    })
    .await
    .expect("no recovery within 30 s");
    assert_eq!(rolled_back, 1);
    // It keeps passing on its interval until told to stop.
    let (later, _) = tokio::time::timeout(Duration::from_secs(10), seen.recv())
        .await
        .expect("no pass after the recovery")
        .expect("the runner stopped early");
    assert_eq!(
        later,
        Ok(0),
        "a pass after the recovery has nothing left to do"
    );
    assert!(!runner.is_stopped());
    shutdown.send(()).expect("the runner is running");
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the runner did not return after its shutdown future completed")
        .expect("the runner panicked");
    assert!(runner.is_stopped() && count >= 1);

    let a = accounts.get("a").await.expect("a");
    let b = accounts.get("b").await.expect("b");
    assert_eq!((a.balance, b.balance), (100, 50));
    common::assert_settled(&t, &["accounts"], "after the in-process runner").await;
}

#[tokio::test]
async fn the_gc_runner_recovers_a_dead_transaction_and_stops_on_sigterm() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100), ("b", 50), ("old", 1)]).await;
    accounts
        .delete("old", 1)
        .await
        .expect("a tombstone to purge");
    // The coordinator dies after b's apply was refused (b changed under it) and before it could
    // abort: a staging transaction holding a, which the GC must fence (b) and abort once its
    // deadline has passed on the server's clock.
    dead_transfer(&t, &accounts).await;
    let held = raw_snapshot(&t.db, "accounts").await;
    let holders: Vec<&str> = held
        .iter()
        .filter(|d| d.contains_key(fields::ACTIVE_TXN))
        .filter_map(|d| d.get_str("_id").ok())
        .collect();
    assert_eq!(holders, vec!["a"], "{held:?}");

    let mut child = Command::new(GC)
        .args([
            "--uri",
            &common::server_uri(),
            "--db",
            t.db.name(),
            "--interval",
            "200ms",
            "--tombstone-retention",
            "1ms",
            "--version-floor-grace",
            "300ms",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start mongotx-gc");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut purged = 0;
    let recovered = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.expect("read") {
            purged += line
                .split_once("purged=")
                .and_then(|(_, n)| n.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap_or(0);
            if line.contains("rolled_back=1") {
                return line;
            }
        }
        panic!("mongotx-gc exited without recovering the transaction");
    })
    .await
    .expect("no recovery within 30 s");
    assert!(recovered.starts_with("round: "), "{recovered}");
    assert_eq!(
        purged, 1,
        "the one tombstone is purged by --tombstone-retention"
    );
    assert!(matches!(
        accounts.get("old").await,
        Err(mongotx::RepoError::NotFound { .. })
    ));

    let a = accounts.get("a").await.expect("a");
    let b = accounts.get("b").await.expect("b");
    assert_eq!((a.balance, b.balance), (100, 50));
    common::assert_settled(&t, &["accounts"], "after the GC runner's round").await;

    let pid = child.id().expect("pid").to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .expect("kill");
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .expect("mongotx-gc did not stop after SIGTERM")
        .expect("wait");
    assert!(status.success(), "exit status after SIGTERM: {status}");
}

#[tokio::test]
async fn the_gc_runner_refuses_bad_configuration_and_an_unreachable_server() {
    let bad_interval = Command::new(GC)
        .args([
            "--uri",
            "mongodb://127.0.0.1:1",
            "--db",
            "x",
            "--interval",
            "soon",
        ])
        .output()
        .await
        .expect("run");
    assert!(!bad_interval.status.success());
    assert!(String::from_utf8_lossy(&bad_interval.stderr).contains("not a duration"));

    let no_db = Command::new(GC)
        .args(["--uri", "mongodb://127.0.0.1:1"])
        .output()
        .await
        .expect("run");
    assert!(!no_db.status.success());
    assert!(String::from_utf8_lossy(&no_db.stderr).contains("--db"));

    // Port 1 on loopback: nothing listens there.
    let unreachable = Command::new(GC)
        .args([
            "--uri",
            "mongodb://127.0.0.1:1",
            "--db",
            "x",
            "--once",
            "--connect-timeout",
            "500ms",
        ])
        .output()
        .await
        .expect("run");
    assert_eq!(unreachable.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&unreachable.stderr).contains("cannot reach the server"),
        "{}",
        String::from_utf8_lossy(&unreachable.stderr)
    );
}

#[tokio::test]
async fn the_gc_runner_returns_expired_quota_reservations() {
    use mongotx::quota::{NewProvider, Quota, Request};
    let t = common::TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    quota
        .create(NewProvider::new(("project", "cores"), 10))
        .await
        .unwrap();
    quota
        .reserve(
            &Request::new("vm").take(("project", "cores"), 7),
            Duration::from_millis(200),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let out = Command::new(GC)
        .args([
            "--uri",
            &common::server_uri(),
            "--db",
            t.db.name(),
            "--once",
        ])
        .output()
        .await
        .expect("run the GC");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("quota: expired=1"), "{stdout}");
    let p = quota.provider(("project", "cores")).await.unwrap();
    assert_eq!((p.usage, p.reserved), (0, 0));
}

/// The value of series `name` (a line `name value`, labels included in the name) in a
/// Prometheus page; 0 when the page has none yet (the library's series appear when first
/// recorded).
fn metric(page: &str, name: &str) -> f64 {
    page.lines()
        .find_map(|line| {
            let (key, value) = line.rsplit_once(' ')?;
            (key == name).then(|| value.trim().parse().ok()).flatten()
        })
        .unwrap_or(0.0)
}

#[tokio::test]
async fn the_gc_runner_serves_metrics_that_move_with_its_work_and_a_health_check() {
    use mongotx::quota::{NewProvider, Quota, Request};
    use mongotx::ratelimit::{Limit, Priority, RateLimits};
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100), ("b", 50)]).await;
    // Work for each counter: a dead coordinator's transaction (rolled back), an expired quota
    // reservation (returned), a limiter whose only entry stops counting (pruned).
    let txns = Transactions::with_options(
        &t.store,
        TxnOptions::default()
            .timeout(Duration::from_millis(300))
            .fault_injector(Arc::new(CrashAt(Failpoint {
                name: failpoint::ABORT_BEFORE,
                step: 0,
            }))),
    );
    let tx = txns.begin();
    tx.adjust(&accounts, "a", 1, &Adjust::new().by("balance", -30_i64))
        .await
        .unwrap();
    tx.adjust(&accounts, "b", 1, &Adjust::new().by("balance", 30_i64))
        .await
        .unwrap();
    accounts
        .update("b", 1, &mongotx::Update::new().set("note", "outside"))
        .await
        .unwrap();
    assert!(matches!(tx.commit().await, Err(TxnError::Crashed { .. })));
    let quota = Quota::open(&t.store).await.unwrap();
    quota
        .create(NewProvider::new(("project", "cores"), 10))
        .await
        .unwrap();
    quota
        .reserve(
            &Request::new("vm").take(("project", "cores"), 7),
            Duration::from_millis(300),
        )
        .await
        .unwrap();
    let limits = RateLimits::open(&t.store).await.unwrap();
    limits
        .define("api", Limit::new(10, Duration::from_millis(100)))
        .await
        .unwrap();
    let r = limits.reserve(&["api"], 1, Priority::High).await.unwrap();
    limits.settle(&r, 1).await.unwrap();

    let mut child = Command::new(GC)
        .args([
            "--uri",
            &common::server_uri(),
            "--db",
            t.db.name(),
            "--interval",
            "200ms",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start mongotx-gc");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = lines.next_line().await.unwrap().expect("a first line");
    let base = first
        .strip_prefix("metrics: ")
        .and_then(|rest| rest.split(',').next())
        .and_then(|url| url.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no metrics address in {first:?}"))
        .to_string();
    // The runner's other lines are not needed; keep its pipe drained.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let http = reqwest::Client::new();
    let scrape = || async {
        let response = http
            .get(format!("{base}/metrics"))
            .send()
            .await
            .expect("scrape /metrics");
        assert!(response.status().is_success());
        response.text().await.expect("metrics body")
    };

    let started = std::time::Instant::now();
    let page = loop {
        let page = scrape().await;
        let done = metric(&page, r#"mongotx_gc_resolved_total{result="rolled_back"}"#) >= 1.0
            && metric(&page, "mongotx_gc_quota_expired_total") >= 1.0
            && metric(&page, "mongotx_gc_ratelimit_pruned_total") >= 1.0;
        if done {
            break page;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the counters did not move within 30 s:\n{page}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let rounds = metric(&page, r#"mongotx_gc_rounds_total{outcome="ok"}"#);
    assert!(rounds >= 1.0, "{page}");
    assert!(metric(&page, "mongotx_gc_quota_sweeps_total") >= 1.0);
    assert!(metric(&page, "mongotx_gc_ratelimit_sweeps_total") >= 1.0);
    assert!(metric(&page, "mongotx_gc_round_duration_seconds_count") >= rounds);
    // One runner: no round left anything to another's claims (the counter is there, at 0).
    assert!(
        page.contains("\nmongotx_gc_left_to_claims_total 0\n"),
        "{page}"
    );
    assert!(
        !page.contains(r#"mongotx_gc_rounds_total{outcome="failed"}"#),
        "no round failed: {page}"
    );
    assert!(page.contains("# TYPE mongotx_gc_round_duration_seconds histogram"));
    // The library's descriptions are there too.
    assert!(page.contains("# HELP mongotx_gc_resolved_total "), "{page}");
    // What the counters say happened did happen.
    let (a, b) = (
        accounts.get("a").await.unwrap(),
        accounts.get("b").await.unwrap(),
    );
    assert_eq!((a.balance, b.balance), (100, 50));
    let p = quota.provider(("project", "cores")).await.unwrap();
    assert_eq!((p.usage, p.reserved), (0, 0));

    // Rounds keep coming: a later scrape counts more.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let later = scrape().await;
    assert!(
        metric(&later, r#"mongotx_gc_rounds_total{outcome="ok"}"#) > rounds,
        "{later}"
    );
    let health = http.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
    let body = health.text().await.unwrap();
    assert!(body.contains(r#""status":"ok""#), "{body}");
    let _ = child.kill().await;
}
