//! A service connecting with the `readWrite` role only, on a server with users and roles (the
//! local test server started with `--user`: SCRAM-SHA-256 and MongoDB's built-in roles, each
//! command checked against the actions the manual lists for them; see docs/testing.md).
//!
//! MongoDB manual, "Built-In Roles" (https://www.mongodb.com/docs/manual/reference/built-in-roles/):
//! `readWrite` has `createCollection`, `createIndex`, `dropCollection`, `find`, `insert`, `update`,
//! `remove`, `listCollections` and `listIndexes`, but not `collMod`, which `dbAdmin` has
//! ("Privilege Actions", https://www.mongodb.com/docs/manual/reference/privilege-actions/).

use bson::{doc, Document};
use mongodb::Client;
use mongotx::adopt::AdoptOptions;
use mongotx::gc::{Gc, GcOptions};
use mongotx::quota::Quota;
use mongotx::testkit::local_server::LocalServer;
use mongotx::{Adjust, Query, RepoError, Store, Transactions};

use crate::common;

fn client_uri(server: &LocalServer, user: &str, password: &str) -> String {
    format!(
        "mongodb://{user}:{password}@127.0.0.1:{}/?authSource=admin&authMechanism=SCRAM-SHA-256&directConnection=true",
        server.port()
    )
}

#[tokio::test]
async fn a_service_with_read_write_only_opens_adopts_and_writes_and_reports_what_an_admin_must_run()
{
    // No database of its own, but it loads the machine: a latency test waits for it.
    let _share = crate::common::machine::share();
    let server = tokio::task::spawn_blocking(|| {
        LocalServer::start_with(&[
            "--user".into(),
            "admin:admin-pw:root@admin".into(),
            "--user".into(),
            "app:app-pw:readWrite@shop".into(),
        ])
    })
    .await
    .unwrap()
    .expect("start a test server with users");
    let admin = Client::with_uri_str(client_uri(&server, "admin", "admin-pw"))
        .await
        .unwrap()
        .database("shop");
    let app = Client::with_uri_str(client_uri(&server, "app", "app-pw"))
        .await
        .unwrap()
        .database("shop");

    // The server refuses what readWrite lacks, and lets the rest through.
    let raw = app.collection::<Document>("accounts");
    raw.insert_many(
        (0..30).map(|i| doc! { "_id": format!("a{i:02}"), "owner": "o", "balance": 100_i64 }),
    )
    .await
    .unwrap();
    let refused = app
        .run_command(doc! { "collMod": "accounts", "validator": {} })
        .await
        .unwrap_err();
    assert_eq!(
        mongotx_error_code(&refused),
        Some(13),
        "collMod is not in readWrite: {refused}"
    );
    let anonymous = Client::with_uri_str(format!(
        "mongodb://127.0.0.1:{}/?directConnection=true",
        server.port()
    ))
    .await
    .unwrap();
    assert!(anonymous
        .database("shop")
        .collection::<Document>("accounts")
        .find_one(doc! {})
        .await
        .is_err());

    // The store opens the existing collection all the same, and says what an admin must run.
    let store = Store::new(app.clone());
    let accounts = common::open_accounts(&store).await;
    let pending = store.pending_validators();
    assert_eq!(pending.len(), 1, "{pending:?}");
    let (collection, command) = &pending[0];
    assert_eq!(collection, "accounts");
    assert_eq!(command.get_str("collMod").ok(), Some("accounts"));
    // A new collection is created with its validator: `create` is in readWrite.
    store
        .repository::<common::Note>(common::notes_spec())
        .await
        .unwrap();
    assert_eq!(store.pending_validators().len(), 1);

    // Everything else works under readWrite: reads, adoption, writes, transactions, the GC, a
    // coordination module's collections.
    let a = accounts.get("a00").await.unwrap();
    assert!(a.is_plain());
    let report = accounts.adopt(AdoptOptions::new()).await.unwrap();
    assert_eq!(report.stamped, 30);
    accounts
        .adjust("a01", 1, &Adjust::new().by("balance", -1_i64))
        .await
        .unwrap();
    Transactions::new(&store)
        .run(|tx| {
            let accounts = accounts.clone();
            async move {
                let (x, y) = (accounts.get("a02").await?, accounts.get("a03").await?);
                tx.adjust(
                    &accounts,
                    "a02",
                    x.version,
                    &Adjust::new().by("balance", -5_i64),
                )
                .await?;
                tx.adjust(
                    &accounts,
                    "a03",
                    y.version,
                    &Adjust::new().by("balance", 5_i64),
                )
                .await?;
                Ok(())
            }
        })
        .await
        .unwrap();
    Gc::new(&store, GcOptions::default())
        .run_round()
        .await
        .unwrap();
    Quota::open(&store).await.unwrap();
    assert_eq!(
        accounts
            .count(Query::new().filter(doc! { "balance": 100_i64 }))
            .await
            .unwrap(),
        27
    );

    // The administrator runs the reported command; from then on the store finds the validator
    // in place and asks for nothing.
    admin.run_command(command.clone()).await.unwrap();
    let later = Store::new(app.clone());
    common::open_accounts(&later).await;
    assert!(
        later.pending_validators().is_empty(),
        "{:?}",
        later.pending_validators()
    );
    let broken = raw
        .update_one(
            doc! { "_id": "a04" },
            doc! { "$set": { "balance": "broken" } },
        )
        .await;
    assert!(
        broken.is_err(),
        "the installed validator guards stamped documents: {broken:?}"
    );
    let err = accounts.get("zz").await.unwrap_err();
    assert!(matches!(err, RepoError::NotFound { .. }));
    server.stop();
}

fn mongotx_error_code(error: &mongodb::error::Error) -> Option<i32> {
    match error.kind.as_ref() {
        mongodb::error::ErrorKind::Command(e) => Some(e.code),
        _ => None,
    }
}
