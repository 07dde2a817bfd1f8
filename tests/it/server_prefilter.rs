//! The local test server rules documents out of a filter with a prefilter of its own before
//! mongo-java-server's matcher runs (tools/test-server, `Prefilter.java`), so that a clause on a
//! field a document lacks costs what it costs MongoDB: next to nothing. The prefilter may only
//! say "cannot match" where the matcher says so too. This test holds it to that: two local
//! servers, one started with `--no-prefilter`, get the same generated documents (nested documents,
//! arrays of values, of documents and of arrays, nulls, missing fields, strings, ids, numbers) and
//! the same generated filters (equality, `$eq`, `$in`, `$exists`, comparisons, `$ne`, under
//! `$and` / `$or` / `$nor`, on plain, dotted and numeric paths, some malformed), through `find`,
//! an aggregation's leading `$match`, `count`, and `updateMany`; every answer, error or not, must
//! be the same on both.

use bson::{doc, oid::ObjectId, Bson, Document};
use futures::TryStreamExt;
use mongodb::{Client, Collection};
use mongotx::testkit::local_server::LocalServer;
use proptest::prelude::*;

/// Ids the generated values draw from, so that equality on ids can hit.
fn ids() -> [ObjectId; 2] {
    [
        ObjectId::from_bytes([0x65, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]),
        ObjectId::from_bytes([0x65, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]),
    ]
}

fn scalar() -> impl Strategy<Value = Bson> {
    prop_oneof![
        prop_oneof![Just("x"), Just("y"), Just("")].prop_map(Bson::from),
        (0_usize..2).prop_map(|i| Bson::ObjectId(ids()[i])),
        (0_i32..3).prop_map(Bson::Int32),
        (0_i64..3).prop_map(Bson::Int64),
        Just(Bson::Double(1.0)),
        Just(Bson::Null),
        any::<bool>().prop_map(Bson::Boolean),
    ]
}

/// A value up to three levels deep: scalars, documents with fields x / y / 0, arrays of any.
fn value() -> impl Strategy<Value = Bson> {
    scalar().prop_recursive(3, 12, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Bson::Array),
            (
                prop::option::of(inner.clone()),
                prop::option::of(inner.clone()),
                prop::option::of(inner),
            )
                .prop_map(|(x, y, zero)| {
                    let mut d = Document::new();
                    for (k, v) in [("x", x), ("y", y), ("0", zero)] {
                        if let Some(v) = v {
                            d.insert(k, v);
                        }
                    }
                    Bson::Document(d)
                }),
        ]
    })
}

fn document() -> impl Strategy<Value = Document> {
    (
        prop::option::of(value()),
        prop::option::of(value()),
        prop::option::of(scalar()),
    )
        .prop_map(|(a, b, c)| {
            let mut d = Document::new();
            for (k, v) in [("a", a), ("b", b), ("c", c)] {
                if let Some(v) = v {
                    d.insert(k, v);
                }
            }
            d
        })
}

fn path() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("a"),
        Just("b"),
        Just("c"),
        Just("a.x"),
        Just("a.0"),
        Just("a.x.y"),
        Just("b.y"),
        Just("b.0.x"),
        Just("d"),
    ]
    .prop_map(str::to_string)
}

/// One field condition: the value (or operator document) of `{path: condition}`.
fn condition() -> impl Strategy<Value = Bson> {
    prop_oneof![
        3 => scalar(),
        1 => scalar().prop_map(|v| Bson::Document(doc! { "$eq": v })),
        2 => prop::collection::vec(scalar(), 0..3).prop_map(|v| Bson::Document(doc! { "$in": v })),
        2 => any::<bool>().prop_map(|e| Bson::Document(doc! { "$exists": e })),
        1 => scalar().prop_map(|v| Bson::Document(doc! { "$gt": v })),
        1 => scalar().prop_map(|v| Bson::Document(doc! { "$ne": v })),
        1 => (scalar(), any::<bool>()).prop_map(|(v, e)| Bson::Document(doc! { "$in": [v], "$exists": e })),
        1 => value().prop_map(|v| Bson::Document(doc! { "$eq": v })),
        // Malformed: the matcher refuses these while it evaluates.
        1 => Just(Bson::Document(doc! { "$in": "x" })),
        1 => Just(Bson::Document(doc! { "$bogus": 1 })),
    ]
}

fn clause() -> impl Strategy<Value = Document> {
    (path(), condition()).prop_map(|(p, c)| doc! { p: c })
}

fn filter() -> impl Strategy<Value = Document> {
    clause().prop_recursive(3, 10, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 1..4).prop_map(|parts| {
                let mut d = Document::new();
                for part in parts {
                    d.extend(part);
                }
                d
            }),
            prop::collection::vec(inner.clone(), 1..3).prop_map(|p| doc! { "$and": p }),
            prop::collection::vec(inner.clone(), 1..3).prop_map(|p| doc! { "$or": p }),
            prop::collection::vec(inner, 1..3).prop_map(|p| doc! { "$nor": p }),
        ]
    })
}

/// What a server answered for one filter: ids found, a count, or the error's code (messages
/// are left out: the JVM drops the text of an exception it has thrown often at one place).
#[derive(Debug, PartialEq)]
enum Answer {
    Ids(Vec<i32>),
    Count(u64),
    Refused(Option<i32>),
}

fn refused(e: mongodb::error::Error) -> Answer {
    match *e.kind {
        mongodb::error::ErrorKind::Command(c) => Answer::Refused(Some(c.code)),
        mongodb::error::ErrorKind::Write(mongodb::error::WriteFailure::WriteError(w)) => {
            Answer::Refused(Some(w.code))
        }
        _ => Answer::Refused(None),
    }
}

fn ids_of(docs: Vec<Document>) -> Answer {
    let mut ids: Vec<i32> = docs.iter().filter_map(|d| d.get_i32("_id").ok()).collect();
    ids.sort_unstable();
    Answer::Ids(ids)
}

async fn answers(coll: &Collection<Document>, filter: &Document) -> Vec<Answer> {
    let found = match coll.find(filter.clone()).await {
        Ok(cursor) => match cursor.try_collect::<Vec<_>>().await {
            Ok(docs) => ids_of(docs),
            Err(e) => refused(e),
        },
        Err(e) => refused(e),
    };
    let matched = match coll.aggregate([doc! { "$match": filter.clone() }]).await {
        Ok(cursor) => match cursor.try_collect::<Vec<_>>().await {
            Ok(docs) => ids_of(docs),
            Err(e) => refused(e),
        },
        Err(e) => refused(e),
    };
    let counted = match coll.count_documents(filter.clone()).await {
        Ok(n) => Answer::Count(n),
        Err(e) => refused(e),
    };
    let updated = match coll
        .update_many(filter.clone(), doc! { "$inc": { "hits": 1 } })
        .await
    {
        Ok(r) => Answer::Count(r.modified_count),
        Err(e) => refused(e),
    };
    // The update's effect, document by document.
    let hits = match coll.find(doc! { "hits": { "$gt": 0 } }).await {
        Ok(cursor) => match cursor.try_collect::<Vec<_>>().await {
            Ok(docs) => ids_of(docs),
            Err(e) => refused(e),
        },
        Err(e) => refused(e),
    };
    let _ = coll
        .update_many(doc! {}, doc! { "$unset": { "hits": "" } })
        .await;
    vec![found, matched, counted, updated, hits]
}

struct Pair {
    with: Client,
    without: Client,
    // Held for their lifetime: the servers stop when these drop.
    _servers: (LocalServer, LocalServer),
}

async fn pair() -> Pair {
    let (with, without) = tokio::task::spawn_blocking(|| {
        (
            LocalServer::start_with(&[]),
            LocalServer::start_with(&["--no-prefilter".to_string()]),
        )
    })
    .await
    .expect("join");
    let (with, without) = (
        with.expect("the local server starts"),
        without.expect("the local server starts with --no-prefilter"),
    );
    Pair {
        with: Client::with_uri_str(with.uri()).await.expect("client"),
        without: Client::with_uri_str(without.uri()).await.expect("client"),
        _servers: (with, without),
    }
}

#[test]
fn the_prefilter_never_changes_an_answer() {
    // No database of its own, but it loads the machine: a latency test waits for it.
    let _share = crate::common::machine::share();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let servers = runtime.block_on(pair());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 150,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let case = (
        prop::collection::vec(document(), 1..40),
        prop::collection::vec(filter(), 12),
    );
    let ruled_out = std::cell::Cell::new(0_usize);
    let outcome = runner.run(&case, |(docs, filters)| {
        let result: Result<(), String> = runtime.block_on(async {
            let name = format!("c{}", ObjectId::new().to_hex());
            let docs: Vec<Document> = docs
                .into_iter()
                .enumerate()
                .map(|(i, mut d)| {
                    d.insert("_id", i as i32);
                    d
                })
                .collect();
            let a = servers.with.database("prefilter").collection::<Document>(&name);
            let b = servers.without.database("prefilter").collection::<Document>(&name);
            a.insert_many(docs.clone()).await.map_err(|e| e.to_string())?;
            b.insert_many(docs.clone()).await.map_err(|e| e.to_string())?;
            for filter in &filters {
                let (left, right) = (answers(&a, filter).await, answers(&b, filter).await);
                if left != right {
                    return Err(format!(
                        "filter {filter}\n  with the prefilter: {left:?}\n  without: {right:?}\n  documents: {docs:?}"
                    ));
                }
                if matches!(&left[0], Answer::Ids(found) if found.len() < docs.len()) {
                    ruled_out.set(ruled_out.get() + 1);
                }
            }
            let _ = a.drop().await;
            let _ = b.drop().await;
            Ok(())
        });
        result.map_err(TestCaseError::fail)
    });
    if let Err(e) = outcome {
        panic!("the servers disagreed: {e}");
    }
    // The generated filters must exercise the prefilter: most of them leave documents out.
    let ruled_out = ruled_out.get();
    assert!(
        ruled_out > 900,
        "only {ruled_out} of 1,800 filters left documents out"
    );
}
