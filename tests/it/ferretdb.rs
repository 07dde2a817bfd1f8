//! FerretDB 1.24 on SQLite, a MongoDB-wire-compatible server nobody on this project wrote, built
//! from the Go module proxy by `tools/ferretdb.sh` and judged by the verdict: it answers every
//! check, so it gets a row per behaviour, and it is refused for behaviours it lacks (documented
//! by FerretDB itself: `$$NOW` and pipeline updates are not implemented), never for a connection
//! error. A `Store` refuses it with the same sentence, before writing anything.

use mongodb::Client;
use mongotx::server::{ProbeError, Status, Verdict};
use mongotx::testkit::ferretdb::FerretDb;
use mongotx::{RepoError, Store};

use crate::common::{self, Account};

fn row<'a>(verdict: &'a Verdict, name: &str) -> &'a mongotx::server::Semantic {
    verdict
        .behaviours
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("{name} not judged: {verdict:#?}"))
}

#[tokio::test]
async fn ferretdb_gets_a_verdict_per_behaviour_and_is_refused_for_what_it_lacks() {
    // No database of its own, but it loads the machine: a latency test waits for it.
    let _share = crate::common::machine::share();
    let server = FerretDb::start().await.expect("FerretDB builds and starts");
    let client = Client::with_uri_str(server.uri()).await.expect("client");
    let db = client.database("mongotx_ferretdb");
    let verdict = mongotx::server::verdict(&db, 64)
        .await
        .expect("FerretDB answers every check: a verdict, not a connection error");
    for s in &verdict.behaviours {
        println!("{:<28} {:<5} {}", s.name, s.status, s.evidence);
    }
    for held in [
        "duplicate_id_refused",
        "find_and_modify_post_image",
        "server_time",
        "numeric_ids",
    ] {
        assert_eq!(row(&verdict, held).status, Status::Holds, "{held}");
    }
    for (lacking, because) in [
        ("expr_now", "error 238 (NotImplemented)"),
        ("pipeline_updates", "error 14 (TypeMismatch)"),
        ("pipeline_find_and_modify", "error 238 (NotImplemented)"),
        ("json_schema_validation", "error 238 (NotImplemented)"),
        ("let_variables", "error 14 (TypeMismatch)"),
    ] {
        let s = row(&verdict, lacking);
        assert_eq!(s.status, Status::Lacks, "{s:?}");
        assert!(s.evidence.contains(because), "{s:?}");
    }
    assert_eq!(
        row(&verdict, "validation_details").status,
        Status::NotApplicable
    );
    assert!(
        row(&verdict, "json_schema_validation")
            .fallback
            .is_some_and(|f| f.contains("on the client")),
        "the verdict names the fallback"
    );
    match verdict.refusal() {
        Some(ProbeError::Lacks { name, .. }) => assert!(
            row(&verdict, name).needed && row(&verdict, name).status == Status::Lacks,
            "{name}"
        ),
        other => panic!("FerretDB must be refused for a behaviour: {other:?}"),
    }

    // A store refuses it with the verdict's sentence for the first protocol behaviour it lacks,
    // and writes nothing.
    let err = Store::new(db.clone())
        .repository::<Account>(common::accounts_spec())
        .await
        .expect_err("the store must refuse FerretDB");
    assert!(
        matches!(
            &err,
            RepoError::ServerUnsuitable {
                name: "expr_now",
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(Some(err.to_string()), row(&verdict, "expr_now").refusal());
    let names = db.list_collection_names().await.expect("list");
    assert!(
        names
            .iter()
            .all(|n| n != "accounts" && !n.starts_with("mongotx_")),
        "the refused store or the checks left {names:?}"
    );

    // The command says the same, with exit status 1.
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_mongotx-probe"))
        .args(["--uri", &server.uri(), "--tasks", "16"])
        .output()
        .await
        .expect("run mongotx-probe");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    let sentence = format!(
        "verdict: refused: {}",
        row(&verdict, "expr_now").refusal().expect("needed")
    );
    assert!(stdout.lines().any(|l| l == sentence), "{stdout}");
}
