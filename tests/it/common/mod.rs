//! Shared integration-test harness: one server for the whole test binary, one database per test.
//!
//! The server comes from `mongotx::testkit::test_server` (MONGODB_URI, Docker with the `docker` feature,
//! or the local mongo-java-server). It is started on first use and probed once; a server that
//! fails the probe, or no server at all, fails every test that needs one with a message saying
//! how to provide one (a test that needs none never starts it). The conformance tests judge the
//! server themselves, one behaviour each, and skip the probe ([`TestDb::unprobed`]).
//!
//! Every test runs in this one process, so nothing here is per subject: a test that needs a server
//! of other settings starts its own, the tests that run fleets of processes take turns
//! ([`fleet_turn`]), and a test that measures latency has the machine to itself
//! ([`machine::alone`]).
#![allow(dead_code)]

pub mod machine;
pub mod refusals;
pub mod stored;
#[path = "../../../src/bin/mongotx-torture/wire_proxy.rs"]
pub mod wire_proxy;
pub mod worker;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, PoisonError};

use bson::oid::ObjectId;
use mongodb::{Client, Database};
use mongotx::server::ServerCapabilities;
#[allow(unused_imports)]
pub use mongotx::testkit::failpoint::CrashAt;
use mongotx::testkit::test_server::{ServerKind, TestServer};
use mongotx::{CollectionSpec, Store};
use serde::{Deserialize, Serialize};

static SERVER: OnceLock<Result<TestServer, String>> = OnceLock::new();
static PROBED: tokio::sync::OnceCell<Result<ServerCapabilities, String>> =
    tokio::sync::OnceCell::const_new();
static COUNTER: AtomicUsize = AtomicUsize::new(0);
/// The subject (module) whose fleet tests run, how many of them, and the signal that none does.
static FLEET: (Mutex<(Option<&str>, usize)>, Condvar) = (Mutex::new((None, 0)), Condvar::new());

/// The turn of a test that runs a fleet of worker processes under kills (the torture runs, the
/// `*_processes` tests, quota's killed workers), taken with [`fleet_turn`].
///
/// Each subject was once a test binary of its own, so a fleet only ever ran beside the fleets of
/// its own file; in the one binary it could run beside another's, and on a small machine two
/// subjects' fleets starve each other of CPU, failing the assertions about progress and latency
/// these tests make. So fleets of one subject may run together, as they did; those of different
/// subjects take turns. Tests that run no fleet do not wait.
pub struct FleetTurn(&'static str);

/// Waits until no fleet of another subject runs (blocking; call it first thing in the test, with
/// `module_path!()`).
pub fn fleet_turn(subject: &'static str) -> FleetTurn {
    let (state, changed) = &FLEET;
    let mut state = changed
        .wait_while(
            state.lock().unwrap_or_else(PoisonError::into_inner),
            |(running, _)| running.is_some_and(|r| r != subject),
        )
        .unwrap_or_else(PoisonError::into_inner);
    state.0 = Some(subject);
    state.1 += 1;
    FleetTurn(subject)
}

impl Drop for FleetTurn {
    fn drop(&mut self) {
        let (state, changed) = &FLEET;
        let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
        debug_assert_eq!(state.0, Some(self.0));
        state.1 -= 1;
        if state.1 == 0 {
            state.0 = None;
            changed.notify_all();
        }
    }
}

/// The server's connection string; panics (failing the test) when no server can be provided.
pub fn server_uri() -> String {
    let server = SERVER.get_or_init(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        TestServer::start().map_err(|e| e.to_string())
    });
    match server {
        Ok(server) => server.uri().to_string(),
        Err(message) => panic!("{message}"),
    }
}

/// Where the shared server came from (starting it if need be); panics like [`server_uri`].
pub fn server_kind() -> ServerKind {
    server_uri();
    match SERVER.get() {
        Some(Ok(server)) => server.kind(),
        _ => unreachable!("server_uri returned, so the server started"),
    }
}

/// A new client on the test server (each test runtime needs its own).
pub async fn client() -> Client {
    Client::with_uri_str(server_uri())
        .await
        .unwrap_or_else(|e| panic!("cannot connect to the test server: {e}"))
}

/// The server's capabilities, probed once for all tests; panics if the server is refused.
pub async fn capabilities() -> ServerCapabilities {
    let probed = PROBED
        .get_or_init(|| async {
            let client = client().await;
            let db = client.database(&format!("mongotx_probe_{}", ObjectId::new().to_hex()));
            let result = mongotx::server::probe(&db).await.map_err(|e| e.to_string());
            let _ = db.drop().await;
            result
        })
        .await;
    match probed {
        Ok(caps) => caps.clone(),
        Err(message) => panic!("the test server was refused by the probe: {message}"),
    }
}

/// A database of its own for one test; dropped when the guard goes out of scope.
pub struct TestDb {
    pub client: Client,
    pub db: Database,
    pub store: Store,
    /// Set by [`TestDb::keeps_foreign_data`]: the stored documents are not checked at the end.
    foreign: AtomicBool,
    /// Held while the database lives: a latency test waits for it ([`machine::alone`]).
    _share: machine::Sharing,
}

impl TestDb {
    /// A fresh, uniquely named database on a probed server.
    pub async fn new() -> TestDb {
        capabilities().await;
        TestDb::unprobed().await
    }

    /// A fresh database on a server that has not been judged: the conformance tests use it, each
    /// judging one behaviour on its own, so that a server lacking some gets a failure per
    /// behaviour it lacks rather than the probe's refusal in every test.
    pub async fn unprobed() -> TestDb {
        let share = machine::share();
        let client = client().await;
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("mongotx_test_{}_{n}", &ObjectId::new().to_hex()[..16]);
        let db = client.database(&name);
        stored::install_validators(&db).await;
        // A short version-floor grace keeps tests that purge tombstones fast.
        let store = Store::builder(db.clone())
            .version_floor_grace(std::time::Duration::from_millis(200))
            .build();
        TestDb {
            client,
            db,
            store,
            foreign: AtomicBool::new(false),
            _share: share,
        }
    }

    /// Says that this test leaves data behind that breaks mongotx's stored format on purpose
    /// (garbage written raw, a torn record, a field of the wrong type): its documents are not
    /// checked against the schemas when it ends ([`stored`]). Every caller says why beside it.
    pub fn keeps_foreign_data(&self) {
        self.foreign.store(true, Ordering::Relaxed);
    }

    /// Another client on the same database (for many-clients concurrency).
    pub async fn other_client_db(&self) -> Database {
        client().await.database(self.db.name())
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // A failing test keeps its database for inspection; a passing one has its stored
        // documents checked against the schemas (unless it keeps foreign data), and cleans up
        // if they hold, or fails keeping the database if not. The work runs on a thread with its
        // own runtime and client, because the test's runtime may be blocked right here.
        if std::thread::panicking() {
            return;
        }
        let name = self.db.name().to_string();
        let uri = server_uri();
        let check = !self.foreign.load(Ordering::Relaxed);
        let found = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return Vec::new();
            };
            runtime.block_on(async move {
                let Ok(client) = Client::with_uri_str(uri).await else {
                    return Vec::new();
                };
                let db = client.database(&name);
                let found = if check {
                    stored::violations(&db).await
                } else {
                    Vec::new()
                };
                if found.is_empty() {
                    let _ = db.drop().await;
                }
                found
            })
        })
        .join()
        .unwrap_or_default();
        if !found.is_empty() {
            let shown = found.len().min(20);
            panic!(
                "{} stored document(s) of database {} break the stored format (docs/format.md; \
                 the database is kept), the first {shown}:\n{}",
                found.len(),
                self.db.name(),
                found[..shown].join("\n")
            );
        }
    }
}

/// The accounts collection definition from `schemas/accounts.json`.
pub fn accounts_spec() -> CollectionSpec {
    CollectionSpec::new(
        "accounts",
        1,
        include_str!("../../../schemas/accounts.json"),
    )
    .unwrap_or_else(|e| panic!("schemas/accounts.json: {e}"))
}

/// Opens the accounts repository (`schemas/accounts.json`) on `store`.
pub async fn open_accounts(store: &Store) -> mongotx::Repository<Account> {
    store
        .repository::<Account>(accounts_spec())
        .await
        .unwrap_or_else(|e| panic!("open accounts: {e}"))
}

/// Inserts one account per `(id, balance)`, owned by the id in capitals.
pub async fn seed_accounts(accounts: &mongotx::Repository<Account>, seeds: &[(&str, i64)]) {
    for (id, balance) in seeds {
        accounts
            .insert(&Account::new(id, &id.to_uppercase(), *balance))
            .await
            .unwrap_or_else(|e| panic!("seed {id}: {e}"));
    }
}

/// The notes collection definition from `schemas/notes.json`.
pub fn notes_spec() -> CollectionSpec {
    CollectionSpec::new("notes", 1, include_str!("../../../schemas/notes.json"))
        .unwrap_or_else(|e| panic!("schemas/notes.json: {e}"))
}

/// The profiles collection at schema version 2, with the upgrade from version 1.
pub fn profiles_spec() -> CollectionSpec {
    CollectionSpec::new(
        "profiles",
        2,
        include_str!("../../../schemas/profiles.json"),
    )
    .unwrap_or_else(|e| panic!("schemas/profiles.json: {e}"))
    .upgrade(1, split_name)
}

/// Upgrade step 1 → 2 of profiles: `name` becomes `given_name` + `family_name`.
pub fn split_name(mut doc: bson::Document) -> Result<bson::Document, String> {
    let name = match doc.remove("name") {
        Some(bson::Bson::String(name)) => name,
        _ => return Err("version 1 profile has no string `name`".to_string()),
    };
    let (given, family) = match name.split_once(' ') {
        Some((given, family)) => (given.to_string(), family.to_string()),
        None => (name.clone(), String::new()),
    };
    doc.insert("given_name", given);
    doc.insert("family_name", family);
    Ok(doc)
}

/// An account as the application sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Account {
    #[serde(rename = "_id")]
    pub id: String,
    pub owner: String,
    pub balance: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Account {
    /// An account with no currency and no note.
    pub fn new(id: &str, owner: &str, balance: i64) -> Account {
        Account {
            id: id.to_string(),
            owner: owner.to_string(),
            balance,
            currency: None,
            note: None,
        }
    }
}

/// A profile in the current (version 2) shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    #[serde(rename = "_id")]
    pub id: String,
    pub given_name: String,
    pub family_name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub email: Option<String>,
}

/// A note with a generated ObjectId.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Note {
    #[serde(rename = "_id", skip_serializing_if = "Option::is_none")]
    pub id: Option<ObjectId>,
    pub text: String,
    #[serde(default)]
    pub tags: Vec<String>,
}

/// The time `hours` from now: a GC round run "at" it treats every deadline in between as passed.
pub fn hours_from_now(hours: i64) -> bson::DateTime {
    bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() + hours * 3_600_000)
}

/// Asserts that the transaction protocol left nothing behind in `t`: no ActiveTransaction
/// document, and no document of `collections` held or marked deleting. `what` names the case.
pub async fn assert_settled(t: &TestDb, collections: &[&str], what: &str) {
    // An aborted record may stay until the server's clock passes its deadline (so that no late
    // copy of it can arrive as staging); nothing else may. A committed one may still be finishing:
    // with the default `Finish::InBackground` the documents are freed and the record deleted (in
    // that order) after `commit` returns, which under load (every test runs in one process) can
    // outlast the test's next steps; right after `commit` returns, its record may even still read
    // `staging` (the commit point is the background's first write). Wait for that, ten seconds at
    // most; nothing else.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let left = loop {
        let left: Vec<_> = raw_snapshot(&t.db, t.store.transactions_collection())
            .await
            .into_iter()
            .filter(|r| r.get_str("state").ok() != Some("aborted"))
            .collect();
        let finishing = !left.is_empty()
            && left
                .iter()
                .all(|r| matches!(r.get_str("state").ok(), Some("committed") | Some("staging")));
        if !finishing || std::time::Instant::now() >= deadline {
            break left;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert!(
        left.is_empty(),
        "{what}: undecided or committed ActiveTransaction documents left: {left:?}"
    );
    for coll in collections {
        for d in raw_snapshot(&t.db, coll).await {
            assert!(
                !d.contains_key(mongotx::fields::ACTIVE_TXN)
                    && !d.contains_key(mongotx::fields::DELETING),
                "{what}: {coll} still held: {d}"
            );
        }
    }
}

/// Waits (up to ten seconds) until no document of `collection` carries a transaction's hold, and
/// returns them: with the default `Finish::InBackground` a committed transaction frees its documents
/// after `commit` returns, so a raw snapshot taken at once may still see the holds.
pub async fn raw_snapshot_when_free(db: &Database, collection: &str) -> Vec<bson::Document> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let docs = raw_snapshot(db, collection).await;
        let held = docs
            .iter()
            .any(|d| d.contains_key(mongotx::fields::ACTIVE_TXN));
        if !held {
            return docs;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{collection} still held after ten seconds: {docs:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Every document of a collection exactly as stored (system fields included), sorted by `_id`.
pub async fn raw_snapshot(db: &Database, collection: &str) -> Vec<bson::Document> {
    use futures::TryStreamExt;
    db.collection::<bson::Document>(collection)
        .find(bson::doc! {})
        .sort(bson::doc! { "_id": 1 })
        .await
        .unwrap_or_else(|e| panic!("snapshot of {collection}: {e}"))
        .try_collect()
        .await
        .unwrap_or_else(|e| panic!("snapshot of {collection}: {e}"))
}

/// Puts a hold on a stored document by hand, as an apply of transaction `txn` would: `set` is the
/// transaction's change (already applied to the stored fields), `hold` the `_hold` document.
pub async fn put_hold(
    db: &Database,
    collection: &str,
    id: impl Into<bson::Bson>,
    txn: ObjectId,
    set: bson::Document,
    hold: bson::Document,
) {
    let mut fields = set;
    fields.insert(mongotx::fields::ACTIVE_TXN, txn);
    fields.insert(mongotx::fields::HOLD, hold);
    let result = db
        .collection::<bson::Document>(collection)
        .update_one(
            bson::doc! { "_id": id.into() },
            bson::doc! { "$set": fields },
        )
        .await
        .unwrap_or_else(|e| panic!("put a hold: {e}"));
    assert_eq!(result.matched_count, 1, "put a hold: no such document");
}

/// A `_hold` document: what the hold stands for, its deadline, its undo and the fields it changed.
pub fn hold_of(
    op: &str,
    deadline: bson::DateTime,
    restore: bson::Document,
    unset: &[&str],
) -> bson::Document {
    let mut changed: Vec<String> = restore.keys().cloned().collect();
    changed.extend(unset.iter().map(|n| n.to_string()));
    bson::doc! { "exp": deadline, "op": op, "restore": restore, "unset": unset, "changed": changed }
}

/// Writes a transaction record by hand with `state` and `deadline`. Its one listed participant
/// is a document of collection `phantoms` that its apply never reached, so a `staging` record
/// stays undecided (an implicit commit needs every participant in place) until someone decides it.
pub async fn put_record(db: &Database, txn: ObjectId, state: &str, deadline: bson::DateTime) {
    db.collection::<bson::Document>(mongotx::collections::TRANSACTIONS_COLLECTION)
        .insert_one(bson::doc! {
            "_id": txn, "state": state,
            "created": bson::DateTime::now(), "deadline": deadline,
            "entries": [{
                "coll": "phantoms", "id": txn.to_hex(), "expected": 0_i64, "applied": 1_i64,
                "schema": 1_i64, "op": { "kind": "insert", "doc": {} },
            }],
        })
        .await
        .unwrap_or_else(|e| panic!("put a record: {e}"));
}

/// The time `ms` milliseconds from now (negative: in the past).
pub fn millis_from_now(ms: i64) -> bson::DateTime {
    bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() + ms)
}

/// Stages `stage` in a transaction whose coordinator stops for good at failpoint `at` (with a
/// deadline an hour away), leaving its record and holds behind; returns the transaction id.
pub async fn stalled_at<F, Fut>(store: &Store, at: &'static str, stage: F) -> ObjectId
where
    F: FnOnce(mongotx::Transaction) -> Fut,
    Fut: std::future::Future<Output = Result<(), mongotx::TxnError>>,
{
    let txns = mongotx::Transactions::with_options(
        store,
        mongotx::options::TxnOptions::default()
            .timeout(std::time::Duration::from_secs(3600))
            // Every step, the finishing ones included, on the coordinator's own path.
            .finish(mongotx::options::Finish::BeforeReturning)
            .fault_injector(std::sync::Arc::new(CrashAt(
                mongotx::testkit::failpoint::Failpoint { name: at, step: 0 },
            ))),
    );
    let tx = txns.begin();
    stage(tx.clone())
        .await
        .unwrap_or_else(|e| panic!("stage the stalled transaction: {e}"));
    match tx.commit().await {
        Err(mongotx::TxnError::Crashed { txn: Some(t), .. }) => t,
        other => panic!("the coordinator should stop at {at}, got {other:?}"),
    }
}

/// Transactions that finish before `commit` returns, for tests of the finishing steps (their
/// failpoints, their writes, the documents as a raw reader sees them right after).
pub fn finishing(store: &Store) -> mongotx::Transactions {
    mongotx::Transactions::with_options(
        store,
        mongotx::options::TxnOptions::default().finish(mongotx::options::Finish::BeforeReturning),
    )
}
