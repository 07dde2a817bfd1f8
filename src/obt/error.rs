//! The OBT module's error types.

use std::time::Duration;

use thiserror::Error;

use crate::error_kind::ErrorKind;
use crate::obt::model::Token;
use crate::repo::error::RepoError;
use crate::repo::format::FormatError;
use crate::server::clock::ClockError;
use crate::txn::error::TxnError;

/// Everything an OBT operation can fail with. Input errors are found before anything is written.
///
/// "You lost ownership" ([`NotOwner`](ObtError::NotOwner), [`Preempted`](ObtError::Preempted),
/// [`StageReplayed`](ObtError::StageReplayed)) is never a database error, and "the service is
/// down" ([`Document`](ObtError::Document), [`Transaction`](ObtError::Transaction), [`Clock`](ObtError::Clock)) never
/// claims anything about ownership: [`is_retryable`](ObtError::is_retryable) tells them apart.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ObtError {
    /// An id, owner, ownership handle, option or other argument is unusable (empty, too long,
    /// out of range, a collection the module cannot use). Found before anything is written.
    #[error("{collection}: invalid OBT request: {reason}")]
    Invalid {
        /// The OBT collection (or the collection name that was refused).
        collection: String,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// No OBT with this id (never created, or released).
    #[error("{collection}/{id}: no such OBT")]
    NotFound {
        /// The OBT collection.
        collection: String,
        /// The OBT id.
        id: String,
    },
    /// Creating an OBT whose id is taken.
    #[error("{collection}/{id}: OBT exists, owned by {owner} (token {token})")]
    Exists {
        /// The OBT collection.
        collection: String,
        /// The OBT id.
        id: String,
        /// Its owner.
        owner: String,
        /// Its token.
        token: Token,
    },
    /// The caller named an owner that does not own the OBT (a preempt naming the wrong current
    /// owner, an advance or release by someone else).
    #[error("{collection}/{id}: owned by {current} (token {token}), not by {presented}")]
    NotOwner {
        /// The OBT collection.
        collection: String,
        /// The OBT id.
        id: String,
        /// The owner the caller named.
        presented: String,
        /// The owner now.
        current: String,
        /// The token now.
        token: Token,
    },
    /// This ownership ended: someone preempted or took over the OBT (or released it). Nothing
    /// the old owner tried here was written.
    #[error("{collection}/{id}: ownership of {owner} (token {token}) ended; now {}", now.as_ref().map(|(o, t)| format!("owned by {o} (token {t})")).unwrap_or_else(|| "released".into()))]
    Preempted {
        /// The OBT collection.
        collection: String,
        /// The OBT id.
        id: String,
        /// The owner whose ownership ended.
        owner: String,
        /// Its token.
        token: Token,
        /// The owner and token now, if the OBT still exists.
        now: Option<(String, Token)>,
    },
    /// A call carried a stage older than the OBT's: a replay of an earlier step.
    #[error("{collection}/{id}: stage {presented} is older than the OBT's stage {current}")]
    StageReplayed {
        /// The OBT collection.
        collection: String,
        /// The OBT id.
        id: String,
        /// The OBT's stage.
        current: i64,
        /// The stage the call carried.
        presented: i64,
    },
    /// A take-over before the owner has been silent for its whole lease.
    #[error("{collection}/{id}: owner {owner} may still be alive: silent for {silent:?} of its {lease:?} lease")]
    LeaseLive {
        /// The OBT collection.
        collection: String,
        /// The OBT id.
        id: String,
        /// The owner.
        owner: String,
        /// How long it has been silent as far as the contender knows.
        silent: Duration,
        /// Its lease.
        lease: Duration,
    },
    /// A take-over found the OBT changed since it was observed: the owner showed signs of life,
    /// or someone else took over or preempted it. Observe again.
    #[error("{collection}/{id}: changed since observed at version {observed} (token {observed_token}); now owned by {owner} at version {version} (token {token})")]
    Changed {
        /// The OBT collection.
        collection: String,
        /// The OBT id.
        id: String,
        /// The version observed.
        observed: i64,
        /// The token observed.
        observed_token: Token,
        /// The owner now.
        owner: String,
        /// The version now.
        version: i64,
        /// The token now.
        token: Token,
    },
    /// A take-over of an OBT without a lease (only explicit preemption can take it).
    #[error("{collection}/{id}: has no lease; only an explicit preempt can take it from {owner}")]
    NoLease {
        /// The OBT collection.
        collection: String,
        /// The OBT id.
        id: String,
        /// The owner.
        owner: String,
    },
    /// The OBT document could not be read or written.
    #[error("OBT: {source}")]
    Document {
        /// What the repository said.
        #[source]
        source: Box<RepoError>,
    },
    /// An owned transaction failed for a reason other than losing ownership.
    #[error("OBT: {source}")]
    Transaction {
        /// What the transaction said.
        #[source]
        source: Box<TxnError>,
    },
    /// The server's time could not be read.
    #[error("OBT: {source}")]
    Clock {
        /// What reading the server's clock said.
        #[source]
        source: ClockError,
    },
    /// An OBT or its namespace's token counter is of a stored format this version does not
    /// read, or the format the database writes could not be read (see `mongotx::format`);
    /// nothing was written.
    #[error(transparent)]
    Format(#[from] FormatError),
}

crate::txn::error::from_lower_errors!(ObtError);

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
            E::Document { source } => source.kind(),
            E::Transaction { source } => source.kind(),
            E::Clock { source } => source.kind(),
            E::Format(source) => source.kind(),
        }
    }

    /// Whether trying the same call again may succeed: the database was unreachable, slow or
    /// contended. Losing ownership is never retryable.
    pub fn is_retryable(&self) -> bool {
        match self {
            ObtError::Document { source } => source.is_retryable(),
            ObtError::Transaction { source } => source.is_retryable(),
            ObtError::Clock { source } => source.is_retryable(),
            ObtError::Format(source) => source.is_retryable(),
            _ => false,
        }
    }

    /// Whether this says the caller does not (or no longer) own the OBT.
    pub fn is_lost_ownership(&self) -> bool {
        matches!(
            self,
            ObtError::NotOwner { .. } | ObtError::Preempted { .. } | ObtError::NotFound { .. }
        )
    }
}

/// A downstream fence's refusal, or its storage failing.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum FenceError {
    /// The resource has already admitted a higher token: the caller's ownership is over.
    #[error("resource {resource}: stale token {presented}, already saw {seen}")]
    StaleToken {
        /// The fenced resource.
        resource: String,
        /// The highest token it has admitted.
        seen: Token,
        /// The token the call carried.
        presented: Token,
    },
    /// An unusable resource name, token or fence collection. Found before anything is written.
    #[error("{fence}: invalid fence call: {reason}")]
    Invalid {
        /// The fence: the collection of a [`MongoFence`](crate::obt::MongoFence), `memory fence`
        /// for a [`MemoryFence`](crate::obt::MemoryFence).
        fence: String,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// The fence's collection could not be read or written.
    #[error("fence: {source}")]
    Document {
        /// What the repository said.
        #[source]
        source: Box<RepoError>,
    },
    /// A resource's fence document is of a stored format this version does not read, or the
    /// format the database writes could not be read (see `mongotx::format`); nothing was
    /// written.
    #[error(transparent)]
    Format(#[from] FormatError),
}

impl From<RepoError> for FenceError {
    fn from(source: RepoError) -> FenceError {
        FenceError::Document {
            source: Box::new(source),
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
            FenceError::Document { source } => source.kind(),
            FenceError::Format(source) => source.kind(),
        }
    }

    /// Whether trying the same call again may succeed (never for a stale token).
    pub fn is_retryable(&self) -> bool {
        match self {
            FenceError::Document { source } => source.is_retryable(),
            FenceError::Format(source) => source.is_retryable(),
            _ => false,
        }
    }
}
