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
