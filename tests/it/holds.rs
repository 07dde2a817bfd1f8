//! Documents held by a transaction describe themselves: readers see the committed value from the
//! hold alone, writers wait (bounded) for a live holder and resolve a decided, expired or ended one
//! on the spot, whether or not its record still exists.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{
    hold_of, millis_from_now, put_hold, put_record, raw_snapshot, Account, TestDb,
};
use async_trait::async_trait;
use bson::{doc, oid::ObjectId, DateTime, Document};
use mongotx::gc::HoldError;
use mongotx::options::LockWait;
use mongotx::testkit::{HoldResolver, NoTransactions, RecordResolver, TxnStatus};
use mongotx::{fields, Adjust, Query, RepoError, Store, Update};

fn short_wait(max_wait_ms: u64) -> LockWait {
    LockWait {
        max_wait: Duration::from_millis(max_wait_ms),
        initial_backoff: Duration::from_millis(2),
        max_backoff: Duration::from_millis(20),
    }
}

async fn accounts_on(store: &Store) -> mongotx::Repository<Account> {
    store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap()
}

fn check_hold() -> Document {
    hold_of("check", millis_from_now(3_600_000), doc! {}, &[])
}

async fn release(t: &TestDb, id: &str) {
    t.db.collection::<Document>("accounts")
        .update_one(
            doc! { "_id": id },
            doc! { "$unset": { fields::ACTIVE_TXN: "", fields::HOLD: "" } },
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
    let accounts = accounts_on(&store).await;
    accounts
        .insert(&Account::new("held", "H", 1))
        .await
        .unwrap();
    let txn = ObjectId::new();
    put_hold(&t.db, "accounts", "held", txn, doc! {}, check_hold()).await;
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
    let accounts = accounts_on(&store).await;
    accounts
        .insert(&Account::new("busy", "B", 1))
        .await
        .unwrap();
    put_hold(
        &t.db,
        "accounts",
        "busy",
        ObjectId::new(),
        doc! {},
        check_hold(),
    )
    .await;

    let releaser = {
        let db = t.db.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            db.collection::<Document>("accounts")
                .update_one(
                    doc! { "_id": "busy" },
                    doc! { "$unset": { fields::ACTIVE_TXN: "", fields::HOLD: "" } },
                )
                .await
                .unwrap();
        })
    };
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
    let accounts = accounts_on(&store).await;
    accounts
        .insert(&Account::new("moved", "M", 1))
        .await
        .unwrap();
    put_hold(
        &t.db,
        "accounts",
        "moved",
        ObjectId::new(),
        doc! {},
        check_hold(),
    )
    .await;

    // The holder commits a change (version 2) and lets go; the waiting writer read version 1.
    let committer = {
        let db = t.db.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            db.collection::<Document>("accounts")
                .update_one(
                    doc! { "_id": "moved" },
                    doc! {
                        "$set": { fields::VERSION: 2_i64, "owner": "Committed" },
                        "$unset": { fields::ACTIVE_TXN: "", fields::HOLD: "" },
                    },
                )
                .await
                .unwrap();
        })
    };
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

/// The change a pending transaction applied to "acc": owner and balance changed, a new field
/// added, version 1 → 2, with the hold that undoes exactly that.
async fn apply_pending_change(t: &TestDb, txn: ObjectId, deadline: DateTime) {
    put_hold(
        &t.db,
        "accounts",
        "acc",
        txn,
        doc! { "owner": "After", "balance": 99_i64, "note": "new", fields::VERSION: 2_i64 },
        hold_of(
            "update",
            deadline,
            doc! { "owner": "Before", "balance": 10_i64, fields::VERSION: 1_i64 },
            &["note"],
        ),
    )
    .await;
}

#[tokio::test]
async fn an_expired_holder_is_aborted_and_undone_instead_of_waited_on() {
    let t = TestDb::new().await;
    // A long wait budget: if the holder were waited on, the write would take 10 s.
    let store = Store::builder(t.db.clone())
        .lock_wait(short_wait(10_000))
        .build();
    let accounts = accounts_on(&store).await;
    accounts
        .insert(&Account::new("acc", "Before", 10))
        .await
        .unwrap();
    let before = raw_snapshot(&t.db, "accounts").await;
    let txn = ObjectId::new();
    let deadline = millis_from_now(-1_000);
    put_record(&t.db, txn, "staging", deadline).await;
    apply_pending_change(&t, txn, deadline).await;

    // The hold alone gives back the document exactly as it was, version included.
    let read = accounts.get("acc").await.unwrap();
    assert_eq!(
        (read.owner.as_str(), read.balance, read.version),
        ("Before", 10, 1)
    );

    let started = Instant::now();
    let v = accounts
        .update("acc", 1, &Update::new().set("owner", "Fresh"))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(v, 2);
    let records = raw_snapshot(&t.db, mongotx::collections::TRANSACTIONS_COLLECTION).await;
    assert_eq!(
        records[0].get_str("state").ok(),
        Some("aborted"),
        "the writer decided the outcome"
    );
    let mut expected = before[0].clone();
    expected.insert("owner", "Fresh");
    expected.insert(fields::VERSION, 2_i64);
    let mut after = raw_snapshot(&t.db, "accounts").await.remove(0);
    // Field order after $set/$unset is the server's business; compare fields.
    let mut want: Vec<_> = expected.into_iter().collect();
    let mut got: Vec<_> = std::mem::take(&mut after).into_iter().collect();
    want.sort_by(|a, b| a.0.cmp(&b.0));
    got.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(got, want);
}

/// On a sharded cluster the records' shard may run ahead of the clock `hello` reports (which sets
/// deadlines). That clock guards a record's abort, so once it has passed a deadline a writer and
/// the GC decide the transaction, without waiting for `hello`'s clock to get there too (here 10 s
/// later; with the 40 s timeout of the skewed-shards torture, 30 s, past the end of the run). A
/// deadline neither clock has reached is still waited on.
#[tokio::test]
async fn a_deadline_the_records_clock_has_passed_is_expired_though_hellos_has_not() {
    let server = tokio::task::spawn_blocking(|| {
        mongotx::testkit::local_server::LocalServer::start_with(&[
            "--clock-offset".to_string(),
            format!("{}=+30s", mongotx::collections::TRANSACTIONS_COLLECTION),
        ])
    })
    .await
    .expect("join")
    .expect("a local test server whose records' clock runs 30 s ahead");
    let client = mongodb::Client::with_uri_str(server.uri())
        .await
        .expect("client");
    let db = client.database(&format!("mongotx_test_{}", ObjectId::new().to_hex()));
    let store = Store::builder(db.clone())
        .lock_wait(short_wait(10_000))
        .build();
    let accounts = accounts_on(&store).await;
    for id in ["by_writer", "by_gc", "live"] {
        accounts
            .insert(&Account::new(id, "Before", 10))
            .await
            .unwrap();
    }
    // Two undecided transactions whose deadlines are 10 s ahead of `hello`'s clock, 20 s behind
    // the records'; one whose deadline is ahead of both.
    let (by_writer, by_gc, live) = (ObjectId::new(), ObjectId::new(), ObjectId::new());
    let (passed, ahead) = (millis_from_now(10_000), millis_from_now(40_000));
    for (txn, id, deadline) in [
        (by_writer, "by_writer", passed),
        (by_gc, "by_gc", passed),
        (live, "live", ahead),
    ] {
        put_record(&db, txn, "staging", deadline).await;
        put_hold(
            &db,
            "accounts",
            id,
            txn,
            doc! {},
            hold_of("check", deadline, doc! {}, &[]),
        )
        .await;
    }

    let started = Instant::now();
    let v = accounts
        .update("by_writer", 1, &Update::new().set("owner", "Fresh"))
        .await
        .unwrap();
    assert_eq!(v, 2);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the writer waited {:?} for a transaction the records' clock had expired",
        started.elapsed()
    );
    let state = |txn: ObjectId| {
        let db = db.clone();
        async move {
            db.collection::<Document>(mongotx::collections::TRANSACTIONS_COLLECTION)
                .find_one(doc! { "_id": txn })
                .await
                .unwrap()
                .and_then(|record| record.get_str("state").ok().map(str::to_string))
        }
    };
    assert_eq!(state(by_writer).await.as_deref(), Some("aborted"));

    let summary = mongotx::gc::Gc::new(&store, mongotx::gc::GcOptions::default())
        .run_round()
        .await
        .unwrap();
    // Both expired records go: the one the writer aborted and the one the GC decides.
    assert_eq!(summary.rolled_back, 2, "{summary:?}");
    let held = |id: &'static str| {
        let db = db.clone();
        async move {
            db.collection::<Document>("accounts")
                .find_one(doc! { "_id": id })
                .await
                .unwrap()
                .is_some_and(|d| d.contains_key(fields::ACTIVE_TXN))
        }
    };
    assert!(
        !held("by_gc").await,
        "the GC left the expired transaction's hold"
    );

    // Neither clock has reached the third deadline: the GC leaves it and a writer waits for it.
    assert_eq!(state(live).await.as_deref(), Some("staging"));
    assert!(held("live").await);
    let waiting = Store::builder(db.clone())
        .lock_wait(short_wait(300))
        .build();
    match accounts_on(&waiting)
        .await
        .update("live", 1, &Update::new().set("owner", "x"))
        .await
    {
        Err(RepoError::Locked { holder, .. }) => assert_eq!(holder, Some(live)),
        other => panic!("expected Locked by the live transaction, got {other:?}"),
    }
    assert_eq!(state(live).await.as_deref(), Some("staging"));
    let _ = db.drop().await;
}

/// A staging record of transaction `txn` (deadline `deadline`) whose participants are the accounts
/// `ids`, each changed to owner "Crossed".
async fn put_staging(t: &TestDb, txn: ObjectId, deadline: DateTime, ids: &[&str]) {
    let entries: Vec<Document> = ids
        .iter()
        .map(|id| {
            doc! {
                "coll": "accounts", "id": *id, "expected": 1_i64, "applied": 2_i64,
                "schema": 1_i64,
                "op": {
                    "kind": "update",
                    "set": [{ "path": "owner", "value": "Crossed" }],
                    "unset": [],
                    "undo": { "restore": { "owner": "Before" }, "absent": [] },
                },
            }
        })
        .collect();
    t.db.collection::<Document>(mongotx::collections::TRANSACTIONS_COLLECTION)
        .insert_one(doc! {
            "_id": txn, "state": "staging", "created": DateTime::now(),
            "deadline": deadline, "entries": entries,
        })
        .await
        .unwrap();
}

/// Two expired staging transactions over accounts "a" and "b", the first holding "a" and the
/// second "b": each misses what the other holds.
async fn crossed_transactions(t: &TestDb, accounts: &mongotx::Repository<Account>) {
    for id in ["a", "b"] {
        accounts
            .insert(&Account::new(id, "Before", 10))
            .await
            .unwrap();
    }
    let deadline = millis_from_now(-1_000);
    for (txn, held) in [(ObjectId::new(), "a"), (ObjectId::new(), "b")] {
        put_staging(t, txn, deadline, &["a", "b"]).await;
        put_hold(
            &t.db,
            "accounts",
            held,
            txn,
            doc! { "owner": "Crossed", fields::VERSION: 2_i64 },
            hold_of(
                "update",
                deadline,
                doc! { "owner": "Before", fields::VERSION: 1_i64 },
                &[],
            ),
        )
        .await;
    }
}

/// Both accounts back as they were, free, and no record left.
async fn assert_uncrossed(t: &TestDb, accounts: &mongotx::Repository<Account>) {
    for doc in raw_snapshot(&t.db, "accounts").await {
        assert!(!doc.contains_key(fields::ACTIVE_TXN), "still held: {doc}");
        assert_eq!(doc.get_str("owner").ok(), Some("Before"), "{doc}");
    }
    for id in ["a", "b"] {
        assert_eq!(accounts.get(id).await.unwrap().version, 1);
    }
    let records = raw_snapshot(&t.db, mongotx::collections::TRANSACTIONS_COLLECTION).await;
    assert!(records.is_empty(), "records left: {records:?}");
}

#[tokio::test]
async fn expired_transactions_each_holding_what_the_other_misses_are_both_aborted_by_the_gc() {
    let t = TestDb::new().await;
    let accounts = accounts_on(&t.store).await;
    crossed_transactions(&t, &accounts).await;
    // Neither can ever commit: past the deadline, an apply on a document another holds is shut
    // out for good, so neither waits for the other.
    let round = mongotx::gc::Gc::new(&t.store, mongotx::gc::GcOptions::default())
        .run_round()
        .await
        .unwrap();
    assert_eq!(round.rolled_back, 2, "{round:?}");
    assert_uncrossed(&t, &accounts).await;
}

#[tokio::test]
async fn a_writer_meeting_crossed_expired_transactions_aborts_them_instead_of_waiting() {
    let t = TestDb::new().await;
    let store = Store::builder(t.db.clone())
        .lock_wait(short_wait(10_000))
        .build();
    let accounts = accounts_on(&store).await;
    crossed_transactions(&t, &accounts).await;
    let started = Instant::now();
    let v = accounts
        .update("a", 1, &Update::new().set("note", "written"))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "waited {:?}",
        started.elapsed()
    );
    assert_eq!(v, 2);
    let a = accounts.get("a").await.unwrap();
    assert_eq!(
        (a.owner.as_str(), a.note.as_deref()),
        ("Before", Some("written"))
    );
}

#[tokio::test]
async fn a_hold_whose_record_is_gone_reads_as_uncommitted_and_is_undone_after_its_deadline() {
    let t = TestDb::new().await;
    let store = Store::builder(t.db.clone())
        .lock_wait(short_wait(10_000))
        .build();
    let accounts = accounts_on(&store).await;
    accounts
        .insert(&Account::new("acc", "Before", 10))
        .await
        .unwrap();
    // A late apply: its transaction ended and has no record, and its deadline has passed.
    // Nothing but the document itself says what to do.
    let txn = ObjectId::new();
    apply_pending_change(&t, txn, millis_from_now(-1_000)).await;

    let read = accounts.get("acc").await.unwrap();
    assert_eq!(
        (read.owner.as_str(), read.version, read.note.clone()),
        ("Before", 1, None)
    );
    let found = accounts
        .find(Query::new().filter(doc! { "owner": "Before" }))
        .await
        .unwrap();
    assert_eq!(found.len(), 1);

    let started = Instant::now();
    accounts
        .adjust("acc", 1, &Adjust::new().by("balance", 5_i64))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let read = accounts.get("acc").await.unwrap();
    assert_eq!(
        (read.owner.as_str(), read.balance, read.version),
        ("Before", 15, 2)
    );
    // The writer put an aborted record in the missing one's place before undoing the hold, so
    // that no copy of the record still on its way could arrive as staging.
    let records = raw_snapshot(&t.db, mongotx::collections::TRANSACTIONS_COLLECTION).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].get_object_id("_id").ok(), Some(txn));
    assert_eq!(records[0].get_str("state").ok(), Some("aborted"));
}

#[tokio::test]
async fn a_hold_whose_record_has_not_arrived_is_waited_on_for_a_grace_then_aborted() {
    let t = TestDb::new().await;
    let impatient = Store::builder(t.db.clone())
        .lock_wait(short_wait(120))
        .build();
    let accounts = accounts_on(&impatient).await;
    accounts
        .insert(&Account::new("acc", "Before", 10))
        .await
        .unwrap();
    // The record of a live transaction may still be on its way: its hold is not undone at once.
    let txn = ObjectId::new();
    apply_pending_change(&t, txn, millis_from_now(3_600_000)).await;
    let held = raw_snapshot(&t.db, "accounts").await;

    let read = accounts.get("acc").await.unwrap();
    assert_eq!((read.owner.as_str(), read.version), ("Before", 1));
    let err = accounts
        .adjust("acc", 1, &Adjust::new().by("balance", 5_i64))
        .await
        .unwrap_err();
    assert!(matches!(err, RepoError::Locked { .. }), "{err:?}");
    assert_eq!(raw_snapshot(&t.db, "accounts").await, held);
    assert!(
        raw_snapshot(&t.db, mongotx::collections::TRANSACTIONS_COLLECTION)
            .await
            .is_empty()
    );

    // A writer that waits longer than the grace puts an aborted record in the missing one's
    // place (no late copy of it can then arrive as staging) and goes ahead.
    let patient = Store::builder(t.db.clone())
        .lock_wait(short_wait(5_000))
        .build();
    let accounts = accounts_on(&patient).await;
    let started = Instant::now();
    accounts
        .adjust("acc", 1, &Adjust::new().by("balance", 5_i64))
        .await
        .unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    let records = raw_snapshot(&t.db, mongotx::collections::TRANSACTIONS_COLLECTION).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].get_str("state").ok(), Some("aborted"));
    let read = accounts.get("acc").await.unwrap();
    assert_eq!(
        (read.owner.as_str(), read.balance, read.version),
        ("Before", 15, 2)
    );
}

#[tokio::test]
async fn readers_see_the_pre_image_until_the_commit_point_and_the_change_after() {
    let t = TestDb::new().await;
    let accounts = accounts_on(&t.store).await;
    accounts
        .insert(&Account::new("acc", "Before", 10))
        .await
        .unwrap();
    let txn = ObjectId::new();
    put_record(&t.db, txn, "staging", millis_from_now(3_600_000)).await;
    apply_pending_change(&t, txn, millis_from_now(3_600_000)).await;

    let read = accounts.get("acc").await.unwrap();
    assert_eq!((read.owner.as_str(), read.version), ("Before", 1));
    let found = accounts.find(Query::new()).await.unwrap();
    assert_eq!((found[0].owner.as_str(), found[0].version), ("Before", 1));

    t.db.collection::<Document>(mongotx::collections::TRANSACTIONS_COLLECTION)
        .update_one(
            doc! { "_id": txn },
            doc! { "$set": { "state": "committed" } },
        )
        .await
        .unwrap();
    let read = accounts.get("acc").await.unwrap();
    assert_eq!(
        (read.owner.as_str(), read.version, read.note.as_deref()),
        ("After", 2, Some("new"))
    );
    let found = accounts.find(Query::new()).await.unwrap();
    assert_eq!((found[0].owner.as_str(), found[0].version), ("After", 2));
}

#[tokio::test]
async fn an_uncommitted_insert_is_invisible_and_a_committed_delete_is_deleted() {
    let t = TestDb::new().await;
    let accounts = accounts_on(&t.store).await;
    accounts
        .insert(&Account::new("visible", "V", 1))
        .await
        .unwrap();
    accounts
        .insert(&Account::new("going", "G", 1))
        .await
        .unwrap();
    let inserting = ObjectId::new();
    put_record(&t.db, inserting, "staging", millis_from_now(3_600_000)).await;
    let mut pending = bson::to_document(&Account::new("pending", "P", 1)).unwrap();
    pending.insert(fields::SCHEMA_VERSION, 1_i64);
    pending.insert(fields::VERSION, 1_i64);
    pending.insert(fields::ACTIVE_TXN, inserting);
    pending.insert(
        fields::HOLD,
        hold_of("insert", millis_from_now(3_600_000), doc! {}, &[]),
    );
    t.db.collection::<Document>("accounts")
        .insert_one(pending)
        .await
        .unwrap();

    assert!(matches!(
        accounts.get("pending").await,
        Err(RepoError::NotFound { .. })
    ));
    let ids: Vec<String> = accounts
        .find(Query::new().sort(doc! { "_id": 1 }))
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.value.id)
        .collect();
    assert_eq!(ids, vec!["going", "visible"]);

    // A delete past its commit point (deleting flag, held by a committed transaction).
    let deleting = ObjectId::new();
    put_record(&t.db, deleting, "committed", millis_from_now(3_600_000)).await;
    put_hold(
        &t.db,
        "accounts",
        "going",
        deleting,
        doc! { fields::DELETING: true, fields::VERSION: 2_i64 },
        hold_of(
            "delete",
            millis_from_now(3_600_000),
            doc! { fields::VERSION: 1_i64 },
            &[],
        ),
    )
    .await;
    assert!(matches!(
        accounts.get("going").await,
        Err(RepoError::Deleted { version: 2, .. })
    ));
    let found = accounts.find(Query::new()).await.unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].value.id, "visible");
}

/// A resolver whose transaction store is unreachable, counting calls.
struct BrokenResolver {
    calls: AtomicUsize,
}

#[async_trait]
impl HoldResolver for BrokenResolver {
    async fn status(&self, _store: &Store, txn: ObjectId) -> Result<TxnStatus, HoldError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Err(HoldError::new(format!(
            "the record of {txn} cannot be read"
        )))
    }

    async fn abort_expired(
        &self,
        store: &Store,
        txn: ObjectId,
        _now: DateTime,
    ) -> Result<TxnStatus, HoldError> {
        self.status(store, txn).await
    }
}

#[tokio::test]
async fn resolver_failures_are_reported_as_hold_errors_and_change_nothing() {
    let t = TestDb::new().await;
    let resolver = Arc::new(BrokenResolver {
        calls: AtomicUsize::new(0),
    });
    let store = Store::builder(t.db.clone())
        .hold_resolver(resolver.clone())
        .build();
    let accounts = accounts_on(&store).await;
    accounts
        .insert(&Account::new("stuck", "S", 1))
        .await
        .unwrap();
    let txn = ObjectId::new();
    put_hold(&t.db, "accounts", "stuck", txn, doc! {}, check_hold()).await;
    let before = raw_snapshot(&t.db, "accounts").await;

    let err = accounts.get("stuck").await.unwrap_err();
    assert!(
        matches!(&err, RepoError::Hold { holder, .. } if *holder == txn),
        "{err:?}"
    );
    assert!(err.to_string().contains("cannot be read"), "{err}");
    let err = accounts
        .update("stuck", 1, &Update::new().set("owner", "x"))
        .await
        .unwrap_err();
    assert!(matches!(err, RepoError::Hold { .. }), "{err:?}");
    assert!(resolver.calls.load(Ordering::SeqCst) >= 2);
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
    release(&t, "stuck").await;
    // With the standard resolver the same document is plain again.
    let accounts = accounts_on(
        &Store::builder(t.db.clone())
            .hold_resolver(Arc::new(RecordResolver))
            .build(),
    )
    .await;
    assert_eq!(accounts.get("stuck").await.unwrap().version, 1);
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
