//! What a transaction reports while it runs: its `tracing` span and its metrics (named in
//! `crate::metrics`, which says how each is counted). The handle calls these around the commit
//! and the retry loop of `run`; deciding what an error means for the counts (an abort, a
//! conflict, an unknown outcome) is done here, once.

use std::time::Instant;

use tracing::field::Empty;
use tracing::Span;

use crate::metrics::{self, CommitEnd};
use crate::repo::error::RepoError;
use crate::txn::error::TxnError;
use crate::txn::options::{Finish, Outcome};
use crate::txn::worklist::Entry;

/// One commit being observed: what it staged, how, and since when.
pub(crate) struct CommitReport {
    /// Every collection the transaction touches, each once, in lock order.
    collections: Vec<String>,
    mode: Finish,
    started: Instant,
    span: Span,
}

impl CommitReport {
    /// Starts observing the commit of `entries` in `mode`, in a span `mongotx.txn.commit` whose
    /// `txn` (the attempt's transaction id) and `attempts` the commit protocol records, and
    /// whose `outcome` [`ended`](CommitReport::ended) records.
    pub(crate) fn start(entries: &[Entry], mode: Finish) -> CommitReport {
        let mut collections: Vec<String> = Vec::new();
        for entry in entries {
            if !collections.contains(&entry.coll) {
                collections.push(entry.coll.clone());
            }
        }
        let span = tracing::info_span!(
            "mongotx.txn.commit",
            txn = Empty,
            collections = %collections.join(","),
            documents = entries.len(),
            mode = mode.label(),
            attempts = Empty,
            outcome = Empty,
        );
        CommitReport {
            collections,
            mode,
            started: Instant::now(),
            span,
        }
    }

    /// The span the commit runs in.
    pub(crate) fn span(&self) -> Span {
        self.span.clone()
    }

    /// Records how the commit ended, on the span and in the metrics.
    pub(crate) fn ended(self, result: &Result<Outcome, TxnError>) {
        let end = match result {
            Ok(outcome) if outcome.txn.is_none() => {
                self.span.record("outcome", "empty");
                return;
            }
            Ok(_) => CommitEnd::Committed,
            // The process "died" (an injected crash): it reports nothing more.
            Err(e) if e.is_crash() => {
                self.span.record("outcome", "crashed");
                return;
            }
            Err(TxnError::CommitUnknown { .. }) => CommitEnd::Unknown,
            Err(_) => CommitEnd::Aborted,
        };
        self.span.record("outcome", end.label());
        if let Err(e) = result {
            if let Some(collection) = in_the_way(e) {
                metrics::conflict(collection);
            }
        }
        metrics::commit(
            self.mode.label(),
            end,
            self.started.elapsed(),
            self.collections.iter().map(String::as_str),
        );
    }
}

/// The collection of the document that made a commit fail by being in the way (changed, no
/// longer matching its guard, held past the lock wait), if one did.
fn in_the_way(error: &TxnError) -> Option<&str> {
    match error.repo_error()? {
        RepoError::VersionConflict { collection, .. }
        | RepoError::ConditionFailed { collection, .. }
        | RepoError::Locked { collection, .. } => Some(collection),
        _ => None,
    }
}

/// The span of one `Transactions::run`: `mongotx.txn.run`, with the attempts it made and its
/// outcome (`committed`, `failed`, or `gave_up` when retrying ran out of time), recorded by
/// [`run_ended`]. Each attempt's commit is a `mongotx.txn.commit` span inside it.
pub(crate) fn run_span() -> Span {
    tracing::info_span!("mongotx.txn.run", attempts = Empty, outcome = Empty)
}

/// A `run` body is rerun after a retryable error.
pub(crate) fn run_retry() {
    metrics::run_retry();
}

/// Records on `span` how a `run` of `attempts` attempts ended.
pub(crate) fn run_ended<T>(span: &Span, attempts: u32, result: &Result<T, TxnError>) {
    span.record("attempts", attempts);
    span.record(
        "outcome",
        match result {
            Ok(_) => "committed",
            Err(TxnError::GaveUp { .. }) => "gave_up",
            Err(_) => "failed",
        },
    );
}
