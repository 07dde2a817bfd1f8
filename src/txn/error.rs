//! The error type of transactions: staging, commit, rollback and GC.

use std::time::Duration;

use bson::oid::ObjectId;
use thiserror::Error;

use crate::error_kind::ErrorKind;
use crate::repo::error::RepoError;
use crate::repo::hold::record::TxnState;
use crate::server::clock::{rfc3339, span, ClockError};
use crate::server::summarize;

/// Everything a transaction (staging, commit, GC) can fail with; messages name the transaction.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TxnError {
    /// A staged document could not be changed: the repository error says which and why.
    #[error("transaction {}: {source}", show_txn(txn))]
    Document {
        /// The transaction, once it has a record.
        txn: Option<ObjectId>,
        /// What happened to the document (boxed: it is large).
        #[source]
        source: Box<RepoError>,
    },
    /// The same document was staged twice (ids the server treats as one, such as Int32 7 and
    /// Double 7.0, count as the same document).
    #[error("{collection}/{id} is staged twice in one transaction; combine the changes")]
    DuplicateEntry {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
    },
    /// Staging this document would make the transaction's record (which lists every staged
    /// change) larger than one MongoDB document may be, so the record could never be written.
    #[error("{collection}/{id}: staging it would make the transaction record about {bytes} bytes ({entries} documents), over the {limit}-byte limit of one document; split the transaction")]
    TooLarge {
        /// Collection of the document that did not fit.
        collection: String,
        /// Its id.
        id: String,
        /// Documents the record would list with it.
        entries: usize,
        /// The size the record's entries would reach with it.
        bytes: usize,
        /// The most the entries may take.
        limit: usize,
    },
    /// The transaction was already committed (or its commit attempted, successfully or not) by
    /// this handle or a clone of it: it stages and commits nothing more.
    #[error("cannot {action}: this transaction's commit was already called (by this handle or a clone of it); begin a new transaction")]
    Closed {
        /// What was attempted, naming the collection and id where there is one.
        action: String,
    },
    /// A transaction or GC option has a value that cannot work; nothing was written.
    #[error("invalid option {option} = {value}: {reason}")]
    InvalidOptions {
        /// The option, as its builder method names it.
        option: &'static str,
        /// The value given.
        value: String,
        /// Why it cannot work.
        reason: String,
    },
    /// A repository of another database was staged; a transaction's record and all its documents
    /// live in one database.
    #[error("{collection} belongs to database {database}, but this transaction runs in database {expected}")]
    ForeignRepository {
        /// Collection name.
        collection: String,
        /// The repository's database.
        database: String,
        /// The transaction's database.
        expected: String,
    },
    /// The deadline passed and the transaction was aborted by someone else before its commit
    /// point; it was rolled back. Retrying is safe.
    #[error(
        "transaction {txn}: its deadline passed and it was rolled back before the commit point"
    )]
    Expired {
        /// The transaction.
        txn: ObjectId,
    },
    /// The commit point could not be written, so the coordinator aborted its own transaction
    /// and rolled it back. Retrying is safe.
    #[error("transaction {txn}: aborted and rolled back because the commit point could not be written ({cause})")]
    Aborted {
        /// The transaction.
        txn: ObjectId,
        /// The last failure seen while writing the commit point.
        cause: String,
    },
    /// The commit point may or may not have been written and the coordinator could not find out.
    /// Not retryable: rerunning the body could apply the changes twice. The record (or, once it is
    /// gone, the documents) tells; after the deadline anyone settles the transaction either way.
    #[error("transaction {txn}: outcome unknown, the commit point may or may not have been written ({cause}); check the documents before retrying")]
    CommitUnknown {
        /// The transaction.
        txn: ObjectId,
        /// What prevented finding out.
        cause: String,
    },
    /// A fault injector stopped the coordinator or GC here, as a crash would (only with the
    /// `testkit` feature).
    #[cfg(feature = "testkit")]
    #[error("transaction {}: injected crash at {at}", show_txn(txn))]
    Crashed {
        /// The transaction, if it had an id yet.
        txn: Option<ObjectId>,
        /// The failpoint.
        at: crate::txn::failpoint::Failpoint,
    },
    /// A stored record cannot be read.
    #[error("transaction {txn}: its record is malformed: {reason}")]
    Malformed {
        /// The transaction.
        txn: ObjectId,
        /// What is wrong.
        reason: String,
    },
    /// The caller's transaction body decided not to commit.
    #[error("transaction rejected: {reason}")]
    Rejected {
        /// Why.
        reason: String,
    },
    /// `run` ran out of time retrying.
    #[error("gave up after {attempts} attempts in {elapsed:?}; last error: {last}")]
    GaveUp {
        /// Attempts made.
        attempts: u32,
        /// Time spent.
        elapsed: Duration,
        /// The last retryable error.
        last: Box<TxnError>,
    },
    /// The server's time, by which deadlines are set, could not be read.
    #[error("transaction {}: {source}", show_txn(txn))]
    Clock {
        /// The transaction, if it had an id yet.
        txn: Option<ObjectId>,
        /// What went wrong.
        #[source]
        source: ClockError,
    },
    /// Deciding an expired staging transaction (checking or fencing its participants) failed.
    #[error("transaction {txn}: deciding it failed: {source}")]
    Resolve {
        /// The transaction.
        txn: ObjectId,
        /// What went wrong.
        #[source]
        source: crate::repo::outcome::HoldError,
    },
    /// A transaction record is of a format this version does not read, or the format the
    /// database writes could not be read (see `mongotx::format`); nothing was written.
    #[error(transparent)]
    Format(#[from] crate::repo::format::FormatError),
    /// The collection named is not one mongotx manages in this database (the meta collection
    /// does not list it), so nothing in it can be held or explained; nothing was read from it.
    #[error(
        "{collection} is not a collection mongotx manages in database {database} (it manages: {})",
        show_names(managed)
    )]
    UnknownCollection {
        /// The database.
        database: String,
        /// The collection asked for.
        collection: String,
        /// The collections mongotx manages there.
        managed: Vec<String>,
    },
    /// No document of the collection has this id: it never existed, or its tombstone was purged.
    #[error("{collection}/{id}: no such document (it never existed, or its tombstone was purged)")]
    UnknownDocument {
        /// Collection name.
        collection: String,
        /// The id asked for.
        id: String,
    },
    /// Nothing is stored of this transaction: no record, and no document it holds. It never
    /// existed, or it ended and everything of it was cleaned up; either way there is nothing to
    /// do.
    #[error("transaction {txn}: no record and no document held by it (it never existed, or it ended and was cleaned up)")]
    UnknownTransaction {
        /// The transaction asked for.
        txn: ObjectId,
    },
    /// The transaction has not expired: its coordinator may still be at work, so only it
    /// decides the transaction until its deadline; settling it now, as the GC would after the
    /// deadline, was refused and nothing was written.
    #[error("transaction {txn} is {} and live: its deadline {} is {} away on the server's clock; only an expired transaction is settled (as the GC would settle it)", state.as_str(), rfc3339(*deadline), span(*left))]
    Live {
        /// The transaction.
        txn: ObjectId,
        /// Its record's state.
        state: TxnState,
        /// Its deadline (server time).
        deadline: bson::DateTime,
        /// How long until then, by the server's clock.
        left: Duration,
    },
    /// The server or the connection failed during a protocol step.
    #[error("transaction {}: {step} failed: {}", show_txn(txn), summarize(source))]
    Database {
        /// The transaction, if it had an id yet.
        txn: Option<ObjectId>,
        /// The protocol step.
        step: &'static str,
        /// The driver error.
        #[source]
        source: Box<mongodb::error::Error>,
    },
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
            #[cfg(feature = "testkit")]
            E::Crashed { .. } => ErrorKind::Crashed,
            E::Malformed { .. } => ErrorKind::Data,
            E::UnknownCollection { .. }
            | E::UnknownDocument { .. }
            | E::UnknownTransaction { .. } => ErrorKind::NotFound,
            E::Live { .. } => ErrorKind::Refused,
            E::Rejected { .. } => ErrorKind::Refused,
            E::GaveUp { .. } => ErrorKind::TimedOut,
            E::Clock { source, .. } => source.kind(),
            E::Resolve { source, .. } => source.kind(),
            E::Format(source) => source.kind(),
            E::Database { .. } => ErrorKind::Unavailable,
        }
    }

    /// Whether running the transaction again (after re-reading) may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            TxnError::Document { source, .. } => source.is_retryable(),
            TxnError::Expired { .. } | TxnError::Aborted { .. } => true,
            TxnError::Database { source, .. } => crate::server::is_transient(source),
            TxnError::Clock { source, .. } => source.is_retryable(),
            TxnError::Resolve { source, .. } => source.is_retryable(),
            TxnError::Format(source) => source.is_retryable(),
            _ => false,
        }
    }

    /// Whether a fault injector stopped the call (never without the `testkit` feature).
    pub(crate) fn is_crash(&self) -> bool {
        #[cfg(feature = "testkit")]
        return matches!(self, TxnError::Crashed { .. });
        #[cfg(not(feature = "testkit"))]
        false
    }

    /// The document-level error inside, if this is one.
    pub fn repo_error(&self) -> Option<&RepoError> {
        match self {
            TxnError::Document { source, .. } => Some(source),
            TxnError::GaveUp { last, .. } => last.repo_error(),
            _ => None,
        }
    }

    pub(crate) fn document(txn: Option<ObjectId>, source: RepoError) -> TxnError {
        TxnError::Document {
            txn,
            source: Box::new(source),
        }
    }

    /// Resolving `holder`'s hold on `collection`/`id` failed, for transaction `txn` (if any).
    pub(crate) fn hold(
        txn: Option<ObjectId>,
        collection: &str,
        id: &bson::Bson,
        holder: ObjectId,
        source: crate::repo::outcome::HoldError,
    ) -> TxnError {
        TxnError::document(
            txn,
            RepoError::Hold {
                collection: collection.to_string(),
                id: crate::repo::error::show_id(id),
                holder,
                source,
            },
        )
    }

    pub(crate) fn database(
        txn: Option<ObjectId>,
        step: &'static str,
        source: mongodb::error::Error,
    ) -> TxnError {
        TxnError::Database {
            txn,
            step,
            source: Box::new(source),
        }
    }
}

impl From<RepoError> for TxnError {
    fn from(source: RepoError) -> TxnError {
        TxnError::document(None, source)
    }
}

fn show_names(names: &[String]) -> String {
    if names.is_empty() {
        "none yet".to_string()
    } else {
        names.join(", ")
    }
}

fn show_txn(txn: &Option<ObjectId>) -> String {
    txn.map(|t| t.to_hex())
        .unwrap_or_else(|| "(not begun)".to_string())
}

/// `From` the three lower-layer errors for a domain module's error with `Document`,
/// `Transaction` and `Clock` variants (the quota's and the OBT's), each keeping the lower error as
/// its `source()`, so that `?` converts them.
macro_rules! from_lower_errors {
    ($error:ident) => {
        impl From<$crate::repo::error::RepoError> for $error {
            fn from(source: $crate::repo::error::RepoError) -> $error {
                $error::Document {
                    source: Box::new(source),
                }
            }
        }

        impl From<$crate::txn::error::TxnError> for $error {
            fn from(source: $crate::txn::error::TxnError) -> $error {
                $error::Transaction {
                    source: Box::new(source),
                }
            }
        }

        impl From<$crate::server::clock::ClockError> for $error {
            fn from(source: $crate::server::clock::ClockError) -> $error {
                $error::Clock { source }
            }
        }
    };
}
pub(crate) use from_lower_errors;
