//! Bad input gets a typed error and changes nothing in the database.

use crate::common;
use crate::refuse;

use crate::common::{raw_snapshot, Account, TestDb};
use bson::{doc, Bson, Document};
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
async fn expected_versions_outside_the_range_are_rejected() {
    let (t, accounts, _, before) = seeded().await;
    for version in [0, -1, i64::MIN, i64::MAX] {
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

/// A schema that lets any other field in (no `additionalProperties: false`), so that only
/// mongotx's own checks stand between a caller and a field name it could not address later.
const LOOSE: &str = r#"{
  "bsonType": "object",
  "required": ["_id", "_schema", "_version"],
  "properties": {
    "_id": { "bsonType": "string" },
    "_schema": { "bsonType": "long", "minimum": 1 },
    "_version": { "bsonType": "long", "minimum": 1 },
    "_txn": { "bsonType": "objectId" },
    "_deleted": { "bsonType": "date" },
    "_deleting": { "bsonType": "bool" },
    "n": { "bsonType": ["long", "int"] }
  }
}"#;

async fn loose(t: &TestDb) -> Repository<Document> {
    let repo = t
        .store
        .repository::<Document>(mongotx::CollectionSpec::new("loose", 1, LOOSE).unwrap())
        .await
        .unwrap();
    repo.insert(&doc! { "_id": "kept", "n": 1_i64, "inner": { "a": 1 } })
        .await
        .unwrap();
    repo
}

fn invalid_at(field: &'static str) -> impl Fn(&RepoError) -> bool {
    move |e| matches!(e, RepoError::Invalid { field: f, collection, .. } if f == field && collection == "loose")
}

/// Field names mongotx could not address afterwards (empty, `$`-prefixed, dotted, at any depth,
/// inside arrays too) and names in its own `_mongotx` namespace are refused on insert, replace,
/// and inside the values of an update, in a transaction as outside one.
#[tokio::test]
async fn field_names_that_paths_cannot_reach_are_refused() {
    let t = TestDb::new().await;
    let repo = loose(&t).await;
    let mut r = common::refusals::Refusals::new(&t.db);
    let cases: Vec<(&str, Document, &'static str)> = vec![
        ("a top-level $ name", doc! { "_id": "x", "$x": 1 }, "$x"),
        (
            "a top-level dotted name",
            doc! { "_id": "x", "a.b": 1 },
            "a.b",
        ),
        ("an empty name", doc! { "_id": "x", "": 1 }, ""),
        (
            "a nested $ name",
            doc! { "_id": "x", "a": { "$gt": 1 } },
            "a.$gt",
        ),
        (
            "a nested dotted name",
            doc! { "_id": "x", "a": { "b": { "c.d": 1 } } },
            "a.b.c.d",
        ),
        (
            "a dotted name inside an array",
            doc! { "_id": "x", "list": [1, { "p.q": 2 }] },
            "list.1.p.q",
        ),
    ];
    for (what, value, field) in cases {
        refuse!(r, what, repo.insert(&value), RepoError::Invalid { .. });
        r.check(
            &format!("replace with {what}"),
            repo.replace("kept", 1, &value_with_id(value.clone(), "kept")),
            invalid_at(field),
        )
        .await;
        let tx = mongotx::Transactions::new(&t.store).begin();
        r.check(
            &format!("a transaction's insert of {what}"),
            tx.insert(&repo, &value),
            |e| matches!(e.repo_error(), Some(RepoError::Invalid { .. })),
        )
        .await;
    }
    for name in ["_mongotx_known", "_mongotx", "_mongotxstate"] {
        let mut value = doc! { "_id": "x" };
        value.insert(name, 1);
        r.check(
            &format!("an insert naming {name}"),
            repo.insert(&value),
            |e| matches!(e, RepoError::SystemField { field, .. } if field == name),
        )
        .await;
        r.check(
            &format!("an update setting {name}"),
            repo.update("kept", 1, &Update::new().set(name, 1)),
            |e| matches!(e, RepoError::SystemField { .. }),
        )
        .await;
    }
    refuse!(
        r,
        "an update whose value holds a $ name",
        repo.update("kept", 1, &Update::new().set("inner", doc! { "$set": 1 })),
        RepoError::Invalid { .. }
    );
    refuse!(
        r,
        "an update whose value holds a dotted name",
        repo.update("kept", 1, &Update::new().set("inner", doc! { "a.b": 1 })),
        RepoError::Invalid { .. }
    );
    assert!(r.checked() >= 26, "{}", r.checked());
}

fn value_with_id(mut value: Document, id: &str) -> Document {
    value.insert("_id", id);
    value
}

/// An increment that would take a 64-bit integer past its range is refused before anything is
/// written, whatever the server would do with it (MongoDB refuses such an `$inc`; a server that
/// wraps around would store a wrong number): by `adjust`, and by a transaction's `adjust`,
/// which checks the stored value it staged against.
#[tokio::test]
async fn increments_past_the_64_bit_range_are_refused() {
    let t = TestDb::new().await;
    let repo = loose(&t).await;
    repo.insert(&doc! { "_id": "top", "n": i64::MAX - 1 })
        .await
        .unwrap();
    repo.insert(&doc! { "_id": "bottom", "n": i64::MIN + 1 })
        .await
        .unwrap();
    repo.insert(&doc! { "_id": "text", "n": 1_i64, "label": "x" })
        .await
        .unwrap();
    let mut r = common::refusals::Refusals::new(&t.db);
    let overflow = |e: &RepoError| {
        matches!(e, RepoError::InvalidIncrement { field, reason, collection, .. }
            if field == "n" && reason.contains("overflows") && collection == "loose")
    };
    for (id, by) in [
        ("top", 2_i64),
        ("top", i64::MAX),
        ("bottom", -2),
        ("bottom", i64::MIN),
    ] {
        r.check(
            &format!("adjust of {id} by {by}"),
            repo.adjust(id, 1, &Adjust::new().by("n", by)),
            overflow,
        )
        .await;
        let tx = mongotx::Transactions::new(&t.store).begin();
        r.check(
            &format!("a transaction's adjust of {id} by {by}"),
            tx.adjust(&repo, id, 1, &Adjust::new().by("n", by)),
            |e| e.repo_error().is_some_and(overflow),
        )
        .await;
    }
    // One overflowing increment among several refuses the whole adjust.
    refuse!(
        r,
        "two increments, the second overflowing",
        repo.adjust("top", 1, &Adjust::new().by("m", 1_i64).by("n", 5_i32)),
        RepoError::InvalidIncrement { .. }
    );
    refuse!(
        r,
        "an increment of a string",
        repo.adjust("text", 1, &Adjust::new().by("label", 1_i64)),
        RepoError::InvalidIncrement { .. }
    );
    let tx = mongotx::Transactions::new(&t.store).begin();
    r.check(
        "a transaction's increment of a string",
        tx.adjust(&repo, "text", 1, &Adjust::new().by("label", 1_i64)),
        |e| matches!(e.repo_error(), Some(RepoError::InvalidIncrement { .. })),
    )
    .await;
    // Up to the edge is fine, and exact.
    assert_eq!(
        repo.adjust("top", 1, &Adjust::new().by("n", 1_i64))
            .await
            .unwrap(),
        2
    );
    assert_eq!(
        repo.get("top").await.unwrap().value.get_i64("n"),
        Ok(i64::MAX)
    );
    assert!(r.checked() >= 11);
}

/// Queries that cannot mean anything on committed values: a negative limit (the driver's
/// "single batch" reading), sort orders other than 1 and -1, filters and sorts on transaction
/// state.
#[tokio::test]
async fn malformed_queries_are_refused() {
    let (t, accounts, _, _) = seeded().await;
    let mut r = common::refusals::Refusals::new(&t.db);
    let cases: Vec<(&str, mongotx::Query)> = vec![
        ("limit -1", mongotx::Query::new().limit(-1)),
        ("limit i64::MIN", mongotx::Query::new().limit(i64::MIN)),
        (
            "sort order 2",
            mongotx::Query::new().sort(doc! { "balance": 2 }),
        ),
        (
            "sort order 0",
            mongotx::Query::new().sort(doc! { "balance": 0 }),
        ),
        (
            "sort order \"asc\"",
            mongotx::Query::new().sort(doc! { "balance": "asc" }),
        ),
        (
            "a text-score sort",
            mongotx::Query::new().sort(doc! { "balance": { "$meta": "textScore" } }),
        ),
        (
            "a filter on _txn",
            mongotx::Query::new().filter(doc! { "_txn": { "$exists": true } }),
        ),
        (
            "a filter on _hold inside $and",
            mongotx::Query::new().filter(doc! { "$and": [{ "_hold.op": "insert" }] }),
        ),
        (
            "a filter on _mongotx_known",
            mongotx::Query::new().filter(doc! { "_mongotx_known": 1 }),
        ),
        (
            "a sort on _deleted",
            mongotx::Query::new().sort(doc! { "_deleted": 1 }),
        ),
    ];
    for (what, query) in cases {
        r.check(
            what,
            accounts.find(query),
            |e| matches!(e, RepoError::InvalidQuery { collection, .. } if collection == "accounts"),
        )
        .await;
    }
    // 0 is "no limit", as in the driver.
    assert_eq!(
        accounts
            .find(mongotx::Query::new().limit(0))
            .await
            .unwrap()
            .len(),
        1
    );
    assert_eq!(r.checked(), 10);
}

/// A repository cannot be opened on the collections mongotx keeps its own records in (it could
/// overwrite transaction records or the collection registry), nor on names MongoDB refuses.
#[tokio::test]
async fn repositories_on_reserved_collections_are_refused() {
    let (t, _, _, _) = seeded().await;
    let mut r = common::refusals::Refusals::new(&t.db);
    for name in [
        mongotx::collections::TRANSACTIONS_COLLECTION,
        mongotx::collections::META_COLLECTION,
    ] {
        let spec = mongotx::CollectionSpec::new(name, 1, LOOSE).unwrap();
        r.check(
            &format!("a repository on {name}"),
            t.store.repository::<Document>(spec),
            |e| matches!(e, RepoError::Spec { source: mongotx::schema::SpecError::Name { name: n, .. } } if n == name),
        )
        .await;
    }
    // A store whose transactions live elsewhere refuses that name instead.
    let store = mongotx::Store::builder(t.db.clone())
        .transactions_collection("my_txns")
        .build();
    refuse!(
        r,
        "a repository on a renamed transactions collection",
        store.repository::<Document>(mongotx::CollectionSpec::new("my_txns", 1, LOOSE).unwrap()),
        RepoError::Spec {
            source: mongotx::schema::SpecError::Name { .. }
        }
    );
    for name in ["", "system.users", "a$b", "nul\0name"] {
        let err = mongotx::CollectionSpec::new(name, 1, LOOSE).unwrap_err();
        assert!(
            matches!(err, mongotx::schema::SpecError::Name { .. }),
            "{name:?}: {err:?}"
        );
    }
    assert_eq!(r.checked(), 3);
}

/// Filters the server cannot parse are the caller's mistake: refused as `InvalidQuery` naming
/// the collection and what is wrong, before anything is sent (servers differ in what they check
/// and how they say it); so are operators that cannot run on committed values.
#[tokio::test]
async fn filters_the_server_cannot_parse_are_invalid_queries() {
    let (t, accounts, _, _) = seeded().await;
    let mut r = common::refusals::Refusals::new(&t.db);
    let filters: Vec<(&str, Document)> = vec![
        (
            "an unknown field operator",
            doc! { "balance": { "$bogus": 1 } },
        ),
        (
            "an unknown top-level operator",
            doc! { "$bogus": [{ "a": 1 }] },
        ),
        ("$in without an array", doc! { "balance": { "$in": 5 } }),
        ("$and without an array", doc! { "$and": { "a": 1 } }),
        ("an empty $or", doc! { "$or": [] }),
        ("$where", doc! { "$where": "this.balance > 1" }),
        ("$text", doc! { "$text": { "$search": "x" } }),
    ];
    for (what, filter) in filters {
        r.check(
            what,
            accounts.find(mongotx::Query::new().filter(filter)),
            |e| matches!(e, RepoError::InvalidQuery { collection, .. } if collection == "accounts"),
        )
        .await;
    }
    assert_eq!(r.checked(), 7);
}

/// A store pointed at a transactions collection MongoDB cannot have refuses to open
/// repositories, before anything is written.
#[tokio::test]
async fn stores_with_unusable_transaction_collections_are_refused() {
    let t = TestDb::new().await;
    let mut r = common::refusals::Refusals::new(&t.db);
    for name in ["", "system.txns", "a$b"] {
        let store = mongotx::Store::builder(t.db.clone())
            .transactions_collection(name)
            .build();
        r.check(
            &format!("transactions collection {name:?}"),
            store.repository::<Account>(common::accounts_spec()),
            |e| {
                matches!(
                    e,
                    RepoError::Spec {
                        source: mongotx::schema::SpecError::Name { .. }
                    }
                )
            },
        )
        .await;
    }
    assert_eq!(r.checked(), 3);
}
