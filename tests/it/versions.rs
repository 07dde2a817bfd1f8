//! A version never repeats for an id: not after a transaction rolls back, and not after a
//! tombstone is purged and the id inserted again, by this process or another.

use crate::common;

use std::time::Duration;

use crate::common::{Account, TestDb};
use mongotx::{RepoError, Store, Update};

/// Moves "x" through versions 1..=3 and deletes it (tombstone at version 4).
async fn live_and_die(accounts: &mongotx::Repository<Account>) -> i64 {
    accounts
        .insert(&Account::new("x", "first life", 1))
        .await
        .expect("insert");
    for v in 1..=2 {
        accounts
            .update("x", v, &Update::new().set("note", format!("v{}", v + 1)))
            .await
            .expect("update");
    }
    accounts.delete("x", 3).await.expect("delete")
}

async fn assert_stale_versions_never_match(accounts: &mongotx::Repository<Account>, up_to: i64) {
    // Walk the new document through as many versions as the old one had, trying every old
    // version as a stale expectation on the way.
    for step in 0..=up_to {
        let current = accounts.get("x").await.expect("read").version;
        assert!(
            current > up_to,
            "version {current} repeats an old one (<= {up_to})"
        );
        for stale in 1..=up_to {
            let result = accounts
                .update("x", stale, &Update::new().set("owner", "stale writer"))
                .await;
            assert!(
                matches!(result, Err(RepoError::VersionConflict { .. })),
                "stale version {stale} against {current}: {result:?}"
            );
        }
        accounts
            .update(
                "x",
                current,
                &Update::new().set("note", format!("step {step}")),
            )
            .await
            .expect("a current write");
    }
}

#[tokio::test]
async fn an_id_purged_and_inserted_again_never_repeats_a_version() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    let last = live_and_die(&accounts).await;
    assert_eq!(last, 4);
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(
        accounts
            .purge_tombstones(Duration::ZERO)
            .await
            .expect("purge"),
        1
    );
    assert!(matches!(
        accounts.get("x").await,
        Err(RepoError::NotFound { .. })
    ));

    accounts
        .insert(&Account::new("x", "second life", 1))
        .await
        .expect("insert again");
    assert_stale_versions_never_match(&accounts, last).await;
}

#[tokio::test]
async fn another_process_inserting_after_a_purge_starts_above_the_floor_too() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    // A second store (another process): it has read the floor (0) before the purge.
    let other_store = Store::builder(t.other_client_db().await)
        .version_floor_grace(Duration::from_millis(200))
        .build();
    let other = common::open_accounts(&other_store).await;
    other
        .insert(&Account::new("warm", "cache", 1))
        .await
        .expect("read the floor");
    assert_eq!(other.get("warm").await.expect("warm").version, 1);

    let last = live_and_die(&accounts).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    accounts
        .purge_tombstones(Duration::ZERO)
        .await
        .expect("purge");

    // The purge waited out the floor grace, longer than the other store caches the floor.
    other
        .insert(&Account::new("x", "second life", 1))
        .await
        .expect("insert again");
    assert!(other.get("x").await.expect("x").version > last);
    assert_stale_versions_never_match(&other, last).await;
}

#[tokio::test]
async fn a_rolled_back_transaction_leaves_versions_exactly_as_they_were() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 10), ("b", 20)]).await;
    let repo = accounts.clone();
    common::stalled_at(
        &t.store,
        mongotx::testkit::failpoint::BEGIN_BEFORE,
        |tx| async move {
            tx.update(&repo, "a", 1, &Update::new().set("owner", "never"))
                .await?;
            tx.delete(&repo, "b", 1)
        },
    )
    .await;
    mongotx::gc::Gc::new(&t.store, mongotx::gc::GcOptions::default())
        .run_round_at(
            common::hours_from_now(2).to_chrono(),
            &std::sync::atomic::AtomicBool::new(false),
        )
        .await
        .expect("GC round");
    // A caller who read version 1 before the transaction can still write: nothing committed.
    for id in ["a", "b"] {
        let read = accounts.get(id).await.expect("read");
        assert_eq!(read.version, 1, "{id}");
        accounts
            .update(id, 1, &Update::new().set("note", "after"))
            .await
            .expect("the version read before the transaction still holds");
    }
}
