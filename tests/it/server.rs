//! The server side of the foundation: the probe accepts the test server and refuses servers that
//! break each guarantee (simulated by a wire proxy), the local server starts and stops, driver
//! failures surface as typed errors, and the demo (`examples/demo/`) runs end to end.

use crate::common;

use std::time::Duration;

use crate::common::wire_proxy::{command_name, Action, PassThrough, Rules, WireProxy};
use crate::common::{server_uri, Account, TestDb};
use bson::{doc, Bson, Document};
use mongodb::options::ClientOptions;
use mongodb::Client;
use mongotx::server::{ProbeError, Status};
use mongotx::testkit::local_server::LocalServer;
use mongotx::{RepoError, Store};

fn on_probe_collection(command: &Document) -> bool {
    command
        .get_str(command_name(command))
        .is_ok_and(|c| c.starts_with("mongotx_probe_"))
}

#[tokio::test]
async fn the_probe_accepts_the_test_server_under_real_contention() {
    let t = TestDb::new().await;
    let caps = mongotx::testkit::probe_with(&t.db, 64)
        .await
        .expect("probe");
    assert_eq!(caps.contention_tasks, 64);
    assert!(
        caps.contention_retries > 0,
        "64 concurrent compare-and-set tasks never collided: the check did not contend"
    );
    let names = t.db.list_collection_names().await.expect("list");
    assert!(
        names.iter().all(|n| !n.starts_with("mongotx_probe")),
        "probe left scratch collections behind: {names:?}"
    );
}

#[tokio::test]
async fn the_wire_proxy_is_transparent_when_it_changes_nothing() {
    let t = TestDb::new().await;
    let proxy = WireProxy::start(&server_uri(), PassThrough).await;
    let client = proxy.client().await;
    let store = Store::new(client.database(t.db.name()));
    let accounts = common::open_accounts(&store).await;
    accounts
        .insert(&Account::new("a1", "Ann", 5))
        .await
        .expect("insert");
    let read = accounts.get("a1").await.expect("get");
    assert_eq!((read.version, read.balance), (1, 5));
    mongotx::server::probe(&client.database(t.db.name()))
        .await
        .expect("probe through a transparent proxy");
}

/// Pretends a duplicate-key insert succeeded.
struct AcceptDuplicates;

impl Rules for AcceptDuplicates {
    fn reply(&self, command: &Document, reply: &mut Document) {
        let duplicate = reply.get_array("writeErrors").is_ok_and(|errors| {
            errors.iter().any(|e| {
                e.as_document()
                    .and_then(|d| d.get("code"))
                    .is_some_and(|c| c.as_i32() == Some(11000) || c.as_i64() == Some(11000))
            })
        });
        if command_name(command) == "insert" && duplicate {
            reply.remove("writeErrors");
            reply.insert("n", 1);
        }
    }
}

#[tokio::test]
async fn the_probe_refuses_a_server_that_accepts_duplicate_ids() {
    let t = TestDb::new().await;
    let proxy = WireProxy::start(&server_uri(), AcceptDuplicates).await;
    let err = mongotx::server::probe(&proxy.client().await.database(t.db.name()))
        .await
        .expect_err("probe must refuse");
    assert!(
        matches!(
            err,
            ProbeError::Lacks {
                name: "duplicate_id_refused",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("_id \"dup\" was stored"), "{err}");
}

/// Acknowledges compare-and-set updates but writes back the value they were conditioned on.
struct LoseUpdates;

impl Rules for LoseUpdates {
    fn command(&self, command: &mut Document) -> Action {
        if command_name(command) != "update" || !on_probe_collection(command) {
            return Action::Forward;
        }
        if let Ok(updates) = command.get_array_mut("updates") {
            for update in updates.iter_mut() {
                if let Bson::Document(update) = update {
                    if let Some(seen) = update
                        .get_document("q")
                        .ok()
                        .and_then(|q| q.get("n"))
                        .cloned()
                    {
                        update.insert("u", doc! { "$set": { "n": seen } });
                    }
                }
            }
        }
        Action::Forward
    }
}

#[tokio::test]
async fn the_probe_refuses_a_server_that_loses_conditional_updates() {
    let t = TestDb::new().await;
    let proxy = WireProxy::start(&server_uri(), LoseUpdates).await;
    let err = mongotx::testkit::probe_with(&proxy.client().await.database(t.db.name()), 16)
        .await
        .expect_err("probe must refuse");
    match &err {
        ProbeError::Lacks {
            name: "conditional_updates_atomic",
            detail,
            ..
        } => assert!(
            detail.contains("16 compare-and-set increments each reported success")
                && detail.ends_with("reached 0"),
            "{detail}"
        ),
        other => panic!("expected conditional_updates_atomic, got {other:?}"),
    }
}

/// Turns find-and-modify into "return the document as it was".
struct StaleFindAndModify;

impl Rules for StaleFindAndModify {
    fn command(&self, command: &mut Document) -> Action {
        if command_name(command).eq_ignore_ascii_case("findAndModify") {
            command.insert("new", false);
        }
        Action::Forward
    }
}

#[tokio::test]
async fn the_probe_refuses_a_server_whose_find_and_modify_returns_the_old_document() {
    let t = TestDb::new().await;
    let proxy = WireProxy::start(&server_uri(), StaleFindAndModify).await;
    let err = mongotx::testkit::probe_with(&proxy.client().await.database(t.db.name()), 8)
        .await
        .expect_err("probe must refuse");
    match &err {
        ProbeError::Lacks {
            name: "find_and_modify_post_image",
            detail,
            ..
        } => assert!(detail.contains("\"n\": 41"), "{detail}"),
        other => panic!("expected find_and_modify_post_image, got {other:?}"),
    }
    assert!(err.to_string().contains("findAndModify"), "{err}");
}

/// Hands every concurrent caller of find-and-modify on the token counter the same post-image,
/// as mongo-java-server's stock backend can under contention.
struct SharedPostImages;

impl Rules for SharedPostImages {
    fn reply(&self, command: &Document, reply: &mut Document) {
        let on_tokens = command_name(command).eq_ignore_ascii_case("findAndModify")
            && command
                .get_document("query")
                .is_ok_and(|q| q.get_str("_id").ok() == Some("tokens"));
        if on_tokens {
            if let Ok(value) = reply.get_document_mut("value") {
                value.insert("n", 1_i64);
            }
        }
    }
}

#[tokio::test]
async fn the_probe_refuses_a_server_whose_find_and_modify_shares_post_images() {
    let t = TestDb::new().await;
    let proxy = WireProxy::start(&server_uri(), SharedPostImages).await;
    let err = mongotx::testkit::probe_with(&proxy.client().await.database(t.db.name()), 64)
        .await
        .expect_err("probe must refuse");
    match &err {
        ProbeError::Lacks {
            name: "own_post_images",
            detail,
            ..
        } => assert_eq!(
            detail,
            "64 concurrent increments returned only 1 distinct values"
        ),
        other => panic!("expected own_post_images, got {other:?}"),
    }
    assert!(err.to_string().contains("their own post-image"), "{err}");
    // The local server itself passes the same check with 64 concurrent callers.
    let caps = mongotx::testkit::probe_with(&t.db, 64)
        .await
        .expect("the local server passes");
    assert_eq!(caps.contention_tasks, 64);
}

/// Answers every command named `name` with a server error instead of forwarding it (code 8000,
/// or the code given). Commands on the registry pass: a store reads there which stored format
/// the database writes before its first write, opening a repository included, and these tests
/// are about the commands on the documents.
struct FailCommand(&'static str, Option<(i32, &'static str)>);

impl Rules for FailCommand {
    fn command(&self, command: &mut Document) -> Action {
        let on_registry = command.get_str(self.0) == Ok(mongotx::collections::META_COLLECTION);
        if command_name(command) == self.0 && !on_registry {
            let (code, name) = self.1.unwrap_or((8000, "AtlasError"));
            Action::Respond(doc! {
                "ok": 0.0,
                "errmsg": "injected by the wire proxy",
                "code": code,
                "codeName": name,
            })
        } else {
            Action::Forward
        }
    }
}

#[tokio::test]
async fn a_probe_step_the_account_may_not_run_is_a_database_error_naming_the_check() {
    let t = TestDb::new().await;
    let proxy = WireProxy::start(
        &server_uri(),
        FailCommand("insert", Some((13, "Unauthorized"))),
    )
    .await;
    let err = mongotx::server::verdict(&proxy.client().await.database(t.db.name()), 8)
        .await
        .expect_err("no verdict without the privilege to ask");
    match &err {
        ProbeError::Database { step, .. } => assert_eq!(*step, "duplicate_id_refused"),
        other => panic!("expected Database, got {other:?}"),
    }
    // The message is one clean sentence; the server's own words stay in the source.
    assert!(
        !err.to_string().contains("injected by the wire proxy"),
        "{err}"
    );
    assert!(err.to_string().contains("error 13"), "{err}");
    let source = std::error::Error::source(&err).expect("the driver error is the source");
    assert!(
        source.to_string().contains("injected by the wire proxy"),
        "{source}"
    );
}

#[tokio::test]
async fn a_server_error_on_read_is_a_database_error_naming_collection_and_id() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    accounts
        .insert(&Account::new("a1", "Ann", 5))
        .await
        .expect("insert");
    let proxy = WireProxy::start(&server_uri(), FailCommand("find", None)).await;
    // The proxy fails every find, the server checks included: vet the server directly instead.
    let via_proxy = Store::builder(proxy.client().await.database(t.db.name()))
        .check_server(false)
        .build()
        .repository::<Account>(common::accounts_spec())
        .await
        .expect("open through proxy");
    let err = via_proxy.get("a1").await.expect_err("read must fail");
    assert!(matches!(err, RepoError::Database { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("accounts") && text.contains("a1"), "{text}");
    // The direct path still works: the failure was the proxy's, not the data's.
    assert_eq!(accounts.get("a1").await.expect("direct get").balance, 5);
}

#[tokio::test]
async fn the_local_server_starts_on_a_free_port_and_stops() {
    let server = tokio::task::spawn_blocking(LocalServer::start)
        .await
        .expect("join")
        .expect("local server starts");
    let mut options = ClientOptions::parse(server.uri()).await.expect("uri");
    options.server_selection_timeout = Some(Duration::from_millis(800));
    let client = Client::with_options(options.clone()).expect("client");
    client
        .database("admin")
        .run_command(doc! { "ping": 1 })
        .await
        .expect("ping while running");
    mongotx::testkit::probe_with(&client.database("mongotx_local_check"), 8)
        .await
        .expect("the local server passes the probe");
    tokio::task::spawn_blocking(move || server.stop())
        .await
        .expect("stop");
    let after = Client::with_options(options).expect("client");
    let err = after
        .database("admin")
        .run_command(doc! { "ping": 1 })
        .await
        .expect_err("a stopped server must not answer");
    assert!(
        matches!(*err.kind, mongodb::error::ErrorKind::ServerSelection { .. }),
        "{err}"
    );
}

/// The demo example's executable, which `cargo test` builds with the examples:
/// `target/<profile>/examples/demo`, beside this test's `target/<profile>/deps/it-<hash>`.
fn demo_example() -> std::path::PathBuf {
    let test = std::env::current_exe().expect("the test's own path");
    let profile = test
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test runs from target/<profile>/deps");
    let demo = profile
        .join("examples")
        .join(format!("demo{}", std::env::consts::EXE_SUFFIX));
    assert!(
        demo.is_file(),
        "{} is missing: a plain `cargo test` builds the examples, a filtered one such as \
         `cargo test --test it server::` does not (run `cargo build --examples` first)",
        demo.display()
    );
    demo
}

#[tokio::test]
async fn the_demo_tour_runs_end_to_end() {
    let uri = server_uri();
    let db = format!("mongotx_demo_test_{}", bson::oid::ObjectId::new().to_hex());
    let output = tokio::process::Command::new(demo_example())
        .env("MONGODB_URI", &uri)
        .args(["--db", &db])
        .output()
        .await
        .expect("run the demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "demo failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    for expected in [
        "VersionConflict",
        "NotFound",
        "Deleted",
        "schema",
        "Locked",
        "moved 120 from dave to erin in 2 attempts",
        "consistent total of 320",
        "rolled_back=1",
        "finished=1",
        "All steps behaved as described.",
    ] {
        assert!(
            stdout.contains(expected) || stdout.to_lowercase().contains(&expected.to_lowercase()),
            "demo output lacks {expected:?}:\n{stdout}"
        );
    }
    // Without --keep the demo drops its database.
    let client = common::client().await;
    let names = client.list_database_names().await.expect("list");
    assert!(!names.contains(&db), "demo left {db} behind");
}

/// Plays a server from before MongoDB 4.2: updates given as a pipeline are refused.
struct NoPipelineUpdates;

impl Rules for NoPipelineUpdates {
    fn command(&self, command: &mut Document) -> Action {
        let pipeline = match command_name(command) {
            "update" => command.get_array("updates").is_ok_and(|updates| {
                updates
                    .iter()
                    .any(|u| u.as_document().is_some_and(|u| u.get_array("u").is_ok()))
            }),
            "findAndModify" => command.get_array("update").is_ok(),
            _ => false,
        };
        if pipeline {
            Action::Respond(doc! {
                "ok": 0.0,
                "errmsg": "Update argument must be an object",
                "code": 14,
                "codeName": "TypeMismatch",
            })
        } else {
            Action::Forward
        }
    }
}

#[tokio::test]
async fn a_server_without_pipeline_updates_is_refused_naming_it() {
    let t = TestDb::new().await;
    let proxy = WireProxy::start(&server_uri(), NoPipelineUpdates).await;
    let db = proxy.client().await.database(t.db.name());
    let err = mongotx::testkit::probe_with(&db, 8)
        .await
        .expect_err("the probe must refuse");
    assert!(
        matches!(
            &err,
            ProbeError::Lacks {
                name: "pipeline_updates",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("pipeline"), "{err}");
    // A store refuses it too, before writing anything of its own.
    let err = Store::new(db.clone())
        .repository::<Account>(common::accounts_spec())
        .await
        .expect_err("the store must refuse");
    assert!(
        matches!(
            &err,
            RepoError::ServerUnsuitable {
                name: "pipeline_updates",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(!t
        .db
        .list_collection_names()
        .await
        .expect("list")
        .contains(&"accounts".to_string()));
}

/// Plays a server whose `$$NOW` moves between the stages of one update (as mongo-java-server's
/// did): every `$$NOW` after an update pipeline's first stage reads 7 ms later.
struct MovingNow;

fn later_now(value: &mut Bson) {
    match value {
        Bson::String(s) if s == "$$NOW" => {
            *value = Bson::Document(doc! { "$add": ["$$NOW", 7] });
        }
        Bson::Document(d) => {
            for (_, v) in d.iter_mut() {
                later_now(v);
            }
        }
        Bson::Array(items) => items.iter_mut().for_each(later_now),
        _ => {}
    }
}

impl Rules for MovingNow {
    fn command(&self, command: &mut Document) -> Action {
        if command_name(command) == "update" {
            if let Ok(updates) = command.get_array_mut("updates") {
                for update in updates.iter_mut() {
                    if let Some(Ok(stages)) = update.as_document_mut().map(|u| u.get_array_mut("u"))
                    {
                        stages.iter_mut().skip(1).for_each(later_now);
                    }
                }
            }
        }
        Action::Forward
    }
}

#[tokio::test]
async fn a_server_whose_now_moves_within_a_statement_is_refused() {
    let t = TestDb::new().await;
    let proxy = WireProxy::start(&server_uri(), MovingNow).await;
    let err = mongotx::testkit::probe_with(&proxy.client().await.database(t.db.name()), 8)
        .await
        .expect_err("the probe must refuse");
    assert!(
        matches!(
            &err,
            ProbeError::Lacks {
                name: "statement_now",
                ..
            }
        ),
        "{err:?}"
    );
}

/// Strips `keyPattern` and `keyValue` from duplicate-key errors (as servers before 4.2 did).
struct PlainDuplicateKeys;

impl Rules for PlainDuplicateKeys {
    fn reply(&self, _command: &Document, reply: &mut Document) {
        if let Ok(errors) = reply.get_array_mut("writeErrors") {
            for error in errors.iter_mut() {
                if let Bson::Document(error) = error {
                    error.remove("keyPattern");
                    error.remove("keyValue");
                }
            }
        }
    }
}

#[tokio::test]
async fn the_probe_reports_every_behaviour_and_refuses_only_for_needed_ones() {
    let t = TestDb::new().await;
    let caps = mongotx::testkit::probe_with(&t.db, 8).await.expect("probe");
    let names: Vec<&str> = caps.semantics.iter().map(|s| s.name).collect();
    for expected in [
        "expr_now",
        "pipeline_updates",
        "upsert_seeding",
        "statement_now",
        "numeric_ids",
        "pipeline_find_and_modify",
        "upsert_seeding_paths",
        "missing_below_null",
        "binary_string_order",
        "unique_missing_as_null",
        "inc_overflow_refused",
        "per_statement_errors",
        "duplicate_key_shape",
        "json_schema_validation",
        "validation_details",
        "let_variables",
        "duplicate_id_refused",
        "conditional_updates_atomic",
        "find_and_modify_post_image",
        "own_post_images",
        "server_time",
        "bulk_write",
    ] {
        assert!(
            names.contains(&expected),
            "{expected} not reported: {names:?}"
        );
    }
    assert!(
        caps.semantics.iter().all(|s| !s.needed || s.holds()),
        "{caps:?}"
    );

    let proxy = WireProxy::start(&server_uri(), PlainDuplicateKeys).await;
    let caps = mongotx::testkit::probe_with(&proxy.client().await.database(t.db.name()), 8)
        .await
        .expect("a missing reported behaviour does not refuse the server");
    let shape = caps
        .semantics
        .iter()
        .find(|s| s.name == "duplicate_key_shape")
        .expect("reported");
    assert!(shape.status == Status::Lacks && !shape.needed, "{shape:?}");
    assert!(shape.evidence.contains("write error"), "{shape:?}");
    assert!(
        shape
            .fallback
            .is_some_and(|f| f.contains("by its code (11000) alone")),
        "{shape:?}"
    );
}

#[tokio::test]
async fn a_server_refusing_every_insert_gets_a_verdict_per_behaviour() {
    let t = TestDb::new().await;
    let proxy = WireProxy::start(&server_uri(), FailCommand("insert", None)).await;
    let verdict = mongotx::server::verdict(&proxy.client().await.database(t.db.name()), 8)
        .await
        .expect("a server that answers gets a verdict");
    let status = |name: &str| {
        verdict
            .behaviours
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("{name} not judged: {verdict:?}"))
            .clone()
    };
    // What needs a stored document is lacking, each saying why; the rest is judged on its own.
    let duplicate = status("duplicate_id_refused");
    assert_eq!(duplicate.status, Status::Lacks);
    assert!(
        duplicate.evidence.starts_with("insert: ") && duplicate.evidence.contains("error 8000"),
        "{duplicate:?}"
    );
    assert_eq!(status("server_time").status, Status::Holds);
    assert_eq!(status("json_schema_validation").status, Status::Lacks);
    assert_eq!(status("validation_details").status, Status::NotApplicable);
    assert!(!verdict.suitable());
    // The probe refuses it for the first needed one, with the sentence the verdict gives.
    let refused = verdict.refusal().expect("refused").to_string();
    assert_eq!(Some(refused.clone()), duplicate.refusal());
    assert!(
        refused.starts_with("the server lacks `duplicate_id_refused`, which mongotx needs"),
        "{refused}"
    );
}

/// `mongotx-probe` (built by `cargo test` beside this test) on the server behind `uri`.
async fn probe_command(uri: &str) -> std::process::Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_mongotx-probe"))
        .args(["--uri", uri, "--tasks", "8"])
        .output()
        .await
        .expect("run mongotx-probe")
}

#[tokio::test]
async fn the_probe_command_prints_a_row_per_behaviour_and_the_store_refuses_with_its_sentence() {
    let t = TestDb::new().await;
    let proxy = WireProxy::start(&server_uri(), NoPipelineUpdates).await;
    let output = probe_command(&proxy.uri()).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    let row = |name: &str| {
        stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row for {name}:\n{stdout}"))
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        row("pipeline_updates"),
        ["pipeline_updates", "yes", "lacks"]
    );
    assert_eq!(row("expr_now"), ["expr_now", "yes", "holds"]);
    assert_eq!(
        row("conditional_updates_atomic"),
        ["conditional_updates_atomic", "yes", "holds"]
    );
    assert_eq!(row("let_variables"), ["let_variables", "no", "lacks"]);
    assert!(
        stdout.contains("without it: none needed: mongotx sends values inline"),
        "{stdout}"
    );
    let refusals: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("verdict: refused: "))
        .collect();
    assert!(!refusals.is_empty(), "{stdout}");
    // A store on the same server refuses it with one of those sentences, word for word.
    let err = Store::new(proxy.client().await.database(t.db.name()))
        .repository::<Account>(common::accounts_spec())
        .await
        .expect_err("the store must refuse");
    assert!(
        refusals.contains(&err.to_string().as_str()),
        "{err}\nnot among\n{refusals:#?}"
    );

    // The local server itself: every needed row holds, exit 0.
    let output = probe_command(&server_uri()).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(
        stdout.lines().any(|l| l.starts_with("verdict: suitable")),
        "{stdout}"
    );
    assert!(!stdout.contains(" yes     lacks"), "{stdout}");
}
