//! The torture run's short form, and the clock-skew run, as part of the test suite: worker,
//! checker and GC runner *processes* against one bank, under SIGKILLs, connection resets and
//! stalls (toxiproxy) and late-delivered commands (the wire proxy); then the total must be exact,
//! nothing held, no record left, and every committed check transaction must have seen the total.
//! `tools/torture.sh` runs the long form.

use crate::common;

use std::process::Command;

use mongotx::testkit::test_server::ServerKind;

pub(crate) fn torture(args: &[&str]) -> String {
    // The harness's server when it is a real MongoDB (MONGODB_URI, a container): the run starts
    // none of its own. When it is the local test server, a fresh one of the run's own, as when
    // this file was a test binary with a server of its own: the shared one has served the whole
    // suite by then, and the runs count on the checker's transaction over every account getting
    // through between the workers' (on the warmed-up shared server the workers once outpaced it
    // and the run ended with "no check transaction committed").
    match common::server_kind() {
        ServerKind::Local => run_torture(args, None),
        _ => run_torture(args, Some(common::server_uri())),
    }
}

/// Runs `mongotx-torture run` on the server of `uri`, or (None) on a local test server of its own,
/// and returns its report, which must say the run kept every invariant.
fn run_torture(args: &[&str], uri: Option<String>) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_mongotx-torture"));
    command.arg("run").args(args);
    match uri {
        Some(uri) => command.env("MONGODB_URI", uri),
        None => command.env_remove("MONGODB_URI"),
    };
    let output = command.output().expect("start mongotx-torture");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    println!("{stdout}");
    assert!(
        output.status.success(),
        "torture run failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("RESULT ok"), "{stdout}");
    stdout
}

/// The number after `label` in the run's report.
pub(crate) fn number_after(report: &str, label: &str) -> i64 {
    report
        .split(label)
        .nth(1)
        .and_then(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .find(|s| !s.is_empty())
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number after {label:?} in:\n{report}"))
}

#[test]
fn short_torture_keeps_every_invariant_under_kills_resets_and_late_deliveries() {
    let _turn = common::fleet_turn(module_path!());
    let report = torture(&[
        "--seconds",
        "45",
        "--kill-every",
        "1500ms",
        "--fault-every",
        "1s",
    ]);
    assert!(
        report.contains("0 held documents, 0 records left"),
        "{report}"
    );
    assert!(number_after(&report, "committed ") > 0);
    assert!(
        number_after(&report, "faults: ") > 0,
        "no process was killed"
    );
    assert!(
        number_after(&report, "SIGKILLs, ") > 0,
        "no connection was reset"
    );
    assert!(
        number_after(&report, "stalls, ") > 0,
        "no command was delivered late"
    );
    assert_eq!(number_after(&report, "consistent check transactions, "), 0);
}

#[test]
fn processes_a_minute_ahead_or_behind_never_take_a_live_transaction_for_expired() {
    let _turn = common::fleet_turn(module_path!());
    // Clocks a minute ahead and a minute behind, a transaction timeout of ten seconds: deciding
    // expiry by any process's own clock would abort nearly every transaction of the other.
    let report = torture(&[
        "--seconds",
        "12",
        "--no-faults",
        "--workers",
        "2",
        "--gc-runners",
        "2",
        "--txn-timeout",
        "10s",
        "--skews",
        "60000,-60000",
    ]);
    assert_eq!(
        number_after(&report, "expired under another party "),
        0,
        "{report}"
    );
    assert!(number_after(&report, "committed ") > 0);
    let offsets = report
        .lines()
        .find(|l| l.contains("measured clock offsets"))
        .unwrap_or_else(|| panic!("no clock offsets in:\n{report}"));
    assert!(
        offsets.contains("60000") && offsets.contains("-60000"),
        "{offsets}"
    );
}

/// Runs the torture on a local test server of its own whose collections keep clocks of their own
/// (`--clock-offsets`), as the shards of a sharded cluster whose clocks disagree: only the local
/// test server can give collections clocks, whatever server the suite uses.
fn torture_on_own_server(args: &[&str]) -> String {
    run_torture(args, None)
}

#[test]
fn shards_whose_clocks_disagree_by_thirty_seconds_lose_no_committed_transfer() {
    let _turn = common::fleet_turn(module_path!());
    // The records' collection 30 s ahead, one accounts collection and the journal 30 s behind,
    // another 30 s ahead (60 s apart), one on time; hello (which sets deadlines) on time. The
    // timeout (40 s) is above the largest offset, so transactions can commit on every collection.
    let report = torture_on_own_server(&[
        "--seconds",
        "30",
        "--accounts",
        "18",
        "--collections",
        "3",
        "--clock-offsets",
        "mongotx_transactions=+30s,accounts=-30s,accounts_1=+30s,accounts_2=0s,transfers=-30s",
        "--txn-timeout",
        "40s",
        // A killed coordinator's documents stay held until the records' clock (30 s ahead)
        // passes its deadline, 10 s later: kills far apart leave the checker, which holds every
        // account, room to commit.
        "--kill-every",
        "8s",
        "--fault-every",
        "1500ms",
    ]);
    assert!(
        report.contains("0 held documents, 0 records left"),
        "{report}"
    );
    assert!(number_after(&report, "committed ") > 0, "{report}");
    assert!(
        number_after(&report, "faults: ") > 0,
        "no process was killed"
    );
    assert_eq!(number_after(&report, "consistent check transactions, "), 0);
    assert!(
        report.contains(" 0 of those missing; 0 balances off the journal"),
        "{report}"
    );
}
