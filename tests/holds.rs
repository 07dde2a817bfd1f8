//! Documents held by a transaction: writers wait (bounded, with backoff) and then fail `Locked`;
//! the hold resolver seam decides what readers see and may free expired holders.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bson::{doc, oid::ObjectId, Bson, Document};
use common::{raw_snapshot, Account, TestDb};
use mongodb::Database;
use mongotx::error::HoldError;
use mongotx::{
    fields, Adjust, CommittedView, HoldResolver, LockWait, NoTransactions, Query, RepoError, Store,
    Update,
};

fn short_wait(max_wait_ms: u64) -> LockWait {
    LockWait {
        max_wait: Duration::from_millis(max_wait_ms),
        initial_backoff: Duration::from_millis(2),
        max_backoff: Duration::from_millis(20),
    }
}

/// Marks a document as held by `txn`, as the transaction layer does when it applies an action.
async fn hold(db: &Database, id: &str, txn: ObjectId) {
    let result = db
        .collection::<Document>("accounts")
        .update_one(
            doc! { "_id": id },
            doc! { "$set": { fields::ACTIVE_TXN: txn } },
        )
        .await
        .unwrap();
    assert_eq!(result.matched_count, 1);
}

async fn release(db: &Database, id: &str) {
    db.collection::<Document>("accounts")
        .update_one(
            doc! { "_id": id },
            doc! { "$unset": { fields::ACTIVE_TXN: "" } },
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn a_writer_waits_for_a_held_document_then_fails_locked() {
    let t = TestDb::new().await;
    let store = Store::builder(t.db.clone())
        .hold_resolver(Arc::new(NoTransactions))
        .lock_wait(short_wait(300))
        .build();
    let accounts = store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    accounts
        .insert(&Account::new("held", "H", 1))
        .await
        .unwrap();
    let txn = ObjectId::new();
    hold(&t.db, "held", txn).await;
    let before = raw_snapshot(&t.db, "accounts").await;

    for attempt in 0..4 {
        let started = Instant::now();
        let result = match attempt {
            0 => {
                accounts
                    .update("held", 1, &Update::new().set("owner", "x"))
                    .await
            }
            1 => {
                accounts
                    .adjust("held", 1, &Adjust::new().by("balance", 1_i64))
                    .await
            }
            2 => {
                accounts
                    .replace("held", 1, &Account::new("held", "x", 1))
                    .await
            }
            _ => accounts.delete("held", 1).await,
        };
        let elapsed = started.elapsed();
        match result {
            Err(RepoError::Locked {
                holder,
                waited,
                collection,
                ..
            }) => {
                assert_eq!(holder, Some(txn));
                assert_eq!(collection, "accounts");
                assert!(
                    waited >= Duration::from_millis(300),
                    "waited only {waited:?}"
                );
            }
            other => panic!("attempt {attempt}: expected Locked, got {other:?}"),
        }
        assert!(
            elapsed >= Duration::from_millis(300) && elapsed < Duration::from_secs(3),
            "{elapsed:?}"
        );
    }
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn a_writer_proceeds_once_the_holder_lets_go() {
    let t = TestDb::new().await;
    let store = Store::builder(t.db.clone())
        .hold_resolver(Arc::new(NoTransactions))
        .lock_wait(short_wait(5_000))
        .build();
    let accounts = store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    accounts
        .insert(&Account::new("busy", "B", 1))
        .await
        .unwrap();
    hold(&t.db, "busy", ObjectId::new()).await;

    let db = t.db.clone();
    let releaser = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(150)).await;
        release(&db, "busy").await;
    });
    let started = Instant::now();
    let v = accounts
        .update("busy", 1, &Update::new().set("owner", "after"))
        .await
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(150));
    releaser.await.unwrap();
    assert_eq!(v, 2);
    assert_eq!(accounts.get("busy").await.unwrap().owner, "after");
}

#[tokio::test]
async fn the_version_is_checked_after_waiting() {
    let t = TestDb::new().await;
    let store = Store::builder(t.db.clone())
        .hold_resolver(Arc::new(NoTransactions))
        .lock_wait(short_wait(5_000))
        .build();
    let accounts = store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    accounts
        .insert(&Account::new("moved", "M", 1))
        .await
        .unwrap();
    hold(&t.db, "moved", ObjectId::new()).await;

    // The holder commits a change (version 2) and lets go; the waiting writer read version 1.
    let db = t.db.clone();
    let committer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        db.collection::<Document>("accounts")
            .update_one(
                doc! { "_id": "moved" },
                doc! { "$set": { fields::VERSION: 2_i64, "owner": "Committed" }, "$unset": { fields::ACTIVE_TXN: "" } },
            )
            .await
            .unwrap();
    });
    let err = accounts
        .update("moved", 1, &Update::new().set("owner", "Late"))
        .await;
    committer.await.unwrap();
    assert!(
        matches!(
            err,
            Err(RepoError::VersionConflict {
                expected: 1,
                actual: 2,
                ..
            })
        ),
        "{err:?}"
    );
    assert_eq!(accounts.get("moved").await.unwrap().owner, "Committed");
}

/// A resolver that treats every holder as expired and frees the document, counting calls.
struct FreeingResolver {
    calls: AtomicUsize,
}

#[async_trait]
impl HoldResolver for FreeingResolver {
    async fn committed_view(
        &self,
        _db: &Database,
        _collection: &str,
        _stored: &Document,
        _holder: &ObjectId,
    ) -> Result<CommittedView, HoldError> {
        Ok(CommittedView::Stored)
    }

    async fn resolve_holder(
        &self,
        db: &Database,
        collection: &str,
        id: &Bson,
        holder: &ObjectId,
    ) -> Result<bool, HoldError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        db.collection::<Document>(collection)
            .update_one(
                doc! { "_id": id.clone(), fields::ACTIVE_TXN: *holder },
                doc! { "$unset": { fields::ACTIVE_TXN: "" } },
            )
            .await?;
        Ok(true)
    }
}

#[tokio::test]
async fn an_expired_holder_is_resolved_instead_of_waited_on() {
    let t = TestDb::new().await;
    let resolver = Arc::new(FreeingResolver {
        calls: AtomicUsize::new(0),
    });
    // A long wait budget: if the resolver were not consulted, the write would take 10 s.
    let store = Store::builder(t.db.clone())
        .lock_wait(short_wait(10_000))
        .hold_resolver(resolver.clone())
        .build();
    let accounts = store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    accounts
        .insert(&Account::new("stale", "S", 1))
        .await
        .unwrap();
    hold(&t.db, "stale", ObjectId::new()).await;

    let started = Instant::now();
    let v = accounts
        .update("stale", 1, &Update::new().set("owner", "Fresh"))
        .await
        .unwrap();
    assert_eq!(v, 2);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(resolver.calls.load(Ordering::SeqCst), 1);
    let raw = raw_snapshot(&t.db, "accounts").await;
    assert!(!raw[0].contains_key(fields::ACTIVE_TXN));
}

/// A resolver that serves fixed committed views, as the transaction layer will.
struct ViewResolver {
    view: CommittedView,
}

#[async_trait]
impl HoldResolver for ViewResolver {
    async fn committed_view(
        &self,
        _db: &Database,
        _collection: &str,
        _stored: &Document,
        _holder: &ObjectId,
    ) -> Result<CommittedView, HoldError> {
        Ok(self.view.clone())
    }

    async fn resolve_holder(
        &self,
        _db: &Database,
        _collection: &str,
        _id: &Bson,
        _holder: &ObjectId,
    ) -> Result<bool, HoldError> {
        Ok(false)
    }
}

async fn store_with_view(t: &TestDb, view: CommittedView) -> mongotx::Repository<Account> {
    let store = Store::builder(t.db.clone())
        .hold_resolver(Arc::new(ViewResolver { view }))
        .build();
    store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap()
}

#[tokio::test]
async fn readers_see_the_pre_image_of_an_uncommitted_change() {
    let t = TestDb::new().await;
    let plain = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    plain
        .insert(&Account::new("pre", "Before", 10))
        .await
        .unwrap();
    let pre_image = raw_snapshot(&t.db, "accounts").await.remove(0);
    // The transaction applied its change: new owner, version 2, held.
    let txn = ObjectId::new();
    t.db.collection::<Document>("accounts")
        .update_one(
            doc! { "_id": "pre" },
            doc! { "$set": { "owner": "After", fields::VERSION: 2_i64, fields::ACTIVE_TXN: txn } },
        )
        .await
        .unwrap();

    let accounts = store_with_view(&t, CommittedView::PreImage(pre_image)).await;
    let read = accounts.get("pre").await.unwrap();
    assert_eq!((read.owner.as_str(), read.version), ("Before", 1));
    let found = accounts.find(Query::new()).await.unwrap();
    assert_eq!(found[0].owner, "Before");

    // Past the commit point the stored post-image is what readers see.
    let accounts = store_with_view(&t, CommittedView::Stored).await;
    let read = accounts.get("pre").await.unwrap();
    assert_eq!((read.owner.as_str(), read.version), ("After", 2));
}

#[tokio::test]
async fn an_uncommitted_insert_is_invisible_and_a_committed_delete_is_deleted() {
    let t = TestDb::new().await;
    let plain = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    plain
        .insert(&Account::new("pending", "P", 1))
        .await
        .unwrap();
    plain
        .insert(&Account::new("visible", "V", 1))
        .await
        .unwrap();
    hold(&t.db, "pending", ObjectId::new()).await;

    let accounts = store_with_view(&t, CommittedView::Absent).await;
    assert!(matches!(
        accounts.get("pending").await,
        Err(RepoError::NotFound { .. })
    ));
    let found = accounts.find(Query::new()).await.unwrap();
    let ids: Vec<&str> = found.iter().map(|a| a.value.id.as_str()).collect();
    assert_eq!(ids, vec!["visible"]);

    // A delete past its commit point (deleting flag, held) reads as deleted.
    t.db.collection::<Document>("accounts")
        .update_one(
            doc! { "_id": "pending" },
            doc! { "$set": { fields::DELETING: true, fields::VERSION: 2_i64 } },
        )
        .await
        .unwrap();
    let accounts = store_with_view(&t, CommittedView::Stored).await;
    assert!(matches!(
        accounts.get("pending").await,
        Err(RepoError::Deleted { version: 2, .. })
    ));
    let found = accounts.find(Query::new()).await.unwrap();
    assert_eq!(found.len(), 1);
}

/// A resolver whose transaction store is unreachable.
struct BrokenResolver;

#[async_trait]
impl HoldResolver for BrokenResolver {
    async fn committed_view(
        &self,
        _db: &Database,
        _collection: &str,
        _stored: &Document,
        holder: &ObjectId,
    ) -> Result<CommittedView, HoldError> {
        Err(format!("transaction {holder} cannot be read").into())
    }

    async fn resolve_holder(
        &self,
        _db: &Database,
        _collection: &str,
        _id: &Bson,
        holder: &ObjectId,
    ) -> Result<bool, HoldError> {
        Err(format!("transaction {holder} cannot be resolved").into())
    }
}

#[tokio::test]
async fn resolver_failures_are_reported_as_hold_errors() {
    let t = TestDb::new().await;
    let store = Store::builder(t.db.clone())
        .hold_resolver(Arc::new(BrokenResolver))
        .build();
    let accounts = store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    accounts
        .insert(&Account::new("stuck", "S", 1))
        .await
        .unwrap();
    let txn = ObjectId::new();
    hold(&t.db, "stuck", txn).await;
    let before = raw_snapshot(&t.db, "accounts").await;

    let err = accounts.get("stuck").await.unwrap_err();
    assert!(
        matches!(&err, RepoError::Hold { holder, .. } if *holder == txn),
        "{err:?}"
    );
    assert!(err.to_string().contains("cannot be read"));
    let err = accounts
        .update("stuck", 1, &Update::new().set("owner", "x"))
        .await
        .unwrap_err();
    assert!(matches!(err, RepoError::Hold { .. }), "{err:?}");
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[test]
fn backoff_grows_is_jittered_and_capped() {
    let wait = LockWait {
        max_wait: Duration::from_secs(1),
        initial_backoff: Duration::from_millis(4),
        max_backoff: Duration::from_millis(50),
    };
    for attempt in 0..20 {
        let pause = wait.backoff(attempt);
        let ceiling =
            Duration::from_millis(4 * (1_u64 << attempt.min(16))).min(Duration::from_millis(50));
        assert!(
            pause <= ceiling && pause >= ceiling / 2,
            "attempt {attempt}: {pause:?}"
        );
    }
    let samples: std::collections::HashSet<Duration> = (0..32).map(|_| wait.backoff(5)).collect();
    assert!(samples.len() > 1, "backoff must be jittered");
}
