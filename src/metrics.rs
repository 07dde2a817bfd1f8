//! Every metric mongotx records, named in one place: what each counts, its labels, and the
//! helpers the layers record through (so that no `counter!` is written anywhere else).
//!
//! # The facade
//!
//! mongotx records through the [`metrics`](https://docs.rs/metrics) crate's facade, as it logs
//! through `tracing`: with no recorder installed every call is a no-op costing an atomic load,
//! and the service, not the library, picks the exporter: `metrics-exporter-prometheus`, an
//! OpenTelemetry bridge, statsd. OpenTelemetry's own API was the other candidate; it pulls in
//! more crates and has changed incompatibly between releases, which a library would pass on to
//! every service depending on it, while the facade has kept its macros stable and bridges to
//! OpenTelemetry for services that use it.
//!
//! A service installs its recorder once at start, then calls [`describe`] so that the exporter
//! knows each metric's unit and help text:
//!
//! ```no_run
//! # fn start(recorder: impl metrics::Recorder + Sync + Send + 'static) {
//! metrics::set_global_recorder(recorder).expect("no recorder installed yet");
//! mongotx::metrics::describe();
//! # }
//! ```
//!
//! # Labels
//!
//! Every label is bounded: a collection name (the service's own collections, and mongotx's
//! records), a mode, an outcome, an operation of a module. Never a document id, a transaction id
//! or a consumer: those are in the spans (`mongotx.txn.commit`, `mongotx.quota.consume`, ...),
//! whose fields carry the ids involved, and would make a metric's series grow without end.
//!
//! # How a transaction is counted
//!
//! A transaction is counted when its [`commit`](crate::Transaction::commit) ends, if it had
//! anything staged: once in [`COMMIT_DURATION`] (by mode and outcome) and, if it committed, once
//! per collection it touched in [`COMMITS`] (a transfer between two accounts counts 1 on
//! `accounts`; one touching `accounts` and `ledger` counts 1 on each, so the sum over collections
//! is not the number of transactions: that is the histogram's count). One that ended without
//! committing counts the same way in [`ABORTS`]; if a document was in the way it also counts 1 in
//! [`CONFLICTS`], on that document's collection. A commit whose outcome is unknown
//! (`CommitUnknown`) counts in neither, only in the histogram. A coordinator that dies counts
//! nothing: the GC's [`GC_RESOLVED`] counts what it left.

use std::time::Duration;

use ::metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit,
};

/// Histogram, seconds: how long [`Transaction::commit`](crate::Transaction::commit) took, from
/// the call to its return, for transactions with something staged. Labels: `mode`
/// (`before_returning` or `in_background`: [`Finish`](crate::options::Finish)), `outcome`
/// (`committed`, `aborted`, `unknown`). Its count is the number of transactions.
pub const COMMIT_DURATION: &str = "mongotx_commit_duration_seconds";

/// Counter: committed transactions, once per collection each touched (see the module's doc).
/// Label: `collection`.
pub const COMMITS: &str = "mongotx_commits_total";

/// Counter: transactions whose commit ended without committing (rolled back, refused, expired),
/// once per collection each touched. Label: `collection`.
pub const ABORTS: &str = "mongotx_aborts_total";

/// Counter: aborted transactions that a document was in the way of: it had changed since it was
/// read (`VersionConflict`), no longer matched a guard (`ConditionFailed`), or stayed held by
/// another transaction past the lock wait (`Locked`). Once per such abort (each also counts in
/// [`ABORTS`]). Label: `collection`, that document's.
pub const CONFLICTS: &str = "mongotx_conflicts_total";

/// Counter: reruns of a [`Transactions::run`](crate::Transactions::run) body after a retryable
/// error, that is its attempts beyond the first. No labels.
pub const RUN_RETRIES: &str = "mongotx_run_retries_total";

/// Counter: documents found held by a transaction. `op="read"`: a read by id (or the read that
/// stages a change) that found the document held, and, for a query, each holding transaction
/// whose outcome it looked up. `op="write"`: a repository write, or one document's apply in a
/// commit attempt, that met a hold, once per holder it met (waiting for the same holder again
/// does not count). Labels: `collection`, `op`.
pub const HOLDS_MET: &str = "mongotx_holds_met_total";

/// Gauge: transactions committed with [`Finish::InBackground`](crate::options::Finish) whose
/// documents a background task is still freeing, over every store of the process.
/// [`Store::shutdown`](crate::Store::shutdown) waits for them. No labels.
pub const BACKGROUND_PENDING: &str = "mongotx_background_finishes_pending";

/// Counter: GC rounds ([`Gc`](crate::gc::Gc) rounds, which a [`GcRunner`](crate::GcRunner) and
/// `mongotx-gc` run), by `outcome`: `ok`, or `failed` (the round, or reading the server's time
/// before it, failed; the next round retries).
pub const GC_ROUNDS: &str = "mongotx_gc_rounds_total";

/// Histogram, seconds: how long a GC round took, whatever its outcome. No labels.
pub const GC_ROUND_DURATION: &str = "mongotx_gc_round_duration_seconds";

/// Counter: what GC rounds that ended resolved, by `result`: `finished` (committed transactions
/// whose documents were freed), `rolled_back`, `swept` (held documents of ended transactions
/// undone one by one), `skipped` (items that failed, left for the next round), `purged`
/// (tombstones).
pub const GC_RESOLVED: &str = "mongotx_gc_resolved_total";

/// Counter: quota operations refused for the state of the quota, not for their input, by `op`
/// (`consume`, `reserve`, `confirm`, `cancel`, `release`, `release_consumed`) and `reason`:
/// `exceeded` (a provider lacked the amount), `expired` (the reservation had expired),
/// `contended` (providers kept changing until the retry budget ran out).
pub const QUOTA_REFUSALS: &str = "mongotx_quota_refusals_total";

/// Counter: rate-limiter reservations ([`RateLimits::reserve`](crate::ratelimit::RateLimits::reserve)
/// and `reserve_within`) that found no room at first and waited, by `outcome`: `granted`,
/// `timed_out`, `failed`. A reservation granted at once does not count.
pub const RATELIMIT_WAITS: &str = "mongotx_ratelimit_waits_total";

/// Histogram, seconds: how long each of the [`RATELIMIT_WAITS`] waited, to its grant or its
/// end. No labels.
pub const RATELIMIT_WAIT_DURATION: &str = "mongotx_ratelimit_wait_duration_seconds";

/// Counter: batch claims ([`Batches::claim`](crate::queue::Batches::claim)) by `outcome`:
/// `claimed`; `slot_taken` (another batch of the service is in flight, or another submitter has
/// this one); `older_first` (an older batch of the service must go first); `unavailable` (the
/// batch is with a submitter, at the ledger or done); `error` (a refused input or a failure).
pub const QUEUE_CLAIMS: &str = "mongotx_queue_claims_total";

/// Registers every metric's unit and description with the installed recorder (the exporter's
/// `# HELP` lines). Call it once the recorder is installed; metrics recorded without it are
/// exported all the same, without help text.
pub fn describe() {
    describe_histogram!(
        COMMIT_DURATION,
        Unit::Seconds,
        "How long a commit took, by finish mode and outcome"
    );
    describe_counter!(
        COMMITS,
        Unit::Count,
        "Committed transactions, once per collection each touched"
    );
    describe_counter!(
        ABORTS,
        Unit::Count,
        "Transactions that ended without committing, once per collection each touched"
    );
    describe_counter!(
        CONFLICTS,
        Unit::Count,
        "Aborted transactions a changed or held document was in the way of, by its collection"
    );
    describe_counter!(
        RUN_RETRIES,
        Unit::Count,
        "Transactions::run attempts beyond the first"
    );
    describe_counter!(
        HOLDS_MET,
        Unit::Count,
        "Documents found held by a transaction, by reads and by writes"
    );
    describe_gauge!(
        BACKGROUND_PENDING,
        Unit::Count,
        "Committed transactions whose documents a background task is still freeing"
    );
    describe_counter!(GC_ROUNDS, Unit::Count, "GC rounds, by outcome");
    describe_histogram!(GC_ROUND_DURATION, Unit::Seconds, "How long a GC round took");
    describe_counter!(
        GC_RESOLVED,
        Unit::Count,
        "What GC rounds resolved: finished, rolled back, swept, skipped, purged"
    );
    describe_counter!(
        QUOTA_REFUSALS,
        Unit::Count,
        "Quota operations refused, by operation and reason"
    );
    describe_counter!(
        RATELIMIT_WAITS,
        Unit::Count,
        "Rate-limiter reservations that had to wait, by outcome"
    );
    describe_histogram!(
        RATELIMIT_WAIT_DURATION,
        Unit::Seconds,
        "How long rate-limiter reservations waited"
    );
    describe_counter!(QUEUE_CLAIMS, Unit::Count, "Batch claims, by outcome");
}

// ----- what the layers call -----

/// How a commit with something staged ended, as the metrics count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CommitEnd {
    Committed,
    Aborted,
    Unknown,
}

impl CommitEnd {
    pub(crate) fn label(self) -> &'static str {
        match self {
            CommitEnd::Committed => "committed",
            CommitEnd::Aborted => "aborted",
            CommitEnd::Unknown => "unknown",
        }
    }
}

/// A commit in `mode` ended as `end` after `took`, touching `collections` (each named once).
pub(crate) fn commit<'a>(
    mode: &'static str,
    end: CommitEnd,
    took: Duration,
    collections: impl IntoIterator<Item = &'a str>,
) {
    histogram!(COMMIT_DURATION, "mode" => mode, "outcome" => end.label())
        .record(took.as_secs_f64());
    let name = match end {
        CommitEnd::Committed => COMMITS,
        CommitEnd::Aborted => ABORTS,
        CommitEnd::Unknown => return,
    };
    for collection in collections {
        counter!(name, "collection" => collection.to_string()).increment(1);
    }
}

/// An aborted commit that a document of `collection` was in the way of.
pub(crate) fn conflict(collection: &str) {
    counter!(CONFLICTS, "collection" => collection.to_string()).increment(1);
}

/// `Transactions::run` reruns its body.
pub(crate) fn run_retry() {
    counter!(RUN_RETRIES).increment(1);
}

/// Who met a hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    Read,
    Write,
}

/// `n` holds on documents of `collection` met by a read or a write.
pub(crate) fn holds_met(collection: &str, access: Access, n: u64) {
    let op = match access {
        Access::Read => "read",
        Access::Write => "write",
    };
    counter!(HOLDS_MET, "collection" => collection.to_string(), "op" => op).increment(n);
}

/// A background finish started.
pub(crate) fn background_started() {
    gauge!(BACKGROUND_PENDING).increment(1.0);
}

/// A background finish ended (done, failed, or its task dropped).
pub(crate) fn background_ended() {
    gauge!(BACKGROUND_PENDING).decrement(1.0);
}

/// What a GC round resolved, each with its `result` label.
pub(crate) struct GcResolved {
    pub(crate) finished: u64,
    pub(crate) rolled_back: u64,
    pub(crate) swept: u64,
    pub(crate) skipped: u64,
    pub(crate) purged: u64,
}

/// A GC round that took `took` ended: with what it resolved, or failed (`None`).
pub(crate) fn gc_round(took: Duration, resolved: Option<GcResolved>) {
    histogram!(GC_ROUND_DURATION).record(took.as_secs_f64());
    let Some(resolved) = resolved else {
        counter!(GC_ROUNDS, "outcome" => "failed").increment(1);
        return;
    };
    counter!(GC_ROUNDS, "outcome" => "ok").increment(1);
    for (result, n) in [
        ("finished", resolved.finished),
        ("rolled_back", resolved.rolled_back),
        ("swept", resolved.swept),
        ("skipped", resolved.skipped),
        ("purged", resolved.purged),
    ] {
        counter!(GC_RESOLVED, "result" => result).increment(n);
    }
}

/// The quota operation `op` was refused for `reason`.
pub(crate) fn quota_refused(op: &'static str, reason: &'static str) {
    counter!(QUOTA_REFUSALS, "op" => op, "reason" => reason).increment(1);
}

/// A rate-limiter reservation that had to wait ended as `outcome` after `waited`.
pub(crate) fn ratelimit_waited(outcome: &'static str, waited: Duration) {
    counter!(RATELIMIT_WAITS, "outcome" => outcome).increment(1);
    histogram!(RATELIMIT_WAIT_DURATION).record(waited.as_secs_f64());
}

/// A batch claim ended as `outcome`.
pub(crate) fn queue_claim(outcome: &'static str) {
    counter!(QUEUE_CLAIMS, "outcome" => outcome).increment(1);
}
