//! OBT leases across processes: a contender whose wall clock runs 60 s ahead cannot take over a
//! live, heart-beating owner by either rule; once the owner's process is killed, a contender
//! takes over after the lease, by either rule.

use crate::common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::common::TestDb;
use mongotx::obt::Obt;

const LEASE: &str = "1s";

fn skew_library() -> PathBuf {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("bash")
        .arg(format!("{root}/tools/skew.sh"))
        .output()
        .expect("run tools/skew.sh");
    assert!(
        out.status.success(),
        "tools/skew.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn torture(t: &TestDb, role: &str, args: &[&str], skew_ms: Option<i64>) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_mongotx-torture"));
    command
        .arg(role)
        .args([
            "--uri",
            &common::server_uri(),
            "--db",
            t.db.name(),
            "--id",
            "attach/dlv0",
        ])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(ms) = skew_ms {
        command
            .env("LD_PRELOAD", skew_library())
            .env("MONGOTX_SKEW_MS", ms.to_string());
    }
    command.spawn().expect("start mongotx-torture")
}

/// The first line of `child`'s output that starts with `prefix`.
fn line(child: &mut Child, prefix: &str) -> String {
    let out = child.stdout.as_mut().expect("piped stdout");
    let mut reader = BufReader::new(out);
    let mut text = String::new();
    loop {
        text.clear();
        if reader.read_line(&mut text).unwrap() == 0 {
            panic!("no line starting with {prefix:?}");
        }
        if text.starts_with(prefix) {
            return text.trim().to_string();
        }
    }
}

fn contender(t: &TestDb, name: &str, rule: &str, for_: &str, skew_ms: Option<i64>) -> Child {
    torture(
        t,
        "obt-contender",
        &["--owner", name, "--rule", rule, "--for", for_],
        skew_ms,
    )
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skewed_contender_waits_for_a_live_lease_and_takes_over_a_killed_owner() {
    let _turn = common::fleet_turn(module_path!());
    let t = TestDb::new().await;
    let obt = Obt::open(&t.store).await.unwrap();
    let mut owner = torture(
        &t,
        "obt-owner",
        &["--owner", "api-1", "--lease", LEASE],
        None,
    );
    let owned = line(&mut owner, "owned ");

    // Contenders 60 s ahead, by both rules, for three leases: neither gets it.
    let mut early = vec![
        contender(&t, "ahead-monotonic", "monotonic", "3s", Some(60_000)),
        contender(&t, "ahead-server", "server", "3s", Some(60_000)),
    ];
    for c in &mut early {
        let clock: i64 = line(c, "clock ")[6..].parse().unwrap();
        let skew = clock - now_ms();
        assert!(
            (55_000..65_000).contains(&skew),
            "the contender's clock is {skew} ms off"
        );
    }
    for mut c in early {
        let verdict = line(&mut c, "never");
        assert!(!c.wait().unwrap().success());
        println!("while the owner lives: {verdict}");
    }
    assert_eq!(
        obt.get("attach/dlv0").await.unwrap().owner,
        "api-1",
        "{owned}"
    );

    // The owner's process dies. A skewed contender by the server's clock takes over, no sooner
    // than one lease after the owner's last heartbeat.
    owner.kill().unwrap();
    owner.wait().unwrap();
    let killed = Instant::now();
    let last_beat = obt.get("attach/dlv0").await.unwrap().beat_at.unwrap();
    let mut by_server = contender(&t, "ahead-server", "server", "10s", Some(60_000));
    let took = line(&mut by_server, "took ");
    assert!(by_server.wait().unwrap().success());
    let after = killed.elapsed();
    println!("by the server's clock: {took}, {after:?} after the kill");
    assert!(
        after >= Duration::from_millis(700),
        "took over {after:?} after the kill"
    );
    let state = obt.get("attach/dlv0").await.unwrap();
    assert_eq!(state.owner, "ahead-server");
    // In the server's own time, the take-over came a whole lease after the last heartbeat.
    let waited = state.beat_at.unwrap().timestamp_millis() - last_beat.timestamp_millis();
    assert!(
        waited >= 1_000,
        "taken over {waited} ms (server time) after the last heartbeat"
    );

    // That contender has exited without heartbeats: one running behind takes it over from it by
    // its own monotonic clock.
    let mut by_monotonic = contender(&t, "behind-monotonic", "monotonic", "10s", Some(-60_000));
    let took = line(&mut by_monotonic, "took ");
    assert!(by_monotonic.wait().unwrap().success());
    println!("by the monotonic rule: {took}");
    let now = obt.get("attach/dlv0").await.unwrap();
    assert_eq!(now.owner, "behind-monotonic");
    assert!(now.token > state.token);
    let waited =
        now.beat_at.unwrap().timestamp_millis() - state.beat_at.unwrap().timestamp_millis();
    assert!(
        waited >= 1_000,
        "taken over {waited} ms after the previous owner's last sign of life"
    );
}
