//! One error for a service that mixes modules: [`Error`] holds any module's error, and
//! [`ErrorKind`] says what kind of failure it is, the same way for every module, so that one
//! `match` (or `?` into `mongotx::Error`) serves a caller of repositories, transactions, quotas,
//! OBTs, the rate limiter and the queue at once.
//!
//! Each module keeps its own error type, with the collection, id and versions involved in its
//! message and the driver's error as its `source()`; each also answers [`kind`](RepoError::kind)
//! and `is_retryable` itself. The kinds are decided here, in one table, so that the modules do not
//! depend on this file (it depends on all of them).

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

/// What kind of failure an error is, the same across modules; see [`Error::kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The call was refused before anything was written: an argument, a document or an option
    /// that cannot work. Fix the call; sending it again fails the same way.
    InvalidInput,
    /// What the call names does not exist (never did, was deleted, released or expired away).
    NotFound,
    /// What the call creates exists already (an id, a unique key, a provider, an OBT, a batch
    /// header, a limiter defined differently).
    AlreadyExists,
    /// Someone else changed or held it first (a version conflict, a transaction's hold, a
    /// contended document, a transaction aborted by another party): read again and retry.
    Conflict,
    /// A rule of the module said no: not enough quota, ownership lost or never held, a stale
    /// fencing token, a replayed stage, a reservation already settled, a status that cannot go
    /// that way. Retrying the same call does not help; the caller decides what comes next.
    Refused,
    /// Waiting (for capacity, or for retries to succeed) took longer than the caller allowed.
    TimedOut,
    /// A commit whose outcome is not known yet (its last write got no answer); reading the
    /// documents, or the transaction's record, later tells.
    OutcomeUnknown,
    /// The server or the connection failed; [`Error::is_retryable`] says whether it may pass.
    Unavailable,
    /// Stored data is not what this version of mongotx (or the caller's type) expects: a
    /// document not written by mongotx, a newer schema, a failed upgrade, a value that does not
    /// deserialize.
    Data,
    /// The server lacks a behaviour mongotx needs (see [`probe`](crate::probe)).
    Unsupported,
    /// A fault injector stopped the call here, as a killed process would stop (tests only).
    Crashed,
}

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

impl RepoError {
    /// What kind of failure this is (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        use RepoError as E;
        match self {
            E::NotFound { .. } | E::Deleted { .. } => ErrorKind::NotFound,
            E::VersionConflict { .. } | E::ConditionFailed { .. } | E::Locked { .. } => {
                ErrorKind::Conflict
            }
            E::DuplicateId { .. } | E::DuplicateKey { .. } => ErrorKind::AlreadyExists,
            E::SchemaTooNew { .. } | E::Upgrade { .. } | E::Malformed { .. } | E::Decode { .. } => {
                ErrorKind::Data
            }
            E::Invalid { .. }
            | E::SystemField { .. }
            | E::InvalidVersion { .. }
            | E::InvalidId { .. }
            | E::InvalidIncrement { .. }
            | E::EmptyChange { .. }
            | E::InvalidQuery { .. }
            | E::Encode { .. }
            | E::Refused { .. } => ErrorKind::InvalidInput,
            E::Spec(e) => e.kind(),
            E::Hold { source, .. } => source.kind(),
            E::Clock { source, .. } => source.kind(),
            E::ServerUnsuitable { .. } => ErrorKind::Unsupported,
            E::Database { .. } => ErrorKind::Unavailable,
        }
    }
}

impl TxnError {
    /// What kind of failure this is (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        use TxnError as E;
        match self {
            E::Document { source, .. } => source.kind(),
            E::DuplicateEntry { .. }
            | E::TooLarge { .. }
            | E::Closed { .. }
            | E::InvalidOptions { .. }
            | E::ForeignRepository { .. } => ErrorKind::InvalidInput,
            E::Expired { .. } | E::Aborted { .. } => ErrorKind::Conflict,
            E::CommitUnknown { .. } => ErrorKind::OutcomeUnknown,
            E::Crashed { .. } => ErrorKind::Crashed,
            E::Malformed { .. } => ErrorKind::Data,
            E::Rejected { .. } => ErrorKind::Refused,
            E::GaveUp { .. } => ErrorKind::TimedOut,
            E::Clock { source, .. } => source.kind(),
            E::Resolve { source, .. } => source.kind(),
            E::Database { .. } => ErrorKind::Unavailable,
        }
    }
}

impl SpecError {
    /// What kind of failure this is: always [`ErrorKind::InvalidInput`] (the definition is the
    /// caller's).
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidInput
    }
}

impl SchemaError {
    /// What kind of failure this is: always [`ErrorKind::InvalidInput`] (the schema text is the
    /// caller's).
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidInput
    }
}

impl HoldError {
    /// What kind of failure this is: resolving a hold fails only when the server cannot be read
    /// or a record cannot be understood.
    pub fn kind(&self) -> ErrorKind {
        if self.has_driver_source() {
            ErrorKind::Unavailable
        } else {
            ErrorKind::Data
        }
    }
}

impl ClockError {
    /// What kind of failure this is (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            ClockError::Database { .. } => ErrorKind::Unavailable,
            ClockError::NoLocalTime => ErrorKind::Unsupported,
        }
    }
}

impl ProbeError {
    /// What kind of failure this is: [`ErrorKind::Unsupported`] for a property the server lacks,
    /// [`ErrorKind::Unavailable`] for a failure while checking.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ProbeError::Database { .. } => ErrorKind::Unavailable,
            _ => ErrorKind::Unsupported,
        }
    }
}

impl QuotaError {
    /// What kind of failure this is (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        use QuotaError as E;
        match self {
            E::QuotaExceeded { .. } | E::ReservationExpired { .. } => ErrorKind::Refused,
            E::UnknownProvider { .. }
            | E::UnknownConsumer { .. }
            | E::UnknownRequest { .. }
            | E::UnknownReservation { .. } => ErrorKind::NotFound,
            E::ProviderExists { .. } => ErrorKind::AlreadyExists,
            E::InvalidAmount { .. }
            | E::DuplicateProvider { .. }
            | E::NegativeLimit { .. }
            | E::InvalidRequest { .. }
            | E::InvalidName { .. }
            | E::InvalidOption { .. }
            | E::RequestReused { .. }
            | E::InvalidTtl { .. } => ErrorKind::InvalidInput,
            E::Contended { .. } => ErrorKind::Conflict,
            E::Repo(e) => e.kind(),
            E::Txn(e) => e.kind(),
            E::Clock(e) => e.kind(),
            E::Crashed { .. } => ErrorKind::Crashed,
        }
    }
}

impl ObtError {
    /// What kind of failure this is (see [`ErrorKind`]); losing ownership is
    /// [`ErrorKind::Refused`] (or [`ErrorKind::NotFound`] once the OBT is gone).
    pub fn kind(&self) -> ErrorKind {
        use ObtError as E;
        match self {
            E::Invalid { .. } => ErrorKind::InvalidInput,
            E::NotFound { .. } => ErrorKind::NotFound,
            E::Exists { .. } => ErrorKind::AlreadyExists,
            E::NotOwner { .. }
            | E::Preempted { .. }
            | E::StageReplayed { .. }
            | E::LeaseLive { .. }
            | E::NoLease { .. } => ErrorKind::Refused,
            E::Changed { .. } => ErrorKind::Conflict,
            E::Repo(e) => e.kind(),
            E::Txn(e) => e.kind(),
            E::Clock(e) => e.kind(),
        }
    }
}

impl FenceError {
    /// What kind of failure this is (see [`ErrorKind`]); a stale token is
    /// [`ErrorKind::Refused`].
    pub fn kind(&self) -> ErrorKind {
        match self {
            FenceError::StaleToken { .. } => ErrorKind::Refused,
            FenceError::Invalid { .. } => ErrorKind::InvalidInput,
            FenceError::Repo(e) => e.kind(),
        }
    }
}

impl RateLimitError {
    /// What kind of failure this is (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        use RateLimitError as E;
        match self {
            E::InvalidLimit { .. }
            | E::ZeroCalls { .. }
            | E::TooManyCalls { .. }
            | E::InvalidRequest { .. }
            | E::InvalidOption { .. }
            | E::MadeExceedsReserved { .. } => ErrorKind::InvalidInput,
            E::LimitMismatch { .. } => ErrorKind::AlreadyExists,
            E::UnknownLimiter { .. } | E::UnknownReservation { .. } => ErrorKind::NotFound,
            E::AlreadySettled { .. } => ErrorKind::Refused,
            E::TimedOut { .. } => ErrorKind::TimedOut,
            E::Contended { .. } => ErrorKind::Conflict,
            E::Database { .. } => ErrorKind::Unavailable,
            E::Clock(e) => e.kind(),
            E::Malformed { .. } => ErrorKind::Data,
        }
    }
}

impl QueueError {
    /// What kind of failure this is (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        use QueueError as E;
        match self {
            E::InvalidBatch { .. } | E::Invalid { .. } => ErrorKind::InvalidInput,
            E::HeaderReused { .. } => ErrorKind::AlreadyExists,
            E::UnknownBatch { .. } => ErrorKind::NotFound,
            E::InvalidTransition { .. } | E::NotClaimant { .. } => ErrorKind::Refused,
            E::Contended { .. } => ErrorKind::Conflict,
            E::Database { .. } => ErrorKind::Unavailable,
            E::Malformed { .. } => ErrorKind::Data,
            E::Clock(e) => e.kind(),
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

        let nested: Error = QuotaError::Repo(RepoError::NotFound {
            collection: "quota_providers".into(),
            id: "\"p\"".into(),
        })
        .into();
        assert_eq!(nested.kind(), ErrorKind::NotFound);
        assert!(!nested.is_retryable());

        let clock: Error = ClockError::NoLocalTime.into();
        assert_eq!(clock.kind(), ErrorKind::Unsupported);
        assert!(std::error::Error::source(&clock).is_none());
    }
}
