//! Isolation judged by an independent checker: list-append transactions from several worker
//! *processes* (`mongotx-torture append-worker`, two workloads side by side: reads unchecked and
//! reads checked with `check`) under one fault per test, their histories merged and handed to
//! `adya`, a Rust implementation of Jepsen's Elle that knows nothing of mongotx. From the values
//! the reads returned alone it infers the write-write, write-read and read-write dependencies
//! between the transactions and looks for the cycles each isolation model forbids (Adya's G0,
//! G1a, G1b, G1c, G-single, G2 and their real-time forms).
//!
//! What must hold (README, docs/guarantees.md): reads unchecked are read committed; with every
//! key read checked, the transactions are serializable, and strict serializable (one that ended
//! before another began is ordered first). The anomalies the stronger models find in the
//! unchecked workload are printed: read skew and write skew are expected there.
//!
//! A history that fails its check is kept under `target/tmp/isolation/<test>/` with the
//! checker's explanation, and the failure names the anomalies. Each run has the machine to itself
//! (a fleet turn of its own).

use crate::common;
use crate::torture::{number_after, torture};

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use adya::{check, History, Opts, Valid, Workload};
use serde_json::Value;

/// Where a run's histories go, and stay when a check fails.
fn history_dir(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("isolation")
        .join(test);
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// What one workload's merged history holds.
#[derive(Debug, Default)]
struct Counts {
    ok: usize,
    fail: usize,
    /// Ended unknown, or never ended (its process was killed).
    info: usize,
    killed: usize,
    /// Reads that returned a non-empty list.
    nonempty_reads: usize,
}

/// Merges every history file of `dir` into one history in the order of the machine's monotonic
/// clock; an operation whose process was killed before it ended gets an `info` (outcome unknown)
/// at the end, as Jepsen records it.
fn merge(dir: &Path) -> (String, Counts) {
    let mut ops: Vec<Value> = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            ops.push(
                serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("{}: {e}: {line}", path.display())),
            );
        }
    }
    ops.sort_by_key(|op| op["time"].as_i64().expect("every line has a time"));
    let mut counts = Counts::default();
    let mut open: HashMap<i64, Value> = HashMap::new();
    for op in &ops {
        let process = op["process"].as_i64().expect("a process");
        match op["type"].as_str().expect("a type") {
            "invoke" => {
                assert!(
                    open.insert(process, op.clone()).is_none(),
                    "process {process} invoked twice: {op}"
                );
            }
            ending => {
                open.remove(&process)
                    .unwrap_or_else(|| panic!("{op} ends nothing"));
                match ending {
                    "ok" => counts.ok += 1,
                    "fail" => counts.fail += 1,
                    _ => counts.info += 1,
                }
                counts.nonempty_reads += op["value"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|m| m[0] == "r" && m[2].as_array().is_some_and(|l| !l.is_empty()))
                    .count();
            }
        }
    }
    let end = ops.last().and_then(|op| op["time"].as_i64()).unwrap_or(0) + 1;
    let mut killed: Vec<Value> = open.into_values().collect();
    killed.sort_by_key(|op| op["time"].as_i64());
    for mut op in killed {
        op["type"] = "info".into();
        op["time"] = end.into();
        ops.push(op);
        counts.info += 1;
        counts.killed += 1;
    }
    let mut text = String::new();
    for (index, mut op) in ops.into_iter().enumerate() {
        op["index"] = index.into();
        text.push_str(&op.to_string());
        text.push('\n');
    }
    (text, counts)
}

/// The anomalies `model` finds in `history`: `Ok` with the anomaly types when it holds or not,
/// checked to a verdict (an unknown one fails the test).
fn judge(history: &History, model: &str) -> adya::Report {
    let opts = Opts {
        models: vec![model.into()],
        timeout: std::time::Duration::from_secs(20),
        ..Opts::default()
    };
    check(history, Workload::ListAppend, &opts)
}

/// The explanation of a report's anomalies (the first few of each type).
fn explain(report: &adya::Report) -> String {
    let mut out = String::new();
    for (kind, found) in &report.anomalies {
        out.push_str(&format!("{kind}: {} found\n", found.len()));
        for anomaly in found.iter().take(3) {
            out.push_str(&anomaly.explanation);
            out.push('\n');
        }
    }
    out
}

/// Checks one workload's history: `must` models must hold; `report` models are judged and their
/// anomalies printed. Keeps the history and the explanation when a `must` model fails.
fn check_workload(dir: &Path, mode: &str, must: &[&str], report: &[&str]) -> Counts {
    let (text, counts) = merge(&dir.join(mode));
    let history = History::from_json(&text).expect("the merged history parses");
    let mut line = format!(
        "isolation {} {mode}: {} ok, {} failed, {} unknown ({} killed mid-transaction), {} non-empty reads",
        dir.file_name().unwrap().to_string_lossy(),
        counts.ok,
        counts.fail,
        counts.info,
        counts.killed,
        counts.nonempty_reads
    );
    for model in must.iter().chain(report) {
        let verdict = judge(&history, model);
        let types = verdict.anomaly_types.join(", ");
        line.push_str(&match verdict.valid {
            Valid::True => format!("; {model}: holds"),
            _ => format!("; {model}: {types}"),
        });
        if must.contains(model) && verdict.valid != Valid::True {
            let kept = dir.join(format!("{mode}.jsonl"));
            std::fs::write(&kept, &text).unwrap();
            let explanation = explain(&verdict);
            std::fs::write(dir.join(format!("{mode}-{model}.txt")), &explanation).unwrap();
            panic!(
                "{line}\n{model} does not hold for the {mode} workload ({:?}); history kept in {}:\n{explanation}",
                verdict.valid,
                kept.display()
            );
        }
    }
    println!("{line}");
    // Enough happened for the verdict to mean something: transactions committed, reads saw
    // what others appended, and conflicts were met.
    assert!(counts.ok >= 20, "{line}");
    assert!(counts.nonempty_reads >= 10, "{line}");
    assert!(counts.fail > 0, "{line}");
    counts
}

/// Reads unchecked are read committed; reads checked are serializable and strict serializable.
fn check_both(dir: &Path) -> (Counts, Counts) {
    let unchecked = check_workload(
        dir,
        "unchecked",
        &["read-committed"],
        &["snapshot-isolation", "serializable", "strict-serializable"],
    );
    let checked = check_workload(
        dir,
        "checked",
        &["serializable", "strict-serializable"],
        &[],
    );
    (unchecked, checked)
}

/// Runs the torture with list-append workers and `faults`, then judges both workloads.
fn run(test: &'static str, seconds: u32, faults: &[&str]) -> (String, Counts, Counts) {
    let _turn = common::fleet_turn(test);
    let dir = history_dir(test.rsplit("::").next().unwrap());
    let history = dir.display().to_string();
    let seconds = seconds.to_string();
    let mut args = vec![
        "--seconds",
        &seconds,
        "--workers",
        "1",
        "--checkers",
        "0",
        "--append-workers",
        "2",
        "--history",
        &history,
    ];
    args.extend(faults);
    let report = torture(&args);
    let (unchecked, checked) = check_both(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    (report, unchecked, checked)
}

#[test]
fn coordinators_killed_at_random_moments() {
    let (report, unchecked, checked) = run(
        "isolation::coordinators_killed_at_random_moments",
        12,
        &["--no-network", "--kill-every", "600ms"],
    );
    assert!(number_after(&report, "faults: ") > 5, "{report}");
    assert!(
        unchecked.killed + checked.killed > 0,
        "no transaction was cut short by a kill:\n{report}"
    );
}

#[test]
fn replies_lost_and_writes_delivered_late() {
    let (report, _, _) = run(
        "isolation::replies_lost_and_writes_delivered_late",
        20,
        &["--no-kills", "--fault-every", "1s", "--late-rate", "0.05"],
    );
    assert!(
        number_after(&report, "SIGKILLs, ") > 0,
        "no reset:\n{report}"
    );
    assert!(
        number_after(&report, "stalls, ") > 0,
        "nothing delivered late:\n{report}"
    );
}

#[test]
fn clocks_a_minute_ahead_and_behind() {
    let (report, _, _) = run(
        "isolation::clocks_a_minute_ahead_and_behind",
        12,
        &["--no-faults", "--skews", "60000,-60000"],
    );
    assert!(report.contains("measured clock offsets"), "{report}");
}

#[test]
fn two_gc_runners_deciding_transactions_of_short_deadlines() {
    // Deadlines short enough that the GC runners and other transactions' readers decide live
    // transactions: fencing their missing participants and aborting them under their
    // coordinators, which then find their commit refused.
    let (report, _, _) = run(
        "isolation::two_gc_runners_deciding_transactions_of_short_deadlines",
        12,
        &[
            "--no-kills",
            "--no-network",
            "--gc-runners",
            "2",
            "--txn-timeout",
            "60ms",
        ],
    );
    let expired: i64 = report
        .lines()
        .filter(|l| l.contains("  lists ("))
        .map(|l| number_after(l, "failed ("))
        .sum();
    assert!(
        expired > 0,
        "no transaction was decided by another party:\n{report}"
    );
}

#[test]
fn plain_documents_adopted_underneath() {
    let (report, _, _) = run(
        "isolation::plain_documents_adopted_underneath",
        12,
        &["--no-kills", "--no-network", "--adoption"],
    );
    let stamped = number_after(&report, "rounds stamped ");
    assert!(stamped > 0, "nothing adopted:\n{report}");
}
