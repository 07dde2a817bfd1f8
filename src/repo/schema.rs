//! Client-side validation with MongoDB's `$jsonSchema` dialect.
//!
//! Every write is checked here before it reaches the server, so a bad document is refused even on
//! servers that ignore validators. The keyword set is MongoDB's (draft 4 plus `bsonType`, without
//! `$ref`, `$schema`, `default`, `definitions`, `format` and the `integer` type), so the same text
//! can also be installed as the server-side validator.

use std::cmp::Ordering;
use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use bson::{Bson, Document};
use regex::Regex;
use serde_json::{Map, Value};
use thiserror::Error;

/// The type of a BSON value, spelled as MongoDB's `bsonType` aliases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BsonType {
    /// 64-bit binary floating point.
    Double,
    /// UTF-8 string.
    String,
    /// Embedded document.
    Object,
    /// Array.
    Array,
    /// Binary data.
    BinData,
    /// Deprecated `undefined`.
    Undefined,
    /// ObjectId.
    ObjectId,
    /// Boolean.
    Bool,
    /// UTC datetime.
    Date,
    /// Null.
    Null,
    /// Regular expression.
    Regex,
    /// Deprecated DBPointer.
    DbPointer,
    /// JavaScript code.
    JavaScript,
    /// Deprecated symbol.
    Symbol,
    /// JavaScript code with scope.
    JavaScriptWithScope,
    /// 32-bit integer.
    Int,
    /// Internal timestamp.
    Timestamp,
    /// 64-bit integer.
    Long,
    /// 128-bit decimal floating point.
    Decimal,
    /// The lowest key.
    MinKey,
    /// The highest key.
    MaxKey,
}

const ALL_TYPES: [BsonType; 21] = [
    BsonType::Double,
    BsonType::String,
    BsonType::Object,
    BsonType::Array,
    BsonType::BinData,
    BsonType::Undefined,
    BsonType::ObjectId,
    BsonType::Bool,
    BsonType::Date,
    BsonType::Null,
    BsonType::Regex,
    BsonType::DbPointer,
    BsonType::JavaScript,
    BsonType::Symbol,
    BsonType::JavaScriptWithScope,
    BsonType::Int,
    BsonType::Timestamp,
    BsonType::Long,
    BsonType::Decimal,
    BsonType::MinKey,
    BsonType::MaxKey,
];

const NUMERIC: [BsonType; 4] = [
    BsonType::Double,
    BsonType::Int,
    BsonType::Long,
    BsonType::Decimal,
];

impl BsonType {
    /// The type of a value.
    pub fn of(value: &Bson) -> BsonType {
        match value {
            Bson::Double(_) => BsonType::Double,
            Bson::String(_) => BsonType::String,
            Bson::Document(_) => BsonType::Object,
            Bson::Array(_) => BsonType::Array,
            Bson::Binary(_) => BsonType::BinData,
            Bson::Undefined => BsonType::Undefined,
            Bson::ObjectId(_) => BsonType::ObjectId,
            Bson::Boolean(_) => BsonType::Bool,
            Bson::DateTime(_) => BsonType::Date,
            Bson::Null => BsonType::Null,
            Bson::RegularExpression(_) => BsonType::Regex,
            Bson::DbPointer(_) => BsonType::DbPointer,
            Bson::JavaScriptCode(_) => BsonType::JavaScript,
            Bson::Symbol(_) => BsonType::Symbol,
            Bson::JavaScriptCodeWithScope(_) => BsonType::JavaScriptWithScope,
            Bson::Int32(_) => BsonType::Int,
            Bson::Timestamp(_) => BsonType::Timestamp,
            Bson::Int64(_) => BsonType::Long,
            Bson::Decimal128(_) => BsonType::Decimal,
            Bson::MinKey => BsonType::MinKey,
            Bson::MaxKey => BsonType::MaxKey,
        }
    }

    /// The `bsonType` alias MongoDB uses for this type.
    pub fn alias(self) -> &'static str {
        match self {
            BsonType::Double => "double",
            BsonType::String => "string",
            BsonType::Object => "object",
            BsonType::Array => "array",
            BsonType::BinData => "binData",
            BsonType::Undefined => "undefined",
            BsonType::ObjectId => "objectId",
            BsonType::Bool => "bool",
            BsonType::Date => "date",
            BsonType::Null => "null",
            BsonType::Regex => "regex",
            BsonType::DbPointer => "dbPointer",
            BsonType::JavaScript => "javascript",
            BsonType::Symbol => "symbol",
            BsonType::JavaScriptWithScope => "javascriptWithScope",
            BsonType::Int => "int",
            BsonType::Timestamp => "timestamp",
            BsonType::Long => "long",
            BsonType::Decimal => "decimal",
            BsonType::MinKey => "minKey",
            BsonType::MaxKey => "maxKey",
        }
    }

    /// The type a `bsonType` alias names (`number` names several and is not accepted here).
    pub fn from_alias(alias: &str) -> Option<BsonType> {
        ALL_TYPES.into_iter().find(|t| t.alias() == alias)
    }

    /// Whether values of this type are numbers.
    pub fn is_numeric(self) -> bool {
        NUMERIC.contains(&self)
    }
}

impl fmt::Display for BsonType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.alias())
    }
}

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

/// A node and the `allOf` schemas that apply with it, recursively.
fn flatten(node: &Node) -> Vec<&Node> {
    let mut out = vec![node];
    for sub in &node.all_of {
        out.extend(flatten(sub));
    }
    out
}

fn child_path(parent: &str, child: &str) -> String {
    if parent.is_empty() {
        child.to_string()
    } else {
        format!("{parent}.{child}")
    }
}

fn shown_path(path: &str) -> String {
    if path.is_empty() {
        "(document)".to_string()
    } else {
        path.to_string()
    }
}

fn type_list(types: &BTreeSet<BsonType>) -> String {
    let names: Vec<&str> = types.iter().map(|t| t.alias()).collect();
    names.join(" or ")
}

/// A value being checked: either a whole document or a single BSON value.
enum Subject<'a> {
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

enum Additional {
    Allowed(bool),
    Schema(Box<Node>),
}

enum Items {
    All(Box<Node>),
    Tuple(Vec<Node>),
}

enum Dependency {
    Fields(Vec<String>),
    Schema(Box<Node>),
}

struct Bound {
    limit: Bson,
    exclusive: bool,
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

#[derive(Default)]
struct Node {
    types: Option<BTreeSet<BsonType>>,
    enum_values: Option<Vec<Bson>>,
    minimum: Option<Bound>,
    maximum: Option<Bound>,
    multiple_of: Option<Bson>,
    min_length: Option<u64>,
    max_length: Option<u64>,
    pattern: Option<Regex>,
    properties: Vec<(String, Node)>,
    required: Vec<String>,
    additional_properties: Option<Additional>,
    pattern_properties: Vec<(Regex, Node)>,
    min_properties: Option<u64>,
    max_properties: Option<u64>,
    dependencies: Vec<(String, Dependency)>,
    items: Option<Items>,
    additional_items: Option<Additional>,
    min_items: Option<u64>,
    max_items: Option<u64>,
    unique_items: bool,
    all_of: Vec<Node>,
    any_of: Vec<Node>,
    one_of: Vec<Node>,
    not: Option<Box<Node>>,
}

fn violation(path: &str, reason: impl Into<String>) -> Violation {
    Violation {
        field: shown_path(path),
        reason: reason.into(),
    }
}

impl Node {
    fn check(&self, value: &Subject<'_>, path: &str) -> Result<(), Violation> {
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

/// A number in a form that compares across BSON numeric types.
enum Number {
    Int(i64),
    Float(f64),
}

fn number(b: &Bson) -> Option<Number> {
    match b {
        Bson::Int32(i) => Some(Number::Int(i64::from(*i))),
        Bson::Int64(i) => Some(Number::Int(*i)),
        Bson::Double(f) => Some(Number::Float(*f)),
        // Decimal128 has no arithmetic in the bson crate; its text form parses closely enough
        // for range checks.
        Bson::Decimal128(d) => d.to_string().parse::<f64>().ok().map(Number::Float),
        _ => None,
    }
}

fn compare_numbers(a: &Bson, b: &Bson) -> Option<Ordering> {
    match (number(a)?, number(b)?) {
        (Number::Int(x), Number::Int(y)) => Some(x.cmp(&y)),
        (Number::Int(x), Number::Float(y)) => compare_int_float(x, y),
        (Number::Float(x), Number::Int(y)) => compare_int_float(y, x).map(Ordering::reverse),
        (Number::Float(x), Number::Float(y)) => x.partial_cmp(&y),
    }
}

/// Compares an integer with a float exactly, even where the integer does not fit an `f64`.
fn compare_int_float(i: i64, f: f64) -> Option<Ordering> {
    if f.is_nan() {
        return None;
    }
    // 2^63 as f64; every i64 is below it.
    const TWO_63: f64 = 9_223_372_036_854_775_808.0;
    if f >= TWO_63 {
        return Some(Ordering::Less);
    }
    if f < -TWO_63 {
        return Some(Ordering::Greater);
    }
    let whole = f.trunc();
    // In range, so the cast is exact.
    let w = whole as i64;
    match i.cmp(&w) {
        Ordering::Equal => 0.0f64.partial_cmp(&(f - whole)),
        other => Some(other),
    }
}

fn is_multiple(n: &Bson, m: &Bson) -> bool {
    match (number(n), number(m)) {
        (Some(Number::Int(x)), Some(Number::Int(y))) => y != 0 && x % y == 0,
        (Some(x), Some(y)) => {
            let x = as_f64(&x);
            let y = as_f64(&y);
            y != 0.0 && x.is_finite() && (x / y).fract() == 0.0
        }
        _ => false,
    }
}

fn as_f64(n: &Number) -> f64 {
    match n {
        Number::Int(i) => *i as f64,
        Number::Float(f) => *f,
    }
}

/// Equality as MongoDB applies it to `enum` and `uniqueItems`: numbers compare by value across
/// types, documents compare field by field in order.
fn bson_equal(a: &Bson, b: &Bson) -> bool {
    if BsonType::of(a).is_numeric() && BsonType::of(b).is_numeric() {
        return compare_numbers(a, b) == Some(Ordering::Equal);
    }
    match (a, b) {
        (Bson::Document(x), Bson::Document(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y.iter())
                    .all(|((ka, va), (kb, vb))| ka == kb && bson_equal(va, vb))
        }
        (Bson::Array(x), Bson::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y.iter()).all(|(p, q)| bson_equal(p, q))
        }
        _ => a == b,
    }
}

fn show_value(value: &Bson) -> String {
    let text = value.clone().into_relaxed_extjson().to_string();
    if text.chars().count() > 60 {
        let cut: String = text.chars().take(57).collect();
        format!("{cut}...")
    } else {
        text
    }
}

struct Parser<'c> {
    collection: &'c str,
}

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

    fn node(&self, value: &serde_json::Value, at: &str) -> Result<Node, SchemaError> {
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
    use super::*;
    use bson::{doc, oid::ObjectId};

    fn schema(json: serde_json::Value) -> JsonSchema {
        match JsonSchema::from_value("things", json) {
            Ok(s) => s,
            Err(e) => panic!("schema should parse: {e}"),
        }
    }

    fn field_of(result: Result<(), Violation>) -> String {
        match result {
            Ok(()) => panic!("expected a violation"),
            Err(v) => v.field,
        }
    }

    fn sample() -> JsonSchema {
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
    fn numbers_compare_across_types() {
        assert!(bson_equal(&Bson::Int32(3), &Bson::Double(3.0)));
        assert!(bson_equal(&Bson::Int64(3), &Bson::Int32(3)));
        assert!(!bson_equal(&Bson::Int64(3), &Bson::String("3".into())));
        assert_eq!(
            compare_numbers(&Bson::Int64(i64::MAX), &Bson::Double(i64::MAX as f64)),
            Some(Ordering::Less)
        );
        assert_eq!(
            compare_numbers(&Bson::Int64(2), &Bson::Double(2.5)),
            Some(Ordering::Less)
        );
        assert_eq!(
            compare_numbers(&Bson::Double(-2.5), &Bson::Int64(-2)),
            Some(Ordering::Less)
        );
        assert_eq!(
            compare_numbers(&Bson::Double(f64::NAN), &Bson::Int64(0)),
            None
        );
    }

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

    #[test]
    fn the_document_form_round_trips() {
        let s = sample();
        let d = s.to_document();
        assert_eq!(d.get_str("bsonType"), Ok("object"));
        assert!(d.get_document("properties").is_ok());
    }
}
