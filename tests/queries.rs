//! Queries see committed values only: filter, sort and limit are evaluated on the value each
//! document had at its last commit, whatever transactions hold it meanwhile.

mod common;

use bson::doc;
use common::{stalled_at, Account, TestDb};
use mongotx::failpoint::{BEGIN_BEFORE, COMMIT_AFTER};
use mongotx::{Adjust, Query, RepoError, Update};

fn ids(found: &[mongotx::Stamped<Account>]) -> Vec<(&str, i64)> {
    found
        .iter()
        .map(|a| (a.value.id.as_str(), a.value.balance))
        .collect()
}

#[tokio::test]
async fn filter_sort_and_limit_see_committed_values_while_a_transaction_is_pending() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100), ("b", 50), ("c", 10)]).await;

    // A pending transaction drains a, fills c and inserts a rich d: none of it is committed.
    let repo = accounts.clone();
    stalled_at(&t.store, BEGIN_BEFORE, |tx| async move {
        tx.adjust(&repo, "a", 1, &Adjust::new().by("balance", -95_i64))
            .await?;
        tx.adjust(&repo, "c", 1, &Adjust::new().by("balance", 490_i64))
            .await?;
        tx.update(&repo, "b", 1, &Update::new().set("owner", "Pending"))
            .await?;
        tx.insert(&repo, &Account::new("d", "D", 1_000)).await?;
        Ok(())
    })
    .await;

    let rich = accounts
        .find(Query::new().filter(doc! { "balance": { "$gte": 100_i64 } }))
        .await
        .expect("find");
    assert_eq!(
        ids(&rich),
        vec![("a", 100)],
        "committed values decide the filter"
    );

    let top = accounts
        .find(Query::new().sort(doc! { "balance": -1 }).limit(2))
        .await
        .expect("find");
    assert_eq!(
        ids(&top),
        vec![("a", 100), ("b", 50)],
        "sort and limit on committed values"
    );

    let by_owner = accounts
        .find(Query::new().filter(doc! { "owner": "B" }))
        .await
        .expect("find");
    assert_eq!(ids(&by_owner), vec![("b", 50)]);
    assert!(accounts
        .find(Query::new().filter(doc! { "owner": "Pending" }))
        .await
        .expect("find")
        .is_empty());

    let all = accounts
        .find(Query::new().sort(doc! { "_id": 1 }))
        .await
        .expect("find");
    assert_eq!(
        ids(&all),
        vec![("a", 100), ("b", 50), ("c", 10)],
        "no pending insert"
    );
    assert!(all.iter().all(|a| a.version == 1), "committed versions");
}

#[tokio::test]
async fn past_the_commit_point_queries_see_the_new_values_before_the_documents_are_freed() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100), ("b", 50), ("c", 10)]).await;
    let repo = accounts.clone();
    stalled_at(&t.store, COMMIT_AFTER, |tx| async move {
        tx.adjust(&repo, "a", 1, &Adjust::new().by("balance", -95_i64))
            .await?;
        tx.adjust(&repo, "c", 1, &Adjust::new().by("balance", 490_i64))
            .await?;
        tx.delete(&repo, "b", 1)?;
        tx.insert(&repo, &Account::new("d", "D", 1_000)).await?;
        Ok(())
    })
    .await;

    let rich = accounts
        .find(
            Query::new()
                .filter(doc! { "balance": { "$gte": 100_i64 } })
                .sort(doc! { "balance": 1 }),
        )
        .await
        .expect("find");
    assert_eq!(ids(&rich), vec![("c", 500), ("d", 1_000)]);
    let top = accounts
        .find(Query::new().sort(doc! { "balance": -1 }).limit(3))
        .await
        .expect("find");
    assert_eq!(
        ids(&top),
        vec![("d", 1_000), ("c", 500), ("a", 5)],
        "the committed delete is gone"
    );
    assert!(matches!(
        accounts.get("b").await,
        Err(RepoError::Deleted { .. })
    ));
}

#[tokio::test]
async fn filters_on_transaction_state_are_refused() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    for filter in [
        doc! { "_txn": { "$exists": true } },
        doc! { "$or": [{ "owner": "x" }, { "_hold.op": "insert" }] },
        doc! { "_deleted": { "$exists": true } },
    ] {
        let err = accounts
            .find(Query::new().filter(filter.clone()))
            .await
            .expect_err("refused");
        assert!(
            matches!(err, RepoError::InvalidQuery { .. }),
            "{filter}: {err:?}"
        );
    }
}
