//! The transaction GC: finishes or rolls back transactions whose deadline has passed, and purges
//! old tombstones.
//!
//! Safe to run from several processes at once and next to live coordinators: claiming a pending
//! transaction and writing its commit point are both conditional on it still being pending, and
//! every finish or rollback write is conditional on the document still referencing it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bson::{doc, oid::ObjectId, DateTime, Document};
use futures::TryStreamExt;
use mongodb::Database;

use crate::error::TxnError;
use crate::failpoint::{FaultInjector, Faults};
use crate::fields;
use crate::recovery::{self, Env, Resolution};
use crate::worklist::TRANSACTIONS_COLLECTION;

/// Settings of a GC.
#[derive(Clone)]
pub struct GcOptions {
    /// The collection of ActiveTransaction documents.
    pub transactions_collection: String,
    /// How many expired transactions one round handles at most.
    pub batch_size: usize,
    /// Purge tombstones deleted longer ago than this (`None`: keep them).
    pub tombstone_retention: Option<Duration>,
    faults: Option<Arc<dyn FaultInjector>>,
}

impl Default for GcOptions {
    fn default() -> GcOptions {
        GcOptions {
            transactions_collection: TRANSACTIONS_COLLECTION.to_string(),
            batch_size: 100,
            tombstone_retention: None,
            faults: None,
        }
    }
}

impl std::fmt::Debug for GcOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GcOptions")
            .field("transactions_collection", &self.transactions_collection)
            .field("batch_size", &self.batch_size)
            .field("tombstone_retention", &self.tombstone_retention)
            .finish()
    }
}

impl GcOptions {
    /// Sets the collection of ActiveTransaction documents.
    pub fn transactions_collection(mut self, name: impl Into<String>) -> GcOptions {
        self.transactions_collection = name.into();
        self
    }

    /// Sets how many expired transactions one round handles at most.
    pub fn batch_size(mut self, batch_size: usize) -> GcOptions {
        self.batch_size = batch_size;
        self
    }

    /// Sets (or clears) the tombstone retention.
    pub fn tombstone_retention(mut self, retention: Option<Duration>) -> GcOptions {
        self.tombstone_retention = retention;
        self
    }

    /// Installs a fault injector (tests): the GC stops at the points it chooses.
    pub fn fault_injector(mut self, injector: Arc<dyn FaultInjector>) -> GcOptions {
        self.faults = Some(injector);
        self
    }
}

/// What one GC round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoundSummary {
    /// Committed transactions whose documents were freed.
    pub finished: usize,
    /// Transactions rolled back.
    pub rolled_back: usize,
    /// Transactions that failed and are left for the next round.
    pub skipped: usize,
    /// Tombstones purged.
    pub purged: u64,
}

/// A GC over one database.
#[derive(Debug, Clone)]
pub struct Gc {
    env: Env,
    options: GcOptions,
}

impl Gc {
    /// A GC over `db`.
    pub fn new(db: Database, options: GcOptions) -> Gc {
        let faults = Faults::new(options.faults.clone());
        Gc {
            env: Env::new(db, &options.transactions_collection, faults),
            options,
        }
    }

    /// Runs one round now.
    pub async fn run_round(&self) -> Result<RoundSummary, TxnError> {
        self.run_round_at(DateTime::now(), &AtomicBool::new(false))
            .await
    }

    /// Runs one round as if the time were `now`; stops between items once `stop` is set.
    ///
    /// An item that fails is logged and skipped (the next round retries it); an injected crash
    /// ends the round with `Err`, as the death of the process would.
    pub async fn run_round_at(
        &self,
        now: DateTime,
        stop: &AtomicBool,
    ) -> Result<RoundSummary, TxnError> {
        let mut summary = RoundSummary::default();
        let limit = i64::try_from(self.options.batch_size.max(1)).unwrap_or(i64::MAX);
        let expired: Vec<Document> = self
            .env
            .txns
            .find(doc! { "deadline": { "$lte": now } })
            .projection(doc! { "_id": 1 })
            .sort(doc! { "deadline": 1 })
            .limit(limit)
            .await
            .map_err(|e| TxnError::database(None, "find expired transactions", e))?
            .try_collect()
            .await
            .map_err(|e| TxnError::database(None, "find expired transactions", e))?;

        for item in expired {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            let Ok(t) = item.get_object_id("_id") else {
                tracing::warn!(item = %item, "skipping ActiveTransaction document without an ObjectId");
                summary.skipped += 1;
                continue;
            };
            match recovery::resolve_expired(&self.env, t, now).await {
                Ok(Resolution::Finished) => summary.finished += 1,
                Ok(Resolution::RolledBack) => summary.rolled_back += 1,
                Ok(Resolution::Gone | Resolution::NotExpired) => {}
                Err(crash @ TxnError::Crashed { .. }) => return Err(crash),
                Err(e) => {
                    tracing::warn!(txn = %t, error = %e, "GC could not resolve transaction; retrying next round");
                    summary.skipped += 1;
                }
            }
        }

        if let Some(retention) = self.options.tombstone_retention {
            if !stop.load(Ordering::SeqCst) {
                summary.purged = self.purge_tombstones(now, retention).await?;
            }
        }
        tracing::info!(
            finished = summary.finished,
            rolled_back = summary.rolled_back,
            skipped = summary.skipped,
            purged = summary.purged,
            "GC round"
        );
        Ok(summary)
    }

    /// Deletes free tombstones older than `retention` in every collection of stamped documents.
    async fn purge_tombstones(&self, now: DateTime, retention: Duration) -> Result<u64, TxnError> {
        let retention = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        let cutoff = DateTime::from_millis(now.timestamp_millis().saturating_sub(retention));
        let names = self
            .env
            .db
            .list_collection_names()
            .await
            .map_err(|e| TxnError::database(None, "list collections", e))?;
        let mut purged = 0;
        for name in names {
            if name == self.options.transactions_collection || name.starts_with("system.") {
                continue;
            }
            // Only documents that carry mongotx's stamp: other collections may use the same names.
            let filter = doc! {
                fields::DELETED: { "$lt": cutoff },
                fields::ACTIVE_TXN: null,
                fields::VERSION: { "$exists": true },
                fields::SCHEMA_VERSION: { "$exists": true },
            };
            purged += self
                .env
                .db
                .collection::<Document>(&name)
                .delete_many(filter)
                .await
                .map_err(|e| TxnError::database(None, "purge tombstones", e))?
                .deleted_count;
        }
        Ok(purged)
    }

    /// Resolves one transaction now if it has expired (used by tools and tests).
    pub async fn resolve(&self, txn: ObjectId) -> Result<bool, TxnError> {
        let resolution = recovery::resolve_expired(&self.env, txn, DateTime::now()).await?;
        Ok(matches!(
            resolution,
            Resolution::Finished | Resolution::RolledBack
        ))
    }
}

/// Parses a duration such as `500ms`, `30s`, `5m`, `2h`, `7d` (a bare number is seconds).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (try 500ms, 30s, 5m, 2h, 7d)"))?;
    let seconds = match unit.trim() {
        "ms" => value / 1000.0,
        "" | "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        "d" => value * 86_400.0,
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (use ms, s, m, h or d)"
            ))
        }
    };
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("{text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(604_800)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }
}
