//! The GC's tombstone purge: tombstones older than the retention go, after the collection's
//! version floor has been raised over them; fresh tombstones, live documents and collections
//! mongotx does not manage stay; and an id inserted again never repeats a version.

use crate::common;

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use crate::common::{hours_from_now, Account, TestDb};
use bson::{doc, DateTime, Document};
use mongotx::gc::{Gc, GcOptions};
use mongotx::{fields, RepoError, Update};

#[tokio::test]
async fn the_gc_purges_only_stamped_tombstones_older_than_the_retention() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("gone1", 1), ("gone2", 2), ("live", 3)]).await;
    accounts.delete("gone1", 1).await.expect("delete");
    let v = accounts
        .update("gone2", 1, &Update::new().set("owner", "x"))
        .await
        .expect("update");
    let last = accounts.delete("gone2", v).await.expect("delete");
    assert_eq!(last, 3);
    // Another application's collection with look-alike fields but no mongotx stamp.
    let foreign = t.db.collection::<Document>("foreign");
    foreign
        .insert_one(doc! { "_id": 1, fields::DELETED: DateTime::from_millis(0) })
        .await
        .expect("foreign document");

    let stop = AtomicBool::new(false);
    let keep_forever = Gc::new(&t.store, GcOptions::default());
    let round = keep_forever
        .run_round_at(hours_from_now(48).to_chrono(), &stop)
        .await
        .expect("round");
    assert_eq!(round.purged, 0, "no retention set: tombstones are kept");

    let gc = Gc::new(
        &t.store,
        GcOptions::default().tombstone_retention(Some(Duration::from_secs(3600))),
    );
    let fresh = gc.run_round().await.expect("round");
    assert_eq!(
        fresh.purged, 0,
        "tombstones younger than the retention stay"
    );
    let later = gc
        .run_round_at(hours_from_now(2).to_chrono(), &stop)
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
    assert_eq!(foreign.count_documents(doc! {}).await.expect("count"), 1);

    // The purged ids come back above every version they ever had: a caller still holding
    // version 2 or 3 of the old gone2 can never match the new one.
    accounts
        .insert(&Account::new("gone2", "again", 1))
        .await
        .expect("insert again");
    let again = accounts.get("gone2").await.expect("read");
    assert!(
        again.version > last,
        "re-inserted at version {}",
        again.version
    );
    let stale = accounts
        .update("gone2", 2, &Update::new().set("owner", "stale"))
        .await;
    assert!(
        matches!(stale, Err(RepoError::VersionConflict { .. })),
        "{stale:?}"
    );
}
