//! Repository basics against a real server: insert, get, find, update, adjust, replace, delete,
//! tombstones and purge.

use crate::common;

use std::time::Duration;

use crate::common::{raw_snapshot, Account, Note, TestDb};
use bson::{doc, Bson};
use mongotx::fields::FIRST_VERSION;
use mongotx::{fields, Adjust, Query, RepoError, Update};

#[tokio::test]
async fn insert_then_get_round_trips_with_version_one() {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    let alice = Account::new("alice", "Alice", 100);

    let id = accounts.insert(&alice).await.unwrap();
    assert_eq!(id, Bson::String("alice".into()));

    let read = accounts.get("alice").await.unwrap();
    assert_eq!(read.version, FIRST_VERSION);
    assert_eq!(read.stored_schema_version, 1);
    assert_eq!(read.value, alice);
    assert_eq!(read.balance, 100, "Stamped derefs to the value");

    let raw = raw_snapshot(&t.db, "accounts").await;
    assert_eq!(raw.len(), 1);
    assert_eq!(raw[0].get_i64(fields::VERSION).unwrap(), 1);
    assert_eq!(raw[0].get_i64(fields::SCHEMA_VERSION).unwrap(), 1);
    assert!(!raw[0].contains_key(fields::ACTIVE_TXN));
    assert!(!raw[0].contains_key(fields::DELETED));
    assert!(!raw[0].contains_key(fields::DELETING));
}

#[tokio::test]
async fn insert_of_taken_id_is_duplicate_and_keeps_the_original() {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    accounts
        .insert(&Account::new("bob", "Bob", 5))
        .await
        .unwrap();
    let before = raw_snapshot(&t.db, "accounts").await;

    let err = accounts
        .insert(&Account::new("bob", "Impostor", 999))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, RepoError::DuplicateId { collection, id } if collection == "accounts" && id == "\"bob\""),
        "{err:?}"
    );
    assert!(err.to_string().contains("accounts/\"bob\""), "{err}");
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn insert_without_id_generates_an_object_id() {
    let t = TestDb::new().await;
    let notes = t
        .store
        .repository::<Note>(common::notes_spec())
        .await
        .unwrap();
    let note = Note {
        id: None,
        text: "hello".into(),
        tags: vec!["a".into()],
    };

    let id = notes.insert(&note).await.unwrap();
    let Bson::ObjectId(oid) = id else {
        panic!("expected an ObjectId, got {id:?}")
    };
    let read = notes.get(oid).await.unwrap();
    assert_eq!(read.value.id, Some(oid));
    assert_eq!(read.value.text, "hello");
}

#[tokio::test]
async fn get_of_unknown_id_is_not_found() {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    let err = accounts.get("nobody").await.unwrap_err();
    assert!(
        matches!(&err, RepoError::NotFound { id, .. } if id == "\"nobody\""),
        "{err:?}"
    );
}

#[tokio::test]
async fn delete_leaves_a_tombstone_that_reads_as_deleted_until_purged() {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    let mut carol = Account::new("carol", "Carol", 7);
    carol.note = Some("to be cleared".into());
    accounts.insert(&carol).await.unwrap();

    let v = accounts.delete("carol", 1).await.unwrap();
    assert_eq!(v, 2);

    let err = accounts.get("carol").await.unwrap_err();
    assert!(
        matches!(err, RepoError::Deleted { version: 2, .. }),
        "{err:?}"
    );

    // The tombstone keeps only _id, schema version, version and the deletion time.
    let raw = raw_snapshot(&t.db, "accounts").await;
    let mut keys: Vec<&str> = raw[0].keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, vec!["_deleted", "_id", "_schema", "_version"]);

    // A young tombstone survives a purge with a long retention...
    assert_eq!(
        accounts
            .purge_tombstones(Duration::from_secs(3600))
            .await
            .unwrap(),
        0
    );
    assert!(matches!(
        accounts.get("carol").await,
        Err(RepoError::Deleted { .. })
    ));
    // ...and is gone after a purge with zero retention: now it was never there.
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(accounts.purge_tombstones(Duration::ZERO).await.unwrap(), 1);
    assert!(matches!(
        accounts.get("carol").await,
        Err(RepoError::NotFound { .. })
    ));
}

#[tokio::test]
async fn purge_removes_only_old_tombstones() {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    for id in ["old", "young", "alive"] {
        accounts.insert(&Account::new(id, "X", 1)).await.unwrap();
    }
    accounts.delete("old", 1).await.unwrap();
    accounts.delete("young", 1).await.unwrap();
    // Age the first tombstone by two hours.
    let two_hours_ago =
        bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() - 7_200_000);
    t.db.collection::<bson::Document>("accounts")
        .update_one(
            doc! { "_id": "old" },
            doc! { "$set": { fields::DELETED: two_hours_ago } },
        )
        .await
        .unwrap();

    assert_eq!(
        accounts
            .purge_tombstones(Duration::from_secs(3600))
            .await
            .unwrap(),
        1
    );
    assert!(matches!(
        accounts.get("old").await,
        Err(RepoError::NotFound { .. })
    ));
    assert!(matches!(
        accounts.get("young").await,
        Err(RepoError::Deleted { .. })
    ));
    assert_eq!(accounts.get("alive").await.unwrap().version, 1);
}

#[tokio::test]
async fn update_sets_and_unsets_fields_and_returns_the_next_version() {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    let mut dave = Account::new("dave", "Dave", 10);
    dave.note = Some("old note".into());
    accounts.insert(&dave).await.unwrap();

    let v2 = accounts
        .update(
            "dave",
            1,
            &Update::new()
                .set("owner", "David")
                .set("currency", "EUR")
                .unset("note"),
        )
        .await
        .unwrap();
    assert_eq!(v2, 2);
    let read = accounts.get("dave").await.unwrap();
    assert_eq!(read.version, 2);
    assert_eq!(read.owner, "David");
    assert_eq!(read.currency.as_deref(), Some("EUR"));
    assert_eq!(read.note, None);

    let v3 = accounts
        .update("dave", 2, &Update::new().set("limits.daily", 500_i64))
        .await
        .unwrap();
    assert_eq!(v3, 3);
    let raw = raw_snapshot(&t.db, "accounts").await;
    assert_eq!(
        raw[0]
            .get_document("limits")
            .unwrap()
            .get_i64("daily")
            .unwrap(),
        500
    );
    assert_eq!(raw[0].get_i64(fields::VERSION).unwrap(), 3);
}

#[tokio::test]
async fn update_with_a_stale_version_is_a_conflict_naming_both_versions() {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    accounts
        .insert(&Account::new("erin", "Erin", 1))
        .await
        .unwrap();
    accounts
        .update("erin", 1, &Update::new().set("owner", "Erin B"))
        .await
        .unwrap();
    let before = raw_snapshot(&t.db, "accounts").await;

    let err = accounts
        .update("erin", 1, &Update::new().set("owner", "Lost"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, RepoError::VersionConflict { expected: 1, actual: 2, collection, .. } if collection == "accounts"),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("expected version 1") && text.contains("found 2"),
        "{text}"
    );
    assert!(err.is_retryable());
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn adjust_increments_numbers_and_bumps_the_version() {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    accounts
        .insert(&Account::new("fay", "Fay", 100))
        .await
        .unwrap();

    let v = accounts
        .adjust("fay", 1, &Adjust::new().by("balance", -30_i64))
        .await
        .unwrap();
    assert_eq!(v, 2);
    let v = accounts
        .adjust(
            "fay",
            2,
            &Adjust::new().by("balance", 5_i32).by("limits.rate", 0.25),
        )
        .await
        .unwrap();
    assert_eq!(v, 3);

    let raw = raw_snapshot(&t.db, "accounts").await;
    assert_eq!(
        raw[0].get("balance"),
        Some(&Bson::Int64(75)),
        "long stays long"
    );
    assert_eq!(
        raw[0]
            .get_document("limits")
            .unwrap()
            .get_f64("rate")
            .unwrap(),
        0.25
    );
    assert_eq!(accounts.get("fay").await.unwrap().balance, 75);

    let err = accounts
        .adjust("fay", 2, &Adjust::new().by("balance", 1_i64))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            RepoError::VersionConflict {
                expected: 2,
                actual: 3,
                ..
            }
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn replace_writes_the_whole_value() {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    let mut gus = Account::new("gus", "Gus", 1);
    gus.note = Some("n".into());
    accounts.insert(&gus).await.unwrap();

    let mut read = accounts.get("gus").await.unwrap();
    read.value.balance = 42;
    read.value.note = None;
    let v = accounts
        .replace("gus", read.version, &read.value)
        .await
        .unwrap();
    assert_eq!(v, 2);
    let again = accounts.get("gus").await.unwrap();
    assert_eq!(again.value, read.value);
    assert_eq!(again.version, 2);

    let err = accounts.replace("gus", 1, &read.value).await.unwrap_err();
    assert!(
        matches!(
            err,
            RepoError::VersionConflict {
                expected: 1,
                actual: 2,
                ..
            }
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn every_write_to_a_tombstone_is_deleted_and_changes_nothing() {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    accounts
        .insert(&Account::new("hal", "Hal", 1))
        .await
        .unwrap();
    accounts.delete("hal", 1).await.unwrap();
    let before = raw_snapshot(&t.db, "accounts").await;

    let results = [
        accounts
            .update("hal", 2, &Update::new().set("owner", "x"))
            .await,
        accounts
            .adjust("hal", 2, &Adjust::new().by("balance", 1_i64))
            .await,
        accounts
            .replace("hal", 2, &Account::new("hal", "x", 1))
            .await,
        accounts.delete("hal", 2).await,
    ];
    for result in results {
        assert!(
            matches!(result, Err(RepoError::Deleted { version: 2, .. })),
            "{result:?}"
        );
    }
    assert!(matches!(
        accounts.insert(&Account::new("hal", "Reborn", 1)).await,
        Err(RepoError::DuplicateId { .. })
    ));
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn every_write_to_an_unknown_id_is_not_found() {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    let results = [
        accounts
            .update("ghost", 1, &Update::new().set("owner", "x"))
            .await,
        accounts
            .adjust("ghost", 1, &Adjust::new().by("balance", 1_i64))
            .await,
        accounts
            .replace("ghost", 1, &Account::new("ghost", "x", 1))
            .await,
        accounts.delete("ghost", 1).await,
    ];
    for result in results {
        assert!(
            matches!(result, Err(RepoError::NotFound { .. })),
            "{result:?}"
        );
    }
    assert!(raw_snapshot(&t.db, "accounts").await.is_empty());
}

#[tokio::test]
async fn find_filters_sorts_limits_and_skips_tombstones() {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    for (id, balance) in [("a", 50), ("b", 10), ("c", 30), ("d", 40), ("e", 20)] {
        accounts
            .insert(&Account::new(id, "X", balance))
            .await
            .unwrap();
    }
    accounts.delete("d", 1).await.unwrap();

    let all = accounts
        .find(Query::new().sort(doc! { "_id": 1 }))
        .await
        .unwrap();
    let ids: Vec<&str> = all.iter().map(|a| a.value.id.as_str()).collect();
    assert_eq!(ids, vec!["a", "b", "c", "e"], "tombstone d is skipped");

    let rich = accounts
        .find(
            Query::new()
                .filter(doc! { "balance": { "$gte": 20_i64 } })
                .sort(doc! { "balance": -1 })
                .limit(2),
        )
        .await
        .unwrap();
    let balances: Vec<i64> = rich.iter().map(|a| a.balance).collect();
    assert_eq!(balances, vec![50, 30]);
    assert!(rich.iter().all(|a| a.version == 1));

    // A filter that only a tombstone would match returns nothing.
    let none = accounts
        .find(Query::new().filter(doc! { "_id": "d" }))
        .await
        .unwrap();
    assert!(none.is_empty());
}

#[tokio::test]
async fn two_concurrent_updates_of_one_version_let_exactly_one_win() {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    accounts
        .insert(&Account::new("ivy", "Ivy", 0))
        .await
        .unwrap();

    let mut handles = Vec::new();
    for owner in ["first", "second"] {
        let accounts = accounts.clone();
        handles.push(tokio::spawn(async move {
            accounts
                .update("ivy", 1, &Update::new().set("owner", owner))
                .await
        }));
    }
    let mut wins = 0;
    let mut conflicts = 0;
    for handle in handles {
        match handle.await.unwrap() {
            Ok(2) => wins += 1,
            Err(RepoError::VersionConflict {
                expected: 1,
                actual: 2,
                ..
            }) => conflicts += 1,
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    assert_eq!((wins, conflicts), (1, 1));
    assert_eq!(accounts.get("ivy").await.unwrap().version, 2);
}
