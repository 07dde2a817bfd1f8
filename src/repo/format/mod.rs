//! The version of what mongotx stores, so that two releases can share a database during a
//! rolling upgrade (docs/format.md describes every stored field of every format).
//!
//! # The field
//!
//! `_format` (a `long`) says which format wrote a stored thing. A thing without it is of format
//! 1: everything written before the field existed reads so. Transaction records and the
//! documents of `mongotx_meta` always carry it. Holds (`_hold._format`) and the documents of the
//! coordination collections carry it from format 2 on only: the release before `_format`
//! installs validators with `additionalProperties: false` on those collections (and puts them
//! back whenever it opens one), so a `_format: 1` there would be refused by an instance of that
//! release still running during the upgrade; format 1 keeps their bytes as that release wrote
//! them.
//!
//! # The rule
//!
//! A process reads the formats up to the one it knows ([`FORMAT`]) and refuses anything newer
//! before acting on it, with [`FormatError::Newer`] and nothing written: a hold, a record or a
//! limiter read in a shape it does not know could be misread, and misreading a hold or a record
//! breaks all-or-nothing. Its conditional writes carry [`readable`], so that a document that
//! turned newer since it was read is not overwritten either. Which format it *writes* is the
//! gate's decision (`gate`): the one switched on for the database, which is only ever one that
//! every live instance reads.

use std::fmt::Display;

use bson::{doc, Bson, Document};

use crate::error_kind::ErrorKind;

pub(crate) mod gate;
pub(crate) mod member;

pub use gate::{FormatStatus, Instance};

/// The newest stored format this version of mongotx reads and can write. A database writes it
/// once it is switched on ([`Store::set_format`](crate::Store::set_format)); until then it writes
/// the one switched on before (format 1 on a database that never switched).
pub const FORMAT: i64 = 2;

/// The format of anything stored without the field: what every release wrote before it.
pub const UNMARKED: i64 = 1;

/// The stored name of the format version (`long`).
pub const FIELD: &str = "_format";

/// A stored thing this process must not act on because of its format.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// Stored by a newer version of mongotx, in a format this one does not read: upgrade this
    /// process. Nothing was written.
    #[error(
        "{collection} {id} is of stored format {found}, newer than format {known}, the newest \
         this version of mongotx reads; upgrade this process (nothing was written)"
    )]
    Newer {
        /// The collection of the stored thing.
        collection: String,
        /// Its id (`format` for the format the database writes).
        id: String,
        /// The format it is of.
        found: i64,
        /// The newest format this process reads.
        known: i64,
    },
    /// A `_format` that is not a format number.
    #[error(
        "{collection} {id} has a {FIELD} of {value}, not a format number (nothing was written)"
    )]
    Unreadable {
        /// The collection of the stored thing.
        collection: String,
        /// Its id.
        id: String,
        /// The stored value.
        value: String,
    },
    /// The format the database writes could not be read or this instance not announced.
    #[error("{what} in mongotx_meta failed: {summary}")]
    Unavailable {
        /// What was being done.
        what: &'static str,
        /// The driver error, summarised.
        summary: String,
        /// The driver error.
        #[source]
        source: mongodb::error::Error,
    },
}

impl FormatError {
    /// What kind of failure this is: a newer format asks for an upgrade of this process.
    pub fn kind(&self) -> ErrorKind {
        match self {
            FormatError::Newer { .. } => ErrorKind::NewerFormat,
            FormatError::Unreadable { .. } => ErrorKind::Data,
            FormatError::Unavailable { .. } => ErrorKind::Unavailable,
        }
    }

    /// Whether trying again may succeed: only when the server could not be read.
    pub fn is_retryable(&self) -> bool {
        match self {
            FormatError::Unavailable { source, .. } => crate::server::is_transient(source),
            _ => false,
        }
    }

    pub(crate) fn unavailable(what: &'static str, source: mongodb::error::Error) -> FormatError {
        FormatError::Unavailable {
            what,
            summary: crate::server::summarize(&source),
            source,
        }
    }
}

/// The format `stored` is of, or the value that is not a format number.
pub(crate) fn stored(stored: &Document) -> Result<i64, &Bson> {
    match stored.get(FIELD) {
        None => Ok(UNMARKED),
        Some(Bson::Int64(n)) if *n >= 1 => Ok(*n),
        Some(Bson::Int32(n)) if *n >= 1 => Ok(i64::from(*n)),
        Some(other) => Err(other),
    }
}

/// Refuses `stored` (document `id` of `collection`) when it is of a format newer than `known`.
pub(crate) fn check(
    stored: &Document,
    known: i64,
    collection: &str,
    id: impl Display,
) -> Result<(), FormatError> {
    match self::stored(stored) {
        Ok(found) if found <= known => Ok(()),
        Ok(found) => Err(FormatError::Newer {
            collection: collection.to_string(),
            id: id.to_string(),
            found,
            known,
        }),
        Err(value) => Err(FormatError::Unreadable {
            collection: collection.to_string(),
            id: id.to_string(),
            value: value.to_string(),
        }),
    }
}

/// [`check`] of a stored document by its own `_id`.
pub(crate) fn check_doc(
    stored: &Document,
    known: i64,
    collection: &str,
) -> Result<(), FormatError> {
    let id = stored
        .get("_id")
        .map_or_else(|| "?".to_string(), Bson::to_string);
    check(stored, known, collection, id)
}

/// The condition, added to a conditional write's filter, that the document is of a format up to
/// `known`: a document a newer version rewrote since it was read is then not matched (the write
/// reports no match, and the caller's next read of it refuses it).
pub(crate) fn readable(known: i64) -> Document {
    doc! { FIELD: { "$not": { "$gt": known } } }
}

/// Adds the [`readable`] condition to `filter`.
///
/// On an upsert, a document of a newer format under the same `_id` is not matched, so the
/// server tries to insert and answers with a duplicate key: the caller then reads the document
/// and refuses it with [`check_doc`], never reporting the collision itself.
pub(crate) fn guard(mut filter: Document, known: i64) -> Document {
    filter.extend(readable(known));
    filter
}

/// Marks `stored` (a hold or a coordination document about to be written) with format `writes`,
/// where format 1 leaves the field out (see the module doc).
pub(crate) fn mark(stored: &mut Document, writes: i64) {
    if writes > UNMARKED {
        stored.insert(FIELD, writes);
    }
}

/// What an update's `$set` gains so that the document it rewrites is marked with format
/// `writes`: nothing for format 1, whose documents stay as the release before `_format` wrote
/// them. A document of a newer format that a store writing an older one updates keeps its mark
/// (what was written in the newer format stays so, see `Store::set_format`).
pub(crate) fn set_mark(writes: i64) -> Document {
    let mut set = Document::new();
    mark(&mut set, writes);
    set
}

/// `update` (an update document of operators) marking the document it writes with format
/// `writes`: [`set_mark`] merged into its `$set` (added if it has none).
pub(crate) fn mark_update(mut update: Document, writes: i64) -> Document {
    let marks = set_mark(writes);
    if marks.is_empty() {
        return update;
    }
    match update.get_mut("$set") {
        Some(Bson::Document(set)) => set.extend(marks),
        _ => {
            update.insert("$set", marks);
        }
    }
    update
}

/// `pipeline` (an update pipeline) marking the document it writes with format `writes`: a last
/// `$set` stage of [`set_mark`], none for format 1.
pub(crate) fn mark_pipeline(mut pipeline: Vec<Document>, writes: i64) -> Vec<Document> {
    let marks = set_mark(writes);
    if !marks.is_empty() {
        pipeline.push(doc! { "$set": marks });
    }
    pipeline
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmarked_documents_are_of_format_one() {
        assert_eq!(stored(&doc! { "_id": 1 }), Ok(1));
        assert_eq!(stored(&doc! { FIELD: 2_i64 }), Ok(2));
        assert_eq!(stored(&doc! { FIELD: 3_i32 }), Ok(3));
        assert!(stored(&doc! { FIELD: "2" }).is_err());
        assert!(stored(&doc! { FIELD: 0_i64 }).is_err());
    }

    #[test]
    fn a_newer_format_is_refused_naming_both_versions() {
        let newer = check_doc(&doc! { "_id": "a", FIELD: 2_i64 }, 1, "ratelimits").unwrap_err();
        assert_eq!(newer.kind(), ErrorKind::NewerFormat);
        let message = newer.to_string();
        assert!(message.contains("ratelimits \"a\""), "{message}");
        assert!(message.contains("format 2"), "{message}");
        assert!(message.contains("format 1"), "{message}");
        check_doc(&doc! { "_id": "a", FIELD: 2_i64 }, 2, "ratelimits").unwrap();
        check_doc(&doc! { "_id": "a" }, 1, "ratelimits").unwrap();
        let odd = check_doc(&doc! { "_id": "a", FIELD: "x" }, 1, "ratelimits").unwrap_err();
        assert_eq!(odd.kind(), ErrorKind::Data);
    }

    #[test]
    fn format_one_marks_nothing() {
        let mut stored = doc! { "n": 1 };
        mark(&mut stored, 1);
        assert_eq!(stored, doc! { "n": 1 });
        mark(&mut stored, 2);
        assert_eq!(stored, doc! { "n": 1, FIELD: 2_i64 });
    }

    #[test]
    fn updates_are_marked_from_format_two_on() {
        assert_eq!(set_mark(1), doc! {});
        assert_eq!(set_mark(2), doc! { FIELD: 2_i64 });
        let update = doc! { "$set": { "a": 1 }, "$unset": { "b": "" } };
        assert_eq!(mark_update(update.clone(), 1), update);
        assert_eq!(
            mark_update(update, 2),
            doc! { "$set": { "a": 1, FIELD: 2_i64 }, "$unset": { "b": "" } }
        );
        assert_eq!(
            mark_update(doc! { "$unset": { "b": "" } }, 2),
            doc! { "$unset": { "b": "" }, "$set": { FIELD: 2_i64 } }
        );
        let pipeline = vec![doc! { "$set": { "a": 1 } }];
        assert_eq!(mark_pipeline(pipeline.clone(), 1), pipeline);
        assert_eq!(
            mark_pipeline(pipeline, 3),
            vec![
                doc! { "$set": { "a": 1 } },
                doc! { "$set": { FIELD: 3_i64 } }
            ]
        );
        assert_eq!(
            guard(doc! { "_id": "a" }, 1),
            doc! { "_id": "a", FIELD: { "$not": { "$gt": 1_i64 } } }
        );
    }
}
