//! Queries evaluated on committed values.
//!
//! A held document stores its transaction's post-image, which is not committed until the commit
//! point; its committed value is the pre-image its hold describes (or nothing, for an insert), or
//! the stored document once its transaction is known to have committed. Filter, sort and limit
//! must see committed values, so they cannot simply run on what is stored. Instead one
//! aggregation computes the committed value of every candidate on the server and evaluates the
//! caller's filter, sort and limit on that:
//!
//! 1. `$match`: free live documents matching the filter, and every held document (a held one may
//!    match on its committed value even where the stored value does not);
//! 2. `$replaceRoot`: documents held by transactions known not to have committed become their
//!    pre-image (merge `_hold.restore`, drop `_hold.unset`, `_txn`, `_hold`, `_deleting`); a
//!    pending insert becomes an absent marker;
//! 3. `$match`: the filter on the committed values, live and not a committed delete, plus every
//!    document held by a transaction whose state is not known yet (tagged);
//! 4. `$sort` (tagged first, then the caller's sort) and `$limit`.
//!
//! If tagged documents come back, their transactions' records are read, the transactions join the
//! known sets, and the query runs again; untagged results are final. Each run reads each document
//! once, atomically, so every result is a value that was committed at some moment during the call.

use bson::{doc, oid::ObjectId, Bson, Document};

use crate::repo::fields;
use crate::repo::hold::ALWAYS_UNSET;

/// Field the pipeline adds to tell results apart from held documents of unknown state.
pub(crate) const KNOWN_TAG: &str = "_mongotx_known";

/// Top-level names a caller's filter or sort may not use: they describe holds, not values.
const HIDDEN: [&str; 4] = [
    fields::ACTIVE_TXN,
    fields::HOLD,
    fields::DELETING,
    fields::DELETED,
];

/// Why a filter or sort cannot be evaluated on committed values, if it cannot.
pub(crate) fn problem(filter: &Document, sort: Option<&Document>) -> Option<String> {
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

/// The aggregation that evaluates `filter`, `sort` and `limit` on committed values, given the
/// transactions known not to have committed (`pending`) and known to have (`committed`).
pub(crate) fn pipeline(
    filter: &Document,
    sort: Option<&Document>,
    limit: Option<i64>,
    pending: &[ObjectId],
    committed: &[ObjectId],
) -> Vec<Document> {
    let pending: Vec<Bson> = pending.iter().map(|t| Bson::ObjectId(*t)).collect();
    let committed: Vec<Bson> = committed.iter().map(|t| Bson::ObjectId(*t)).collect();
    let mut known = committed.clone();
    known.push(Bson::Null);
    let holder = doc! { "$ifNull": [format!("${}", fields::ACTIVE_TXN), Bson::Null] };
    let always_unset: Vec<Bson> = ALWAYS_UNSET.iter().map(|s| Bson::from(*s)).collect();

    let pre_image = doc! {
        "$cond": [
            { "$eq": [format!("${}.op", fields::HOLD), "insert"] },
            { "_id": "$_id", fields::DELETED: true },
            { "$arrayToObject": { "$filter": {
                "input": { "$objectToArray": { "$mergeObjects": [
                    "$$ROOT",
                    format!("${}.restore", fields::HOLD),
                ] } },
                "as": "field",
                "cond": { "$not": [{ "$in": [
                    "$$field.k",
                    { "$concatArrays": [format!("${}.unset", fields::HOLD), always_unset] },
                ] }] },
            } } },
        ]
    };
    let free_or_committed = doc! { "$or": [
        { fields::ACTIVE_TXN: { "$exists": false } },
        { fields::ACTIVE_TXN: { "$in": committed.clone() } },
    ] };
    let unknown = doc! { fields::ACTIVE_TXN: { "$exists": true, "$nin": committed.clone() } };

    let mut sort_by = doc! { KNOWN_TAG: 1 };
    if let Some(sort) = sort {
        sort_by.extend(sort.clone());
    }
    let mut stages = vec![
        doc! { "$match": { "$or": [
            { "$and": [filter.clone(), fields::live_filter(), { fields::ACTIVE_TXN: { "$exists": false } }] },
            { fields::ACTIVE_TXN: { "$exists": true } },
        ] } },
        doc! { "$replaceRoot": { "newRoot": {
            // A fence never carries a change: it reads as the document it sits on, or as nothing.
            "$cond": [
                { "$or": [
                    { "$in": [holder.clone(), pending] },
                    { "$eq": [format!("${}.fence", fields::HOLD), true] },
                ] },
                pre_image,
                "$$ROOT",
            ]
        } } },
        doc! { "$match": { "$or": [
            { "$and": [
                filter.clone(),
                fields::live_filter(),
                { fields::DELETING: { "$exists": false } },
                free_or_committed,
            ] },
            unknown,
        ] } },
        doc! { "$addFields": { KNOWN_TAG: { "$cond": [{ "$in": [holder, known] }, 1, 0] } } },
        doc! { "$sort": sort_by },
    ];
    if let Some(limit) = limit {
        stages.push(doc! { "$limit": limit });
    }
    stages
}

/// The transaction a result is held by, if its state was not known to the pipeline.
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
            Some(&doc! { "owner": 1 })
        )
        .is_none());
        assert!(problem(&doc! { "_version": 3 }, None).is_none());
        assert!(problem(&doc! { "_txn": { "$exists": true } }, None).is_some());
        assert!(problem(
            &doc! { "$or": [{ "a": 1 }, { "_hold.op": "insert" }] },
            None
        )
        .is_some());
        assert!(problem(&doc! {}, Some(&doc! { "_deleted": 1 })).is_some());
    }

    #[test]
    fn the_pipeline_sorts_unknown_holds_first_and_limits_last() {
        let t = ObjectId::new();
        let stages = pipeline(
            &doc! { "n": 1 },
            Some(&doc! { "n": -1 }),
            Some(3),
            &[t],
            &[],
        );
        assert_eq!(stages.len(), 6);
        assert_eq!(stages[4], doc! { "$sort": { KNOWN_TAG: 1, "n": -1 } });
        assert_eq!(stages[5], doc! { "$limit": 3_i64 });
        assert!(pipeline(&doc! {}, None, None, &[], &[]).len() == 5);
    }

    #[test]
    fn unknown_holders_are_read_from_the_tag() {
        let t = ObjectId::new();
        assert_eq!(unknown_holder(&doc! { KNOWN_TAG: 0, "_txn": t }), Some(t));
        assert_eq!(unknown_holder(&doc! { KNOWN_TAG: 1, "_txn": t }), None);
        assert_eq!(unknown_holder(&doc! { KNOWN_TAG: 1 }), None);
    }
}
