//! The error type of the repository surface.

use std::time::Duration;

use bson::{oid::ObjectId, Bson};
use thiserror::Error;

use crate::collection::SpecError;

/// Boxed error produced by a [`HoldResolver`](crate::hold::HoldResolver).
pub type HoldError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything a repository call can fail with; each message names the collection and the id.
#[derive(Debug, Error)]
pub enum RepoError {
    /// No document has this id: it never existed or its tombstone was purged.
    #[error("{collection}/{id}: not found")]
    NotFound {
        /// Collection name.
        collection: String,
        /// The id asked for.
        id: String,
    },
    /// The document is a tombstone.
    #[error("{collection}/{id}: deleted (tombstone at version {version})")]
    Deleted {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// The tombstone's version.
        version: i64,
    },
    /// The document changed since the caller read it.
    #[error("{collection}/{id}: version conflict: expected version {expected}, found {actual}")]
    VersionConflict {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// The version the caller named.
        expected: i64,
        /// The version stored now.
        actual: i64,
    },
    /// A transaction held the document for longer than the writer was willing to wait.
    #[error("{collection}/{id}: locked by transaction {} (waited {waited:?})", holder.map(|h| h.to_hex()).unwrap_or_else(|| "(several in turn)".into()))]
    Locked {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// The ActiveTransaction last seen holding it.
        holder: Option<ObjectId>,
        /// How long the writer waited.
        waited: Duration,
    },
    /// An insert named an id that is already taken (by a live document or a tombstone).
    #[error("{collection}/{id}: duplicate id")]
    DuplicateId {
        /// Collection name.
        collection: String,
        /// The duplicated id.
        id: String,
    },
    /// The stored document has a schema version newer than this code understands.
    #[error("{collection}/{id}: stored schema version {found} is newer than the supported version {supported}; the document is left untouched")]
    SchemaTooNew {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// The stored schema version.
        found: i64,
        /// The newest version the code knows.
        supported: i64,
    },
    /// Upgrading a stored document to the current schema version failed.
    #[error("{collection}/{id}: upgrade from schema version {from} failed: {reason}")]
    Upgrade {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// The schema version the failing step started from.
        from: i64,
        /// What the step reported.
        reason: String,
    },
    /// The document or change does not satisfy the collection's schema.
    #[error("{collection}/{id}: invalid field `{field}`: {reason}")]
    Invalid {
        /// Collection name.
        collection: String,
        /// The document id, or "(new)" before one is known.
        id: String,
        /// Dotted path of the offending field.
        field: String,
        /// Why it is invalid.
        reason: String,
    },
    /// The caller tried to set a system field, which only mongotx writes.
    #[error("{collection}/{id}: field `{field}` is a system field and cannot be set by callers")]
    SystemField {
        /// Collection name.
        collection: String,
        /// The document id, or "(new)".
        id: String,
        /// The system field named.
        field: String,
    },
    /// An expected version that no document can have (versions start at 1).
    #[error("{collection}/{id}: expected version {version} is invalid (versions start at 1)")]
    InvalidVersion {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// The version given.
        version: i64,
    },
    /// An id whose BSON type the collection's schema does not allow.
    #[error("{collection}: id {id} has type {found}, but the schema allows {expected}")]
    InvalidId {
        /// Collection name.
        collection: String,
        /// The id given.
        id: String,
        /// Its BSON type.
        found: String,
        /// The types the schema allows.
        expected: String,
    },
    /// An increment that is not a finite number of a supported type.
    #[error("{collection}/{id}: increment of `{field}` by {amount} is invalid: {reason}")]
    InvalidIncrement {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// The field to increment.
        field: String,
        /// The amount given.
        amount: String,
        /// Why it is rejected.
        reason: String,
    },
    /// An update or adjust with nothing in it.
    #[error("{collection}/{id}: the change is empty")]
    EmptyChange {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
    },
    /// A stored document lacks valid system fields (it was not written by mongotx).
    #[error("{collection}/{id}: stored document is not a mongotx document: {reason}")]
    Malformed {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The caller's value could not be serialized to a BSON document.
    #[error("{collection}: value cannot be stored: {reason}")]
    Encode {
        /// Collection name.
        collection: String,
        /// Serializer message.
        reason: String,
    },
    /// A stored document could not be deserialized into the caller's type.
    #[error("{collection}/{id}: stored document does not fit the Rust type: {source}")]
    Decode {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// The deserializer error.
        #[source]
        source: bson::de::Error,
    },
    /// The collection definition is unusable.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The transaction layer failed while resolving a document's holder.
    #[error("{collection}/{id}: resolving holder transaction {holder} failed: {source}")]
    Hold {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// The holding transaction.
        holder: ObjectId,
        /// What went wrong.
        #[source]
        source: HoldError,
    },
    /// The server or the connection failed.
    #[error("{collection}/{id}: {operation} failed: {source}")]
    Database {
        /// Collection name.
        collection: String,
        /// The document id, or "*" for multi-document operations.
        id: String,
        /// The operation attempted.
        operation: &'static str,
        /// The driver error (boxed: it is large and rare).
        #[source]
        source: Box<mongodb::error::Error>,
    },
}

impl RepoError {
    /// Whether retrying the same call (after re-reading, for version conflicts) may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            RepoError::VersionConflict { .. } | RepoError::Locked { .. }
        ) || matches!(self, RepoError::Database { source, .. } if is_transient(source))
    }
}

pub(crate) fn is_transient(error: &mongodb::error::Error) -> bool {
    matches!(
        error.kind.as_ref(),
        mongodb::error::ErrorKind::Io(_) | mongodb::error::ErrorKind::ConnectionPoolCleared { .. }
    ) || error.contains_label(mongodb::error::RETRYABLE_WRITE_ERROR)
        || error.contains_label(mongodb::error::TRANSIENT_TRANSACTION_ERROR)
}

/// Renders an id for error messages: strings quoted, other values as extended JSON-ish text.
pub fn show_id(id: &Bson) -> String {
    match id {
        Bson::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

/// Everything a transaction (staging, commit, GC) can fail with; messages name the transaction.
#[derive(Debug, Error)]
pub enum TxnError {
    /// A staged document could not be changed: the repository error says which and why.
    #[error("transaction {}: {source}", show_txn(txn))]
    Document {
        /// The transaction, once it has an ActiveTransaction document.
        txn: Option<ObjectId>,
        /// What happened to the document (boxed: it is large).
        #[source]
        source: Box<RepoError>,
    },
    /// The same document was staged twice.
    #[error("{collection}/{id} is staged twice in one transaction; combine the changes")]
    DuplicateEntry {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
    },
    /// The deadline passed and a GC claimed the transaction before its commit point; it was
    /// rolled back. Retrying is safe.
    #[error(
        "transaction {txn}: its deadline passed and it was rolled back before the commit point"
    )]
    Expired {
        /// The transaction.
        txn: ObjectId,
    },
    /// The commit point could not be written, so the coordinator aborted its own transaction
    /// and rolled it back. Retrying is safe.
    #[error("transaction {txn}: aborted and rolled back because the commit point could not be written: {cause}")]
    Aborted {
        /// The transaction.
        txn: ObjectId,
        /// The last failure seen while writing the commit point.
        cause: String,
    },
    /// The commit point may or may not have been written and the coordinator could not find out.
    /// Not retryable: rerunning the body could apply the changes twice. The ActiveTransaction
    /// document (or, once it is gone, the documents themselves) tells; after the deadline the GC
    /// settles the transaction either way.
    #[error("transaction {txn}: outcome unknown, the commit point may or may not have been written ({cause}); check the documents before retrying")]
    CommitUnknown {
        /// The transaction.
        txn: ObjectId,
        /// What prevented finding out.
        cause: String,
    },
    /// Recovery found a document in a state the protocol does not produce; the transaction is
    /// left as it is for the next GC round.
    #[error("transaction {txn}: cannot settle {collection}/{id}: {reason}")]
    Unsettled {
        /// The transaction.
        txn: ObjectId,
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// What was found.
        reason: String,
    },
    /// A fault injector stopped the coordinator or GC here, as a crash would.
    #[error("transaction {}: injected crash at {at}", show_txn(txn))]
    Crashed {
        /// The transaction, if it had an id yet.
        txn: Option<ObjectId>,
        /// The failpoint.
        at: crate::failpoint::Failpoint,
    },
    /// A stored ActiveTransaction document cannot be read.
    #[error("transaction {txn}: ActiveTransaction document is malformed: {reason}")]
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
    /// `run_transaction` ran out of time retrying.
    #[error("gave up after {attempts} attempts in {elapsed:?}; last error: {last}")]
    GaveUp {
        /// Attempts made.
        attempts: u32,
        /// Time spent.
        elapsed: Duration,
        /// The last retryable error.
        last: Box<TxnError>,
    },
    /// The server or the connection failed on the transactions collection.
    #[error("transaction {}: {step} failed: {source}", show_txn(txn))]
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
    /// Whether running the transaction again (after re-reading) may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            TxnError::Document { source, .. } => source.is_retryable(),
            TxnError::Expired { .. } | TxnError::Aborted { .. } => true,
            TxnError::Database { source, .. } => is_transient(source),
            _ => false,
        }
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

fn show_txn(txn: &Option<ObjectId>) -> String {
    txn.map(|t| t.to_hex())
        .unwrap_or_else(|| "(not begun)".to_string())
}
