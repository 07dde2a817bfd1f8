//! `find` against the server's own answer: generated documents, generated transactions left
//! pending or committed-but-unfinished by coordinators that died, or rolled back by their
//! coordinator (a document moved under them), and generated filters (field conditions, `$in` /
//! `$nin` / `$exists` / null, `$and` / `$or` / `$nor`, `$expr`), with and without sort and limit,
//! each with a generated projection (none, `{_id: 1}` alone, inclusions, exclusions of every
//! field). The expected answer is the same query run by the raw driver on a collection holding
//! exactly the committed values; mongotx's `find` on the held collection must return the same
//! documents, byte for byte (field order included), in the same order, and at the versions an
//! unprojected `find` reads. Some of the documents are
//! plain (written by the raw driver, without system fields, as in a collection being adopted):
//! the transactions that stage changes on them stamp them first, so the collection mixes plain,
//! stamped and held documents.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::common::{CrashAt, TestDb};
use bson::{doc, Bson, Document};
use futures::TryStreamExt;
use mongotx::options::TxnOptions;
use mongotx::testkit::failpoint::{self, Failpoint};
use mongotx::{Adjust, CollectionSpec, Query, Transactions, TxnError, Update};
use proptest::prelude::*;

const SCHEMA: &str = r#"{
  "bsonType": "object",
  "required": ["_id", "_schema", "_version", "a", "b"],
  "properties": {
    "_id": { "bsonType": "string" },
    "_schema": { "bsonType": "long", "minimum": 1 },
    "_version": { "bsonType": "long", "minimum": 1 },
    "_txn": { "bsonType": "objectId" },
    "_deleted": { "bsonType": "date" },
    "_deleting": { "bsonType": "bool" },
    "a": { "bsonType": "long" },
    "b": { "bsonType": "long" },
    "c": { "bsonType": "string" }
  }
}"#;

const DOCS: usize = 10;

#[derive(Debug, Clone)]
enum Op {
    SetA(i64),
    SetC(&'static str),
    UnsetC,
    AdjustB(i64),
    Delete,
}

/// How a generated transaction ends.
#[derive(Debug, Clone, Copy, PartialEq)]
enum End {
    /// Its coordinator dies before writing its record: pending, and never committed.
    Pending,
    /// Its coordinator dies before the commit point: committed, its documents still held.
    Committed,
    /// A document it changes moves under it (to the same values): its coordinator rolls it back.
    RolledBack,
}

#[derive(Debug, Clone)]
struct Txn {
    /// (document index, change); each document in at most one transaction.
    ops: Vec<(usize, Op)>,
    /// A new document it inserts (a, b), if any.
    insert: Option<(i64, i64)>,
    end: End,
}

type Model = BTreeMap<String, Document>;

type Seed = (i64, i64, Option<&'static str>, bool);

fn initial(seed: &[Seed]) -> Model {
    seed.iter()
        .enumerate()
        .map(|(i, (a, b, c, _))| {
            let id = format!("d{i:02}");
            // `c` before the others: a rolled-back unset of it must put it back there.
            let mut d = doc! { "_id": id.clone() };
            if let Some(c) = c {
                d.insert("c", *c);
            }
            d.insert("a", *a);
            d.insert("b", *b);
            (id, d)
        })
        .collect()
}

fn apply(model: &mut Model, k: usize, txn: &Txn) {
    for (i, op) in &txn.ops {
        let id = format!("d{i:02}");
        let Some(d) = model.get_mut(&id) else {
            continue;
        };
        match op {
            Op::SetA(a) => {
                d.insert("a", *a);
            }
            Op::SetC(s) => {
                d.insert("c", *s);
            }
            Op::UnsetC => {
                d.remove("c");
            }
            Op::AdjustB(by) => {
                let b = d.get_i64("b").unwrap_or(0) + by;
                d.insert("b", b);
            }
            Op::Delete => {
                model.remove(&id);
            }
        }
    }
    if let Some((a, b)) = txn.insert {
        let id = format!("n{k}");
        model.insert(id.clone(), doc! { "_id": id, "a": a, "b": b });
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0_i64..5).prop_map(Op::SetA),
        prop_oneof![Just("x"), Just("y")].prop_map(Op::SetC),
        Just(Op::UnsetC),
        (-3_i64..4).prop_map(Op::AdjustB),
        Just(Op::Delete),
    ]
}

fn txns() -> impl Strategy<Value = Vec<Txn>> {
    // Each document goes to one transaction at most: a shuffled list of indexes, cut in pieces.
    (
        Just((0..DOCS).collect::<Vec<_>>()).prop_shuffle(),
        prop::collection::vec(
            (
                1_usize..4,
                prop::collection::vec(op(), 3),
                prop::option::of((0_i64..5, 0_i64..5)),
                prop_oneof![
                    Just(End::Pending),
                    Just(End::Committed),
                    Just(End::RolledBack)
                ],
            ),
            0..4,
        ),
    )
        .prop_map(|(order, specs)| {
            let mut next = 0;
            let mut out = Vec::new();
            for (n, ops, insert, end) in specs {
                let take: Vec<usize> = order.iter().skip(next).take(n).copied().collect();
                next += take.len();
                let ops: Vec<(usize, Op)> = take.into_iter().zip(ops).collect();
                // A rollback needs a document to move under the transaction.
                if ops.is_empty() && (insert.is_none() || end == End::RolledBack) {
                    continue;
                }
                out.push(Txn { ops, insert, end });
            }
            out
        })
}

fn leaf() -> impl Strategy<Value = Document> {
    prop_oneof![
        (0_i64..5).prop_map(|v| doc! { "a": v }),
        (0_i64..5).prop_map(|v| doc! { "a": { "$gt": v } }),
        (-2_i64..7).prop_map(|v| doc! { "b": { "$lte": v } }),
        prop_oneof![Just("x"), Just("y")].prop_map(|s| doc! { "c": s }),
        any::<bool>().prop_map(|e| doc! { "c": { "$exists": e } }),
        Just(doc! { "c": Bson::Null }),
        (0_i64..5, 0_i64..5).prop_map(|(v, w)| doc! { "a": { "$in": [v, w] } }),
        Just(doc! { "c": { "$nin": ["x"] } }),
        Just(doc! { "$expr": { "$gt": ["$a", "$b"] } }),
    ]
}

fn filter() -> impl Strategy<Value = Document> {
    prop_oneof![
        leaf(),
        (leaf(), leaf()).prop_map(|(l, r)| doc! { "$or": [l, r] }),
        (leaf(), leaf()).prop_map(|(l, r)| doc! { "$and": [l, r] }),
        leaf().prop_map(|l| doc! { "$nor": [l] }),
        (leaf(), leaf()).prop_map(|(l, r)| doc! { "$or": [{ "$and": [l, r] }, { "b": 0_i64 }] }),
    ]
}

/// Projections a caller may give: none, `_id` alone, inclusions, exclusions (of every field too).
fn projection() -> impl Strategy<Value = Option<Document>> {
    prop_oneof![
        Just(None),
        Just(Some(doc! { "_id": 1 })),
        Just(Some(doc! { "_id": true })),
        Just(Some(doc! { "a": 1 })),
        Just(Some(doc! { "c": 1, "a": 1 })),
        Just(Some(doc! { "_id": 1, "b": 1 })),
        Just(Some(doc! { "a": 0 })),
        Just(Some(doc! { "c": 0 })),
        Just(Some(doc! { "a": 0, "b": 0, "c": 0 })),
    ]
}

fn seed() -> impl Strategy<Value = Vec<Seed>> {
    prop::collection::vec(
        (
            0_i64..5,
            0_i64..5,
            prop::option::of(prop_oneof![Just("x"), Just("y")]),
            // Written plain by the raw driver, or inserted through mongotx.
            any::<bool>(),
        ),
        DOCS,
    )
}

async fn run_case(
    seed: Vec<Seed>,
    txns: Vec<Txn>,
    filters: Vec<(Document, bool, Option<Document>)>,
) -> Result<(), String> {
    let t = TestDb::new().await;
    let spec = CollectionSpec::new("props", 1, SCHEMA).map_err(|e| e.to_string())?;
    let repo = t
        .store
        .repository::<Document>(spec)
        .await
        .map_err(|e| e.to_string())?;
    let mut model = initial(&seed);
    for (d, (.., plain)) in model.values().zip(&seed) {
        if *plain {
            repo.raw_collection()
                .insert_one(d)
                .await
                .map_err(|e| e.to_string())?;
        } else {
            repo.insert(d).await.map_err(|e| e.to_string())?;
        }
    }
    for (k, txn) in txns.iter().enumerate() {
        // A dead coordinator stops for good: one handle (and injector) per transaction.
        let mut options = TxnOptions::default()
            .timeout(std::time::Duration::from_secs(3600))
            .finish(mongotx::options::Finish::BeforeReturning);
        let at = match txn.end {
            End::Committed => Some(failpoint::COMMIT_BEFORE),
            End::Pending => Some(failpoint::BEGIN_BEFORE),
            End::RolledBack => None,
        };
        if let Some(at) = at {
            options = options.fault_injector(Arc::new(CrashAt(Failpoint { name: at, step: 0 })));
        }
        let handle = Transactions::with_options(&t.store, options);
        let tx = handle.begin();
        for (i, op) in &txn.ops {
            let id = format!("d{i:02}");
            // The version read: a stamped document's, or a plain one's fingerprint.
            let v = repo
                .get(id.as_str())
                .await
                .map_err(|e| format!("read {id}: {e}"))?
                .version;
            let staged = match op {
                Op::SetA(a) => {
                    tx.update(&repo, id.as_str(), v, &Update::new().set("a", *a))
                        .await
                }
                Op::SetC(s) => {
                    tx.update(&repo, id.as_str(), v, &Update::new().set("c", *s))
                        .await
                }
                Op::UnsetC => {
                    tx.update(&repo, id.as_str(), v, &Update::new().unset("c"))
                        .await
                }
                Op::AdjustB(by) => {
                    tx.adjust(&repo, id.as_str(), v, &Adjust::new().by("b", *by))
                        .await
                }
                Op::Delete => tx.delete(&repo, id.as_str(), v),
            };
            staged.map_err(|e| format!("stage {op:?} on {id}: {e}"))?;
        }
        if let Some((a, b)) = txn.insert {
            tx.insert(&repo, &doc! { "_id": format!("n{k}"), "a": a, "b": b })
                .await
                .map_err(|e| e.to_string())?;
        }
        if txn.end == End::RolledBack {
            // The first document it changes moves under it, keeping its values (a stamp for a
            // plain one, a rewrite of the same `a` for a stamped one).
            let (i, _) = &txn.ops[0];
            let id = format!("d{i:02}");
            let now = repo
                .get(id.as_str())
                .await
                .map_err(|e| format!("read {id}: {e}"))?;
            let a = now.value.get_i64("a").map_err(|e| e.to_string())?;
            repo.update(id.as_str(), now.version, &Update::new().set("a", a))
                .await
                .map_err(|e| format!("move {id}: {e}"))?;
            match tx.commit().await {
                Err(e)
                    if e.repo_error().is_some_and(|r| {
                        matches!(r, mongotx::RepoError::VersionConflict { .. })
                    }) => {}
                other => {
                    return Err(format!(
                        "the transaction should have rolled back: {other:?}"
                    ))
                }
            }
            continue;
        }
        match tx.commit().await {
            Err(TxnError::Crashed { .. }) => {}
            other => return Err(format!("the coordinator should have died: {other:?}")),
        }
        if txn.end == End::Committed {
            apply(&mut model, k, txn);
        }
    }
    // The committed values, as plain documents, for the raw driver to query.
    let expected_coll = t.db.collection::<Document>("expected");
    if !model.is_empty() {
        expected_coll
            .insert_many(model.values().cloned().collect::<Vec<_>>())
            .await
            .map_err(|e| e.to_string())?;
    }
    let bytes = |d: &Document| bson::to_vec(d).unwrap_or_default();
    for (filter, sorted, projection) in filters {
        let mut raw = expected_coll.find(filter.clone());
        let mut query = Query::new().filter(filter.clone());
        if sorted {
            raw = raw.sort(doc! { "a": -1, "_id": 1 }).limit(3);
            query = query.sort(doc! { "a": -1, "_id": 1 }).limit(3);
        } else {
            raw = raw.sort(doc! { "_id": 1 });
            query = query.sort(doc! { "_id": 1 });
        }
        // The versions an unprojected find reads, by id.
        let versions: BTreeMap<String, i64> = repo
            .find(query.clone())
            .await
            .map_err(|e| format!("find {filter}: {e}"))?
            .into_iter()
            .map(|s| {
                (
                    s.value.get_str("_id").unwrap_or_default().to_string(),
                    s.version,
                )
            })
            .collect();
        if let Some(projection) = &projection {
            raw = raw.projection(projection.clone());
            query = query.projection(projection.clone());
        }
        let expected: Vec<Document> = raw
            .await
            .map_err(|e| e.to_string())?
            .try_collect()
            .await
            .map_err(|e| e.to_string())?;
        let found = repo
            .find(query)
            .await
            .map_err(|e| format!("find {filter} {projection:?}: {e}"))?;
        let found_docs: Vec<Document> = found.iter().map(|s| s.value.clone()).collect();
        let same = found_docs.len() == expected.len()
            && found_docs
                .iter()
                .zip(&expected)
                .all(|(f, e)| bytes(f) == bytes(e));
        if !same {
            return Err(format!(
                "filter {filter} (sorted and limited: {sorted}, projection {projection:?}):\n  find: {found_docs:?}\n  committed: {expected:?}\n  transactions: {txns:?}"
            ));
        }
        for row in &found {
            let id = row.value.get_str("_id").unwrap_or_default();
            if versions.get(id) != Some(&row.version) {
                return Err(format!(
                    "filter {filter}, projection {projection:?}: {id} read at version {} where an unprojected find reads {:?}",
                    row.version,
                    versions.get(id)
                ));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn find_returns_what_the_server_returns_on_the_committed_values(
        seed in seed(),
        txns in txns(),
        filters in prop::collection::vec((filter(), any::<bool>(), projection()), 8),
    ) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let outcome = runtime.block_on(run_case(seed, txns, filters));
        prop_assert!(outcome.is_ok(), "{}", outcome.err().unwrap_or_default());
    }
}
