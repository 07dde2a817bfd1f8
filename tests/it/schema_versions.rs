//! Schema versions: older documents are upgraded on read (and on write), newer ones are refused
//! and never overwritten.

use crate::common;

use crate::common::{raw_snapshot, Profile, TestDb};
use bson::{doc, Document};
use mongotx::schema::SpecError;
use mongotx::{fields, Adjust, CollectionSpec, RepoError, Update};

/// Plants a profile stored in schema version 1 (single `name` field).
async fn plant_v1(t: &TestDb, id: &str, name: &str, version: i64) {
    t.db.collection::<Document>("profiles")
        .insert_one(doc! {
            "_id": id,
            "name": name,
            fields::SCHEMA_VERSION: 1_i64,
            fields::VERSION: version,
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn an_older_document_is_upgraded_on_read_and_left_as_stored() {
    let t = TestDb::new().await;
    let profiles = t
        .store
        .repository::<Profile>(common::profiles_spec())
        .await
        .unwrap();
    plant_v1(&t, "ada", "Ada Lovelace", 3).await;
    let before = raw_snapshot(&t.db, "profiles").await;

    let read = profiles.get("ada").await.unwrap();
    assert_eq!(read.given_name, "Ada");
    assert_eq!(read.family_name, "Lovelace");
    assert_eq!(read.version, 3);
    assert_eq!(read.stored_schema_version, 1);

    let found = profiles.find(mongotx::Query::new()).await.unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].given_name, "Ada");
    // Reading never writes.
    assert_eq!(raw_snapshot(&t.db, "profiles").await, before);
}

#[tokio::test]
async fn a_field_update_of_an_older_document_stores_it_in_the_current_shape() {
    let t = TestDb::new().await;
    let profiles = t
        .store
        .repository::<Profile>(common::profiles_spec())
        .await
        .unwrap();
    plant_v1(&t, "alan", "Alan Turing", 1).await;

    let v = profiles
        .update("alan", 1, &Update::new().set("email", "alan@example.org"))
        .await
        .unwrap();
    assert_eq!(v, 2);

    let raw = raw_snapshot(&t.db, "profiles").await;
    assert_eq!(
        raw[0].get_i64(fields::SCHEMA_VERSION).unwrap(),
        2,
        "writes stamp the current version"
    );
    assert_eq!(raw[0].get_str("given_name").unwrap(), "Alan");
    assert_eq!(raw[0].get_str("family_name").unwrap(), "Turing");
    assert_eq!(raw[0].get_str("email").unwrap(), "alan@example.org");
    assert!(!raw[0].contains_key("name"));

    // The version still guards the upgrade path.
    plant_v1(&t, "grace", "Grace Hopper", 4).await;
    let err = profiles
        .update("grace", 3, &Update::new().set("email", "g@example.org"))
        .await;
    assert!(
        matches!(
            err,
            Err(RepoError::VersionConflict {
                expected: 3,
                actual: 4,
                ..
            })
        ),
        "{err:?}"
    );
    let err = profiles
        .adjust("grace", 4, &Adjust::new().by("logins", 1_i64))
        .await;
    assert_eq!(err.unwrap(), 5);
    let read = profiles.get("grace").await.unwrap();
    assert_eq!((read.version, read.stored_schema_version), (5, 2));
}

#[tokio::test]
async fn delete_and_replace_accept_older_documents() {
    let t = TestDb::new().await;
    let profiles = t
        .store
        .repository::<Profile>(common::profiles_spec())
        .await
        .unwrap();
    plant_v1(&t, "old1", "Old One", 1).await;
    plant_v1(&t, "old2", "Old Two", 1).await;

    assert_eq!(profiles.delete("old1", 1).await.unwrap(), 2);
    assert!(matches!(
        profiles.get("old1").await,
        Err(RepoError::Deleted { .. })
    ));

    let replacement = Profile {
        id: "old2".into(),
        given_name: "New".into(),
        family_name: "Two".into(),
        email: None,
    };
    assert_eq!(profiles.replace("old2", 1, &replacement).await.unwrap(), 2);
    let read = profiles.get("old2").await.unwrap();
    assert_eq!(read.value, replacement);
    assert_eq!(read.stored_schema_version, 2);
}

#[tokio::test]
async fn a_document_newer_than_the_code_is_refused_and_never_overwritten() {
    let t = TestDb::new().await;
    let profiles = t
        .store
        .repository::<Profile>(common::profiles_spec())
        .await
        .unwrap();
    t.db.collection::<Document>("profiles")
        .insert_one(doc! {
            "_id": "future",
            "given_name": "F",
            "family_name": "Uture",
            "pronouns": "they",
            fields::SCHEMA_VERSION: 3_i64,
            fields::VERSION: 1_i64,
        })
        .await
        .unwrap();
    let before = raw_snapshot(&t.db, "profiles").await;

    let too_new = |r: Result<i64, RepoError>| {
        assert!(
            matches!(
                r,
                Err(RepoError::SchemaTooNew {
                    found: 3,
                    supported: 2,
                    ..
                })
            ),
            "{r:?}"
        )
    };
    too_new(profiles.get("future").await.map(|s| s.version));
    too_new(
        profiles
            .find(mongotx::Query::new())
            .await
            .map(|v| v.len() as i64),
    );
    too_new(
        profiles
            .update("future", 1, &Update::new().set("email", "f@x.io"))
            .await,
    );
    too_new(
        profiles
            .adjust("future", 1, &Adjust::new().by("logins", 1_i64))
            .await,
    );
    too_new(
        profiles
            .replace(
                "future",
                1,
                &Profile {
                    id: "future".into(),
                    given_name: "G".into(),
                    family_name: "H".into(),
                    email: None,
                },
            )
            .await,
    );
    too_new(profiles.delete("future", 1).await);
    assert_eq!(raw_snapshot(&t.db, "profiles").await, before);
}

#[tokio::test]
async fn a_failing_upgrade_step_is_reported_with_its_version() {
    let t = TestDb::new().await;
    let profiles = t
        .store
        .repository::<Profile>(common::profiles_spec())
        .await
        .unwrap();
    // A version 1 profile without `name` cannot be split.
    t.db.collection::<Document>("profiles")
        .insert_one(doc! { "_id": "broken", fields::SCHEMA_VERSION: 1_i64, fields::VERSION: 1_i64 })
        .await
        .unwrap();
    let before = raw_snapshot(&t.db, "profiles").await;
    let err = profiles.get("broken").await.unwrap_err();
    assert!(
        matches!(&err, RepoError::Upgrade { from: 1, reason, .. } if reason.contains("name")),
        "{err:?}"
    );
    let err = profiles
        .update("broken", 1, &Update::new().set("email", "b@x.io"))
        .await;
    assert!(
        matches!(err, Err(RepoError::Upgrade { from: 1, .. })),
        "{err:?}"
    );
    assert_eq!(raw_snapshot(&t.db, "profiles").await, before);
}

#[tokio::test]
async fn a_version_without_its_upgrade_step_is_refused_at_open() {
    let t = TestDb::new().await;
    let spec =
        CollectionSpec::new("profiles", 2, include_str!("../../schemas/profiles.json")).unwrap();
    let err = t.store.repository::<Profile>(spec).await.unwrap_err();
    assert!(
        matches!(&err, RepoError::Spec { source: SpecError::Versions { collection, reason } } if collection == "profiles" && reason.contains("from version 1")),
        "{err:?}"
    );
    let spec = CollectionSpec::new("profiles", 2, include_str!("../../schemas/profiles.json"))
        .unwrap()
        .upgrade(1, common::split_name)
        .upgrade(2, Ok);
    let err = t.store.repository::<Profile>(spec).await.unwrap_err();
    assert!(
        matches!(
            err,
            RepoError::Spec {
                source: SpecError::Versions { .. }
            }
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_multi_step_upgrade_runs_every_step_in_order() {
    let t = TestDb::new().await;
    // Version 3 adds a default email derived from the id; versions 1 and 2 chain into it.
    let spec = CollectionSpec::new("profiles", 3, include_str!("../../schemas/profiles.json"))
        .unwrap()
        .upgrade(1, common::split_name)
        .upgrade(2, |mut d: Document| {
            let id = d.get_str("_id").map_err(|e| e.to_string())?.to_string();
            d.insert("email", format!("{id}@example.org"));
            Ok(d)
        });
    let profiles = t.store.repository::<Profile>(spec).await.unwrap();
    plant_v1(&t, "edsger", "Edsger Dijkstra", 1).await;
    let read = profiles.get("edsger").await.unwrap();
    assert_eq!(read.given_name, "Edsger");
    assert_eq!(read.email.as_deref(), Some("edsger@example.org"));
    assert_eq!(read.stored_schema_version, 1);
}
