//! Bad input to the batch queue: every refusal is a typed error and changes no document of the
//! database (checked by `common::refusals`).
//!
//! Every case is set up first (batches added, claimed, recorded, settled), then checked; the
//! queue runs nothing in the background.

use crate::refuse;

use std::time::Duration;

use crate::common::refusals::Refusals;
use crate::common::TestDb;
use mongotx::collections::META_COLLECTION;
use mongotx::fields::MAX_NAME;
use mongotx::queue::{
    Batch, BatchStatus, Batches, Claim, NewBatch, QueueError, Submission, Submitter, MAX_CLAIM,
    MAX_CONTENT, MAX_DELAY,
};
use mongotx::testkit::ledger::{Faults, Ledger};

/// A name one byte longer than allowed, of two-byte characters.
fn too_long() -> String {
    "é".repeat(MAX_NAME / 2) + "x"
}

/// Claims the queued batch `header` for `who`.
async fn claim(batches: &Batches, header: &str, who: &str) -> Claim {
    let queued = batches.round().await.unwrap();
    let batch = queued
        .iter()
        .find(|b| b.header == header)
        .unwrap_or_else(|| panic!("{header} is not queued: {queued:?}"));
    batches
        .claim(batch, who, Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{header} could not be claimed"))
}

/// Adding batches with unusable service ids, headers or contents, reusing a header, and reading
/// batches by unusable or unknown headers.
#[tokio::test]
async fn unusable_batches_and_reused_headers() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches
        .add(&NewBatch::new("s1", "h1", "payload"))
        .await
        .unwrap();
    let mut r = Refusals::new(&t.db);

    let cases = [
        ("an empty service id", NewBatch::new("", "h2", "x")),
        ("an empty header", NewBatch::new("s1", "", "x")),
        (
            "an over-long service id",
            NewBatch::new(too_long(), "h2", "x"),
        ),
        ("an over-long header", NewBatch::new("s1", too_long(), "x")),
        ("a NUL in the header", NewBatch::new("s1", "h\u{0}2", "x")),
        (
            "a NUL in the service id",
            NewBatch::new("s\u{0}1", "h2", "x"),
        ),
        ("an empty content", NewBatch::new("s1", "h2", "")),
        (
            "a content over MAX_CONTENT",
            NewBatch::new("s1", "h2", "x".repeat(MAX_CONTENT + 1)),
        ),
    ];
    for (what, batch) in &cases {
        refuse!(
            r,
            &format!("add with {what}"),
            batches.add(batch),
            QueueError::InvalidBatch { .. }
        );
    }
    refuse!(
        r,
        "add reusing a header with another content",
        batches.add(&NewBatch::new("s1", "h1", "other")),
        QueueError::HeaderReused { .. }
    );
    refuse!(
        r,
        "add reusing a header for another service",
        batches.add(&NewBatch::new("s2", "h1", "payload")),
        QueueError::HeaderReused { .. }
    );
    refuse!(
        r,
        "get of an empty header",
        batches.get(""),
        QueueError::InvalidBatch { .. }
    );
    refuse!(
        r,
        "get of an over-long header",
        batches.get(&too_long()),
        QueueError::InvalidBatch { .. }
    );
    refuse!(
        r,
        "get of an unknown header",
        batches.get("nope"),
        QueueError::UnknownBatch { .. }
    );
    assert!(r.checked() >= 13, "{} refusals checked", r.checked());
}

/// Opening a collection of batches the queue cannot (or must not) use, or with an absurd delay
/// window.
#[tokio::test]
async fn unusable_collections_and_delay_windows() {
    let t = TestDb::new().await;
    Batches::open(&t.store).await.unwrap();
    let mut r = Refusals::new(&t.db);
    for (what, name) in [
        ("an empty collection name", String::new()),
        ("a collection name with '$'", "bat$ches".to_string()),
        ("a collection name with a NUL", "bat\0ches".to_string()),
        ("a system. collection", "system.batches".to_string()),
        (
            "the transaction records",
            t.store.transactions_collection().to_string(),
        ),
        ("the collection registry", META_COLLECTION.to_string()),
        (
            "another collection's services",
            "batches_services".to_string(),
        ),
    ] {
        refuse!(
            r,
            &format!("with_collection on {what}"),
            Batches::with_collection(&t.store, &name, Duration::from_secs(15)),
            QueueError::Invalid { .. }
        );
    }
    refuse!(
        r,
        "with_collection with a delay window over MAX_DELAY",
        Batches::with_collection(&t.store, "batches", MAX_DELAY + Duration::from_millis(1)),
        QueueError::Invalid { .. }
    );
    refuse!(
        r,
        "with_collection with Duration::MAX as delay window",
        Batches::with_collection(&t.store, "batches", Duration::MAX),
        QueueError::Invalid { .. }
    );
    assert!(r.checked() >= 9, "{} refusals checked", r.checked());
}

/// Claiming a batch that does not exist, under an unusable claimant name or for an unusable
/// time; the same through a submitter.
#[tokio::test]
async fn claims_of_unknown_batches_or_on_unusable_terms() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches.add(&NewBatch::new("s", "b1", "x")).await.unwrap();
    let queued: Vec<Batch> = batches.round().await.unwrap();
    let b1 = queued[0].clone();
    let mut unknown = b1.clone();
    unknown.header = "nope".into();
    let mut empty = b1.clone();
    empty.header = String::new();
    let ledger = Ledger::new(Duration::ZERO, Faults::NONE, 1);
    let nameless = Submitter::new(batches.clone(), ledger.clone(), "", Duration::from_secs(10));
    let hasty = Submitter::new(batches.clone(), ledger, "host-a", Duration::ZERO);
    let ttl = Duration::from_secs(10);
    let mut r = Refusals::new(&t.db);

    refuse!(
        r,
        "claim of a batch that does not exist",
        batches.claim(&unknown, "me", ttl),
        QueueError::UnknownBatch { .. }
    );
    refuse!(
        r,
        "claim of a batch with an empty header",
        batches.claim(&empty, "me", ttl),
        QueueError::InvalidBatch { .. }
    );
    refuse!(
        r,
        "claim by an empty claimant",
        batches.claim(&b1, "", ttl),
        QueueError::Invalid { .. }
    );
    refuse!(
        r,
        "claim by a claimant with a NUL",
        batches.claim(&b1, "me\0", ttl),
        QueueError::Invalid { .. }
    );
    refuse!(
        r,
        "claim by an over-long claimant",
        batches.claim(&b1, &too_long(), ttl),
        QueueError::Invalid { .. }
    );
    refuse!(
        r,
        "claim for no time",
        batches.claim(&b1, "me", Duration::ZERO),
        QueueError::Invalid { .. }
    );
    refuse!(
        r,
        "claim for under a millisecond",
        batches.claim(&b1, "me", Duration::from_micros(999)),
        QueueError::Invalid { .. }
    );
    refuse!(
        r,
        "claim for longer than MAX_CLAIM",
        batches.claim(&b1, "me", MAX_CLAIM + Duration::from_millis(1)),
        QueueError::Invalid { .. }
    );
    refuse!(
        r,
        "claim for Duration::MAX",
        batches.claim(&b1, "me", Duration::MAX),
        QueueError::Invalid { .. }
    );
    refuse!(
        r,
        "a submitter without a name taking a batch",
        nameless.take(&b1),
        QueueError::Invalid { .. }
    );
    refuse!(
        r,
        "a submitter without a name running a round",
        nameless.run_once(),
        QueueError::Invalid { .. }
    );
    refuse!(
        r,
        "a submitter with a zero claim time running a round",
        hasty.run_once(),
        QueueError::Invalid { .. }
    );
    assert!(r.checked() >= 12, "{} refusals checked", r.checked());
}

/// Recording a submission under a claim that is not the batch's, twice, or for a batch that does
/// not exist; recording a ledger status the batch's status does not lead to, for an unknown
/// batch, or about a state the batch has left.
#[tokio::test]
async fn records_by_non_claimants_and_transitions_not_allowed() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    // One service per batch, so that each can be taken at once.
    for s in ["p", "c", "i", "v", "w", "n"] {
        batches
            .add(&NewBatch::new(s, format!("{s}1"), "x"))
            .await
            .unwrap();
    }
    let mut claims = Vec::new();
    for s in ["p", "c", "i", "v", "w"] {
        claims.push(claim(&batches, &format!("{s}1"), "me").await);
    }
    // p1 pending, c1 committed, i1 invalid, v1 valid: accepted, then settled by the monitor.
    let submitted_p1 = claims[0].batch.clone();
    for (claim, status) in claims.iter().zip([
        None,
        Some(BatchStatus::Committed),
        Some(BatchStatus::Invalid),
        Some(BatchStatus::Valid),
    ]) {
        let pending = batches.record(claim, Submission::Accepted).await.unwrap();
        if let Some(status) = status {
            batches.record_status(&pending, status).await.unwrap();
        }
    }
    // w1 stays with its submitter (claimed, marked submitted, nothing recorded yet).
    let with_submitter = claims[4].clone();
    let mut forged = with_submitter.clone();
    forged.token = bson::oid::ObjectId::new();
    let mut unknown = with_submitter.clone();
    unknown.batch.header = "nope".into();
    let mut empty = with_submitter.clone();
    empty.batch.header = String::new();
    let get = |h: &'static str| {
        let batches = batches.clone();
        async move { batches.get(h).await.unwrap() }
    };
    let (p1, c1, i1, v1, w1, n1) = (
        get("p1").await,
        get("c1").await,
        get("i1").await,
        get("v1").await,
        get("w1").await,
        get("n1").await,
    );
    let mut unknown_seen = w1.clone();
    unknown_seen.header = "nope".into();
    let mut empty_seen = w1.clone();
    empty_seen.header = String::new();
    let mut r = Refusals::new(&t.db);

    // record: the submitter's write
    refuse!(
        r,
        "record under a claim token that is not the batch's",
        batches.record(&forged, Submission::Accepted),
        QueueError::NotClaimant { .. }
    );
    refuse!(
        r,
        "record twice",
        batches.record(&claims[0], Submission::Accepted),
        QueueError::NotClaimant { .. }
    );
    refuse!(
        r,
        "record a delay after the ledger settled the batch",
        batches.record(&claims[1], Submission::Delayed),
        QueueError::NotClaimant { .. }
    );
    refuse!(
        r,
        "record for a batch that does not exist",
        batches.record(&unknown, Submission::Delayed),
        QueueError::UnknownBatch { .. }
    );
    refuse!(
        r,
        "record for an empty header",
        batches.record(&empty, Submission::Accepted),
        QueueError::InvalidBatch { .. }
    );

    // record_status: the monitor's write
    for status in [
        BatchStatus::Pending,
        BatchStatus::Committed,
        BatchStatus::Valid,
        BatchStatus::Invalid,
        BatchStatus::Unknown,
        BatchStatus::Delayed,
    ] {
        refuse!(
            r,
            &format!("record_status {status} of a batch never submitted"),
            batches.record_status(&n1, status),
            QueueError::InvalidTransition { .. }
        );
    }
    let not_allowed = [
        (&w1, BatchStatus::Delayed, "with a submitter"),
        (&p1, BatchStatus::Delayed, "pending"),
        (&c1, BatchStatus::Pending, "committed"),
        (&c1, BatchStatus::Unknown, "committed"),
        (&c1, BatchStatus::Invalid, "committed"),
        (&i1, BatchStatus::Committed, "invalid"),
        (&i1, BatchStatus::Pending, "invalid"),
        (&v1, BatchStatus::Pending, "valid"),
        (&v1, BatchStatus::Invalid, "valid"),
    ];
    for (seen, status, from) in not_allowed {
        refuse!(
            r,
            &format!("record_status {status} of a {from} batch"),
            batches.record_status(seen, status),
            QueueError::InvalidTransition { .. }
        );
    }
    refuse!(
        r,
        "record_status of a batch that does not exist",
        batches.record_status(&unknown_seen, BatchStatus::Committed),
        QueueError::UnknownBatch { .. }
    );
    refuse!(
        r,
        "record_status of an empty header",
        batches.record_status(&empty_seen, BatchStatus::Committed),
        QueueError::InvalidBatch { .. }
    );
    refuse!(
        r,
        "record_status about a state the batch has left",
        batches.record_status(&submitted_p1, BatchStatus::Committed),
        QueueError::Contended { .. }
    );
    refuse!(
        r,
        "record_status unknown while the submitter's claim is live",
        batches.record_status(&w1, BatchStatus::Unknown),
        QueueError::Contended { .. }
    );
    assert!(r.checked() >= 24, "{} refusals checked", r.checked());
}

/// A refusal's message names the collection, the header and the values involved, and shows an
/// over-long value cut short rather than whole.
#[tokio::test]
async fn refusals_name_the_collection_the_header_and_the_values() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches.add(&NewBatch::new("s", "b1", "x")).await.unwrap();
    let b1 = batches.get("b1").await.unwrap();
    let says = |e: &QueueError, parts: &[&str]| {
        let text = e.to_string();
        for part in parts {
            assert!(text.contains(part), "{text:?} does not say {part:?}");
        }
        assert!(text.len() < 400, "{} bytes: {text}", text.len());
    };
    let e = batches
        .add(&NewBatch::new("s", "b2", ""))
        .await
        .unwrap_err();
    says(&e, &["batches", "\"b2\"", "\"s\"", "0 bytes"]);
    let e = batches
        .add(&NewBatch::new(too_long(), "b2", "x"))
        .await
        .unwrap_err();
    says(&e, &["batches", "\"b2\"", "service id", "513 bytes", "éé"]);
    let e = batches.claim(&b1, "me", Duration::ZERO).await.unwrap_err();
    says(&e, &["batches", "\"b1\"", "\"me\"", "0ns"]);
    let e = batches
        .claim(&b1, "", Duration::from_secs(1))
        .await
        .unwrap_err();
    says(&e, &["batches", "\"b1\"", "claimant name \"\""]);
    let e = Batches::with_collection(&t.store, "x_services", Duration::ZERO)
        .await
        .unwrap_err();
    says(&e, &["\"x_services\"", "services"]);
    let e = batches.get("nope").await.unwrap_err();
    says(&e, &["batches/nope"]);
    let e = batches
        .record_status(&b1, BatchStatus::Committed)
        .await
        .unwrap_err();
    says(&e, &["batches/b1", "none", "committed"]);
}
