//! The parsed form of a schema: a tree of [`Node`]s, one per schema and subschema, each keyword
//! already checked and converted (type names to a set, patterns compiled, bounds as BSON numbers).
//! `parse` builds the tree and `validate` checks values against it; this file does neither.

use std::collections::BTreeSet;

use bson::Bson;
use regex::Regex;

use crate::repo::schema::types::BsonType;

/// What `additionalProperties` or `additionalItems` allows: anything, nothing, or a schema.
pub(super) enum Additional {
    Allowed(bool),
    Schema(Box<Node>),
}

/// `items`: one schema for every item, or one per position.
pub(super) enum Items {
    All(Box<Node>),
    Tuple(Vec<Node>),
}

/// One entry of `dependencies`: fields that must be present too, or a schema for the document.
pub(super) enum Dependency {
    Fields(Vec<String>),
    Schema(Box<Node>),
}

/// A `minimum` or `maximum` with its `exclusiveMinimum`/`exclusiveMaximum` flag.
pub(super) struct Bound {
    pub(super) limit: Bson,
    pub(super) exclusive: bool,
}

/// One schema (the root or a subschema), one field per keyword it can carry.
#[derive(Default)]
pub(super) struct Node {
    pub(super) types: Option<BTreeSet<BsonType>>,
    pub(super) enum_values: Option<Vec<Bson>>,
    pub(super) minimum: Option<Bound>,
    pub(super) maximum: Option<Bound>,
    pub(super) multiple_of: Option<Bson>,
    pub(super) min_length: Option<u64>,
    pub(super) max_length: Option<u64>,
    pub(super) pattern: Option<Regex>,
    pub(super) properties: Vec<(String, Node)>,
    pub(super) required: Vec<String>,
    pub(super) additional_properties: Option<Additional>,
    pub(super) pattern_properties: Vec<(Regex, Node)>,
    pub(super) min_properties: Option<u64>,
    pub(super) max_properties: Option<u64>,
    pub(super) dependencies: Vec<(String, Dependency)>,
    pub(super) items: Option<Items>,
    pub(super) additional_items: Option<Additional>,
    pub(super) min_items: Option<u64>,
    pub(super) max_items: Option<u64>,
    pub(super) unique_items: bool,
    pub(super) all_of: Vec<Node>,
    pub(super) any_of: Vec<Node>,
    pub(super) one_of: Vec<Node>,
    pub(super) not: Option<Box<Node>>,
}

/// A node and the `allOf` schemas that apply with it, recursively.
pub(super) fn flatten(node: &Node) -> Vec<&Node> {
    let mut out = vec![node];
    for sub in &node.all_of {
        out.extend(flatten(sub));
    }
    out
}
