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

/// Keeps a copy of every create of an `accounts` document that passes (the commit protocol's
/// upsert of an inserted document), to send again later as a copy delivered late would be.
struct KeepCreates(std::sync::Arc<std::sync::Mutex<Vec<Document>>>);

impl crate::common::wire_proxy::Rules for KeepCreates {
    fn command(&self, command: &mut Document) -> crate::common::wire_proxy::Action {
        if crate::common::wire_proxy::command_name(command) == "findAndModify"
            && command.get_str("findAndModify").ok() == Some("accounts")
        {
            let mut copy = command.clone();
            for session in [
                "$db",
                "lsid",
                "$clusterTime",
                "txnNumber",
                "$readPreference",
            ] {
                copy.remove(session);
            }
            self.0.lock().unwrap().push(copy);
        }
        crate::common::wire_proxy::Action::Forward
    }
}

/// Issue 46, case 6 (its last part): a copy of a transaction's create still on its way could
/// bring back a document deleted and purged since. The transaction inserted z and committed (its
/// record stays until its deadline: here the coordinator died before ending it); z is then
/// deleted, and its tombstone is older than the retention. While a record that inserted z is
/// there, the purge keeps z's tombstone, so a copy of the create arriving meanwhile meets it.
#[tokio::test]
async fn a_tombstone_stays_while_a_transaction_that_inserted_it_has_a_record() {
    use mongotx::testkit::failpoint::END_BEFORE;
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    let creates = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let proxy = crate::common::wire_proxy::WireProxy::start(
        &common::server_uri(),
        KeepCreates(std::sync::Arc::clone(&creates)),
    )
    .await;
    let store = mongotx::Store::new(proxy.client().await.database(t.db.name()));
    let via_proxy = common::open_accounts(&store).await;
    let repo = via_proxy.clone();
    common::stalled_at(&store, END_BEFORE, |tx| async move {
        tx.insert(&repo, &Account::new("z", "Z", 5)).await?;
        Ok(())
    })
    .await;
    let z = accounts.get("z").await.expect("z is committed");
    accounts.delete("z", z.version).await.expect("delete z");
    let create = creates
        .lock()
        .unwrap()
        .first()
        .cloned()
        .expect("the create passed");

    let gc = Gc::new(
        &t.store,
        GcOptions::default().tombstone_retention(Some(Duration::ZERO)),
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let round = gc.run_round().await.expect("round");
    assert_eq!(round.purged, 0, "z's tombstone went: {round:?}");

    // The copy arrives now, before the transaction's deadline: it meets the tombstone.
    let replayed = t.db.run_command(create).await;
    assert!(replayed.is_err(), "the copy landed: {replayed:?}");
    let read = accounts.get("z").await;
    assert!(matches!(read, Err(RepoError::Deleted { .. })), "{read:?}");
    drop(proxy);
}
