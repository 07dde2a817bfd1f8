//! The batch queuer's error type. Input errors are found before anything is written.

use crate::error_kind::ErrorKind;
use thiserror::Error;

/// Everything a queue operation can fail with.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum QueueError {
    /// A batch, or a header naming one, is unusable: an empty, overlong or NUL-carrying header or
    /// service id, an empty or overlong content. Found before anything is written.
    #[error("{collection}: invalid batch: {reason}")]
    InvalidBatch {
        /// The collection of batches.
        collection: String,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// An argument other than the batch is unusable: a collection name the queue cannot use, a
    /// delay window or claim time out of range, an unusable claimant name. Found before anything
    /// is written.
    #[error("{collection}: invalid queue request: {reason}")]
    Invalid {
        /// The collection of batches (or the collection name that was refused).
        collection: String,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// The header is already used by a batch of another service or with another content.
    #[error("{collection}/{header}: the header is already used (service {service_id}) with another content or service")]
    HeaderReused {
        /// The collection of batches.
        collection: String,
        /// The header.
        header: String,
        /// The service of the stored batch.
        service_id: String,
    },
    /// No batch has this header.
    #[error("{collection}/{header}: no such batch")]
    UnknownBatch {
        /// The collection of batches.
        collection: String,
        /// The header.
        header: String,
    },
    /// No batch of this service was ever added (it has no batch and no slot).
    #[error("{collection}: no batch of service {service} was ever added")]
    UnknownService {
        /// The collection of batches.
        collection: String,
        /// The service id.
        service: String,
    },
    /// The ledger's statuses do not go this way (for example from committed back to pending).
    #[error("{collection}/{header}: a batch does not go from {from} to {to}")]
    InvalidTransition {
        /// The collection of batches.
        collection: String,
        /// The header.
        header: String,
        /// The stored status (`none`: nothing yet).
        from: String,
        /// The status asked for.
        to: String,
    },
    /// The caller does not hold the batch's claim (it expired and another submitter took it,
    /// or it was never this caller's).
    #[error("{collection}/{header}: claim {token} is not the batch's claim (held: {held})")]
    NotClaimant {
        /// The collection of batches.
        collection: String,
        /// The header.
        header: String,
        /// The claim presented.
        token: bson::oid::ObjectId,
        /// The claim the batch has (`none` if none).
        held: String,
    },
    /// Others kept changing the batch or its service; nothing was left half done.
    #[error("{collection}/{header}: {what} gave up after {tries} tries under contention")]
    Contended {
        /// The collection of batches.
        collection: String,
        /// The header.
        header: String,
        /// What was being done.
        what: &'static str,
        /// Tries made.
        tries: u32,
    },
    /// A batch could not be read or written.
    #[error(
        "{collection}/{header}: {op} failed: {}",
        crate::server::summarize(source)
    )]
    Database {
        /// The collection of batches.
        collection: String,
        /// The batch header (`*` for several).
        header: String,
        /// The operation.
        op: &'static str,
        /// The driver error.
        #[source]
        source: Box<mongodb::error::Error>,
    },
    /// A stored batch does not have the shape this version writes.
    #[error("{collection}/{header}: malformed batch: {reason}")]
    Malformed {
        /// The collection of batches.
        collection: String,
        /// The batch header.
        header: String,
        /// What is wrong.
        reason: String,
    },
    /// This process could not estimate the server's time.
    #[error("reading the server's time failed: {0}")]
    Clock(#[source] Box<crate::server::clock::ClockError>),
    /// A batch or a service document is of a stored format this version does not read, or the
    /// format the database writes could not be read (see `mongotx::format`); nothing was
    /// written.
    #[error(transparent)]
    Format(#[from] crate::repo::format::FormatError),
}

impl QueueError {
    /// What kind of failure this is (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        use QueueError as E;
        match self {
            E::InvalidBatch { .. } | E::Invalid { .. } => ErrorKind::InvalidInput,
            E::HeaderReused { .. } => ErrorKind::AlreadyExists,
            E::UnknownBatch { .. } | E::UnknownService { .. } => ErrorKind::NotFound,
            E::InvalidTransition { .. } | E::NotClaimant { .. } => ErrorKind::Refused,
            E::Contended { .. } => ErrorKind::Conflict,
            E::Database { .. } => ErrorKind::Unavailable,
            E::Malformed { .. } => ErrorKind::Data,
            E::Clock(e) => e.kind(),
            E::Format(source) => source.kind(),
        }
    }

    /// Whether trying the same call again may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            QueueError::Database { source, .. } => crate::server::is_transient(source),
            QueueError::Clock(e) => e.is_retryable(),
            QueueError::Contended { .. } => true,
            QueueError::Format(source) => source.is_retryable(),
            _ => false,
        }
    }

    pub(crate) fn database(
        collection: &str,
        header: &str,
        op: &'static str,
        source: mongodb::error::Error,
    ) -> QueueError {
        QueueError::Database {
            collection: collection.to_string(),
            header: header.to_string(),
            op,
            source: Box::new(source),
        }
    }
}
