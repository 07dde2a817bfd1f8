//! Turning schema JSON into the node tree: [`Parser`] checks every keyword against MongoDB's
//! `$jsonSchema` dialect (refusing what the server would refuse, such as `$ref`, `format` or the
//! `integer` type) and converts it once, so that validation never meets an unusable schema. Errors
//! name the collection, the place in the schema and the keyword.

use std::cmp::Ordering;
use std::collections::BTreeSet;

use bson::Bson;
use regex::Regex;
use serde_json::Map;

use crate::repo::schema::error::SchemaError;
use crate::repo::schema::node::{Additional, Bound, Dependency, Items, Node};
use crate::repo::schema::types::{BsonType, NUMERIC};
use crate::repo::schema::values::{bson_equal, compare_numbers, show_value};

/// Turns schema JSON into [`Node`]s, naming `collection` in every error.
pub(super) struct Parser<'c> {
    pub(super) collection: &'c str,
}

/// The keywords MongoDB's `$jsonSchema` accepts.
const KEYWORDS: &[&str] = &[
    "bsonType",
    "type",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "properties",
    "required",
    "additionalProperties",
    "patternProperties",
    "minProperties",
    "maxProperties",
    "dependencies",
    "items",
    "additionalItems",
    "minItems",
    "maxItems",
    "uniqueItems",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "title",
    "description",
];

impl Parser<'_> {
    fn error(&self, at: &str, keyword: &str, reason: impl Into<String>) -> SchemaError {
        SchemaError::Keyword {
            collection: self.collection.to_string(),
            at: at.to_string(),
            keyword: keyword.to_string(),
            reason: reason.into(),
        }
    }

    pub(super) fn node(&self, value: &serde_json::Value, at: &str) -> Result<Node, SchemaError> {
        let Some(map) = value.as_object() else {
            return Err(self.error(at, "(schema)", "must be a JSON object"));
        };
        for key in map.keys() {
            if !KEYWORDS.contains(&key.as_str()) {
                let reason = match key.as_str() {
                    "$schema" | "$ref" | "id" | "$id" | "default" | "definitions" | "format" => {
                        "is not supported by MongoDB's $jsonSchema"
                    }
                    _ => "is not a $jsonSchema keyword",
                };
                return Err(self.error(at, key, reason));
            }
        }
        if map.contains_key("bsonType") && map.contains_key("type") {
            return Err(self.error(at, "type", "cannot be combined with `bsonType`"));
        }
        let mut node = Node {
            types: self.types(map, at)?,
            ..Node::default()
        };
        if let Some(v) = map.get("enum") {
            node.enum_values = Some(self.enum_values(v, at)?);
        }
        node.minimum = self.bound(map, at, "minimum", "exclusiveMinimum")?;
        node.maximum = self.bound(map, at, "maximum", "exclusiveMaximum")?;
        if let Some(v) = map.get("multipleOf") {
            let n = self.number(v, at, "multipleOf")?;
            if compare_numbers(&n, &Bson::Int32(0)) != Some(Ordering::Greater) {
                return Err(self.error(at, "multipleOf", "must be greater than 0"));
            }
            node.multiple_of = Some(n);
        }
        node.min_length = self.count(map, at, "minLength")?;
        node.max_length = self.count(map, at, "maxLength")?;
        node.min_properties = self.count(map, at, "minProperties")?;
        node.max_properties = self.count(map, at, "maxProperties")?;
        node.min_items = self.count(map, at, "minItems")?;
        node.max_items = self.count(map, at, "maxItems")?;
        if let Some(v) = map.get("pattern") {
            node.pattern = Some(self.regex(v, at, "pattern")?);
        }
        if let Some(v) = map.get("uniqueItems") {
            node.unique_items = v
                .as_bool()
                .ok_or_else(|| self.error(at, "uniqueItems", "must be true or false"))?;
        }
        if let Some(v) = map.get("properties") {
            let props = v
                .as_object()
                .ok_or_else(|| self.error(at, "properties", "must be an object of schemas"))?;
            for (name, sub) in props {
                let sub_at = format!("{at}.properties.{name}");
                node.properties
                    .push((name.clone(), self.node(sub, &sub_at)?));
            }
        }
        if let Some(v) = map.get("patternProperties") {
            let props = v.as_object().ok_or_else(|| {
                self.error(at, "patternProperties", "must be an object of schemas")
            })?;
            for (pattern, sub) in props {
                let re = Regex::new(pattern).map_err(|e| {
                    self.error(
                        at,
                        "patternProperties",
                        format!("has an invalid pattern {pattern:?}: {e}"),
                    )
                })?;
                let sub_at = format!("{at}.patternProperties.{pattern}");
                node.pattern_properties.push((re, self.node(sub, &sub_at)?));
            }
        }
        if let Some(v) = map.get("required") {
            node.required = self.names(v, at, "required")?;
        }
        if let Some(v) = map.get("additionalProperties") {
            node.additional_properties = Some(self.additional(v, at, "additionalProperties")?);
        }
        if let Some(v) = map.get("additionalItems") {
            node.additional_items = Some(self.additional(v, at, "additionalItems")?);
        }
        if let Some(v) = map.get("items") {
            node.items = Some(match v {
                serde_json::Value::Array(list) => Items::Tuple(
                    list.iter()
                        .enumerate()
                        .map(|(i, sub)| self.node(sub, &format!("{at}.items.{i}")))
                        .collect::<Result<_, _>>()?,
                ),
                other => Items::All(Box::new(self.node(other, &format!("{at}.items"))?)),
            });
        }
        if let Some(v) = map.get("dependencies") {
            let deps = v.as_object().ok_or_else(|| {
                self.error(
                    at,
                    "dependencies",
                    "must be an object of field lists or schemas",
                )
            })?;
            for (name, dep) in deps {
                let dependency = match dep {
                    serde_json::Value::Array(_) => {
                        Dependency::Fields(self.names(dep, at, "dependencies")?)
                    }
                    other => Dependency::Schema(Box::new(
                        self.node(other, &format!("{at}.dependencies.{name}"))?,
                    )),
                };
                node.dependencies.push((name.clone(), dependency));
            }
        }
        node.all_of = self.list(map, at, "allOf")?;
        node.any_of = self.list(map, at, "anyOf")?;
        node.one_of = self.list(map, at, "oneOf")?;
        if let Some(v) = map.get("not") {
            node.not = Some(Box::new(self.node(v, &format!("{at}.not"))?));
        }
        for text in ["title", "description"] {
            if map.get(text).is_some_and(|v| !v.is_string()) {
                return Err(self.error(at, text, "must be a string"));
            }
        }
        Ok(node)
    }

    fn types(
        &self,
        map: &Map<String, serde_json::Value>,
        at: &str,
    ) -> Result<Option<BTreeSet<BsonType>>, SchemaError> {
        let (keyword, value) = match (map.get("bsonType"), map.get("type")) {
            (Some(v), _) => ("bsonType", v),
            (None, Some(v)) => ("type", v),
            (None, None) => return Ok(None),
        };
        let names: Vec<&str> = match value {
            serde_json::Value::String(s) => vec![s.as_str()],
            serde_json::Value::Array(list) if !list.is_empty() => list
                .iter()
                .map(|v| {
                    v.as_str()
                        .ok_or_else(|| self.error(at, keyword, "must list type names as strings"))
                })
                .collect::<Result<_, _>>()?,
            _ => {
                return Err(self.error(
                    at,
                    keyword,
                    "must be a type name or a non-empty array of them",
                ))
            }
        };
        let mut types = BTreeSet::new();
        for name in names {
            let found: Vec<BsonType> = if name == "number" {
                NUMERIC.to_vec()
            } else if keyword == "bsonType" {
                match BsonType::from_alias(name) {
                    Some(t) => vec![t],
                    None => {
                        return Err(self.error(at, keyword, format!("names unknown type {name:?}")))
                    }
                }
            } else {
                match name {
                    "object" => vec![BsonType::Object],
                    "array" => vec![BsonType::Array],
                    "string" => vec![BsonType::String],
                    "boolean" => vec![BsonType::Bool],
                    "null" => vec![BsonType::Null],
                    "integer" => return Err(self.error(
                        at,
                        keyword,
                        "\"integer\" is not supported by MongoDB; use bsonType \"int\" or \"long\"",
                    )),
                    other => {
                        return Err(self.error(
                            at,
                            keyword,
                            format!("names unknown JSON type {other:?}"),
                        ))
                    }
                }
            };
            for t in found {
                if !types.insert(t) && name != "number" {
                    return Err(self.error(at, keyword, format!("lists {name:?} twice")));
                }
            }
        }
        Ok(Some(types))
    }

    fn enum_values(&self, v: &serde_json::Value, at: &str) -> Result<Vec<Bson>, SchemaError> {
        let list = v
            .as_array()
            .filter(|l| !l.is_empty())
            .ok_or_else(|| self.error(at, "enum", "must be a non-empty array"))?;
        let mut values = Vec::with_capacity(list.len());
        for item in list {
            let b = Bson::try_from(item.clone())
                .map_err(|e| self.error(at, "enum", format!("has an unusable value: {e}")))?;
            if values.iter().any(|seen| bson_equal(seen, &b)) {
                return Err(self.error(at, "enum", format!("lists {} twice", show_value(&b))));
            }
            values.push(b);
        }
        Ok(values)
    }

    fn number(&self, v: &serde_json::Value, at: &str, keyword: &str) -> Result<Bson, SchemaError> {
        match v {
            serde_json::Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    Ok(Bson::Int64(i))
                } else if let Some(f) = n.as_f64() {
                    Ok(Bson::Double(f))
                } else {
                    Err(self.error(at, keyword, "must be a number that fits i64 or f64"))
                }
            }
            _ => Err(self.error(at, keyword, "must be a number")),
        }
    }

    fn bound(
        &self,
        map: &Map<String, serde_json::Value>,
        at: &str,
        keyword: &str,
        exclusive_keyword: &str,
    ) -> Result<Option<Bound>, SchemaError> {
        let exclusive = match map.get(exclusive_keyword) {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.error(at, exclusive_keyword, "must be true or false"))?,
        };
        match map.get(keyword) {
            None if map.contains_key(exclusive_keyword) => Err(self.error(
                at,
                exclusive_keyword,
                format!("needs `{keyword}` beside it"),
            )),
            None => Ok(None),
            Some(v) => Ok(Some(Bound {
                limit: self.number(v, at, keyword)?,
                exclusive,
            })),
        }
    }

    fn count(
        &self,
        map: &Map<String, serde_json::Value>,
        at: &str,
        keyword: &str,
    ) -> Result<Option<u64>, SchemaError> {
        match map.get(keyword) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .or_else(|| {
                    v.as_f64()
                        .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f <= u32::MAX as f64)
                        .map(|f| f as u64)
                })
                .map(Some)
                .ok_or_else(|| self.error(at, keyword, "must be a non-negative integer")),
        }
    }

    fn regex(&self, v: &serde_json::Value, at: &str, keyword: &str) -> Result<Regex, SchemaError> {
        let text = v
            .as_str()
            .ok_or_else(|| self.error(at, keyword, "must be a string"))?;
        Regex::new(text).map_err(|e| self.error(at, keyword, format!("is not a valid regex: {e}")))
    }

    fn names(
        &self,
        v: &serde_json::Value,
        at: &str,
        keyword: &str,
    ) -> Result<Vec<String>, SchemaError> {
        let list = v
            .as_array()
            .filter(|l| !l.is_empty())
            .ok_or_else(|| self.error(at, keyword, "must be a non-empty array of field names"))?;
        let mut names: Vec<String> = Vec::with_capacity(list.len());
        for item in list {
            let name = item
                .as_str()
                .ok_or_else(|| self.error(at, keyword, "must list field names as strings"))?;
            if names.iter().any(|n| n == name) {
                return Err(self.error(at, keyword, format!("lists {name:?} twice")));
            }
            names.push(name.to_string());
        }
        Ok(names)
    }

    fn additional(
        &self,
        v: &serde_json::Value,
        at: &str,
        keyword: &str,
    ) -> Result<Additional, SchemaError> {
        match v {
            serde_json::Value::Bool(b) => Ok(Additional::Allowed(*b)),
            serde_json::Value::Object(_) => Ok(Additional::Schema(Box::new(
                self.node(v, &format!("{at}.{keyword}"))?,
            ))),
            _ => Err(self.error(at, keyword, "must be true, false or a schema")),
        }
    }

    fn list(
        &self,
        map: &Map<String, serde_json::Value>,
        at: &str,
        keyword: &str,
    ) -> Result<Vec<Node>, SchemaError> {
        match map.get(keyword) {
            None => Ok(Vec::new()),
            Some(serde_json::Value::Array(list)) if !list.is_empty() => list
                .iter()
                .enumerate()
                .map(|(i, sub)| self.node(sub, &format!("{at}.{keyword}.{i}")))
                .collect(),
            Some(_) => Err(self.error(at, keyword, "must be a non-empty array of schemas")),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::repo::schema::{JsonSchema, SchemaError};

    #[test]
    fn unusable_schemas_are_refused_naming_the_keyword() {
        let bad = [
            (serde_json::json!({ "$schema": "x" }), "$schema"),
            (serde_json::json!({ "format": "email" }), "format"),
            (serde_json::json!({ "frobnicate": 1 }), "frobnicate"),
            (serde_json::json!({ "type": "integer" }), "type"),
            (
                serde_json::json!({ "bsonType": "int", "type": "string" }),
                "type",
            ),
            (serde_json::json!({ "bsonType": "integer" }), "bsonType"),
            (serde_json::json!({ "bsonType": [] }), "bsonType"),
            (serde_json::json!({ "required": [] }), "required"),
            (serde_json::json!({ "required": ["a", "a"] }), "required"),
            (serde_json::json!({ "enum": [] }), "enum"),
            (serde_json::json!({ "minLength": -1 }), "minLength"),
            (serde_json::json!({ "minimum": "1" }), "minimum"),
            (
                serde_json::json!({ "exclusiveMinimum": true }),
                "exclusiveMinimum",
            ),
            (serde_json::json!({ "pattern": "(" }), "pattern"),
            (serde_json::json!({ "multipleOf": 0 }), "multipleOf"),
            (
                serde_json::json!({ "properties": { "a": { "minItems": "x" } } }),
                "minItems",
            ),
            (serde_json::json!({ "allOf": [] }), "allOf"),
            (
                serde_json::json!({ "additionalProperties": 1 }),
                "additionalProperties",
            ),
        ];
        for (json, keyword) in bad {
            let shown = json.to_string();
            match JsonSchema::from_value("things", json) {
                Ok(_) => panic!("{shown} should be refused"),
                Err(e) => {
                    let text = e.to_string();
                    assert!(text.contains(&format!("`{keyword}`")), "{shown}: {text}");
                    assert!(text.contains("things"), "{text}");
                }
            }
        }
        assert!(matches!(
            JsonSchema::parse("things", "{not json"),
            Err(SchemaError::NotJson { .. })
        ));
        assert!(matches!(
            JsonSchema::parse("things", "[1]"),
            Err(SchemaError::NotJson { .. })
        ));
    }
}
