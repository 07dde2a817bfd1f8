//! The remaining error paths: unusable collection definitions, foreign documents, documents
//! that do not fit the Rust type, and an unreachable server.

use crate::common;

use std::time::Duration;

use crate::common::{raw_snapshot, Account, TestDb};
use bson::{doc, Document};
use mongodb::options::ClientOptions;
use mongodb::Client;
use mongotx::schema::SpecError;
use mongotx::{fields, CollectionSpec, RepoError, Store, Update};
use serde::Deserialize;

/// The accounts schema with one system property removed or changed.
fn accounts_schema_with(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut schema: serde_json::Value =
        serde_json::from_str(include_str!("../../schemas/accounts.json")).unwrap();
    edit(&mut schema);
    schema.to_string()
}

#[test]
fn a_schema_must_declare_every_system_field_as_stored() {
    for field in fields::ALL {
        let text = accounts_schema_with(|s| {
            s["properties"].as_object_mut().unwrap().remove(field);
        });
        match CollectionSpec::new("accounts", 1, &text) {
            Err(SpecError::SystemField {
                field: named,
                collection,
                ..
            }) => {
                assert_eq!(named, field);
                assert_eq!(collection, "accounts");
            }
            // Removing a required property's declaration may instead trip required checks.
            other => panic!("{field}: expected SystemField, got {other:?}"),
        }
    }
    let text = accounts_schema_with(|s| s["properties"]["_version"]["bsonType"] = "string".into());
    assert!(matches!(
        CollectionSpec::new("accounts", 1, &text),
        Err(SpecError::SystemField {
            field: "_version",
            ..
        })
    ));
    let text = accounts_schema_with(|s| {
        s["required"] =
            serde_json::json!(["_id", "_schema", "_version", "owner", "balance", "_txn"]);
    });
    assert!(matches!(
        CollectionSpec::new("accounts", 1, &text),
        Err(SpecError::SystemField { field: "_txn", .. })
    ));
}

#[test]
fn unusable_schemas_names_and_versions_are_refused() {
    let schema = include_str!("../../schemas/accounts.json");
    assert!(matches!(
        CollectionSpec::new("accounts", 1, "{ not json"),
        Err(SpecError::Schema { .. })
    ));
    let text =
        accounts_schema_with(|s| s["$schema"] = "http://json-schema.org/draft-04/schema#".into());
    let err = CollectionSpec::new("accounts", 1, &text).unwrap_err();
    assert!(matches!(err, SpecError::Schema { .. }), "{err:?}");
    assert!(err.to_string().contains("$schema"), "{err}");
    for name in ["", "system.users", "a$b"] {
        assert!(
            matches!(
                CollectionSpec::new(name, 1, schema),
                Err(SpecError::Name { .. })
            ),
            "{name:?}"
        );
    }
    assert!(matches!(
        CollectionSpec::new("accounts", 0, schema),
        Err(SpecError::Versions { .. })
    ));
}

#[tokio::test]
async fn a_document_with_unreadable_system_fields_is_malformed_and_a_plain_one_is_not() {
    let t = TestDb::new().await;
    // Writes a string `_version` and a `_version` without `_schema` raw, to see them refused
    // as malformed: they break the format on purpose.
    t.keeps_foreign_data();
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    t.db.collection::<Document>("accounts")
        .insert_one(doc! { "_id": "foreign", "owner": "F", "balance": 1_i64 })
        .await
        .unwrap();
    t.db.collection::<Document>("accounts")
        .insert_one(doc! { "_id": "odd", "owner": "F", "balance": 1_i64, fields::SCHEMA_VERSION: 1_i64, fields::VERSION: "one" })
        // Written by something other than mongotx, past the server's validator.
        .bypass_document_validation(true)
        .await
        .unwrap();
    t.db.collection::<Document>("accounts")
        .insert_one(doc! { "_id": "half", "owner": "F", "balance": 1_i64, fields::VERSION: 3_i64 })
        .bypass_document_validation(true)
        .await
        .unwrap();
    let before = raw_snapshot(&t.db, "accounts").await;

    // A plain document (no system field at all) is data: it reads, at a fingerprint version.
    let foreign = accounts.get("foreign").await.unwrap();
    assert!(foreign.is_plain() && foreign.owner == "F", "{foreign:?}");
    let err = accounts.get("odd").await.unwrap_err();
    assert!(
        matches!(&err, RepoError::Malformed { reason, .. } if reason.contains("_version")),
        "{err:?}"
    );
    let err = accounts.get("half").await.unwrap_err();
    assert!(
        matches!(&err, RepoError::Malformed { reason, id, .. } if reason.contains("_schema") && id.contains("half")),
        "{err:?}"
    );
    let err = accounts
        .update("odd", 1, &Update::new().set("owner", "x"))
        .await
        .unwrap_err();
    assert!(matches!(err, RepoError::Malformed { .. }), "{err:?}");
    let err = accounts
        .update("foreign", 1, &Update::new().set("owner", "x"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, RepoError::VersionConflict { expected: 1, actual, .. } if actual == foreign.version),
        "{err:?}"
    );
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
}

#[tokio::test]
async fn a_stored_document_that_does_not_fit_the_type_is_a_decode_error() {
    #[derive(Debug, Deserialize, serde::Serialize)]
    struct Strict {
        #[serde(rename = "_id")]
        id: String,
        owner: String,
        balance: String,
    }
    let t = TestDb::new().await;
    let accounts = t
        .store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    accounts
        .insert(&Account::new("typed", "T", 3))
        .await
        .unwrap();
    let strict = t
        .store
        .repository::<Strict>(common::accounts_spec())
        .await
        .unwrap();
    let err = strict.get("typed").await.unwrap_err();
    assert!(
        matches!(&err, RepoError::Decode { id, .. } if id == "\"typed\""),
        "{err:?}"
    );
}

#[tokio::test]
async fn an_unreachable_server_is_a_database_error() {
    let mut options = ClientOptions::parse("mongodb://127.0.0.1:9/")
        .await
        .unwrap();
    options.server_selection_timeout = Some(Duration::from_millis(300));
    let client = Client::with_options(options).unwrap();
    let store = Store::builder(client.database("nowhere"))
        .server_validation(mongotx::options::ServerValidation::Never)
        .build();
    let err = store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            RepoError::Database {
                operation: "checking the server",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(!err.to_string().is_empty());
}

#[tokio::test]
async fn the_server_validator_matches_the_probed_capability() {
    let t = TestDb::new().await;
    let caps = common::capabilities().await;
    t.store
        .repository::<Account>(common::accounts_spec())
        .await
        .unwrap();
    // Bypass the client-side checks with a raw insert of an invalid live document.
    let raw = t
        .db
        .collection::<Document>("accounts")
        .insert_one(doc! { "_id": "bad", fields::SCHEMA_VERSION: 1_i64, fields::VERSION: 1_i64, "balance": "x" })
        .await;
    assert_eq!(
        raw.is_err(),
        caps.json_schema_validation,
        "server-side enforcement must match the probe ({raw:?})"
    );
    // Tombstones are exempt from the server-side schema wherever it is enforced.
    t.db.collection::<Document>("accounts")
        .insert_one(doc! { "_id": "tomb", fields::SCHEMA_VERSION: 1_i64, fields::VERSION: 2_i64, fields::DELETED: bson::DateTime::now() })
        .await
        .unwrap();
}
