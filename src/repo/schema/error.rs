//! What schema checks report: [`SchemaError`] when a schema text cannot be used, [`Violation`] when a
//! document or a change breaks a schema.

use std::fmt;

use crate::error_kind::ErrorKind;
use thiserror::Error;

/// Why a JSON Schema text cannot be used.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SchemaError {
    /// The text is not JSON, or not a JSON object.
    #[error("collection {collection}: schema is not a JSON object: {reason}")]
    NotJson {
        /// Collection the schema is for.
        collection: String,
        /// What the parser said.
        reason: String,
    },
    /// A keyword is unsupported or has an unusable value.
    #[error("collection {collection}: schema at {at}: keyword `{keyword}` {reason}")]
    Keyword {
        /// Collection the schema is for.
        collection: String,
        /// Where in the schema, as a dotted path of keywords (`(root)` for the top).
        at: String,
        /// The keyword.
        keyword: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl SchemaError {
    /// What kind of failure this is: always [`ErrorKind::InvalidInput`] (the schema text is the
    /// caller's).
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidInput
    }

    /// Whether trying again may succeed: never, the schema text must change.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

/// A document, field or value that breaks the schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Dotted path of the offending field (`(document)` for the document itself).
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` {}", self.field, self.reason)
    }
}
