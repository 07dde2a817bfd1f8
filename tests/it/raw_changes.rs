//! Raw changes between a read and a write: another writer (a shell, another service, a restore)
//! changes a plain document after mongotx read it and before mongotx's write lands. However small
//! the change (a number's type only, a decimal's precision, a string's case under a
//! case-insensitive collation), the write must notice it: a `VersionConflict`, with the raw
//! change left exactly as written, never replaced from the old read.

use std::str::FromStr;
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

/// Whether `command` is a write conditional on a whole document's content (its filter compares
/// `$$ROOT` with the document as read).
fn content_conditional(command: &Document) -> bool {
    let names = ["update", "delete", "findAndModify"];
    names.contains(&command_name(command)) && command.to_string().contains("$$ROOT")
}

/// Whether `command` stamps documents of `measures` (an `update` setting `_version`), whatever
/// its condition.
fn stamping(command: &Document) -> bool {
    command_name(command) == "update"
        && command.get_str("update").ok() == Some("measures")
        && command.to_string().contains("\"$set\": { \"_schema\"")
}

/// Holds back the first write `matches` accepts until the test releases it (its sender still
/// waits for it) and says so on `seen`, so that a test can change the document in between.
struct BeforeTheWrite {
    matches: fn(&Document) -> bool,
    release: std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
    seen: tokio::sync::mpsc::UnboundedSender<()>,
}

impl Rules for BeforeTheWrite {
    fn command(&self, command: &mut Document) -> Action {
        if !(self.matches)(command) {
            return Action::Forward;
        }
        let Some(release) = self
            .release
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        else {
            return Action::Forward;
        };
        let _ = self.seen.send(());
        Action::After(Box::pin(async move {
            // Released by the test, or let go after a while if the test gave up.
            let _ = tokio::time::timeout(Duration::from_secs(30), release).await;
        }))
    }
}

/// A store whose first write of a kind waits on the way until released, and the receiver told
/// when it does.
pub struct RawWindow {
    pub store: Store,
    seen: tokio::sync::mpsc::UnboundedReceiver<()>,
    release: Option<tokio::sync::oneshot::Sender<()>>,
    _proxy: WireProxy,
}

impl RawWindow {
    /// Holds back the first content-conditional write.
    pub async fn open(t: &TestDb) -> RawWindow {
        RawWindow::before(t, content_conditional).await
    }

    /// Holds back the first write `matches` accepts.
    pub async fn before(t: &TestDb, matches: fn(&Document) -> bool) -> RawWindow {
        let (seen_tx, seen) = tokio::sync::mpsc::unbounded_channel();
        let (release, held) = tokio::sync::oneshot::channel();
        let proxy = WireProxy::start(
            &common::server_uri(),
            BeforeTheWrite {
                matches,
                release: std::sync::Mutex::new(Some(held)),
                seen: seen_tx,
            },
        )
        .await;
        let store = Store::new(proxy.client().await.database(t.db.name()));
        RawWindow {
            store,
            seen,
            release: Some(release),
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

    /// Lets the held-back write go on to the server.
    pub fn release(&mut self) {
        if let Some(release) = self.release.take() {
            let _ = release.send(());
        }
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
        let case = RawCase::value(before, after);
        let (written, stored) = case
            .run(|_, measures, v| async move {
                measures
                    .update("m", v, &Update::new().set("label", "bob"))
                    .await
            })
            .await;
        case.assert_kept(what, &written, &stored);
    }
}

/// A version conflict, as a repository's write or a transaction's commit reports it.
trait IsConflict {
    fn is_conflict(&self) -> bool;
}

impl IsConflict for RepoError {
    fn is_conflict(&self) -> bool {
        matches!(self, RepoError::VersionConflict { .. })
    }
}

impl IsConflict for mongotx::TxnError {
    fn is_conflict(&self) -> bool {
        self.repo_error().is_some_and(IsConflict::is_conflict)
    }
}

/// A plain measure `m` (in a collection created with `collation`, if given) made of `original`'s
/// fields; the raw change `$set`s `raw_set`.
struct RawCase {
    collation: Option<Document>,
    original: Document,
    raw_set: Document,
}

impl RawCase {
    /// `{label: "alice", value: before}`, whose value the raw change sets to `after`.
    fn value(before: Bson, after: Bson) -> RawCase {
        RawCase {
            collation: None,
            original: doc! { "label": "alice", "value": before },
            raw_set: doc! { "value": after },
        }
    }

    /// The document the raw change leaves.
    fn changed(&self) -> Document {
        let mut changed = doc! { "_id": "m" };
        changed.extend(self.original.clone());
        changed.extend(self.raw_set.clone());
        changed
    }

    /// Runs `write` through a store whose content-conditional write waits on the way, makes the
    /// raw change meanwhile, and returns what `write` said and the document as stored afterwards.
    async fn run<F, Fut, R>(&self, write: F) -> (R, Document)
    where
        F: FnOnce(Store, Repository<Document>, i64) -> Fut,
        Fut: std::future::Future<Output = R> + Send + 'static,
        R: Send + 'static,
    {
        let t = TestDb::new().await;
        if let Some(collation) = &self.collation {
            t.db.run_command(doc! { "create": "measures", "collation": collation.clone() })
                .await
                .unwrap();
        }
        let raw = t.db.collection::<Document>("measures");
        let mut stored = doc! { "_id": "m" };
        stored.extend(self.original.clone());
        raw.insert_one(stored).await.unwrap();
        let mut window = RawWindow::open(&t).await;
        let measures: Repository<Document> =
            window.store.repository(measures_spec()).await.unwrap();
        let version = measures.get("m").await.unwrap().version;
        let writer = tokio::spawn(write(window.store.clone(), measures, version));
        window.write_on_its_way().await;
        raw.update_one(doc! { "_id": "m" }, doc! { "$set": self.raw_set.clone() })
            .await
            .unwrap();
        window.release();
        let said = writer.await.unwrap();
        let stored = raw.find_one(doc! { "_id": "m" }).await.unwrap().unwrap();
        (said, stored)
    }

    /// Asserts that `said` is a conflict and `stored` the raw change, byte for byte.
    fn assert_kept<T, E>(&self, what: &str, said: &Result<T, E>, stored: &Document)
    where
        T: std::fmt::Debug,
        E: std::fmt::Debug + IsConflict,
    {
        assert!(
            said.as_ref().err().is_some_and(IsConflict::is_conflict),
            "{what}: {said:?}"
        );
        // Byte for byte (Rust's Bson equality tells int from long, but -0.0 equals 0.0).
        assert_eq!(
            bson::to_vec(stored).unwrap(),
            bson::to_vec(&self.changed()).unwrap(),
            "{what}: the raw change must stay as written: {stored}"
        );
    }
}

/// Issue 46, case 2, the other writes that start from a plain document's content: a delete (its
/// tombstone replaces the document), and a transaction (which stamps the document before its
/// commit protocol runs; a stamp on content the client never read, then rolled back, would put
/// the old types back from its undo).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_type_only_raw_change_before_a_delete_or_a_transaction_is_a_conflict() {
    for (what, before, after) in type_only_changes() {
        let case = RawCase::value(before, after);
        let (deleted, stored) = case
            .run(|_, measures, v| async move { measures.delete("m", v).await })
            .await;
        case.assert_kept(&format!("delete, {what}"), &deleted, &stored);

        let (committed, stored) = case
            .run(|store, measures, v| async move {
                let tx = mongotx::Transactions::new(&store).begin();
                tx.update(&measures, "m", v, &Update::new().set("label", "bob"))
                    .await?;
                tx.commit().await
            })
            .await;
        // Nothing stamped, nothing lost: the commit fails with the conflict its stamp met.
        case.assert_kept(&format!("transaction, {what}"), &committed, &stored);
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
        window.release();
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
        let strength = if what.contains("strength 1") { 1 } else { 2 };
        let case = RawCase {
            collation: Some(doc! { "locale": "en", "strength": strength }),
            original: doc! { "label": before, "value": 1_i64 },
            raw_set: doc! { "label": after },
        };
        let (written, stored) = case
            .run(|_, measures, v| async move {
                measures
                    .update("m", v, &Update::new().set("value", 2_i64))
                    .await
            })
            .await;
        case.assert_kept(what, &written, &stored);
    }
}

/// Stages an adjust of account `q` (at version 1) in `tx`, moves `q` under it, and commits: the
/// round's apply of `q` is refused, so whatever else `tx` applied is rolled back.
async fn refused_by_a_moved_account(
    tx: mongotx::Transaction,
    accounts: &Repository<crate::common::Account>,
) {
    tx.adjust(
        accounts,
        "q",
        1,
        &mongotx::Adjust::new().by("balance", 1_i64),
    )
    .await
    .unwrap();
    accounts
        .update("q", 1, &Update::new().set("owner", "moved"))
        .await
        .unwrap();
    let refused = tx.commit().await;
    assert!(refused.is_err(), "{refused:?}");
}

/// The user fields of `doc` in their stored order, system fields left out.
fn user_fields(doc: &Document) -> Vec<(String, Bson)> {
    doc.iter()
        .filter(|(k, _)| !k.starts_with('_') || k.as_str() == "_id")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Issue 46, case 5: an undo puts a document back as it was, field order included. It `$set`
/// the restored fields, so a field the transaction removed (an unset, or a field an upgrade step
/// renamed) came back after the system fields: a rolled-back transaction altered a plain
/// document beyond its stamp, and a stamped one beyond nothing.
#[tokio::test]
async fn a_rolled_back_transaction_leaves_the_field_order_as_it_was() {
    use crate::common::{accounts_spec, Account};
    use mongotx::testkit::failpoint::APPLY_BEFORE;
    for (what, plain, by_gc) in [
        ("plain, rolled back by its coordinator", true, false),
        ("stamped, rolled back by its coordinator", false, false),
        ("plain, rolled back by the GC", true, true),
    ] {
        let t = TestDb::new().await;
        let raw = t.db.collection::<Document>("accounts");
        let original = doc! {
            "_id": "p", "owner": "P", "note": "keep me here", "balance": 5_i64, "currency": "EUR",
        };
        raw.insert_one(original.clone()).await.unwrap();
        let accounts = t
            .store
            .repository::<Account>(accounts_spec())
            .await
            .unwrap();
        common::seed_accounts(&accounts, &[("q", 1)]).await;
        let mut version = accounts.get("p").await.unwrap().version;
        if !plain {
            version = accounts
                .update("p", version, &Update::new().set("balance", 6_i64))
                .await
                .unwrap();
        }
        let before = raw.find_one(doc! { "_id": "p" }).await.unwrap().unwrap();
        let change = Update::new().unset("note").set("owner", "Q");
        if by_gc {
            // The coordinator dies after its first apply; the GC rolls the transaction back later.
            let repo = accounts.clone();
            let txns = mongotx::Transactions::with_options(
                &t.store,
                mongotx::options::TxnOptions::default()
                    .timeout(Duration::from_millis(200))
                    .fault_injector(Arc::new(common::CrashAt(
                        mongotx::testkit::failpoint::Failpoint {
                            name: APPLY_BEFORE,
                            step: 1,
                        },
                    ))),
            );
            let tx = txns.begin();
            tx.update(&repo, "p", version, &change).await.unwrap();
            tx.adjust(&repo, "q", 1, &mongotx::Adjust::new().by("balance", 1_i64))
                .await
                .unwrap();
            let crashed = tx.commit().await;
            assert!(crashed.is_err(), "{what}: {crashed:?}");
            tokio::time::sleep(Duration::from_millis(400)).await;
            mongotx::gc::Gc::new(&t.store, mongotx::gc::GcOptions::default())
                .run_round()
                .await
                .unwrap();
        } else {
            // q moved under the transaction: its apply is refused and p's is rolled back.
            let tx = mongotx::Transactions::new(&t.store).begin();
            tx.update(&accounts, "p", version, &change).await.unwrap();
            refused_by_a_moved_account(tx, &accounts).await;
        }
        common::assert_settled(&t, &["accounts"], what).await;
        let after = raw.find_one(doc! { "_id": "p" }).await.unwrap().unwrap();
        assert_eq!(
            user_fields(&after),
            user_fields(&before),
            "{what}: the user fields in their order"
        );
        assert_eq!(
            user_fields(&before).len(),
            user_fields(&original).len(),
            "{what}"
        );
        if !plain {
            assert_eq!(after, before, "{what}: exactly as before");
        }
        let names: Vec<&str> = after.keys().map(String::as_str).collect();
        let first_system = names
            .iter()
            .position(|n| n.starts_with("_s") || n.starts_with("_v"));
        assert!(
            first_system.is_some_and(|i| names[i..].iter().all(|n| n.starts_with('_'))),
            "{what}: the system fields come after the user's: {names:?}"
        );
    }
}

/// Issue 46, case 5, for an upgrade's rename: a transaction's change of a profile stored at schema
/// version 1 rewrites it in the version 2 shape (`name` becomes `given_name` and `family_name`);
/// rolled back, the document is the version 1 one again, `name` where it was.
#[tokio::test]
async fn a_rolled_back_rewrite_puts_renamed_fields_back_in_place() {
    use crate::common::{profiles_spec, Profile};
    let t = TestDb::new().await;
    let raw = t.db.collection::<Document>("profiles");
    let stored = doc! {
        "_id": "ada", "name": "Ada Lovelace", "email": "ada@example.org",
        "_schema": 1_i64, "_version": 3_i64,
    };
    raw.insert_one(stored.clone()).await.unwrap();
    let profiles = t
        .store
        .repository::<Profile>(profiles_spec())
        .await
        .unwrap();
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("q", 1)]).await;
    let tx = mongotx::Transactions::new(&t.store).begin();
    tx.update(
        &profiles,
        "ada",
        3,
        &Update::new().set("email", "ada@analytical.engine"),
    )
    .await
    .unwrap();
    refused_by_a_moved_account(tx, &accounts).await;
    common::assert_settled(&t, &["profiles"], "rewrite rolled back").await;
    let after = raw.find_one(doc! { "_id": "ada" }).await.unwrap().unwrap();
    assert_eq!(
        bson::to_vec(&after).unwrap(),
        bson::to_vec(&stored).unwrap(),
        "exactly as stored before: {after}"
    );
}

/// Issue 46, case 8: the first adjust of a plain document holding a decimal was refused as "not a
/// number", while a stamped document's decimal is incremented by the server.
#[tokio::test]
async fn the_first_adjust_of_a_plain_decimal_adds_on_the_server() {
    let t = TestDb::new().await;
    let raw = t.db.collection::<Document>("measures");
    raw.insert_one(doc! { "_id": "m", "label": "alice", "value": decimal("1.50") })
        .await
        .unwrap();
    let measures: Repository<Document> = t.store.repository(measures_spec()).await.unwrap();
    let read = measures.get("m").await.unwrap();
    let version = measures
        .adjust(
            "m",
            read.version,
            &mongotx::Adjust::new().by("value", 2_i64),
        )
        .await
        .expect("the decimal is incremented");
    assert_eq!(version, 1);
    let stored = raw.find_one(doc! { "_id": "m" }).await.unwrap().unwrap();
    assert_eq!(stored.get("value"), Some(&decimal("3.50")), "{stored}");
    assert_eq!(stored.get_str("label").ok(), Some("alice"));
    // The stamped document goes on the same way.
    let version = measures
        .adjust("m", version, &mongotx::Adjust::new().by("value", 1_i64))
        .await
        .unwrap();
    assert_eq!(version, 2);
    let stored = raw.find_one(doc! { "_id": "m" }).await.unwrap().unwrap();
    assert_eq!(stored.get("value"), Some(&decimal("4.50")), "{stored}");
}

/// Turns every `BADUTF8!` in replies into bytes that are not UTF-8, as a server returns a string
/// some old writer stored.
struct InvalidUtf8;

impl Rules for InvalidUtf8 {
    fn reply_bytes(&self, _command: &Document, message: &mut [u8]) {
        let marker = b"BADUTF8!";
        let mut i = 0;
        while i + marker.len() <= message.len() {
            if &message[i..i + marker.len()] == marker {
                message[i..i + marker.len()].copy_from_slice(b"\xff\xfe\xfdBAD!!");
            }
            i += 1;
        }
    }
}

/// Issue 46, case 8: one document the driver cannot convert (invalid UTF-8) stopped the whole
/// adoption, and every rerun stopped on it again. It fails only itself now: reported, left plain.
#[tokio::test]
async fn adoption_goes_past_a_document_it_cannot_read() {
    let t = TestDb::new().await;
    let raw = t.db.collection::<Document>("measures");
    raw.insert_many([
        doc! { "_id": "a", "label": "fine", "value": 1_i64 },
        doc! { "_id": "b", "label": "BADUTF8!", "value": 2_i64 },
        doc! { "_id": "c", "label": "fine too", "value": 3_i64 },
    ])
    .await
    .unwrap();
    let proxy = WireProxy::start(&common::server_uri(), InvalidUtf8).await;
    let store = Store::new(proxy.client().await.database(t.db.name()));
    let measures: Repository<Document> = store.repository(measures_spec()).await.unwrap();
    for run in 0..2 {
        let report = measures
            .adopt(mongotx::adopt::AdoptOptions::new().batch_size(2))
            .await
            .unwrap_or_else(|e| panic!("run {run}: {e}"));
        assert_eq!(report.refused, 1, "run {run}: {report:?}");
        assert_eq!(report.refusals[0].id, "\"b\"", "run {run}: {report:?}");
        assert!(
            report.refusals[0].rule.contains("cannot be read"),
            "run {run}: {report:?}"
        );
        assert_eq!(
            report.stamped,
            if run == 0 { 2 } else { 0 },
            "run {run}: {report:?}"
        );
    }
    let b = raw.find_one(doc! { "_id": "b" }).await.unwrap().unwrap();
    assert_eq!(
        b,
        doc! { "_id": "b", "label": "BADUTF8!", "value": 2_i64 },
        "left plain"
    );
    drop(proxy);
}

/// Issue 46, case 4: a transaction could not touch a plain document the schema refuses: it
/// stamped every plain document before its commit protocol ran, and a stamp needs content the
/// schema accepts, so even an update that makes the document valid failed `Invalid`, where the
/// same update outside a transaction stamps it. Now such an update (or adjust) rewrites the plain
/// document whole in the transaction's one write, conditional on its exact content, and its undo
/// makes it the same plain document again. A delete, a check or a guard needs the document held
/// as it is, which a server validator refuses for content its schema refuses: those stay a typed
/// `Invalid`, changing nothing.
#[tokio::test]
async fn a_transaction_may_fix_a_plain_document_the_schema_refuses() {
    use crate::common::{accounts_spec, Account};
    let t = TestDb::new().await;
    let raw = t.db.collection::<Document>("accounts");
    let broken = doc! { "_id": "p", "owner": "P", "balance": "100", "note": "typed by hand" };
    raw.insert_one(broken.clone()).await.unwrap();
    let accounts = t
        .store
        .repository::<Account>(accounts_spec())
        .await
        .unwrap();
    let loose = t
        .store
        .repository::<Document>(accounts_spec())
        .await
        .unwrap();
    common::seed_accounts(&accounts, &[("q", 1)]).await;
    let read = loose.get("p").await.unwrap();
    assert!(read.is_plain());

    // Refused by the schema: delete, check and guard are refused by name, and change nothing.
    for what in ["delete", "check", "guard"] {
        let tx = mongotx::Transactions::new(&t.store).begin();
        match what {
            "delete" => tx.delete(&loose, "p", read.version).unwrap(),
            "check" => tx.check(&loose, "p", read.version).unwrap(),
            _ => tx.guard(&loose, "p", doc! { "owner": "P" }).unwrap(),
        }
        let refused = tx.commit().await;
        let invalid = refused
            .as_ref()
            .err()
            .and_then(|e| e.repo_error())
            .is_some_and(|e| matches!(e, RepoError::Invalid { field, .. } if field == "balance"));
        assert!(invalid, "{what}: {refused:?}");
        let stored = raw.find_one(doc! { "_id": "p" }).await.unwrap().unwrap();
        assert_eq!(stored, broken, "{what} changed nothing");
    }

    // An update that fixes it, rolled back (q moved under the transaction): the same plain
    // document again, byte for byte.
    let tx = mongotx::Transactions::new(&t.store).begin();
    tx.update(
        &loose,
        "p",
        read.version,
        &Update::new().set("balance", 100_i64),
    )
    .await
    .unwrap();
    refused_by_a_moved_account(tx, &accounts).await;
    common::assert_settled(&t, &["accounts"], "rolled back").await;
    let stored = raw.find_one(doc! { "_id": "p" }).await.unwrap().unwrap();
    assert_eq!(
        bson::to_vec(&stored).unwrap(),
        bson::to_vec(&broken).unwrap(),
        "rolled back to the plain document: {stored}"
    );

    // The same update committed: the document is stamped with the fix.
    let tx = mongotx::Transactions::new(&t.store).begin();
    tx.update(
        &loose,
        "p",
        read.version,
        &Update::new().set("balance", 100_i64),
    )
    .await
    .unwrap();
    let outcome = tx.commit().await.expect("the fix commits");
    assert_eq!(outcome.written.len(), 1);
    common::assert_settled(&t, &["accounts"], "committed").await;
    let fixed = accounts.get("p").await.unwrap();
    assert!(!fixed.is_plain());
    assert_eq!(
        (
            fixed.owner.as_str(),
            fixed.balance,
            fixed.note.as_deref(),
            fixed.version
        ),
        ("P", 100, Some("typed by hand"), outcome.written[0].version)
    );
}
