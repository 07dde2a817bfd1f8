//! The roles that move batches to the ledger: the submitter (a queuer round, then claim, submit,
//! record for each queued batch) and the monitor (asks the ledger about batches with a submitter
//! or at the ledger, and records what it says). Any number of each may run, in any processes.

use std::future::Future;
use std::time::Duration;

use bson::doc;
use futures::TryStreamExt;

use crate::queue::claim::{self, Claim, Submission};
use crate::queue::db;
use crate::queue::error::QueueError;
use crate::queue::model::{Batch, BatchStatus};
use crate::queue::Batches;
use crate::server::clock::minus;

/// The external ledger, as submitters and monitors use it. Errors are the transport's, in
/// words. A submission without an answer may still have arrived, so it is not taken for
/// delayed: the batch stays marked submitted until the monitor asks the ledger about it.
pub trait LedgerApi: Send + Sync {
    /// Submits one batch.
    fn submit(
        &self,
        service: &str,
        header: &str,
        content: &str,
    ) -> impl Future<Output = Result<Answer, String>> + Send;

    /// What the ledger says about one batch.
    fn status(&self, header: &str) -> impl Future<Output = Result<LedgerStatus, String>> + Send;
}

/// What the ledger answers a submission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Taken: ask its status later.
    Accepted,
    /// Not taken this time: submit again after the delay window.
    Delayed,
}

/// What the ledger says about a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerStatus {
    /// Taken, not decided yet.
    Pending,
    /// Found invalid; it will never be committed.
    Invalid,
    /// Committed.
    Committed,
    /// Never taken, or forgotten: submit it again.
    Unknown,
}

/// Takes queued batches and submits them.
#[derive(Debug, Clone)]
pub struct Submitter<L> {
    batches: Batches,
    ledger: L,
    name: String,
    claim_ttl: Duration,
}

impl<L: LedgerApi> Submitter<L> {
    /// A submitter named `name` (recorded in its claims) holding each claim for at most
    /// `claim_ttl`. A name or claim time [`Batches::claim`] refuses is reported, as
    /// [`QueueError::Invalid`], by the first [`take`](Submitter::take) or
    /// [`run_once`](Submitter::run_once), before anything is written.
    pub fn new(batches: Batches, ledger: L, name: impl Into<String>, claim_ttl: Duration) -> Self {
        Submitter {
            batches,
            ledger,
            name: name.into(),
            claim_ttl,
        }
    }

    /// One queuer round, then each queued batch this submitter manages to claim is submitted
    /// and the answer recorded. Returns the batches it submitted.
    pub async fn run_once(&self) -> Result<Vec<Batch>, QueueError> {
        let queued = self.batches.round().await?;
        let mut submitted = Vec::new();
        for batch in queued {
            if let Some(claim) = self.take(&batch).await? {
                if let Some(batch) = self.send(&claim).await? {
                    submitted.push(batch);
                }
            }
        }
        Ok(submitted)
    }

    /// Claims one queued batch ([`Batches::claim`] with this submitter's name and claim time).
    pub async fn take(&self, batch: &Batch) -> Result<Option<Claim>, QueueError> {
        self.batches.claim(batch, &self.name, self.claim_ttl).await
    }

    /// Submits a claimed batch and records the answer. `None` if the claim ran out first or the
    /// ledger did not answer: the batch is left to the claim's expiry and the monitor, which
    /// asks the ledger whether it arrived.
    pub async fn send(&self, claim: &Claim) -> Result<Option<Batch>, QueueError> {
        if !claim.usable() {
            return Ok(None);
        }
        let b = &claim.batch;
        let outcome = match self
            .ledger
            .submit(&b.service_id, &b.header, &claim.content)
            .await
        {
            Ok(Answer::Accepted) => Submission::Accepted,
            Ok(Answer::Delayed) => Submission::Delayed,
            Err(e) => {
                // It may have arrived (and been found invalid, which must never be sent
                // again): it stays marked submitted, and the monitor asks the ledger once the
                // claim has expired.
                tracing::debug!(header = %b.header, error = %e, "no answer to a submission; left to the monitor");
                return Ok(None);
            }
        };
        match self.batches.record(claim, outcome).await {
            Ok(batch) => Ok(Some(batch)),
            // Taken over after our claim expired: the new claimant records it.
            Err(QueueError::NotClaimant { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Asks the ledger about batches with a submitter or at the ledger and records its answers.
#[derive(Debug, Clone)]
pub struct Monitor<L> {
    batches: Batches,
    ledger: L,
}

impl<L: LedgerApi> Monitor<L> {
    /// A monitor of `batches` asking `ledger`.
    pub fn new(batches: Batches, ledger: L) -> Self {
        Monitor { batches, ledger }
    }

    /// One pass over the batches with a submitter or at the ledger. Returns the batches whose
    /// status it changed. Each answer is recorded as of the time the question was asked, read
    /// before asking ([`Batches::record_answer`]): an "unknown" asked while a submitter's claim
    /// was live is dropped, however late it comes.
    pub async fn run_once(&self) -> Result<Vec<Batch>, QueueError> {
        let watched = self.batches.watched().await?;
        let mut changed = Vec::new();
        for batch in watched {
            // The time of the question, read before it is asked and taken at its earliest: an
            // unknown is recorded only for a claim that had expired by then.
            let (now, error) = db::now_within(&self.batches).await?;
            let asked = minus(now, error);
            let said = match self.ledger.status(&batch.header).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(header = %batch.header, error = %e, "the ledger did not answer");
                    continue;
                }
            };
            let status = match said {
                LedgerStatus::Committed => BatchStatus::Committed,
                LedgerStatus::Invalid => BatchStatus::Invalid,
                LedgerStatus::Pending => BatchStatus::Pending,
                LedgerStatus::Unknown => BatchStatus::Unknown,
            };
            if !batch.needs(status) {
                continue;
            }
            match claim::record_status(&self.batches, &batch, status, Some(asked)).await {
                Ok(b) => changed.push(b),
                // Another monitor or a submitter moved it meanwhile, or its submitter is still
                // at work: the next pass looks again.
                Err(QueueError::Contended { .. } | QueueError::InvalidTransition { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(changed)
    }
}

/// The body of [`Batches::watched`].
pub(crate) async fn watched(queue: &Batches) -> Result<Vec<Batch>, QueueError> {
    let docs: Vec<bson::Document> = queue
        .coll
        .find(doc! { "$or": [
            { "status": { "$in": ["pending", "valid"] } },
            { "submitted": true, "status": { "$nin": ["pending", "valid", "committed", "invalid"] } },
        ] })
        .projection(doc! { "content": 0 })
        .await
        .map_err(|e| db::db_error(queue, "*", "watch", e))?
        .try_collect()
        .await
        .map_err(|e| db::db_error(queue, "*", "watch", e))?;
    docs.iter().map(|d| db::parse(queue, d)).collect()
}
