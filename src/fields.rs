//! The system fields every managed document carries, and their stored names.
//!
//! The names start with an underscore so they cannot collide with ordinary serde field names
//! (and `_id` is already MongoDB's convention for engine-owned fields). They are part of the
//! on-disk format: changing one is a schema migration, not a refactor.

use bson::{oid::ObjectId, Bson, Document};

/// Stored name of the schema version: which shape of the document this is (`long`).
pub const SCHEMA_VERSION: &str = "_schema";
/// Stored name of the document version, the optimistic lock: 1 on insert, +1 on every change (`long`).
pub const VERSION: &str = "_version";
/// Stored name of the reference to the ActiveTransaction holding the document (`objectId`), absent when free.
pub const ACTIVE_TXN: &str = "_txn";
/// Stored name of the tombstone marker: the time of deletion (`date`), absent on live documents.
pub const DELETED: &str = "_deleted";
/// Stored name of the flag set while a deleting transaction is in flight (`bool`), absent otherwise.
pub const DELETING: &str = "_deleting";

/// All five system fields, in the order they are documented.
pub const ALL: [&str; 5] = [SCHEMA_VERSION, VERSION, ACTIVE_TXN, DELETED, DELETING];

/// Whether `path` (a top-level name or a dotted path) addresses a system field.
pub fn is_system_path(path: &str) -> bool {
    let head = path.split('.').next().unwrap_or(path);
    ALL.contains(&head)
}

/// The system fields as read from a stored document.
#[derive(Debug, Clone, PartialEq)]
pub struct SystemFields {
    /// Schema version of the stored shape.
    pub schema_version: i64,
    /// Current document version.
    pub version: i64,
    /// The ActiveTransaction holding the document, if any.
    pub active_txn: Option<ObjectId>,
    /// When the document was deleted, if it is a tombstone.
    pub deleted_at: Option<bson::DateTime>,
    /// Whether a deleting transaction is in flight.
    pub deleting: bool,
}

impl SystemFields {
    /// Reads the system fields of a stored document; `Err` names what is missing or mistyped.
    pub fn read(doc: &Document) -> Result<SystemFields, String> {
        let schema_version = read_integer(doc, SCHEMA_VERSION)?;
        let version = read_integer(doc, VERSION)?;
        let active_txn = match doc.get(ACTIVE_TXN) {
            None | Some(Bson::Null) => None,
            Some(Bson::ObjectId(txn)) => Some(*txn),
            Some(other) => {
                return Err(format!(
                    "system field `{ACTIVE_TXN}` must be an objectId, found {}",
                    crate::schema::BsonType::of(other)
                ))
            }
        };
        let deleted_at = match doc.get(DELETED) {
            None | Some(Bson::Null) => None,
            Some(Bson::DateTime(at)) => Some(*at),
            Some(other) => {
                return Err(format!(
                    "system field `{DELETED}` must be a date, found {}",
                    crate::schema::BsonType::of(other)
                ))
            }
        };
        let deleting = matches!(doc.get(DELETING), Some(Bson::Boolean(true)));
        Ok(SystemFields {
            schema_version,
            version,
            active_txn,
            deleted_at,
            deleting,
        })
    }

    /// Whether the document is a tombstone.
    pub fn is_deleted(&self) -> bool {
        self.deleted_at.is_some()
    }

    /// Whether the document is the placeholder a rolled-back transactional insert leaves: a
    /// version-0 tombstone that reads as not found and that a new insert may take over.
    pub fn is_placeholder(&self) -> bool {
        self.is_deleted() && self.version == 0
    }
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
pub fn strip(doc: &mut Document) {
    for name in ALL {
        doc.remove(name);
    }
}

/// Filter fragment matching live documents (not tombstones).
pub fn live_filter() -> Document {
    bson::doc! { DELETED: { "$exists": false } }
}

/// Filter matching the free placeholder a rolled-back transactional insert left under `id`,
/// which a new insert of the same id may replace.
pub fn free_placeholder_filter(id: &Bson) -> Document {
    bson::doc! {
        "_id": id.clone(),
        VERSION: 0_i64,
        DELETED: { "$exists": true },
        ACTIVE_TXN: null,
    }
}

/// Filter fragment matching documents that no transaction holds.
pub fn free_filter() -> Document {
    bson::doc! { ACTIVE_TXN: { "$exists": false } }
}
