//! The previous version and this one on one database at once (issue 49, "a stored format that
//! outlives a release"): a service deploys its instances one at a time, so for minutes an old
//! and a new mongotx read and write the same documents, records and providers, and each must
//! settle what the other left when it died.
//!
//! The torture run with `--previous`: half its worker, checker, GC runner and quota worker
//! processes are the pinned previous version's binaries (`tools/previous-version.sh`), half this
//! build's, under SIGKILLs, connection resets, stalls and late deliveries. It proves that the two
//! can run side by side on one bank and one quota: the total is exact, every transfer seen
//! committed is in the journal and applied whole, nothing is left held and no record is left
//! once this build's GC has run, the quota providers keep their invariants, and both versions
//! commit transfers without either failing more than a third of its transactions or GC rounds.
//! That last part is what catches a version that cannot read what the other writes: the data
//! stays safe then (the protocol refuses what it cannot decide), so only the failures show it.
//!
//! Its limits: it pits this build against one pinned commit, not every release a deployment may
//! skip from; the previous version meets only what this build writes during the run, not a
//! database this build has upgraded first; the final GC and checks are this build's, so what
//! only the previous version misreads counts only through its failures (a misreading that
//! fails now and then, under the third, passes); and ~30 s of faults sample the interleavings,
//! they do not enumerate them.

use crate::common;

use std::process::Command;

use crate::torture::{number_after, torture};

/// The directory of the previous version's binaries: the script builds them on its first call
/// (minutes, unless CI's step before `cargo test` did) and then only prints where they are.
fn previous_version() -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tools/previous-version.sh");
    let output = Command::new("bash")
        .arg(script)
        .output()
        .expect("run tools/previous-version.sh");
    let stdout = String::from_utf8_lossy(&output.stdout);
    // What it built, if anything (nothing once the binaries are cached).
    print!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(
        output.status.success(),
        "tools/previous-version.sh failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
        .lines()
        .last()
        .map(str::to_string)
        .unwrap_or_else(|| panic!("tools/previous-version.sh printed no directory"))
}

#[test]
fn the_previous_version_and_this_one_share_a_bank_and_a_quota_under_kills() {
    // Taken before the build too: a build of minutes beside another subject's fleet would
    // starve it.
    let _turn = common::fleet_turn(module_path!());
    let previous = previous_version();
    let report = torture(&[
        "--seconds",
        "30",
        "--workers",
        "4",
        "--checkers",
        "2",
        "--gc-runners",
        "2",
        "--quota-workers",
        "2",
        "--kill-every",
        "1500ms",
        "--fault-every",
        "1s",
        "--previous",
        &previous,
    ]);
    assert!(
        report.contains("0 held documents, 0 records left"),
        "{report}"
    );
    assert!(
        report.contains(" 0 of those missing; 0 balances off the journal"),
        "{report}"
    );
    for version in ["current", "previous"] {
        assert!(
            number_after(&report, &format!("{version} version: transfers committed ")) > 0,
            "the {version} version committed no transfer:\n{report}"
        );
    }
    assert!(
        number_after(&report, "faults: ") > 0,
        "no process was killed:\n{report}"
    );
    assert!(
        report.contains("quota invariants: held"),
        "the quota invariants:\n{report}"
    );
    // Consumers are named after the worker process that made them: both versions' consumes
    // committed (released ones are gone by then, so these are the ones still holding).
    for version in ["(current", ", previous"] {
        assert!(
            number_after(&report, &format!("{version} version ")) > 0,
            "no consumer of the {version} version holds quota at the end:\n{report}"
        );
    }
}
