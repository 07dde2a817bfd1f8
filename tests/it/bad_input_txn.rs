//! Bad input to the transaction layer and the GC gets a typed error and changes nothing in the
//! database: staging (wrong ids, versions, empty changes, system fields, bad paths, values the
//! schema refuses, a document staged twice, a repository of another database, a record too large
//! to store), adjusts past the 64-bit range, commits the server refuses, closed transactions,
//! `Transactions::run` bodies, and options that cannot work (durations on the command line: the CLI's own tests).
//!
//! Each refusal goes through `common::refusals::Refusals`, which snapshots every collection of
//! the test's database around the call. Setup that writes (seeding, a successful commit, opening
//! a repository) happens before the checks; commits in setup finish before returning
//! (`common::finishing`), so no background task writes during a check.

use crate::common;
use crate::refuse;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::refusals::{snapshot, Refusals};
use crate::common::{Account, Note, TestDb};
use bson::{doc, oid::ObjectId, Bson, Document};
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::{LockWait, TxnOptions};
use mongotx::{
    Adjust, CollectionSpec, RepoError, Repository, Store, Transactions, TxnError, Update,
};

/// Accounts "alice" (100), "bob" (50) and "carol" (10), each at version 1.
async fn bank(t: &TestDb) -> Repository<Account> {
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("alice", 100), ("bob", 50), ("carol", 10)]).await;
    accounts
}

/// The accounts collection seen as raw documents (to stage values `Account` cannot hold).
async fn raw_accounts(t: &TestDb) -> Repository<Document> {
    t.store
        .repository::<Document>(common::accounts_spec())
        .await
        .expect("open raw accounts")
}

/// A collection whose ids may be any number, so that ids the server takes for one (Int32 7,
/// Int64 7, Double 7.0) can be staged.
const NUMBERED: &str = r#"{
  "bsonType": "object",
  "required": ["_id", "_schema", "_version"],
  "properties": {
    "_id": { "bsonType": ["int", "long", "double"] },
    "_schema": { "bsonType": "long", "minimum": 1 },
    "_version": { "bsonType": "long", "minimum": 1 },
    "_txn": { "bsonType": "objectId" },
    "_deleted": { "bsonType": "date" },
    "_deleting": { "bsonType": "bool" },
    "n": { "bsonType": "long" }
  }
}"#;

/// The repository error inside a transaction error, if it is one of `pattern`.
macro_rules! repo_refusal {
    ($pattern:pat) => {
        |e: &TxnError| matches!(e, TxnError::Document { source, .. } if matches!(**source, $pattern))
    };
}

/// Staging refuses ids of a type the schema does not allow, versions no document can have (0,
/// negative, and `i64::MAX`, which has no successor), versions or ids that do not match the
/// stored document, and empty changes: all before anything is written.
#[tokio::test]
async fn staging_refuses_wrong_ids_versions_and_empty_changes() {
    let t = TestDb::new().await;
    let accounts = bank(&t).await;
    let txns = Transactions::new(&t.store);
    let tx = txns.begin();
    let mut r = Refusals::new(&t.db);
    let give = Adjust::new().by("balance", 5_i64);
    let note = Update::new().set("note", "hi");

    r.check(
        "an update of an Int64 id (accounts have string ids)",
        tx.update(&accounts, 7_i64, 1, &note),
        repo_refusal!(RepoError::InvalidId { .. }),
    )
    .await;
    r.check(
        "an adjust of an ObjectId id",
        tx.adjust(&accounts, ObjectId::new(), 1, &give),
        repo_refusal!(RepoError::InvalidId { .. }),
    )
    .await;
    r.check(
        "a delete of a null id",
        async { tx.delete(&accounts, Bson::Null, 1) },
        repo_refusal!(RepoError::InvalidId { .. }),
    )
    .await;
    r.check(
        "a check of a document id",
        async { tx.check(&accounts, doc! { "a": 1 }, 1) },
        repo_refusal!(RepoError::InvalidId { .. }),
    )
    .await;
    r.check(
        "a guard on a boolean id",
        async { tx.guard(&accounts, true, doc! { "owner": "ALICE" }) },
        repo_refusal!(RepoError::InvalidId { .. }),
    )
    .await;
    for (what, version) in [("0", 0_i64), ("-1", -1), ("i64::MIN", i64::MIN)] {
        let invalid = |e: &TxnError| {
            matches!(e, TxnError::Document { source, .. }
                if matches!(&**source, RepoError::InvalidVersion { version: v, collection, id }
                    if *v == version && collection == "accounts" && id == "\"alice\""))
        };
        r.check(
            &format!("an update expecting version {what}"),
            tx.update(&accounts, "alice", version, &note),
            invalid,
        )
        .await;
        r.check(
            &format!("an adjust expecting version {what}"),
            tx.adjust(&accounts, "alice", version, &give),
            invalid,
        )
        .await;
        r.check(
            &format!("a delete expecting version {what}"),
            async { tx.delete(&accounts, "alice", version) },
            invalid,
        )
        .await;
        r.check(
            &format!("a check expecting version {what}"),
            async { tx.check(&accounts, "alice", version) },
            invalid,
        )
        .await;
    }
    // i64::MAX has no next version: the entry's version after the change cannot be computed.
    r.check(
        "a delete expecting version i64::MAX",
        async { tx.delete(&accounts, "alice", i64::MAX) },
        repo_refusal!(RepoError::InvalidVersion {
            version: i64::MAX,
            ..
        }),
    )
    .await;
    r.check(
        "an update expecting version i64::MAX",
        tx.update(&accounts, "alice", i64::MAX, &note),
        repo_refusal!(RepoError::InvalidVersion {
            version: i64::MAX,
            ..
        }),
    )
    .await;
    r.check(
        "an update expecting a stale version",
        tx.update(&accounts, "alice", 7, &note),
        repo_refusal!(RepoError::VersionConflict {
            expected: 7,
            actual: 1,
            ..
        }),
    )
    .await;
    r.check(
        "an adjust of a missing document",
        tx.adjust(&accounts, "nobody", 1, &give),
        repo_refusal!(RepoError::NotFound { .. }),
    )
    .await;
    r.check(
        "an empty update",
        tx.update(&accounts, "alice", 1, &Update::new()),
        repo_refusal!(RepoError::EmptyChange { .. }),
    )
    .await;
    r.check(
        "an empty adjust",
        tx.adjust(&accounts, "alice", 1, &Adjust::new()),
        repo_refusal!(RepoError::EmptyChange { .. }),
    )
    .await;
    assert!(tx.is_empty(), "a refused staging left an entry");
    assert_eq!(r.checked(), 23);
}

/// Staging refuses system fields, paths that cannot address a field (`_id`, empty components,
/// array positions, `$` names), values and removals the schema does not allow, increments the
/// field cannot take, inserts the schema refuses, and guards that are not plain equalities on
/// user fields of the staged document.
#[tokio::test]
async fn staging_refuses_system_fields_bad_paths_and_schema_violations() {
    let t = TestDb::new().await;
    let accounts = bank(&t).await;
    let raw = raw_accounts(&t).await;
    let tx = Transactions::new(&t.store).begin();
    let mut r = Refusals::new(&t.db);
    let update = |u: Update| {
        let (tx, accounts) = (tx.clone(), accounts.clone());
        async move { tx.update(&accounts, "alice", 1, &u).await }
    };

    for field in ["_version", "_txn", "_hold.exp", "_mongotx_x"] {
        r.check(
            &format!("an update setting {field}"),
            update(Update::new().set(field, 1_i64)),
            repo_refusal!(RepoError::SystemField { .. }),
        )
        .await;
    }
    r.check(
        "an update removing _deleted",
        update(Update::new().unset("_deleted")),
        repo_refusal!(RepoError::SystemField { .. }),
    )
    .await;
    r.check(
        "an adjust of _version",
        tx.adjust(&accounts, "alice", 1, &Adjust::new().by("_version", 1_i64)),
        repo_refusal!(RepoError::SystemField { .. }),
    )
    .await;
    for (what, path) in [
        ("_id", "_id"),
        ("an empty path", ""),
        ("an empty component", "limits..daily"),
        ("an array position", "limits.0"),
        ("a $ component", "limits.$daily"),
    ] {
        r.check(
            &format!("an update of {what}"),
            update(Update::new().set(path, 1_i64)),
            repo_refusal!(RepoError::Invalid { .. }),
        )
        .await;
    }
    r.check(
        "a balance that is a string",
        update(Update::new().set("balance", "lots")),
        repo_refusal!(RepoError::Invalid { .. }),
    )
    .await;
    r.check(
        "a currency outside the enum",
        update(Update::new().set("currency", "XYZ")),
        repo_refusal!(RepoError::Invalid { .. }),
    )
    .await;
    r.check(
        "a field the schema does not declare",
        update(Update::new().set("nickname", "al")),
        repo_refusal!(RepoError::Invalid { .. }),
    )
    .await;
    r.check(
        "removing the required owner",
        update(Update::new().unset("owner")),
        repo_refusal!(RepoError::Invalid { .. }),
    )
    .await;
    r.check(
        "overlapping paths in one update",
        update(
            Update::new()
                .set("limits", doc! { "daily": 5_i64 })
                .set("limits.daily", 6_i64),
        ),
        repo_refusal!(RepoError::Invalid { .. }),
    )
    .await;
    r.check(
        "an adjust of a string field",
        tx.adjust(&accounts, "alice", 1, &Adjust::new().by("owner", 1_i64)),
        repo_refusal!(RepoError::Invalid { .. }),
    )
    .await;
    r.check(
        "an adjust of a long field by a double",
        tx.adjust(&accounts, "alice", 1, &Adjust::new().by("balance", 0.5)),
        repo_refusal!(RepoError::Invalid { .. }),
    )
    .await;
    r.check(
        "an adjust by NaN",
        tx.adjust(
            &accounts,
            "alice",
            1,
            &Adjust::new().by("limits.rate", f64::NAN),
        ),
        repo_refusal!(RepoError::InvalidIncrement { .. }),
    )
    .await;
    r.check(
        "an adjust by a string",
        tx.adjust(&accounts, "alice", 1, &Adjust::new().by("balance", "5")),
        repo_refusal!(RepoError::InvalidIncrement { .. }),
    )
    .await;
    r.check(
        "an insert missing the required balance",
        tx.insert(&raw, &doc! { "_id": "dave", "owner": "DAVE" }),
        repo_refusal!(RepoError::Invalid { .. }),
    )
    .await;
    r.check(
        "an insert carrying _version",
        tx.insert(
            &raw,
            &doc! { "_id": "dave", "owner": "DAVE", "balance": 1_i64, "_version": 9_i64 },
        ),
        repo_refusal!(RepoError::SystemField { .. }),
    )
    .await;
    r.check(
        "an insert with an Int64 id",
        tx.insert(&raw, &doc! { "_id": 5_i64, "owner": "F", "balance": 1_i64 }),
        repo_refusal!(RepoError::InvalidId { .. }),
    )
    .await;
    r.check(
        "an insert without an id (string ids are never generated)",
        tx.insert(&raw, &doc! { "owner": "F", "balance": 1_i64 }),
        repo_refusal!(RepoError::Invalid { .. }),
    )
    .await;
    r.check(
        "an insert with an empty id (minLength 1)",
        tx.insert(&accounts, &Account::new("", "E", 1)),
        repo_refusal!(RepoError::Invalid { .. }),
    )
    .await;
    let guard = |condition: Document| {
        let (tx, accounts) = (tx.clone(), accounts.clone());
        async move { tx.guard(&accounts, "alice", condition) }
    };
    for (what, condition) in [
        ("an empty guard", doc! {}),
        ("a guard naming _id", doc! { "_id": "bob" }),
        ("a guard naming _id.x", doc! { "_id.x": 1 }),
        ("a guard naming _version", doc! { "_version": 1_i64 }),
        ("a guard naming $where", doc! { "$where": "true" }),
        (
            "a guard with an operator",
            doc! { "balance": { "$gt": 1_i64 } },
        ),
        ("a guard with an array", doc! { "owner": ["A", "B"] }),
        (
            "a guard with an empty component",
            doc! { "limits..daily": 1_i64 },
        ),
        ("a guard on an array position", doc! { "limits.0": 1_i64 }),
    ] {
        r.check(
            what,
            guard(condition),
            repo_refusal!(RepoError::InvalidQuery { .. }),
        )
        .await;
    }
    assert!(tx.is_empty(), "a refused staging left an entry");
    assert_eq!(r.checked(), 34);
}

/// What cannot share one transaction: a document staged twice (ids the server takes for one
/// count as one), a repository of another database or of a store keeping its records elsewhere,
/// and changes whose record would be larger than one MongoDB document.
#[tokio::test]
async fn staging_refuses_duplicates_foreign_repositories_and_oversized_records() {
    let t = TestDb::new().await;
    let accounts = bank(&t).await;
    let numbered = t
        .store
        .repository::<Document>(CollectionSpec::new("numbered", 1, NUMBERED).unwrap())
        .await
        .unwrap();
    numbered
        .insert(&doc! { "_id": 7_i32, "n": 1_i64 })
        .await
        .unwrap();
    let notes = t
        .store
        .repository::<Note>(common::notes_spec())
        .await
        .unwrap();
    // Another database, and this one with its records in another collection.
    let other_name = format!("{}_other", t.db.name());
    let other_store = Store::new(t.client.database(&other_name));
    let foreign = common::open_accounts(&other_store).await;
    let elsewhere = Store::builder(t.db.clone())
        .transactions_collection("other_records")
        .build();
    let elsewhere_accounts = common::open_accounts(&elsewhere).await;

    let tx = Transactions::new(&t.store).begin();
    tx.adjust(&accounts, "alice", 1, &Adjust::new().by("balance", -5_i64))
        .await
        .unwrap();
    tx.delete(&accounts, "bob", 1).unwrap();
    tx.check(&numbered, 7_i64, 1).unwrap();
    let mut r = Refusals::new(&t.db);
    let twice = |e: &TxnError| matches!(e, TxnError::DuplicateEntry { collection, .. } if collection == "accounts" || collection == "numbered");
    r.check(
        "alice adjusted twice",
        tx.adjust(&accounts, "alice", 1, &Adjust::new().by("balance", -5_i64)),
        twice,
    )
    .await;
    r.check(
        "alice checked after her adjust",
        async { tx.check(&accounts, "alice", 1) },
        twice,
    )
    .await;
    r.check(
        "bob updated after his delete",
        tx.update(&accounts, "bob", 1, &Update::new().set("note", "x")),
        twice,
    )
    .await;
    r.check(
        "bob guarded after his delete",
        async { tx.guard(&accounts, "bob", doc! { "owner": "BOB" }) },
        twice,
    )
    .await;
    r.check(
        "Double 7.0 after Int64 7",
        async { tx.delete(&numbered, 7.0_f64, 1) },
        twice,
    )
    .await;
    r.check(
        "Int32 7 after Int64 7",
        tx.update(&numbered, 7_i32, 1, &Update::new().set("n", 2_i64)),
        twice,
    )
    .await;
    r.check(
        "an insert of an id already staged",
        tx.insert(&accounts, &Account::new("alice", "A", 1)),
        twice,
    )
    .await;
    let foreign_db = |e: &TxnError| {
        matches!(e, TxnError::ForeignRepository { database, expected, .. }
            if database == &other_name && expected == t.db.name())
    };
    r.check(
        "an adjust on another database",
        tx.adjust(&foreign, "alice", 1, &Adjust::new().by("balance", 1_i64)),
        foreign_db,
    )
    .await;
    r.check(
        "an insert into another database",
        tx.insert(&foreign, &Account::new("zed", "Z", 1)),
        foreign_db,
    )
    .await;
    r.check(
        "a check on another database",
        async { tx.check(&foreign, "alice", 1) },
        foreign_db,
    )
    .await;
    r.check(
        "a delete through a store with its records elsewhere",
        async { tx.delete(&elsewhere_accounts, "carol", 1) },
        |e| matches!(e, TxnError::ForeignRepository { database, .. } if database.contains("other_records")),
    )
    .await;
    // Three notes of 6 MB: the record would list 18 MB of inserts, more than a document holds.
    let big = |n: usize| Note {
        id: None,
        text: format!("{n}{}", "x".repeat(6_000_000)),
        tags: vec![],
    };
    let large = Transactions::new(&t.store).begin();
    large.insert(&notes, &big(1)).await.unwrap();
    large.insert(&notes, &big(2)).await.unwrap();
    r.check("a third 6 MB insert", large.insert(&notes, &big(3)), |e| {
        matches!(e, TxnError::TooLarge { collection, entries: 3, bytes, limit, .. }
            if collection == "notes" && bytes > limit)
    })
    .await;
    assert_eq!(large.len(), 2);
    assert_eq!(tx.len(), 3);
    assert!(r.checked() >= 12, "{}", r.checked());
    drop(r);
    t.client
        .database(&other_name)
        .drop()
        .await
        .expect("drop the other database");
}

/// An adjust that would take a 64-bit balance past its range is refused with `InvalidIncrement`
/// and writes nothing: by `Repository::adjust` (its write carries the range as a condition) and
/// by a transaction's `adjust` (staging reads the stored document and checks), going up from
/// near `i64::MAX` and down from near `i64::MIN`. Up to the edge is fine.
#[tokio::test]
async fn adjusts_past_the_64_bit_range_are_refused() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(
        &accounts,
        &[
            ("max", i64::MAX),
            ("near_max", i64::MAX - 1),
            ("min", i64::MIN),
            ("near_min", i64::MIN + 1),
        ],
    )
    .await;
    let tx = Transactions::new(&t.store).begin();
    let mut r = Refusals::new(&t.db);
    let overflow = |id: &'static str| {
        move |e: &RepoError| {
            matches!(e, RepoError::InvalidIncrement { collection, id: i, field, .. }
                if collection == "accounts" && i == &format!("{id:?}") && field == "balance")
        }
    };
    let cases: [(&'static str, Bson); 8] = [
        ("max", Bson::Int64(1)),
        ("max", Bson::Int64(i64::MAX)),
        ("max", Bson::Int32(1)),
        ("near_max", Bson::Int64(2)),
        ("min", Bson::Int64(-1)),
        ("min", Bson::Int64(i64::MIN)),
        ("min", Bson::Int32(-1)),
        ("near_min", Bson::Int64(-2)),
    ];
    for (id, by) in cases {
        let adjust = Adjust::new().by("balance", by.clone());
        r.check(
            &format!("Repository::adjust of {id} by {by}"),
            accounts.adjust(id, 1, &adjust),
            overflow(id),
        )
        .await;
        r.check(
            &format!("a transaction's adjust of {id} by {by}"),
            tx.adjust(&accounts, id, 1, &adjust),
            |e| {
                matches!(e, TxnError::Document { source, .. } if overflow(id)(source))
                    && e.repo_error().is_some()
            },
        )
        .await;
    }
    // Two increments, the second overflowing: the whole adjust is refused.
    r.check(
        "a transaction's adjust with one overflowing increment of two",
        tx.adjust(
            &accounts,
            "max",
            1,
            &Adjust::new().by("limits.daily", 1_i64).by("balance", 1_i64),
        ),
        |e| e.repo_error().is_some_and(overflow("max")),
    )
    .await;
    assert!(tx.is_empty());
    assert_eq!(r.checked(), 17);
    // To the edge, exactly.
    let txns = common::finishing(&t.store);
    let tx = txns.begin();
    tx.adjust(
        &accounts,
        "near_max",
        1,
        &Adjust::new().by("balance", 1_i64),
    )
    .await
    .unwrap();
    tx.adjust(
        &accounts,
        "near_min",
        1,
        &Adjust::new().by("balance", -1_i64),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(accounts.get("near_max").await.unwrap().balance, i64::MAX);
    assert_eq!(accounts.get("near_min").await.unwrap().balance, i64::MIN);
}

/// Commits the server refuses, all or nothing: a check whose version moved, a delete of a
/// document that does not exist, an insert of an id that is taken, a guard that no longer
/// matches; each alongside a good change, which is not written either.
#[tokio::test]
async fn commits_the_documents_refuse_write_nothing() {
    let t = TestDb::new().await;
    let accounts = bank(&t).await;
    // A transaction that commits and finishes creates the records' collection (left empty): the
    // checks then see the records the refused commits write and delete, if any stayed.
    let setup = common::finishing(&t.store).begin();
    setup.check(&accounts, "carol", 1).unwrap();
    setup.commit().await.unwrap();
    let txns = Transactions::new(&t.store);
    let mut r = Refusals::new(&t.db);
    let with_good = |stage: Box<dyn FnOnce(&mongotx::Transaction) + Send>| {
        let (txns, accounts) = (txns.clone(), accounts.clone());
        async move {
            let tx = txns.begin();
            tx.adjust(&accounts, "carol", 1, &Adjust::new().by("balance", 1_i64))
                .await?;
            stage(&tx);
            tx.commit().await
        }
    };
    let accounts2 = accounts.clone();
    r.check(
        "a check of a version that moved",
        with_good(Box::new(move |tx| {
            tx.check(&accounts2, "alice", 4).unwrap()
        })),
        repo_refusal!(RepoError::VersionConflict { .. }),
    )
    .await;
    let accounts2 = accounts.clone();
    r.check(
        "a delete of a missing document",
        with_good(Box::new(move |tx| {
            tx.delete(&accounts2, "nobody", 1).unwrap()
        })),
        repo_refusal!(RepoError::NotFound { .. } | RepoError::VersionConflict { .. }),
    )
    .await;
    let accounts2 = accounts.clone();
    r.check(
        "a guard that no longer matches",
        with_good(Box::new(move |tx| {
            tx.guard(&accounts2, "bob", doc! { "owner": "somebody else" })
                .unwrap()
        })),
        repo_refusal!(RepoError::ConditionFailed { .. }),
    )
    .await;
    let tx = txns.begin();
    tx.insert(&accounts, &Account::new("alice", "ALICE", 1))
        .await
        .unwrap();
    tx.adjust(&accounts, "carol", 1, &Adjust::new().by("balance", 1_i64))
        .await
        .unwrap();
    r.check(
        "an insert of a taken id",
        tx.commit(),
        repo_refusal!(RepoError::DuplicateId { .. }),
    )
    .await;
    assert_eq!(r.checked(), 4);
    common::assert_settled(&t, &["accounts"], "after the refused commits").await;
}

/// `commit` closes the transaction, and every clone of its handle, whatever its outcome: a
/// second commit and any later staging are refused with `Closed`, instead of committing nothing
/// (an empty success for changes that were never written) or staging into a list nobody will
/// commit.
#[tokio::test]
async fn a_committed_transaction_refuses_further_use() {
    let t = TestDb::new().await;
    let accounts = bank(&t).await;
    let raw = raw_accounts(&t).await;
    let txns = common::finishing(&t.store);
    let tx = txns.begin();
    tx.adjust(&accounts, "alice", 1, &Adjust::new().by("balance", -1_i64))
        .await
        .unwrap();
    let after = tx.clone();
    let outcome = tx.commit().await.unwrap();
    assert!(outcome.finished);
    // A commit that failed closes the transaction too.
    let failed = txns.begin();
    failed.check(&accounts, "bob", 9).unwrap();
    let failed_again = failed.clone();
    assert!(failed.commit().await.is_err());
    // And so does an empty one (which succeeds: nothing to write).
    let empty = txns.begin();
    let empty_again = empty.clone();
    let nothing = empty.commit().await.unwrap();
    assert_eq!(nothing.txn, None);
    assert!(nothing.written.is_empty());

    let mut r = Refusals::new(&t.db);
    refuse!(
        r,
        "a second commit",
        after.clone().commit(),
        TxnError::Closed { .. }
    );
    refuse!(
        r,
        "an adjust after the commit",
        after.adjust(&accounts, "alice", 2, &Adjust::new().by("balance", 1_i64)),
        TxnError::Closed { .. }
    );
    refuse!(
        r,
        "an update after the commit",
        after.update(&accounts, "bob", 1, &Update::new().set("note", "x")),
        TxnError::Closed { .. }
    );
    refuse!(
        r,
        "an insert after the commit",
        after.insert(
            &raw,
            &doc! { "_id": "dave", "owner": "D", "balance": 1_i64 }
        ),
        TxnError::Closed { .. }
    );
    refuse!(
        r,
        "a delete after the commit",
        async { after.delete(&accounts, "carol", 1) },
        TxnError::Closed { .. }
    );
    refuse!(
        r,
        "a check after the commit",
        async { after.check(&accounts, "carol", 1) },
        TxnError::Closed { .. }
    );
    refuse!(
        r,
        "a guard after the commit",
        async { after.guard(&accounts, "carol", doc! { "owner": "CAROL" }) },
        TxnError::Closed { .. }
    );
    refuse!(
        r,
        "a commit after a failed commit",
        failed_again.clone().commit(),
        TxnError::Closed { .. }
    );
    refuse!(
        r,
        "staging after a failed commit",
        async { failed_again.check(&accounts, "carol", 1) },
        TxnError::Closed { .. }
    );
    refuse!(
        r,
        "a commit after an empty commit",
        empty_again.commit(),
        TxnError::Closed { .. }
    );
    assert_eq!(after.len(), 0);
    assert_eq!(r.checked(), 10);
}

/// `Transactions::run` returns a body's refusal at once (it is not retryable) and writes
/// nothing: a body staging bad input, one rejecting, one committing its handle itself (the body
/// must leave that to `run`), and one staging the same document twice.
#[tokio::test]
async fn run_returns_a_bodys_bad_input_without_writing() {
    let t = TestDb::new().await;
    let accounts = bank(&t).await;
    let txns = Transactions::new(&t.store);
    let calls = Arc::new(AtomicUsize::new(0));
    let mut r = Refusals::new(&t.db);
    let counted = |calls: &Arc<AtomicUsize>| {
        calls.store(0, Ordering::SeqCst);
        Arc::clone(calls)
    };

    let seen = counted(&calls);
    let (a, s) = (accounts.clone(), seen.clone());
    r.check(
        "a body staging version 0",
        txns.run(move |tx| {
            let (a, s) = (a.clone(), s.clone());
            async move {
                s.fetch_add(1, Ordering::SeqCst);
                tx.adjust(&a, "alice", 0, &Adjust::new().by("balance", 1_i64))
                    .await
            }
        }),
        repo_refusal!(RepoError::InvalidVersion { version: 0, .. }),
    )
    .await;
    assert_eq!(seen.load(Ordering::SeqCst), 1, "a refusal is not retried");

    let seen = counted(&calls);
    let (a, s) = (accounts.clone(), seen.clone());
    r.check(
        "a body that stages and then rejects",
        txns.run(move |tx| {
            let (a, s) = (a.clone(), s.clone());
            async move {
                s.fetch_add(1, Ordering::SeqCst);
                tx.adjust(&a, "alice", 1, &Adjust::new().by("balance", 1_i64))
                    .await?;
                Err::<(), _>(TxnError::Rejected {
                    reason: "changed my mind".into(),
                })
            }
        }),
        |e| matches!(e, TxnError::Rejected { .. }),
    )
    .await;
    assert_eq!(seen.load(Ordering::SeqCst), 1);

    r.check(
        "a body that commits its own transaction",
        txns.run(|tx| async move { tx.commit().await.map(|_| ()) }),
        |e| matches!(e, TxnError::Closed { action } if action == "commit"),
    )
    .await;

    let a = accounts.clone();
    r.check(
        "a body staging alice twice",
        txns.run(move |tx| {
            let a = a.clone();
            async move {
                tx.adjust(&a, "alice", 1, &Adjust::new().by("balance", 1_i64))
                    .await?;
                tx.check(&a, "alice", 1)
            }
        }),
        |e| matches!(e, TxnError::DuplicateEntry { .. }),
    )
    .await;

    let a = accounts.clone();
    r.check(
        "a body updating an empty change",
        txns.run(move |tx| {
            let a = a.clone();
            async move { tx.update(&a, "bob", 1, &Update::new()).await }
        }),
        repo_refusal!(RepoError::EmptyChange { .. }),
    )
    .await;
    assert_eq!(r.checked(), 5);
}

/// Options that cannot work are refused before anything is read or written, by `commit` and by
/// `run` (whose body then never runs): a timeout of zero, under a millisecond or over a day, a
/// retry whose first pause is longer than its longest or zero, a store whose records would go
/// to a collection MongoDB or mongotx cannot use. A zero `max_wait` is accepted: one attempt.
#[tokio::test]
async fn transaction_options_that_cannot_work_are_refused() {
    let t = TestDb::new().await;
    let accounts = bank(&t).await;
    let retry = TxnOptions::default().retry;
    let bad: Vec<(&str, &str, TxnOptions)> = vec![
        (
            "a zero timeout",
            "timeout",
            TxnOptions::default().timeout(Duration::ZERO),
        ),
        (
            "a 500 µs timeout",
            "timeout",
            TxnOptions::default().timeout(Duration::from_micros(500)),
        ),
        (
            "a 25-hour timeout",
            "timeout",
            TxnOptions::default().timeout(Duration::from_secs(25 * 3600)),
        ),
        (
            "Duration::MAX as timeout",
            "timeout",
            TxnOptions::default().timeout(Duration::MAX),
        ),
        (
            "a first pause longer than the longest",
            "retry",
            TxnOptions::default().retry(LockWait {
                initial_backoff: Duration::from_secs(1),
                max_backoff: Duration::from_millis(10),
                ..retry
            }),
        ),
        (
            "a zero first pause with retries allowed",
            "retry",
            TxnOptions::default().retry(LockWait {
                initial_backoff: Duration::ZERO,
                ..retry
            }),
        ),
    ];
    let mut r = Refusals::new(&t.db);
    for (what, option, options) in bad {
        assert!(options.validate().is_err(), "{what}");
        let txns = Transactions::with_options(&t.store, options);
        let invalid =
            |e: &TxnError| matches!(e, TxnError::InvalidOptions { option: o, .. } if *o == option);
        let tx = txns.begin();
        tx.adjust(&accounts, "alice", 1, &Adjust::new().by("balance", 1_i64))
            .await
            .unwrap();
        let kept = tx.clone();
        r.check(&format!("commit with {what}"), tx.commit(), invalid)
            .await;
        // A refused commit leaves the transaction as it was.
        assert_eq!(kept.len(), 1, "{what}");
        let ran = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&ran);
        r.check(
            &format!("run with {what}"),
            txns.run(move |_tx| {
                seen.fetch_add(1, Ordering::SeqCst);
                async { Ok(()) }
            }),
            invalid,
        )
        .await;
        assert_eq!(ran.load(Ordering::SeqCst), 0, "{what}: the body ran");
    }
    for name in [
        "",
        "system.records",
        "a$b",
        mongotx::collections::META_COLLECTION,
    ] {
        let store = Store::builder(t.db.clone())
            .transactions_collection(name)
            .build();
        refuse!(
            r,
            &format!("a commit recording in {name:?}"),
            Transactions::new(&store).begin().commit(),
            TxnError::InvalidOptions {
                option: "transactions_collection",
                ..
            }
        );
    }
    assert_eq!(r.checked(), 16);
    // Accepted: no retries at all, and a day exactly.
    for options in [
        TxnOptions::default().retry(LockWait {
            max_wait: Duration::ZERO,
            initial_backoff: Duration::ZERO,
            max_backoff: Duration::ZERO,
        }),
        TxnOptions::default().timeout(TxnOptions::MAX_TIMEOUT),
        TxnOptions::default().timeout(Duration::from_millis(1)),
    ] {
        assert!(options.validate().is_ok(), "{options:?}");
    }
}

/// GC options that cannot work are refused by every round and by `resolve`, before anything
/// is read or written: a page of 0 records or over the most one claim command carries, and a
/// records collection MongoDB or mongotx cannot use. Accepted: any tombstone retention (one
/// reaching before the epoch purges nothing), and resolving a transaction that has no record
/// (`false`: nothing to do, and nothing written).
#[tokio::test]
async fn gc_options_that_cannot_work_are_refused() {
    let t = TestDb::new().await;
    let accounts = bank(&t).await;
    // A tombstone that an absurd retention must keep.
    let v = accounts.get("carol").await.unwrap().version;
    accounts.delete("carol", v).await.unwrap();
    let mut r = Refusals::new(&t.db);
    let later = common::hours_from_now(48).to_chrono();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let bad: Vec<(&str, &str, Gc)> = vec![
        (
            "a page of 0",
            "batch_size",
            Gc::new(&t.store, GcOptions::default().batch_size(0)),
        ),
        (
            "a page of MAX_BATCH_SIZE + 1",
            "batch_size",
            Gc::new(
                &t.store,
                GcOptions::default().batch_size(GcOptions::MAX_BATCH_SIZE + 1),
            ),
        ),
        (
            "a page of usize::MAX",
            "batch_size",
            Gc::new(&t.store, GcOptions::default().batch_size(usize::MAX)),
        ),
        (
            "records in \"\"",
            "transactions_collection",
            Gc::new(
                &mongotx::Store::builder(t.db.clone())
                    .transactions_collection("")
                    .build(),
                GcOptions::default(),
            ),
        ),
        (
            "records in system.x",
            "transactions_collection",
            Gc::new(
                &mongotx::Store::builder(t.db.clone())
                    .transactions_collection("system.x")
                    .build(),
                GcOptions::default(),
            ),
        ),
        (
            "records in the registry of collections",
            "transactions_collection",
            Gc::new(
                &mongotx::Store::builder(t.db.clone())
                    .transactions_collection(mongotx::collections::META_COLLECTION)
                    .build(),
                GcOptions::default(),
            ),
        ),
    ];
    for (what, option, gc) in bad {
        let invalid =
            |e: &TxnError| matches!(e, TxnError::InvalidOptions { option: o, .. } if *o == option);
        r.check(&format!("a round with {what}"), gc.run_round(), invalid)
            .await;
        r.check(
            &format!("a round at a later time with {what}"),
            gc.run_round_at(later, &stop),
            invalid,
        )
        .await;
        r.check(
            &format!("resolve with {what}"),
            gc.resolve(ObjectId::new()),
            invalid,
        )
        .await;
    }
    assert_eq!(r.checked(), 18);

    // Accepted, writing nothing: a transaction that has no record, and a retention so long that
    // its cutoff is before the epoch.
    let before = snapshot(&t.db).await;
    let gc = Gc::new(
        &t.store,
        GcOptions::default().tombstone_retention(Some(Duration::MAX)),
    );
    assert!(!gc.resolve(ObjectId::new()).await.unwrap());
    let summary = gc.run_round().await.unwrap();
    assert_eq!(summary.purged, 0);
    assert_eq!(before, snapshot(&t.db).await, "an idle round wrote");
}
