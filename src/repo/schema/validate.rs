//! Checking a value against the parsed tree: [`Node::check`] applies every keyword of a node to a
//! whole document or to one BSON value and returns the first [`Violation`], named by the dotted
//! path of the offending field (`(document)` for the document itself). The helpers that build those
//! paths and messages are shared with the single-field checks of `JsonSchema`.

use std::cmp::Ordering;
use std::collections::BTreeSet;

use bson::{Bson, Document};

use crate::repo::schema::error::Violation;
use crate::repo::schema::node::{Additional, Bound, Dependency, Items, Node};
use crate::repo::schema::types::BsonType;
use crate::repo::schema::values::{bson_equal, compare_numbers, is_multiple, show_value};

pub(super) fn child_path(parent: &str, child: &str) -> String {
    if parent.is_empty() {
        child.to_string()
    } else {
        format!("{parent}.{child}")
    }
}

pub(super) fn shown_path(path: &str) -> String {
    if path.is_empty() {
        "(document)".to_string()
    } else {
        path.to_string()
    }
}

pub(super) fn type_list(types: &BTreeSet<BsonType>) -> String {
    let names: Vec<&str> = types.iter().map(|t| t.alias()).collect();
    names.join(" or ")
}

/// A value being checked: either a whole document or a single BSON value.
pub(super) enum Subject<'a> {
    Doc(&'a Document),
    Bson(&'a Bson),
}

impl<'a> Subject<'a> {
    fn bson_type(&self) -> BsonType {
        match self {
            Subject::Doc(_) => BsonType::Object,
            Subject::Bson(b) => BsonType::of(b),
        }
    }

    fn as_document(&self) -> Option<&'a Document> {
        match self {
            Subject::Doc(d) => Some(d),
            Subject::Bson(Bson::Document(d)) => Some(d),
            Subject::Bson(_) => None,
        }
    }

    fn owned(&self) -> Bson {
        match self {
            Subject::Doc(d) => Bson::Document((*d).clone()),
            Subject::Bson(b) => (*b).clone(),
        }
    }
}

impl Bound {
    /// Checks that `n` lies on the `side` of the limit (`Greater` for a minimum, `Less` for a
    /// maximum), or on it when the bound is inclusive.
    fn check(&self, n: &Bson, side: Ordering, path: &str) -> Result<(), Violation> {
        let ok = match compare_numbers(n, &self.limit) {
            Some(Ordering::Equal) => !self.exclusive,
            Some(ord) => ord == side,
            None => false,
        };
        if ok {
            return Ok(());
        }
        let op = match (side, self.exclusive) {
            (Ordering::Greater, true) => ">",
            (Ordering::Greater, false) => ">=",
            (_, true) => "<",
            (_, false) => "<=",
        };
        Err(violation(
            path,
            format!(
                "must be {op} {}, found {}",
                show_value(&self.limit),
                show_value(n)
            ),
        ))
    }
}

fn violation(path: &str, reason: impl Into<String>) -> Violation {
    Violation {
        field: shown_path(path),
        reason: reason.into(),
    }
}

impl Node {
    pub(super) fn check(&self, value: &Subject<'_>, path: &str) -> Result<(), Violation> {
        let ty = value.bson_type();
        if let Some(types) = &self.types {
            if !types.contains(&ty) {
                return Err(violation(
                    path,
                    format!("must be of bsonType {}, found {ty}", type_list(types)),
                ));
            }
        }
        if let Some(allowed) = &self.enum_values {
            let owned = value.owned();
            if !allowed.iter().any(|a| bson_equal(a, &owned)) {
                let shown: Vec<String> = allowed.iter().take(8).map(show_value).collect();
                let more = if allowed.len() > 8 { ", ..." } else { "" };
                return Err(violation(
                    path,
                    format!(
                        "must be one of [{}{more}], found {}",
                        shown.join(", "),
                        show_value(&owned)
                    ),
                ));
            }
        }
        match value {
            Subject::Bson(b) if ty.is_numeric() => self.check_number(b, path)?,
            Subject::Bson(Bson::String(s)) => self.check_string(s, path)?,
            Subject::Bson(Bson::Array(items)) => self.check_array(items, path)?,
            _ => {}
        }
        if let Some(doc) = value.as_document() {
            self.check_object(doc, path)?;
        }
        for sub in &self.all_of {
            sub.check(value, path)?;
        }
        if !self.any_of.is_empty() {
            let mut first = None;
            let mut any = false;
            for sub in &self.any_of {
                match sub.check(value, path) {
                    Ok(()) => {
                        any = true;
                        break;
                    }
                    Err(v) => {
                        first.get_or_insert(v);
                    }
                }
            }
            if !any {
                let detail = first.map(|v| format!(" (first: {v})")).unwrap_or_default();
                return Err(violation(
                    path,
                    format!("matches none of the anyOf alternatives{detail}"),
                ));
            }
        }
        if !self.one_of.is_empty() {
            let matching = self
                .one_of
                .iter()
                .filter(|sub| sub.check(value, path).is_ok())
                .count();
            if matching != 1 {
                return Err(violation(
                    path,
                    format!("must match exactly one oneOf alternative, matches {matching}"),
                ));
            }
        }
        if let Some(not) = &self.not {
            if not.check(value, path).is_ok() {
                return Err(violation(
                    path,
                    "matches the schema it must not match (not)",
                ));
            }
        }
        Ok(())
    }

    fn check_number(&self, n: &Bson, path: &str) -> Result<(), Violation> {
        if let Some(b) = &self.minimum {
            b.check(n, Ordering::Greater, path)?;
        }
        if let Some(b) = &self.maximum {
            b.check(n, Ordering::Less, path)?;
        }
        if let Some(m) = &self.multiple_of {
            if !is_multiple(n, m) {
                return Err(violation(
                    path,
                    format!(
                        "must be a multiple of {}, found {}",
                        show_value(m),
                        show_value(n)
                    ),
                ));
            }
        }
        Ok(())
    }

    fn check_string(&self, s: &str, path: &str) -> Result<(), Violation> {
        // MongoDB counts code points, not bytes.
        let len = s.chars().count() as u64;
        if let Some(min) = self.min_length {
            if len < min {
                return Err(violation(
                    path,
                    format!("must be at least {min} characters long, found {len}"),
                ));
            }
        }
        if let Some(max) = self.max_length {
            if len > max {
                return Err(violation(
                    path,
                    format!("must be at most {max} characters long, found {len}"),
                ));
            }
        }
        if let Some(re) = &self.pattern {
            if !re.is_match(s) {
                return Err(violation(
                    path,
                    format!("must match the pattern /{}/, found {s:?}", re.as_str()),
                ));
            }
        }
        Ok(())
    }

    fn check_array(&self, items: &[Bson], path: &str) -> Result<(), Violation> {
        let count = items.len() as u64;
        if let Some(min) = self.min_items {
            if count < min {
                return Err(violation(
                    path,
                    format!("must have at least {min} items, found {count}"),
                ));
            }
        }
        if let Some(max) = self.max_items {
            if count > max {
                return Err(violation(
                    path,
                    format!("must have at most {max} items, found {count}"),
                ));
            }
        }
        if self.unique_items {
            for (i, a) in items.iter().enumerate() {
                if let Some(j) = items[..i].iter().position(|b| bson_equal(a, b)) {
                    return Err(violation(
                        &child_path(path, &i.to_string()),
                        format!("repeats item {j}; items must be unique"),
                    ));
                }
            }
        }
        match &self.items {
            None => {}
            Some(Items::All(node)) => {
                for (i, item) in items.iter().enumerate() {
                    node.check(&Subject::Bson(item), &child_path(path, &i.to_string()))?;
                }
            }
            Some(Items::Tuple(nodes)) => {
                for (i, item) in items.iter().enumerate() {
                    let at = child_path(path, &i.to_string());
                    match nodes.get(i) {
                        Some(node) => node.check(&Subject::Bson(item), &at)?,
                        None => match &self.additional_items {
                            Some(Additional::Allowed(false)) => {
                                return Err(violation(
                                    &at,
                                    format!("is not allowed: at most {} items", nodes.len()),
                                ))
                            }
                            Some(Additional::Schema(node)) => {
                                node.check(&Subject::Bson(item), &at)?
                            }
                            Some(Additional::Allowed(true)) | None => {}
                        },
                    }
                }
            }
        }
        Ok(())
    }

    fn check_object(&self, doc: &Document, path: &str) -> Result<(), Violation> {
        for name in &self.required {
            if !doc.contains_key(name) {
                return Err(violation(&child_path(path, name), "is required"));
            }
        }
        let count = doc.len() as u64;
        if let Some(min) = self.min_properties {
            if count < min {
                return Err(violation(
                    path,
                    format!("must have at least {min} fields, found {count}"),
                ));
            }
        }
        if let Some(max) = self.max_properties {
            if count > max {
                return Err(violation(
                    path,
                    format!("must have at most {max} fields, found {count}"),
                ));
            }
        }
        for (key, value) in doc {
            let at = child_path(path, key);
            let mut matched = false;
            if let Some((_, node)) = self.properties.iter().find(|(k, _)| k == key) {
                node.check(&Subject::Bson(value), &at)?;
                matched = true;
            }
            for (re, node) in &self.pattern_properties {
                if re.is_match(key) {
                    node.check(&Subject::Bson(value), &at)?;
                    matched = true;
                }
            }
            if !matched {
                match &self.additional_properties {
                    Some(Additional::Allowed(false)) => {
                        return Err(violation(
                            &at,
                            format!(
                                "is not allowed: `{}` permits no undeclared fields",
                                shown_path(path)
                            ),
                        ))
                    }
                    Some(Additional::Schema(node)) => node.check(&Subject::Bson(value), &at)?,
                    Some(Additional::Allowed(true)) | None => {}
                }
            }
        }
        for (name, dependency) in &self.dependencies {
            if !doc.contains_key(name) {
                continue;
            }
            match dependency {
                Dependency::Fields(needed) => {
                    if let Some(missing) = needed.iter().find(|n| !doc.contains_key(n.as_str())) {
                        return Err(violation(
                            &child_path(path, missing),
                            format!("is required when `{}` is present", child_path(path, name)),
                        ));
                    }
                }
                Dependency::Schema(node) => node.check(&Subject::Doc(doc), path)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use bson::{doc, oid::ObjectId, Document};

    use crate::repo::schema::tests::{field_of, sample, schema};

    #[test]
    fn valid_documents_pass() {
        let s = sample();
        let d = doc! {
            "_id": ObjectId::new(), "name": "ann", "age": 3_i64, "score": 2.5, "kind": 3.0,
            "tags": ["x", "y"], "pair": [1, "z"], "address": { "city": "B", "zip": "1", "n": 4 },
            "extra": { "x_ok": true, "other": 1 }, "either": 7, "exactly": 1.5, "never": 4, "both": 11
        };
        assert_eq!(s.validate(&d), Ok(()));
    }

    #[test]
    fn each_keyword_reports_the_offending_field() {
        let s = sample();
        let base = doc! { "_id": "x", "name": "ann" };
        let cases: Vec<(Document, &str)> = vec![
            (doc! { "_id": "x" }, "name"),
            (doc! { "_id": 5, "name": "ann" }, "_id"),
            (doc! { "name": "a" }, "_id"),
            (doc! { "_id": "x", "name": "a" }, "name"),
            (doc! { "_id": "x", "name": "abcdef" }, "name"),
            (doc! { "_id": "x", "name": "ann", "age": -1 }, "age"),
            (doc! { "_id": "x", "name": "ann", "age": 150 }, "age"),
            (doc! { "_id": "x", "name": "ann", "score": 0.3 }, "score"),
            (doc! { "_id": "x", "name": "ann", "kind": "c" }, "kind"),
            (doc! { "_id": "x", "name": "ann", "tags": ["A"] }, "tags.0"),
            (
                doc! { "_id": "x", "name": "ann", "tags": ["a", "a"] },
                "tags.1",
            ),
            (
                doc! { "_id": "x", "name": "ann", "tags": ["a", "b", "c", "d"] },
                "tags",
            ),
            (doc! { "_id": "x", "name": "ann", "pair": [1, 2] }, "pair.1"),
            (
                doc! { "_id": "x", "name": "ann", "pair": [1, "a", 3] },
                "pair.2",
            ),
            (
                doc! { "_id": "x", "name": "ann", "address": {} },
                "address.city",
            ),
            (
                doc! { "_id": "x", "name": "ann", "address": { "city": "c", "q": "s" } },
                "address.q",
            ),
            (
                doc! { "_id": "x", "name": "ann", "extra": { "x_a": 1 } },
                "extra.x_a",
            ),
            (doc! { "_id": "x", "name": "ann", "either": 1.5 }, "either"),
            (doc! { "_id": "x", "name": "ann", "exactly": 2 }, "exactly"),
            (doc! { "_id": "x", "name": "ann", "never": "s" }, "never"),
            (doc! { "_id": "x", "name": "ann", "both": 9 }, "both"),
            (doc! { "_id": "x", "name": "ann", "unknown": 1 }, "unknown"),
        ];
        assert_eq!(s.validate(&base), Ok(()));
        for (d, field) in cases {
            assert_eq!(field_of(s.validate(&d)), field, "{d}");
        }
    }

    #[test]
    fn root_violations_name_the_document() {
        let s = schema(serde_json::json!({ "minProperties": 2 }));
        assert_eq!(field_of(s.validate(&doc! { "a": 1 })), "(document)");
    }

    #[test]
    fn lengths_count_code_points() {
        let s = sample();
        assert_eq!(s.validate(&doc! { "_id": "x", "name": "ééééé" }), Ok(()));
    }

    #[test]
    fn dependencies_require_fields() {
        let s = schema(serde_json::json!({ "dependencies": { "a": ["b"] } }));
        assert_eq!(field_of(s.validate(&doc! { "a": 1 })), "b");
        assert_eq!(s.validate(&doc! { "a": 1, "b": 2 }), Ok(()));
    }
}
