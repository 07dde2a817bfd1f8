//! Batches in the database: adding (idempotent, typed refusals that write nothing) and the
//! queuer's round over stored batches in every state.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::TestDb;
use bson::{doc, Document};
use mongotx::collections::BATCHES_COLLECTION;
use mongotx::queue::{
    BatchStatus, Batches, LedgerApi, Monitor, NewBatch, QueueError, Submission, Submitter,
    BATCHES_SCHEMA, SERVICES_SCHEMA,
};
use mongotx::schema::JsonSchema;
use mongotx::testkit::ledger::{Answer, Fate, Faults, Ledger, LedgerStatus};

/// Sets `fields` on the stored batch `header`.
pub(crate) async fn set(t: &TestDb, header: &str, fields: Document) {
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
async fn a_round_over_stored_batches_follows_the_one_round_serial_strategy() {
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

fn headers(batches: &[mongotx::queue::Batch]) -> Vec<String> {
    batches.iter().map(|b| b.header.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_claimant_per_batch_and_one_batch_in_flight_per_service() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    for h in ["a1", "a2", "a3"] {
        batches.add(&NewBatch::new("a", h, h)).await.unwrap();
    }
    let queued = batches.round().await.unwrap();
    assert_eq!(headers(&queued), vec!["a1"]);
    // 16 claimants over two clients race for the same batch: one wins.
    let other = Batches::open(&mongotx::Store::new(t.other_client_db().await))
        .await
        .unwrap();
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let handle = if i % 2 == 0 {
                batches.clone()
            } else {
                other.clone()
            };
            let batch = queued[0].clone();
            tokio::spawn(async move {
                handle
                    .claim(&batch, &format!("s{i}"), Duration::from_secs(30))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut won = Vec::new();
    for task in tasks {
        if let Some(claim) = task.await.unwrap() {
            won.push(claim);
        }
    }
    assert_eq!(won.len(), 1, "one claimant per batch");
    let claim = won.pop().unwrap();
    assert!(claim.batch.submitted);
    assert!(claim.batch.last_submitted_at.is_some());

    // The next batch of the service cannot be taken while a1 is in flight, even bypassing
    // the queuer.
    let stored: Vec<_> = batches.round().await.unwrap();
    assert!(stored.is_empty(), "nothing queued: {:?}", headers(&stored));
    let a2 = batch_of(&t, "a2").await;
    assert!(batches
        .claim(&a2, "sneak", Duration::from_secs(30))
        .await
        .unwrap()
        .is_none());
    batches.record(&claim, Submission::Accepted).await.unwrap();
    assert!(
        batches
            .claim(&a2, "sneak", Duration::from_secs(30))
            .await
            .unwrap()
            .is_none(),
        "a1 is pending at the ledger"
    );
    // a3 cannot jump ahead of a2 once a1 is committed either.
    batches
        .record_status(&batches.get("a1").await.unwrap(), BatchStatus::Committed)
        .await
        .unwrap();
    let a3 = batch_of(&t, "a3").await;
    assert!(batches
        .claim(&a3, "sneak", Duration::from_secs(30))
        .await
        .unwrap()
        .is_none());
    let next = batches.round().await.unwrap();
    assert_eq!(headers(&next), vec!["a2"]);
    assert!(batches
        .claim(&next[0], "s", Duration::from_secs(30))
        .await
        .unwrap()
        .is_some());
    let services = common::raw_snapshot(&t.db, "batches_services").await;
    let schema = JsonSchema::parse("batches_services", SERVICES_SCHEMA).unwrap();
    for d in &services {
        schema.validate(d).unwrap_or_else(|v| panic!("{d}: {v}"));
    }
    let schema = JsonSchema::parse(BATCHES_COLLECTION, BATCHES_SCHEMA).unwrap();
    for d in common::raw_snapshot(&t.db, BATCHES_COLLECTION).await {
        schema.validate(&d).unwrap_or_else(|v| panic!("{d}: {v}"));
    }
}

async fn batch_of(t: &TestDb, header: &str) -> mongotx::queue::Batch {
    Batches::open(&t.store)
        .await
        .unwrap()
        .get(header)
        .await
        .unwrap()
}

#[tokio::test]
async fn wrong_claims_and_transitions_are_refused_without_writing() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches.add(&NewBatch::new("s", "b1", "x")).await.unwrap();
    batches.add(&NewBatch::new("s", "b2", "y")).await.unwrap();
    let queued = batches.round().await.unwrap();
    let claim = batches
        .claim(&queued[0], "me", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    let before = common::raw_snapshot(&t.db, BATCHES_COLLECTION).await;

    let mut forged = claim.clone();
    forged.token = bson::oid::ObjectId::new();
    let err = batches
        .record(&forged, Submission::Accepted)
        .await
        .unwrap_err();
    assert!(matches!(err, QueueError::NotClaimant { .. }), "{err}");
    assert!(err.to_string().contains("batches/b1"), "{err}");

    // Not submitted: the ledger cannot have said anything about b2.
    for status in [
        BatchStatus::Committed,
        BatchStatus::Pending,
        BatchStatus::Delayed,
    ] {
        let b2 = batches.get("b2").await.unwrap();
        let err = batches.record_status(&b2, status).await.unwrap_err();
        assert!(
            matches!(err, QueueError::InvalidTransition { .. }),
            "{status}: {err}"
        );
    }
    let mut nope = batches.get("b2").await.unwrap();
    nope.header = "nope".into();
    nope.submitted = true;
    let err = batches
        .record_status(&nope, BatchStatus::Committed)
        .await
        .unwrap_err();
    assert!(matches!(err, QueueError::UnknownBatch { .. }), "{err}");
    assert_eq!(
        common::raw_snapshot(&t.db, BATCHES_COLLECTION).await,
        before,
        "nothing written by a refusal"
    );

    // Settled statuses do not go back.
    batches.record(&claim, Submission::Accepted).await.unwrap();
    batches
        .record_status(&batches.get("b1").await.unwrap(), BatchStatus::Invalid)
        .await
        .unwrap();
    let settled = common::raw_snapshot(&t.db, BATCHES_COLLECTION).await;
    for status in [
        BatchStatus::Pending,
        BatchStatus::Committed,
        BatchStatus::Unknown,
    ] {
        let b1 = batches.get("b1").await.unwrap();
        let err = batches.record_status(&b1, status).await.unwrap_err();
        assert!(matches!(err, QueueError::InvalidTransition { .. }), "{err}");
        assert!(err.to_string().contains("from invalid"), "{err}");
    }
    // A claim on a settled batch is refused.
    let b1 = batches.get("b1").await.unwrap();
    assert!(batches
        .claim(&b1, "again", Duration::from_secs(30))
        .await
        .unwrap()
        .is_none());
    assert_eq!(
        common::raw_snapshot(&t.db, BATCHES_COLLECTION).await,
        settled
    );
}

#[tokio::test]
async fn sequential_adds_are_stamped_in_order_and_a_late_stamp_goes_after_what_was_sent() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    // Headers that sort the other way round: only the stamps may order them.
    let mut stamps = Vec::new();
    for i in 0..20 {
        let b = batches
            .add(&NewBatch::new("s", format!("z{:02}", 20 - i), "x"))
            .await
            .unwrap();
        stamps.push(b.created_at);
    }
    assert!(
        stamps.windows(2).all(|w| w[0] < w[1]),
        "strictly increasing: {stamps:?}"
    );
    assert_eq!(headers(&batches.round().await.unwrap()), vec!["z20"]);

    // A batch inserted with an old stamp (its adder died before placing it) after z20 was
    // sent: taking it is refused and it is stamped after z20, so it never overtakes it.
    let queued = batches.round().await.unwrap();
    let claim = batches
        .claim(&queued[0], "me", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    batches.record(&claim, Submission::Accepted).await.unwrap();
    batches
        .record_status(&batches.get("z20").await.unwrap(), BatchStatus::Committed)
        .await
        .unwrap();
    let old = bson::DateTime::from_millis(stamps[0].timestamp_millis() - 1_000);
    t.db.collection::<Document>(BATCHES_COLLECTION)
        .insert_one(doc! {
            "_id": "late", "service_id": "s", "content": "x",
            "created_at": old, "submitted": false,
        })
        .await
        .unwrap();
    let late = batches.get("late").await.unwrap();
    assert!(batches
        .claim(&late, "me", Duration::from_secs(30))
        .await
        .unwrap()
        .is_none());
    let late = batches.get("late").await.unwrap();
    assert!(
        late.created_at > claim.batch.created_at,
        "stamped after z20"
    );
    assert_eq!(headers(&batches.round().await.unwrap()), vec!["z19"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submitters_and_monitors_commit_every_valid_batch_once_in_order() {
    let t = TestDb::new().await;
    let batches = Batches::with_collection(&t.store, "batches", Duration::from_millis(100))
        .await
        .unwrap();
    let faults = Faults {
        invalid: 0.05,
        unknown: 0.05,
        delayed: 0.05,
        lost: 0.05,
    };
    let ledger = Ledger::new(Duration::from_millis(5), faults, 11);
    let mut created: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for i in 0..30 {
        for s in ["s1", "s2", "s3"] {
            let h = format!("{s}-{i:03}");
            batches.add(&NewBatch::new(s, &h, &h)).await.unwrap();
            created.entry(s.to_string()).or_default().push(h);
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..3 {
        let submitter = Submitter::new(
            batches.clone(),
            ledger.clone(),
            format!("sub{i}"),
            Duration::from_secs(5),
        );
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                submitter.run_once().await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }));
    }
    for _ in 0..2 {
        let monitor = Monitor::new(batches.clone(), ledger.clone());
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                monitor.run_once().await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }));
    }
    let started = std::time::Instant::now();
    loop {
        let open =
            t.db.collection::<Document>(BATCHES_COLLECTION)
                .count_documents(doc! { "status": { "$nin": ["committed", "invalid"] } })
                .await
                .unwrap();
        if open == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{open} batches still open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    assert!(ledger.breaches().is_empty(), "{:?}", ledger.breaches());
    let committed = ledger.committed();
    let invalid: Vec<String> = common::raw_snapshot(&t.db, BATCHES_COLLECTION)
        .await
        .into_iter()
        .filter(|d| d.get_str("status") == Ok("invalid"))
        .map(|d| d.get_str("_id").unwrap().to_string())
        .collect();
    assert!(!invalid.is_empty(), "the ledger found some batches invalid");
    for (service, headers) in &created {
        let expected: Vec<&String> = headers.iter().filter(|h| !invalid.contains(h)).collect();
        let got: Vec<&String> = committed
            .get(service)
            .map(|c| c.iter().collect())
            .unwrap_or_default();
        assert_eq!(
            got, expected,
            "{service}: committed in creation order, each once"
        );
    }
    println!(
        "{} submissions for {} batches ({} invalid)",
        ledger.submissions(),
        created.values().map(Vec::len).sum::<usize>(),
        invalid.len()
    );
}

#[tokio::test]
async fn a_ledger_answer_about_an_earlier_state_is_not_recorded() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches.add(&NewBatch::new("s", "b", "x")).await.unwrap();
    let queued = batches.round().await.unwrap();
    let claim = batches
        .claim(&queued[0], "me", Duration::from_millis(200))
        .await
        .unwrap()
        .unwrap();
    // A monitor reads the batch (submitted, no answer yet, claim run out) and asks the
    // ledger, which does not know it yet; meanwhile the submission lands and is recorded.
    // (A claim lands only before it runs out by the server's clock, so it is not shorter.)
    tokio::time::sleep(Duration::from_millis(250)).await;
    let seen = batches.get("b").await.unwrap();
    t.db.collection::<Document>(BATCHES_COLLECTION)
        .update_one(
            doc! { "_id": "b" },
            doc! { "$set": { "status": "pending" }, "$unset": { "claim": "" } },
        )
        .await
        .unwrap();
    let err = batches
        .record_status(&seen, BatchStatus::Unknown)
        .await
        .unwrap_err();
    assert!(matches!(err, QueueError::Contended { .. }), "{err}");
    let b = batches.get("b").await.unwrap();
    assert_eq!((b.status, b.submitted), (Some(BatchStatus::Pending), true));
    drop(claim);
}

/// A ledger whose answers to the submissions of some headers are lost after they arrived.
#[derive(Clone)]
struct LosesAnswers {
    inner: Ledger,
    lose: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

impl LedgerApi for LosesAnswers {
    async fn submit(&self, service: &str, header: &str, content: &str) -> Result<Answer, String> {
        let answer = self.inner.submit(service, header, content);
        if self.lose.lock().unwrap().remove(header) {
            return Err("connection reset after the request was sent".into());
        }
        Ok(answer)
    }

    async fn status(&self, header: &str) -> Result<LedgerStatus, String> {
        Ok(self.inner.status(header))
    }
}

#[tokio::test]
async fn a_submission_without_an_answer_is_asked_about_not_sent_again() {
    let t = TestDb::new().await;
    // A delay window shorter than the claim: a batch taken for delayed would be sent again
    // well before the claim expires.
    let batches = Batches::with_collection(&t.store, "batches", Duration::from_millis(10))
        .await
        .unwrap();
    let inner = Ledger::new(Duration::from_millis(5), Faults::NONE, 3);
    inner.force("b1", Fate::Invalid);
    let ledger = LosesAnswers {
        inner: inner.clone(),
        lose: Arc::new(std::sync::Mutex::new(["b1".to_string()].into())),
    };
    batches.add(&NewBatch::new("s", "b1", "x")).await.unwrap();
    batches.add(&NewBatch::new("s", "b2", "y")).await.unwrap();
    let submitter = Submitter::new(
        batches.clone(),
        ledger.clone(),
        "me",
        Duration::from_millis(300),
    );
    let monitor = Monitor::new(batches.clone(), ledger);
    let started = std::time::Instant::now();
    while batches.get("b2").await.unwrap().status != Some(BatchStatus::Committed) {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "b2 never committed"
        );
        submitter.run_once().await.unwrap();
        monitor.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        batches.get("b1").await.unwrap().status,
        Some(BatchStatus::Invalid)
    );
    assert!(inner.breaches().is_empty(), "{:?}", inner.breaches());
    assert_eq!(inner.submissions(), 2, "b1 once, b2 once");
    assert_eq!(inner.committed()["s"], vec!["b2"]);
}
