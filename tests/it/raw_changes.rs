//! Raw changes between a read and a write: another writer (a shell, another service, a restore)
//! changes a plain document after mongotx read it and before mongotx's write lands. However small
//! the change (a number's type only, a decimal's precision, a string's case under a
//! case-insensitive collation), the write must notice it: a `VersionConflict`, with the raw
//! change left exactly as written, never replaced from the old read.

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bson::{doc, Bson, Decimal128, Document};
use mongotx::{CollectionSpec, RepoError, Repository, Store, Update};

use crate::common::wire_proxy::{command_name, Action, Rules, WireProxy};
use crate::common::{self, TestDb};

/// Measures: a label and a value of any numeric type (or a document of them).
pub const MEASURES_SCHEMA: &str = r#"{
  "bsonType": "object",
  "required": ["_id", "_schema", "_version", "label"],
  "properties": {
    "_id": { "bsonType": "string" },
    "_schema": { "bsonType": "long" },
    "_version": { "bsonType": "long" },
    "_txn": { "bsonType": "objectId" },
    "_deleted": { "bsonType": "date" },
    "_deleting": { "bsonType": "bool" },
    "label": { "bsonType": "string" },
    "value": { "bsonType": ["int", "long", "double", "decimal", "object"] }
  }
}"#;

pub fn measures_spec() -> CollectionSpec {
    CollectionSpec::new("measures", 1, MEASURES_SCHEMA).expect("measures schema")
}

/// Whether `command` is a write to `measures` conditional on a whole document's content (its
/// filter compares `$$ROOT` with the document as read).
fn content_conditional(command: &Document) -> bool {
    let names = ["update", "delete", "findAndModify"];
    names.contains(&command_name(command))
        && command.get_str(command_name(command)).ok() == Some("measures")
        && command.to_string().contains("$$ROOT")
}

/// Whether `command` stamps documents of `measures` (an `update` setting `_version`), whatever
/// its condition.
fn stamping(command: &Document) -> bool {
    command_name(command) == "update"
        && command.get_str("update").ok() == Some("measures")
        && command.to_string().contains("\"$set\": { \"_schema\"")
}

/// Holds back the first write `matches` accepts for `delay` (its sender still waits for it) and
/// says so on `seen`, so that a test can change the document in between.
struct BeforeTheWrite {
    matches: fn(&Document) -> bool,
    delay: Duration,
    fired: Arc<AtomicUsize>,
    seen: tokio::sync::mpsc::UnboundedSender<()>,
}

impl Rules for BeforeTheWrite {
    fn command(&self, command: &mut Document) -> Action {
        if (self.matches)(command)
            && self
                .fired
                .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            let _ = self.seen.send(());
            return Action::Delay(self.delay);
        }
        Action::Forward
    }
}

/// A store whose first write of a kind waits on the way, and the receiver told when it does.
pub struct RawWindow {
    pub store: Store,
    pub seen: tokio::sync::mpsc::UnboundedReceiver<()>,
    _proxy: WireProxy,
}

impl RawWindow {
    /// Holds back the first content-conditional write to `measures`.
    pub async fn open(t: &TestDb) -> RawWindow {
        RawWindow::before(t, content_conditional).await
    }

    /// Holds back the first write `matches` accepts.
    pub async fn before(t: &TestDb, matches: fn(&Document) -> bool) -> RawWindow {
        let (seen_tx, seen) = tokio::sync::mpsc::unbounded_channel();
        let proxy = WireProxy::start(
            &common::server_uri(),
            BeforeTheWrite {
                matches,
                delay: Duration::from_millis(700),
                fired: Arc::new(AtomicUsize::new(0)),
                seen: seen_tx,
            },
        )
        .await;
        let store = Store::new(proxy.client().await.database(t.db.name()));
        RawWindow {
            store,
            seen,
            _proxy: proxy,
        }
    }

    /// Waits until the write is on its way, held back.
    pub async fn write_on_its_way(&mut self) {
        tokio::time::timeout(Duration::from_secs(20), self.seen.recv())
            .await
            .expect("the content-conditional write was never sent")
            .expect("the proxy is gone");
    }
}

fn decimal(s: &str) -> Bson {
    Bson::Decimal128(Decimal128::from_str(s).expect("decimal"))
}

/// Each raw change keeps the value as MongoDB compares it, and changes only its representation.
fn type_only_changes() -> Vec<(&'static str, Bson, Bson)> {
    vec![
        ("int to long", Bson::Int32(5), Bson::Int64(5)),
        ("long to double", Bson::Int64(5), Bson::Double(5.0)),
        ("int to double", Bson::Int32(5), Bson::Double(5.0)),
        ("double to decimal", Bson::Double(5.0), decimal("5.0")),
        ("decimal 1.0 to 1.00", decimal("1.0"), decimal("1.00")),
        ("double 0 to -0", Bson::Double(0.0), Bson::Double(-0.0)),
        (
            "a long deep in an array of a document",
            Bson::Document(doc! { "parts": [1_i32, { "n": 2_i32 }, [3_i32]] }),
            Bson::Document(doc! { "parts": [1_i32, { "n": 2_i64 }, [3_i32]] }),
        ),
        (
            "a decimal in a nested array",
            Bson::Document(doc! { "parts": [[decimal("2.5")]] }),
            Bson::Document(doc! { "parts": [[decimal("2.50")]] }),
        ),
    ]
}

/// Issue 46, case 2: the first write of a plain document is conditional on its content being
/// the one read, compared once with `$eq`, which sees int 5 = long 5 = double 5.0 and decimal
/// 1.0 = 1.00. A type-only raw change between the read and the write slipped through, and the
/// write replaced the document from the old read: the raw change was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_type_only_raw_change_before_a_first_write_is_a_conflict_never_lost() {
    for (what, before, after) in type_only_changes() {
        let t = TestDb::new().await;
        let raw = t.db.collection::<Document>("measures");
        raw.insert_one(doc! { "_id": "m", "label": "alice", "value": before.clone() })
            .await
            .unwrap();
        let mut window = RawWindow::open(&t).await;
        let measures: Repository<Document> =
            window.store.repository(measures_spec()).await.unwrap();
        let read = measures.get("m").await.unwrap();
        assert!(read.is_plain(), "{what}");
        let writer = {
            let measures = measures.clone();
            let version = read.version;
            tokio::spawn(async move {
                measures
                    .update("m", version, &Update::new().set("label", "bob"))
                    .await
            })
        };
        window.write_on_its_way().await;
        raw.update_one(
            doc! { "_id": "m" },
            doc! { "$set": { "value": after.clone() } },
        )
        .await
        .unwrap();
        let written = writer.await.unwrap();
        assert!(
            matches!(written, Err(RepoError::VersionConflict { .. })),
            "{what}: {written:?}"
        );
        let stored = raw.find_one(doc! { "_id": "m" }).await.unwrap().unwrap();
        assert_eq!(
            stored,
            doc! { "_id": "m", "label": "alice", "value": after.clone() },
            "{what}: the raw change must stay as written"
        );
        // Byte for byte (Rust's Bson equality tells int from long, but -0.0 equals 0.0).
        assert_eq!(
            bson::to_vec(&stored).unwrap(),
            bson::to_vec(&doc! { "_id": "m", "label": "alice", "value": after }).unwrap(),
            "{what}"
        );
    }
}

/// Runs `write` against a plain measure `{label: "alice", value: before}` through a store whose
/// content-conditional write waits on the way, changes the value to `after` with the raw driver
/// meanwhile, and returns what `write` said and the document as stored afterwards.
async fn with_a_raw_change_in_between<F, Fut, R>(
    before: Bson,
    after: Bson,
    write: F,
) -> (R, Document)
where
    F: FnOnce(Store, Repository<Document>, i64) -> Fut,
    Fut: std::future::Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    let t = TestDb::new().await;
    let raw = t.db.collection::<Document>("measures");
    raw.insert_one(doc! { "_id": "m", "label": "alice", "value": before })
        .await
        .unwrap();
    let mut window = RawWindow::open(&t).await;
    let measures: Repository<Document> = window.store.repository(measures_spec()).await.unwrap();
    let version = measures.get("m").await.unwrap().version;
    let writer = tokio::spawn(write(window.store.clone(), measures, version));
    window.write_on_its_way().await;
    raw.update_one(doc! { "_id": "m" }, doc! { "$set": { "value": after } })
        .await
        .unwrap();
    let said = writer.await.unwrap();
    let stored = raw.find_one(doc! { "_id": "m" }).await.unwrap().unwrap();
    (said, stored)
}

/// Issue 46, case 2, the other writes that start from a plain document's content: a delete (its
/// tombstone replaces the document), and a transaction (which stamps the document before its
/// commit protocol runs; a stamp on content the client never read, then rolled back, would put
/// the old types back from its undo).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_type_only_raw_change_before_a_delete_or_a_transaction_is_a_conflict() {
    for (what, before, after) in type_only_changes() {
        let (deleted, stored) = with_a_raw_change_in_between(
            before.clone(),
            after.clone(),
            |_, measures, v| async move { measures.delete("m", v).await },
        )
        .await;
        assert!(
            matches!(deleted, Err(RepoError::VersionConflict { .. })),
            "delete, {what}: {deleted:?}"
        );
        assert_eq!(
            bson::to_vec(&stored).unwrap(),
            bson::to_vec(&doc! { "_id": "m", "label": "alice", "value": after.clone() }).unwrap(),
            "delete, {what}"
        );

        let (committed, stored) = with_a_raw_change_in_between(
            before.clone(),
            after.clone(),
            |store, measures, v| async move {
                let tx = mongotx::Transactions::new(&store).begin();
                tx.update(&measures, "m", v, &Update::new().set("label", "bob"))
                    .await?;
                tx.commit().await
            },
        )
        .await;
        let conflict = committed
            .as_ref()
            .err()
            .and_then(|e| e.repo_error())
            .is_some_and(|e| matches!(e, RepoError::VersionConflict { .. }));
        assert!(conflict, "transaction, {what}: {committed:?}");
        assert_eq!(
            bson::to_vec(&stored).unwrap(),
            bson::to_vec(&doc! { "_id": "m", "label": "alice", "value": after.clone() }).unwrap(),
            "transaction, {what}: nothing stamped, nothing lost"
        );
    }
}

/// Measures whose value must be a long: a raw change of a long into an equal int makes a
/// document the schema refuses.
fn long_measures_spec() -> CollectionSpec {
    CollectionSpec::new(
        "measures",
        1,
        &MEASURES_SCHEMA.replace(
            r#"["int", "long", "double", "decimal", "object"]"#,
            r#""long""#,
        ),
    )
    .expect("long measures schema")
}

/// Issue 46, cases 2 and 3: adoption stamps a batch conditionally on each document being the one
/// it read and checked. Where the store had installed the collection's validator, the condition
/// was only "not stamped yet", trusting the server to check the stamp; but an administrator may
/// set the validator to warn or switch it off, and a newer process (schema version 2) installs a
/// validator that lets every other version through unchecked. A raw change of a long 5 into an
/// int 5 between the read and the stamp then went unseen, and a document the schema refuses was
/// stamped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adoption_never_stamps_content_it_did_not_check() {
    for relaxed in [
        "validationAction warn",
        "validationLevel off",
        "a newer process's validator",
    ] {
        let t = TestDb::new().await;
        let raw = t.db.collection::<Document>("measures");
        raw.insert_many([
            doc! { "_id": "m", "label": "alice", "value": 5_i64 },
            doc! { "_id": "n", "label": "bob", "value": 6_i64 },
        ])
        .await
        .unwrap();
        let mut window = RawWindow::before(&t, stamping).await;
        let measures: Repository<Document> =
            window.store.repository(long_measures_spec()).await.unwrap();
        match relaxed {
            "validationAction warn" => {
                t.db.run_command(doc! { "collMod": "measures", "validationAction": "warn" })
                    .await
                    .unwrap();
            }
            "validationLevel off" => {
                t.db.run_command(doc! { "collMod": "measures", "validationLevel": "off" })
                    .await
                    .unwrap();
            }
            _ => {
                let newer = CollectionSpec::new(
                    "measures",
                    2,
                    &MEASURES_SCHEMA.replace(r#""long" }"#, r#""long", "minimum": 2 }"#),
                )
                .unwrap()
                .upgrade(1, Ok);
                Store::new(t.db.clone())
                    .repository::<Document>(newer)
                    .await
                    .unwrap();
            }
        }
        let adoption =
            tokio::spawn(async move { measures.adopt(mongotx::adopt::AdoptOptions::new()).await });
        window.write_on_its_way().await;
        raw.update_one(doc! { "_id": "m" }, doc! { "$set": { "value": 5_i32 } })
            .await
            .unwrap();
        let report = adoption.await.unwrap().expect("adoption");
        assert_eq!(
            (report.stamped, report.refused),
            (1, 1),
            "{relaxed}: {report:?}"
        );
        assert_eq!(report.refusals[0].id, "\"m\"", "{relaxed}: {report:?}");
        let m = raw.find_one(doc! { "_id": "m" }).await.unwrap().unwrap();
        assert_eq!(
            m,
            doc! { "_id": "m", "label": "alice", "value": 5_i32 },
            "{relaxed}: refused by the schema, so left plain"
        );
    }
}

/// Issue 46, case 2 under a collation: in a collection whose default collation ignores case, the
/// content condition's `$eq` took "ALICE" for "alice", and a first write replaced a raw change of
/// case only from the old read.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_case_only_raw_change_under_a_collation_is_a_conflict_never_lost() {
    for (what, before, after) in [
        ("upper case", "alice", "ALICE"),
        ("one letter", "alice", "alicE"),
        ("an accent under strength 1", "resume", "resumé"),
    ] {
        let t = TestDb::new().await;
        let strength = if what.contains("strength 1") { 1 } else { 2 };
        t.db.run_command(doc! {
            "create": "measures",
            "collation": { "locale": "en", "strength": strength },
        })
        .await
        .unwrap();
        let raw = t.db.collection::<Document>("measures");
        raw.insert_one(doc! { "_id": "m", "label": before, "value": 1_i64 })
            .await
            .unwrap();
        let mut window = RawWindow::open(&t).await;
        let measures: Repository<Document> =
            window.store.repository(measures_spec()).await.unwrap();
        let version = measures.get("m").await.unwrap().version;
        let writer = tokio::spawn(async move {
            measures
                .update("m", version, &Update::new().set("value", 2_i64))
                .await
        });
        window.write_on_its_way().await;
        raw.update_one(doc! { "_id": "m" }, doc! { "$set": { "label": after } })
            .await
            .unwrap();
        let written = writer.await.unwrap();
        assert!(
            matches!(written, Err(RepoError::VersionConflict { .. })),
            "{what}: {written:?}"
        );
        let stored = raw.find_one(doc! { "_id": "m" }).await.unwrap().unwrap();
        assert_eq!(
            stored,
            doc! { "_id": "m", "label": after, "value": 1_i64 },
            "{what}: the raw change must stay as written"
        );
    }
}
