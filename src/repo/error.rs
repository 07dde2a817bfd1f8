//! The error type of the repository surface.
//!
//! Every message is one sentence that names the collection and the id (and the versions or the
//! transaction involved). Driver errors are summarized in a few words and kept whole as the
//! `source()`, never pasted into the message.

use std::time::Duration;

use bson::{oid::ObjectId, Bson};
use thiserror::Error;

use crate::error_kind::ErrorKind;
use crate::repo::collection::SpecError;
use crate::repo::format::FormatError;
use crate::repo::outcome::HoldError;
use crate::server::clock::ClockError;
use crate::server::summarize;

/// Everything a repository call can fail with.
#[derive(Debug, Error)]
#[non_exhaustive]
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
    /// A transaction's guard found the document no longer matching its condition.
    #[error("{collection}/{id}: no longer matches the guard {condition} (found version {actual})")]
    ConditionFailed {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// The condition the guard named.
        condition: String,
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
        /// The transaction last seen holding it.
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
    /// A unique secondary index refused the write: another document has the same key.
    #[error("{collection}/{id}: unique index {index} already has this key")]
    DuplicateKey {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// The index that refused it (as the server names it).
        index: String,
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
    /// An expected version that no document can have, or that has no next version.
    #[error("{collection}/{id}: expected version {version} is invalid (stamped documents' versions run from 1 to one below i64::MAX, so that a write has a next version; plain documents read as negative fingerprints from i64::MIN + 1 to -2)")]
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
    /// A query mongotx cannot evaluate on committed values.
    #[error("{collection}: invalid query: {reason}")]
    InvalidQuery {
        /// Collection name.
        collection: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A stored document whose system fields mongotx cannot read: some of them missing or of the
    /// wrong type (a document with none of them is a plain document, which reads fine).
    #[error("{collection}/{id}: stored document has unreadable system fields: {reason}")]
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
    #[error("unusable collection definition: {source}")]
    Spec {
        /// What is wrong with it.
        #[from]
        source: SpecError,
    },
    /// The holder of the document could not be resolved.
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
    /// The server's time, by which deadlines are decided, could not be read.
    #[error("{collection}: {source}")]
    Clock {
        /// Collection name.
        collection: String,
        /// What went wrong.
        #[source]
        source: ClockError,
    },
    /// The server's collection validator refused a write that mongotx's own validator let
    /// through: the validator installed on the server is not the one this code knows (another
    /// version of the schema, or one installed by hand). `field` and `rule` come from the server's
    /// explanation (`errInfo.details`, MongoDB 5.0+); older servers give none.
    #[error(
        "{collection}/{id}: the server's validator refused the write at field `{field}`: {rule}"
    )]
    Refused {
        /// Collection name.
        collection: String,
        /// The document id.
        id: String,
        /// Dotted path of the field the server named, or `(document)` when it named none.
        field: String,
        /// The rule that failed, as the server described it.
        rule: String,
        /// The driver error, with the server's whole explanation.
        #[source]
        source: Box<mongodb::error::Error>,
    },
    /// The server lacks a behaviour the transaction protocol cannot do without (see
    /// `StoreBuilder::check_server` and `mongotx-probe`); nothing was written.
    #[error("{}", crate::server::semantics::refusal(name, what, detail))]
    ServerUnsuitable {
        /// The behaviour's short name.
        name: &'static str,
        /// What it is.
        what: &'static str,
        /// What the server did instead.
        detail: String,
    },
    /// A stored thing is of a format this version does not read, or the format the database
    /// writes could not be read (see `mongotx::format`); nothing was written.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// [`Store::set_format`](crate::Store::set_format) was asked for a format this release does
    /// not read (or below 1); nothing was written.
    #[error(
        "stored format {requested} cannot be switched on: this release reads formats 1 to {reads}"
    )]
    FormatUnknown {
        /// The format asked for.
        requested: i64,
        /// The newest format this release reads.
        reads: i64,
    },
    /// [`Store::set_format`](crate::Store::set_format) was refused: live instances do not read
    /// the format yet; nothing was written.
    #[error(
        "stored format {requested} cannot be switched on: {} live instance(s) read only older formats: {}; upgrade them (or wait for their announcements to lapse) first",
        behind.len(),
        behind.join("; ")
    )]
    FormatRefused {
        /// The format asked for.
        requested: i64,
        /// The live instances that do not read it, each described.
        behind: Vec<String>,
    },
    /// The server or the connection failed.
    #[error("{collection}/{id}: {operation} failed: {}", summarize(source))]
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
            E::Spec { source } => source.kind(),
            E::Hold { source, .. } => source.kind(),
            E::Clock { source, .. } => source.kind(),
            E::ServerUnsuitable { .. } => ErrorKind::Unsupported,
            E::Database { .. } => ErrorKind::Unavailable,
            E::Format(source) => source.kind(),
            E::FormatUnknown { .. } => ErrorKind::InvalidInput,
            E::FormatRefused { .. } => ErrorKind::Refused,
        }
    }

    /// Whether retrying the same call (after re-reading, for version conflicts) may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            RepoError::VersionConflict { .. } | RepoError::Locked { .. } => true,
            RepoError::Database { source, .. } => crate::server::is_transient(source),
            RepoError::Hold { source, .. } => source.is_retryable(),
            RepoError::Clock { source, .. } => source.is_retryable(),
            RepoError::Format(source) => source.is_retryable(),
            _ => false,
        }
    }

    pub(crate) fn database(
        collection: &str,
        id: &str,
        operation: &'static str,
        source: mongodb::error::Error,
    ) -> RepoError {
        RepoError::Database {
            collection: collection.to_string(),
            id: id.to_string(),
            operation,
            source: Box::new(source),
        }
    }

    /// The error of a write the server failed: a refusal by its validator (`Refused`), a
    /// document over the 16 MiB MongoDB stores (`Invalid`: bad input), or a database error.
    pub(crate) fn written(
        collection: &str,
        id: &str,
        operation: &'static str,
        source: mongodb::error::Error,
    ) -> RepoError {
        if let Some((field, rule)) = crate::server::codes::validation_failure(&source) {
            return RepoError::Refused {
                collection: collection.to_string(),
                id: id.to_string(),
                field,
                rule,
                source: Box::new(source),
            };
        }
        // The driver refuses a document over MongoDB's 16 MiB before sending it (the server
        // answers BSONObjectTooLarge, 10334, for one that grows past it): the caller's value is
        // too large, which is bad input, not a database failure.
        let too_large = match &*source.kind {
            mongodb::error::ErrorKind::InvalidArgument { message, .. } => {
                message.contains("within") && message.contains("bytes")
            }
            _ => crate::server::codes::error_code(&source) == Some(10334),
        };
        if too_large {
            return RepoError::Invalid {
                collection: collection.to_string(),
                id: id.to_string(),
                field: "(document)".to_string(),
                reason: "larger than the 16 MiB MongoDB stores in one document".to_string(),
            };
        }
        RepoError::database(collection, id, operation, source)
    }
}

/// Renders an id for error messages: strings quoted, other values as extended JSON-ish text.
pub fn show_id(id: &Bson) -> String {
    match id {
        Bson::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}
