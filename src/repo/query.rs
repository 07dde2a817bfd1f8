//! Queries evaluated on committed values.
//!
//! A held document stores its transaction's post-image, which is not committed until the commit
//! point; its committed value is the pre-image its hold describes (or nothing, for an insert), or
//! the stored document once its transaction is known to have committed. Filter, sort and limit
//! must see committed values, so they run in an aggregation that computes each candidate's
//! committed value on the server. A query is at most two such passes, with the holders' outcomes
//! read in between:
//!
//! 1. **Holders** ([`holders_pass`]): the free live documents matching the filter, sorted and
//!    limited, and, for every held document that can match (its stored value or its pre-image:
//!    see [`either_image`]), just its id and holder. Held documents that cannot match are never
//!    read, so the cost does not depend on what is held elsewhere. No held candidate: the free
//!    documents are the answer (one command).
//! 2. The holders' outcomes, in one batch (`HoldResolver::statuses`: one command for their
//!    records, one per collection for the participants of staging ones).
//! 3. **Values** ([`values_pass`]): every candidate becomes its committed value (the stored one
//!    for holders known to have committed, the pre-image for every other), then the filter, sort
//!    and limit run on those.
//!
//! A holder the second pass meets that the first did not report put its hold there after the
//! first pass read that document, so the pre-image was the committed value then, during the call:
//! every result is a value that was committed at some moment during the call (read committed per
//! document), and nothing waits for a holder or fails because of one.

use bson::{doc, oid::ObjectId, Bson, Document};

use crate::repo::fields;
use crate::repo::hold::held::{self as hold, ALWAYS_UNSET};

/// Field the first pass adds to tell free documents (1) from held candidates (0).
pub(crate) const KNOWN_TAG: &str = "_mongotx_known";

/// Field the second pass adds to a held document whose hold cannot be read.
pub(crate) const UNREADABLE_TAG: &str = "_mongotx_unreadable";

/// Top-level names a caller's filter or sort may not use: they describe holds, not values.
pub(crate) const HIDDEN: [&str; 4] = [
    fields::ACTIVE_TXN,
    fields::HOLD,
    fields::DELETING,
    fields::DELETED,
];

/// Why a filter, sort or limit cannot be evaluated on committed values, if it cannot.
pub(crate) fn problem(
    filter: &Document,
    sort: Option<&Document>,
    limit: Option<i64>,
) -> Option<String> {
    if let Some(limit) = limit.filter(|l| *l < 0) {
        return Some(format!("the limit {limit} is negative"));
    }
    if let Some((path, operator)) = javascript(&Bson::Document(filter.clone()), "") {
        return Some(format!(
            "the filter uses `{operator}` at `{path}`, which runs JavaScript on the server; \
             filters that may come from a service's clients never do"
        ));
    }
    if let Some(reason) = shape_problem(filter) {
        return Some(reason);
    }
    if let Some((key, value)) = sort
        .into_iter()
        .flat_map(|s| s.iter())
        .find(|(_, order)| !is_order(order))
    {
        return Some(format!(
            "the sort gives `{key}` the order {value}; orders are 1 (ascending) or -1 (descending)"
        ));
    }
    if let Some(name) = names(filter).find(|n| HIDDEN.contains(n) || n.starts_with("_mongotx")) {
        return Some(format!(
            "the filter names `{name}`, which describes transaction state; queries see committed values only"
        ));
    }
    if let Some(name) = sort
        .into_iter()
        .flat_map(|s| s.keys())
        .map(|k| k.split('.').next().unwrap_or(k))
        .find(|n| HIDDEN.contains(n) || n.starts_with("_mongotx"))
    {
        return Some(format!(
            "the sort names `{name}`, which describes transaction state"
        ));
    }
    None
}

/// The operators that run JavaScript on the server.
const JAVASCRIPT: [&str; 3] = ["$where", "$function", "$accumulator"];

/// The first operator in `value` (at any depth: inside `$expr`, `$elemMatch`, arrays and
/// documents) that runs JavaScript on the server, with the path it sits at.
fn javascript(value: &Bson, at: &str) -> Option<(String, String)> {
    let under = |key: &str| {
        if at.is_empty() {
            key.to_string()
        } else {
            format!("{at}.{key}")
        }
    };
    match value {
        Bson::Document(doc) => doc.iter().find_map(|(key, inner)| {
            if JAVASCRIPT.contains(&key.as_str()) {
                let path = if at.is_empty() {
                    "(top level)".to_string()
                } else {
                    at.to_string()
                };
                return Some((path, key.clone()));
            }
            javascript(inner, &under(key))
        }),
        Bson::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, item)| javascript(item, &under(&i.to_string()))),
        _ => None,
    }
}

/// Query operators a field condition may use (MongoDB's, less the geospatial ones that need a
/// special index or cannot run inside an aggregation).
const FIELD_OPERATORS: [&str; 20] = [
    "$eq",
    "$ne",
    "$gt",
    "$gte",
    "$lt",
    "$lte",
    "$in",
    "$nin",
    "$exists",
    "$type",
    "$regex",
    "$options",
    "$not",
    "$elemMatch",
    "$size",
    "$all",
    "$mod",
    "$bitsAllSet",
    "$bitsAnySet",
    "$bitsAllClear",
];

/// Why a filter is malformed, if it is: an operator MongoDB does not know or that cannot run on
/// committed values (`$where`, `$text`, `$near`), or an operator given the wrong kind of
/// argument. Checked here so that every server refuses the same filters with the same typed
/// error, before anything is sent (servers differ in what they check and how they say it).
fn shape_problem(filter: &Document) -> Option<String> {
    for (key, value) in filter {
        let problem = match key.as_str() {
            "$and" | "$or" | "$nor" => match value.as_array() {
                Some(items) if !items.is_empty() => items.iter().find_map(|item| match item {
                    Bson::Document(inner) => shape_problem(inner),
                    other => Some(format!("`{key}` lists {other}, which is not a filter")),
                }),
                _ => Some(format!(
                    "`{key}` takes a non-empty array of filters, not {value}"
                )),
            },
            "$expr" | "$comment" => None,
            "$jsonSchema" => (!matches!(value, Bson::Document(_)))
                .then(|| format!("`$jsonSchema` takes a schema document, not {value}")),
            "$where" | "$text" => Some(format!(
                "`{key}` cannot be evaluated on committed values (it needs the stored documents)"
            )),
            name if name.starts_with('$') => Some(format!("unknown operator `{name}`")),
            name => field_problem(name, value),
        };
        if problem.is_some() {
            return problem;
        }
    }
    None
}

/// Why the condition on field `name` is malformed, if it is.
fn field_problem(name: &str, condition: &Bson) -> Option<String> {
    let Bson::Document(operators) = condition else {
        return None;
    };
    if !operators.keys().next().is_some_and(|k| k.starts_with('$')) {
        return None; // equality with a document
    }
    for (operator, argument) in operators {
        let wrong = |wants: &str| {
            Some(format!(
                "`{operator}` on `{name}` takes {wants}, not {argument}"
            ))
        };
        let problem = match operator.as_str() {
            "$in" | "$nin" | "$all" if !matches!(argument, Bson::Array(_)) => wrong("an array"),
            "$not" if !matches!(argument, Bson::Document(_) | Bson::RegularExpression(_)) => {
                wrong("an operator document or a regular expression")
            }
            "$not" => match argument {
                Bson::Document(inner) => field_problem(name, &Bson::Document(inner.clone())),
                _ => None,
            },
            "$elemMatch" if !matches!(argument, Bson::Document(_)) => wrong("a document"),
            "$size"
                if argument
                    .as_i64()
                    .or(argument.as_i32().map(i64::from))
                    .is_none() =>
            {
                wrong("a whole number")
            }
            "$mod" if !matches!(argument, Bson::Array(items) if items.len() == 2) => {
                wrong("[divisor, remainder]")
            }
            known if FIELD_OPERATORS.contains(&known) => None,
            unknown if unknown.starts_with('$') => {
                Some(format!("unknown operator `{unknown}` on `{name}`"))
            }
            other => Some(format!(
                "`{name}` mixes operators with the plain field `{other}`"
            )),
        };
        if problem.is_some() {
            return problem;
        }
    }
    None
}

/// Whether a sort value is 1 or -1, of any numeric type.
fn is_order(value: &Bson) -> bool {
    match value {
        Bson::Int32(n) => n.abs() == 1,
        Bson::Int64(n) => n.abs() == 1,
        Bson::Double(d) => d.abs() == 1.0,
        _ => false,
    }
}

/// Every field name a filter mentions at its top level or inside `$and` / `$or` / `$nor`.
fn names(filter: &Document) -> Box<dyn Iterator<Item = &str> + '_> {
    Box::new(filter.iter().flat_map(|(key, value)| {
        let nested: Box<dyn Iterator<Item = &str>> = match (key.as_str(), value) {
            ("$and" | "$or" | "$nor", Bson::Array(items)) => Box::new(
                items
                    .iter()
                    .filter_map(|item| item.as_document())
                    .flat_map(names),
            ),
            (name, _) if !name.starts_with('$') => {
                Box::new(std::iter::once(name.split('.').next().unwrap_or(name)))
            }
            _ => Box::new(std::iter::empty()),
        };
        nested
    }))
}

/// The most held candidates a limited first pass reports beyond the limit; with more than this
/// many, their holders are read apart, once each ([`holders_of`]).
pub(crate) const HOLDER_BATCH: i64 = 1_000;

/// A filter that every held document matches whose stored value or pre-image matches `filter`
/// (a superset: the exact test runs on the committed value later).
///
/// The pre-image differs from the stored document only in the top-level fields of the hold's
/// `restore` (set back) and `unset` (removed), so a field's pre-image value is either its stored
/// value, its `_hold.restore` copy, or missing (and then the restore copy is missing too). A
/// condition on a field therefore holds on the pre-image only if it holds on the stored field or
/// on the restore copy. Conditions that cannot be moved that way (`$expr`, `$jsonSchema`, `$nor`
/// and other top-level operators) are left out, which only widens the superset.
pub(crate) fn either_image(filter: &Document) -> Document {
    let mut clauses: Vec<Document> = Vec::new();
    for (key, value) in filter {
        let branches = || -> Option<Vec<Document>> {
            let items = value.as_array()?;
            items
                .iter()
                .map(|item| item.as_document().map(either_image))
                .collect()
        };
        match key.as_str() {
            "$and" => {
                if let Some(parts) = branches() {
                    clauses.extend(parts.into_iter().filter(|p| !p.is_empty()));
                }
            }
            "$or" => {
                if let Some(parts) = branches() {
                    if !parts.is_empty() && parts.iter().all(|p| !p.is_empty()) {
                        let parts: Vec<Bson> = parts.into_iter().map(Bson::Document).collect();
                        clauses.push(doc! { "$or": parts });
                    }
                }
            }
            name if !name.starts_with('$') => {
                let restored = format!("{}.restore.{name}", fields::HOLD);
                clauses.push(doc! { "$or": [
                    { name: value.clone() },
                    { restored: value.clone() },
                ] });
            }
            _ => {}
        }
    }
    match clauses.len() {
        0 => Document::new(),
        1 => clauses.pop().unwrap_or_default(),
        _ => doc! { "$and": clauses },
    }
}

/// The top-level fields `filter` depends on, if it depends on named fields only (field
/// conditions under `$and`, `$or` and `$nor`); `None` if it may read any field (`$expr`,
/// `$jsonSchema`, `$where`, `$text` and the like).
fn depends_on(filter: &Document) -> Option<Vec<String>> {
    let mut found = Vec::new();
    for (key, value) in filter {
        match key.as_str() {
            "$and" | "$or" | "$nor" => {
                for item in value.as_array()? {
                    found.extend(depends_on(item.as_document()?)?);
                }
            }
            "$comment" => {}
            name if name.starts_with('$') => return None,
            name => found.push(name.split('.').next().unwrap_or(name).to_string()),
        }
    }
    Some(found)
}

/// What the first `$match` of every pass keeps: documents whose stored value matches `filter`
/// (free and live, or held), and held documents whose pre-image can match it where the stored
/// value does not. Those changed a field the filter depends on, which their hold lists
/// (`_hold.changed`, indexed), so held documents that cannot match are never looked at; a filter
/// that may read any field looks at every held document instead.
fn candidate_filter(filter: &Document) -> Document {
    let pre_image_differs = match depends_on(filter) {
        Some(names) => doc! { hold::CHANGED_PATH: { "$in": names } },
        None => doc! { fields::ACTIVE_TXN: { "$exists": true } },
    };
    doc! { "$or": [
        { "$and": [filter.clone(), fields::live_filter()] },
        { "$and": [pre_image_differs, either_image(filter)] },
    ] }
}

/// The `$match` of both passes (see [`candidate_filter`]).
fn candidates(filter: &Document) -> Document {
    doc! { "$match": candidate_filter(filter) }
}

fn holder() -> Document {
    doc! { "$ifNull": [format!("${}", fields::ACTIVE_TXN), Bson::Null] }
}

/// The first pass: the answer if nothing that can match is held, and otherwise the holders of
/// the held candidates (each as `{_id, _txn, KNOWN_TAG: 0}`, sorted first, at most
/// [`HOLDER_BATCH`] beyond a limit).
pub(crate) fn holders_pass(
    filter: &Document,
    sort: Option<&Document>,
    limit: Option<i64>,
) -> Vec<Document> {
    let mut stages = vec![
        candidates(filter),
        doc! { "$addFields": { KNOWN_TAG: { "$cond": [{ "$eq": [holder(), Bson::Null] }, 1, 0] } } },
    ];
    match (sort, limit) {
        (sort, Some(limit)) => {
            let mut sort_by = doc! { KNOWN_TAG: 1 };
            if let Some(sort) = sort {
                sort_by.extend(sort.clone());
            }
            stages.push(doc! { "$sort": sort_by });
            stages.push(doc! { "$limit": limit.saturating_add(HOLDER_BATCH) });
        }
        (Some(sort), None) => stages.push(doc! { "$sort": sort.clone() }),
        (None, None) => {}
    }
    // A held candidate's value is not needed yet, only its holder.
    stages.push(doc! { "$replaceRoot": { "newRoot": { "$cond": [
        { "$eq": [format!("${KNOWN_TAG}"), 0] },
        { "_id": "$_id", fields::ACTIVE_TXN: format!("${}", fields::ACTIVE_TXN), KNOWN_TAG: 0 },
        "$$ROOT",
    ] } } });
    stages
}

/// Every holder of a held document that can match `filter`, once each (`{_id: holder}`): the
/// first pass's complement when it was filled with held candidates before it reached them all.
pub(crate) fn holders_of(filter: &Document) -> Vec<Document> {
    vec![
        doc! { "$match": { "$and": [
            { fields::ACTIVE_TXN: { "$exists": true } },
            candidate_filter(filter),
        ] } },
        doc! { "$group": { "_id": format!("${}", fields::ACTIVE_TXN) } },
    ]
}

/// The second pass: `filter`, `sort` and `limit` on committed values, the stored value standing
/// for documents held by a transaction in `committed` and the pre-image for every other hold.
pub(crate) fn values_pass(
    filter: &Document,
    sort: Option<&Document>,
    limit: Option<i64>,
    committed: &[ObjectId],
) -> Vec<Document> {
    let committed: Vec<Bson> = committed.iter().map(|t| Bson::ObjectId(*t)).collect();
    let always_unset: Vec<Bson> = ALWAYS_UNSET.iter().map(|s| Bson::from(*s)).collect();
    // A hold whose parts are not of their types (a document mongotx cannot read) must not fail
    // the whole pass: its restore counts as empty and its unset list as empty, and the document
    // is refused by name when it is decoded, if it matches.
    let restore = format!("${}.restore", fields::HOLD);
    let unset = format!("${}.unset", fields::HOLD);
    // A hold that records the document's field order (`_hold.order`: its change removed a
    // field) reads in that order: merged onto a document of those names, the pre-image's fields
    // take their places (every name of the order is in the pre-image).
    let order = format!("${}.order", fields::HOLD);
    let skeleton = doc! { "$arrayToObject": { "$map": {
        "input": { "$cond": [{ "$isArray": order.as_str() }, order.as_str(), []] },
        "as": "name",
        "in": { "k": "$$name", "v": Bson::Null },
    } } };
    let pre_image = doc! {
        "$cond": [
            { "$eq": [format!("${}.op", fields::HOLD), "insert"] },
            { "_id": "$_id", fields::DELETED: true },
            { "$mergeObjects": [skeleton, { "$arrayToObject": { "$filter": {
                "input": { "$objectToArray": { "$mergeObjects": [
                    "$$ROOT",
                    { "$cond": [is_object(&restore), restore.as_str(), {}] },
                ] } },
                "as": "field",
                "cond": { "$not": [{ "$in": [
                    "$$field.k",
                    { "$concatArrays": [
                        { "$cond": [{ "$isArray": unset.as_str() }, unset.as_str(), []] },
                        always_unset,
                    ] },
                ] }] },
            } } }] },
        ]
    };
    let mut stages = vec![
        candidates(filter),
        doc! { "$replaceRoot": { "newRoot": {
            "$cond": [
                { "$eq": [holder(), Bson::Null] },
                "$$ROOT",
                { "$cond": [
                    // A hold that cannot be read: matched on the stored value, and refused by
                    // name when decoded.
                    { "$not": [is_object(&format!("${}", fields::HOLD))] },
                    { "$mergeObjects": ["$$ROOT", { UNREADABLE_TAG: true }] },
                    // A fence never carries a change: it reads as the document it sits on, or
                    // as nothing; nor does a creation the server stamped after the deadline
                    // (see `Hold::never_commits`).
                    { "$cond": [
                        { "$or": [
                            { "$not": [{ "$in": [holder(), committed] }] },
                            { "$eq": [format!("${}.fence", fields::HOLD), true] },
                            { "$gt": [
                                format!("${}", hold::AT_PATH),
                                format!("${}.exp", fields::HOLD),
                            ] },
                        ] },
                        pre_image,
                        "$$ROOT",
                    ] },
                ] },
            ]
        } } },
        doc! { "$match": { "$and": [
            filter.clone(),
            fields::live_filter(),
            { fields::DELETING: { "$exists": false } },
        ] } },
    ];
    if let Some(sort) = sort {
        stages.push(doc! { "$sort": sort.clone() });
    }
    if let Some(limit) = limit {
        stages.push(doc! { "$limit": limit });
    }
    stages
}

/// Whether the value at `path` (a `$` field path) is an embedded document, as an aggregation
/// expression: documents sort after strings and before arrays in MongoDB's order of BSON types,
/// and `{}` and `[]` are the least of each (servers before 4.4 lack nothing this needs).
fn is_object(path: &str) -> Bson {
    Bson::Document(doc! { "$and": [
        { "$gte": [path, {}] },
        { "$lt": [path, []] },
    ] })
}

/// The holder a first-pass row reports, if it is a held candidate.
pub(crate) fn unknown_holder(result: &Document) -> Option<ObjectId> {
    match result.get(KNOWN_TAG) {
        Some(Bson::Int32(0)) | Some(Bson::Int64(0)) => {
            result.get_object_id(fields::ACTIVE_TXN).ok()
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_on_transaction_state_are_refused() {
        assert!(problem(
            &doc! { "balance": { "$gt": 5 } },
            Some(&doc! { "owner": 1 }),
            Some(3)
        )
        .is_none());
        assert!(problem(&doc! { "_version": 3 }, None, None).is_none());
        assert!(problem(&doc! { "_txn": { "$exists": true } }, None, None).is_some());
        assert!(problem(
            &doc! { "$or": [{ "a": 1 }, { "_hold.op": "insert" }] },
            None,
            None
        )
        .is_some());
        assert!(problem(&doc! {}, Some(&doc! { "_deleted": 1 }), None).is_some());
        assert!(problem(&doc! {}, None, Some(-1)).is_some());
        assert!(problem(&doc! {}, Some(&doc! { "a": 2 }), None).is_some());
        assert!(problem(&doc! {}, Some(&doc! { "a": "up" }), None).is_some());
        assert!(problem(&doc! {}, Some(&doc! { "a": -1_i64, "b": 1.0 }), None).is_none());
        for bad in [
            doc! { "a": { "$bogus": 1 } },
            doc! { "$bogus": [] },
            doc! { "a": { "$in": 5 } },
            doc! { "$or": [] },
            doc! { "$and": [1] },
            doc! { "$where": "1" },
            doc! { "a": { "$not": { "$in": 1 } } },
            doc! { "a": { "$gt": 1, "b": 2 } },
        ] {
            assert!(problem(&bad, None, None).is_some(), "{bad}");
        }
        for good in [
            doc! { "a": { "$in": [1], "$nin": [] }, "b": { "c": 1 } },
            doc! { "$or": [{ "a": 1 }], "$expr": { "$gt": ["$a", 1] } },
            doc! { "a": { "$not": { "$gt": 1 } }, "t": { "$size": 2 } },
        ] {
            assert!(problem(&good, None, None).is_none(), "{good}");
        }
    }

    #[test]
    fn javascript_is_refused_at_any_depth() {
        for bad in [
            doc! { "$where": "this.a > 1" },
            doc! { "$and": [{ "a": 1 }, { "$where": "true" }] },
            doc! { "$expr": { "$function": { "body": "function() { return true }", "args": [], "lang": "js" } } },
            doc! { "$expr": { "$and": [true, { "$eq": [{ "$accumulator": {} }, 1] }] } },
            doc! { "a": { "$elemMatch": { "$where": "1" } } },
            doc! { "$nor": [{ "$expr": { "$gt": [{ "$function": {} }, 1] } }] },
        ] {
            let reason = problem(&bad, None, None).unwrap_or_default();
            assert!(reason.contains("JavaScript"), "{bad}: {reason}");
        }
        assert!(problem(&doc! { "$expr": { "$gt": ["$a", 1] } }, None, None).is_none());
        assert!(problem(&doc! { "note": "$where" }, None, None).is_none());
    }

    #[test]
    fn the_first_pass_sorts_held_candidates_first_and_leaves_room_for_them() {
        let stages = holders_pass(&doc! { "n": 1 }, Some(&doc! { "n": -1 }), Some(3));
        assert_eq!(stages.len(), 5);
        assert_eq!(stages[2], doc! { "$sort": { KNOWN_TAG: 1, "n": -1 } });
        assert_eq!(stages[3], doc! { "$limit": 3 + HOLDER_BATCH });
        assert_eq!(holders_pass(&doc! {}, None, None).len(), 3);
        let last = values_pass(&doc! { "n": 1 }, Some(&doc! { "n": -1 }), Some(3), &[]);
        assert_eq!(last.len(), 5);
        assert_eq!(last[4], doc! { "$limit": 3_i64 });
    }

    #[test]
    fn either_image_moves_field_conditions_onto_the_restore_copy() {
        assert_eq!(
            either_image(&doc! { "a.b": { "$gt": 1 } }),
            doc! { "$or": [{ "a.b": { "$gt": 1 } }, { "_hold.restore.a.b": { "$gt": 1 } }] }
        );
        let both = either_image(&doc! { "a": 1, "$or": [{ "b": 2 }, { "c": 3 }] });
        assert_eq!(both.get_array("$and").map(Vec::len), Ok(2));
        // What cannot be moved widens the filter instead of narrowing it.
        assert_eq!(
            either_image(&doc! { "$expr": { "$gt": ["$a", 1] } }),
            doc! {}
        );
        assert_eq!(either_image(&doc! { "$nor": [{ "a": 1 }] }), doc! {});
        assert_eq!(
            either_image(&doc! { "$or": [{ "a": 1 }, { "$expr": true }] }),
            doc! {}
        );
    }

    #[test]
    fn unknown_holders_are_read_from_the_tag() {
        let t = ObjectId::new();
        assert_eq!(unknown_holder(&doc! { KNOWN_TAG: 0, "_txn": t }), Some(t));
        assert_eq!(unknown_holder(&doc! { KNOWN_TAG: 1, "_txn": t }), None);
        assert_eq!(unknown_holder(&doc! { KNOWN_TAG: 1 }), None);
    }
}
