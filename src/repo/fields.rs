//! The system fields every managed document carries, and their stored names.
//!
//! The names start with an underscore so they cannot collide with ordinary serde field names
//! (and `_id` is already MongoDB's convention for engine-owned fields). They are part of the
//! on-disk format: changing one is a schema migration, not a refactor.

use std::ops::RangeInclusive;

use bson::{oid::ObjectId, Bson, Document};
use sha2::{Digest, Sha256};

use crate::repo::schema::BsonType;

/// The longest id or name a caller may give mongotx, in bytes: document ids and other names
/// (OBT ids and owners, batch headers, service and claimant names, limiter names, quota scopes,
/// resources, consumers and request ids) become document ids and indexed values, so they stay
/// short. Every module refuses a longer one with its own typed error.
pub const MAX_NAME: usize = 512;

/// The version a document has right after insert into a collection that was never purged.
pub const FIRST_VERSION: i64 = 1;

/// Stored name of the schema version: which shape of the document this is (`long`).
pub const SCHEMA_VERSION: &str = "_schema";
/// Stored name of the document version, the optimistic lock: 1 on insert, +1 on every change (`long`).
pub const VERSION: &str = "_version";
/// Stored name of the reference to the transaction holding the document (`objectId`), absent when free.
pub const ACTIVE_TXN: &str = "_txn";
/// Stored name of the tombstone marker: the time of deletion (`date`), absent on live documents.
pub const DELETED: &str = "_deleted";
/// Stored name of the flag set while a deleting transaction is in flight (`bool`), absent otherwise.
pub const DELETING: &str = "_deleting";
/// Stored name of a held document's own description of its hold (`object`): the holder's deadline
/// and what undoes its change. Present exactly when [`ACTIVE_TXN`] is.
pub const HOLD: &str = "_hold";

/// The five system fields every schema declares, in the order they are documented.
pub const ALL: [&str; 5] = [SCHEMA_VERSION, VERSION, ACTIVE_TXN, DELETED, DELETING];

/// Every field only mongotx writes: [`ALL`] and [`HOLD`].
pub(crate) const RESERVED: [&str; 6] =
    [SCHEMA_VERSION, VERSION, ACTIVE_TXN, DELETED, DELETING, HOLD];

/// Prefix of the top-level names mongotx keeps for itself (fields it adds in queries and writes
/// for a moment): a caller's document may not use it.
pub(crate) const RESERVED_PREFIX: &str = "_mongotx";

/// Whether `path` (a top-level name or a dotted path) addresses a system field, or a name in
/// mongotx's own namespace (`_mongotx...`).
pub fn is_system_path(path: &str) -> bool {
    let head = path.split('.').next().unwrap_or(path);
    RESERVED.contains(&head) || head.starts_with(RESERVED_PREFIX)
}

/// How deep MongoDB lets documents and arrays nest in a stored document (the top-level document
/// is the first level).
pub(crate) const MAX_NESTING: usize = 100;

/// The first field name in `value` (at any depth, inside documents and arrays) that mongotx
/// could not address afterwards, with its path and why: an empty name, one starting with `$`,
/// or one containing `.` (updates name fields by dotted paths, so such a field could neither be
/// changed nor read back reliably); or the first value nested deeper than MongoDB stores.
/// `level` is the level of the document or array that holds `value` (1 for a top-level field).
pub(crate) fn bad_name(value: &Bson, level: usize) -> Option<(String, &'static str)> {
    let nests = matches!(value, Bson::Document(_) | Bson::Array(_));
    if nests && level >= MAX_NESTING {
        return Some((
            String::new(),
            "documents and arrays nest at most 100 levels deep in MongoDB",
        ));
    }
    let under = |at: String, (path, reason): (String, &'static str)| {
        let path = if path.is_empty() {
            at
        } else {
            format!("{at}.{path}")
        };
        (path, reason)
    };
    match value {
        Bson::Document(doc) => names_in(doc, level + 1),
        Bson::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
            bad_name(item, level + 1).map(|found| under(i.to_string(), found))
        }),
        _ => None,
    }
}

/// [`bad_name`] of every field of the top-level document `doc`.
pub(crate) fn bad_name_in(doc: &Document) -> Option<(String, &'static str)> {
    names_in(doc, 1)
}

fn names_in(doc: &Document, level: usize) -> Option<(String, &'static str)> {
    doc.iter().find_map(|(name, inner)| {
        let reason = if name.is_empty() {
            Some("field names cannot be empty")
        } else if name.starts_with('$') {
            Some("field names cannot start with '$'")
        } else if name.contains('.') {
            Some("field names cannot contain '.'")
        } else {
            None
        };
        match reason {
            Some(reason) => Some((name.clone(), reason)),
            None => bad_name(inner, level).map(|(path, reason)| {
                let path = if path.is_empty() {
                    name.clone()
                } else {
                    format!("{name}.{path}")
                };
                (path, reason)
            }),
        }
    })
}

// ----- plain documents (no system field at all; the protocol around them is `repo::plain`) -----

/// The versions plain documents read as: negative, and never -1 or `i64::MIN`, which stay
/// refused as expected versions (`InvalidVersion`) like 0.
pub(crate) const PLAIN_VERSIONS: RangeInclusive<i64> = (i64::MIN + 1)..=-2;

/// Whether `doc` carries none of mongotx's system fields.
pub(crate) fn is_plain(doc: &Document) -> bool {
    !RESERVED.iter().any(|name| doc.contains_key(*name))
}

/// Whether `version` is one a plain document reads as.
pub(crate) fn is_plain_version(version: i64) -> bool {
    PLAIN_VERSIONS.contains(&version)
}

/// The version a plain document reads as: a fingerprint (SHA-256) of its BSON bytes, as read,
/// mapped onto [`PLAIN_VERSIONS`]. Every process computes the same one for the same stored
/// content; a different content gives a different one (but for a collision of 63-bit hashes).
pub(crate) fn fingerprint(doc: &Document) -> i64 {
    let mut bytes = Vec::new();
    if doc.to_writer(&mut bytes).is_err() {
        // A document read from the server always serializes; should one not, its fields'
        // debug text still tells contents apart.
        bytes = format!("{doc:?}").into_bytes();
    }
    let digest = Sha256::digest(&bytes);
    let mut head = [0_u8; 8];
    head.copy_from_slice(&digest[..8]);
    let hash = u64::from_be_bytes(head);
    // The range holds 2^63 - 2 values: -2 down to i64::MIN + 1.
    let span = (i64::MAX - 1) as u64;
    let offset = i64::try_from(hash % span).unwrap_or(0);
    -2 - offset
}

/// The system fields as read from a stored document.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SystemFields {
    /// Schema version of the stored shape (0 for a plain document as [`SystemFields::read`]
    /// returns it: the collection declares it, see `Repository::system_fields`).
    pub(crate) schema_version: i64,
    /// Current document version (a plain document's fingerprint, see `repo::plain`).
    pub(crate) version: i64,
    /// Whether the document is plain: it carries no system field at all.
    pub(crate) plain: bool,
    /// The transaction holding the document, if any.
    pub(crate) active_txn: Option<ObjectId>,
    /// When the document was deleted, if it is a tombstone.
    pub(crate) deleted_at: Option<bson::DateTime>,
    /// Whether a deleting transaction is in flight.
    pub(crate) deleting: bool,
}

impl SystemFields {
    /// Reads the system fields of a stored document; `Err` names what is missing or mistyped. A
    /// document with none of them reads as plain: free, live, its fingerprint as its version.
    pub(crate) fn read(doc: &Document) -> Result<SystemFields, String> {
        if is_plain(doc) {
            return Ok(SystemFields {
                schema_version: 0,
                version: fingerprint(doc),
                plain: true,
                active_txn: None,
                deleted_at: None,
                deleting: false,
            });
        }
        if let Some(fence) = fenced_plain(doc) {
            // A plain document under a fence: held (a resolver fenced it for a transaction that
            // was to rewrite it whole), with no version of its own; it reads as the plain
            // document under the fence, which its hold describes.
            return Ok(SystemFields {
                schema_version: 0,
                version: 0,
                plain: false,
                active_txn: Some(fence),
                deleted_at: None,
                deleting: false,
            });
        }
        // The holder first: a query's first pass reports a held candidate by `_id` and `_txn`
        // alone, so an unreadable holder must be what such a row is refused for.
        let active_txn = match doc.get(ACTIVE_TXN) {
            None | Some(Bson::Null) => None,
            Some(Bson::ObjectId(txn)) => Some(*txn),
            Some(other) => return Err(mistyped(ACTIVE_TXN, "an objectId", other)),
        };
        let schema_version = read_integer(doc, SCHEMA_VERSION)?;
        let version = read_integer(doc, VERSION)?;
        let deleted_at = match doc.get(DELETED) {
            None | Some(Bson::Null) => None,
            Some(Bson::DateTime(at)) => Some(*at),
            Some(other) => return Err(mistyped(DELETED, "a date", other)),
        };
        let deleting = match doc.get(DELETING) {
            None | Some(Bson::Null) | Some(Bson::Boolean(false)) => false,
            Some(Bson::Boolean(true)) => true,
            Some(other) => return Err(mistyped(DELETING, "a boolean", other)),
        };
        Ok(SystemFields {
            schema_version,
            version,
            plain: false,
            active_txn,
            deleted_at,
            deleting,
        })
    }

    /// Whether the document is a tombstone.
    pub(crate) fn is_deleted(&self) -> bool {
        self.deleted_at.is_some()
    }
}

/// The transaction fencing `doc` if it is a plain document under a fence: `_txn` and a `_hold`
/// marked `fence` on a document with no other system field. A transaction that rewrites a plain
/// document keeps it plain until its apply lands, so a resolver that finds the apply missing
/// fences the document as it is (see `repo::hold::staging`); the fence's undo makes it the same
/// plain document again.
fn fenced_plain(doc: &Document) -> Option<ObjectId> {
    if [SCHEMA_VERSION, VERSION, DELETED, DELETING]
        .iter()
        .any(|name| doc.contains_key(*name))
    {
        return None;
    }
    let txn = doc.get_object_id(ACTIVE_TXN).ok()?;
    let fence = doc.get_document(HOLD).ok()?.get_bool("fence").ok()?;
    fence.then_some(txn)
}

/// The message for system field `name` holding `found` where it must hold `expected`.
pub(crate) fn mistyped(name: &str, expected: &str, found: &Bson) -> String {
    format!(
        "system field `{name}` must be {expected}, found {}",
        BsonType::of(found)
    )
}

fn read_integer(doc: &Document, name: &str) -> Result<i64, String> {
    match doc.get(name) {
        Some(Bson::Int64(v)) => Ok(*v),
        Some(Bson::Int32(v)) => Ok(i64::from(*v)),
        Some(_) => Err(format!("system field `{name}` is not an integer")),
        None => Err(format!("system field `{name}` is missing")),
    }
}

/// Removes the system fields from a stored document, leaving the caller's fields and `_id`.
pub(crate) fn strip(doc: &mut Document) {
    for name in RESERVED {
        doc.remove(name);
    }
}

/// Filter fragment matching live documents (not tombstones).
pub(crate) fn live_filter() -> Document {
    bson::doc! { DELETED: { "$exists": false } }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

    fn nested(depth: usize) -> Bson {
        let mut value = Bson::Int32(1);
        for _ in 0..depth {
            value = Bson::Document(doc! { "d": value });
        }
        value
    }

    #[test]
    fn names_paths_cannot_reach_are_found_with_their_path() {
        assert_eq!(bad_name_in(&doc! { "a": { "b": [1, { "c": 2 }] } }), None);
        let found = |d: Document| bad_name_in(&d).map(|(path, _)| path);
        assert_eq!(found(doc! { "$x": 1 }), Some("$x".into()));
        assert_eq!(found(doc! { "a": { "b.c": 1 } }), Some("a.b.c".into()));
        // An empty name is reported at the path of the document holding it.
        assert_eq!(found(doc! { "a": [0, { "": 1 }] }), Some("a.1".into()));
    }

    #[test]
    fn a_plain_document_under_a_fence_reads_as_held() {
        let txn = ObjectId::new();
        let fenced =
            doc! { "_id": "p", "n": "1", "_txn": txn, "_hold": { "op": "check", "fence": true } };
        let sys = SystemFields::read(&fenced).expect("readable");
        assert_eq!(
            (sys.active_txn, sys.plain, sys.version),
            (Some(txn), false, 0)
        );
        // Anything else half-stamped stays unreadable.
        let unfenced = doc! { "_id": "p", "_txn": txn, "_hold": { "op": "check" } };
        assert!(SystemFields::read(&unfenced).is_err());
        let versioned =
            doc! { "_id": "p", "_version": 2_i64, "_txn": txn, "_hold": { "fence": true } };
        assert!(SystemFields::read(&versioned).is_err());
    }

    #[test]
    fn nesting_stops_at_one_hundred_levels() {
        // The top-level document is level 1, so 99 documents inside it reach level 100.
        assert_eq!(bad_name_in(&doc! { "deep": nested(99) }), None);
        let (path, reason) = bad_name_in(&doc! { "deep": nested(100) }).unwrap_or_default();
        assert!(reason.contains("100 levels"), "{reason}");
        assert!(path.starts_with("deep.d.d"), "{path}");
        // An update's value starts as deep as its path.
        assert_eq!(bad_name(&nested(98), 2), None);
        assert!(bad_name(&nested(99), 2).is_some());
    }
}
