//! Durability of the protocol on replica sets: the writes that decide or carry a transaction's
//! outcome are majority-acknowledged and the reads that decide outcomes are majority reads, so a
//! failover cannot lose an acknowledged commit point. Detected from the server's `hello` reply
//! (the wire proxy makes the test server answer like a replica-set member) or set explicitly.

use crate::common;

use std::sync::{Arc, Mutex};

use crate::common::wire_proxy::{command_name, writes_in, Action, Rules, WireProxy};
use crate::common::TestDb;
use bson::Document;
use mongotx::collections::TRANSACTIONS_COLLECTION;
use mongotx::options::Durability;
use mongotx::server::Topology;
use mongotx::testkit::failpoint::BEGIN_BEFORE;
use mongotx::{Adjust, Store};

/// Records every command; optionally answers `hello` / `isMaster` as a replica-set member.
#[derive(Clone)]
struct Recorder {
    replica_set: bool,
    seen: Arc<Mutex<Vec<Document>>>,
}

impl Rules for Recorder {
    fn command(&self, command: &mut Document) -> Action {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(command.clone());
        Action::Forward
    }

    fn reply(&self, command: &Document, reply: &mut Document) {
        let name = command_name(command).to_ascii_lowercase();
        if self.replica_set && (name == "hello" || name == "ismaster") {
            reply.insert("setName", "rs0");
        }
    }
}

impl Recorder {
    fn new(replica_set: bool) -> Recorder {
        Recorder {
            replica_set,
            seen: Arc::new(Mutex::new(Vec::new())),
        }
    }

    fn take(&self) -> Vec<Document> {
        std::mem::take(&mut *self.seen.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// The commands named `name` on `coll`, the writes inside a bulkWrite counted one by one (each
/// with the bulk's write concern).
fn on(commands: &[Document], name: &str, coll: &str) -> Vec<Document> {
    commands
        .iter()
        .flat_map(writes_in)
        .filter(|c| command_name(c) == name && c.get_str(name).ok() == Some(coll))
        .collect()
}

fn write_concern(command: &Document) -> Option<String> {
    command
        .get_document("writeConcern")
        .ok()
        .and_then(|wc| wc.get("w"))
        .map(|w| w.to_string())
}

fn read_concern(command: &Document) -> Option<String> {
    command
        .get_document("readConcern")
        .ok()
        .and_then(|rc| rc.get_str("level").ok())
        .map(str::to_string)
}

/// Runs a transfer and a read of a document held by a stalled transaction through `proxy`;
/// returns the commands of each phase: (seeding, commit, resolving read).
async fn exercise(
    t: &TestDb,
    proxy: &WireProxy,
    recorder: &Recorder,
    durability: Durability,
) -> (Vec<Document>, Vec<Document>, Vec<Document>) {
    let store = Store::builder(proxy.client().await.database(t.db.name()))
        .durability(durability)
        .build();
    let accounts = common::open_accounts(&store).await;
    recorder.take();
    common::seed_accounts(&accounts, &[("a", 100), ("b", 0), ("c", 5)]).await;
    let seeding = recorder.take();

    let tx = common::finishing(&store).begin();
    tx.adjust(&accounts, "a", 1, &Adjust::new().by("balance", -10_i64))
        .await
        .expect("stage");
    tx.adjust(&accounts, "b", 1, &Adjust::new().by("balance", 10_i64))
        .await
        .expect("stage");
    recorder.take();
    tx.commit().await.expect("commit");
    let commit = recorder.take();

    let repo = accounts.clone();
    common::stalled_at(&store, BEGIN_BEFORE, |tx| async move {
        tx.adjust(&repo, "c", 1, &Adjust::new().by("balance", 1_i64))
            .await
    })
    .await;
    recorder.take();
    assert_eq!(accounts.get("c").await.expect("c").balance, 5);
    let reading = recorder.take();
    (seeding, commit, reading)
}

#[tokio::test]
async fn on_a_replica_set_every_protocol_write_and_deciding_read_is_majority() {
    let t = TestDb::new().await;
    let recorder = Recorder::new(true);
    let proxy = WireProxy::start(&common::server_uri(), recorder.clone()).await;
    let db = proxy.client().await.database(t.db.name());
    let caps = mongotx::server::probe(&db).await.expect("probe");
    assert_eq!(
        caps.topology,
        Topology::ReplicaSet { name: "rs0".into() },
        "the probe reports it"
    );
    assert_eq!(
        Store::new(db).topology().await.expect("topology"),
        Topology::ReplicaSet { name: "rs0".into() }
    );

    let (seeding, commit, reading) = exercise(&t, &proxy, &recorder, Durability::Auto).await;
    let majority = Some("\"majority\"".to_string());
    let record_writes = on(&commit, "findAndModify", TRANSACTIONS_COLLECTION);
    let record_updates = on(&commit, "update", TRANSACTIONS_COLLECTION);
    let record_deletes = on(&commit, "delete", TRANSACTIONS_COLLECTION);
    let document_writes = on(&commit, "update", "accounts");
    assert_eq!(record_writes.len(), 1, "the record");
    assert_eq!(record_updates.len(), 1, "the commit point");
    assert_eq!(record_deletes.len(), 1, "the end");
    assert_eq!(document_writes.len(), 4, "two applies and two finishes");
    // The server has bulkWrite: each round's writes on the documents went in one message.
    let bulks = commit
        .iter()
        .filter(|c| command_name(c) == "bulkWrite")
        .count();
    assert_eq!(
        bulks, 2,
        "the applies in one bulkWrite, the finishes in another"
    );
    for command in record_writes
        .iter()
        .chain(&record_updates)
        .chain(&record_deletes)
        .chain(&document_writes)
    {
        assert_eq!(write_concern(command), majority, "{command}");
    }
    let record_reads = on(&reading, "find", TRANSACTIONS_COLLECTION);
    assert!(
        !record_reads.is_empty(),
        "reading a held document looks up its record"
    );
    for command in &record_reads {
        assert_eq!(
            read_concern(command).as_deref(),
            Some("majority"),
            "{command}"
        );
    }
    // Plain repository writes keep the client's own settings.
    for command in &on(&seeding, "insert", "accounts") {
        assert_eq!(write_concern(command), None, "{command}");
    }
}

#[tokio::test]
async fn on_a_standalone_server_the_client_defaults_apply_unless_majority_is_asked_for() {
    let t = TestDb::new().await;
    let recorder = Recorder::new(false);
    let proxy = WireProxy::start(&common::server_uri(), recorder.clone()).await;
    let (_, commit, _) = exercise(&t, &proxy, &recorder, Durability::Auto).await;
    let record_writes = on(&commit, "findAndModify", TRANSACTIONS_COLLECTION);
    assert_eq!(record_writes.len(), 1, "the record");
    for command in &record_writes {
        assert_eq!(write_concern(command), None, "{command}");
    }

    let t = TestDb::new().await;
    let (_, commit, reading) = exercise(&t, &proxy, &recorder, Durability::Majority).await;
    for command in &on(&commit, "update", TRANSACTIONS_COLLECTION) {
        assert_eq!(
            write_concern(command).as_deref(),
            Some("\"majority\""),
            "{command}"
        );
    }
    for command in &on(&reading, "find", TRANSACTIONS_COLLECTION) {
        assert_eq!(
            read_concern(command).as_deref(),
            Some("majority"),
            "{command}"
        );
    }
}

/// Delays the reply to the first write of a transaction record and reports a write concern error
/// in it: the record was written on the server, as a primary does before its majority times out.
struct UnconfirmedRecord {
    fired: Arc<std::sync::atomic::AtomicUsize>,
}

fn record_write(command: &Document) -> bool {
    command_name(command) == "findAndModify"
        && command.get_str("findAndModify").ok() == Some(TRANSACTIONS_COLLECTION)
}

impl Rules for UnconfirmedRecord {
    fn reply(&self, command: &Document, reply: &mut Document) {
        use std::sync::atomic::Ordering;
        if record_write(command) && self.fired.fetch_add(1, Ordering::SeqCst) == 0 {
            reply.insert(
                "writeConcernError",
                bson::doc! { "code": 64, "codeName": "WriteConcernFailed", "errmsg": "waiting for replication timed out" },
            );
        }
    }

    fn reply_delay(&self, command: &Document) -> Option<std::time::Duration> {
        use std::sync::atomic::Ordering;
        (record_write(command) && self.fired.load(Ordering::SeqCst) <= 1)
            .then_some(std::time::Duration::from_millis(1_500))
    }
}

/// Issue 46, case 7: a record's write that comes back with a write concern error was written (on
/// the primary, unconfirmed): the coordinator must not take it for a record that never was. It
/// did, and rolled back every participant, while a writer that met one of them meanwhile had
/// found the record staging with every participant in place, committed the transaction and
/// finished its own document: the rollback undid the rest of a committed transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_record_written_without_confirmation_is_never_taken_for_no_record() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100), ("b", 50)]).await;
    let proxy = WireProxy::start(
        &common::server_uri(),
        UnconfirmedRecord {
            fired: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        },
    )
    .await;
    let store = Store::new(proxy.client().await.database(t.db.name()));
    let via_proxy = common::open_accounts(&store).await;
    let coordinator = tokio::spawn(async move {
        let tx = mongotx::Transactions::new(&store).begin();
        tx.adjust(&via_proxy, "a", 1, &Adjust::new().by("balance", -10_i64))
            .await?;
        tx.adjust(&via_proxy, "b", 1, &Adjust::new().by("balance", 10_i64))
            .await?;
        tx.commit().await
    });
    // A writer meets a while the coordinator waits for its record's reply.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let a = accounts.get("a").await.expect("a");
    let written = accounts
        .update("a", a.version, &mongotx::Update::new().set("note", "after"))
        .await;
    let committed = coordinator.await.expect("coordinator task");
    let (a, b) = (
        accounts.get("a").await.expect("a"),
        accounts.get("b").await.expect("b"),
    );
    assert_eq!(
        a.balance + b.balance,
        150,
        "all or nothing: a {} b {} (writer {written:?}, coordinator {committed:?})",
        a.balance,
        b.balance
    );
    if a.balance == 90 {
        assert!(
            committed.is_ok() || matches!(committed, Err(mongotx::TxnError::CommitUnknown { .. })),
            "committed, but the coordinator said {committed:?}"
        );
    }
    mongotx::gc::Gc::new(&t.store, mongotx::gc::GcOptions::default())
        .run_round()
        .await
        .expect("GC");
    drop(proxy);
}
