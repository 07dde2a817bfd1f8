//! Batches in the database: adding (idempotent, typed refusals that write nothing) and the
//! queuer's round over stored batches in every state.

mod common;

use bson::{doc, Document};
use common::TestDb;
use mongotx::queue::{Batches, NewBatch, QueueError, BATCHES_COLLECTION, BATCHES_SCHEMA};
use mongotx::JsonSchema;

async fn set(t: &TestDb, header: &str, fields: Document) {
    t.db.collection::<Document>(BATCHES_COLLECTION)
        .update_one(doc! { "_id": header }, doc! { "$set": fields })
        .await
        .unwrap();
}

#[tokio::test]
async fn adding_is_idempotent_and_bad_batches_are_refused_without_writing() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    let first = batches
        .add(&NewBatch::new("s1", "h1", "payload"))
        .await
        .unwrap();
    assert_eq!(
        (first.service_id.as_str(), first.submitted, first.status),
        ("s1", false, None)
    );
    let again = batches
        .add(&NewBatch::new("s1", "h1", "payload"))
        .await
        .unwrap();
    assert_eq!(again, first, "adding the same batch again changes nothing");
    let before = common::raw_snapshot(&t.db, BATCHES_COLLECTION).await;

    let err = batches
        .add(&NewBatch::new("s1", "h1", "other"))
        .await
        .unwrap_err();
    assert!(matches!(err, QueueError::HeaderReused { .. }), "{err}");
    assert!(err.to_string().contains("batches/h1"), "{err}");
    let err = batches
        .add(&NewBatch::new("s2", "h1", "payload"))
        .await
        .unwrap_err();
    assert!(matches!(err, QueueError::HeaderReused { .. }), "{err}");
    for bad in [NewBatch::new("", "h2", "x"), NewBatch::new("s1", "", "x")] {
        let err = batches.add(&bad).await.unwrap_err();
        assert!(
            matches!(err, QueueError::InvalidBatch { .. }),
            "{bad:?}: {err}"
        );
        assert!(!err.is_retryable());
    }
    let after = common::raw_snapshot(&t.db, BATCHES_COLLECTION).await;
    assert_eq!(after, before, "nothing written by a refusal");

    let schema = JsonSchema::parse(BATCHES_COLLECTION, BATCHES_SCHEMA).unwrap();
    for d in after {
        schema
            .validate(&d)
            .unwrap_or_else(|v| panic!("{d} breaks the schema: {v}"));
    }
}

#[tokio::test]
async fn a_round_over_stored_batches_follows_the_seeds_strategy() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    // s1: its first batch is at the ledger, so its second waits.
    // s2: its first batch was committed, so its second is next (before its third).
    // s3: unknown to the ledger: queued again; its next batch waits.
    // s4: delayed a moment ago: waits for the window; s5: delayed long ago: queued.
    // s6: its batch is with a submitter: nothing of s6 is queued.
    for (service, header) in [
        ("s1", "s1-a"),
        ("s1", "s1-b"),
        ("s2", "s2-a"),
        ("s2", "s2-b"),
        ("s2", "s2-c"),
        ("s3", "s3-a"),
        ("s3", "s3-b"),
        ("s4", "s4-a"),
        ("s5", "s5-a"),
        ("s6", "s6-a"),
        ("s6", "s6-b"),
    ] {
        batches
            .add(&NewBatch::new(service, header, "x"))
            .await
            .unwrap();
    }
    let long_ago = bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() - 60_000);
    set(&t, "s1-a", doc! { "submitted": true, "status": "pending" }).await;
    set(&t, "s2-a", doc! { "status": "committed" }).await;
    set(&t, "s3-a", doc! { "status": "unknown" }).await;
    set(
        &t,
        "s4-a",
        doc! { "status": "delayed", "last_submitted_at": bson::DateTime::now() },
    )
    .await;
    set(
        &t,
        "s5-a",
        doc! { "status": "delayed", "last_submitted_at": long_ago },
    )
    .await;
    set(&t, "s6-a", doc! { "submitted": true }).await;
    let queued: Vec<String> = batches
        .round()
        .await
        .unwrap()
        .into_iter()
        .map(|b| b.header)
        .collect();
    assert_eq!(queued, vec!["s3-a", "s5-a", "s2-b"]);
}
