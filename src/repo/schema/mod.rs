//! Client-side validation with MongoDB's `$jsonSchema` dialect.
//!
//! Every write is checked here before it reaches the server, so a bad document is refused even on
//! servers that ignore validators. The keyword set is MongoDB's (draft 4 plus `bsonType`, without
//! `$ref`, `$schema`, `default`, `definitions`, `format` and the `integer` type), so the same text
//! can also be installed as the server-side validator.
//!
//! [`JsonSchema`] is the front door, here; inside, one idea per file, each depending only on those
//! listed before it: `types` names the BSON types and their `bsonType` aliases; `error` holds what
//! checks report; `values` compares and shows BSON values (numbers across types, MongoDB's
//! equality); `node` is the parsed tree; `parse` builds that tree from JSON; `validate` checks
//! documents and values against it.

mod error;
mod node;
mod parse;
mod types;
mod validate;
mod values;

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use bson::{Bson, Document};
use serde_json::Value;

pub use error::{SchemaError, Violation};
pub use types::BsonType;

use node::{flatten, Additional, Node};
use parse::Parser;
use validate::{child_path, type_list, Subject};

/// A parsed `$jsonSchema`: validates documents, single-field changes and answers type questions.
#[derive(Clone)]
pub struct JsonSchema {
    root: Arc<Node>,
    document: Document,
}

impl fmt::Debug for JsonSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("JsonSchema").field(&self.document).finish()
    }
}

impl JsonSchema {
    /// Parses schema text for `collection` (named in errors).
    pub fn parse(collection: &str, json: &str) -> Result<JsonSchema, SchemaError> {
        let value: Value = serde_json::from_str(json).map_err(|e| SchemaError::NotJson {
            collection: collection.to_string(),
            reason: e.to_string(),
        })?;
        JsonSchema::from_value(collection, value)
    }

    /// Builds a schema from a JSON value for `collection` (named in errors).
    pub fn from_value(collection: &str, value: Value) -> Result<JsonSchema, SchemaError> {
        if !value.is_object() {
            return Err(SchemaError::NotJson {
                collection: collection.to_string(),
                reason: "the top level must be an object".into(),
            });
        }
        let parser = Parser { collection };
        let root = parser.node(&value, "(root)")?;
        let document = match Bson::try_from(value) {
            Ok(Bson::Document(d)) => d,
            Ok(other) => {
                return Err(SchemaError::NotJson {
                    collection: collection.to_string(),
                    reason: format!("converts to BSON {other:?}, not a document"),
                })
            }
            Err(e) => {
                return Err(SchemaError::NotJson {
                    collection: collection.to_string(),
                    reason: e.to_string(),
                })
            }
        };
        Ok(JsonSchema {
            root: Arc::new(root),
            document,
        })
    }

    /// The schema as the BSON document that goes under `$jsonSchema`.
    pub fn to_document(&self) -> Document {
        self.document.clone()
    }

    /// Checks a whole document.
    pub fn validate(&self, doc: &Document) -> Result<(), Violation> {
        self.root.check(&Subject::Doc(doc), "")
    }

    /// Checks that setting the dotted `path` to `value` cannot break the schema.
    ///
    /// Schemas reached through `anyOf`, `oneOf` and `not` above the field are not consulted,
    /// because whether they hold depends on fields this change does not touch.
    pub fn validate_set(&self, path: &str, value: &Bson) -> Result<(), Violation> {
        let leaves = self.walk(path)?;
        for node in leaves {
            node.check(&Subject::Bson(value), path)?;
        }
        Ok(())
    }

    /// Checks that removing the dotted `path` cannot break the schema (it is not required).
    pub fn validate_unset(&self, path: &str) -> Result<(), Violation> {
        let (parent, last) = match path.rsplit_once('.') {
            Some((parent, last)) => (self.walk(parent)?, last),
            None => (flatten(&self.root), path),
        };
        if parent.iter().any(|n| n.required.iter().any(|r| r == last)) {
            return Err(Violation {
                field: path.to_string(),
                reason: "is required and cannot be removed".into(),
            });
        }
        Ok(())
    }

    /// The types the schema allows at the dotted `path`, or `None` if it does not constrain them.
    pub fn allowed_types(&self, path: &str) -> Option<BTreeSet<BsonType>> {
        let leaves = self.walk(path).ok()?;
        let mut allowed: Option<BTreeSet<BsonType>> = None;
        for types in leaves.iter().filter_map(|n| n.types.as_ref()) {
            allowed = Some(match allowed {
                None => types.clone(),
                Some(so_far) => so_far.intersection(types).copied().collect(),
            });
        }
        allowed
    }

    /// The schemas that apply to the field at `path`, or why the field cannot exist.
    fn walk(&self, path: &str) -> Result<Vec<&Node>, Violation> {
        let mut current = flatten(&self.root);
        let mut at = String::new();
        for segment in path.split('.') {
            let parent_path = if at.is_empty() {
                "(document)".to_string()
            } else {
                at.clone()
            };
            at = child_path(&at, segment);
            let mut next = Vec::new();
            for node in &current {
                if let Some(types) = &node.types {
                    if !types.contains(&BsonType::Object) {
                        return Err(Violation {
                            field: at.clone(),
                            reason: format!(
                                "cannot exist: `{parent_path}` must be of bsonType {}",
                                type_list(types)
                            ),
                        });
                    }
                }
                let mut matched = false;
                if let Some(child) = node.properties.iter().find(|(k, _)| k == segment) {
                    next.extend(flatten(&child.1));
                    matched = true;
                }
                for (re, child) in &node.pattern_properties {
                    if re.is_match(segment) {
                        next.extend(flatten(child));
                        matched = true;
                    }
                }
                if !matched {
                    match &node.additional_properties {
                        Some(Additional::Allowed(false)) => {
                            return Err(Violation {
                                field: at.clone(),
                                reason: format!(
                                    "is not allowed: `{parent_path}` permits no undeclared fields"
                                ),
                            })
                        }
                        Some(Additional::Schema(child)) => next.extend(flatten(child)),
                        Some(Additional::Allowed(true)) | None => {}
                    }
                }
            }
            current = next;
        }
        Ok(current)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn schema(json: serde_json::Value) -> JsonSchema {
        match JsonSchema::from_value("things", json) {
            Ok(s) => s,
            Err(e) => panic!("schema should parse: {e}"),
        }
    }

    pub(super) fn field_of(result: Result<(), Violation>) -> String {
        match result {
            Ok(()) => panic!("expected a violation"),
            Err(v) => v.field,
        }
    }

    pub(super) fn sample() -> JsonSchema {
        schema(serde_json::json!({
            "bsonType": "object",
            "required": ["_id", "name"],
            "additionalProperties": false,
            "properties": {
                "_id": { "bsonType": ["string", "objectId"] },
                "name": { "bsonType": "string", "minLength": 2, "maxLength": 5 },
                "age": { "bsonType": ["int", "long"], "minimum": 0, "maximum": 150, "exclusiveMaximum": true },
                "score": { "bsonType": "number", "multipleOf": 0.5 },
                "kind": { "enum": ["a", "b", 3] },
                "tags": { "bsonType": "array", "items": { "bsonType": "string", "pattern": "^[a-z]+$" }, "uniqueItems": true, "maxItems": 3 },
                "pair": { "bsonType": "array", "items": [{ "bsonType": "int" }, { "bsonType": "string" }], "additionalItems": false },
                "address": {
                    "bsonType": "object",
                    "required": ["city"],
                    "properties": { "city": { "bsonType": "string" }, "zip": { "bsonType": "string" } },
                    "dependencies": { "zip": ["city"] },
                    "additionalProperties": { "bsonType": "int" }
                },
                "extra": { "bsonType": "object", "patternProperties": { "^x_": { "bsonType": "bool" } } },
                "either": { "anyOf": [{ "bsonType": "string" }, { "bsonType": "int" }] },
                "exactly": { "oneOf": [{ "bsonType": "number" }, { "bsonType": "int" }] },
                "never": { "not": { "bsonType": "string" } },
                "both": { "allOf": [{ "bsonType": "int" }, { "minimum": 10 }] }
            }
        }))
    }

    #[test]
    fn single_field_changes_are_checked_along_the_path() {
        let s = sample();
        assert_eq!(s.validate_set("name", &Bson::from("bob")), Ok(()));
        assert_eq!(field_of(s.validate_set("name", &Bson::from(1))), "name");
        assert_eq!(field_of(s.validate_set("nope", &Bson::from(1))), "nope");
        assert_eq!(s.validate_set("address.city", &Bson::from("x")), Ok(()));
        assert_eq!(s.validate_set("address.other", &Bson::from(2)), Ok(()));
        assert_eq!(
            field_of(s.validate_set("address.other", &Bson::from("s"))),
            "address.other"
        );
        assert_eq!(
            field_of(s.validate_set("name.first", &Bson::from("a"))),
            "name.first"
        );
        assert_eq!(field_of(s.validate_set("both", &Bson::from(3))), "both");
        assert_eq!(field_of(s.validate_unset("name")), "name");
        assert_eq!(s.validate_unset("age"), Ok(()));
        assert_eq!(field_of(s.validate_unset("address.city")), "address.city");
        assert_eq!(s.validate_unset("address.zip"), Ok(()));
    }

    #[test]
    fn allowed_types_follow_bson_type_and_all_of() {
        let s = sample();
        let types = |p: &str| {
            s.allowed_types(p)
                .map(|t| t.into_iter().collect::<Vec<_>>())
        };
        assert_eq!(types("age"), Some(vec![BsonType::Int, BsonType::Long]));
        assert_eq!(
            types("score"),
            Some(vec![
                BsonType::Double,
                BsonType::Int,
                BsonType::Long,
                BsonType::Decimal
            ])
        );
        assert_eq!(types("both"), Some(vec![BsonType::Int]));
        assert_eq!(types("kind"), None);
        assert_eq!(types("nope"), None);
        assert_eq!(types("address.other"), Some(vec![BsonType::Int]));
    }

    #[test]
    fn the_document_form_round_trips() {
        let s = sample();
        let d = s.to_document();
        assert_eq!(d.get_str("bsonType"), Ok("object"));
        assert!(d.get_document("properties").is_ok());
    }
}
