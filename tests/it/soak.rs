//! The soak run's short form: `mongotx-torture soak --minutes 1 --interval 5s`, every system at
//! once for a minute (transfers with kills, quota, the rate limiter, OBTs with preemption,
//! batches to the ledger simulator, GC runners, adoption), must pass its end checks and its
//! trend rules and leave a sample of every series. The long form (30 minutes by default, 60 for
//! the charts of docs/benchmarks.md) is run by hand.

use crate::common;

use std::collections::BTreeSet;
use std::process::Command;

use mongotx::testkit::test_server::ServerKind;

/// Every series a sample carries in a run of a minute (operations whose windows all had no
/// operation may miss from one sample, never from all).
const RSS: [&str; 7] = [
    "checker-0",
    "gc-0",
    "gc-1",
    "quota-worker-0",
    "rate-worker-0",
    "queue-worker-0",
    "soak",
];
const OPS: [&str; 12] = [
    "adopt.run",
    "gc.pass",
    "obt.heartbeat",
    "obt.preempt",
    "plain.delete",
    "queue.add",
    "queue.submit",
    "quota.consume",
    "quota.release",
    "ratelimit.reserve.bulk",
    "ratelimit.reserve.high",
    "transfer.commit",
];
const COUNTS: [&str; 15] = [
    "records",
    "held.accounts",
    "held.transfers",
    "held.quota_providers",
    "held.plain",
    "tombstones",
    "quota_providers",
    "ratelimits",
    "obts",
    "obt_tokens",
    "mongotx_meta",
    "batches",
    "batches.open",
    "plain.unadopted",
    "transfers",
];

#[test]
fn a_minute_of_every_system_at_once_shows_no_trend_and_samples_every_series() {
    let _turn = common::fleet_turn(module_path!());
    let out = std::env::temp_dir().join(format!("mongotx-soak-{}", std::process::id()));
    let mut command = Command::new(env!("CARGO_BIN_EXE_mongotx-torture"));
    command
        .args(["soak", "--minutes", "1", "--interval", "5s", "--out"])
        .arg(&out);
    // As the torture tests: a real MongoDB when the harness has one, else a local test server
    // of the run's own.
    match common::server_kind() {
        ServerKind::Local => command.env_remove("MONGODB_URI"),
        _ => command.env("MONGODB_URI", common::server_uri()),
    };
    let started = std::time::Instant::now();
    let output = command.output().expect("start mongotx-torture soak");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    println!("{stdout}\n(took {:.0?})", started.elapsed());
    assert!(
        output.status.success() && stdout.contains("RESULT ok"),
        "soak failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let text = std::fs::read_to_string(out.join("samples.jsonl")).unwrap();
    let samples: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(samples.len() >= 10, "{} samples", samples.len());
    let keys = |field: &str| -> BTreeSet<String> {
        samples
            .iter()
            .flat_map(|s| s[field].as_object().unwrap().keys().cloned())
            .collect()
    };
    let (rss, ops, counts) = (keys("rss_kib"), keys("latency"), keys("count"));
    for name in RSS {
        assert!(rss.contains(name), "no memory of {name}: {rss:?}");
    }
    for op in OPS {
        assert!(ops.contains(op), "no latency of {op}: {ops:?}");
    }
    for name in COUNTS {
        assert!(counts.contains(name), "no count of {name}: {counts:?}");
    }
    for chart in ["soak_rss.svg", "soak_p99.svg", "soak_collections.svg"] {
        assert!(out.join(chart).is_file(), "no {chart}");
    }
    let _ = std::fs::remove_dir_all(&out);
}
