//! The quota operations against the database: read, decide (`decide`), write conditionally.
//! This file holds what they share (the retry budget, how a failed write is classified); the
//! provider operations are in `providers`, consuming and reserving in `consume`, giving back in
//! `release`, reading providers and writing decisions in `access`.

use std::time::Duration;

use bson::{doc, Document};
use mongodb::IndexModel;

use crate::collections::PROVIDERS_COLLECTION;
use crate::metrics;
use crate::quota::decide::{self, Docs};
use crate::quota::error::QuotaError;
use crate::quota::model::ProviderDoc;
use crate::quota::Quota;
use crate::repo::changes::Update;
use crate::repo::error::RepoError;
use crate::repo::fields;
use crate::repo::repository::Stamped;
use crate::retry::LockWait;
use crate::retry::Retry;
use crate::server::is_transient;
use crate::txn::error::TxnError;

/// Single-provider writes tried before falling back to the generation-checked path (which only
/// happens when the provider is held by a transaction or the server's clock ran past a send's
/// deadline).
pub(super) const FAST_TRIES: u32 = 4;

/// The longest reservation.
pub(super) const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

/// `result` of the operation `op`, counted as a refusal if it is one (`crate::metrics`).
pub(super) fn counted<T>(op: &'static str, result: Result<T, QuotaError>) -> Result<T, QuotaError> {
    if let Some(reason) = result.as_ref().err().and_then(QuotaError::refusal_reason) {
        metrics::quota_refused(op, reason);
    }
    result
}

/// How a conditional write ended.
pub(super) enum Step {
    Done,
    /// Nothing was written (a generation moved, a holder was in the way): re-read and decide again.
    Retry(String),
    /// It may or may not have been written: re-read; the entries tell.
    Ambiguous(String),
}

/// Re-read-and-retry budget of one call.
pub(super) struct Attempts {
    what: String,
    retry: Retry,
}

impl Attempts {
    pub(super) fn new(policy: LockWait, what: String) -> Attempts {
        Attempts {
            what,
            retry: Retry::until_deadline(policy),
        }
    }

    /// Re-reads made so far (each one followed a pause).
    pub(super) fn retries(&self) -> u32 {
        self.retry.pauses()
    }

    /// Time since the first attempt.
    pub(super) fn elapsed(&self) -> Duration {
        self.retry.elapsed()
    }

    pub(super) async fn again(&mut self, reason: String) -> Result<(), QuotaError> {
        let attempt = self.retry.pauses() + 1;
        if self.retry.exhausted() {
            return Err(QuotaError::Contended {
                what: self.what.clone(),
                attempts: attempt,
                elapsed: self.retry.elapsed(),
                last: reason,
            });
        }
        tracing::debug!(what = %self.what, attempt, %reason, "quota: re-reading");
        self.retry.pause().await;
        Ok(())
    }
}

pub(super) fn stamped_docs(found: Vec<Stamped<ProviderDoc>>) -> Docs {
    found
        .into_iter()
        .map(|s| (s.value.id.clone(), (s.version, s.value)))
        .collect()
}

pub(super) fn update_of(doc: &ProviderDoc) -> Result<Update, QuotaError> {
    let held = bson::to_bson(&doc.held).map_err(|e| RepoError::Encode {
        collection: PROVIDERS_COLLECTION.to_string(),
        reason: e.to_string(),
    })?;
    let mut update = Update::new()
        .set("limit", doc.limit)
        .set("usage", doc.usage)
        .set("available", doc.available)
        .set("held", held);
    // Set only once a provider is striped, so a provider of one stripe stays as before.
    if doc.bits != 0 {
        update = update.set("bits", doc.bits);
    }
    if doc.over {
        update = update.set("over", true);
    } else {
        update = update.unset("over");
    }
    if !doc.stripes.is_empty() {
        let stripes = bson::to_bson(&doc.stripes).map_err(|e| RepoError::Encode {
            collection: PROVIDERS_COLLECTION.to_string(),
            reason: e.to_string(),
        })?;
        update = update.set("stripes", stripes);
    }
    Ok(update)
}

pub(super) fn classify_repo(error: RepoError) -> Result<Step, QuotaError> {
    match error {
        RepoError::Database { ref source, .. } if is_transient(source) => {
            Ok(Step::Ambiguous(error.to_string()))
        }
        e if e.is_retryable() => Ok(Step::Retry(e.to_string())),
        e => Err(e.into()),
    }
}

pub(super) fn classify_txn(error: TxnError) -> Result<Step, QuotaError> {
    match error {
        TxnError::CommitUnknown { .. } => Ok(Step::Ambiguous(error.to_string())),
        TxnError::Document { source, .. } => classify_repo(*source),
        e if e.is_retryable() => Ok(Step::Retry(e.to_string())),
        e => Err(e.into()),
    }
}

pub(crate) async fn create_indexes(quota: &Quota) -> Result<(), QuotaError> {
    let coll = quota.repo.raw_collection();
    // A release, confirm or cancel finds its entries with an `$or` of the stored ones and
    // those a pending transaction would restore (`stored_or_restored`); MongoDB answers an
    // `$or` from indexes only when every branch has one, so the restored copy is indexed too.
    let restored = format!("{}.restore.held", fields::HOLD);
    for keys in [
        doc! { "held.c": 1, "held.r": 1 },
        doc! { format!("{restored}.c"): 1, format!("{restored}.r"): 1 },
        doc! { "held.exp": 1 },
    ] {
        coll.create_index(IndexModel::builder().keys(keys).build())
            .await
            .map_err(|e| RepoError::database(PROVIDERS_COLLECTION, "*", "create index", e))?;
    }
    Ok(())
}

pub(super) fn check(quota: &Quota, name: &'static str) -> Result<(), QuotaError> {
    #[cfg(feature = "testkit")]
    return quota
        .faults
        .check(name, 0)
        .map_err(|at| QuotaError::Crashed { at });
    // Without the test rig no injector can be installed: every point passes.
    #[cfg(not(feature = "testkit"))]
    {
        let _ = (&quota.faults, name);
        Ok(())
    }
}

pub(super) fn entry_filter(consumer: &str, request: &str) -> Document {
    doc! { "held": { "$elemMatch": { "c": consumer, "r": request } } }
}

pub(super) fn check_ids(consumer: &str, request: &str) -> Result<(), QuotaError> {
    decide::check_name("consumer", consumer)?;
    decide::check_name("request id", request)
}

/// `filter` on the stored fields, or on the values a pending transaction's hold would restore
/// (its undo copy under `_hold.restore`): a provider whose committed entries only the undo still
/// shows matches too.
pub(super) fn stored_or_restored(filter: &Document) -> Document {
    let restored: Document = filter
        .iter()
        .map(|(k, v)| (format!("{}.restore.{k}", fields::HOLD), v.clone()))
        .collect();
    doc! { "$or": [filter.clone(), restored] }
}
