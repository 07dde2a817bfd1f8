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
    assert_schema_kept(&after);
}

/// Asserts that every stored batch in `batches` keeps the batches' JSON Schema.
pub(crate) fn assert_schema_kept(batches: &[Document]) {
    let schema = JsonSchema::parse(BATCHES_COLLECTION, BATCHES_SCHEMA).unwrap();
    for d in batches {
        schema
            .validate(d)
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
    assert_schema_kept(&common::raw_snapshot(&t.db, BATCHES_COLLECTION).await);
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

/// An add that finds its batch stored and never taken (the first add died between its insert and
/// its check, while a batch added meanwhile went ahead) does the check itself: what it returns
/// is the batch's final place, after the one that went, and before a batch added after it
/// returned. Without the check it would return the old stamp, and the batch would later be
/// stamped again by a claimant, behind the batch added after it.
#[tokio::test]
async fn adding_again_a_batch_whose_adder_died_places_it_before_batches_added_later() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    let went = batches.add(&NewBatch::new("s", "went", "x")).await.unwrap();
    let queued = batches.round().await.unwrap();
    assert_eq!(headers(&queued), vec!["went"]);
    let claim = batches
        .claim(&queued[0], "me", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    batches.record(&claim, Submission::Accepted).await.unwrap();
    // The dead add's insert, with the stamp it drew before "went" drew its own.
    let old = bson::DateTime::from_millis(went.created_at.timestamp_millis() - 1_000);
    t.db.collection::<Document>(BATCHES_COLLECTION)
        .insert_one(doc! {
            "_id": "late", "service_id": "s", "content": "y",
            "created_at": old, "submitted": false,
        })
        .await
        .unwrap();
    let late = batches.add(&NewBatch::new("s", "late", "y")).await.unwrap();
    assert!(
        late.created_at > went.created_at,
        "placed after the batch that went: {} <= {}",
        late.created_at,
        went.created_at
    );
    assert_eq!(batches.get("late").await.unwrap(), late, "as stored");
    let after = batches
        .add(&NewBatch::new("s", "after", "z"))
        .await
        .unwrap();
    assert!(after.created_at > late.created_at);
    batches
        .record_status(&batches.get("went").await.unwrap(), BatchStatus::Committed)
        .await
        .unwrap();
    let queued = batches.round().await.unwrap();
    assert_eq!(headers(&queued), vec!["late"], "the older add goes first");
    assert!(batches
        .claim(&queued[0], "me", Duration::from_secs(30))
        .await
        .unwrap()
        .is_some());
    assert_eq!(
        batches.get("late").await.unwrap().created_at,
        late.created_at
    );
}

/// Three submitters (one holding its claims 5 s; two only 40 ms, pausing up to 60 ms between
/// claiming a batch and sending it, so that claims run out around their sends while monitors ask
/// the ledger about their batches) and two monitors move 3 × 30 batches through a
/// ledger that finds 5 % invalid, forgets 5 %, delays 5 % and loses 5 %, while the batches are
/// being added: one adder per service, its adds in turn on a link of its own and on a slow one
/// (30 ms for each reply about the services) whose estimate of the server's clock is 1 s behind.
/// Every valid batch is committed once, in the
/// order of its service's adds; the ledger never has two batches of a service in flight, and is
/// never sent a batch it already has.
/// Three submitters and two monitors on `batches` and `ledger` until `stop`: one submitter runs
/// whole rounds with claims of 5 s; two hold claims of 40 ms and pause up to 60 ms before
/// sending, so that claims run out around their sends while the monitors ask (`ran_out` counts
/// the claims that ran out before their batch was sent).
pub(crate) fn crew(
    batches: &Batches,
    ledger: &Ledger,
    stop: &Arc<AtomicBool>,
    ran_out: &Arc<std::sync::atomic::AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for (i, claim) in [5_000, 40, 40].into_iter().enumerate() {
        let submitter = Submitter::new(
            batches.clone(),
            ledger.clone(),
            format!("sub{i}"),
            Duration::from_millis(claim),
        );
        let (stop, batches, ran_out) = (stop.clone(), batches.clone(), ran_out.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if claim == 5_000 {
                    submitter.run_once().await.unwrap();
                } else {
                    for batch in batches.round().await.unwrap() {
                        if let Some(claim) = submitter.take(&batch).await.unwrap() {
                            let pause = rand::random::<u64>() % 60;
                            tokio::time::sleep(Duration::from_millis(pause)).await;
                            if !claim.usable() {
                                ran_out.fetch_add(1, Ordering::Relaxed);
                            }
                            submitter.send(&claim).await.unwrap();
                        }
                    }
                }
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
    tasks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submitters_and_monitors_commit_every_valid_batch_once_in_order() {
    let t = TestDb::new().await;
    let batches = Batches::with_collection(&t.store, "batches", Duration::from_millis(100))
        .await
        .unwrap();
    let lagging = crate::queue_claim::Tampered::start(&t).await;
    lagging.link.hello_behind(1_000);
    lagging.link.slow_services(30);
    let lagging_batches =
        Batches::with_collection(&lagging.store, "batches", Duration::from_millis(100))
            .await
            .unwrap();
    let faults = Faults {
        invalid: 0.05,
        unknown: 0.05,
        delayed: 0.05,
        lost: 0.05,
    };
    let ledger = Ledger::new(Duration::from_millis(5), faults, 11);
    let stop = Arc::new(AtomicBool::new(false));
    let ran_out = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks = crew(&batches, &ledger, &stop, &ran_out);
    // The adds, while the submitters and monitors run.
    let adders: Vec<_> = ["s1", "s2", "s3"]
        .into_iter()
        .map(|s| {
            let handles = [batches.clone(), lagging_batches.clone()];
            tokio::spawn(async move {
                let mut added = Vec::new();
                for i in 0..30 {
                    let h = format!("{s}-{:03}", 30 - i);
                    handles[i % 2].add(&NewBatch::new(s, &h, &h)).await.unwrap();
                    added.push(h);
                }
                (s.to_string(), added)
            })
        })
        .collect();
    let mut created: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for adder in adders {
        let (service, added) = adder.await.unwrap();
        created.insert(service, added);
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
            "{service}: committed in the order of the adds, each once"
        );
    }
    assert!(ledger.repeats().is_empty(), "{:?}", ledger.repeats());
    println!(
        "{} submissions for {} batches ({} invalid); {} claims ran out before their batch was sent",
        ledger.submissions(),
        created.values().map(Vec::len).sum::<usize>(),
        invalid.len(),
        ran_out.load(Ordering::Relaxed),
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

/// Runs `submitter` and `monitor` rounds until every batch of `headers` is committed or invalid,
/// failing with where each stands after `limit`.
async fn drain<L: LedgerApi>(
    batches: &Batches,
    submitter: &Submitter<L>,
    monitor: &Monitor<L>,
    headers: &[&str],
    limit: Duration,
) {
    let started = std::time::Instant::now();
    loop {
        let mut open = Vec::new();
        for h in headers {
            let b = batches.get(h).await.unwrap();
            if !matches!(
                b.status,
                Some(BatchStatus::Committed | BatchStatus::Invalid)
            ) {
                open.push(format!("{h}: {:?} submitted {}", b.status, b.submitted));
            }
        }
        if open.is_empty() {
            return;
        }
        assert!(started.elapsed() < limit, "stuck after {limit:?}: {open:?}");
        submitter.run_once().await.unwrap();
        monitor.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Issue 47, case 8: `add(b)` returns, then `add(a)` runs on a process whose estimate of the
/// server's clock is behind (1 s here; half a slow `hello` round trip in life), and a submitter's
/// round runs before the add returns (its link holds the add's first command on the services
/// after its insert). The batch added second never goes first, and is stamped after the first.
#[tokio::test]
async fn an_add_overlapping_a_submitter_round_does_not_overtake_an_earlier_add() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    let first = batches
        .add(&NewBatch::new("s", "b", "first"))
        .await
        .unwrap();
    let adder = crate::queue_claim::Tampered::start(&t).await;
    adder.link.hello_behind(1_000);
    let inserted = Arc::new(AtomicBool::new(false));
    let (reached, release) = adder.link.hold(move |command| {
        use crate::queue_claim::target;
        if crate::common::wire_proxy::command_name(command) == "insert"
            && target(command) == BATCHES_COLLECTION
        {
            inserted.store(true, Ordering::SeqCst);
            return false;
        }
        inserted.load(Ordering::SeqCst) && target(command) == "batches_services"
    });
    let other = adder.batches().await;
    let mut adding =
        tokio::spawn(async move { other.add(&NewBatch::new("s", "a", "second")).await.unwrap() });
    let ledger = Ledger::new(Duration::from_millis(5), Faults::NONE, 8);
    let submitter = Submitter::new(
        batches.clone(),
        ledger.clone(),
        "sub",
        Duration::from_secs(5),
    );
    let monitor = Monitor::new(batches.clone(), ledger.clone());
    let second = tokio::select! {
        held = reached => {
            held.expect("the hold was dropped");
            // The add has inserted its batch and not returned: a submitter's round now.
            submitter.run_once().await.unwrap();
            release.send(()).unwrap();
            (&mut adding).await.unwrap()
        }
        added = &mut adding => added.unwrap(),
    };
    drain(
        &batches,
        &submitter,
        &monitor,
        &["a", "b"],
        Duration::from_secs(10),
    )
    .await;
    assert!(ledger.breaches().is_empty(), "{:?}", ledger.breaches());
    assert_eq!(
        ledger.committed()["s"],
        vec!["b", "a"],
        "in the order of the adds"
    );
    assert!(
        second.created_at > first.created_at,
        "stamped {} before the earlier add's {}",
        second.created_at,
        first.created_at
    );
}

/// The ledger simulator, with the answers to status questions about some headers set by the
/// test (a submission of such a header drops its set answer: the ledger says again what it has).
#[derive(Clone)]
pub(crate) struct Scripted {
    pub inner: Ledger,
    says: Arc<std::sync::Mutex<std::collections::HashMap<String, LedgerStatus>>>,
}

impl Scripted {
    pub(crate) fn new(inner: Ledger) -> Scripted {
        Scripted {
            inner,
            says: Arc::default(),
        }
    }

    /// The ledger answers `status` about `header` until it is submitted again.
    pub(crate) fn say(&self, header: &str, status: LedgerStatus) {
        self.says.lock().unwrap().insert(header.to_string(), status);
    }

    /// The ledger answers about `header` from what it has.
    pub(crate) fn forget_word(&self, header: &str) {
        self.says.lock().unwrap().remove(header);
    }
}

impl LedgerApi for Scripted {
    async fn submit(&self, service: &str, header: &str, content: &str) -> Result<Answer, String> {
        self.says.lock().unwrap().remove(header);
        Ok(self.inner.submit(service, header, content))
    }

    async fn status(&self, header: &str) -> Result<LedgerStatus, String> {
        let set = self.says.lock().unwrap().get(header).copied();
        Ok(set.unwrap_or_else(|| self.inner.status(header)))
    }
}

/// Issue 47, case 9: the ledger validates a batch (recorded through the public `record_status`),
/// submitters and monitors go on (a younger batch must not go meanwhile), then the ledger
/// forgets the valid batch and says unknown, which `record_status` allows. The forgotten batch is
/// sent again and the service moves on, in order: it is never stuck.
#[tokio::test]
async fn a_valid_batch_the_ledger_forgets_goes_again_and_the_service_moves_on() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    for h in ["b1", "b2", "b3"] {
        batches.add(&NewBatch::new("s", h, h)).await.unwrap();
    }
    let ledger = Scripted::new(Ledger::new(Duration::from_millis(20), Faults::NONE, 9));
    let submitter = Submitter::new(
        batches.clone(),
        ledger.clone(),
        "sub",
        Duration::from_secs(5),
    );
    let monitor = Monitor::new(batches.clone(), ledger.clone());
    let sent = submitter.run_once().await.unwrap();
    assert_eq!(headers(&sent), vec!["b1"]);
    ledger.say("b1", LedgerStatus::Pending);
    let b1 = batches.get("b1").await.unwrap();
    let valid = batches
        .record_status(&b1, BatchStatus::Valid)
        .await
        .unwrap();
    assert_eq!(valid.status, Some(BatchStatus::Valid));
    // Rounds go on for a while: b1 is not done yet, so nothing younger goes.
    let until = std::time::Instant::now() + Duration::from_millis(300);
    while std::time::Instant::now() < until {
        submitter.run_once().await.unwrap();
        monitor.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        ledger.inner.submissions(),
        1,
        "a younger batch went while b1 was valid: {:?}",
        ledger.inner.committed()
    );
    // The ledger forgets b1: the monitor records valid → unknown.
    ledger.say("b1", LedgerStatus::Unknown);
    let changed = monitor.run_once().await.unwrap();
    assert!(
        changed
            .iter()
            .any(|b| b.header == "b1" && b.status == Some(BatchStatus::Unknown)),
        "{changed:?}"
    );
    // A batch added now goes too.
    batches.add(&NewBatch::new("s", "b4", "b4")).await.unwrap();
    drain(
        &batches,
        &submitter,
        &monitor,
        &["b1", "b2", "b3", "b4"],
        Duration::from_secs(10),
    )
    .await;
    let inner = &ledger.inner;
    assert!(inner.breaches().is_empty(), "{:?}", inner.breaches());
    assert_eq!(inner.committed()["s"], vec!["b1", "b2", "b3", "b4"]);
    let services = common::raw_snapshot(&t.db, "batches_services").await;
    assert!(
        services.iter().all(|d| !d.contains_key("holder")),
        "{services:?}"
    );
}

/// The states `record_status` records from, as a test reaches them through the public API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum From {
    /// Claimed: with a submitter, nothing recorded yet.
    Claimed,
    /// Unknown, then claimed again.
    UnknownClaimed,
    /// Delayed, then claimed again.
    DelayedClaimed,
    /// Sent and accepted.
    Pending,
    /// Sent, accepted, then found valid.
    Valid,
}

/// What the ledger says of a batch recorded `status` (it has no word for valid).
fn ledger_word(status: BatchStatus) -> LedgerStatus {
    match status {
        BatchStatus::Pending | BatchStatus::Valid => LedgerStatus::Pending,
        BatchStatus::Committed => LedgerStatus::Committed,
        BatchStatus::Invalid => LedgerStatus::Invalid,
        BatchStatus::Unknown | BatchStatus::Delayed => LedgerStatus::Unknown,
    }
}

/// Takes batch `header` (the oldest of its service) to `from` through the public API: claims
/// last `ttl`. Returns the batch as read then.
async fn bring(
    batches: &Batches,
    submitter: &Submitter<Scripted>,
    ledger: &Scripted,
    header: &str,
    from: From,
    ttl: Duration,
) -> mongotx::queue::Batch {
    let claim = |ttl: Duration| async move {
        let b = batches.get(header).await.unwrap();
        batches
            .claim(&b, "bring", ttl)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{header} could not be claimed"))
    };
    let record = |status: BatchStatus| async move {
        let seen = batches.get(header).await.unwrap();
        ledger.say(header, ledger_word(status));
        batches.record_status(&seen, status).await.unwrap();
    };
    match from {
        From::Claimed => {
            claim(ttl).await;
        }
        From::UnknownClaimed => {
            claim(Duration::from_millis(50)).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            record(BatchStatus::Unknown).await;
            claim(ttl).await;
        }
        From::DelayedClaimed => {
            let c = claim(Duration::from_secs(5)).await;
            batches.record(&c, Submission::Delayed).await.unwrap();
            claim(ttl).await;
        }
        From::Pending | From::Valid => {
            let c = claim(Duration::from_secs(5)).await;
            submitter.send(&c).await.unwrap().expect("sent");
            ledger.say(header, LedgerStatus::Pending);
            if from == From::Valid {
                record(BatchStatus::Valid).await;
            }
        }
    }
    batches.get(header).await.unwrap()
}

/// Every transition `record_status` allows, from every state it allows it from (a batch with a
/// submitter, nothing recorded, unknown or delayed; pending; valid), each on the oldest batch
/// of a service of its own with two more behind it, the ledger saying the same. Recording it
/// again changes nothing. Then submitters and monitors run: nothing younger goes while a batch
/// is valid; then the ledger forgets the valid batches (they come back unknown); in the end
/// every batch is committed or invalid, each service's reached the ledger one at a time and in
/// order, and no slot is held.
#[tokio::test]
async fn every_transition_record_status_allows_leaves_its_service_moving_in_order() {
    use BatchStatus as S;
    let t = TestDb::new().await;
    let batches = Batches::with_collection(&t.store, "batches", Duration::ZERO)
        .await
        .unwrap();
    // The ledger settles what it takes at once; what it says of the first batches is set.
    let ledger = Scripted::new(Ledger::new(Duration::ZERO, Faults::NONE, 13));
    let submitter = Submitter::new(
        batches.clone(),
        ledger.clone(),
        "sub",
        Duration::from_secs(5),
    );
    let monitor = Monitor::new(batches.clone(), ledger.clone());
    let with_submitter = [S::Pending, S::Valid, S::Committed, S::Invalid, S::Unknown];
    let mut edges: Vec<(From, BatchStatus)> = Vec::new();
    for from in [From::Claimed, From::UnknownClaimed, From::DelayedClaimed] {
        edges.extend(with_submitter.iter().map(|&to| (from, to)));
    }
    edges.extend([S::Valid, S::Committed, S::Invalid, S::Unknown].map(|to| (From::Pending, to)));
    edges.extend([S::Committed, S::Unknown].map(|to| (From::Valid, to)));
    let mut services = Vec::new();
    for (n, &(from, to)) in edges.iter().enumerate() {
        let s = format!("e{n:02}");
        let hs: Vec<String> = (1..=3).map(|i| format!("{s}-{i}")).collect();
        for h in &hs {
            batches.add(&NewBatch::new(&s, h, h)).await.unwrap();
        }
        // Unknown is recorded for a batch with a submitter only once its claim has expired.
        let ttl = if to == S::Unknown {
            Duration::from_millis(50)
        } else {
            Duration::from_secs(30)
        };
        let seen = bring(&batches, &submitter, &ledger, &hs[0], from, ttl).await;
        services.push((s, hs, from, to, seen));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    for (s, hs, from, to, seen) in &services {
        // The ledger has what it is recorded to have: a batch never sent arrives now.
        let sent = matches!(from, From::Pending | From::Valid);
        match to {
            S::Pending | S::Committed | S::Valid if !sent => {
                ledger.inner.submit(s, &hs[0], &hs[0]);
            }
            S::Invalid if !sent => {
                ledger.inner.force(&hs[0], Fate::Invalid);
                ledger.inner.submit(s, &hs[0], &hs[0]);
            }
            _ => {}
        }
        match to {
            // Accepted: the ledger says what becomes of it.
            S::Pending => ledger.forget_word(&hs[0]),
            &other => ledger.say(&hs[0], ledger_word(other)),
        }
        let recorded = batches
            .record_status(seen, *to)
            .await
            .unwrap_or_else(|e| panic!("{s}: {from:?} -> {to}: {e}"));
        assert_eq!(recorded.status, Some(*to), "{s}: {from:?} -> {to}");
        let again = batches.record_status(&recorded, *to).await.unwrap();
        assert_eq!(
            again, recorded,
            "{s}: recording {to} again changed the batch"
        );
    }
    // Rounds go on: behind a batch that is not done (valid included), nothing younger goes.
    let until = std::time::Instant::now() + Duration::from_millis(300);
    while std::time::Instant::now() < until {
        submitter.run_once().await.unwrap();
        monitor.run_once().await.unwrap();
        for (s, hs, ..) in &services {
            let first = batches.get(&hs[0]).await.unwrap();
            if !matches!(first.status, Some(S::Committed | S::Invalid)) {
                for h in &hs[1..] {
                    let b = batches.get(h).await.unwrap();
                    assert!(
                        !b.submitted && b.status.is_none(),
                        "{s}: {h} went while {} is {:?}: {b:?}",
                        hs[0],
                        first.status
                    );
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The ledger forgets the valid batches: valid, then unknown.
    for (_, hs, ..) in &services {
        if batches.get(&hs[0]).await.unwrap().status == Some(S::Valid) {
            ledger.say(&hs[0], LedgerStatus::Unknown);
        }
    }
    let all: Vec<&str> = services
        .iter()
        .flat_map(|(_, hs, ..)| hs.iter().map(String::as_str))
        .collect();
    drain(
        &batches,
        &submitter,
        &monitor,
        &all,
        Duration::from_secs(30),
    )
    .await;
    let inner = &ledger.inner;
    assert!(inner.breaches().is_empty(), "{:?}", inner.breaches());
    let committed = inner.committed();
    for (s, hs, from, to, _) in &services {
        let got = committed.get(s).cloned().unwrap_or_default();
        let in_order: Vec<&String> = hs.iter().filter(|h| got.contains(h)).collect();
        assert_eq!(
            got.iter().collect::<Vec<_>>(),
            in_order,
            "{s} ({from:?} -> {to}): reached the ledger out of order"
        );
        assert!(got.ends_with(&hs[1..]), "{s} ({from:?} -> {to}): {got:?}");
    }
    let slots = common::raw_snapshot(&t.db, "batches_services").await;
    assert!(slots.iter().all(|d| !d.contains_key("holder")), "{slots:?}");
}
