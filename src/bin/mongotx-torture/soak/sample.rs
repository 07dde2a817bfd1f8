//! One sample of a soak run: the resident memory of each long-lived process, each operation's
//! p50 and p99 over the window since the last sample, and the size of every system collection.
//! Written one JSON object a line (`samples.jsonl`), read back by the trend rules and the charts.

use std::collections::BTreeMap;

use bson::{doc, Document};
use mongotx::collections::{
    BATCHES_COLLECTION, LIMITERS_COLLECTION, META_COLLECTION, OBTS_COLLECTION,
    PROVIDERS_COLLECTION, TOKENS_COLLECTION, TRANSACTIONS_COLLECTION,
};
use mongotx::fields;
use serde::{Deserialize, Serialize};

/// One operation's durations over a window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct Window {
    /// How many ended in the window.
    pub(crate) n: u64,
    pub(crate) p50_us: u64,
    pub(crate) p99_us: u64,
}

impl Window {
    /// The window of `values` (µs), or `None` when there are none.
    pub(crate) fn of(mut values: Vec<u64>) -> Option<Window> {
        if values.is_empty() {
            return None;
        }
        values.sort_unstable();
        Some(Window {
            n: values.len() as u64,
            p50_us: percentile(&values, 0.50),
            p99_us: percentile(&values, 0.99),
        })
    }
}

/// The nearest-rank percentile `q` of sorted, non-empty `values`.
fn percentile(values: &[u64], q: f64) -> u64 {
    let rank = (q * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// One sample.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Sample {
    /// Seconds since the soak's processes started.
    pub(crate) t: f64,
    /// Resident memory (VmRSS) in KiB by process name (`gc-0`, `checker-0`, ..., and `soak`).
    pub(crate) rss_kib: BTreeMap<String, u64>,
    /// Each operation that ended in the window.
    pub(crate) latency: BTreeMap<String, Window>,
    /// Documents per series (see [`count_collections`]).
    pub(crate) count: BTreeMap<String, u64>,
}

/// VmRSS of process `pid` in KiB, `None` when it is gone (killed between two looks).
pub(crate) fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The collections where a transaction may hold a document (the soak's managed collections).
pub(crate) const MANAGED: [&str; 4] = ["accounts", "transfers", PROVIDERS_COLLECTION, "plain"];

/// Counts every series of the soak's database:
///
/// - `records`: transaction records; `held.<collection>`: documents with `_txn` set in each
///   managed collection; `tombstones`: documents with `_deleted` set in any of them;
/// - `quota_providers`, `ratelimits`, `obts`, `obt_tokens`: every document of the coordination
///   modules' collections;
/// - `mongotx_meta`: the registry's documents but the instances' announcements, which are
///   `mongotx_meta.instances` (one per process that ever opened a store, kept a day when it
///   never retracted it, as a killed one cannot);
/// - `batches` (all: the soak deletes settled ones after 20 s, as the queue keeps them),
///   `batches.open` (not yet committed or invalid);
/// - `plain.unadopted`: documents of the adoption collection without `_version`;
/// - `transfers`: the bank's journal (the soak deletes entries after 20 s).
pub(crate) async fn count_collections(
    db: &mongodb::Database,
) -> Result<BTreeMap<String, u64>, String> {
    let count = |name: &'static str, filter: Document| {
        let coll = db.collection::<Document>(name);
        async move {
            coll.count_documents(filter)
                .await
                .map_err(|e| format!("count {name}: {e}"))
        }
    };
    let mut counts = BTreeMap::new();
    counts.insert(
        "records".into(),
        count(TRANSACTIONS_COLLECTION, doc! {}).await?,
    );
    let mut tombstones = 0;
    for name in MANAGED {
        let held = count(name, doc! { fields::ACTIVE_TXN: { "$exists": true } }).await?;
        counts.insert(format!("held.{name}"), held);
        tombstones += count(name, doc! { fields::DELETED: { "$exists": true } }).await?;
    }
    counts.insert("tombstones".into(), tombstones);
    for name in [
        PROVIDERS_COLLECTION,
        LIMITERS_COLLECTION,
        OBTS_COLLECTION,
        TOKENS_COLLECTION,
        BATCHES_COLLECTION,
        "transfers",
    ] {
        counts.insert(name.into(), count(name, doc! {}).await?);
    }
    let instances = doc! { "_id": { "$regex": "^instance:" } };
    let rest = doc! { "_id": { "$not": { "$regex": "^instance:" } } };
    counts.insert(META_COLLECTION.into(), count(META_COLLECTION, rest).await?);
    counts.insert(
        format!("{META_COLLECTION}.instances"),
        count(META_COLLECTION, instances).await?,
    );
    let open = doc! { "status": { "$nin": ["committed", "invalid"] } };
    counts.insert(
        "batches.open".into(),
        count(BATCHES_COLLECTION, open).await?,
    );
    let plain = doc! { fields::VERSION: { "$exists": false } };
    counts.insert("plain.unadopted".into(), count("plain", plain).await?);
    Ok(counts)
}

/// The samples of a `samples.jsonl` file.
pub(crate) fn read(path: &std::path::Path) -> Result<Vec<Sample>, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("read {}: {e}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, line)| {
            serde_json::from_str(line)
                .map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let w = Window::of((1..=100).rev().collect()).unwrap();
        assert_eq!((w.n, w.p50_us, w.p99_us), (100, 50, 99));
        let one = Window::of(vec![7]).unwrap();
        assert_eq!((one.p50_us, one.p99_us), (7, 7));
        assert_eq!(Window::of(Vec::new()), None);
    }

    #[test]
    fn a_sample_reads_back_as_written() {
        let mut s = Sample {
            t: 10.5,
            ..Sample::default()
        };
        s.rss_kib.insert("gc-0".into(), 12_345);
        s.latency
            .insert("gc.pass".into(), Window::of(vec![5, 9]).unwrap());
        s.count.insert("records".into(), 3);
        let line = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<Sample>(&line).unwrap(), s);
    }
}
