//! Differential check of the two validators: for every schema in `schemas/`, thousands
//! of documents (valid ones, and valid ones broken in one way) are judged by mongotx's own
//! validator (`JsonSchema::validate`) and by the server's `$jsonSchema` validator, and the two
//! must agree on every one.
//!
//! Documents are generated from the schema itself with proptest strategies (types, bounds,
//! lengths, patterns, enums, required and optional fields, nested objects and arrays, open maps
//! under `additionalProperties`), then one in two is broken by one of: a wrong BSON type, a
//! required field removed, an undeclared field added, a value out of bounds, an array item of the
//! wrong type, an integer or double of the wrong width, a null where a value belongs, a value
//! outside an enum.

use std::collections::BTreeMap;

use crate::common::TestDb;
use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use mongotx::schema::JsonSchema;
use proptest::prelude::*;
use proptest::strategy::{BoxedStrategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use rand::{Rng, SeedableRng};
use serde_json::Value;

/// Documents judged per schema (half of them broken).
const PER_SCHEMA: usize = 2400;
/// Documents per insert command.
const BATCH: usize = 400;

const SCHEMAS: &[(&str, &str)] = &[
    ("accounts", include_str!("../../schemas/accounts.json")),
    (
        "batch_services",
        include_str!("../../schemas/batch_services.json"),
    ),
    ("batches", include_str!("../../schemas/batches.json")),
    ("counters", include_str!("../../schemas/counters.json")),
    ("dlvs", include_str!("../../schemas/dlvs.json")),
    ("lists", include_str!("../../schemas/lists.json")),
    (
        "managed_system_fields",
        include_str!("../../schemas/managed_system_fields.json"),
    ),
    (
        "mongotx_contention",
        include_str!("../../schemas/mongotx_contention.json"),
    ),
    (
        "mongotx_meta",
        include_str!("../../schemas/mongotx_meta.json"),
    ),
    (
        "mongotx_transactions",
        include_str!("../../schemas/mongotx_transactions.json"),
    ),
    ("notes", include_str!("../../schemas/notes.json")),
    ("obt_fences", include_str!("../../schemas/obt_fences.json")),
    ("obt_tokens", include_str!("../../schemas/obt_tokens.json")),
    ("obts", include_str!("../../schemas/obts.json")),
    ("profiles", include_str!("../../schemas/profiles.json")),
    (
        "quota_providers",
        include_str!("../../schemas/quota_providers.json"),
    ),
    ("ratelimits", include_str!("../../schemas/ratelimits.json")),
    ("transfers", include_str!("../../schemas/transfers.json")),
];

// ---------------------------------------------------------------------------------------------
// Generation of valid documents
// ---------------------------------------------------------------------------------------------

fn types_of(node: &Value) -> Vec<String> {
    let listed = node.get("bsonType").or_else(|| node.get("type"));
    match listed {
        Some(Value::String(t)) => vec![json_type(t)],
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(|t| t.as_str().map(json_type))
            .collect(),
        _ => vec!["string".into(), "long".into()],
    }
}

fn json_type(name: &str) -> String {
    match name {
        "boolean" => "bool".into(),
        other => other.into(),
    }
}

fn number(node: &Value, key: &str) -> Option<f64> {
    node.get(key).and_then(Value::as_f64)
}

fn count(node: &Value, key: &str) -> Option<usize> {
    node.get(key).and_then(Value::as_u64).map(|n| n as usize)
}

/// A strategy for values that satisfy `node`.
fn valid(node: &Value, depth: usize) -> BoxedStrategy<Bson> {
    // A choice of shapes (a record's kinds of change, the registry's kinds of document): a value
    // of one of them, each described whole by its alternative.
    if let Some(Value::Array(alternatives)) = node.get("oneOf").or_else(|| node.get("anyOf")) {
        let strategies: Vec<BoxedStrategy<Bson>> =
            alternatives.iter().map(|a| valid(a, depth)).collect();
        return prop::strategy::Union::new(strategies).boxed();
    }
    if let Some(Value::Array(values)) = node.get("enum") {
        let values: Vec<Bson> = values
            .iter()
            .filter_map(|v| Bson::try_from(v.clone()).ok())
            .collect();
        return prop::sample::select(values).boxed();
    }
    let strategies: Vec<BoxedStrategy<Bson>> = types_of(node)
        .iter()
        .map(|t| of_type(node, t, depth))
        .collect();
    prop::strategy::Union::new(strategies).boxed()
}

fn of_type(node: &Value, ty: &str, depth: usize) -> BoxedStrategy<Bson> {
    let min = number(node, "minimum");
    let max = number(node, "maximum");
    match ty {
        "string" => string(node),
        "long" => {
            let lo = min.map_or(-1_000_000, |m| m as i64);
            let hi = max.map_or(lo.saturating_add(1_000_000), |m| m as i64);
            (lo..=hi).prop_map(Bson::Int64).boxed()
        }
        "int" => {
            let lo = min.map_or(-100_000, |m| m as i32);
            let hi = max.map_or(lo.saturating_add(100_000), |m| m as i32);
            (lo..=hi).prop_map(Bson::Int32).boxed()
        }
        "double" | "number" => {
            let lo = min.unwrap_or(-1e6);
            let hi = max.unwrap_or(lo + 1e6);
            (lo..=hi).prop_map(Bson::Double).boxed()
        }
        "bool" => any::<bool>().prop_map(Bson::Boolean).boxed(),
        "date" => (1_500_000_000_000_i64..1_900_000_000_000)
            .prop_map(|ms| Bson::DateTime(DateTime::from_millis(ms)))
            .boxed(),
        "objectId" => any::<[u8; 12]>()
            .prop_map(|b| Bson::ObjectId(ObjectId::from_bytes(b)))
            .boxed(),
        "null" => Just(Bson::Null).boxed(),
        "object" => object(node, depth),
        "array" => array(node, depth),
        _ => Just(Bson::String("x".into())).boxed(),
    }
}

/// Characters beyond ASCII too, so that lengths are counted in code points on both sides.
const ALPHABET: &[char] = &[
    'a',
    'b',
    'z',
    'Q',
    '7',
    '-',
    ' ',
    '\u{e9}',
    '\u{4e2d}',
    '\u{1f600}',
];

fn string(node: &Value) -> BoxedStrategy<Bson> {
    if let Some(pattern) = node.get("pattern").and_then(Value::as_str) {
        // The generator has no anchors; a whole-string match is what they ask for anyway.
        let body = pattern.trim_start_matches('^');
        // A pattern anchored at the start only (a prefix) matches whatever follows: some letters
        // do, as many as `minLength` asks for at least.
        let body = match body.strip_suffix('$') {
            Some(whole) => whole.to_string(),
            None => {
                let lo = count(node, "minLength").unwrap_or(0);
                format!("{body}[a-z]{{{lo},{}}}", lo + 8)
            }
        };
        return proptest::string::string_regex(&body)
            .expect("a pattern the generator understands")
            .prop_map(Bson::String)
            .boxed();
    }
    let lo = count(node, "minLength").unwrap_or(0);
    let hi = count(node, "maxLength").unwrap_or(lo + 12).min(lo + 12);
    prop::collection::vec(prop::sample::select(ALPHABET), lo..=hi)
        .prop_map(|chars| Bson::String(chars.into_iter().collect()))
        .boxed()
}

fn object(node: &Value, depth: usize) -> BoxedStrategy<Bson> {
    let required: Vec<String> = node
        .get("required")
        .and_then(Value::as_array)
        .map(|r| {
            r.iter()
                .filter_map(|n| n.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let mut strategies: Vec<BoxedStrategy<Option<(String, Bson)>>> = Vec::new();
    // A collection schema describes live, free documents; one that says how the system fields go
    // together (`dependencies`, the system fields' own schema) gets them all.
    let live_only = depth == 0 && node.get("dependencies").is_none();
    let needs = dependencies(node);
    if let Some(Value::Object(properties)) = node.get("properties") {
        for (name, sub) in properties {
            if live_only && matches!(name.as_str(), "_txn" | "_deleted" | "_deleting" | "_hold") {
                continue;
            }
            let owned = name.clone();
            let value = valid(sub, depth + 1).prop_map(move |v| (owned.clone(), v));
            if required.contains(name) {
                strategies.push(value.prop_map(Some).boxed());
            } else {
                strategies.push(prop::option::weighted(0.6, value).boxed());
            }
        }
    }
    let open: BoxedStrategy<Vec<(String, Bson)>> = match node.get("additionalProperties") {
        Some(extra @ Value::Object(_)) if depth < 3 => {
            prop::collection::vec(("[a-z]{1,6}", valid(extra, depth + 1)), 0..3).boxed()
        }
        _ => Just(Vec::new()).boxed(),
    };
    (strategies, open)
        .prop_map(move |(fields, open)| {
            let mut doc = Document::new();
            for (name, value) in fields.into_iter().flatten() {
                doc.insert(name, value);
            }
            for (name, value) in open {
                if !doc.contains_key(&name) {
                    doc.insert(format!("k_{name}"), value);
                }
            }
            // A field whose companions were not drawn goes too, until every one that is left
            // has them.
            while let Some(lone) = needs.iter().find_map(|(name, with)| {
                (doc.contains_key(name) && with.iter().any(|w| !doc.contains_key(w)))
                    .then(|| name.clone())
            }) {
                doc.remove(&lone);
            }
            Bson::Document(doc)
        })
        .boxed()
}

/// The field-list `dependencies` of an object schema: each field with the fields it needs.
fn dependencies(node: &Value) -> Vec<(String, Vec<String>)> {
    let Some(Value::Object(deps)) = node.get("dependencies") else {
        return Vec::new();
    };
    deps.iter()
        .filter_map(|(name, with)| {
            let with = with.as_array()?;
            Some((
                name.clone(),
                with.iter()
                    .filter_map(|w| w.as_str().map(str::to_string))
                    .collect(),
            ))
        })
        .collect()
}

/// The alternative of `node`'s `oneOf` / `anyOf` that `value` satisfies (the one it was drawn
/// from, for a value not yet broken), or `node` itself when it offers none.
fn alternative_of(node: &Value, value: &Bson) -> Value {
    let Some(Value::Array(alternatives)) = node.get("oneOf").or_else(|| node.get("anyOf")) else {
        return node.clone();
    };
    let holder = doc! { "v": value.clone() };
    alternatives
        .iter()
        .find(|a| {
            let wrapped = serde_json::json!({ "bsonType": "object", "properties": { "v": a } });
            JsonSchema::from_value("alternative", wrapped)
                .is_ok_and(|s| s.validate(&holder).is_ok())
        })
        .cloned()
        .unwrap_or_else(|| node.clone())
}

fn array(node: &Value, depth: usize) -> BoxedStrategy<Bson> {
    let lo = count(node, "minItems").unwrap_or(0);
    let hi = count(node, "maxItems").unwrap_or(lo + 4).min(lo + 4);
    let item = match node.get("items") {
        Some(items @ Value::Object(_)) => valid(items, depth + 1),
        _ => valid(
            &serde_json::json!({ "bsonType": ["string", "long"] }),
            depth + 1,
        ),
    };
    let unique = node.get("uniqueItems").and_then(Value::as_bool) == Some(true);
    prop::collection::vec(item, lo..=hi)
        .prop_map(move |mut items| {
            if unique {
                let mut seen: Vec<Bson> = Vec::new();
                items.retain(|i| {
                    let fresh = !seen.contains(i);
                    seen.push(i.clone());
                    fresh
                });
            }
            Bson::Array(items)
        })
        .boxed()
}

// ---------------------------------------------------------------------------------------------
// Breaking a valid document in one way
// ---------------------------------------------------------------------------------------------

/// A field of a document and the schema node that governs it.
struct Slot {
    path: Vec<Step>,
    node: Value,
    required: bool,
}

#[derive(Clone)]
enum Step {
    Key(String),
    Index(usize),
}

fn property_node(node: &Value, key: &str) -> Option<Value> {
    if let Some(sub) = node.get("properties").and_then(|p| p.get(key)) {
        return Some(sub.clone());
    }
    match node.get("additionalProperties") {
        Some(extra @ Value::Object(_)) => Some(extra.clone()),
        _ => None,
    }
}

fn is_required(node: &Value, key: &str) -> bool {
    node.get("required")
        .and_then(Value::as_array)
        .is_some_and(|r| r.iter().any(|n| n.as_str() == Some(key)))
}

/// Every field of `doc` (below the root, `_id` excepted) with its schema node.
fn slots(doc: &Document, node: &Value, prefix: &[Step], out: &mut Vec<Slot>) {
    for (key, value) in doc {
        if prefix.is_empty() && key == "_id" {
            continue;
        }
        let Some(sub) = property_node(node, key) else {
            continue;
        };
        let mut path = prefix.to_vec();
        path.push(Step::Key(key.clone()));
        descend(value, &sub, &path, out);
        out.push(Slot {
            path,
            required: is_required(node, key),
            node: sub,
        });
    }
}

fn descend(value: &Bson, node: &Value, path: &[Step], out: &mut Vec<Slot>) {
    let node = &alternative_of(node, value);
    match value {
        Bson::Document(inner) => slots(inner, node, path, out),
        Bson::Array(items) => {
            if let Some(item_node @ Value::Object(_)) = node.get("items") {
                for (i, item) in items.iter().enumerate() {
                    let mut at = path.to_vec();
                    at.push(Step::Index(i));
                    descend(item, item_node, &at, out);
                    out.push(Slot {
                        path: at,
                        required: true,
                        node: item_node.clone(),
                    });
                }
            }
        }
        _ => {}
    }
}

fn at_mut<'a>(root: &'a mut Bson, path: &[Step]) -> Option<&'a mut Bson> {
    let mut here = root;
    for step in path {
        here = match (step, here) {
            (Step::Key(k), Bson::Document(d)) => d.get_mut(k)?,
            (Step::Index(i), Bson::Array(a)) => a.get_mut(*i)?,
            _ => return None,
        };
    }
    Some(here)
}

fn remove_at(root: &mut Bson, path: &[Step]) {
    let Some((last, parent)) = path.split_last() else {
        return;
    };
    if let (Some(Bson::Document(d)), Step::Key(k)) = (at_mut(root, parent), last) {
        d.remove(k);
    }
}

fn other_values() -> Vec<Bson> {
    vec![
        Bson::String("wrong".into()),
        Bson::Int64(5),
        Bson::Int32(5),
        Bson::Double(5.5),
        Bson::Boolean(true),
        Bson::Null,
        Bson::DateTime(DateTime::from_millis(1_600_000_000_000)),
        Bson::ObjectId(ObjectId::new()),
        Bson::Document(doc! { "k": 1 }),
        Bson::Array(vec![Bson::Int32(1)]),
    ]
}

/// Breaks `doc` (valid for `schema`) in one way; returns what was done.
fn break_one(doc: &mut Document, schema: &Value, rng: &mut rand::rngs::StdRng) -> &'static str {
    let mut all = Vec::new();
    slots(doc, schema, &[], &mut all);
    let mut root = Bson::Document(std::mem::take(doc));
    let kind = rng.random_range(0..8);
    let picked = if all.is_empty() {
        None
    } else {
        Some(&all[rng.random_range(0..all.len())])
    };
    let what = match (kind, picked) {
        (0, Some(slot)) => {
            let values = other_values();
            if let Some(v) = at_mut(&mut root, &slot.path) {
                *v = values[rng.random_range(0..values.len())].clone();
            }
            "wrong bsonType"
        }
        (1, _) => {
            let required: Vec<&Slot> = all
                .iter()
                .filter(|s| s.required && matches!(s.path.last(), Some(Step::Key(_))))
                .collect();
            if let Some(slot) = required.get(rng.random_range(0..required.len().max(1))) {
                remove_at(&mut root, &slot.path);
            } else if let Bson::Document(d) = &mut root {
                d.remove("_schema");
            }
            "missing required"
        }
        (2, _) => {
            let objects: Vec<&Slot> = all
                .iter()
                .filter(|s| matches!(at_mut(&mut root.clone(), &s.path), Some(Bson::Document(_))))
                .collect();
            if !objects.is_empty() && rng.random_bool(0.5) {
                let slot = objects[rng.random_range(0..objects.len())];
                if let Some(Bson::Document(d)) = at_mut(&mut root, &slot.path) {
                    d.insert("zz_extra", 1);
                }
            } else if let Bson::Document(d) = &mut root {
                d.insert("zz_extra", 1);
            }
            "extra property"
        }
        (3, Some(slot)) => {
            let node = &slot.node;
            let replacement = if let Some(min) = number(node, "minimum") {
                Some(Bson::Int64(min as i64 - 1 - rng.random_range(0..5)))
            } else if let Some(max) = number(node, "maximum") {
                Some(Bson::Int64(max as i64 + 1))
            } else if let Some(max) = count(node, "maxLength") {
                Some(Bson::String("\u{e9}".repeat(max + 1)))
            } else if let Some(min) = count(node, "minLength") {
                Some(Bson::String("a".repeat(min.saturating_sub(1))))
            } else {
                count(node, "maxItems")
                    .map(|max| Bson::Array(vec![Bson::String("t".into()); max + 1]))
            };
            if let (Some(v), Some(target)) = (replacement, at_mut(&mut root, &slot.path)) {
                *target = v;
            }
            "out of bounds"
        }
        (4, Some(slot)) => {
            let values = other_values();
            if let Some(Bson::Array(items)) = at_mut(&mut root, &slot.path) {
                items.push(values[rng.random_range(0..values.len())].clone());
            } else if let Some(v) = at_mut(&mut root, &slot.path) {
                *v = Bson::Array(vec![values[rng.random_range(0..values.len())].clone()]);
            }
            "wrong item type"
        }
        (5, Some(slot)) => {
            if let Some(v) = at_mut(&mut root, &slot.path) {
                *v = match v.clone() {
                    Bson::Int64(n) if rng.random_bool(0.5) => Bson::Int32(n as i32),
                    Bson::Int64(n) => Bson::Double(n as f64),
                    Bson::Int32(n) => Bson::Int64(i64::from(n)),
                    Bson::Double(f) => Bson::Int64(f as i64),
                    _ => Bson::Double(1.0),
                };
            }
            "int / long / double"
        }
        (6, Some(slot)) => {
            if let Some(v) = at_mut(&mut root, &slot.path) {
                *v = Bson::Null;
            }
            "null for a value"
        }
        (7, Some(slot)) => {
            if let Some(v) = at_mut(&mut root, &slot.path) {
                *v = Bson::String("not-in-the-enum".into());
            }
            "outside the enum"
        }
        _ => {
            if let Bson::Document(d) = &mut root {
                d.insert("zz_extra", Bson::Null);
            }
            "extra property"
        }
    };
    if let Bson::Document(d) = root {
        *doc = d;
    }
    what
}

/// The `_id` a generated document gets: unique (`i` keeps it so) and of the type the schema
/// wants, or, where the schema allows one value only (the registry's format document), that
/// value: such a document is judged alone (`true`).
fn unique_id(schema: &Value, drawn: &Document, i: usize) -> (Bson, bool) {
    let node = alternative_of(schema, &Bson::Document(drawn.clone()))
        .get("properties")
        .and_then(|p| p.get("_id"))
        .cloned()
        .unwrap_or(Value::Null);
    if let Some(Value::Array(only)) = node.get("enum") {
        if let [one] = only.as_slice() {
            return (Bson::try_from(one.clone()).expect("an enum value"), true);
        }
    }
    if let Some(pattern) = node.get("pattern").and_then(Value::as_str) {
        // The registry's ids: `collection:` and any name after it, or `instance:` and 24 hex
        // digits, made unique by `i` in either case.
        let id = match pattern.strip_suffix('$') {
            None => format!("{}c{i}", pattern.trim_start_matches('^')),
            Some(_) if pattern.contains("[0-9a-f]{24}") => {
                format!(
                    "{}{i:024x}",
                    pattern
                        .trim_start_matches('^')
                        .split('[')
                        .next()
                        .unwrap_or("")
                )
            }
            Some(_) => panic!("no unique ids for the pattern {pattern}"),
        };
        return (Bson::String(id), false);
    }
    let id = match types_of(&node).first().map(String::as_str) {
        Some("objectId") => Bson::ObjectId(ObjectId::new()),
        Some("int") => Bson::Int32(i as i32),
        Some("long") => Bson::Int64(i as i64),
        Some("double") => Bson::Double(i as f64),
        // A compound `_id`: each of its required properties made unique by `i` (a string, a
        // date, a long).
        Some("object") => {
            let mut id = Document::new();
            for (key, sub) in node["properties"].as_object().into_iter().flatten() {
                if !is_required(&node, key) {
                    continue;
                }
                let value = match types_of(sub).first().map(String::as_str) {
                    Some("date") => Bson::DateTime(DateTime::from_millis(i as i64)),
                    Some("long") => Bson::Int64(i as i64),
                    _ => Bson::String(format!("s{i}")),
                };
                id.insert(key.clone(), value);
            }
            Bson::Document(id)
        }
        _ => Bson::String(format!("id{i}")),
    };
    (id, false)
}

// ---------------------------------------------------------------------------------------------
// The check
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn mongotx_and_the_server_judge_every_generated_document_alike() {
    let t = TestDb::new().await;
    let mut totals = BTreeMap::new();
    for (n, (name, text)) in SCHEMAS.iter().enumerate() {
        let schema_json: Value = serde_json::from_str(text).expect("schema JSON");
        let ours = JsonSchema::parse(name, text).expect("mongotx parses the schema");
        let coll_name = format!("agree_{name}");
        t.db.run_command(doc! {
            "create": &coll_name,
            "validator": { "$jsonSchema": ours.to_document() },
        })
        .await
        .unwrap_or_else(|e| panic!("{name}: the server refused the schema: {e}"));

        let strategy = valid(&schema_json, 0);
        let mut runner = TestRunner::new_with_rng(
            Config::default(),
            TestRng::from_seed(RngAlgorithm::ChaCha, &[n as u8 + 1; 32]),
        );
        let mut rng = rand::rngs::StdRng::seed_from_u64(n as u64 + 7);
        let mut documents = Vec::with_capacity(PER_SCHEMA);
        let mut broken_kinds = Vec::with_capacity(PER_SCHEMA);
        let mut judged_alone = Vec::with_capacity(PER_SCHEMA);
        for i in 0..PER_SCHEMA {
            let Bson::Document(mut doc) =
                strategy.new_tree(&mut runner).expect("generate").current()
            else {
                panic!("{name}: the root strategy made no document");
            };
            let (id, alone) = unique_id(&schema_json, &doc, i);
            let shape = alternative_of(&schema_json, &Bson::Document(doc.clone()));
            doc.insert("_id", id);
            judged_alone.push(alone);
            let kind = if i % 2 == 1 {
                break_one(&mut doc, &shape, &mut rng)
            } else {
                "unbroken"
            };
            // The server stores `_id` first; compare the same document on both sides.
            let mut ordered = doc! { "_id": doc.get("_id").cloned().unwrap_or(Bson::Null) };
            for (k, v) in doc {
                if k != "_id" {
                    ordered.insert(k, v);
                }
            }
            documents.push(ordered);
            broken_kinds.push(kind);
        }

        let mut accepted = 0;
        let mut refused = 0;
        let mut disagreements = Vec::new();
        for (chunk_no, chunk) in documents.chunks(BATCH).enumerate() {
            let alone = &judged_alone[chunk_no * BATCH..chunk_no * BATCH + chunk.len()];
            let server_refused = server_judges(&t.db, &coll_name, chunk, alone)
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            for (i, doc) in chunk.iter().enumerate() {
                let ours_refused = ours.validate(doc).is_err();
                if ours_refused {
                    refused += 1;
                } else {
                    accepted += 1;
                }
                if ours_refused != server_refused[i] {
                    let at = chunk_no * BATCH + i;
                    disagreements.push(format!(
                        "{} ({}): mongotx {}, server {}: {doc}",
                        at,
                        broken_kinds[at],
                        if ours_refused { "refuses" } else { "accepts" },
                        if server_refused[i] {
                            "refuses"
                        } else {
                            "accepts"
                        },
                    ));
                }
            }
        }
        println!(
            "{name}: {} documents, {} agreeing decisions ({accepted} accepted, {refused} refused), {} disagreements",
            documents.len(),
            documents.len() - disagreements.len(),
            disagreements.len()
        );
        assert!(
            disagreements.is_empty(),
            "{name}: the validators disagree on {} documents, the first: {:#?}",
            disagreements.len(),
            &disagreements[..disagreements.len().min(5)]
        );
        assert!(
            accepted >= PER_SCHEMA / 4 && refused >= PER_SCHEMA / 4,
            "{name}: {accepted} accepted, {refused} refused"
        );
        totals.insert(*name, documents.len());
    }
    assert_eq!(totals.len(), SCHEMAS.len());
    assert!(totals.values().all(|n| *n >= 2000));
}

/// Which of `docs` the server's validator on `coll` refuses: inserted together, but for those
/// `alone` (one value of `_id` for all of them), each inserted by itself and removed again.
async fn server_judges(
    db: &mongodb::Database,
    coll: &str,
    docs: &[Document],
    alone: &[bool],
) -> Result<Vec<bool>, String> {
    let refusal = |error: &Document| {
        let code = error.get_i32("code").unwrap_or_default();
        if code == 121 {
            Ok(())
        } else {
            Err(format!("not a validation failure: {error}"))
        }
    };
    let together: Vec<usize> = (0..docs.len()).filter(|i| !alone[*i]).collect();
    let mut refused = vec![false; docs.len()];
    let batch: Vec<Document> = together.iter().map(|i| docs[*i].clone()).collect();
    if !batch.is_empty() {
        let reply = db
            .run_command(doc! { "insert": coll, "documents": batch, "ordered": false })
            .await
            .map_err(|e| format!("insert: {e}"))?;
        if let Ok(errors) = reply.get_array("writeErrors") {
            for error in errors.iter().filter_map(Bson::as_document) {
                refusal(error)?;
                let index = error.get_i32("index").map_err(|e| e.to_string())? as usize;
                refused[together[index]] = true;
            }
        }
    }
    for i in (0..docs.len()).filter(|i| alone[*i]) {
        let reply = db
            .run_command(doc! { "insert": coll, "documents": [docs[i].clone()] })
            .await
            .map_err(|e| format!("insert: {e}"))?;
        match reply.get_array("writeErrors").ok().and_then(|e| e.first()) {
            Some(Bson::Document(error)) => {
                refusal(error)?;
                refused[i] = true;
            }
            _ => {
                let id = docs[i].get("_id").cloned().unwrap_or(Bson::Null);
                db.collection::<Document>(coll)
                    .delete_one(doc! { "_id": id })
                    .await
                    .map_err(|e| format!("delete: {e}"))?;
            }
        }
    }
    Ok(refused)
}

#[test]
fn every_schema_file_is_checked() {
    let mut on_disk: Vec<String> =
        std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/schemas"))
            .expect("schemas/")
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_suffix(".json"))
                    .map(str::to_string)
            })
            .collect();
    on_disk.sort();
    let checked: Vec<String> = SCHEMAS.iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(
        on_disk, checked,
        "a schema in schemas/ is missing from the differential check"
    );
}
