//! Existing data: a collection of plain documents (no system fields, written by the raw driver)
//! read, queried, written and used in transactions through mongotx, which stamps each document
//! at its first write, conditionally on its content being what was read.

use bson::{doc, Bson, Document};
use futures::{StreamExt, TryStreamExt};
use mongotx::{fields, Adjust, Query, RepoError, Transactions, TxnError, Update};

use crate::common::{self, raw_snapshot, Account, TestDb};

/// `n` plain accounts `a000`... written by the raw driver, owner `o<i % 10>`, balance 100.
pub async fn plain_accounts(t: &TestDb, n: usize) -> Vec<Document> {
    let docs: Vec<Document> = (0..n)
        .map(|i| doc! { "_id": format!("a{i:03}"), "owner": format!("o{}", i % 10), "balance": 100_i64 })
        .collect();
    if !docs.is_empty() {
        t.db.collection::<Document>("accounts")
            .insert_many(docs.clone())
            .await
            .unwrap();
    }
    docs
}

#[tokio::test]
async fn a_newcomer_reads_queries_writes_and_transfers_on_plain_documents() {
    let t = TestDb::new().await;
    plain_accounts(&t, 200).await;
    let accounts = common::open_accounts(&t.store).await;

    let a1 = accounts.get("a001").await.unwrap();
    assert!(a1.is_plain(), "{a1:?}");
    assert!(
        a1.version < -1,
        "a plain document reads as a negative fingerprint: {a1:?}"
    );
    assert_eq!((a1.owner.as_str(), a1.balance), ("o1", 100));
    assert_eq!(a1.stored_schema_version, 1);
    // The same content reads as the same version.
    assert_eq!(accounts.get("a001").await.unwrap().version, a1.version);

    let o3 = accounts
        .find(
            Query::new()
                .filter(doc! { "owner": "o3" })
                .sort(doc! { "_id": 1 }),
        )
        .await
        .unwrap();
    assert_eq!(o3.len(), 20);
    assert!(o3.iter().all(|a| a.is_plain() && a.owner == "o3"));
    assert_eq!(accounts.count(Query::new()).await.unwrap(), 200);
    let streamed: Vec<_> = accounts
        .find_stream(Query::new().filter(doc! { "owner": "o3" }))
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(streamed.len(), 20);

    // The first write stamps it: version 1, the change applied, nothing else altered.
    let v = accounts
        .adjust("a001", a1.version, &Adjust::new().by("balance", -10_i64))
        .await
        .unwrap();
    assert_eq!(v, 1);
    let raw =
        t.db.collection::<Document>("accounts")
            .find_one(doc! { "_id": "a001" })
            .await
            .unwrap()
            .unwrap();
    assert_eq!(
        raw,
        doc! { "_id": "a001", "owner": "o1", "balance": 90_i64, fields::SCHEMA_VERSION: 1_i64, fields::VERSION: 1_i64 }
    );
    // The version read before the stamp is stale now.
    let err = accounts
        .adjust("a001", a1.version, &Adjust::new().by("balance", -10_i64))
        .await
        .unwrap_err();
    assert!(
        matches!(err, RepoError::VersionConflict { expected, actual: 1, .. } if expected == a1.version),
        "{err:?}"
    );

    // A transfer between two plain documents.
    let txns = Transactions::new(&t.store);
    let (_, outcome) = txns
        .run(|tx| {
            let accounts = accounts.clone();
            async move {
                let from = accounts.get("a002").await?;
                let to = accounts.get("a003").await?;
                tx.adjust(
                    &accounts,
                    "a002",
                    from.version,
                    &Adjust::new().by("balance", -25_i64),
                )
                .await?;
                tx.adjust(
                    &accounts,
                    "a003",
                    to.version,
                    &Adjust::new().by("balance", 25_i64),
                )
                .await?;
                Ok(())
            }
        })
        .await
        .unwrap();
    assert_eq!(outcome.written.len(), 2);
    let (from, to) = (
        accounts.get("a002").await.unwrap(),
        accounts.get("a003").await.unwrap(),
    );
    assert_eq!((from.balance, to.balance), (75, 125));
    assert!(!from.is_plain() && !to.is_plain());
    assert_eq!(
        (from.version, to.version),
        (2, 2),
        "stamped at 1, changed to 2"
    );
    common::assert_settled(&t, &["accounts"], "transfer on plain documents").await;
}

#[tokio::test]
async fn a_raw_change_between_read_and_write_is_a_conflict_never_a_lost_write() {
    let t = TestDb::new().await;
    plain_accounts(&t, 3).await;
    let accounts = common::open_accounts(&t.store).await;
    let raw = t.db.collection::<Document>("accounts");

    let read = accounts.get("a000").await.unwrap();
    raw.update_one(
        doc! { "_id": "a000" },
        doc! { "$inc": { "balance": 7_i64 } },
    )
    .await
    .unwrap();
    let changed = accounts.get("a000").await.unwrap();
    assert_ne!(changed.version, read.version);
    for result in [
        accounts
            .update("a000", read.version, &Update::new().set("owner", "x"))
            .await,
        accounts
            .adjust("a000", read.version, &Adjust::new().by("balance", 1_i64))
            .await,
        accounts
            .replace("a000", read.version, &Account::new("a000", "x", 1))
            .await,
        accounts.delete("a000", read.version).await,
    ] {
        assert!(
            matches!(result, Err(RepoError::VersionConflict { expected, actual, .. })
                if expected == read.version && actual == changed.version),
            "{result:?}"
        );
    }
    // A change of a number's type alone is a change of content too.
    raw.update_one(
        doc! { "_id": "a001" },
        doc! { "$set": { "balance": 100_i32 } },
    )
    .await
    .unwrap();
    let before = accounts.get("a001").await;
    assert!(before.is_ok() || matches!(before, Err(RepoError::Decode { .. })));
    assert_eq!(
        raw.find_one(doc! { "_id": "a000" }).await.unwrap().unwrap(),
        doc! { "_id": "a000", "owner": "o0", "balance": 107_i64 },
        "nothing was stamped or lost"
    );

    // In a transaction: the commit stamps first, conditionally on the content read.
    let read = accounts.get("a002").await.unwrap();
    let tx = Transactions::new(&t.store).begin();
    tx.adjust(
        &accounts,
        "a002",
        read.version,
        &Adjust::new().by("balance", 1_i64),
    )
    .await
    .unwrap();
    tx.check(&accounts, "a000", changed.version).unwrap();
    raw.update_one(doc! { "_id": "a002" }, doc! { "$set": { "owner": "raw" } })
        .await
        .unwrap();
    let err = tx.commit().await.unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    assert_eq!(
        raw.find_one(doc! { "_id": "a002" }).await.unwrap().unwrap(),
        doc! { "_id": "a002", "owner": "raw", "balance": 100_i64 }
    );
}

#[tokio::test]
async fn deletes_checks_guards_and_inserts_meet_plain_documents() {
    let t = TestDb::new().await;
    plain_accounts(&t, 4).await;
    let accounts = common::open_accounts(&t.store).await;
    let raw = t.db.collection::<Document>("accounts");

    // A delete leaves a tombstone at the collection's first version.
    let a0 = accounts.get("a000").await.unwrap();
    assert_eq!(accounts.delete("a000", a0.version).await.unwrap(), 1);
    assert!(matches!(
        accounts.get("a000").await,
        Err(RepoError::Deleted { version: 1, .. })
    ));
    // An insert of a plain document's id is a duplicate, in and out of transactions.
    let dup = accounts.insert(&Account::new("a001", "x", 1)).await;
    assert!(matches!(dup, Err(RepoError::DuplicateId { .. })), "{dup:?}");
    let tx = Transactions::new(&t.store).begin();
    tx.insert(&accounts, &Account::new("a001", "x", 1))
        .await
        .unwrap();
    let err = tx.commit().await.unwrap_err();
    assert!(
        matches!(&err, TxnError::Document { source, .. } if matches!(**source, RepoError::DuplicateId { .. })),
        "{err:?}"
    );

    // A check, a delete and a guard in one transaction on plain documents.
    let a1 = accounts.get("a001").await.unwrap();
    let a2 = accounts.get("a002").await.unwrap();
    let tx = Transactions::new(&t.store).begin();
    tx.check(&accounts, "a001", a1.version).unwrap();
    tx.delete(&accounts, "a002", a2.version).unwrap();
    tx.guard(&accounts, "a003", doc! { "owner": "o3" }).unwrap();
    let outcome = tx.commit().await.unwrap();
    assert_eq!(outcome.written.len(), 2);
    common::assert_settled(&t, &["accounts"], "check, delete and guard").await;
    let a1 = raw.find_one(doc! { "_id": "a001" }).await.unwrap().unwrap();
    assert_eq!(
        a1,
        doc! { "_id": "a001", "owner": "o1", "balance": 100_i64, fields::SCHEMA_VERSION: 1_i64, fields::VERSION: 1_i64 },
        "a check stamps and leaves the content"
    );
    assert!(matches!(
        accounts.get("a002").await,
        Err(RepoError::Deleted { version: 2, .. })
    ));
    let a3 = raw.find_one(doc! { "_id": "a003" }).await.unwrap().unwrap();
    assert_eq!(a3.get(fields::VERSION), Some(&Bson::Int64(1)), "{a3}");
}

#[tokio::test]
async fn raw_writers_keep_writing_plain_documents_past_the_validator() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    let raw = t.db.collection::<Document>("accounts");
    accounts
        .insert(&Account::new("stamped", "S", 1))
        .await
        .unwrap();
    // The schema would refuse this document (a balance of type string), but it is plain: the
    // server's validator lets other writers insert and update it as before.
    raw.insert_one(doc! { "_id": "legacy", "owner": "L", "balance": "ten" })
        .await
        .unwrap();
    raw.update_one(doc! { "_id": "legacy" }, doc! { "$set": { "owner": "L2" } })
        .await
        .unwrap();
    // A stamped document stays under the schema for every writer.
    let refused = raw
        .update_one(
            doc! { "_id": "stamped" },
            doc! { "$set": { "balance": "ten" } },
        )
        .await;
    if common::capabilities().await.json_schema_validation {
        assert!(refused.is_err(), "{refused:?}");
    }
    let before = raw_snapshot(&t.db, "accounts").await;
    // Reading it as an account fails for that document alone, naming it.
    let err = accounts.get("legacy").await.unwrap_err();
    assert!(
        matches!(&err, RepoError::Decode { id, .. } if id.contains("legacy")),
        "{err:?}"
    );
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn documents_mongotx_cannot_read_fail_only_the_reads_that_meet_them() {
    let t = TestDb::new().await;
    // Writes documents with system fields of the wrong type or half of them, past the
    // validator, to see mongotx refuse to read them: they break the format on purpose.
    t.keeps_foreign_data();
    plain_accounts(&t, 20).await;
    let accounts = common::open_accounts(&t.store).await;
    let raw = t.db.collection::<Document>("accounts");
    let bad = [
        doc! { "_id": "b-schema", "owner": "o3", "balance": 1_i64, "_schema": "one", "_version": 1_i64 },
        doc! { "_id": "b-txn", "owner": "o3", "balance": 1_i64, "_schema": 1_i64, "_version": 1_i64, "_txn": "abc" },
        doc! { "_id": "b-hold", "owner": "o3", "balance": 1_i64, "_schema": 1_i64, "_version": 2_i64, "_txn": bson::oid::ObjectId::new(), "_hold": 5 },
        doc! { "_id": "b-half", "owner": "o3", "balance": 1_i64, "_version": 4_i64 },
    ];
    raw.insert_many(bad.clone())
        .bypass_document_validation(true)
        .await
        .unwrap();
    accounts
        .insert(&Account::new("s-1", "o3", 5))
        .await
        .unwrap();

    for doc in &bad {
        let id = doc.get_str("_id").unwrap();
        let err = accounts.get(id).await.unwrap_err();
        assert!(
            matches!(&err, RepoError::Malformed { id: named, .. } | RepoError::Hold { id: named, .. } if named.contains(id)),
            "{id}: {err:?}"
        );
    }
    // A query that matches them fails, naming one of them.
    let err = accounts
        .find(Query::new().filter(doc! { "owner": "o3" }))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, RepoError::Malformed { id, .. } if id.contains("b-")),
        "{err:?}"
    );
    // The stream yields every readable document and one error per unreadable one, in place.
    let streamed: Vec<Result<_, _>> = accounts
        .find_stream(
            Query::new()
                .filter(doc! { "owner": "o3" })
                .sort(doc! { "_id": 1 }),
        )
        .await
        .unwrap()
        .collect::<Vec<_>>()
        .await;
    let (ok, failed): (Vec<_>, Vec<_>) = streamed.into_iter().partition(Result::is_ok);
    assert_eq!(
        (ok.len(), failed.len()),
        (2 + 1, bad.len()),
        "a003, a013, s-1"
    );
    // Queries they cannot match are unaffected, whatever shape their filter has.
    for filter in [
        doc! { "owner": "o1" },
        doc! { "$expr": { "$eq": ["$owner", "o1"] } },
        doc! { "$nor": [{ "owner": { "$ne": "o1" } }] },
    ] {
        let found = accounts
            .find(Query::new().filter(filter.clone()))
            .await
            .unwrap_or_else(|e| panic!("{filter}: {e}"));
        assert_eq!(found.len(), 2, "{filter}");
        assert_eq!(
            accounts.count(Query::new().filter(filter)).await.unwrap(),
            2
        );
    }
    // count counts what matches, readable or not.
    assert_eq!(
        accounts
            .count(Query::new().filter(doc! { "owner": "o3" }))
            .await
            .unwrap(),
        2 + 1 + bad.len() as u64
    );
}

#[tokio::test]
async fn projected_plain_documents_keep_the_version_of_their_whole_content() {
    #[derive(Debug, serde::Deserialize, serde::Serialize)]
    struct Owner {
        #[serde(rename = "_id")]
        id: String,
        owner: String,
    }
    let t = TestDb::new().await;
    plain_accounts(&t, 5).await;
    common::open_accounts(&t.store).await;
    let owners = t
        .store
        .repository::<Owner>(common::accounts_spec())
        .await
        .unwrap();
    let accounts = common::open_accounts(&t.store).await;
    for projection in [doc! { "owner": 1 }, doc! { "balance": 0 }] {
        let found = owners
            .find(
                Query::new()
                    .filter(doc! { "_id": "a002" })
                    .projection(projection.clone()),
            )
            .await
            .unwrap();
        let whole = accounts.get("a002").await.unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].version, whole.version, "{projection}");
    }
    let found = owners
        .find(
            Query::new()
                .filter(doc! { "_id": "a002" })
                .projection(doc! { "owner": 1 }),
        )
        .await
        .unwrap();
    let v = accounts
        .adjust(
            "a002",
            found[0].version,
            &Adjust::new().by("balance", 1_i64),
        )
        .await
        .unwrap();
    assert_eq!(v, 1);
}

#[tokio::test]
async fn filters_that_would_run_javascript_are_refused() {
    let t = TestDb::new().await;
    plain_accounts(&t, 2).await;
    let accounts = common::open_accounts(&t.store).await;
    for filter in [
        doc! { "$where": "this.balance > 1" },
        doc! { "$expr": { "$function": { "body": "function() { return true }", "args": [], "lang": "js" } } },
        doc! { "$or": [{ "owner": "o1" }, { "$expr": { "$eq": [{ "$accumulator": {} }, 1] } }] },
    ] {
        let results = [
            accounts
                .find(Query::new().filter(filter.clone()))
                .await
                .map(|_| ()),
            accounts
                .count(Query::new().filter(filter.clone()))
                .await
                .map(|_| ()),
            accounts
                .find_stream(Query::new().filter(filter.clone()))
                .await
                .map(|_| ()),
        ];
        for result in results {
            assert!(
                matches!(&result, Err(RepoError::InvalidQuery { reason, .. }) if reason.contains("JavaScript")),
                "{filter}: {result:?}"
            );
        }
    }
}

/// Plain documents of an older shape (declared with `plain_documents`) read upgraded, are written
/// in the current shape by their first write (in a transaction too, whose rollback puts back the
/// old shape, stamped), and explicit adoption stamps them in their own shape.
#[tokio::test]
async fn plain_documents_of_an_older_shape_are_carried_forward_by_the_upgrade_steps() {
    let t = TestDb::new().await;
    let raw = t.db.collection::<Document>("profiles");
    raw.insert_many([
        doc! { "_id": "ada", "name": "Ada Lovelace" },
        doc! { "_id": "alan", "name": "Alan Turing" },
        doc! { "_id": "grace", "name": "Grace Hopper" },
        doc! { "_id": "broken", "name": 42 },
    ])
    .await
    .unwrap();
    let profiles = t
        .store
        .repository::<common::Profile>(common::profiles_spec().plain_documents(1))
        .await
        .unwrap();
    let ada = profiles.get("ada").await.unwrap();
    assert!(ada.is_plain());
    assert_eq!(ada.stored_schema_version, 1);
    assert_eq!(
        (ada.given_name.as_str(), ada.family_name.as_str()),
        ("Ada", "Lovelace")
    );
    let err = profiles.get("broken").await.unwrap_err();
    assert!(
        matches!(&err, RepoError::Upgrade { id, .. } if id.contains("broken")),
        "{err:?}"
    );

    // A lazy write stores the upgraded, changed document.
    profiles
        .update(
            "ada",
            ada.version,
            &Update::new().set("email", "ada@example.org"),
        )
        .await
        .unwrap();
    assert_eq!(
        raw.find_one(doc! { "_id": "ada" }).await.unwrap().unwrap(),
        doc! { "_id": "ada", "given_name": "Ada", "family_name": "Lovelace", "email": "ada@example.org", "_schema": 2_i64, "_version": 1_i64 }
    );

    // A transaction that fails after its rewrite landed: the rollback puts back the plain
    // document exactly as it was (the rewrite stamped it in its own write, which the undo
    // reverses too).
    let alan = profiles.get("alan").await.unwrap();
    let tx = Transactions::new(&t.store).begin();
    tx.update(
        &profiles,
        "alan",
        alan.version,
        &Update::new().set("email", "alan@example.org"),
    )
    .await
    .unwrap();
    tx.insert(
        &profiles,
        &common::Profile {
            id: "grace".into(),
            given_name: "G".into(),
            family_name: "H".into(),
            email: None,
        },
    )
    .await
    .unwrap();
    let err = tx.commit().await.unwrap_err();
    assert!(
        matches!(&err, TxnError::Document { source, .. } if matches!(**source, RepoError::DuplicateId { .. })),
        "{err:?}"
    );
    common::assert_settled(&t, &["profiles"], "rolled back rewrite").await;
    assert_eq!(
        raw.find_one(doc! { "_id": "alan" }).await.unwrap().unwrap(),
        doc! { "_id": "alan", "name": "Alan Turing" }
    );
    // Committed: the rewrite lands in the current shape.
    Transactions::new(&t.store)
        .run(|tx| {
            let profiles = profiles.clone();
            async move {
                let alan = profiles.get("alan").await?;
                tx.update(
                    &profiles,
                    "alan",
                    alan.version,
                    &Update::new().set("email", "alan@example.org"),
                )
                .await
            }
        })
        .await
        .unwrap();
    let stored = common::raw_snapshot_when_free(&t.db, "profiles").await;
    let alan = stored
        .iter()
        .find(|d| d.get_str("_id") == Ok("alan"))
        .unwrap();
    assert_eq!(alan.get_str("given_name"), Ok("Alan"));
    assert_eq!(alan.get_i64("_schema"), Ok(2));
    assert_eq!(alan.get_i64("_version"), Ok(1));

    // Explicit adoption stamps the rest in their own shape, and refuses the one no step takes.
    let report = profiles
        .adopt(mongotx::adopt::AdoptOptions::new())
        .await
        .unwrap();
    assert_eq!((report.stamped, report.refused), (1, 1), "{report:?}");
    assert_eq!(report.refusals[0].field, "_schema");
    assert_eq!(
        raw.find_one(doc! { "_id": "grace" })
            .await
            .unwrap()
            .unwrap(),
        doc! { "_id": "grace", "name": "Grace Hopper", "_schema": 1_i64, "_version": 1_i64 }
    );
    assert_eq!(profiles.get("grace").await.unwrap().given_name, "Grace");
}

/// A plain document with a field name mongotx cannot address reads as stored; its first write,
/// which would send it back whole, is refused naming the field, and nothing changes.
#[tokio::test]
async fn a_plain_document_with_a_dotted_field_name_reads_but_its_first_write_is_refused() {
    let t = TestDb::new().await;
    let repo = t
        .store
        .repository::<Document>(common::accounts_spec())
        .await
        .unwrap();
    let raw = t.db.collection::<Document>("accounts");
    let stored = doc! { "_id": "dotted", "owner": "o", "balance": 1_i64, "odd.name": 1 };
    // MongoDB stores dotted field names since 3.6 (the manual's "Field Names" section).
    raw.insert_one(stored.clone()).await.unwrap();
    let read = repo.get("dotted").await.unwrap();
    assert_eq!(read.value, stored);
    let err = repo
        .update("dotted", read.version, &Update::new().set("owner", "p"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, RepoError::Invalid { field, .. } if field == "odd.name"),
        "{err:?}"
    );
    assert_eq!(raw_snapshot(&t.db, "accounts").await, vec![stored]);
}

/// A transaction that rewrites a plain document keeps it plain until its apply lands. If the
/// apply never comes (its coordinator died after writing the record), the resolver that decides
/// the transaction after its deadline fences the document as it is: `_txn` and `_hold` on a
/// document with no `_schema` or `_version`. The server's validator refused that write (error 121)
/// until it let a plain document under a fence through, so the GC could never abort such a
/// transaction: its record stayed `staging`, skipped by every round.
#[tokio::test]
async fn a_plain_document_whose_rewrite_never_landed_is_fenced_and_the_transaction_aborted() {
    use mongotx::gc::{Gc, GcOptions};
    use mongotx::testkit::failpoint::{self as fp, Failpoint};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    let t = TestDb::new().await;
    let raw = t.db.collection::<Document>("accounts");
    // Content the schema refuses, so that a transaction's update rewrites it whole.
    let plain = doc! { "_id": "p", "owner": "P", "balance": "100" };
    raw.insert_one(plain.clone()).await.unwrap();
    let loose = t
        .store
        .repository::<Document>(common::accounts_spec())
        .await
        .unwrap();
    let read = loose.get("p").await.unwrap();
    assert!(read.is_plain());
    // What a coordinator that died after its record, before the apply, leaves.
    let txn = bson::oid::ObjectId::new();
    let now = t.store.server_time().await.unwrap();
    let deadline = bson::DateTime::from_millis(now.timestamp_millis() + 300);
    t.db.collection::<Document>(mongotx::collections::TRANSACTIONS_COLLECTION)
        .insert_one(doc! {
            "_id": txn, "state": "staging", "created": bson::DateTime::from_chrono(now),
            "deadline": deadline,
            "entries": [{
                "coll": "accounts", "id": "p", "expected": read.version, "applied": 1_i64,
                "schema": 1_i64,
                "op": { "kind": "rewrite", "post": { "owner": "P", "balance": 100_i64 }, "pre": plain.clone() },
            }],
        })
        .await
        .unwrap();
    crate::admin::past(&t, deadline).await;

    // A GC that dies right after fencing leaves the plain document under its fence.
    let crashing = Gc::new(
        &t.store,
        GcOptions::default().fault_injector(Arc::new(common::CrashAt(Failpoint {
            name: fp::GC_FENCE_AFTER,
            step: 0,
        }))),
    );
    let _ = crashing
        .run_round_at(chrono::Utc::now(), &AtomicBool::new(false))
        .await;
    let fenced = raw.find_one(doc! { "_id": "p" }).await.unwrap().unwrap();
    assert_eq!(
        fenced.get_object_id(fields::ACTIVE_TXN),
        Ok(txn),
        "{fenced}"
    );
    assert_eq!(
        fenced
            .get_document(fields::HOLD)
            .and_then(|h| h.get_bool("fence")),
        Ok(true),
        "{fenced}"
    );
    assert!(!fenced.contains_key(fields::SCHEMA_VERSION), "{fenced}");
    assert_eq!(loose.get("p").await.unwrap().version, read.version);

    // The next round (past the dead runner's claim) aborts the transaction and takes the fence
    // away: the same plain document.
    let summary = Gc::new(&t.store, GcOptions::default())
        .run_round_at(
            chrono::Utc::now() + chrono::Duration::minutes(2),
            &AtomicBool::new(false),
        )
        .await
        .unwrap();
    assert_eq!(summary.rolled_back, 1, "{summary:?}");
    assert_eq!(summary.skipped, 0, "{summary:?}");
    common::assert_settled(&t, &["accounts"], "fence undone").await;
    let stored = raw.find_one(doc! { "_id": "p" }).await.unwrap().unwrap();
    assert_eq!(
        bson::to_vec(&stored).unwrap(),
        bson::to_vec(&plain).unwrap(),
        "{stored}"
    );
}
