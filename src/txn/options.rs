//! Settings and results of transactions: [`TxnOptions`] (deadline, when documents are freed
//! ([`Finish`]), how `run` retries, fault injection for tests) and what a commit returns
//! ([`Outcome`], [`Written`]).

use std::time::Duration;

use bson::{oid::ObjectId, Bson};

use crate::repo::ids;
use crate::retry::LockWait;
use crate::txn::error::TxnError;

/// When the coordinator frees the documents of a committed transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Finish {
    /// Write the commit point and free every document before `commit` returns: a raw driver
    /// reader then sees clean documents, and the next writer finds them free.
    BeforeReturning,
    /// Return after the one round of writes (the record and the applies), which commits the
    /// transaction; write the commit point and free the documents in a background task (readers
    /// through mongotx already see the committed values; a writer that meets a hold before the
    /// task frees it finishes that document itself; a GC finishes the job if the process dies).
    /// The default: a third to a half of the latency, and as many or more transfers per second
    /// unless they fight over a few documents (see the measured table in docs/transactions.md).
    #[default]
    InBackground,
}

impl Finish {
    /// The `mode` label and span field of a commit in this mode (`crate::metrics`).
    pub(crate) fn label(self) -> &'static str {
        match self {
            Finish::BeforeReturning => "before_returning",
            Finish::InBackground => "in_background",
        }
    }
}

/// Settings of a [`Transactions`](crate::Transactions) handle.
#[derive(Clone)]
#[non_exhaustive]
pub struct TxnOptions {
    /// How long a transaction may take (from its record being written, in server time) before
    /// anyone may abort it, or finish it if it committed.
    pub timeout: Duration,
    /// When documents are freed after the commit point.
    pub finish: Finish,
    /// How [`Transactions::run`](crate::Transactions::run) retries: `max_wait` is the overall deadline.
    pub retry: LockWait,
    pub(crate) faults: crate::txn::failpoint::Injector,
}

impl Default for TxnOptions {
    fn default() -> TxnOptions {
        TxnOptions {
            timeout: Duration::from_secs(30),
            finish: Finish::default(),
            retry: LockWait {
                max_wait: Duration::from_secs(10),
                initial_backoff: Duration::from_millis(2),
                max_backoff: Duration::from_millis(100),
            },
            faults: Default::default(),
        }
    }
}

impl std::fmt::Debug for TxnOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxnOptions")
            .field("timeout", &self.timeout)
            .field("finish", &self.finish)
            .field("retry", &self.retry)
            .field("faults", &crate::txn::failpoint::installed(&self.faults))
            .finish()
    }
}

impl TxnOptions {
    /// The longest [`timeout`](TxnOptions::timeout) that [`validate`](TxnOptions::validate)
    /// accepts: a coordinator that dies leaves its documents held until the deadline, and nobody
    /// may resolve them sooner, so a longer timeout is taken for a mistake.
    pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

    /// Checks that these options can work; [`Transactions::run`](crate::Transactions::run) and [`Transaction::commit`](crate::Transaction::commit)
    /// refuse with [`TxnError::InvalidOptions`] (before writing anything) when they cannot:
    ///
    /// - `timeout` under a millisecond (deadlines are whole milliseconds of server time, so every
    ///   apply would find the deadline passed) or over [`TxnOptions::MAX_TIMEOUT`];
    /// - `retry.initial_backoff` above `retry.max_backoff`;
    /// - a zero `retry.initial_backoff` while `retry.max_wait` allows retries: the backoff doubles
    ///   from it, so every rerun would follow the last at once, hammering the server.
    ///
    /// Any `retry.max_wait` is accepted: zero means one attempt, a huge one retries until the
    /// transaction commits or fails for a reason that retrying cannot fix.
    pub fn validate(&self) -> Result<(), TxnError> {
        let invalid = |option, value: String, reason: &str| {
            Err(TxnError::InvalidOptions {
                option,
                value,
                reason: reason.to_string(),
            })
        };
        if self.timeout < Duration::from_millis(1) {
            return invalid(
                "timeout",
                format!("{:?}", self.timeout),
                "deadlines are whole milliseconds of server time: under 1 ms every apply would find the deadline passed",
            );
        }
        if self.timeout > TxnOptions::MAX_TIMEOUT {
            return invalid(
                "timeout",
                format!("{:?}", self.timeout),
                "over a day: a dead coordinator's documents would stay held that long",
            );
        }
        let retry = &self.retry;
        if retry.initial_backoff > retry.max_backoff {
            return invalid(
                "retry",
                format!("{retry:?}"),
                "initial_backoff is longer than max_backoff",
            );
        }
        if retry.initial_backoff.is_zero() && !retry.max_wait.is_zero() {
            return invalid(
                "retry",
                format!("{retry:?}"),
                "a zero initial_backoff reruns at once, without ever pausing (use a zero max_wait for no retries)",
            );
        }
        Ok(())
    }

    /// Sets how long a transaction may take before anyone may resolve it.
    pub fn timeout(mut self, timeout: Duration) -> TxnOptions {
        self.timeout = timeout;
        self
    }

    /// Sets when documents are freed after the commit point.
    pub fn finish(mut self, finish: Finish) -> TxnOptions {
        self.finish = finish;
        self
    }

    /// Sets how [`Transactions::run`](crate::Transactions::run) retries.
    pub fn retry(mut self, retry: LockWait) -> TxnOptions {
        self.retry = retry;
        self
    }

    #[cfg(feature = "testkit")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
    /// Installs a fault injector (tests): the coordinator stops at the points it chooses.
    pub fn fault_injector(
        mut self,
        injector: std::sync::Arc<dyn crate::txn::failpoint::FaultInjector>,
    ) -> TxnOptions {
        self.faults = Some(injector);
        self
    }
}

/// What a document looks like after a committed transaction.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Written {
    /// Collection name.
    pub collection: String,
    /// Document id.
    pub id: Bson,
    /// Its version now (unchanged for a check; the tombstone's for a delete).
    pub version: i64,
}

/// The result of a committed transaction.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Outcome {
    /// The transaction id (`None` when nothing was staged and nothing written).
    pub txn: Option<ObjectId>,
    /// Each staged document, in lock order.
    pub written: Vec<Written>,
    /// Whether every document was freed before returning.
    pub finished: bool,
}

impl Outcome {
    /// The new version of document `id` in `collection`, if the transaction staged it.
    pub fn version_of(&self, collection: &str, id: impl Into<Bson>) -> Option<i64> {
        let id = id.into();
        self.written
            .iter()
            .find(|w| w.collection == collection && ids::same(&w.id, &id))
            .map(|w| w.version)
    }
}
