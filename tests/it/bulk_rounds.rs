//! A round of protocol writes (a commit's applies, its finishes, a rollback's undos) goes to the
//! server as one `bulkWrite` where the server has it, and as one command per write where it does
//! not: a server older than MongoDB 8.0 (the driver refuses to send the command), or one that
//! announces 8.0 and answers "no such command". Either way the transaction's outcome is the same,
//! and the store remembers not to try again. The servers are played by a wire proxy in front of
//! the test server, which rewrites the handshake or answers in its place.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::common::wire_proxy::{command_name, writes_in, Action, Rules, WireProxy};
use crate::common::{Account, TestDb};
use bson::{doc, Document};
use mongotx::{Adjust, Repository, Store, Transaction, Update};

/// How the proxied server differs from the test server.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Plays {
    /// Itself.
    Same,
    /// A server before 8.0: its handshake announces wire version 9 (MongoDB 4.4).
    Before8,
    /// A server that announces 8.0 but answers bulkWrite with "no such command".
    NoBulkWrite,
}

/// Records every command (after any rewriting) and plays `plays`.
#[derive(Clone)]
struct Server {
    plays: Plays,
    seen: Arc<Mutex<Vec<Document>>>,
    refused: Arc<AtomicUsize>,
}

impl Server {
    fn new(plays: Plays) -> Server {
        Server {
            plays,
            seen: Arc::new(Mutex::new(Vec::new())),
            refused: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn take(&self) -> Vec<Document> {
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

impl Rules for Server {
    fn command(&self, command: &mut Document) -> Action {
        self.seen.lock().unwrap().push(command.clone());
        if self.plays == Plays::NoBulkWrite && command_name(command) == "bulkWrite" {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Action::Respond(doc! {
                "ok": 0.0,
                "code": 59,
                "codeName": "CommandNotFound",
                "errmsg": "no such command: 'bulkWrite'",
            });
        }
        Action::Forward
    }

    fn reply(&self, command: &Document, reply: &mut Document) {
        let name = command_name(command).to_ascii_lowercase();
        if self.plays == Plays::Before8 && (name == "hello" || name == "ismaster") {
            reply.insert("maxWireVersion", 9);
        }
    }
}

/// The commands among `commands` that carry writes to `coll`, and how many writes each carries.
fn writes_to(commands: &[Document], coll: &str) -> Vec<(String, usize)> {
    commands
        .iter()
        .filter_map(|command| {
            let carried = writes_in(command)
                .iter()
                .filter(|w| {
                    let name = command_name(w);
                    matches!(name, "insert" | "update" | "delete" | "findAndModify")
                        && w.get_str(name).ok() == Some(coll)
                })
                .count();
            (carried > 0).then(|| (command_name(command).to_string(), carried))
        })
        .collect()
}

struct Fixture {
    t: TestDb,
    server: Server,
    _proxy: WireProxy,
    store: Store,
    accounts: Repository<Account>,
}

impl Fixture {
    async fn new(plays: Plays) -> Fixture {
        let t = TestDb::new().await;
        let server = Server::new(plays);
        let proxy = WireProxy::start(&common::server_uri(), server.clone()).await;
        let store = Store::new(proxy.client().await.database(t.db.name()));
        let accounts = common::open_accounts(&store).await;
        common::seed_accounts(&accounts, &[("a", 100), ("b", 50), ("c", 7), ("d", 1)]).await;
        Fixture {
            t,
            server,
            _proxy: proxy,
            store,
            accounts,
        }
    }

    /// Stages a transfer a → b that also updates c and deletes d, at version `v` of each.
    async fn staged(&self, v: i64) -> Transaction {
        let tx = common::finishing(&self.store).begin();
        let repo = &self.accounts;
        tx.adjust(repo, "a", v, &Adjust::new().by("balance", -10_i64))
            .await
            .expect("stage a");
        tx.adjust(repo, "b", v, &Adjust::new().by("balance", 10_i64))
            .await
            .expect("stage b");
        tx.update(repo, "c", v, &Update::new().set("note", "moved"))
            .await
            .expect("stage c");
        tx.delete(repo, "d", v).expect("stage d");
        tx
    }

    async fn transfer(&self, v: i64) -> Result<mongotx::Outcome, mongotx::TxnError> {
        self.staged(v).await.commit().await
    }

    async fn assert_committed(&self, what: &str) {
        common::assert_settled(&self.t, &["accounts"], what).await;
        let a = self.accounts.get("a").await.expect("a");
        let b = self.accounts.get("b").await.expect("b");
        let c = self.accounts.get("c").await.expect("c");
        assert_eq!((a.balance, a.version), (90, 2), "{what}: a");
        assert_eq!((b.balance, b.version), (60, 2), "{what}: b");
        assert_eq!(
            (c.note.as_deref(), c.version),
            (Some("moved"), 2),
            "{what}: c"
        );
        assert!(
            matches!(
                self.accounts.get("d").await,
                Err(mongotx::RepoError::Deleted { version: 2, .. })
            ),
            "{what}: d"
        );
    }
}

#[tokio::test]
async fn each_round_is_one_message_where_the_server_has_bulk_write() {
    let f = Fixture::new(Plays::Same).await;
    f.server.take();
    let outcome = f.transfer(1).await.expect("commit");
    assert!(outcome.finished);
    let sent = writes_to(&f.server.take(), "accounts");
    if common::capabilities().await.bulk_write {
        // The applies in one message, the finishes (three frees and a tombstone) in another.
        assert_eq!(
            sent,
            vec![("bulkWrite".to_string(), 4), ("bulkWrite".to_string(), 4)],
            "{sent:?}"
        );
        assert!(f.store.batches_writes());
    } else {
        // A server given by MONGODB_URI that is older than 8.0.
        assert_eq!(sent.len(), 8, "{sent:?}");
        assert!(!f.store.batches_writes());
    }
    f.assert_committed("rounds").await;
}

#[tokio::test]
async fn a_server_before_8_0_gets_one_command_per_write_and_the_same_commit() {
    let f = Fixture::new(Plays::Before8).await;
    let caps = mongotx::server::probe(f.store.database())
        .await
        .expect("probe");
    assert!(!caps.bulk_write, "the probe reports no bulkWrite");
    f.server.take();
    f.transfer(1).await.expect("commit");
    let sent = writes_to(&f.server.take(), "accounts");
    // The driver refuses bulkWrite to such a server before sending anything.
    assert!(
        sent.iter().all(|(name, n)| name != "bulkWrite" && *n == 1),
        "{sent:?}"
    );
    assert_eq!(sent.len(), 8, "four applies and four finishes: {sent:?}");
    assert!(!f.store.batches_writes(), "the store remembers");
    f.assert_committed("one command per write").await;
}

#[tokio::test]
async fn a_server_without_the_command_is_asked_once_and_then_written_write_by_write() {
    let f = Fixture::new(Plays::NoBulkWrite).await;
    let caps = mongotx::server::probe(f.store.database())
        .await
        .expect("probe");
    assert!(!caps.bulk_write, "the probe reports no bulkWrite");
    let before = f.server.refused.load(Ordering::SeqCst);
    f.transfer(1).await.expect("commit");
    assert_eq!(
        f.server.refused.load(Ordering::SeqCst) - before,
        1,
        "asked once, then never again"
    );
    assert!(!f.store.batches_writes(), "the store remembers");
    f.assert_committed("refused bulkWrite").await;

    // Later transactions go write by write from the start.
    f.server.take();
    let tx = common::finishing(&f.store).begin();
    tx.adjust(&f.accounts, "a", 2, &Adjust::new().by("balance", 1_i64))
        .await
        .expect("stage");
    tx.adjust(&f.accounts, "b", 2, &Adjust::new().by("balance", -1_i64))
        .await
        .expect("stage");
    tx.commit().await.expect("commit");
    let sent = f.server.take();
    assert!(
        sent.iter().all(|c| command_name(c) != "bulkWrite"),
        "{sent:?}"
    );
    assert_eq!(f.accounts.get("a").await.expect("a").balance, 91);
}

#[tokio::test]
async fn a_refused_write_inside_a_bulk_fails_only_its_own_entry_and_everything_is_undone() {
    let f = Fixture::new(Plays::Same).await;
    // c moves on under the transaction: its apply inside the bulk matches nothing, the others
    // land, and the rollback (one round too) puts them back.
    let tx = f.staged(1).await;
    f.accounts
        .update("c", 1, &Update::new().set("owner", "outsider"))
        .await
        .expect("outside write");
    f.server.take();
    let err = tx.commit().await.expect_err("c moved");
    assert!(
        matches!(
            err.repo_error(),
            Some(mongotx::RepoError::VersionConflict {
                expected: 1,
                actual: 2,
                ..
            })
        ),
        "{err}"
    );
    let sent = writes_to(&f.server.take(), "accounts");
    if common::capabilities().await.bulk_write {
        assert_eq!(
            sent.first(),
            Some(&("bulkWrite".to_string(), 4)),
            "the applies went together: {sent:?}"
        );
    }
    common::assert_settled(&f.t, &["accounts"], "after the rollback").await;
    for (id, balance) in [("a", 100), ("b", 50), ("d", 1)] {
        let read = f.accounts.get(id).await.expect("read");
        assert_eq!((read.balance, read.version), (balance, 1), "{id}");
    }
}
