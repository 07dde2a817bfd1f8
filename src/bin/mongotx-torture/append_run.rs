//! List-append transactions in a torture run (`run --append-workers N --history DIR`), for the
//! isolation tests (`tests/it/isolation.rs`): two collections of lists, `lists` whose workers
//! read without checks and `lists_checked` whose workers check every key they read, each with
//! its own history directory (`DIR/unchecked`, `DIR/checked`), under the run's faults beside
//! the transfers. The run seeds a few keys at a time and moves the window of keys in use every
//! second, so that every list stays short. With `--adoption` the new keys are written as plain
//! documents (no system fields, as another service would) and adopted by the run while the
//! workers already transact on them.
//!
//! The run checks only what it can (nothing held, no record left, through its recovery); the
//! test judges the histories.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bson::doc;
use mongotx::adopt::AdoptOptions;
use mongotx::{Repository, Store};
use rand::Rng;

use crate::append::{lists_spec, window_collection, List};
use crate::children::{Kind, Slot};

/// Keys in use at a time (each a document holding a list).
const KEYS: i64 = 6;
/// Keys the window moves by at each step.
const STEP: i64 = 2;
/// Time between two steps.
const EVERY: Duration = Duration::from_millis(1_000);

/// One of the two workloads: its collection and its history directory.
struct Lists {
    name: &'static str,
    checked: bool,
    repo: Repository<List>,
    window: mongodb::Collection<bson::Document>,
    raw: mongodb::Collection<bson::Document>,
}

/// The list-append part of a run.
pub(crate) struct AppendRun {
    lists: Vec<Lists>,
    history: PathBuf,
    plain: bool,
    hi: i64,
    next: Instant,
    adoptions: u64,
    adopted: u64,
}

impl AppendRun {
    /// Opens both collections, seeds the first keys and writes the windows. `plain`: keys are
    /// written as plain documents and adopted later.
    pub(crate) async fn create(
        store: &Store,
        db: &mongodb::Database,
        history: &Path,
        plain: bool,
    ) -> Result<AppendRun, String> {
        let mut lists = Vec::new();
        for (name, checked) in [("lists", false), ("lists_checked", true)] {
            std::fs::create_dir_all(history.join(mode(checked)))
                .map_err(|e| format!("create {}: {e}", history.display()))?;
            lists.push(Lists {
                name,
                checked,
                repo: store
                    .repository::<List>(lists_spec(name)?)
                    .await
                    .map_err(|e| format!("open {name}: {e}"))?,
                window: db.collection(&window_collection(name)),
                raw: db.collection(name),
            });
        }
        let mut run = AppendRun {
            lists,
            history: history.to_path_buf(),
            plain,
            hi: 0,
            next: Instant::now() + EVERY,
            adoptions: 0,
            adopted: 0,
        };
        run.seed(0, KEYS).await?;
        run.hi = KEYS;
        run.publish().await?;
        Ok(run)
    }

    /// The arguments of a worker of the unchecked (`checked` false) or checked workload.
    pub(crate) fn worker_args(
        &self,
        uri: &str,
        db: &str,
        checked: bool,
        txn_timeout: Duration,
    ) -> Vec<String> {
        let name = if checked { "lists_checked" } else { "lists" };
        let mut args = vec![
            "append-worker".to_string(),
            "--uri".into(),
            uri.to_string(),
            "--db".into(),
            db.to_string(),
            "--collection".into(),
            name.into(),
            "--history".into(),
            self.history.join(mode(checked)).display().to_string(),
            "--txn-timeout".into(),
            format!("{}ms", txn_timeout.as_millis()),
        ];
        if checked {
            args.push("--checked".into());
        }
        args
    }

    /// The collections where a killed worker may leave a hold.
    pub(crate) fn collections(&self) -> Vec<String> {
        self.lists.iter().map(|l| l.name.to_string()).collect()
    }

    /// Moves the window on when its time has come: seeds the next keys, then publishes them.
    /// With plain keys, adopts the collection a moment later, while they are in use.
    pub(crate) async fn tick(&mut self) -> Result<(), String> {
        if Instant::now() < self.next {
            return Ok(());
        }
        self.next = Instant::now() + EVERY;
        self.seed(self.hi, self.hi + STEP).await?;
        self.hi += STEP;
        self.publish().await?;
        if self.plain {
            let pause = Duration::from_millis(rand::rng().random_range(50..400));
            tokio::time::sleep(pause).await;
            for lists in &self.lists {
                let report = lists
                    .repo
                    .adopt(AdoptOptions::default())
                    .await
                    .map_err(|e| format!("adopt {}: {e}", lists.name))?;
                self.adoptions += 1;
                self.adopted += report.stamped;
            }
        }
        Ok(())
    }

    async fn seed(&self, from: i64, to: i64) -> Result<(), String> {
        for lists in &self.lists {
            for key in from..to {
                let written = if self.plain {
                    lists
                        .raw
                        .insert_one(doc! { "_id": key, "list": [] })
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                } else {
                    lists
                        .repo
                        .insert(&List {
                            id: key,
                            list: Vec::new(),
                        })
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                };
                written.map_err(|e| format!("seed {}/{key}: {e}", lists.name))?;
            }
        }
        Ok(())
    }

    async fn publish(&self) -> Result<(), String> {
        let lo = (self.hi - KEYS).max(0);
        for lists in &self.lists {
            lists
                .window
                .replace_one(
                    doc! { "_id": "window" },
                    doc! { "_id": "window", "lo": lo, "hi": self.hi },
                )
                .upsert(true)
                .await
                .map_err(|e| format!("move the window of {}: {e}", lists.name))?;
        }
        Ok(())
    }

    /// The results' lines: transactions of each workload by how they ended, keys, adoptions.
    pub(crate) fn summary(&self, slots: &[Slot]) -> Vec<String> {
        let mut lines = Vec::new();
        for lists in &self.lists {
            let mut total = crate::children::Report::new();
            for slot in slots.iter().filter(|s| s.recipe.kind == Kind::Append) {
                let name = lists.name;
                if !slot.recipe.args.iter().any(|a| a == name) {
                    continue;
                }
                if let Ok(reports) = slot.reports.lock() {
                    crate::children::add(&mut total, &reports.total());
                }
            }
            let get = |k: &str| total.get(k).copied().unwrap_or(0);
            lines.push(format!(
                "  lists ({}): {} ok, {} unknown, {} failed ({} expired under another party), over {} keys",
                mode(lists.checked),
                get("committed"),
                get("unknown"),
                get("failed"),
                get("expired"),
                self.hi
            ));
        }
        if self.plain {
            lines.push(format!(
                "  adoption: {} rounds stamped {} plain documents",
                self.adoptions, self.adopted
            ));
        }
        lines
    }
}

/// The history subdirectory of a workload.
fn mode(checked: bool) -> &'static str {
    if checked {
        "checked"
    } else {
        "unchecked"
    }
}
