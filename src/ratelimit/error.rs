//! The rate limiter's error type. Input errors are found before anything is written.

use std::time::Duration;

use crate::error_kind::ErrorKind;
use bson::oid::ObjectId;
use thiserror::Error;

/// Everything a rate-limiter operation can fail with.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RateLimitError {
    /// A limit's definition is unusable (no calls, a zero window, a reserved part as large as the
    /// limit, a hold longer than a day...).
    #[error("{collection}/{limiter}: invalid limit: {reason}")]
    InvalidLimit {
        /// The collection of limiters.
        collection: String,
        /// The limiter.
        limiter: String,
        /// What is wrong.
        reason: String,
    },
    /// The limiter exists with another definition; `define` never changes a live limit, since
    /// workers that read the old one would count by it.
    #[error("{collection}/{limiter}: already defined as {existing}, not {wanted}")]
    LimitMismatch {
        /// The collection of limiters.
        collection: String,
        /// The limiter.
        limiter: String,
        /// The stored definition.
        existing: String,
        /// The one asked for.
        wanted: String,
    },
    /// No limiter of this name has been defined.
    #[error("{collection}/{limiter}: no such limiter")]
    UnknownLimiter {
        /// The collection of limiters.
        collection: String,
        /// The limiter.
        limiter: String,
    },
    /// A request for zero calls.
    #[error("{collection}/{limiter}: a reservation must be for at least one call")]
    ZeroCalls {
        /// The collection of limiters.
        collection: String,
        /// The limiter.
        limiter: String,
    },
    /// More calls than this kind of caller can ever be granted at once (the limit for
    /// high-priority callers, the limit less the reserved part for bulk callers).
    #[error("{collection}/{limiter}: {requested} calls asked, at most {most} can ever be granted at once to a {priority} caller")]
    TooManyCalls {
        /// The collection of limiters.
        collection: String,
        /// The limiter.
        limiter: String,
        /// Calls asked.
        requested: u32,
        /// The most that can be granted.
        most: u32,
        /// The caller's priority.
        priority: String,
    },
    /// One request named a limiter twice, or none, or a limiter name is unusable (empty, longer
    /// than 512 bytes, or holding a control character such as a NUL).
    #[error("invalid rate-limit request: {reason}")]
    InvalidRequest {
        /// What is wrong.
        reason: String,
    },
    /// A [`RateLimitOptions`](crate::ratelimit::RateLimitOptions) value makes no sense: a
    /// collection name the server refuses or that belongs to someone else (another mongotx
    /// module, or a collection holding documents that are not limiters), or a poll of zero or
    /// more than a day. Found before any collection is created or changed.
    #[error("{collection}: option {option} = {value} is unusable: {reason}")]
    InvalidOption {
        /// The collection of limiters asked for.
        collection: String,
        /// The option, as named on `RateLimitOptions`.
        option: &'static str,
        /// The value given.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// The reservation is not in the limiter's log: never granted (or granted by another
    /// collection), or a forged handle.
    #[error("{collection}/{limiter}: no reservation {reservation}")]
    UnknownReservation {
        /// The collection of limiters.
        collection: String,
        /// The limiter.
        limiter: String,
        /// The reservation.
        reservation: ObjectId,
    },
    /// The reservation was settled, or is being settled, by another `settle` call (on it or a
    /// clone of it) reporting `made` calls made; that settlement stands, and this call wrote
    /// nothing. (After that call failed with a retryable error, a call reporting the same
    /// `made` sends the same settlement again instead.)
    #[error("{collection}/{limiter}: reservation {reservation} was already settled with {made} calls made")]
    AlreadySettled {
        /// The collection of limiters.
        collection: String,
        /// The limiter.
        limiter: String,
        /// The reservation.
        reservation: ObjectId,
        /// The calls recorded by the first settlement.
        made: u32,
    },
    /// More calls reported made than were reserved.
    #[error(
        "reservation {reservation}: {made} calls reported made, only {reserved} were reserved"
    )]
    MadeExceedsReserved {
        /// The reservation.
        reservation: ObjectId,
        /// Calls reported.
        made: u32,
        /// Calls reserved.
        reserved: u32,
    },
    /// Waiting for capacity took longer than the caller allowed.
    #[error("{collection}/{limiters}: no room for {requested} calls within {waited:?}")]
    TimedOut {
        /// The collection of limiters.
        collection: String,
        /// The limiters asked, comma separated.
        limiters: String,
        /// Calls asked.
        requested: u32,
        /// Time spent waiting.
        waited: Duration,
    },
    /// A settlement's sendings kept reaching the limiter outside their window of server time
    /// (this process's estimate of the limiter's clock far off, or a link slower than
    /// [`send_window`](crate::ratelimit::RateLimitOptions::send_window)) until the tries ran
    /// out; none of them changed anything. Retrying is safe.
    #[error("{collection}/{limiter}: {what} did not apply after {tries} tries")]
    Contended {
        /// The collection of limiters.
        collection: String,
        /// The limiter.
        limiter: String,
        /// The operation.
        what: &'static str,
        /// Tries made.
        tries: u32,
    },
    /// The limiter document could not be read or written.
    #[error(
        "{collection}/{limiter}: {op} failed: {}",
        crate::server::summarize(source)
    )]
    Database {
        /// The collection of limiters.
        collection: String,
        /// The limiter.
        limiter: String,
        /// The operation.
        op: &'static str,
        /// The driver error.
        #[source]
        source: Box<mongodb::error::Error>,
    },
    /// This process could not estimate the server's time (to queue a bulk caller).
    #[error("reading the server's time failed: {0}")]
    Clock(#[source] Box<crate::server::clock::ClockError>),
    /// A limiter document does not have the shape this version writes.
    #[error("{collection}/{limiter}: malformed limiter document: {reason}")]
    Malformed {
        /// The collection of limiters.
        collection: String,
        /// The limiter.
        limiter: String,
        /// What is wrong.
        reason: String,
    },
    /// A limiter is of a stored format this version does not read, or the format the database
    /// writes could not be read (see `mongotx::format`); nothing was written.
    #[error(transparent)]
    Format(#[from] crate::repo::format::FormatError),
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
            E::Format(source) => source.kind(),
        }
    }

    /// Whether trying the same call again may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            RateLimitError::Database { source, .. } => crate::server::is_transient(source),
            RateLimitError::Clock(e) => e.is_retryable(),
            RateLimitError::TimedOut { .. } | RateLimitError::Contended { .. } => true,
            RateLimitError::Format(source) => source.is_retryable(),
            _ => false,
        }
    }

    pub(crate) fn database(
        collection: &str,
        limiter: &str,
        op: &'static str,
        source: mongodb::error::Error,
    ) -> RateLimitError {
        RateLimitError::Database {
            collection: collection.to_string(),
            limiter: limiter.to_string(),
            op,
            source: Box::new(source),
        }
    }
}
