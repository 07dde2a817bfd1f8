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
use crate::repo::contention;
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields;
use crate::repo::schema::Violation;
use crate::repo::store::Store;

/// How often [`stamp`] reads a document again when it changed between the read and the write
/// without changing what the caller expected (a stamp by someone else, a field order change).
const STAMP_ATTEMPTS: usize = 4;

/// The filter that matches document `stored` only while it is exactly as read: the same fields,
/// in the same order, with the same values of the same types and bytes.
///
/// `$eq` of `$$ROOT` with the document as a `$literal` pins the fields, their order and their
/// values, but as MongoDB compares values: numbers by value across types (int 5, long 5, double
/// 5.0 and decimal 5.0 are equal, and decimal 1.0 equals 1.00), strings by the collection's
/// collation (case-insensitive where a collation says so). A raw change of that kind between the
/// read and the write would slip through, and the write would replace it from the old read (a
/// lost write). So beside the `$eq`, every value whose representation `$eq` does not see is
/// checked one by one: the BSON type of every number (`$type`, on the value's dotted path), the
/// server's own string form of every decimal and of every double zero (`$toString`: 1.0 and
/// 1.00, 0.0 and -0.0 differ there), and, in a collection with a collation (`binary_strings`
/// false), the type of every string and its bytes (`$strLenBytes` and `$indexOfBytes`, which no
/// collation affects).
///
/// What this cannot pin (docs/adoption.md lists it): a value whose dotted path cannot be written
/// (a field name with a `.` or starting with `$`, or an array element that another element's
/// field of the same name would also answer for) has no `$type` condition; one that no
/// variable-free expression reads (see [`Exact::reach`]) has no `$toString` or byte check; every
/// value of a document whose exact condition would be larger than [`EXACT_CONDITION_BYTES`] (a
/// command carries at most 16 MiB) is compared by `$eq` only; NaN payloads are not told apart.
pub(crate) fn unchanged(stored: &Document, binary_strings: bool) -> Document {
    let id = stored.get("_id").cloned().unwrap_or(Bson::Null);
    let whole = doc! { "$eq": ["$$ROOT", { "$literal": stored.clone() }] };
    let mut exact = Exact {
        binary_strings,
        ..Exact::default()
    };
    let mut route = Vec::new();
    for (name, value) in stored {
        route.push(Step::Field(name));
        exact.value(value, &mut route);
        route.pop();
    }
    let mut filter = doc! { "_id": id.clone() };
    let mut checks = vec![Bson::Document(whole.clone())];
    checks.extend(exact.expressions);
    if !exact.types.is_empty() {
        filter.insert("$and", exact.types);
    }
    filter.insert("$expr", doc! { "$and": checks });
    let fits = exact.bytes <= EXACT_CONDITION_BYTES
        && bson::to_vec(&filter).is_ok_and(|bytes| bytes.len() <= EXACT_CONDITION_BYTES);
    if fits {
        filter
    } else {
        tracing::debug!(id = %crate::repo::error::show_id(&id), "the exact condition of a plain document is too large; comparing it by value only");
        doc! { "_id": id, "$expr": whole }
    }
}

/// The largest exact condition [`unchanged`] builds: well under the 16 MiB of a command, with
/// room for the update beside it.
pub(crate) const EXACT_CONDITION_BYTES: usize = 12 * 1024 * 1024;

/// Whether a field name can be written in a dotted path and in a `$` field path.
fn addressable(name: &str) -> bool {
    !name.is_empty() && !name.contains('.') && !name.starts_with('$')
}

/// The conditions [`unchanged`] adds to `$eq` of the whole document.
#[derive(Default)]
struct Exact {
    /// `{path: {$type: ...}}`, one per number and string with a usable dotted path.
    types: Vec<Bson>,
    /// `$expr` clauses: string forms of decimals and double zeros, bytes of strings.
    expressions: Vec<Bson>,
    /// Whether each array reached so far maps one to one through the field names after it (see
    /// [`Exact::reach`]), by the array's address and those names.
    one_to_one: std::collections::HashMap<(usize, Vec<String>), bool>,
    /// The field names made of digits in each array's document elements, by the array's address.
    numbered_fields: std::collections::HashMap<usize, std::collections::HashSet<String>>,
    /// About how many bytes the conditions take so far: past [`EXACT_CONDITION_BYTES`] the walk
    /// stops, and the document is compared by value only.
    bytes: usize,
    /// The collection compares strings by their bytes (no collation): `$eq` tells them apart
    /// already.
    binary_strings: bool,
}

/// One step from the document down to a value: a field of a document, or an element of an array.
#[derive(Clone, Copy)]
enum Step<'a> {
    Field(&'a str),
    Element(usize, &'a [Bson]),
}

impl<'a> Exact {
    /// Adds the checks of `value`, reached from the document by `route`.
    fn value(&mut self, value: &'a Bson, route: &mut Vec<Step<'a>>) {
        let alias = match value {
            Bson::Int32(_) => Some("int"),
            Bson::Int64(_) => Some("long"),
            Bson::Double(_) => Some("double"),
            Bson::Decimal128(_) => Some("decimal"),
            Bson::String(_) if !self.binary_strings => Some("string"),
            _ => None,
        };
        if self.bytes > EXACT_CONDITION_BYTES {
            return;
        }
        if let Some(alias) = alias {
            if let Some(path) = self.dotted(route) {
                self.bytes += path.len() + 32;
                self.types
                    .push(Bson::Document(doc! { path: { "$type": alias } }));
            }
        }
        match value {
            Bson::Decimal128(_) => self.same_string_form(value, route),
            Bson::Double(d) if *d == 0.0 => self.same_string_form(value, route),
            Bson::String(s) if !self.binary_strings => {
                if let Some(expr) = self.reach(route) {
                    self.bytes += 2 * s.len() + 96;
                    let len = i64::try_from(s.len()).unwrap_or(i64::MAX);
                    self.expressions.push(Bson::Document(
                        doc! { "$eq": [{ "$strLenBytes": expr.clone() }, len] },
                    ));
                    self.expressions.push(Bson::Document(
                        doc! { "$eq": [{ "$indexOfBytes": [expr, { "$literal": s.clone() }] }, 0] },
                    ));
                }
            }
            Bson::Document(inner) => {
                for (name, child) in inner {
                    route.push(Step::Field(name));
                    self.value(child, route);
                    route.pop();
                }
            }
            Bson::Array(items) => {
                for (i, child) in items.iter().enumerate() {
                    route.push(Step::Element(i, items));
                    self.value(child, route);
                    route.pop();
                }
            }
            _ => {}
        }
    }

    /// Adds the check that the value at `route` has the server's string form of `value`.
    fn same_string_form(&mut self, value: &Bson, route: &[Step<'a>]) {
        if let Some(expr) = self.reach(route) {
            self.bytes += 96;
            self.expressions.push(Bson::Document(doc! { "$eq": [
                { "$toString": expr },
                { "$toString": { "$literal": value.clone() } },
            ] }));
        }
    }

    /// The aggregation expression that reads the value at `route`, without variables (`$getField`
    /// needs MongoDB 5.0, and `$let` or a bound `$map` variable is what some wire-compatible
    /// servers get wrong): the field path of every field on the way (`$a.b.c`), taken apart at
    /// each array by `$arrayElemAt`. On an array of documents a field path gives one value per
    /// element that has it, so a field path may run through one array at most, and only where
    /// every element has the fields that follow it, through documents, none of them an array;
    /// `None` elsewhere (a field of a document in an array of arrays, or in an array inside a
    /// document in an array), and for a field name a field path cannot hold. Arrays the path
    /// does not run through (arrays of arrays of values) are read position by position.
    fn reach(&mut self, route: &[Step<'a>]) -> Option<Bson> {
        let mut names: Vec<&str> = Vec::new();
        let mut indices: Vec<usize> = Vec::new();
        let elements = route
            .iter()
            .filter(|s| matches!(s, Step::Element(..)))
            .count();
        for (k, step) in route.iter().enumerate() {
            match *step {
                Step::Field(name) => {
                    if !addressable(name) {
                        return None;
                    }
                    names.push(name);
                }
                Step::Element(i, siblings) => {
                    // The field names after this array: the field path runs through it, one
                    // value per element that has them. Only one array may be run through so
                    // (one that holds arrays, or leads to another, is kept whole by MongoDB and
                    // spread out by some wire-compatible servers), and only where every element
                    // has those fields, through documents, none of them an array.
                    let after: Vec<String> = route[k + 1..]
                        .iter()
                        .filter_map(|s| match s {
                            Step::Field(name) => Some((*name).to_string()),
                            Step::Element(..) => None,
                        })
                        .collect();
                    if !after.is_empty() {
                        if elements > 1 {
                            return None;
                        }
                        let key = (siblings.as_ptr() as usize, after.clone());
                        let one_to_one = *self.one_to_one.entry(key).or_insert_with(|| {
                            siblings.iter().all(|item| {
                                through_documents(item, &after)
                                    .is_some_and(|v| !matches!(v, Bson::Array(_)))
                            })
                        });
                        if !one_to_one {
                            return None;
                        }
                    }
                    indices.push(i);
                }
            }
        }
        if names.is_empty() {
            return None;
        }
        let mut expr = Bson::String(format!("${}", names.join(".")));
        for i in indices {
            let index = i64::try_from(i).ok()?;
            expr = Bson::Document(doc! { "$arrayElemAt": [expr, index] });
        }
        Some(expr)
    }

    /// The dotted path of `route` for a query condition, if it has one that names that value
    /// alone: every field name writable in a path, and no array on the way with a document
    /// element that has a field named like the element's position (a path's number names both).
    fn dotted(&mut self, route: &[Step<'_>]) -> Option<String> {
        let mut parts = Vec::with_capacity(route.len());
        for step in route {
            match *step {
                Step::Field(name) if addressable(name) => parts.push(name.to_string()),
                Step::Field(_) => return None,
                Step::Element(i, siblings) => {
                    let key = i.to_string();
                    let numbered = self
                        .numbered_fields
                        .entry(siblings.as_ptr() as usize)
                        .or_insert_with(|| {
                            siblings
                                .iter()
                                .filter_map(Bson::as_document)
                                .flat_map(|d| d.keys())
                                .filter(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
                                .cloned()
                                .collect()
                        });
                    if numbered.contains(&key) {
                        return None;
                    }
                    parts.push(key);
                }
            }
        }
        Some(parts.join("."))
    }
}

/// The value at `names` below `value`, through documents only (`None` past anything else).
fn through_documents<'v>(value: &'v Bson, names: &[String]) -> Option<&'v Bson> {
    names.iter().try_fold(value, |at, name| match at {
        Bson::Document(d) => d.get(name),
        _ => None,
    })
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
            let Some(expected) = expected else {
                return Ok(Stamping::AlreadyStamped(sys.version));
            };
            contention::conflict(store, name, id);
            return Err(RepoError::VersionConflict {
                collection: name.to_string(),
                id: shown,
                expected,
                actual: sys.version,
            });
        }
        let actual = fields::fingerprint(&stored);
        if let Some(expected) = expected.filter(|e| *e != actual) {
            contention::conflict(store, name, id);
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
            .update_one(unchanged(&stored, store.binary_collation(name)), update)
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

    /// The `$type` conditions and the `$expr` clauses of `unchanged(stored)`, as strings.
    fn parts(stored: &Document) -> (Vec<String>, Vec<String>) {
        let filter = unchanged(stored, false);
        let types = filter
            .get_array("$and")
            .map(|a| a.iter().map(|c| c.to_string()).collect())
            .unwrap_or_default();
        let exprs = filter
            .get_document("$expr")
            .and_then(|e| e.get_array("$and"))
            .map(|a| a.iter().skip(1).map(|c| c.to_string()).collect())
            .unwrap_or_default();
        (types, exprs)
    }

    #[test]
    fn the_content_condition_pins_types_and_bytes_where_it_can_read_them() {
        use std::str::FromStr;
        let dec = Bson::Decimal128(bson::Decimal128::from_str("1.50").expect("decimal"));
        let stored = doc! {
            "_id": "x", "n": 5, "l": 5_i64, "d": dec, "z": -0.0, "s": "Ab",
            "doc": { "inner": 1.5 }, "arr": [1, "t"], "rows": [{ "v": "a" }, { "v": "b" }],
            "ragged": [{ "v": "a" }, { "w": "b" }], "deep": [{ "v": [0.0] }],
        };
        let (types, exprs) = parts(&stored);
        for wanted in [
            r#"{ "n": { "$type": "int" } }"#,
            r#"{ "l": { "$type": "long" } }"#,
            r#"{ "d": { "$type": "decimal" } }"#,
            r#"{ "doc.inner": { "$type": "double" } }"#,
            r#"{ "arr.0": { "$type": "int" } }"#,
            r#"{ "rows.1.v": { "$type": "string" } }"#,
            r#"{ "deep.0.v.0": { "$type": "double" } }"#,
        ] {
            assert!(types.iter().any(|t| t == wanted), "{wanted} in {types:?}");
        }
        let has = |needle: &str| exprs.iter().any(|e| e.contains(needle));
        assert!(has(r#"{ "$toString": "$d" }"#));
        assert!(has(r#"{ "$toString": "$z" }"#));
        assert!(has(r#"{ "$strLenBytes": "$s" }"#));
        // An element of a uniform array of documents is read by a field path and its position.
        assert!(has(
            r#"{ "$strLenBytes": { "$arrayElemAt": ["$rows.v", 1] } }"#
        ));
        assert!(has(
            r#"{ "$strLenBytes": { "$arrayElemAt": ["$arr", 1] } }"#
        ));
        // Not where a field path would skip or spread elements.
        assert!(!has("$ragged"));
        assert!(!has("$deep"));
        // Nor through an array of arrays on the way to a field.
        let (_, exprs) = parts(&doc! { "_id": "y", "a": [[{ "a": -0.0 }]], "b": [[-0.0]] });
        let joined = exprs.join(" ");
        assert!(!joined.contains("$a.a"), "{joined}");
        assert!(
            joined.contains(r#"{ "$arrayElemAt": [{ "$arrayElemAt": ["$b", 0] }, 0] }"#),
            "{joined}"
        );
        // A non-zero double and numbers of the other types need no string form.
        assert!(!has(r#"{ "$toString": "$n" }"#) && !has(r#"{ "$toString": "$doc.inner" }"#));
    }

    #[test]
    fn strings_are_checked_byte_for_byte_only_under_a_collation() {
        let stored = doc! { "_id": "x", "s": "Ab", "n": 1 };
        let binary = unchanged(&stored, true).to_string();
        assert!(!binary.contains("$strLenBytes") && !binary.contains("\"string\""));
        assert!(binary.contains("\"int\""));
        let collated = unchanged(&stored, false).to_string();
        assert!(collated.contains("$strLenBytes") && collated.contains("\"string\""));
    }

    #[test]
    fn a_path_a_document_elements_field_could_also_answer_gets_no_type_condition() {
        let stored = doc! { "_id": 1, "a": [{ "1": 2 }, 3] };
        let (types, _) = parts(&stored);
        assert!(!types.iter().any(|t| t.contains("\"a.1\"")), "{types:?}");
        assert!(types.iter().any(|t| t.contains("\"a.0.1\"")), "{types:?}");
    }

    #[test]
    fn an_oversized_condition_falls_back_to_comparing_by_value() {
        let big: Vec<Bson> = (0..700_000).map(Bson::Int32).collect();
        let stored = doc! { "_id": 1, "big": big };
        let filter = unchanged(&stored, false);
        assert!(!filter.contains_key("$and"));
        assert!(filter
            .get_document("$expr")
            .is_ok_and(|e| e.contains_key("$eq")));
    }
}
