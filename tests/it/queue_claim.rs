//! Taking a batch: two round trips in sequence (the slot, then the claim beside the count of
//! older batches), and the slot as the fence that keeps one batch per service in flight when a
//! claimant is stale, slow, or dead between the two.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::wire_proxy::{Rules, WireProxy};
use crate::common::TestDb;
use crate::queue::set;
use bson::{doc, oid::ObjectId, DateTime, Document};
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use mongodb::options::ClientOptions;
use mongodb::Client;
use mongotx::collections::BATCHES_COLLECTION;
use mongotx::queue::{BatchStatus, Batches, Monitor, NewBatch, Submission, Submitter};
use mongotx::testkit::ledger::{Faults, Ledger};
use mongotx::Store;

const SERVICES: &str = "batches_services";

/// Holds every reply for a while when told to: a slow link, on which commands sent together
/// overlap whatever the machine's load.
struct SlowLink(Arc<AtomicBool>);

impl Rules for SlowLink {
    fn reply_delay(&self, _command: &Document) -> Option<Duration> {
        self.0
            .load(Ordering::SeqCst)
            .then_some(Duration::from_millis(150))
    }
}

/// A claim is two round trips: the commands it sends start in two groups, the second only
/// after the first has answered (the server's clock, already known, adds none). Counted on a
/// client of its own by the driver's command monitoring, through a proxy that holds each reply
/// 150 ms: a command that starts while none is in flight begins a round trip.
#[tokio::test]
async fn a_claim_is_two_round_trips_in_sequence() {
    let t = TestDb::new().await;
    let counting = Arc::new(AtomicBool::new(false));
    let proxy = WireProxy::start(&common::server_uri(), SlowLink(Arc::clone(&counting))).await;
    let in_flight = Arc::new(AtomicUsize::new(0));
    let rounds = Arc::new(AtomicUsize::new(0));
    let commands = Arc::new(AtomicUsize::new(0));
    let mut options = ClientOptions::parse(proxy.uri()).await.expect("uri");
    {
        let (counting, in_flight, rounds, commands) = (
            Arc::clone(&counting),
            Arc::clone(&in_flight),
            Arc::clone(&rounds),
            Arc::clone(&commands),
        );
        options.command_event_handler = Some(EventHandler::callback(move |event| {
            if !counting.load(Ordering::SeqCst) {
                return;
            }
            match event {
                CommandEvent::Started(_) => {
                    commands.fetch_add(1, Ordering::SeqCst);
                    if in_flight.fetch_add(1, Ordering::SeqCst) == 0 {
                        rounds.fetch_add(1, Ordering::SeqCst);
                    }
                }
                CommandEvent::Succeeded(_) | CommandEvent::Failed(_) => {
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                }
                _ => {}
            }
        }));
    }
    let client = Client::with_options(options).expect("client");
    let store = Store::builder(client.database(t.db.name())).build();
    let batches = Batches::open(&store).await.unwrap();
    for service in ["s0", "s1", "s2", "s3"] {
        batches
            .add(&NewBatch::new(service, format!("{service}-b"), "x"))
            .await
            .unwrap();
    }
    let queued = batches.round().await.unwrap();
    assert_eq!(queued.len(), 4);
    // The first claim opens the pool's second connection (a command waiting for one to be
    // made starts late, after the other may have answered); the others are counted.
    let (first, counted) = queued.split_at(1);
    batches
        .claim(&first[0], "me", Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the first batch is free to claim");
    for batch in counted {
        rounds.store(0, Ordering::SeqCst);
        commands.store(0, Ordering::SeqCst);
        counting.store(true, Ordering::SeqCst);
        let claim = batches
            .claim(batch, "me", Duration::from_secs(30))
            .await
            .unwrap();
        counting.store(false, Ordering::SeqCst);
        let claim = claim.unwrap_or_else(|| panic!("{} could not be claimed", batch.header));
        assert!(claim.batch.submitted);
        assert_eq!(
            (
                rounds.load(Ordering::SeqCst),
                commands.load(Ordering::SeqCst)
            ),
            (2, 3),
            "claim of {}: (round trips in sequence, commands)",
            batch.header
        );
    }
}

/// A claimant working from an old reading of a batch that went since (its own claim ran out,
/// the ledger has it) takes the slot back for a moment, finds the batch not claimable and puts
/// the slot back as it was: the next batch of the service still cannot go.
#[tokio::test]
async fn a_stale_claim_of_a_batch_that_went_leaves_the_slot_to_it() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches.add(&NewBatch::new("s", "b1", "x")).await.unwrap();
    let stale = batches.round().await.unwrap();
    assert_eq!(stale.len(), 1);
    let claim = batches
        .claim(&stale[0], "first", Duration::from_millis(200))
        .await
        .unwrap()
        .expect("b1 is free to claim");
    batches.record(&claim, Submission::Accepted).await.unwrap();
    batches.add(&NewBatch::new("s", "b2", "y")).await.unwrap();
    // The first taking of the slot has run out; the batch is at the ledger.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let holder_before = slot(&t, "s").await;
    assert!(batches
        .claim(&stale[0], "stale", Duration::from_secs(30))
        .await
        .unwrap()
        .is_none());
    assert_eq!(
        slot(&t, "s").await,
        holder_before,
        "the slot is back as it was"
    );
    let b2 = batches.get("b2").await.unwrap();
    assert!(
        batches
            .claim(&b2, "next", Duration::from_secs(30))
            .await
            .unwrap()
            .is_none(),
        "b2 went while b1 was at the ledger"
    );
    // Once the ledger settles b1, the slot is free and the mark at b1: b2 goes, b1 never again.
    let b1 = batches.get("b1").await.unwrap();
    batches
        .record_status(&b1, BatchStatus::Committed)
        .await
        .unwrap();
    let service =
        t.db.collection::<Document>(SERVICES)
            .find_one(doc! { "_id": "s" })
            .await
            .unwrap()
            .unwrap();
    assert!(service.get("holder").is_none(), "{service}");
    assert_eq!(service.get_str("mark_header"), Ok("b1"), "{service}");
    assert!(batches
        .claim(&stale[0], "stale", Duration::from_secs(30))
        .await
        .unwrap()
        .is_none());
    assert!(batches
        .claim(&b2, "next", Duration::from_secs(30))
        .await
        .unwrap()
        .is_some());
}

/// A claimant that took the slot and died before claiming the batch: nobody takes the slot nor
/// claims the batch until the taking runs out by the server's clock; then the batch can be
/// claimed again.
#[tokio::test]
async fn a_slot_whose_taker_died_before_the_claim_runs_out_at_its_until() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches.add(&NewBatch::new("s", "b1", "x")).await.unwrap();
    let b1 = batches.get("b1").await.unwrap();
    // The first round trip of a claimant that died then: the slot with its taking.
    let until = DateTime::from_millis(DateTime::now().timestamp_millis() + 1_500);
    set_service(
        &t,
        "s",
        doc! { "holder": {
            "header": "b1", "at": b1.created_at, "token": ObjectId::new(),
            "by": "dead", "until": until,
        } },
    )
    .await;
    let taken = slot(&t, "s").await;
    assert!(batches
        .claim(&b1, "early", Duration::from_secs(30))
        .await
        .unwrap()
        .is_none());
    assert_eq!(slot(&t, "s").await, taken, "refused before its until");
    let stored = batches.get("b1").await.unwrap();
    assert!(!stored.submitted, "refused, yet marked submitted");
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    let claim = batches
        .claim(&b1, "later", Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the taking ran out");
    assert_eq!(
        slot(&t, "s").await.get_object_id("token"),
        Ok(claim.token),
        "the slot is the new claimant's"
    );
    let raw =
        t.db.collection::<Document>(BATCHES_COLLECTION)
            .find_one(doc! { "_id": "b1" })
            .await
            .unwrap()
            .unwrap();
    assert_eq!(
        raw.get_document("claim").unwrap().get_str("by"),
        Ok("later")
    );
}

/// Sets `fields` on `service`'s document, as a process of the queue would have left them.
async fn set_service(t: &TestDb, service: &str, fields: Document) {
    t.db.collection::<Document>(SERVICES)
        .update_one(doc! { "_id": service }, doc! { "$set": fields })
        .await
        .unwrap();
}

/// The slot of `service` as stored.
async fn slot(t: &TestDb, service: &str) -> Document {
    t.db.collection::<Document>(SERVICES)
        .find_one(doc! { "_id": service })
        .await
        .unwrap()
        .unwrap_or_default()
        .get_document("holder")
        .cloned()
        .unwrap_or_default()
}

/// A claimant that claimed a batch and found an older one to go first, then died before giving
/// the claim back, leaves its batch marked submitted though it never went. The monitor finds the
/// ledger does not know it; the service still gets both batches to the ledger, the older first.
#[tokio::test]
async fn a_claimant_that_died_after_finding_an_older_batch_blocks_nothing() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches.add(&NewBatch::new("s", "a", "x")).await.unwrap();
    batches.add(&NewBatch::new("s", "b", "y")).await.unwrap();
    let b = batches.get("b").await.unwrap();
    let now = DateTime::now().timestamp_millis();
    let until = DateTime::from_millis(now + 300);
    let token = ObjectId::new();
    // Both writes of its second round trip landed; the give-back never did.
    set(
        &t,
        "b",
        doc! {
            "claim": { "token": token, "by": "dead", "until": until },
            "submitted": true,
            "last_submitted_at": DateTime::from_millis(now),
        },
    )
    .await;
    set_service(
        &t,
        "s",
        doc! { "holder": {
            "header": "b", "at": b.created_at, "token": token, "by": "dead", "until": until,
        } },
    )
    .await;
    let ledger = Ledger::new(Duration::from_millis(5), Faults::NONE, 7);
    let submitter = Submitter::new(
        batches.clone(),
        ledger.clone(),
        "me",
        Duration::from_secs(5),
    );
    let monitor = Monitor::new(batches.clone(), ledger.clone());
    let started = std::time::Instant::now();
    loop {
        let (a, b) = (
            batches.get("a").await.unwrap(),
            batches.get("b").await.unwrap(),
        );
        if a.status == Some(BatchStatus::Committed) && b.status == Some(BatchStatus::Committed) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "stuck: a {:?} submitted {}, b {:?} submitted {}",
            a.status,
            a.submitted,
            b.status,
            b.submitted
        );
        submitter.run_once().await.unwrap();
        monitor.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(ledger.breaches().is_empty(), "{:?}", ledger.breaches());
    assert_eq!(ledger.committed()["s"], vec!["a", "b"]);
    assert_eq!(ledger.submissions(), 2, "each once");
}

/// Holds the reply to a read of one batch (a taker's look at the slot's holder) long enough for
/// the holder's claimant to land its claim and for the slot's taking to run out meanwhile.
struct SlowBatchRead(&'static str);

impl Rules for SlowBatchRead {
    fn reply_delay(&self, command: &Document) -> Option<Duration> {
        let reads_it = command.get_str("find") == Ok(BATCHES_COLLECTION)
            && command
                .get_document("filter")
                .is_ok_and(|f| f.get_str("_id") == Ok(self.0));
        reads_it.then_some(Duration::from_millis(800))
    }
}

/// A taker that finds the slot held by a batch nobody seems to be at work on decides it was
/// abandoned only from a reading made after the taking ran out: a reading made before it can
/// be overtaken by the holder's claim, and the batch would then be at the ledger with its slot
/// free.
#[tokio::test]
async fn a_slot_is_judged_abandoned_only_after_its_taking_ran_out() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches.add(&NewBatch::new("s", "b", "x")).await.unwrap();
    batches.add(&NewBatch::new("s", "c", "y")).await.unwrap();
    let b = batches.get("b").await.unwrap();
    let c = batches.get("c").await.unwrap();
    // A claimant's first round trip: the slot is b's until `until`, the batch not yet claimed.
    let until = DateTime::from_millis(DateTime::now().timestamp_millis() + 400);
    let token = ObjectId::new();
    set_service(
        &t,
        "s",
        doc! { "holder": {
            "header": "b", "at": b.created_at, "token": token, "by": "slow", "until": until,
        } },
    )
    .await;
    // Another taker, for c, through a link that holds its reading of b.
    let proxy = WireProxy::start(&common::server_uri(), SlowBatchRead("b")).await;
    let store = Store::new(proxy.client().await.database(t.db.name()));
    let via_proxy = Batches::open(&store).await.unwrap();
    let taker = tokio::spawn(async move {
        via_proxy
            .claim(&c, "other", Duration::from_secs(30))
            .await
            .unwrap()
    });
    // Meanwhile b's claimant lands its second round trip before `until` (and sends b).
    tokio::time::sleep(Duration::from_millis(150)).await;
    set(
        &t,
        "b",
        doc! {
            "claim": { "token": token, "by": "slow", "until": until },
            "submitted": true,
            "last_submitted_at": DateTime::now(),
        },
    )
    .await;
    assert!(taker.await.unwrap().is_none(), "c was taken while b is out");
    assert_eq!(
        slot(&t, "s").await.get_str("header"),
        Ok("b"),
        "b is at the ledger: its slot stays"
    );
}

/// Versions before 2026-11-26 moved the mark to a batch when it was sent; such a batch that
/// comes back unknown still takes its slot again.
#[tokio::test]
async fn a_batch_at_the_mark_that_came_back_unknown_is_taken_again() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches.add(&NewBatch::new("s", "b", "x")).await.unwrap();
    let b = batches.get("b").await.unwrap();
    set(
        &t,
        "b",
        doc! { "status": "unknown", "last_submitted_at": b.created_at },
    )
    .await;
    set_service(
        &t,
        "s",
        doc! {
            "holder": { "header": "b", "at": b.created_at, "token": ObjectId::new() },
            "mark_at": b.created_at,
            "mark_header": "b",
        },
    )
    .await;
    let queued = batches.round().await.unwrap();
    assert_eq!(queued.len(), 1);
    assert!(batches
        .claim(&queued[0], "me", Duration::from_secs(30))
        .await
        .unwrap()
        .is_some());
}

/// An adder that died between inserting the first batch of a service and writing the service's
/// document leaves no document to take a slot in: the claimant writes it.
#[tokio::test]
async fn the_first_batch_of_a_service_whose_adder_died_is_taken() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches.add(&NewBatch::new("s", "b", "x")).await.unwrap();
    t.db.collection::<Document>(SERVICES)
        .delete_one(doc! { "_id": "s" })
        .await
        .unwrap();
    let queued = batches.round().await.unwrap();
    assert_eq!(queued.len(), 1);
    let claim = batches
        .claim(&queued[0], "me", Duration::from_secs(30))
        .await
        .unwrap()
        .expect("b is free to claim");
    assert_eq!(slot(&t, "s").await.get_object_id("token"), Ok(claim.token));
}
