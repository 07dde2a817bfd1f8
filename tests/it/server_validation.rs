//! The server-side validators mongotx installs (`ServerValidation::Auto`, the default, wherever
//! the server enforces them, as MongoDB and the local test server do): the server refuses a raw
//! write of an invalid document, while every kind of write mongotx makes passes (plain writes and
//! tombstones, transaction holds and their undo, fences and placeholders, GC rollback and finish,
//! upgrades of older documents, and every domain module's collections); a refusal reaches the
//! caller as a typed error naming the collection, the id and the field; and a new schema version
//! replaces the validator without refusing a valid write of either version.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{Account, TestDb};
use bson::{doc, Bson, Document};
use futures::future::join_all;
use mongodb::Database;
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::TxnOptions;
use mongotx::testkit::failpoint::{CrashAt, Failpoint, APPLY_BEFORE, BEGIN_BEFORE, COMMIT_AFTER};
use mongotx::{fields, Adjust, CollectionSpec, RepoError, Store, Transactions, TxnError, Update};
use serde::{Deserialize, Serialize};

/// The validator the server holds for `collection`, if any.
async fn validator_of(db: &Database, collection: &str) -> Option<Document> {
    let listed = db
        .run_command(doc! { "listCollections": 1, "filter": { "name": collection } })
        .await
        .expect("listCollections");
    listed
        .get_document("cursor")
        .ok()?
        .get_array("firstBatch")
        .ok()?
        .iter()
        .filter_map(Bson::as_document)
        .find(|c| c.get_str("name").ok() == Some(collection))?
        .get_document("options")
        .ok()?
        .get_document("validator")
        .ok()
        .cloned()
}

/// The code of a raw insert's write error, if it was refused.
async fn raw_insert_code(db: &Database, collection: &str, document: Document) -> Option<i32> {
    let reply = db
        .run_command(doc! { "insert": collection, "documents": [document] })
        .await
        .expect("insert command");
    reply
        .get_array("writeErrors")
        .ok()?
        .first()?
        .as_document()?
        .get_i32("code")
        .ok()
}

/// Leaves a transaction behind: its coordinator stops for good at `point` (deadline an hour
/// away), after staging `stage`.
async fn stranded<F, Fut>(store: &Store, point: &'static str, step: usize, stage: F)
where
    F: FnOnce(mongotx::Transaction) -> Fut,
    Fut: std::future::Future<Output = Result<(), TxnError>>,
{
    let txns = Transactions::with_options(
        store,
        TxnOptions::default()
            .timeout(Duration::from_secs(3600))
            .finish(mongotx::options::Finish::BeforeReturning)
            .fault_injector(Arc::new(CrashAt(Failpoint { name: point, step }))),
    );
    let tx = txns.begin();
    stage(tx.clone()).await.expect("stage");
    match tx.commit().await {
        Err(TxnError::Crashed { .. }) => {}
        other => panic!("the coordinator should stop at {point}, got {other:?}"),
    }
}

/// A few GC rounds as if two hours had passed: every stranded transaction is decided and cleared.
async fn gc_rounds(gc: &Gc) {
    for _ in 0..4 {
        gc.run_round_at(
            common::hours_from_now(2).to_chrono(),
            &AtomicBool::new(false),
        )
        .await
        .expect("GC round");
    }
}

#[tokio::test]
async fn the_server_refuses_a_raw_invalid_write_and_passes_every_write_mongotx_makes() {
    let t = TestDb::new().await;
    let caps = common::capabilities().await;
    assert!(
        caps.json_schema_validation,
        "the test server must enforce validators: {caps:?}"
    );
    let accounts = common::open_accounts(&t.store).await;
    let validator = validator_of(&t.db, "accounts").await.expect("a validator");
    assert!(validator.to_string().contains("$jsonSchema"), "{validator}");

    // The server itself refuses what mongotx would refuse on the client.
    assert_eq!(
        raw_insert_code(
            &t.db,
            "accounts",
            doc! { "_id": "raw", "owner": "R", "balance": "lots", fields::SCHEMA_VERSION: 1_i64, fields::VERSION: 1_i64 },
        )
        .await,
        Some(121)
    );

    // Plain writes, a tombstone and its purge.
    common::seed_accounts(
        &accounts,
        &[("a", 100), ("b", 100), ("c", 100), ("gone", 1)],
    )
    .await;
    let a = accounts.get("a").await.expect("get");
    let v = accounts
        .update(
            "a",
            a.version,
            &Update::new().set("note", "n").set("currency", "EUR"),
        )
        .await
        .expect("update");
    let v = accounts
        .adjust("a", v, &Adjust::new().by("balance", 5_i64))
        .await
        .expect("adjust");
    accounts
        .replace("a", v, &Account::new("a", "A2", 105))
        .await
        .expect("replace");
    let gone = accounts.get("gone").await.expect("get");
    accounts.delete("gone", gone.version).await.expect("delete");
    tokio::time::sleep(Duration::from_millis(300)).await;
    accounts
        .purge_tombstones(Duration::ZERO)
        .await
        .expect("purge");

    // A transaction of every action.
    let txns = Transactions::new(&t.store);
    let (a, b, c) = (
        accounts.get("a").await.unwrap(),
        accounts.get("b").await.unwrap(),
        accounts.get("c").await.unwrap(),
    );
    let tx = txns.begin();
    tx.insert(&accounts, &Account::new("d", "D", 7))
        .await
        .expect("insert");
    tx.update(&accounts, "a", a.version, &Update::new().unset("note"))
        .await
        .expect("update");
    tx.adjust(
        &accounts,
        "b",
        b.version,
        &Adjust::new().by("balance", -1_i64),
    )
    .await
    .expect("adjust");
    tx.check(&accounts, "c", c.version).expect("check");
    tx.commit().await.expect("commit");
    let d = accounts.get("d").await.unwrap();
    let tx = txns.begin();
    tx.delete(&accounts, "d", d.version).expect("delete");
    tx.commit().await.expect("delete commit");

    // Holds left by dead coordinators: one before its applies all landed (a placeholder fence
    // for the insert that never arrived, then a rollback), one before its record (a hold the GC
    // undoes), one after its commit point (a finish).
    let b = accounts.get("b").await.unwrap();
    stranded(&t.store, APPLY_BEFORE, 1, |tx| {
        let accounts = accounts.clone();
        async move {
            tx.adjust(
                &accounts,
                "b",
                b.version,
                &Adjust::new().by("balance", 3_i64),
            )
            .await?;
            tx.insert(&accounts, &Account::new("e", "E", 1)).await?;
            Ok(())
        }
    })
    .await;
    let c = accounts.get("c").await.unwrap();
    stranded(&t.store, BEGIN_BEFORE, 0, |tx| {
        let accounts = accounts.clone();
        async move {
            tx.update(
                &accounts,
                "c",
                c.version,
                &Update::new().set("note", "pending"),
            )
            .await?;
            Ok(())
        }
    })
    .await;
    let gc = Gc::new(&t.store, GcOptions::default());
    gc_rounds(&gc).await;
    let b2 = accounts.get("b").await.unwrap();
    stranded(&t.store, COMMIT_AFTER, 0, |tx| {
        let accounts = accounts.clone();
        async move {
            tx.adjust(
                &accounts,
                "b",
                b2.version,
                &Adjust::new().by("balance", 10_i64),
            )
            .await?;
            Ok(())
        }
    })
    .await;
    gc_rounds(&gc).await;
    common::assert_settled(&t, &["accounts"], "after the GC").await;
    assert_eq!(accounts.get("b").await.unwrap().balance, 109);
    assert_eq!(accounts.get("c").await.unwrap().note, None);
    assert!(matches!(
        accounts.get("e").await,
        Err(RepoError::NotFound { .. })
    ));

    // The domain modules' collections, each with its validator.
    use mongotx::obt::{Fence, MongoFence, NewObt, Obt};
    use mongotx::queue::{Batches, NewBatch};
    use mongotx::quota::{NewProvider, Quota, Request};
    use mongotx::ratelimit::{Limit, Priority, RateLimits};
    let quota = Quota::open(&t.store).await.expect("quota");
    quota
        .create(NewProvider::new(("p/1", "cores"), 8))
        .await
        .expect("provider");
    quota
        .consume(&Request::new("vm").take(("p/1", "cores"), 2))
        .await
        .expect("consume");
    quota.release("vm").await.expect("release");
    let obt = Obt::open(&t.store).await.expect("obt");
    let owned = obt.create(NewObt::new("res", "o1")).await.expect("create");
    let fence = MongoFence::open(&t.store).await.expect("fence");
    fence.admit("res", owned.token).await.expect("admit");
    let taken = obt.preempt("res", "o1", "o2").await.expect("preempt");
    fence.admit("res", taken.token).await.expect("admit");
    obt.release_owned(&taken).await.expect("release");
    let limits = RateLimits::open(&t.store).await.expect("limits");
    limits
        .define("api", Limit::new(10, Duration::from_secs(1)))
        .await
        .expect("define");
    let r = limits
        .reserve(&["api"], 2, Priority::Bulk)
        .await
        .expect("reserve");
    limits.settle(&r, 1).await.expect("settle");
    let batches = Batches::open(&t.store).await.expect("batches");
    batches
        .add(&NewBatch::new("svc", "svc/1", "payload"))
        .await
        .expect("add");

    let mut missing = Vec::new();
    for name in t.db.list_collection_names().await.expect("collections") {
        if name == mongotx::collections::TRANSACTIONS_COLLECTION
            || name == mongotx::collections::META_COLLECTION
        {
            continue;
        }
        if validator_of(&t.db, &name).await.is_none() {
            missing.push(name);
        }
    }
    assert!(
        missing.is_empty(),
        "collections without a validator: {missing:?}"
    );
}

#[tokio::test]
async fn a_server_refusal_names_the_collection_the_id_and_the_field() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    // A validator stricter than this code's schema (installed by hand, or by another version).
    t.db.run_command(doc! {
        "collMod": "accounts",
        "validator": { "$jsonSchema": {
            "bsonType": "object",
            "required": ["currency"],
            "properties": { "owner": { "bsonType": "string", "maxLength": 3 } },
        } },
    })
    .await
    .expect("collMod");
    let err = accounts
        .insert(&Account::new("x1", "Al", 1))
        .await
        .expect_err("the server refuses");
    let RepoError::Refused {
        collection,
        id,
        field,
        rule,
        ..
    } = &err
    else {
        panic!("expected Refused, got {err:?}");
    };
    assert_eq!(collection, "accounts");
    assert_eq!(id, "\"x1\"");
    let server =
        t.db.run_command(doc! { "buildInfo": 1 })
            .await
            .expect("buildInfo");
    let major = server
        .get_array("versionArray")
        .ok()
        .and_then(|v| v.first())
        .and_then(Bson::as_i32)
        .unwrap_or(0);
    if major >= 5 {
        assert_eq!(field, "currency", "{err}");
        assert!(rule.contains("required"), "{err}");
        let mut long = Account::new("x2", "Alexandra", 1);
        long.currency = Some("EUR".into());
        let err = accounts.insert(&long).await.expect_err("refused");
        assert!(
            matches!(&err, RepoError::Refused { field, rule, .. } if field == "owner" && rule.contains("maxLength")),
            "{err:?}"
        );
    } else {
        assert_eq!(field, "(document)", "4.4 explains nothing: {err}");
    }
    assert!(err.to_string().contains("accounts"), "{err}");
    assert!(std::error::Error::source(&err).is_some());
    assert!(!err.is_retryable());
}

/// Schema version 1 of profiles: a single `name`.
const PROFILES_V1: &str = r#"{
  "bsonType": "object",
  "required": ["_id", "_schema", "_version", "name"],
  "additionalProperties": false,
  "properties": {
    "_id": { "bsonType": "string", "minLength": 1 },
    "_schema": { "bsonType": "long", "minimum": 1 },
    "_version": { "bsonType": "long", "minimum": 1 },
    "_txn": { "bsonType": "objectId" },
    "_deleted": { "bsonType": "date" },
    "_deleting": { "bsonType": "bool" },
    "name": { "bsonType": "string", "minLength": 1 }
  }
}"#;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct ProfileV1 {
    #[serde(rename = "_id")]
    id: String,
    name: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_schema_version_replaces_the_validator_without_refusing_a_valid_write() {
    let t = TestDb::new().await;
    let v1_spec = || CollectionSpec::new("profiles", 1, PROFILES_V1).expect("v1 spec");
    let old = t
        .store
        .repository::<ProfileV1>(v1_spec())
        .await
        .expect("open v1");
    // Processes of the old version keep writing all through the upgrade.
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicUsize::new(0));
    let writers = (0..4).map(|w| {
        let (old, stop, written) = (old.clone(), Arc::clone(&stop), Arc::clone(&written));
        tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let id = format!("old{w}_{i}");
                old.insert(&ProfileV1 {
                    id: id.clone(),
                    name: format!("Old {i}"),
                })
                .await
                .map_err(|e| format!("a v1 insert was refused: {e}"))?;
                let read = old.get(id.as_str()).await.map_err(|e| e.to_string())?;
                old.update(
                    id.as_str(),
                    read.version,
                    &Update::new().set("name", "Renamed"),
                )
                .await
                .map_err(|e| format!("a v1 update was refused: {e}"))?;
                written.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            Ok::<(), String>(())
        })
    });
    let writers: Vec<_> = writers.collect();
    tokio::time::sleep(Duration::from_millis(150)).await;

    // The new version opens (its validator replaces the old one) and writes.
    let new_store = Store::new(t.db.clone());
    let new = new_store
        .repository::<common::Profile>(common::profiles_spec())
        .await
        .expect("open v2");
    for i in 0..20 {
        new.insert(&common::Profile {
            id: format!("new{i}"),
            given_name: "New".into(),
            family_name: format!("{i}"),
            email: None,
        })
        .await
        .expect("a v2 insert");
    }
    // An old process that restarts late opens its version again: the newer validator stays.
    let late_store = Store::new(t.db.clone());
    late_store
        .repository::<ProfileV1>(v1_spec())
        .await
        .expect("reopen v1");
    for i in 20..40 {
        new.insert(&common::Profile {
            id: format!("new{i}"),
            given_name: "New".into(),
            family_name: format!("{i}"),
            email: None,
        })
        .await
        .expect("a v2 insert after the late v1 open");
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    stop.store(true, Ordering::Relaxed);
    for outcome in join_all(writers).await {
        outcome
            .expect("writer task")
            .expect("no valid write refused");
    }
    assert!(
        written.load(Ordering::Relaxed) > 10,
        "the old writers barely ran"
    );

    // The validator is version 2's: a v2-shaped document breaking v2's schema is refused.
    let validator = validator_of(&t.db, "profiles").await.expect("validator");
    assert!(validator.to_string().contains("given_name"), "{validator}");
    assert_eq!(
        raw_insert_code(
            &t.db,
            "profiles",
            doc! { "_id": "bad", fields::SCHEMA_VERSION: 2_i64, fields::VERSION: 1_i64, "given_name": 5, "family_name": "x" },
        )
        .await,
        Some(121)
    );
}
