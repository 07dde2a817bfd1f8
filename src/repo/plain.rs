//! Plain documents: documents without mongotx's system fields, as a service's collection holds
//! them before it adopts mongotx, and as other writers (another service, a shell, a restore) may
//! still add them afterwards.
//!
//! A plain document is data, not damage. It reads as a committed, free document at the schema
//! version its collection declares for plain documents
//! ([`CollectionSpec::plain_documents`](crate::CollectionSpec::plain_documents)), with a version
//! no stamped document can have: a **fingerprint** of its content, a negative number (stamped
//! versions start at 1). The fingerprint is what makes writes to it safe without asking the
//! caller for anything new: a write names the version it read, and for a plain document that
//! version says exactly which content was read. So the first write to it
//!
//! 1. reads it and compares its fingerprint with the expected version (a different content is a
//!    `VersionConflict`, as a changed version would be), then
//! 2. writes conditionally on the whole stored document being what was read ([`unchanged`]:
//!    `$expr` equality of `$$ROOT` with the document as a `$literal`; field order and values
//!    compared as MongoDB compares documents), and stamps it: `_schema` (the plain schema
//!    version for a stamp alone, the current one for a change) and `_version` (the collection's
//!    first version, one above its version floor, so a purged and re-inserted id does not repeat
//!    one).
//!
//! A raw write that lands between 1 and 2 makes the write match nothing; the document is read
//! again and the caller gets the conflict. Nothing the raw writer wrote is lost.
//!
//! Stamping alone ([`stamp`]) adds only the two system fields and changes nothing else; it is
//! what explicit adoption does in bulk (`repo::adopt`) and what a transaction does to a plain
//! document before its commit protocol runs (the protocol's holds and undos work on stamped
//! documents only).

use bson::{doc, Bson, Document};
use mongodb::Collection;

use crate::repo::collection::CollectionSpec;
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields;
use crate::repo::schema::Violation;
use crate::repo::store::Store;

/// How often [`stamp`] reads a document again when it changed between the read and the write
/// without changing what the caller expected (a stamp by someone else, a field order change).
const STAMP_ATTEMPTS: usize = 4;

/// The filter that matches document `stored` only while it is exactly as read: same fields, in
/// the same order, with equal values (numbers compare by value across types, as everywhere in
/// MongoDB; the fingerprint check before the write tells types apart).
pub(crate) fn unchanged(stored: &Document) -> Document {
    let id = stored.get("_id").cloned().unwrap_or(Bson::Null);
    doc! {
        "_id": id,
        "$expr": { "$eq": ["$$ROOT", { "$literal": stored.clone() }] },
    }
}

/// The filter that matches plain documents: no system field at all.
pub(crate) fn plain_filter() -> Document {
    fields::RESERVED
        .iter()
        .map(|name| {
            (
                (*name).to_string(),
                Bson::Document(doc! { "$exists": false }),
            )
        })
        .collect()
}

/// Why the schema refuses plain document `stored` (read from `spec`'s collection), if it does: the
/// document as it reads, upgraded from the plain schema version to the current one and stamped,
/// checked against the current schema. A document that passes reads and writes like any other;
/// one that does not is left plain by adoption and reported.
pub(crate) fn refusal(spec: &CollectionSpec, stored: &Document) -> Result<(), Violation> {
    let mut upgraded = spec
        .upgrade_document(stored.clone(), spec.plain_schema_version())
        .map_err(|(from, reason)| Violation {
            field: fields::SCHEMA_VERSION.to_string(),
            reason: format!("the upgrade step from schema version {from} failed: {reason}"),
        })?;
    upgraded.insert(fields::SCHEMA_VERSION, spec.schema_version());
    // The least version a stamp gives (the floor only raises it).
    upgraded.insert(fields::VERSION, 1_i64);
    spec.schema().validate(&upgraded)
}

/// What [`stamp`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stamping {
    /// It stamped the plain document at this version.
    Stamped(i64),
    /// The document was stamped already (by another writer meanwhile), at this version.
    AlreadyStamped(i64),
}

/// Stamps the plain document `id` of `spec`'s collection in place: adds `_schema` (the
/// collection's plain schema version) and `_version` (its first version), conditionally on the
/// content being unchanged since it was read, and on its fingerprint being `expected` when that
/// is given. The content is checked against the schema first (see [`refusal`]).
///
/// `VersionConflict` when the content is not the one expected (or the document is stamped
/// already and `expected` was given); `NotFound`, `Deleted`, `Invalid` as their names say.
pub(crate) async fn stamp(
    store: &Store,
    coll: &Collection<Document>,
    spec: &CollectionSpec,
    id: &Bson,
    expected: Option<i64>,
) -> Result<Stamping, RepoError> {
    let shown = show_id(id);
    let name = spec.name();
    for _ in 0..STAMP_ATTEMPTS {
        let stored = coll
            .find_one(doc! { "_id": id.clone() })
            .await
            .map_err(|e| RepoError::database(name, &shown, "read the plain document", e))?
            .ok_or_else(|| RepoError::NotFound {
                collection: name.to_string(),
                id: shown.clone(),
            })?;
        if !fields::is_plain(&stored) {
            let sys =
                fields::SystemFields::read(&stored).map_err(|reason| RepoError::Malformed {
                    collection: name.to_string(),
                    id: shown.clone(),
                    reason,
                })?;
            if sys.is_deleted() {
                return Err(RepoError::Deleted {
                    collection: name.to_string(),
                    id: shown,
                    version: sys.version,
                });
            }
            return match expected {
                Some(expected) => Err(RepoError::VersionConflict {
                    collection: name.to_string(),
                    id: shown,
                    expected,
                    actual: sys.version,
                }),
                None => Ok(Stamping::AlreadyStamped(sys.version)),
            };
        }
        let actual = fields::fingerprint(&stored);
        if let Some(expected) = expected.filter(|e| *e != actual) {
            return Err(RepoError::VersionConflict {
                collection: name.to_string(),
                id: shown,
                expected,
                actual,
            });
        }
        let version = store
            .first_version(name)
            .await
            .map_err(|e| RepoError::database(name, &shown, "read the version floor", e))?;
        let schema = spec.plain_schema_version();
        refusal(spec, &stored).map_err(|v| RepoError::Invalid {
            collection: name.to_string(),
            id: shown.clone(),
            field: v.field,
            reason: v.reason,
        })?;
        let update = doc! { "$set": { fields::SCHEMA_VERSION: schema, fields::VERSION: version } };
        let written = coll
            .update_one(unchanged(&stored), update)
            .await
            .map_err(|e| RepoError::written(name, &shown, "stamp the plain document", e))?;
        if written.matched_count == 1 {
            tracing::debug!(collection = name, id = %shown, version, "stamped a plain document");
            return Ok(Stamping::Stamped(version));
        }
    }
    Err(RepoError::Malformed {
        collection: name.to_string(),
        id: shown,
        reason: "the plain document kept changing while it was being stamped".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repo::fields::{fingerprint, is_plain, is_plain_version};

    #[test]
    fn fingerprints_are_negative_stable_and_tell_contents_apart() {
        let a = doc! { "_id": "a", "n": 1 };
        assert_eq!(fingerprint(&a), fingerprint(&a.clone()));
        assert!(is_plain_version(fingerprint(&a)));
        // Another value, another type of the same value, another field order.
        for other in [
            doc! { "_id": "a", "n": 2 },
            doc! { "_id": "a", "n": 1_i64 },
            doc! { "n": 1, "_id": "a" },
        ] {
            assert_ne!(fingerprint(&a), fingerprint(&other), "{other}");
        }
        assert!(!is_plain_version(-1) && !is_plain_version(i64::MIN) && !is_plain_version(0));
        assert!(is_plain_version(-2) && is_plain_version(i64::MIN + 1));
    }

    #[test]
    fn a_document_with_any_system_field_is_not_plain() {
        assert!(is_plain(&doc! { "_id": 1, "balance": 3 }));
        for name in fields::RESERVED {
            assert!(!is_plain(&doc! { "_id": 1, name: 1 }), "{name}");
        }
        assert_eq!(plain_filter().len(), fields::RESERVED.len());
    }
}
