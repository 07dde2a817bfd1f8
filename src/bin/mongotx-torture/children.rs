//! The processes of a torture run: started, watched, killed with SIGKILL and started again, with
//! the last report of every incarnation kept; and the builds they run (`run --previous`: the
//! previous version's binaries beside this build's).
//!
//! What a child prints is read here (`stats`, `round:`, `committed-transfer`, `failed` lines, and
//! for the soak the durations of `latencies`, `wait` and `pass:` lines),
//! from the previous version's children as much as from this build's: those lines are
//! part of what a release must keep, like the children's arguments (see `chaos::run`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// What kind of process a slot runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    Worker,
    Checker,
    Gc,
    Quota,
    /// A list-append worker of the isolation tests (`append`).
    Append,
    /// The soak's rate-limited worker.
    Rate,
    /// The soak's OBT owner.
    Obt,
    /// The soak's batch-queue worker.
    Queue,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Worker => "worker",
            Kind::Checker => "checker",
            Kind::Gc => "gc",
            Kind::Quota => "quota-worker",
            Kind::Append => "append-worker",
            Kind::Rate => "rate-worker",
            Kind::Obt => "obt-owner",
            Kind::Queue => "queue-worker",
        }
    }
}

/// Which build a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Version {
    /// This build's binaries.
    Current,
    /// The previous version's (`run --previous <DIR>`).
    Previous,
}

impl Version {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Version::Current => "current",
            Version::Previous => "previous",
        }
    }
}

/// The two binaries a run starts its processes from.
#[derive(Debug, Clone)]
pub(crate) struct Build {
    pub(crate) torture: PathBuf,
    pub(crate) gc: PathBuf,
}

impl Build {
    /// The `mongotx-torture` and `mongotx-gc` of `dir`, which must both be there.
    fn in_dir(dir: &Path) -> Result<Build, String> {
        let find = |name: &str| {
            let path = dir.join(name);
            if path.is_file() {
                Ok(path)
            } else {
                Err(format!("{name} not found in {}", dir.display()))
            }
        };
        Ok(Build {
            torture: find("mongotx-torture")?,
            gc: find("mongotx-gc")?,
        })
    }
}

/// This build's binaries, and the previous version's when the run mixes versions.
pub(crate) struct Programs {
    current: Build,
    previous: Option<Build>,
}

impl Programs {
    /// This build's binaries (beside this one: cargo puts every binary of the crate in one
    /// directory) and, with `previous`, the ones in that directory.
    pub(crate) fn find(previous: Option<&Path>) -> Result<Programs, String> {
        let me = std::env::current_exe().map_err(|e| format!("locate this binary: {e}"))?;
        let here = me
            .parent()
            .ok_or_else(|| format!("{} has no directory", me.display()))?;
        Ok(Programs {
            current: Build::in_dir(here)?,
            previous: previous.map(Build::in_dir).transpose()?,
        })
    }

    /// The build the `n`-th process of a kind runs: with a previous version, even ones this
    /// build and odd ones the previous, so that every kind with two processes or more has both
    /// versions at work on the same documents at once (a rolling deployment's halfway point).
    pub(crate) fn nth(&self, n: usize) -> (Version, &Build) {
        match &self.previous {
            Some(previous) if n % 2 == 1 => (Version::Previous, previous),
            _ => (Version::Current, &self.current),
        }
    }
}

/// How to start one process.
#[derive(Debug, Clone)]
pub(crate) struct Recipe {
    pub(crate) kind: Kind,
    pub(crate) version: Version,
    pub(crate) program: PathBuf,
    pub(crate) args: Vec<String>,
    /// `(LD_PRELOAD library, skew in ms)` for a process with a skewed clock.
    pub(crate) skew: Option<(PathBuf, i64)>,
}

/// Numbers parsed from `key=value` report lines.
pub(crate) type Report = BTreeMap<String, i64>;

/// What one slot has reported over all its incarnations.
#[derive(Debug, Default)]
pub(crate) struct Reports {
    /// The last `stats` line of each finished incarnation, summed.
    pub(crate) finished: Report,
    /// The last `stats` line of the running incarnation.
    pub(crate) current: Report,
    /// GC `round:` lines, summed over every incarnation.
    pub(crate) rounds: Report,
    /// Lines that report a broken invariant, kept verbatim.
    pub(crate) alarms: Vec<String>,
    /// Transfers a worker saw commit (by id), to be found in the journal at the end.
    pub(crate) committed: Vec<String>,
    /// Why transactions failed (`failed ` lines: a checker's, each one line), for the results.
    pub(crate) failures: Vec<String>,
    /// Durations in µs per operation since the soak last took them (`latencies` lines, a rate
    /// worker's `wait` lines, a GC runner's `pass:` lines).
    pub(crate) latencies: BTreeMap<String, Vec<u64>>,
}

impl Reports {
    /// Every incarnation's last stats, summed.
    pub(crate) fn total(&self) -> Report {
        let mut total = self.finished.clone();
        add(&mut total, &self.current);
        total
    }
}

pub(crate) fn add(into: &mut Report, from: &Report) {
    for (key, value) in from {
        *into.entry(key.clone()).or_insert(0) += value;
    }
}

fn parse(line: &str) -> Report {
    line.split_whitespace()
        .filter_map(|pair| pair.split_once('='))
        .filter_map(|(k, v)| v.parse::<i64>().ok().map(|v| (k.to_string(), v)))
        .collect()
}

/// The durations a line reports, by operation: a `latencies` line's; a rate worker's
/// `wait <µs> <unix ms> <bulk|high>` (how long a reservation took to be granted); a GC runner's
/// `pass: took_ms=<ms>` (a whole pass: round and sweeps; `gc.pass.purge` when its round purged
/// tombstones).
fn timed(line: &str, purged: bool) -> Option<(String, Vec<u64>)> {
    if let Some(found) = crate::latency::parse_line(line) {
        return Some(found);
    }
    if let Some(rest) = line.strip_prefix("wait ") {
        let words: Vec<&str> = rest.split_whitespace().collect();
        if let [us, _, kind] = words[..] {
            return Some((format!("ratelimit.reserve.{kind}"), vec![us.parse().ok()?]));
        }
    }
    let ms: u64 = line.strip_prefix("pass: took_ms=")?.trim().parse().ok()?;
    let op = if purged { "gc.pass.purge" } else { "gc.pass" };
    Some((op.to_string(), vec![ms.saturating_mul(1_000)]))
}

/// One process slot: the recipe, the running child, and the reports.
pub(crate) struct Slot {
    pub(crate) recipe: Recipe,
    child: Option<Child>,
    pub(crate) reports: Arc<Mutex<Reports>>,
    pub(crate) starts: u64,
    /// The process id of every incarnation (a quota worker names its consumers after it).
    pub(crate) pids: Vec<u32>,
}

impl Slot {
    pub(crate) fn new(recipe: Recipe) -> Slot {
        Slot {
            recipe,
            child: None,
            reports: Arc::new(Mutex::new(Reports::default())),
            starts: 0,
            pids: Vec::new(),
        }
    }

    /// Starts a new incarnation.
    pub(crate) fn start(&mut self) -> Result<(), String> {
        let mut command = Command::new(&self.recipe.program);
        command
            .args(&self.recipe.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        if let Some((library, skew)) = &self.recipe.skew {
            command
                .env("LD_PRELOAD", library)
                .env("MONGOTX_SKEW_MS", skew.to_string());
        }
        let mut child = command
            .spawn()
            .map_err(|e| format!("start {}: {e}", self.recipe.program.display()))?;
        if let Some(stdout) = child.stdout.take() {
            let reports = Arc::clone(&self.reports);
            tokio::spawn(async move {
                let mut lines = BufReader::new(stdout).lines();
                // Whether the GC round before the next `pass:` line purged tombstones: such a
                // pass waits out the version floor's grace, so its duration is a series apart.
                let mut purged = false;
                while let Ok(Some(line)) = lines.next_line().await {
                    if line.starts_with("round:") {
                        purged = parse(&line).get("purged").is_some_and(|n| *n > 0);
                    }
                    let Ok(mut reports) = reports.lock() else {
                        break;
                    };
                    if line.starts_with("stats ") {
                        reports.current = parse(&line);
                    } else if line.starts_with("round:") {
                        if line.starts_with("round: failed") {
                            // `round: failed (<why>)`: a round that met an error (a fault, or a
                            // document or record it cannot read), counted, its words not parsed.
                            *reports.rounds.entry("failed".into()).or_insert(0) += 1;
                        } else {
                            add(&mut reports.rounds, &parse(&line));
                        }
                        *reports.rounds.entry("rounds".into()).or_insert(0) += 1;
                    } else if line.starts_with("bad-snapshot") {
                        reports.alarms.push(line);
                    } else if let Some(id) = line.strip_prefix("committed-transfer ") {
                        reports.committed.push(id.trim().to_string());
                    } else if let Some(cause) = line.strip_prefix("failed ") {
                        reports.failures.push(cause.trim().to_string());
                    } else if let Some((op, values)) = timed(&line, purged) {
                        reports.latencies.entry(op).or_default().extend(values);
                    }
                }
            });
        }
        self.pids.extend(child.id());
        self.child = Some(child);
        self.starts += 1;
        Ok(())
    }

    /// The process id of the running incarnation.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// Kills the running incarnation with SIGKILL and waits for it.
    pub(crate) async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
            self.retire();
        }
    }

    /// Asks the running incarnation to stop (stdin closed, then SIGTERM) and waits for it.
    pub(crate) async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            drop(child.stdin.take());
            if let Some(pid) = child.id() {
                let _ = Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status()
                    .await;
            }
            if tokio::time::timeout(std::time::Duration::from_secs(10), child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
            self.retire();
        }
    }

    /// Whether the running incarnation has exited on its own (it should not).
    pub(crate) fn exited(&mut self) -> Option<String> {
        let child = self.child.as_mut()?;
        match child.try_wait() {
            Ok(Some(status)) => Some(format!(
                "{} exited on its own: {status}",
                self.recipe.kind.name()
            )),
            _ => None,
        }
    }

    fn retire(&self) {
        if let Ok(mut reports) = self.reports.lock() {
            let current = std::mem::take(&mut reports.current);
            add(&mut reports.finished, &current);
        }
    }
}

/// What the processes of `version` did, summed over their incarnations: what its workers
/// committed, left unknown and failed, its checkers' consistent check transactions and failed
/// ones, its GC runners' rounds and failed ones, and how many quota workers it ran (what they
/// consumed is counted from the providers at the end, in `quota_run`). Returns that line, and
/// what says this version could not work beside the other.
///
/// The invariants at the end hold even when one version cannot read what the other writes: the
/// protocol keeps the data safe, and this build's GC settles everything at the end. What such a
/// version shows instead is failure: a worker or checker meeting a document held by a
/// transaction whose record it cannot read gives up on it, and a GC round fails on it (with the
/// current build writing a record's participants under a new name, 678 of the previous
/// version's 743 transactions failed and 23 of its 29 GC rounds, while the totals stayed
/// exact). Under the run's faults
/// about one transaction in a hundred fails, and few rounds; so a version is refused when its
/// workers commit nothing, or more than a third of its transactions or GC rounds fail.
pub(crate) fn version_summary(slots: &[Slot], version: Version) -> (String, Vec<String>) {
    let mut processes = BTreeMap::<Kind, usize>::new();
    let mut counts = Report::new();
    for slot in slots.iter().filter(|s| s.recipe.version == version) {
        let Ok(reports) = slot.reports.lock() else {
            continue;
        };
        *processes.entry(slot.recipe.kind).or_default() += 1;
        let (report, keys) = match slot.recipe.kind {
            Kind::Worker => (reports.total(), &["committed", "unknown", "failed"][..]),
            Kind::Checker => (reports.total(), &["snapshots", "failed"][..]),
            Kind::Gc => (reports.rounds.clone(), &["rounds", "failed"][..]),
            Kind::Quota | Kind::Append | Kind::Rate | Kind::Obt | Kind::Queue => {
                (Report::new(), &[][..])
            }
        };
        for key in keys {
            let name = format!("{}.{key}", slot.recipe.kind.name());
            *counts.entry(name).or_default() += report.get(*key).copied().unwrap_or(0);
        }
    }
    let n = |kind: Kind| processes.get(&kind).copied().unwrap_or(0);
    let get = |key: &str| counts.get(key).copied().unwrap_or(0);
    let line = format!(
        "transfers committed {}, unknown {}, failed {} ({} workers); check transactions {}, failed {} ({} checkers); GC rounds {}, failed {} ({} runners); {} quota workers",
        get("worker.committed"),
        get("worker.unknown"),
        get("worker.failed"),
        n(Kind::Worker),
        get("checker.snapshots"),
        get("checker.failed"),
        n(Kind::Checker),
        get("gc.rounds"),
        get("gc.failed"),
        n(Kind::Gc),
        n(Kind::Quota),
    );
    let mut trouble = Vec::new();
    let name = version.name();
    if n(Kind::Worker) > 0 && get("worker.committed") == 0 {
        trouble.push(format!(
            "the {name} version's workers committed no transfer"
        ));
    }
    let failed = get("worker.failed") + get("checker.failed");
    let ended = failed + get("worker.committed") + get("worker.unknown") + get("checker.snapshots");
    if failed > 10 && failed * 3 > ended {
        trouble.push(format!(
            "{failed} of the {name} version's {ended} transactions failed"
        ));
    }
    if get("gc.failed") > 3 && get("gc.failed") * 3 > get("gc.rounds") {
        trouble.push(format!(
            "{} of the {name} version's {} GC rounds failed",
            get("gc.failed"),
            get("gc.rounds")
        ));
    }
    (line, trouble)
}
