//! The processes of a torture run: started, watched, killed with SIGKILL and started again, with
//! the last report of every incarnation kept.

use std::collections::BTreeMap;
use std::path::PathBuf;
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
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Worker => "worker",
            Kind::Checker => "checker",
            Kind::Gc => "gc",
        }
    }
}

/// How to start one process.
#[derive(Debug, Clone)]
pub(crate) struct Recipe {
    pub(crate) kind: Kind,
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

/// One process slot: the recipe, the running child, and the reports.
pub(crate) struct Slot {
    pub(crate) recipe: Recipe,
    child: Option<Child>,
    pub(crate) reports: Arc<Mutex<Reports>>,
    pub(crate) starts: u64,
}

impl Slot {
    pub(crate) fn new(recipe: Recipe) -> Slot {
        Slot {
            recipe,
            child: None,
            reports: Arc::new(Mutex::new(Reports::default())),
            starts: 0,
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
                while let Ok(Some(line)) = lines.next_line().await {
                    let Ok(mut reports) = reports.lock() else {
                        break;
                    };
                    if line.starts_with("stats ") {
                        reports.current = parse(&line);
                    } else if line.starts_with("round:") {
                        let round = parse(&line);
                        add(&mut reports.rounds, &round);
                        *reports.rounds.entry("rounds".into()).or_insert(0) += 1;
                    } else if line.starts_with("bad-snapshot") {
                        reports.alarms.push(line);
                    } else if let Some(id) = line.strip_prefix("committed-transfer ") {
                        reports.committed.push(id.trim().to_string());
                    } else if let Some(cause) = line.strip_prefix("failed ") {
                        reports.failures.push(cause.trim().to_string());
                    }
                }
            });
        }
        self.child = Some(child);
        self.starts += 1;
        Ok(())
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
