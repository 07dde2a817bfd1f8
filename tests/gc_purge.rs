//! The GC's tombstone purge: tombstones older than the retention go; fresh tombstones, live and
//! held documents, and documents of collections mongotx does not manage stay.

mod common;

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use bson::{doc, DateTime, Document};
use common::{hours_from_now, TestDb};
use mongotx::{fields, Gc, GcOptions, RepoError};

#[tokio::test]
async fn the_gc_purges_only_stamped_tombstones_older_than_the_retention() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(
        &accounts,
        &[("gone1", 1), ("gone2", 2), ("live", 3), ("held", 4)],
    )
    .await;
    accounts.delete("gone1", 1).await.expect("delete");
    accounts.delete("gone2", 1).await.expect("delete");
    // A tombstone still held by a transaction in flight is that transaction's business.
    accounts.delete("held", 1).await.expect("delete");
    let raw = t.db.collection::<Document>("accounts");
    raw.update_one(
        doc! { "_id": "held" },
        doc! { "$set": { fields::ACTIVE_TXN: bson::oid::ObjectId::new() } },
    )
    .await
    .expect("hold the tombstone");
    // Another application's collection with look-alike fields but no mongotx stamp.
    let foreign = t.db.collection::<Document>("foreign");
    foreign
        .insert_one(doc! { "_id": 1, fields::DELETED: DateTime::from_millis(0) })
        .await
        .expect("foreign document");

    let stop = AtomicBool::new(false);
    let keep_forever = Gc::new(t.db.clone(), GcOptions::default());
    let round = keep_forever
        .run_round_at(hours_from_now(48), &stop)
        .await
        .expect("round");
    assert_eq!(round.purged, 0, "no retention set: tombstones are kept");

    let gc = Gc::new(
        t.db.clone(),
        GcOptions::default().tombstone_retention(Some(Duration::from_secs(3600))),
    );
    let fresh = gc
        .run_round_at(DateTime::now(), &stop)
        .await
        .expect("round");
    assert_eq!(
        fresh.purged, 0,
        "tombstones younger than the retention stay"
    );
    let later = gc
        .run_round_at(hours_from_now(2), &stop)
        .await
        .expect("round");
    assert_eq!(later.purged, 2, "{later:?}");

    for id in ["gone1", "gone2"] {
        let read = accounts.get(id).await;
        assert!(
            matches!(read, Err(RepoError::NotFound { .. })),
            "{id}: {read:?}"
        );
    }
    assert_eq!(accounts.get("live").await.expect("live").balance, 3);
    assert!(raw
        .find_one(doc! { "_id": "held" })
        .await
        .expect("read")
        .is_some());
    assert_eq!(foreign.count_documents(doc! {}).await.expect("count"), 1);
}
