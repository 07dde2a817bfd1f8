//! One error for a service that mixes modules: [`Error`] holds any module's error, and
//! [`ErrorKind`] says what kind of failure it is, the same way for every module, so that one
//! `match` (or `?` into `mongotx::Error`) serves a caller of repositories, transactions, quotas,
//! OBTs, the rate limiter and the queue at once.
//!
//! The rule: every public function returns its own module's error ([`RepoError`] for the store
//! and repositories, [`TxnError`] for transactions and the GC, `QuotaError`, `ObtError` and
//! `FenceError`, `RateLimitError`, `QueueError`, [`ProbeError`]), with the collection, id and
//! versions involved in its message and the driver's error as its `source()`; each answers
//! [`kind`](RepoError::kind) and `is_retryable` side by side in its own file. [`Error`] is the one
//! type they all convert into, and [`Result`] defaults to it, for a service that mixes modules.

use crate::error_kind::ErrorKind;
use crate::obt::{FenceError, ObtError};
use crate::queue::QueueError;
use crate::quota::QuotaError;
use crate::ratelimit::RateLimitError;
use crate::repo::collection::SpecError;
use crate::repo::error::RepoError;
use crate::repo::outcome::HoldError;
use crate::repo::schema::SchemaError;
use crate::server::clock::ClockError;
use crate::server::probe::ProbeError;
use crate::txn::error::TxnError;

/// Any mongotx error: the module's own error inside, its message and `source()` passed through
/// unchanged. Every module error converts into it with `?`; [`kind`](Error::kind) says what kind
/// of failure it is and [`is_retryable`](Error::is_retryable) whether the same call may succeed.
///
/// # Examples
///
/// ```no_run
/// use mongotx::quota::{ProviderId, Quota, Request};
/// use mongotx::{Error, ErrorKind};
/// # async fn take(quota: &Quota, accounts: &mongotx::Repository<bson::Document>)
/// # -> Result<(), Error> {
/// // A quota error and a repository error, through one `?` and one `match`.
/// let cores = ProviderId::new("team-a", "cores");
/// quota.consume(&Request::new("job-7").take(cores, 4)).await?;
/// match accounts.get("alice").await {
///     Ok(account) => println!("{account:?}"),
///     Err(e) if e.kind() == ErrorKind::NotFound => println!("no such account"),
///     Err(e) => return Err(e.into()),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// From a repository (documents, versions, soft deletes, upgrades).
    #[error(transparent)]
    Repo(#[from] RepoError),
    /// From a transaction, or the GC.
    #[error(transparent)]
    Txn(#[from] TxnError),
    /// From a collection definition.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// From a JSON Schema.
    #[error(transparent)]
    Schema(#[from] SchemaError),
    /// From resolving a transaction's hold on a document.
    #[error(transparent)]
    Hold(#[from] HoldError),
    /// From reading the server's clock.
    #[error(transparent)]
    Clock(#[from] ClockError),
    /// From probing the server.
    #[error(transparent)]
    Probe(#[from] ProbeError),
    /// From the quota module.
    #[error(transparent)]
    Quota(#[from] QuotaError),
    /// From the OBT module.
    #[error(transparent)]
    Obt(#[from] ObtError),
    /// From a fence.
    #[error(transparent)]
    Fence(#[from] FenceError),
    /// From the rate limiter.
    #[error(transparent)]
    RateLimit(#[from] RateLimitError),
    /// From the batch queue.
    #[error(transparent)]
    Queue(#[from] QueueError),
}

/// A result whose error defaults to [`Error`], the error any module's converts into with `?`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Repo(e) => e.kind(),
            Error::Txn(e) => e.kind(),
            Error::Spec(e) => e.kind(),
            Error::Schema(e) => e.kind(),
            Error::Hold(e) => e.kind(),
            Error::Clock(e) => e.kind(),
            Error::Probe(e) => e.kind(),
            Error::Quota(e) => e.kind(),
            Error::Obt(e) => e.kind(),
            Error::Fence(e) => e.kind(),
            Error::RateLimit(e) => e.kind(),
            Error::Queue(e) => e.kind(),
        }
    }

    /// Whether the same call (after reading again, for a conflict) may succeed: the module's own
    /// answer.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Repo(e) => e.is_retryable(),
            Error::Txn(e) => e.is_retryable(),
            Error::Spec(e) => e.is_retryable(),
            Error::Schema(e) => e.is_retryable(),
            Error::Hold(e) => e.is_retryable(),
            Error::Clock(e) => e.is_retryable(),
            Error::Probe(e) => e.is_retryable(),
            Error::Quota(e) => e.is_retryable(),
            Error::Obt(e) => e.is_retryable(),
            Error::Fence(e) => e.is_retryable(),
            Error::RateLimit(e) => e.is_retryable(),
            Error::Queue(e) => e.is_retryable(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A module error keeps its message and source through the conversion, and its kind and
    /// retryability are the module's.
    #[test]
    fn conversion_keeps_message_source_kind_and_retryability() {
        let repo = RepoError::VersionConflict {
            collection: "accounts".into(),
            id: "\"alice\"".into(),
            expected: 3,
            actual: 4,
        };
        let message = repo.to_string();
        let error: Error = repo.into();
        assert_eq!(error.to_string(), message);
        assert_eq!(error.kind(), ErrorKind::Conflict);
        assert!(error.is_retryable());

        let nested: Error = QuotaError::from(RepoError::NotFound {
            collection: "quota_providers".into(),
            id: "\"p\"".into(),
        })
        .into();
        assert_eq!(nested.kind(), ErrorKind::NotFound);
        assert!(!nested.is_retryable());
        // The repository's error is the quota error's source, not a variant to match through.
        let inner = std::error::Error::source(&nested).map(ToString::to_string);
        assert_eq!(inner.as_deref(), Some("quota_providers/\"p\": not found"));

        let clock: Error = ClockError::NoLocalTime.into();
        assert_eq!(clock.kind(), ErrorKind::Unsupported);
        assert!(std::error::Error::source(&clock).is_none());
    }
}
