//! The soak's own load, beside its processes: batches added to the queue, plain documents
//! inserted, adopted by a `mongotx-adopt` process and deleted through mongotx; and the retention
//! of what would otherwise grow by design (the bank's journal, settled batches).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::{doc, Document};
use futures::TryStreamExt;
use mongotx::queue::{Batches, NewBatch};
use mongotx::{fields, Repository};

use crate::roles::Account;

/// The services batches are added for, in turn.
const SERVICES: usize = 5;
/// Plain documents inserted, adopted and deleted per adoption round.
const PLAIN_PER_ROUND: usize = 20;
const ADOPT_EVERY: Duration = Duration::from_secs(5);

/// Durations the soak measures itself (adding batches, adopting), by operation.
pub(super) type Timings = Arc<Mutex<BTreeMap<String, Vec<u64>>>>;

fn time(timings: &Timings, op: &str, started: Instant) {
    if let Ok(mut t) = timings.lock() {
        let us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        t.entry(op.to_string()).or_default().push(us);
    }
}

/// Adds a batch every 200 ms, over [`SERVICES`] services in turn, until stopped.
pub(super) async fn add_batches(
    batches: Batches,
    timings: Timings,
    stop: Arc<AtomicBool>,
) -> Result<(), String> {
    let mut n = 0_u64;
    while !stop.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let service = format!("svc{}", n % SERVICES as u64);
        let header = format!("{service}-{n:09}");
        let started = Instant::now();
        batches
            .add(&NewBatch::new(
                &service,
                &header,
                format!("content of {header}"),
            ))
            .await
            .map_err(|e| format!("add {header}: {e}"))?;
        time(&timings, "queue.add", started);
        n += 1;
    }
    Ok(())
}

/// What the adoption rounds work with.
pub(super) struct Adoption {
    pub(super) program: PathBuf,
    pub(super) uri: String,
    pub(super) db: mongodb::Database,
    pub(super) plain: Repository<Account>,
    pub(super) schema: PathBuf,
}

/// Every [`ADOPT_EVERY`] until stopped: deletes through mongotx the documents adopted before
/// (tombstones, purged by the GC runners), inserts [`PLAIN_PER_ROUND`] plain documents raw, and
/// adopts them with a `mongotx-adopt` process.
pub(super) async fn adoption(
    a: Adoption,
    timings: Timings,
    stop: Arc<AtomicBool>,
) -> Result<(), String> {
    let raw = a.db.collection::<Document>("plain");
    let mut n = 0_u64;
    while !stop.load(Ordering::SeqCst) {
        tokio::time::sleep(ADOPT_EVERY).await;
        let adopted: Vec<Document> = raw
            .find(doc! {
                fields::VERSION: { "$exists": true },
                fields::DELETED: { "$exists": false },
            })
            .await
            .map_err(|e| format!("find adopted: {e}"))?
            .try_collect()
            .await
            .map_err(|e| format!("find adopted: {e}"))?;
        for d in adopted {
            let (Ok(id), Ok(version)) = (d.get_str("_id"), d.get_i64(fields::VERSION)) else {
                continue;
            };
            let started = Instant::now();
            a.plain
                .delete(id, version)
                .await
                .map_err(|e| format!("delete {id}: {e}"))?;
            time(&timings, "plain.delete", started);
        }
        let fresh: Vec<Document> = (0..PLAIN_PER_ROUND)
            .map(|_| {
                n += 1;
                doc! { "_id": format!("plain{n:09}"), "owner": "legacy", "balance": n as i64 }
            })
            .collect();
        raw.insert_many(fresh)
            .await
            .map_err(|e| format!("insert plain documents: {e}"))?;
        let started = Instant::now();
        let ran = tokio::process::Command::new(&a.program)
            .args([
                "--uri",
                &a.uri,
                "--db",
                a.db.name(),
                "--collection",
                "plain",
            ])
            .arg("--schema")
            .arg(&a.schema)
            .arg("--quiet")
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|e| format!("run {}: {e}", a.program.display()))?;
        if !ran.status.success() {
            return Err(format!(
                "mongotx-adopt failed: {}",
                String::from_utf8_lossy(&ran.stderr).trim()
            ));
        }
        time(&timings, "adopt.run", started);
    }
    Ok(())
}

/// How long the journal's entries and settled batches are kept: well under a minute, so that in
/// the test suite's minute-long soak they are flat by its second half, as the trend rules want.
const KEPT: Duration = Duration::from_secs(20);

/// Every 5 s until stopped: deletes the journal's entries and the settled (committed or invalid)
/// batches older than [`KEPT`], raw, as a service's retention job would.
///
/// Neither is needed after: the soak checks the bank by its total, not by its journal, and a
/// settled batch is never read again by the queue (its rounds look at open batches and at the
/// services' counters). Without this both grow with every transfer and batch, and the local test
/// server, which scans a collection for any query not by `_id`, slows down with them (a 15-minute
/// run's p99s of heartbeats and batch adds doubled), which is the rig's cost and not mongotx's.
pub(super) async fn retention(db: mongodb::Database, stop: Arc<AtomicBool>) -> Result<(), String> {
    while !stop.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_err(|e| e.to_string())?;
        let before = now.saturating_sub(KEPT);
        // A journal entry's id is a new ObjectId's hex, which starts with its creation time in
        // seconds: ids below this one are older than KEPT. Held entries are left to the GC.
        let oldest = format!("{:08x}{}", before.as_secs(), "0".repeat(16));
        db.collection::<Document>("transfers")
            .delete_many(doc! {
                "_id": { "$lt": oldest },
                fields::ACTIVE_TXN: { "$exists": false },
            })
            .await
            .map_err(|e| format!("trim the journal: {e}"))?;
        let cutoff = bson::DateTime::from_millis(i64::try_from(before.as_millis()).unwrap_or(0));
        db.collection::<Document>(mongotx::collections::BATCHES_COLLECTION)
            .delete_many(doc! {
                "status": { "$in": ["committed", "invalid"] },
                "created_at": { "$lt": cutoff },
            })
            .await
            .map_err(|e| format!("trim the batches: {e}"))?;
    }
    Ok(())
}
