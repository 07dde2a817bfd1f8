//! Queries see committed values only: filter, sort, skip, limit, projection and count are
//! evaluated on the value each document had at its last commit, whatever transactions hold it
//! meanwhile, whether the results come as a `Vec` (`find`) or a stream (`find_stream`).

use crate::common;

use crate::common::{stalled_at, Account, TestDb};
use bson::doc;
use futures::TryStreamExt;
use mongotx::testkit::failpoint::{BEGIN_BEFORE, COMMIT_AFTER};
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

/// An account read through a projection: fields left out must be optional.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Owner {
    #[serde(rename = "_id")]
    id: String,
    owner: Option<String>,
    balance: Option<i64>,
}

#[tokio::test]
async fn streams_counts_skips_and_projections_see_committed_values_while_a_transaction_is_pending()
{
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(
        &accounts,
        &[("a", 100), ("b", 50), ("c", 10), ("e", 70), ("f", 30)],
    )
    .await;
    let repo = accounts.clone();
    stalled_at(&t.store, BEGIN_BEFORE, |tx| async move {
        tx.adjust(&repo, "a", 1, &Adjust::new().by("balance", -95_i64))
            .await?;
        tx.adjust(&repo, "c", 1, &Adjust::new().by("balance", 490_i64))
            .await?;
        tx.delete(&repo, "e", 1)?;
        tx.insert(&repo, &Account::new("d", "D", 1_000)).await?;
        Ok(())
    })
    .await;

    // The stream: every committed document once, the pending insert and delete unseen.
    let streamed: Vec<_> = accounts
        .find_stream(Query::new().sort(doc! { "balance": -1 }))
        .await
        .expect("find_stream")
        .try_collect()
        .await
        .expect("stream");
    assert_eq!(
        ids(&streamed),
        vec![("a", 100), ("e", 70), ("b", 50), ("f", 30), ("c", 10)]
    );
    let rich: Vec<_> = accounts
        .find_stream(
            Query::new()
                .filter(doc! { "balance": { "$gte": 50_i64 } })
                .limit(2)
                .sort(doc! { "_id": 1 }),
        )
        .await
        .expect("find_stream")
        .try_collect()
        .await
        .expect("stream");
    assert_eq!(ids(&rich), vec![("a", 100), ("b", 50)]);

    // Skip, through both find (held candidates present) and the stream.
    let query = Query::new().sort(doc! { "balance": -1 }).skip(1).limit(3);
    let page = accounts.find(query.clone()).await.expect("find");
    assert_eq!(ids(&page), vec![("e", 70), ("b", 50), ("f", 30)]);
    let streamed: Vec<_> = accounts
        .find_stream(query)
        .await
        .expect("find_stream")
        .try_collect()
        .await
        .expect("stream");
    assert_eq!(ids(&streamed), vec![("e", 70), ("b", 50), ("f", 30)]);
    let rest = accounts
        .find(Query::new().sort(doc! { "balance": -1 }).skip(4))
        .await
        .expect("find");
    assert_eq!(ids(&rest), vec![("c", 10)]);

    // Count, on committed values: a (100 committed, 5 pending) counts as rich, c (10 committed,
    // 500 pending) does not, the pending insert d not at all, the pending delete e still does.
    let rich = Query::new().filter(doc! { "balance": { "$gte": 50_i64 } });
    assert_eq!(accounts.count(rich.clone()).await.expect("count"), 3);
    assert_eq!(accounts.count(Query::new()).await.expect("count"), 5);
    assert_eq!(
        accounts.count(rich.skip(1).limit(1)).await.expect("count"),
        1
    );

    // Projection: only the fields asked for, values committed ones.
    let owners = t.store.repository::<Owner>(common::accounts_spec()).await;
    let owners = owners.expect("the same collection, read through another type");
    let cut = owners
        .find(
            Query::new()
                .sort(doc! { "_id": 1 })
                .projection(doc! { "balance": 1 }),
        )
        .await
        .expect("find with a projection");
    let seen: Vec<_> = cut
        .iter()
        .map(|o| (o.value.id.as_str(), o.value.owner.clone(), o.value.balance))
        .collect();
    assert_eq!(
        seen,
        vec![
            ("a", None, Some(100)),
            ("b", None, Some(50)),
            ("c", None, Some(10)),
            ("e", None, Some(70)),
            ("f", None, Some(30)),
        ]
    );
    assert!(
        cut.iter().all(|o| o.version == 1),
        "versions come through a projection"
    );
    let streamed: Vec<_> = owners
        .find_stream(
            Query::new()
                .filter(doc! { "_id": "c" })
                .projection(doc! { "balance": 0 }),
        )
        .await
        .expect("find_stream")
        .try_collect()
        .await
        .expect("stream");
    assert_eq!(streamed.len(), 1);
    assert_eq!(
        (
            streamed[0].value.owner.as_deref(),
            streamed[0].value.balance
        ),
        (Some("C"), None)
    );

    // Projections that cannot work are refused before anything is sent.
    for bad in [
        doc! { "balance": 1, "owner": 0 },
        doc! { "_id": 0 },
        doc! { "_version": 1 },
        doc! { "_hold": 0 },
        doc! { "total": { "$add": ["$balance", 1] } },
        doc! { "balance": "yes" },
        doc! { "": 1 },
        doc! { "a..b": 1 },
    ] {
        let refused = owners.find(Query::new().projection(bad.clone())).await;
        assert!(
            matches!(refused, Err(RepoError::InvalidQuery { .. })),
            "{bad}: {refused:?}"
        );
        let refused = owners.count(Query::new().projection(bad.clone())).await;
        assert!(
            matches!(refused, Err(RepoError::InvalidQuery { .. })),
            "{bad}"
        );
    }
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

/// An account read through a projection of `_id` alone.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct IdOnly {
    #[serde(rename = "_id")]
    id: String,
}

/// Issue 46, case 1: a projection that names only `_id` once dropped the system fields, the
/// holders' tags and a plain document's copy of itself, so stamped documents read as plain with a
/// fingerprint of `{_id}` as their version and a pending insert came back as a result.
#[tokio::test]
async fn a_projection_of_id_alone_reads_committed_versions_and_no_pending_document() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100), ("b", 50)]).await;
    // A plain document, as another writer stores it.
    t.db.collection::<bson::Document>("accounts")
        .insert_one(doc! { "_id": "p", "owner": "P", "balance": 7_i64 })
        .await
        .unwrap();
    let repo = accounts.clone();
    stalled_at(&t.store, BEGIN_BEFORE, |tx| async move {
        tx.adjust(&repo, "a", 1, &Adjust::new().by("balance", 900_i64))
            .await?;
        tx.insert(&repo, &Account::new("c", "C", 5_000)).await?;
        Ok(())
    })
    .await;
    let ids_only = t
        .store
        .repository::<IdOnly>(common::accounts_spec())
        .await
        .unwrap();
    let whole = accounts
        .find(Query::new().sort(doc! { "_id": 1 }))
        .await
        .unwrap();
    let expected: Vec<(String, i64)> = whole
        .iter()
        .map(|a| (a.value.id.clone(), a.version))
        .collect();
    assert_eq!(
        expected
            .iter()
            .map(|(id, _)| id.as_str())
            .collect::<Vec<_>>(),
        ["a", "b", "p"]
    );
    for projection in [doc! { "_id": 1 }, doc! { "_id": true }, doc! { "_id": 1.0 }] {
        let query = Query::new()
            .sort(doc! { "_id": 1 })
            .projection(projection.clone());
        let cut = ids_only.find(query.clone()).await.unwrap();
        let seen: Vec<(String, i64)> = cut
            .iter()
            .map(|a| (a.value.id.clone(), a.version))
            .collect();
        assert_eq!(
            seen, expected,
            "{projection}: ids and versions of the committed documents"
        );
        assert_eq!(
            cut.iter().map(|a| a.is_plain()).collect::<Vec<_>>(),
            [false, false, true],
            "{projection}"
        );
        let streamed: Vec<_> = ids_only
            .find_stream(query)
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        let seen: Vec<(String, i64)> = streamed
            .iter()
            .map(|a| (a.value.id.clone(), a.version))
            .collect();
        assert_eq!(seen, expected, "{projection}, streamed");
        // `a` matches `balance > 500` only on its uncommitted value, `c` only exists uncommitted.
        let rich = ids_only
            .find(
                Query::new()
                    .filter(doc! { "balance": { "$gt": 500_i64 } })
                    .projection(projection.clone()),
            )
            .await
            .unwrap();
        assert!(rich.is_empty(), "{projection}: {rich:?}");
    }
}
