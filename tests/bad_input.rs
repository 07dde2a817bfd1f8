//! Bad input gets a typed error and changes nothing in the database.

mod common;

use bson::{doc, Bson, Document};
use common::{raw_snapshot, Account, TestDb};
use mongotx::{Adjust, RepoError, Repository, Update};

/// A database holding one account "acc" (balance 10, version 1), plus the raw repository view.
async fn seeded() -> (
    TestDb,
    Repository<Account>,
    Repository<Document>,
    Vec<Document>,
) {
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    let raw = t
        .store
        .repository::<Document>(common::accounts_spec())
        .await
        .unwrap();
    accounts
        .insert(&Account::new("acc", "Owner", 10))
        .await
        .unwrap();
    let before = raw_snapshot(&t.db, "accounts").await;
    (t, accounts, raw, before)
}

fn invalid_field(result: Result<impl std::fmt::Debug, RepoError>) -> String {
    match result {
        Err(RepoError::Invalid {
            field, collection, ..
        }) => {
            assert_eq!(collection, "accounts");
            field
        }
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[tokio::test]
async fn insert_with_a_wrong_field_type_is_invalid() {
    let (t, _, raw, before) = seeded().await;
    let err = raw
        .insert(&doc! { "_id": "x", "owner": "O", "balance": "lots" })
        .await
        .unwrap_err();
    let text = err.to_string();
    assert_eq!(invalid_field(Err::<(), _>(err)), "balance");
    assert!(text.contains("balance") && text.contains("long"), "{text}");
    // An int where the schema wants a long is also a wrong type.
    let err = raw
        .insert(&doc! { "_id": "y", "owner": "O", "balance": 5_i32 })
        .await;
    assert_eq!(invalid_field(err), "balance");
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn insert_missing_a_required_field_is_invalid() {
    let (t, _, raw, before) = seeded().await;
    let err = raw.insert(&doc! { "_id": "x", "balance": 1_i64 }).await;
    assert_eq!(invalid_field(err), "owner");
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn insert_with_an_undeclared_or_out_of_range_field_is_invalid() {
    let (t, _, raw, before) = seeded().await;
    let err = raw
        .insert(&doc! { "_id": "x", "owner": "O", "balance": 1_i64, "colour": "red" })
        .await;
    assert_eq!(invalid_field(err), "colour");
    let err = raw
        .insert(&doc! { "_id": "x", "owner": "O", "balance": 1_i64, "currency": "JPY" })
        .await;
    assert_eq!(invalid_field(err), "currency");
    let err = raw
        .insert(&doc! { "_id": "x", "owner": "O", "balance": 1_i64, "limits": { "daily": -1_i64 } })
        .await;
    assert_eq!(invalid_field(err), "limits.daily");
    let err = raw
        .insert(&doc! { "_id": "", "owner": "O", "balance": 1_i64 })
        .await;
    assert_eq!(invalid_field(err), "_id");
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn callers_cannot_set_system_fields() {
    let (t, _, raw, before) = seeded().await;
    for field in mongotx::fields::ALL {
        let mut value = doc! { "_id": "x", "owner": "O", "balance": 1_i64 };
        value.insert(field, 7_i64);
        match raw.insert(&value).await {
            Err(RepoError::SystemField { field: named, .. }) => assert_eq!(named, field),
            other => panic!("{field}: expected SystemField, got {other:?}"),
        }
    }
    let err = raw
        .update("acc", 1, &Update::new().set("_version", 99_i64))
        .await;
    assert!(
        matches!(err, Err(RepoError::SystemField { ref field, .. }) if field == "_version"),
        "{err:?}"
    );
    let err = raw.update("acc", 1, &Update::new().unset("_txn")).await;
    assert!(matches!(err, Err(RepoError::SystemField { .. })), "{err:?}");
    let err = raw
        .adjust("acc", 1, &Adjust::new().by("_version", 1_i64))
        .await;
    assert!(matches!(err, Err(RepoError::SystemField { .. })), "{err:?}");
    let mut replacement = doc! { "_id": "acc", "owner": "O", "balance": 1_i64 };
    replacement.insert("_deleted", bson::DateTime::now());
    let err = raw.replace("acc", 1, &replacement).await;
    assert!(matches!(err, Err(RepoError::SystemField { .. })), "{err:?}");
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn non_positive_expected_versions_are_rejected() {
    let (t, accounts, _, before) = seeded().await;
    for version in [0, -1, i64::MIN] {
        let results = [
            accounts
                .update("acc", version, &Update::new().set("owner", "x"))
                .await,
            accounts
                .adjust("acc", version, &Adjust::new().by("balance", 1_i64))
                .await,
            accounts
                .replace("acc", version, &Account::new("acc", "x", 1))
                .await,
            accounts.delete("acc", version).await,
        ];
        for result in results {
            assert!(
                matches!(result, Err(RepoError::InvalidVersion { version: v, .. }) if v == version),
                "{result:?}"
            );
        }
    }
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn non_finite_or_non_numeric_increments_are_rejected() {
    let (t, accounts, _, before) = seeded().await;
    let amounts: [Bson; 5] = [
        Bson::Double(f64::NAN),
        Bson::Double(f64::INFINITY),
        Bson::Double(f64::NEG_INFINITY),
        Bson::String("1".into()),
        Bson::Decimal128("1".parse().unwrap()),
    ];
    for amount in amounts {
        let err = accounts
            .adjust("acc", 1, &Adjust::new().by("limits.rate", amount.clone()))
            .await;
        assert!(
            matches!(&err, Err(RepoError::InvalidIncrement { field, .. }) if field == "limits.rate"),
            "{amount:?}: {err:?}"
        );
    }
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn increments_must_fit_the_declared_numeric_type() {
    let (t, accounts, _, before) = seeded().await;
    // A double added to a long field would turn it into a double.
    let err = accounts
        .adjust("acc", 1, &Adjust::new().by("balance", 0.5))
        .await;
    assert_eq!(invalid_field(err), "balance");
    // A string field cannot be incremented at all.
    let err = accounts
        .adjust("acc", 1, &Adjust::new().by("owner", 1_i64))
        .await;
    assert_eq!(invalid_field(err), "owner");
    // An undeclared field is rejected by additionalProperties: false.
    let err = accounts
        .adjust("acc", 1, &Adjust::new().by("points", 1_i64))
        .await;
    assert_eq!(invalid_field(err), "points");
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn ids_of_the_wrong_type_are_rejected() {
    let (t, accounts, raw, before) = seeded().await;
    let check = |result: Result<(), RepoError>| match result {
        Err(RepoError::InvalidId {
            found, expected, ..
        }) => {
            assert_eq!(found, "int");
            assert_eq!(expected, "string");
        }
        other => panic!("expected InvalidId, got {other:?}"),
    };
    check(accounts.get(42).await.map(|_| ()));
    check(
        accounts
            .update(42, 1, &Update::new().set("owner", "x"))
            .await
            .map(|_| ()),
    );
    check(
        accounts
            .adjust(42, 1, &Adjust::new().by("balance", 1_i64))
            .await
            .map(|_| ()),
    );
    check(accounts.delete(42, 1).await.map(|_| ()));
    check(
        raw.insert(&doc! { "_id": 42, "owner": "O", "balance": 1_i64 })
            .await
            .map(|_| ()),
    );
    let notes = t
        .store
        .repository::<common::Note>(common::notes_spec())
        .await
        .unwrap();
    assert!(matches!(
        notes.get("not-an-oid").await,
        Err(RepoError::InvalidId { .. })
    ));
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn updates_are_validated_field_by_field() {
    let (t, accounts, _, before) = seeded().await;
    let cases: Vec<(Update, &str)> = vec![
        (Update::new().set("balance", "ten"), "balance"),
        (Update::new().set("currency", "JPY"), "currency"),
        (Update::new().set("nickname", "Bo"), "nickname"),
        (Update::new().set("limits.daily", -5_i64), "limits.daily"),
        (Update::new().set("limits.weekly", 5_i64), "limits.weekly"),
        (Update::new().unset("owner"), "owner"),
        (Update::new().set("_id", "renamed"), "_id"),
        (
            Update::new()
                .set("limits", doc! {})
                .set("limits.daily", 1_i64),
            "limits.daily",
        ),
        (Update::new().set("note", "a").unset("note"), "note"),
        (Update::new().set("a..b", 1), "a..b"),
        (Update::new().set("$where", 1), "$where"),
        (Update::new().set("tags.0", "x"), "tags.0"),
    ];
    for (update, field) in cases {
        let err = accounts.update("acc", 1, &update).await;
        assert_eq!(invalid_field(err), field, "{update:?}");
    }
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn empty_changes_are_rejected() {
    let (t, accounts, _, before) = seeded().await;
    let err = accounts.update("acc", 1, &Update::new()).await;
    assert!(matches!(err, Err(RepoError::EmptyChange { .. })), "{err:?}");
    let err = accounts.adjust("acc", 1, &Adjust::new()).await;
    assert!(matches!(err, Err(RepoError::EmptyChange { .. })), "{err:?}");
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn replace_with_a_different_id_is_invalid() {
    let (t, accounts, _, before) = seeded().await;
    let err = accounts
        .replace("acc", 1, &Account::new("other", "O", 1))
        .await;
    assert_eq!(invalid_field(err), "_id");
    let err = accounts
        .replace("acc", 1, &Account::new("acc", "", 1))
        .await;
    assert_eq!(invalid_field(err), "owner");
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn values_that_are_not_documents_cannot_be_stored() {
    let t = TestDb::new().await;
    let numbers = t
        .store
        .repository::<i64>(common::accounts_spec())
        .await
        .unwrap();
    let err = numbers.insert(&5).await.unwrap_err();
    assert!(
        matches!(&err, RepoError::Encode { collection, .. } if collection == "accounts"),
        "{err:?}"
    );
    assert!(raw_snapshot(&t.db, "accounts").await.is_empty());
}
