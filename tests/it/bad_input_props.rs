//! Generated inputs around the edges, through the repository: documents (odd field names, i64
//! and i32 bounds, NaN, infinities, -0.0, empty and long strings, deep nesting, sizes up to and
//! past 16 MB), ids of every type, increments of every numeric type against stored values near
//! the 64-bit bounds, limits, and transaction timeouts. Every call either succeeds and reads
//! back exactly what the caller meant, or fails with a typed error that says what was wrong and
//! leaves the collection as it was. A `Database` error (the server's refusal passed through)
//! counts as a failure of the property: a bad input must be caught and named by mongotx.

use crate::common;

use std::cell::Cell;
use std::time::Duration;

use crate::common::TestDb;
use bson::{doc, spec::BinarySubtype, Binary, Bson, Document};
use mongotx::options::TxnOptions;
use mongotx::{Adjust, CollectionSpec, Query, RepoError, Repository, TxnError};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const LOOSE: &str = r#"{
  "bsonType": "object",
  "required": ["_id", "_schema", "_version"],
  "properties": {
    "_id": { "bsonType": ["string", "int", "long", "double", "objectId"] },
    "_schema": { "bsonType": "long", "minimum": 1 },
    "_version": { "bsonType": "long", "minimum": 1 },
    "_txn": { "bsonType": "objectId" },
    "_deleted": { "bsonType": "date" },
    "_deleting": { "bsonType": "bool" },
    "n": { "bsonType": ["long", "int", "double"] }
  }
}"#;

/// Every document of every non-empty collection (a collection the server created on the way and
/// left empty holds nothing a caller could see).
async fn snapshot(db: &mongodb::Database) -> std::collections::BTreeMap<String, Vec<Document>> {
    let mut all = common::refusals::snapshot(db).await;
    all.retain(|_, docs| !docs.is_empty());
    all
}

/// `value`'s Debug text, cut to 300 characters (a 16 MB string would flood the output).
fn short(value: &impl std::fmt::Debug) -> String {
    let text = format!("{value:?}");
    match text.char_indices().nth(300) {
        Some((at, _)) => format!("{}... ({} characters)", &text[..at], text.len()),
        None => text,
    }
}

/// Fails the test with the property's message only (not the generated input, which may be huge).
fn passed(outcome: Result<(), proptest::test_runner::TestError<impl std::fmt::Debug>>) {
    match outcome {
        Ok(()) => {}
        Err(proptest::test_runner::TestError::Fail(reason, input)) => {
            panic!("{reason}\ninput: {}", short(&input))
        }
        Err(e) => panic!("{}", short(&e)),
    }
}

/// The refusals a bad input may get: each names what was wrong.
fn typed_refusal(e: &RepoError) -> bool {
    matches!(
        e,
        RepoError::Invalid { .. }
            | RepoError::SystemField { .. }
            | RepoError::InvalidId { .. }
            | RepoError::InvalidIncrement { .. }
            | RepoError::InvalidQuery { .. }
            | RepoError::Encode { .. }
            | RepoError::DuplicateId { .. }
    )
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => "[a-z]{1,8}",
        1 => Just(String::new()),
        1 => "\\$[a-z]{1,4}",
        1 => "[a-z]{1,3}\\.[a-z]{1,3}",
        1 => Just("_version".to_string()),
        1 => Just("_mongotx_x".to_string()),
        1 => "[α-ω]{1,4}",
        1 => "[a-z]{200,300}",
    ]
}

fn scalar() -> impl Strategy<Value = Bson> {
    prop_oneof![
        any::<i32>().prop_map(Bson::Int32),
        prop_oneof![Just(i32::MIN), Just(i32::MAX), Just(0), Just(-1)].prop_map(Bson::Int32),
        any::<i64>().prop_map(Bson::Int64),
        prop_oneof![Just(i64::MIN), Just(i64::MAX), Just(i64::MAX - 1), Just(0)]
            .prop_map(Bson::Int64),
        any::<f64>().prop_map(Bson::Double),
        prop_oneof![
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(-0.0),
            Just(f64::MIN_POSITIVE / 2.0),
            Just(f64::MAX)
        ]
        .prop_map(Bson::Double),
        "\\PC{0,12}".prop_map(Bson::String),
        Just(Bson::String(String::new())),
        any::<bool>().prop_map(Bson::Boolean),
        Just(Bson::Null),
        prop::collection::vec(any::<u8>(), 0..16).prop_map(|bytes| Bson::Binary(Binary {
            subtype: BinarySubtype::Generic,
            bytes
        })),
    ]
}

fn value() -> impl Strategy<Value = Bson> {
    scalar().prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Bson::Array),
            prop::collection::vec((name(), inner), 0..4)
                .prop_map(|fields| { Bson::Document(fields.into_iter().collect()) }),
        ]
    })
}

/// A value nested `depth` documents deep.
fn nested(depth: usize) -> Bson {
    let mut value = Bson::Int32(1);
    for _ in 0..depth {
        value = Bson::Document(doc! { "d": value });
    }
    value
}

fn document() -> impl Strategy<Value = Document> {
    (
        prop::collection::vec((name(), value()), 0..6),
        prop_oneof![
            8 => Just(None),
            1 => (90_usize..110).prop_map(Some),
        ],
        prop_oneof![
            12 => Just(0_usize),
            1 => Just(16 * 1024 * 1024 - 200),
            1 => Just(16 * 1024 * 1024 + 1),
        ],
    )
        .prop_map(|(fields, depth, big)| {
            let mut d: Document = fields.into_iter().collect();
            if let Some(depth) = depth {
                d.insert("deep", nested(depth));
            }
            if big > 0 {
                d.insert("big", "x".repeat(big));
            }
            d
        })
}

fn id() -> impl Strategy<Value = Bson> {
    prop_oneof![
        6 => "[a-z0-9]{1,12}".prop_map(Bson::String),
        1 => Just(Bson::String(String::new())),
        1 => "[a-z]{1100,1200}".prop_map(Bson::String),
        1 => any::<i32>().prop_map(Bson::Int32),
        1 => any::<i64>().prop_map(Bson::Int64),
        1 => any::<f64>().prop_map(Bson::Double),
        1 => Just(Bson::Null),
        1 => Just(Bson::Array(vec![Bson::Int32(1)])),
        1 => Just(Bson::Document(doc! { "$gt": 1 })),
        1 => Just(Bson::ObjectId(bson::oid::ObjectId::new())),
    ]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

async fn open(t: &TestDb, name: &str) -> Repository<Document> {
    t.store
        .repository::<Document>(CollectionSpec::new(name, 1, LOOSE).expect("spec"))
        .await
        .expect("open")
}

/// Byte-exact comparison (so NaN equals NaN and -0.0 differs from 0.0), field order included.
fn same(a: &Document, b: &Document) -> bool {
    bson::to_vec(a).ok() == bson::to_vec(b).ok()
}

/// Inserted documents read back exactly, or are refused with a typed error and nothing stored.
#[test]
fn documents_are_stored_exactly_or_refused_cleanly() {
    let rt = runtime();
    let (t, repo) = rt.block_on(async {
        let t = TestDb::new().await;
        let repo = open(&t, "docs").await;
        (t, repo)
    });
    let n = Cell::new(0_u64);
    let accepted = Cell::new(0_u32);
    let refused = Cell::new(0_u32);
    let outcome = runner(200).run(&(document(), id()), |(mut value, id)| {
        n.set(n.get() + 1);
        value.insert("_id", id.clone());
        rt.block_on(async {
            let before = snapshot(&t.db).await;
            match repo.insert(&value).await {
                Ok(stored_id) => {
                    accepted.set(accepted.get() + 1);
                    let read = repo
                        .get(stored_id.clone())
                        .await
                        .map_err(|e| TestCaseError::fail(format!("read back {stored_id}: {e}")))?;
                    let mut expected = value.clone();
                    let mut found = read.value;
                    expected.remove("_id");
                    found.remove("_id");
                    prop_assert!(
                        same(&expected, &found),
                        "stored {}\nread back {}",
                        short(&expected),
                        short(&found)
                    );
                    prop_assert_eq!(read.version, 1);
                    // Keep the collection small for the snapshots of later cases.
                    t.db.collection::<Document>("docs")
                        .delete_one(doc! { "_id": stored_id })
                        .await
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                Err(e) => {
                    refused.set(refused.get() + 1);
                    prop_assert!(
                        typed_refusal(&e),
                        "case {}: untyped refusal: {}",
                        n.get(),
                        short(&e)
                    );
                    prop_assert!(!e.to_string().is_empty());
                    prop_assert!(
                        snapshot(&t.db).await == before,
                        "refused ({}) but wrote",
                        short(&e)
                    );
                }
            }
            Ok(())
        })
    });
    passed(outcome);
    // The generator must reach both sides.
    let (accepted, refused) = (accepted.get(), refused.get());
    assert!(
        accepted > 20 && refused > 20,
        "{accepted} accepted, {refused} refused"
    );
}

/// Increments of every numeric type against stored numbers near the bounds: the stored result is
/// the exact sum in the type MongoDB gives it, or the adjust is refused with a typed error and
/// nothing written; the same through a transaction.
#[test]
fn increments_add_exactly_or_are_refused_cleanly() {
    let rt = runtime();
    let (t, repo) = rt.block_on(async {
        let t = TestDb::new().await;
        let repo = open(&t, "amounts").await;
        (t, repo)
    });
    let stored = prop_oneof![
        prop_oneof![
            Just(i64::MAX),
            Just(i64::MAX - 3),
            Just(i64::MIN),
            Just(i64::MIN + 3),
            Just(0_i64)
        ]
        .prop_map(Bson::Int64),
        any::<i64>().prop_map(Bson::Int64),
        prop_oneof![Just(i32::MAX), Just(i32::MIN), Just(5_i32)].prop_map(Bson::Int32),
        prop_oneof![Just(1.5_f64), Just(f64::MAX), Just(-0.0)].prop_map(Bson::Double),
    ];
    let amount = prop_oneof![
        prop_oneof![
            Just(1_i64),
            Just(-1),
            Just(i64::MAX),
            Just(i64::MIN),
            Just(4),
            Just(-4)
        ]
        .prop_map(Bson::Int64),
        any::<i64>().prop_map(Bson::Int64),
        prop_oneof![Just(i32::MAX), Just(i32::MIN), Just(1_i32)].prop_map(Bson::Int32),
        prop_oneof![
            Just(0.5_f64),
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::MAX)
        ]
        .prop_map(Bson::Double),
        Just(Bson::String("1".into())),
    ];
    let k = Cell::new(0_u64);
    let (added, refused) = (Cell::new(0_u32), Cell::new(0_u32));
    let outcome = runner(300).run(&(stored, amount, any::<bool>()), |(start, by, in_txn)| {
        k.set(k.get() + 1);
        let id = format!("a{}", k.get());
        rt.block_on(async {
            repo.insert(&doc! { "_id": &id, "n": start.clone() })
                .await
                .map_err(|e| TestCaseError::fail(format!("seed {start}: {e}")))?;
            let before = snapshot(&t.db).await;
            let adjust = Adjust::new().by("n", by.clone());
            // Err(typed, what): typed when the refusal names the bad increment.
            let named = |e: &RepoError| {
                matches!(
                    e,
                    RepoError::Invalid { .. } | RepoError::InvalidIncrement { .. }
                )
            };
            let result: Result<(), (bool, String)> = if in_txn {
                let tx = mongotx::Transactions::with_options(
                    &t.store,
                    TxnOptions::default().finish(mongotx::options::Finish::BeforeReturning),
                )
                .begin();
                match tx.adjust(&repo, id.as_str(), 1, &adjust).await {
                    Ok(()) => tx
                        .commit()
                        .await
                        .map(|_| ())
                        .map_err(|e| (false, format!("commit: {e:?}"))),
                    Err(e) => Err((e.repo_error().is_some_and(named), format!("{e:?}"))),
                }
            } else {
                repo.adjust(id.as_str(), 1, &adjust)
                    .await
                    .map(|_| ())
                    .map_err(|e| (named(&e), format!("{e:?}")))
            };
            let expected = mongotx_sum(&start, &by);
            match (result, expected) {
                (Ok(()), Some(sum)) => {
                    added.set(added.get() + 1);
                    let read = repo
                        .get(id.as_str())
                        .await
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let found = read.value.get("n").cloned().unwrap_or(Bson::Null);
                    prop_assert!(
                        bson::to_vec(&doc! { "v": found.clone() }).ok()
                            == bson::to_vec(&doc! { "v": sum.clone() }).ok(),
                        "{start} + {by} (txn {in_txn}): stored {found:?}, expected {sum:?}"
                    );
                }
                (Ok(()), None) => {
                    return Err(TestCaseError::fail(format!(
                        "{start} + {by} (txn {in_txn}) was accepted, but has no exact result"
                    )))
                }
                (Err((typed, e)), _) => {
                    refused.set(refused.get() + 1);
                    prop_assert!(typed, "{start} + {by} (txn {in_txn}): {e}");
                    prop_assert!(
                        snapshot(&t.db).await == before,
                        "refused ({}) but wrote",
                        short(&e)
                    );
                }
            }
            Ok(())
        })
    });
    passed(outcome);
    let (added, refused) = (added.get(), refused.get());
    assert!(
        added > 30 && refused > 30,
        "{added} added, {refused} refused"
    );
}

/// What MongoDB stores for `start + by` in a field the schema allows as long, int or double:
/// int + int overflowing becomes a long, long overflow is an error, a double anywhere gives a
/// double; `None` where there is no exact result to store (overflow, NaN or an infinity given as
/// the amount, a string).
fn mongotx_sum(start: &Bson, by: &Bson) -> Option<Bson> {
    let as_f64 = |v: &Bson| match v {
        Bson::Int32(x) => Some(f64::from(*x)),
        Bson::Int64(x) => Some(*x as f64),
        Bson::Double(x) => Some(*x),
        _ => None,
    };
    match (start, by) {
        (_, Bson::Double(d)) if !d.is_finite() => None,
        (Bson::Int32(x), Bson::Int32(y)) => Some(
            x.checked_add(*y)
                .map(Bson::Int32)
                .unwrap_or(Bson::Int64(i64::from(*x) + i64::from(*y))),
        ),
        (Bson::Int32(x), Bson::Int64(y)) => i64::from(*x).checked_add(*y).map(Bson::Int64),
        (Bson::Int64(x), Bson::Int32(y)) => x.checked_add(i64::from(*y)).map(Bson::Int64),
        (Bson::Int64(x), Bson::Int64(y)) => x.checked_add(*y).map(Bson::Int64),
        (a, b) => Some(Bson::Double(as_f64(a)? + as_f64(b)?)),
    }
}

/// Limits of every size: a negative one is refused, any other returns at most that many.
#[test]
fn limits_bound_the_results_or_are_refused() {
    let rt = runtime();
    let repo = rt.block_on(async {
        let t = TestDb::new().await;
        let repo = open(&t, "limits").await;
        for i in 0..7 {
            repo.insert(&doc! { "_id": format!("l{i}"), "n": i as i64 })
                .await
                .expect("seed");
        }
        (t, repo)
    });
    let limit = prop_oneof![any::<i64>(), -3_i64..10, Just(i64::MIN), Just(i64::MAX)];
    let outcome = runner(100).run(&limit, |limit| {
        rt.block_on(async {
            let found = repo
                .1
                .find(Query::new().limit(limit).sort(doc! { "n": 1 }))
                .await;
            match found {
                Ok(rows) => {
                    prop_assert!(limit >= 0, "limit {limit} accepted");
                    let want = if limit == 0 { 7 } else { limit.min(7) as usize };
                    prop_assert_eq!(rows.len(), want, "limit {}", limit);
                }
                Err(e) => {
                    prop_assert!(limit < 0, "limit {limit}: {e:?}");
                    prop_assert!(matches!(e, RepoError::InvalidQuery { .. }), "{e:?}");
                }
            }
            Ok(())
        })
    });
    passed(outcome);
}

/// Transaction timeouts from zero to absurd: a commit either succeeds or is refused with a typed
/// error before it writes, and never panics.
#[test]
fn transaction_timeouts_of_any_size_commit_or_are_refused() {
    let rt = runtime();
    let (t, repo) = rt.block_on(async {
        let t = TestDb::new().await;
        let repo = open(&t, "timeouts").await;
        (t, repo)
    });
    let timeout = prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::from_nanos(1)),
        Just(Duration::MAX),
        Just(Duration::from_secs(u64::MAX / 2)),
        (0_u64..10_000_000).prop_map(Duration::from_millis),
        any::<u64>().prop_map(Duration::from_secs),
    ];
    let k = Cell::new(0_u64);
    let outcome = runner(60).run(&timeout, |timeout| {
        k.set(k.get() + 1);
        rt.block_on(async {
            let before = snapshot(&t.db).await;
            let tx = mongotx::Transactions::with_options(
                &t.store,
                TxnOptions::default()
                    .timeout(timeout)
                    .finish(mongotx::options::Finish::BeforeReturning),
            )
            .begin();
            let id = format!("t{}", k.get());
            let staged = tx.insert(&repo, &doc! { "_id": &id, "n": 1_i64 }).await;
            let committed = match staged {
                Ok(_) => tx.commit().await.map(|_| ()),
                Err(e) => Err(e),
            };
            match committed {
                Ok(()) => {
                    let read = repo
                        .get(id.as_str())
                        .await
                        .map_err(|e| TestCaseError::fail(format!("{timeout:?}: {e}")))?;
                    prop_assert_eq!(read.value.get_i64("n").ok(), Some(1));
                }
                Err(e) => {
                    prop_assert!(
                        !matches!(
                            e,
                            TxnError::Database { .. }
                                | TxnError::Crashed { .. }
                                | TxnError::CommitUnknown { .. }
                                | TxnError::Malformed { .. }
                        ),
                        "timeout {timeout:?}: {e:?}"
                    );
                    prop_assert!(
                        snapshot(&t.db).await == before,
                        "refused ({}) but wrote",
                        short(&e)
                    );
                }
            }
            Ok(())
        })
    });
    passed(outcome);
}
