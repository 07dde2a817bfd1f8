//! What the repository layer needs to know of a holder, and what can go wrong finding out: a
//! transaction's outcome as its record says ([`TxnStatus`]) and why a hold could not be resolved
//! ([`HoldError`]). The store's `HoldResolver` seam answers in these terms; the hold protocol
//! (`repo::hold`) produces them and the repository's errors carry them.

use crate::error_kind::ErrorKind;
use crate::repo::format::FormatError;
use bson::DateTime;

/// What a transaction's record says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnStatus {
    /// Still undecided (staging, with a participant not in place); anyone may decide it once
    /// `deadline` (server time) has passed.
    Pending {
        /// The deadline.
        deadline: DateTime,
    },
    /// Committed.
    Committed,
    /// Aborted.
    Aborted,
    /// No record: the transaction ended, and any hold left of it did not commit.
    Absent,
}

/// Why a hold could not be resolved: one clean sentence, the driver error as its source.
#[derive(Debug, thiserror::Error)]
#[error("{reason}")]
pub struct HoldError {
    reason: String,
    #[source]
    source: Option<Box<mongodb::error::Error>>,
    /// Set when the record or hold is of a format this process does not read (or the format
    /// the database writes could not be read).
    format: Option<Box<FormatError>>,
}

impl HoldError {
    /// An error described by `reason` alone.
    pub fn new(reason: impl Into<String>) -> HoldError {
        HoldError {
            reason: reason.into(),
            source: None,
            format: None,
        }
    }

    /// A record or hold this process must not act on because of its format.
    pub(crate) fn format(error: FormatError) -> HoldError {
        HoldError {
            reason: error.to_string(),
            source: None,
            format: Some(Box::new(error)),
        }
    }

    /// The format refusal inside, if this is one: a record or hold of a newer format.
    pub fn format_error(&self) -> Option<&FormatError> {
        self.format.as_deref()
    }

    /// A driver failure while doing `what`.
    pub fn database(what: &str, source: mongodb::error::Error) -> HoldError {
        HoldError {
            reason: format!("{what} failed: {}", crate::server::summarize(&source)),
            source: Some(Box::new(source)),
            format: None,
        }
    }

    /// Whether a driver error caused it (rather than a record that cannot be understood).
    pub(crate) fn has_driver_source(&self) -> bool {
        self.source.is_some()
    }

    /// What kind of failure this is: resolving a hold fails only when the server cannot be read
    /// or a record cannot be understood.
    pub fn kind(&self) -> ErrorKind {
        if let Some(format) = &self.format {
            format.kind()
        } else if self.has_driver_source() {
            ErrorKind::Unavailable
        } else {
            ErrorKind::Data
        }
    }

    /// Whether trying again may succeed.
    pub fn is_retryable(&self) -> bool {
        if let Some(format) = &self.format {
            return format.is_retryable();
        }
        self.source
            .as_deref()
            .is_some_and(crate::server::is_transient)
    }
}
