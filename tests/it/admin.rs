//! The admin API (`mongotx::admin::Inspector`) on states the tests build, compared with what
//! the test reads with the driver: free, deleted, plain and numeric-id documents explained;
//! unknown names refused with typed errors; a hold without a record and a fence explained and
//! settled; a live transaction refused with the time it has left; and the GC round summary's
//! count of records left to a dead runner's claims. (`admin_cli.rs` runs the command itself and
//! shares the helpers here.)

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use chrono::SecondsFormat;
use mongotx::admin::{Action, CommittedValue, DocState, Inspector, Settlement, TxnState};
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::{Finish, TxnOptions};
use mongotx::testkit::failpoint::{self, Failpoint};
use mongotx::{fields, Adjust, ErrorKind, Repository, Transactions, TxnError};

use crate::common::refusals::snapshot;
use crate::common::{Account, CrashAt, TestDb};

/// How long a crashed transaction stays live in the acceptance tests: long enough for the
/// commands run before its deadline on a loaded machine, short enough to wait out.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// A time as the reports print it.
pub fn rfc3339(at: DateTime) -> String {
    at.to_chrono().to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// The stored record of `txn`.
pub async fn record(t: &TestDb, txn: ObjectId) -> Option<Document> {
    t.db.collection::<Document>(mongotx::collections::TRANSACTIONS_COLLECTION)
        .find_one(doc! { "_id": txn })
        .await
        .expect("read the record")
}

/// Waits until the server's clock has passed `deadline`.
pub async fn past(t: &TestDb, deadline: DateTime) {
    loop {
        let now = t.store.server_time().await.expect("server time");
        if now > deadline.to_chrono() + chrono::Duration::milliseconds(50) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Transactions whose coordinator stops for good at `at`, with deadline `timeout` away.
pub fn dying(t: &TestDb, at: &'static str, timeout: Duration) -> Transactions {
    Transactions::with_options(
        &t.store,
        TxnOptions::default()
            .timeout(timeout)
            .finish(Finish::BeforeReturning)
            .fault_injector(Arc::new(CrashAt(Failpoint { name: at, step: 0 }))),
    )
}

/// Moves 30 from `from` to `to` (both at version 1) in a transaction whose coordinator dies at
/// `at`, its deadline [`TIMEOUT`] away; returns its id. With `outside`, `to` is changed by
/// another writer after it was staged.
pub async fn crashed_transfer(
    t: &TestDb,
    accounts: &Repository<Account>,
    (from, to): (&str, &str),
    at: &'static str,
    outside: bool,
) -> ObjectId {
    crashed_transfer_within(t, accounts, (from, to), at, outside, TIMEOUT).await
}

/// [`crashed_transfer`] with a deadline `timeout` away.
pub async fn crashed_transfer_within(
    t: &TestDb,
    accounts: &Repository<Account>,
    (from, to): (&str, &str),
    at: &'static str,
    outside: bool,
    timeout: Duration,
) -> ObjectId {
    let tx = dying(t, at, timeout).begin();
    tx.adjust(accounts, from, 1, &Adjust::new().by("balance", -30_i64))
        .await
        .expect("stage");
    tx.adjust(accounts, to, 1, &Adjust::new().by("balance", 30_i64))
        .await
        .expect("stage");
    if outside {
        accounts
            .update(to, 1, &mongotx::Update::new().set("note", "outside"))
            .await
            .expect("outside write");
    }
    match tx.commit().await {
        Err(TxnError::Crashed { txn: Some(txn), .. }) => txn,
        other => panic!("the coordinator should die at {at}: {other:?}"),
    }
}

/// The stored (balance, version, holder) of account `id`.
pub async fn stored_account(t: &TestDb, id: &str) -> (i64, i64, Option<ObjectId>) {
    let found =
        t.db.collection::<Document>("accounts")
            .find_one(doc! { "_id": id })
            .await
            .expect("read")
            .expect("the account exists");
    (
        found.get_i64("balance").expect("balance"),
        found.get_i64(fields::VERSION).expect("version"),
        found.get_object_id(fields::ACTIVE_TXN).ok(),
    )
}

/// Runs a GC round that dies at failpoint `at`, as a killed runner would (its claims stay).
pub async fn gc_dies_at(t: &TestDb, at: &'static str) {
    let dead = Gc::new(
        &t.store,
        GcOptions::default().fault_injector(Arc::new(CrashAt(Failpoint { name: at, step: 0 }))),
    );
    assert!(matches!(
        dead.run_round().await,
        Err(TxnError::Crashed { .. })
    ));
}

/// The deadline stored in `txn`'s record.
async fn deadline_of(t: &TestDb, txn: ObjectId) -> DateTime {
    *record(t, txn)
        .await
        .expect("the record")
        .get_datetime("deadline")
        .expect("deadline")
}

#[tokio::test]
async fn a_gc_round_counts_the_expired_records_left_to_a_dead_runners_claims() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(
        &accounts,
        &[("a", 1), ("b", 2), ("c", 3), ("d", 4), ("e", 5), ("f", 6)],
    )
    .await;
    let short = Duration::from_secs(2);
    let mut txns = Vec::new();
    for pair in [("a", "b"), ("c", "d"), ("e", "f")] {
        txns.push(
            crashed_transfer_within(&t, &accounts, pair, failpoint::COMMIT_AFTER, false, short)
                .await,
        );
    }
    past(&t, deadline_of(&t, txns[2]).await).await;
    // The first runner claims the page, then dies before finishing anything.
    gc_dies_at(&t, failpoint::GC_FINISH_BEFORE).await;
    let other = Gc::new(
        &mongotx::Store::new(t.other_client_db().await),
        GcOptions::default(),
    );
    let round = other.run_round().await.expect("a round");
    assert_eq!(round.left_to_claims, 3, "{round:?}");
    assert_eq!(
        (round.finished, round.rolled_back, round.skipped),
        (0, 0, 0),
        "{round:?}"
    );
    for txn in &txns {
        assert_eq!(
            record(&t, *txn)
                .await
                .expect("left in place")
                .get_str("state"),
            Ok("committed")
        );
    }
    // A round with no claim in its way counts none.
    let t2 = TestDb::new().await;
    let quiet = Gc::new(&t2.store, GcOptions::default())
        .run_round()
        .await
        .expect("a round");
    assert_eq!(quiet.left_to_claims, 0);
}

#[tokio::test]
async fn why_explains_free_deleted_and_plain_documents_and_refuses_unknown_names() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100), ("gone", 1)]).await;
    accounts.delete("gone", 1).await.expect("delete");
    // Plain documents (no system fields) written by another writer, one with a numeric id.
    let raw_accounts = t.db.collection::<Document>("accounts");
    raw_accounts
        .insert_one(doc! { "_id": "p", "owner": "P", "balance": 3_i64 })
        .await
        .expect("raw insert");
    raw_accounts
        .insert_one(doc! { "_id": 7_i32, "owner": "N", "balance": 4_i64 })
        .await
        .expect("raw insert");
    let inspector = Inspector::new(&t.store);

    let free = inspector.why("accounts", "a").await.expect("why a");
    assert_eq!(free.hold, None);
    assert_eq!(
        free.committed,
        CommittedValue::Live {
            version: 1,
            schema_version: 1,
            value: doc! { "_id": "a", "owner": "A", "balance": 100_i64 },
        }
    );
    let text = free.to_string();
    let last = text.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("held by:") && last.ends_with(" nobody: the document is free"),
        "{text}"
    );

    let gone = inspector.why("accounts", "gone").await.expect("why gone");
    assert_eq!(gone.committed, CommittedValue::Deleted { version: 2 });
    assert_eq!(gone.hold, None);

    let plain = inspector.why("accounts", "p").await.expect("why p");
    let read = accounts
        .get("p")
        .await
        .expect("a reader gets the plain document");
    match &plain.committed {
        CommittedValue::Live {
            version,
            schema_version,
            value,
        } => {
            assert!(
                *version < 0,
                "a plain document's version is its fingerprint: {version}"
            );
            assert_eq!(read.version, *version, "the version a reader gets");
            assert_eq!(*schema_version, 0);
            assert_eq!(value, &doc! { "_id": "p", "owner": "P", "balance": 3_i64 });
        }
        other => panic!("the plain document is live: {other:?}"),
    }
    // Int64 7 names the document stored under Int32 7, as the server compares ids.
    let numeric = inspector.why("accounts", 7_i64).await.expect("why 7");
    assert!(
        matches!(&numeric.committed, CommittedValue::Live { value, .. }
            if value == &doc! { "_id": 7_i32, "owner": "N", "balance": 4_i64 }),
        "{numeric:?}"
    );

    let before = snapshot(&t.db).await;
    let unknown = ObjectId::new();
    let refusals = [
        inspector.why("nosuch", "a").await.map(|_| ()),
        inspector.why("accounts", "zzz").await.map(|_| ()),
        inspector.transaction(unknown).await.map(|_| ()),
        inspector.resolve(unknown).await.map(|_| ()),
    ];
    for refusal in &refusals {
        let e = refusal.as_ref().expect_err("refused");
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    }
    match &refusals[0] {
        Err(TxnError::UnknownCollection {
            database,
            collection,
            managed,
        }) => {
            assert_eq!(
                (database.as_str(), collection.as_str()),
                (t.db.name(), "nosuch")
            );
            assert_eq!(managed, &vec!["accounts".to_string()]);
        }
        other => panic!("{other:?}"),
    }
    match &refusals[1] {
        Err(TxnError::UnknownDocument { collection, id }) => {
            assert_eq!((collection.as_str(), id.as_str()), ("accounts", "\"zzz\""));
        }
        other => panic!("{other:?}"),
    }
    for refusal in &refusals[2..] {
        assert!(
            matches!(refusal, Err(TxnError::UnknownTransaction { txn }) if *txn == unknown),
            "{refusal:?}"
        );
    }
    let as_error = mongotx::Error::from(inspector.why("nosuch", "a").await.expect_err("refused"));
    assert_eq!(as_error.kind(), ErrorKind::NotFound);
    assert_eq!(snapshot(&t.db).await, before, "a read wrote something");
}

#[tokio::test]
async fn a_hold_without_a_record_is_explained_and_undone_as_the_gc_would() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100)]).await;
    let orphan = ObjectId::new();
    let exp = common::millis_from_now(3_600_000);
    common::put_hold(
        &t.db,
        "accounts",
        "a",
        orphan,
        doc! { "balance": 999_i64, fields::VERSION: 2_i64 },
        common::hold_of(
            "update",
            exp,
            doc! { "balance": 100_i64, fields::VERSION: 1_i64 },
            &[],
        ),
    )
    .await;
    let inspector = Inspector::new(&t.store);

    let why = inspector.why("accounts", "a").await.expect("why");
    assert_eq!(
        why.committed,
        CommittedValue::Live {
            version: 1,
            schema_version: 1,
            value: doc! { "_id": "a", "owner": "A", "balance": 100_i64 },
        }
    );
    let hold = why.hold.expect("held");
    assert_eq!(
        (hold.txn, hold.op, hold.stored_version),
        (orphan, "update", 2)
    );
    assert_eq!((hold.record, hold.hold_deadline), (None, Some(exp)));
    assert!(hold.others.is_empty());
    assert_eq!(hold.next.action, Action::UndoOrphan);
    assert_eq!(hold.next.gc_from, None);

    let report = inspector.transaction(orphan).await.expect("report");
    assert_eq!(report.record, None);
    assert_eq!(report.documents.len(), 1);
    assert_eq!(
        (report.documents[0].op, report.documents[0].state),
        ("update", DocState::Held { version: 2 })
    );

    let resolved = inspector.resolve(orphan).await.expect("resolve");
    assert_eq!(
        (resolved.outcome, resolved.holds_settled),
        (Settlement::HoldsUndone, 1)
    );
    assert_eq!(resolved.documents[0].state, DocState::Free { version: 1 });
    // An aborted record now stands in the missing one's place, until the hold's deadline.
    let after = resolved.record_after.expect("the aborted record");
    assert_eq!((after.state, after.deadline), (TxnState::Aborted, exp));
    assert_eq!(stored_account(&t, "a").await, (100, 1, None));
}

#[tokio::test]
async fn a_fence_is_explained_and_a_live_transaction_is_refused_with_the_time_it_has_left() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100), ("b", 50), ("c", 10), ("d", 20)]).await;
    let inspector = Inspector::new(&t.store);

    // Live: refused, with the time left by the server's clock, nothing written.
    let live = crashed_transfer(&t, &accounts, ("c", "d"), failpoint::COMMIT_AFTER, false).await;
    let deadline = deadline_of(&t, live).await;
    let before = snapshot(&t.db).await;
    let asked = t.store.server_time().await.expect("server time");
    match inspector.resolve(live).await {
        Err(e @ TxnError::Live { .. }) => {
            assert_eq!(e.kind(), ErrorKind::Refused);
            let TxnError::Live {
                txn,
                state,
                deadline: said,
                left,
            } = e
            else {
                unreachable!()
            };
            assert_eq!((txn, state, said), (live, TxnState::Committed, deadline));
            let most = (deadline.to_chrono() - asked).to_std().expect("ahead");
            assert!(
                left <= most && left + Duration::from_secs(5) > most,
                "{left:?} of {most:?}"
            );
        }
        other => panic!("a live transaction must be refused: {other:?}"),
    }
    assert_eq!(
        snapshot(&t.db).await,
        before,
        "a refused resolve wrote something"
    );

    // A GC that fences b (changed under the transaction) and dies before aborting.
    let txn = crashed_transfer_within(
        &t,
        &accounts,
        ("a", "b"),
        failpoint::ABORT_BEFORE,
        true,
        Duration::from_secs(2),
    )
    .await;
    past(&t, deadline_of(&t, txn).await).await;
    gc_dies_at(&t, failpoint::GC_CLAIM_BEFORE).await;
    let b =
        t.db.collection::<Document>("accounts")
            .find_one(doc! { "_id": "b" })
            .await
            .expect("read")
            .expect("b");
    assert_eq!(
        b.get_object_id(fields::ACTIVE_TXN),
        Ok(txn),
        "b is fenced: {b}"
    );

    let why = inspector.why("accounts", "b").await.expect("why b");
    assert_eq!(
        why.committed,
        CommittedValue::Live {
            version: 2,
            schema_version: 1,
            value: doc! { "_id": "b", "owner": "B", "balance": 50_i64, "note": "outside" },
        }
    );
    let hold = why.hold.expect("held by the fence");
    assert!(hold.fence && hold.op == "check", "{hold:?}");
    assert!(
        hold.note
            .as_deref()
            .is_some_and(|n| n.contains("carries a fence")),
        "{hold:?}"
    );
    assert_eq!(
        hold.record.as_ref().map(|r| r.state),
        Some(TxnState::Staging)
    );
    assert_eq!(hold.next.action, Action::RollBack);
    assert!(
        hold.next.says.contains("accounts/\"b\" is fenced"),
        "{}",
        hold.next.says
    );
    assert_eq!(hold.others.len(), 1);
    assert_eq!(hold.others[0].id, Bson::from("a"));
    assert_eq!(hold.others[0].state, DocState::Held { version: 2 });

    let resolved = inspector.resolve(txn).await.expect("resolve");
    assert_eq!(resolved.outcome, Settlement::RolledBack);
    assert_eq!(stored_account(&t, "a").await, (100, 1, None));
    assert_eq!(stored_account(&t, "b").await, (50, 2, None));
}
