//! The stored format (docs/format.md, `mongotx::format`): a transaction record, a hold or a
//! registry entry of a format newer than this release reads is refused, naming both versions,
//! with nothing written, and the GC leaves it alone; the gate keeps a fleet from writing a format
//! that a live instance does not read, and a store playing a future release writes that format
//! only once it is switched on, after which this release refuses to write at all.
//! (`format_coordination.rs` does the same for the coordination modules' documents.)

use std::sync::Arc;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Document};
use mongotx::collections::{META_COLLECTION, TRANSACTIONS_COLLECTION};
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::{Finish, TxnOptions};
use mongotx::testkit::failpoint::{self, Failpoint};
use mongotx::{Adjust, ErrorKind, RepoError, Repository, Store, Transactions, TxnError};

use crate::admin::{past, record};
use crate::common::refusals::snapshot;
use crate::common::{accounts_spec, seed_accounts, Account, CrashAt, TestDb};

/// A crashed transaction's deadline: short, since the GC tests wait it out.
const TIMEOUT: Duration = Duration::from_secs(2);

/// Moves 30 from `a` to `b` through `store`, whose coordinator dies with the record and both
/// applies written (staging, every participant in place); returns the transaction's id.
async fn crashed(store: &Store, accounts: &Repository<Account>) -> ObjectId {
    let txns = Transactions::with_options(
        store,
        TxnOptions::default()
            .timeout(TIMEOUT)
            .finish(Finish::BeforeReturning)
            .fault_injector(Arc::new(CrashAt(Failpoint {
                name: failpoint::COMMIT_BEFORE,
                step: 0,
            }))),
    );
    let tx = txns.begin();
    let version = |id: &str| {
        let accounts = accounts.clone();
        let id = id.to_string();
        async move { accounts.get(&id).await.expect("read").version }
    };
    let (va, vb) = (version("a").await, version("b").await);
    tx.adjust(accounts, "a", va, &Adjust::new().by("balance", -30_i64))
        .await
        .expect("stage");
    tx.adjust(accounts, "b", vb, &Adjust::new().by("balance", 30_i64))
        .await
        .expect("stage");
    match tx.commit().await {
        Err(TxnError::Crashed { txn: Some(txn), .. }) => txn,
        other => panic!("the coordinator should die before its commit: {other:?}"),
    }
}

/// Waits until the server's clock has passed the deadline in `txn`'s record.
async fn past_deadline(t: &TestDb, txn: ObjectId) {
    let record = record(t, txn).await.expect("the record");
    past(t, *record.get_datetime("deadline").expect("deadline")).await;
}

async fn bank(t: &TestDb) -> Repository<Account> {
    let accounts = t
        .store
        .repository::<Account>(accounts_spec())
        .await
        .expect("open accounts");
    seed_accounts(&accounts, &[("a", 100), ("b", 100)]).await;
    accounts
}

/// Sets `field` to `value` on document `id` of `collection`, as a newer release would have.
async fn set_raw(t: &TestDb, collection: &str, id: impl Into<bson::Bson>, field: &str, value: i64) {
    let set =
        t.db.collection::<Document>(collection)
            .update_one(doc! { "_id": id.into() }, doc! { "$set": { field: value } })
            .await
            .expect("raw write");
    assert_eq!(set.matched_count, 1, "{collection}: no such document");
}

/// Checks that `error` is a refusal of a format-3 thing by a reader of formats up to 2, named.
fn refused_as_newer(error: &dyn std::fmt::Display, kind: ErrorKind, names: &[&str]) {
    let message = error.to_string();
    assert_eq!(kind, ErrorKind::NewerFormat, "{message}");
    for name in ["format 3", "format 2"].iter().chain(names) {
        assert!(message.contains(name), "{name:?} missing from: {message}");
    }
}

#[tokio::test]
async fn a_record_of_a_newer_format_is_refused_and_left_alone() {
    let t = TestDb::new().await;
    let accounts = bank(&t).await;
    let txn = crashed(&t.store, &accounts).await;
    assert_eq!(
        record(&t, txn).await.expect("record").get_i64("_format"),
        Ok(1),
        "this release writes format 1 in its records"
    );
    set_raw(&t, TRANSACTIONS_COLLECTION, txn, "_format", 3).await;
    let before = snapshot(&t.db).await;

    let read = accounts
        .get("a")
        .await
        .expect_err("a reader cannot judge the holder");
    refused_as_newer(
        &read,
        read.kind(),
        &[TRANSACTIONS_COLLECTION, &txn.to_hex()],
    );
    let write = accounts
        .update("a", 2, &mongotx::Update::new().set("note", "x"))
        .await
        .expect_err("a writer cannot judge the holder");
    assert_eq!(write.kind(), ErrorKind::NewerFormat, "{write}");

    // Expired, the GC of this release leaves it to one that reads it.
    past_deadline(&t, txn).await;
    let round = Gc::new(&t.store, GcOptions::default())
        .run_round()
        .await
        .expect("the round goes on past what it cannot read");
    assert_eq!((round.finished, round.rolled_back), (0, 0), "{round:?}");
    assert_eq!(snapshot(&t.db).await, before, "nothing was written");

    // The format was all that stood in the way.
    set_raw(&t, TRANSACTIONS_COLLECTION, txn, "_format", 1).await;
    assert_eq!(accounts.get("a").await.expect("read").value.balance, 70);
}

#[tokio::test]
async fn a_hold_of_a_newer_format_is_refused_and_left_alone() {
    let t = TestDb::new().await;
    let accounts = bank(&t).await;
    let txn = crashed(&t.store, &accounts).await;
    let deadline = *record(&t, txn)
        .await
        .expect("record")
        .get_datetime("deadline")
        .expect("deadline");
    let held = || async {
        t.db.collection::<Document>("accounts")
            .find_one(doc! { "_id": "a" })
            .await
            .expect("read")
            .expect("a")
    };
    assert!(
        held()
            .await
            .get_document("_hold")
            .expect("held")
            .get("_format")
            .is_none(),
        "format 1 leaves holds unmarked"
    );
    // A hold of a newer release whose record is gone: only the hold says what undoes it.
    set_raw(&t, "accounts", "a", "_hold._format", 3).await;
    t.db.collection::<Document>(TRANSACTIONS_COLLECTION)
        .delete_one(doc! { "_id": txn })
        .await
        .expect("delete the record");
    let a = held().await;

    let read = accounts
        .get("a")
        .await
        .expect_err("a reader cannot read the hold");
    refused_as_newer(&read, read.kind(), &["accounts", "_hold"]);

    past(&t, deadline).await;
    Gc::new(&t.store, GcOptions::default())
        .run_round()
        .await
        .expect("the round goes on past what it cannot read");
    assert_eq!(held().await, a, "the GC left the hold it cannot read");
    assert_eq!(
        accounts.get("b").await.expect("b").value.balance,
        100,
        "b, of format 1, was rolled back"
    );
}

#[tokio::test]
async fn a_collection_registered_in_a_newer_format_is_refused_at_open() {
    let t = TestDb::new().await;
    bank(&t).await;
    let registry = || async {
        t.db.collection::<Document>(META_COLLECTION)
            .find_one(doc! { "_id": "collection:accounts" })
            .await
            .expect("read")
            .expect("registered")
    };
    assert_eq!(registry().await.get_i64("_format"), Ok(1));
    set_raw(&t, META_COLLECTION, "collection:accounts", "_format", 3).await;
    let entry = registry().await;
    let other = Store::new(t.db.clone());
    let refused = other
        .repository::<Account>(accounts_spec())
        .await
        .expect_err("registered by a newer release");
    refused_as_newer(&refused, refused.kind(), &[META_COLLECTION, "accounts"]);
    assert_eq!(registry().await, entry, "the registry entry is as it was");
}

/// A store of this release and one playing the next (reads formats 1 to 3), both announced by
/// opening the accounts.
async fn two_releases(t: &TestDb, refresh: Duration) -> (Store, Store) {
    let this = Store::builder(t.db.clone()).format_refresh(refresh).build();
    let next = Store::builder(t.db.clone())
        .format_refresh(refresh)
        .plays_format(3)
        .build();
    for store in [&this, &next] {
        store
            .repository::<Account>(accounts_spec())
            .await
            .expect("open accounts");
    }
    (this, next)
}

#[tokio::test]
async fn the_gate_switches_only_once_every_live_instance_reads_the_format() {
    let t = TestDb::new().await;
    let accounts = bank(&t).await;
    // The harness's store announced itself (reading formats up to 2) by opening the accounts.
    t.store.shutdown(Duration::from_secs(5)).await;
    let (this, next) = two_releases(&t, Duration::from_secs(10)).await;
    let this_id = this.format_status().await.expect("status").instance;

    let refused = next.set_format(3).await.expect_err("this release is live");
    assert_eq!(refused.kind(), ErrorKind::Refused, "{refused}");
    match &refused {
        RepoError::FormatRefused {
            requested: 3,
            behind,
        } => {
            assert_eq!(behind.len(), 1, "{refused}");
            assert!(behind[0].contains(&this_id), "{refused}");
        }
        other => panic!("expected FormatRefused, got {other:?}"),
    }
    let switched = |_: ()| async {
        t.db.collection::<Document>(META_COLLECTION)
            .find_one(doc! { "_id": "format" })
            .await
            .expect("read")
    };
    assert!(switched(()).await.is_none(), "nothing switched");

    // Until switched, the next release writes format 1.
    let next_accounts = next
        .repository::<Account>(accounts_spec())
        .await
        .expect("open");
    let txn = crashed(&next, &next_accounts).await;
    assert_eq!(
        record(&t, txn).await.expect("record").get_i64("_format"),
        Ok(1)
    );
    let a = accounts.get("a").await;
    assert!(
        a.is_ok(),
        "this release reads what the next wrote unswitched: {a:?}"
    );

    // This release stops; the switch goes through, and the next release writes format 3.
    this.shutdown(Duration::from_secs(5)).await;
    let status = next
        .set_format(3)
        .await
        .expect("every live instance reads 3");
    assert_eq!((status.writes, status.reads), (3, 3));
    assert_eq!(
        switched(()).await.expect("switched").get_i64("writes"),
        Ok(3)
    );
    past_deadline(&t, txn).await;
    Gc::new(&next, GcOptions::default())
        .run_round()
        .await
        .expect("the next release's GC");
    let txn = crashed(&next, &next_accounts).await;
    assert_eq!(
        record(&t, txn).await.expect("record").get_i64("_format"),
        Ok(3)
    );
    let stored_a =
        t.db.collection::<Document>("accounts")
            .find_one(doc! { "_id": "a" })
            .await
            .expect("read")
            .expect("a");
    assert_eq!(
        stored_a
            .get_document("_hold")
            .expect("held")
            .get_i64("_format"),
        Ok(3)
    );

    // A store of this release started now refuses to write, and writes nothing.
    let late = Store::new(t.db.clone());
    let before = snapshot(&t.db).await;
    let opened = late
        .repository::<Account>(accounts_spec())
        .await
        .expect_err("the database writes a format this release does not read");
    refused_as_newer(&opened, opened.kind(), &[META_COLLECTION]);
    let read = accounts.get("a").await.expect_err("a format-3 record");
    assert_eq!(read.kind(), ErrorKind::NewerFormat, "{read}");
    assert_eq!(snapshot(&t.db).await, before, "nothing was written");

    // Formats this release does not read cannot be switched on; going back is allowed.
    for asked in [0, 4] {
        let unknown = next
            .set_format(asked)
            .await
            .expect_err("not a format it reads");
        assert_eq!(unknown.kind(), ErrorKind::InvalidInput, "{unknown}");
    }
    assert_eq!(next.set_format(1).await.expect("back to 1").writes, 1);
}

#[tokio::test]
async fn an_announcement_lapses_once_its_store_stops_renewing_it() {
    let t = TestDb::new().await;
    bank(&t).await;
    t.store.shutdown(Duration::from_secs(5)).await;
    let refresh = Duration::from_millis(100);
    let (this, next) = two_releases(&t, refresh).await;
    let this_id = this.format_status().await.expect("status").instance;
    assert!(
        next.set_format(3).await.is_err(),
        "live right after it announced"
    );
    // Six intervals without a renewal, and a margin for the server's clock.
    tokio::time::sleep(refresh * 6 + Duration::from_millis(400)).await;
    let status = next
        .set_format(3)
        .await
        .expect("the idle store's announcement lapsed");
    let listed = status
        .instances
        .iter()
        .find(|i| i.id == this_id)
        .expect("a lapsed announcement is still listed");
    assert!(!listed.live && listed.reads == 2, "{listed:?}");
    assert!(status.instances.iter().any(|i| i.live && i.reads == 3));
}

#[tokio::test]
async fn the_admin_command_shows_the_format_and_switches_it_through_the_gate() {
    use crate::admin_cli::{mongotx, mongotx_json, run, MONGOTX};
    let t = TestDb::new().await;
    bank(&t).await;
    let me = t.store.format_status().await.expect("status").instance;

    let shown = mongotx(&t, &["format"]).await;
    assert!(shown.contains("writes: format 1"), "{shown}");
    assert!(shown.contains("instances: 1 live, 0 lapsed"), "{shown}");
    assert!(
        shown.contains(&format!("live   {me}: reads 1 to 2, writes 1")),
        "{shown}"
    );
    let json = mongotx_json(&t, &["format"]).await;
    assert_eq!(json["writes"], 1, "{json}");
    assert_eq!(json["instances"][0]["id"], me.as_str(), "{json}");

    // Not a format this release reads: refused, exit status 1, nothing switched.
    let refused = run(MONGOTX, &t, &["format", "set", "3"]).await;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("reads formats 1 to 2"), "{stderr}");
    let bad = run(MONGOTX, &t, &["format", "set", "0"]).await;
    assert_eq!(bad.status.code(), Some(2), "a bad argument");
    let format =
        t.db.collection::<Document>(META_COLLECTION)
            .find_one(doc! { "_id": "format" })
            .await
            .expect("read");
    assert!(format.is_none(), "nothing switched: {format:?}");

    let switched = mongotx(&t, &["format", "set", "1"]).await;
    assert!(
        switched.contains("switched: the database writes format 1"),
        "{switched}"
    );
    let after = mongotx_json(&t, &["format"]).await;
    assert_eq!(
        after["instances"].as_array().map(Vec::len),
        Some(1),
        "the command left no announcement: {after}"
    );
}
