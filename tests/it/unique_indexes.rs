//! Users' unique secondary indexes next to tombstones and transactions.
//!
//! Tombstones clear user fields, so in a plain (non-sparse, non-partial) unique index every
//! tombstone would carry the same missing key; mongotx marks each tombstone's indexed field with a
//! value of its own, so any number of tombstones coexist with the index and a deleted document's
//! key is free again. A write that breaks a unique index fails with a typed, clean error and
//! changes nothing.

use crate::common;

use crate::common::{raw_snapshot, Account, TestDb};
use bson::doc;
use mongodb::options::IndexOptions;
use mongodb::IndexModel;
use mongotx::{Adjust, RepoError, Transactions, TxnError, Update};

async fn unique_owner(t: &TestDb) {
    t.db.collection::<bson::Document>("accounts")
        .create_index(
            IndexModel::builder()
                .keys(doc! { "owner": 1 })
                .options(IndexOptions::builder().unique(true).build())
                .build(),
        )
        .await
        .expect("create the unique index");
}

fn assert_clean(message: &str) {
    for raw in ["E11000", "dup key", "Error {", "kind:", "Kind", "0x"] {
        assert!(
            !message.contains(raw),
            "a raw driver error leaked: {message}"
        );
    }
}

#[tokio::test]
async fn tombstones_coexist_with_a_plain_unique_index_created_before_or_after_opening() {
    for index_first in [true, false] {
        let t = TestDb::new().await;
        if index_first {
            // The collection does not exist yet: create it with the index.
            unique_owner(&t).await;
        }
        let accounts = common::open_accounts(&t.store).await;
        if !index_first {
            unique_owner(&t).await;
        }
        common::seed_accounts(&accounts, &[("a", 1), ("b", 2), ("c", 3), ("d", 4)]).await;
        for id in ["a", "b"] {
            accounts
                .delete(id, 1)
                .await
                .unwrap_or_else(|e| panic!("plain delete of {id}: {e}"));
        }
        let txns = Transactions::new(&t.store);
        let tx = txns.begin();
        tx.delete(&accounts, "c", 1).expect("stage");
        tx.delete(&accounts, "d", 1).expect("stage");
        tx.commit().await.expect("transactional deletes finish");
        for id in ["a", "b", "c", "d"] {
            assert!(
                matches!(accounts.get(id).await, Err(RepoError::Deleted { .. })),
                "{id} (index first: {index_first})"
            );
        }
        // A deleted document's key is free again.
        accounts
            .insert(&Account::new("e", "A", 5))
            .await
            .expect("reuse a deleted owner");
        common::assert_settled(&t, &["accounts"], "after the deletes").await;
    }
}

#[tokio::test]
async fn a_transaction_that_inserts_and_rolls_back_leaves_no_key_behind() {
    let t = TestDb::new().await;
    unique_owner(&t).await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 1)]).await;
    for round in 0..3 {
        let tx = Transactions::new(&t.store).begin();
        tx.insert(
            &accounts,
            &Account::new(&format!("n{round}"), &format!("N{round}"), 1),
        )
        .await
        .expect("stage");
        tx.insert(
            &accounts,
            &Account::new(&format!("m{round}"), &format!("M{round}"), 1),
        )
        .await
        .expect("stage");
        // Fails after the inserts applied: a's version moved.
        tx.adjust(
            &accounts,
            "a",
            round + 1,
            &Adjust::new().by("balance", 1_i64),
        )
        .await
        .expect("stage");
        accounts
            .update(
                "a",
                round + 1,
                &Update::new().set("note", format!("{round}")),
            )
            .await
            .expect("outside write");
        let err = tx.commit().await.expect_err("conflict");
        assert!(
            matches!(err.repo_error(), Some(RepoError::VersionConflict { .. })),
            "{err}"
        );
    }
    assert_eq!(
        raw_snapshot(&t.db, "accounts").await.len(),
        1,
        "no placeholder is left"
    );
    accounts
        .insert(&Account::new("n0", "N0", 1))
        .await
        .expect("the id and key are free");
}

#[tokio::test]
async fn a_duplicate_key_is_a_typed_clean_error_and_changes_nothing() {
    let t = TestDb::new().await;
    unique_owner(&t).await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 1), ("b", 2)]).await;
    let before = raw_snapshot(&t.db, "accounts").await;

    let err = accounts
        .insert(&Account::new("c", "A", 3))
        .await
        .expect_err("owner A is taken");
    match &err {
        RepoError::DuplicateKey {
            collection,
            id,
            index,
        } => {
            assert_eq!((collection.as_str(), id.as_str()), ("accounts", "\"c\""));
            assert_eq!(index, "owner_1");
        }
        other => panic!("expected DuplicateKey, got {other:?}"),
    }
    assert_clean(&err.to_string());
    assert!(!err.is_retryable());

    let err = accounts
        .update("b", 1, &Update::new().set("owner", "A"))
        .await
        .expect_err("owner A is taken");
    assert!(matches!(err, RepoError::DuplicateKey { .. }), "{err:?}");
    assert_clean(&err.to_string());

    let tx = Transactions::new(&t.store).begin();
    tx.adjust(&accounts, "a", 1, &Adjust::new().by("balance", 5_i64))
        .await
        .expect("stage");
    tx.insert(&accounts, &Account::new("d", "B", 4))
        .await
        .expect("stage");
    let err = tx.commit().await.expect_err("owner B is taken");
    assert!(
        matches!(err, TxnError::Document { ref source, .. } if matches!(**source, RepoError::DuplicateKey { .. })),
        "{err:?}"
    );
    assert_clean(&err.to_string());
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
    common::assert_settled(&t, &["accounts"], "after the refused transaction").await;
}
