//! What kind of failure an error is, the same across modules: each module's error answers
//! `kind()` beside `is_retryable()`, and [`Error`](crate::Error) passes both through.

/// What kind of failure an error is, the same across modules; see [`Error::kind`](crate::Error::kind).
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
    /// The server or the connection failed; [`Error::is_retryable`](crate::Error::is_retryable) says whether it may pass.
    Unavailable,
    /// Stored data is not what this version of mongotx (or the caller's type) expects: a
    /// document not written by mongotx, a newer schema, a failed upgrade, a value that does not
    /// deserialize.
    Data,
    /// Stored data, or the stored format the database writes, is of a newer format than this
    /// version of mongotx reads (see [`format`](crate::format)): upgrade this process. Nothing
    /// was written.
    NewerFormat,
    /// The server lacks a behaviour mongotx needs (see [`probe`](crate::server::probe)).
    Unsupported,
    /// A fault injector stopped the call here, as a killed process would stop (only with the
    /// `testkit` feature, whose fault injection is the one source of it).
    #[cfg(feature = "testkit")]
    Crashed,
}
