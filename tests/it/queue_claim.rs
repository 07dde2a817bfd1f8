//! Taking a batch: two round trips in sequence (the slot, then the claim beside the count of
//! older batches), and the slot as the fence that keeps one batch per service in flight when a
//! claimant is stale, slow, or dead between the two.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::wire_proxy::{command_name, Action, Rules, WireProxy};
use crate::common::TestDb;
use crate::queue::set;
use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use mongodb::options::ClientOptions;
use mongodb::Client;
use mongotx::collections::BATCHES_COLLECTION;
use mongotx::queue::{
    Answer, BatchStatus, Batches, LedgerApi, LedgerStatus, Monitor, NewBatch, Submission, Submitter,
};
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

/// What a [`Tampered`] link does to one queue process's traffic, changed by the test as it goes.
#[derive(Default)]
pub(crate) struct Link {
    /// Milliseconds taken off the `localTime` of `hello` replies: the process's estimate of the
    /// server's clock is that much behind (as a slow `hello` round trip leaves it, up to half the
    /// trip, or as a primary whose clock is behind reports it).
    hello_behind_ms: AtomicI64,
    /// How long to hold the replies to `hello` (a slow link for the clock's samples only).
    hello_delay_ms: AtomicI64,
    /// How long to hold the replies to commands on a services collection.
    services_delay_ms: AtomicI64,
    hold: std::sync::Mutex<Option<Hold>>,
    /// Told once the reply to a command it accepts has come back.
    replied: std::sync::Mutex<Option<Replied>>,
}

type Replied = (
    Box<dyn FnMut(&Document) -> bool + Send>,
    tokio::sync::oneshot::Sender<()>,
);

/// The first command `matches` accepts waits on the way until released (`reached` says so),
/// and then runs with `$$NOW` shifted by `shift_ms`.
struct Hold {
    matches: Box<dyn FnMut(&Document) -> bool + Send>,
    shift_ms: i64,
    reached: tokio::sync::oneshot::Sender<()>,
    release: tokio::sync::oneshot::Receiver<()>,
}

impl Link {
    pub(crate) fn hello_behind(&self, ms: i64) {
        self.hello_behind_ms.store(ms, Ordering::SeqCst);
    }

    pub(crate) fn slow_hello(&self, ms: i64) {
        self.hello_delay_ms.store(ms, Ordering::SeqCst);
    }

    pub(crate) fn slow_services(&self, ms: i64) {
        self.services_delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Holds the first command `matches` accepts (it reaches the server once released, while its
    /// sender waits for the reply): the first receiver fires when it is held, the sender releases
    /// it.
    pub(crate) fn hold(
        &self,
        matches: impl FnMut(&Document) -> bool + Send + 'static,
    ) -> (
        tokio::sync::oneshot::Receiver<()>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        self.hold_then_run_on(matches, 0)
    }

    /// Fires once the reply to the first command `matches` accepts is on its way back.
    pub(crate) fn replied(
        &self,
        matches: impl FnMut(&Document) -> bool + Send + 'static,
    ) -> tokio::sync::oneshot::Receiver<()> {
        let (tell, told) = tokio::sync::oneshot::channel();
        *self.replied.lock().unwrap() = Some((Box::new(matches), tell));
        told
    }

    /// As [`hold`](Link::hold), and the held command, once released, runs on a clock `shift_ms`
    /// away from the server's: released after a failover to a primary whose clock is off by
    /// that much.
    pub(crate) fn hold_then_run_on(
        &self,
        matches: impl FnMut(&Document) -> bool + Send + 'static,
        shift_ms: i64,
    ) -> (
        tokio::sync::oneshot::Receiver<()>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        let (reached, on_reach) = tokio::sync::oneshot::channel();
        let (release, on_release) = tokio::sync::oneshot::channel();
        *self.hold.lock().unwrap() = Some(Hold {
            matches: Box::new(matches),
            shift_ms,
            reached,
            release: on_release,
        });
        (on_reach, release)
    }
}

fn is_hello(command: &Document) -> bool {
    matches!(command_name(command), "hello" | "isMaster" | "ismaster")
}

/// `$$NOW` shifted by `ms` wherever a statement names it (an expression the server evaluates
/// when the statement runs).
fn shift_now(value: &mut Bson, ms: i64) {
    match value {
        Bson::String(s) if s == "$$NOW" => *value = Bson::Document(doc! { "$add": ["$$NOW", ms] }),
        Bson::Document(d) => d.iter_mut().for_each(|(_, v)| shift_now(v, ms)),
        Bson::Array(items) => items.iter_mut().for_each(|v| shift_now(v, ms)),
        _ => {}
    }
}

struct LinkRules(Arc<Link>);

impl Rules for LinkRules {
    fn command(&self, command: &mut Document) -> Action {
        let link = &self.0;
        let mut hold = link.hold.lock().unwrap();
        let held = match hold.as_mut() {
            Some(h) => (h.matches)(command),
            None => false,
        };
        if !held {
            return Action::Forward;
        }
        let Hold {
            reached,
            release,
            shift_ms,
            ..
        } = hold.take().expect("matched");
        if shift_ms != 0 {
            command.iter_mut().for_each(|(_, v)| shift_now(v, shift_ms));
        }
        let _ = reached.send(());
        Action::After(Box::pin(async move {
            // Released by the test, or let go after a while if the test gave up.
            let _ = tokio::time::timeout(Duration::from_secs(30), release).await;
        }))
    }

    fn reply(&self, command: &Document, reply: &mut Document) {
        let mut replied = self.0.replied.lock().unwrap();
        if replied
            .as_mut()
            .is_some_and(|(matches, _)| matches(command))
        {
            let (_, tell) = replied.take().expect("matched");
            let _ = tell.send(());
        }
        drop(replied);
        let behind = self.0.hello_behind_ms.load(Ordering::SeqCst);
        if behind != 0 && is_hello(command) {
            if let Ok(at) = reply.get_datetime("localTime") {
                let earlier = DateTime::from_millis(at.timestamp_millis() - behind);
                reply.insert("localTime", earlier);
            }
        }
    }

    fn reply_delay(&self, command: &Document) -> Option<Duration> {
        let ms = if is_hello(command) {
            self.0.hello_delay_ms.load(Ordering::SeqCst)
        } else if target(command).ends_with("_services") {
            self.0.services_delay_ms.load(Ordering::SeqCst)
        } else {
            0
        };
        (ms > 0).then(|| Duration::from_millis(ms as u64))
    }
}

/// A queue process whose link to the server a test tampers with ([`Link`]).
pub(crate) struct Tampered {
    pub store: Store,
    pub link: Arc<Link>,
    _proxy: WireProxy,
}

impl Tampered {
    pub(crate) async fn start(t: &TestDb) -> Tampered {
        let link = Arc::new(Link::default());
        let proxy = WireProxy::start(&common::server_uri(), LinkRules(Arc::clone(&link))).await;
        let store = Store::new(proxy.client().await.database(t.db.name()));
        Tampered {
            store,
            link,
            _proxy: proxy,
        }
    }

    /// Its batches (the default collection).
    pub(crate) async fn batches(&self) -> Batches {
        Batches::open(&self.store).await.unwrap()
    }
}

/// The collection a command is about (the value of its first key).
pub(crate) fn target(command: &Document) -> &str {
    command
        .iter()
        .next()
        .and_then(|(_, v)| v.as_str())
        .unwrap_or("")
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

/// A ledger whose answer to the first status question about one header is what it knew when
/// asked, handed over only when the test releases it (`asked` fires when the question is in).
struct SlowAnswer {
    inner: Ledger,
    header: &'static str,
    asked: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    release: tokio::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
}

impl LedgerApi for SlowAnswer {
    async fn submit(&self, service: &str, header: &str, content: &str) -> Result<Answer, String> {
        Ok(self.inner.submit(service, header, content))
    }

    async fn status(&self, header: &str) -> Result<LedgerStatus, String> {
        let said = self.inner.status(header);
        if header == self.header {
            let first = self.asked.lock().unwrap().take();
            if let Some(asked) = first {
                let _ = asked.send(());
                if let Some(release) = self.release.lock().await.take() {
                    let _ = release.await;
                }
            }
        }
        Ok(said)
    }
}

/// Issue 47, case 10: a monitor asks the ledger about a batch whose submitter's claim is still
/// live; the ledger does not know it yet and says unknown; the submitter, inside its deadline,
/// sends it; the answer reaches the monitor once the claim has run out. That answer is about a
/// time the claim was live: it is not recorded, the submitter records its submission, and the
/// batch is not taken and sent a second time.
#[tokio::test]
async fn an_unknown_asked_while_the_claim_was_live_is_not_recorded_after_it_ran_out() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches.add(&NewBatch::new("s", "b", "x")).await.unwrap();
    let b = batches.get("b").await.unwrap();
    let ttl = Duration::from_millis(1_500);
    let claim = batches
        .claim(&b, "sub", ttl)
        .await
        .unwrap()
        .expect("b is free to claim");
    let claimed = std::time::Instant::now();
    let inner = Ledger::new(Duration::from_secs(3_600), Faults::NONE, 10);
    let (asked, on_asked) = tokio::sync::oneshot::channel();
    let (release, on_release) = tokio::sync::oneshot::channel();
    let ledger = SlowAnswer {
        inner: inner.clone(),
        header: "b",
        asked: std::sync::Mutex::new(Some(asked)),
        release: tokio::sync::Mutex::new(Some(on_release)),
    };
    let monitor = Monitor::new(batches.clone(), ledger);
    let monitoring = tokio::spawn(async move { monitor.run_once().await.unwrap() });
    on_asked.await.unwrap();
    // The submitter sends, inside its deadline: the ledger has the batch now.
    assert!(claim.usable());
    assert_eq!(
        inner.submit("s", "b", &claim.content),
        mongotx::queue::Answer::Accepted
    );
    // The claim runs out while the answer (unknown) is on its way to the monitor.
    tokio::time::sleep((ttl + Duration::from_millis(300)).saturating_sub(claimed.elapsed())).await;
    release.send(()).unwrap();
    let changed = monitoring.await.unwrap();
    // The submitter records the acceptance.
    let recorded = batches.record(&claim, Submission::Accepted).await;
    let after = batches.get("b").await.unwrap();
    // Another submitter's round.
    let other = Submitter::new(batches.clone(), inner.clone(), "other", ttl);
    let again = other.run_once().await.unwrap();
    assert_eq!(
        inner.submissions(),
        1,
        "sent again while pending at the ledger: {again:?}"
    );
    assert!(
        changed.is_empty(),
        "recorded an answer asked while the claim was live: {changed:?}"
    );
    let recorded = recorded.expect("the submitter still holds its claim");
    assert_eq!(recorded.status, Some(BatchStatus::Pending));
    assert_eq!(
        (after.status, after.submitted),
        (Some(BatchStatus::Pending), true)
    );
}

/// Issue 47, case 10: a claim's deadline (an instant of the claimant's monotonic clock) comes
/// no later than its expiry by the server's clock, even when the claimant's estimate of that
/// clock lags (its `hello` replies take 600 ms on the way back: the estimate is up to 300 ms
/// behind).
#[tokio::test]
async fn a_claims_deadline_comes_before_its_expiry_by_the_servers_clock() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches.add(&NewBatch::new("s", "b", "x")).await.unwrap();
    let b = batches.get("b").await.unwrap();
    let slow = Tampered::start(&t).await;
    slow.link.slow_hello(600);
    let claimant = slow.batches().await;
    let ttl = Duration::from_secs(2);
    let claim = claimant
        .claim(&b, "lagging", ttl)
        .await
        .unwrap()
        .expect("b is free to claim");
    // When the server's clock reaches the stored expiry, by a direct estimate (this test's
    // link has no delay: its estimate is within a millisecond or two).
    let until = *raw(&t, "b")
        .await
        .get_document("claim")
        .unwrap()
        .get_datetime("until")
        .unwrap();
    let server_now = t.store.server_time().await.unwrap();
    let expires = std::time::Instant::now()
        + Duration::from_millis(
            (until.timestamp_millis() - server_now.timestamp_millis()).max(0) as u64,
        );
    let late = claim.deadline.saturating_duration_since(expires);
    assert!(
        late <= Duration::from_millis(25),
        "the claim's deadline is {late:?} after its expiry by the server's clock"
    );
}

/// The stored batch `header`.
async fn raw(t: &TestDb, header: &str) -> Document {
    t.db.collection::<Document>(BATCHES_COLLECTION)
        .find_one(doc! { "_id": header })
        .await
        .unwrap()
        .unwrap()
}

/// Issue 47, case 11: failovers between primaries whose clocks disagree. A claimant whose
/// estimate of the server's clock was sampled on a primary 1 s behind the current one (before a
/// failover) takes the slot for `y` until `until` (1.5 s by its estimate, 0.5 s by the current
/// primary's clock) and sends its claim, which is held on the way; its count of older batches is
/// answered. Meanwhile `x` appears with an earlier stamp (an add that drew its stamp before
/// `y`'s, whose insert arrived late), and once the current primary's clock has passed `until`,
/// another submitter finds `y` never claimed, judges the slot abandoned, takes it for `x` and
/// sends `x`. Then the held claim runs on a primary whose clock is 2 s behind, where `until`
/// has not passed, while its claimant is still inside its deadline. It must not land and be
/// sent: `y` would go while `x` is in flight, two batches of one service at the ledger.
#[tokio::test]
async fn a_late_claim_on_a_primary_whose_clock_is_behind_does_not_land_after_its_slot_was_freed() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    batches.add(&NewBatch::new("s", "y", "y")).await.unwrap();
    let y = batches.get("y").await.unwrap();
    let slow = Tampered::start(&t).await;
    slow.link.hello_behind(1_000);
    let (reached, release) = slow.link.hold_then_run_on(
        |command| {
            command_name(command) == "findAndModify"
                && target(command) == BATCHES_COLLECTION
                && command
                    .get_document("update")
                    .and_then(|u| u.get_document("$set"))
                    .is_ok_and(|set| set.contains_key("claim"))
        },
        -2_000,
    );
    // Its count of older batches, sent beside the claim, is answered.
    let counted = slow.link.replied(|command| {
        command_name(command) == "aggregate" && target(command) == BATCHES_COLLECTION
    });
    let claimant = slow.batches().await;
    let ledger = Ledger::new(Duration::from_secs(1), Faults::NONE, 11);
    let late = Submitter::new(
        claimant.clone(),
        ledger.clone(),
        "late",
        Duration::from_millis(1_500),
    );
    let claiming = tokio::spawn(async move {
        let claim = late.take(&y).await.unwrap();
        match claim {
            Some(claim) => late.send(&claim).await.unwrap(),
            None => None,
        }
    });
    reached.await.unwrap();
    counted.await.unwrap();
    let x_at = DateTime::from_millis(
        batches
            .get("y")
            .await
            .unwrap()
            .created_at
            .timestamp_millis()
            - 1,
    );
    t.db.collection::<Document>(BATCHES_COLLECTION)
        .insert_one(doc! {
            "_id": "x", "service_id": "s", "content": "x", "created_at": x_at, "submitted": false,
        })
        .await
        .unwrap();
    // The current primary's clock passes the taking's `until`.
    let until = *slot(&t, "s").await.get_datetime("until").unwrap();
    let left = until.timestamp_millis() - t.store.server_time().await.unwrap().timestamp_millis();
    tokio::time::sleep(Duration::from_millis((left + 100).max(0) as u64)).await;
    let other = Submitter::new(
        batches.clone(),
        ledger.clone(),
        "other",
        Duration::from_secs(5),
    );
    let x = batches.get("x").await.unwrap();
    let claim = other
        .take(&x)
        .await
        .unwrap()
        .expect("x takes the abandoned slot");
    other.send(&claim).await.unwrap().expect("x sent");
    // The failover; the held claim runs on the new primary.
    release.send(()).unwrap();
    let sent_late = claiming.await.unwrap();
    assert!(ledger.breaches().is_empty(), "{:?}", ledger.breaches());
    assert!(sent_late.is_none(), "y was sent: {sent_late:?}");
    // Both go, in order.
    let monitor = Monitor::new(batches.clone(), ledger.clone());
    let started = std::time::Instant::now();
    while ledger.committed().get("s").map_or(0, Vec::len) < 2 {
        assert!(started.elapsed() < Duration::from_secs(20), "stuck");
        other.run_once().await.unwrap();
        monitor.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ledger.breaches().is_empty(), "{:?}", ledger.breaches());
    assert_eq!(ledger.committed()["s"], vec!["x", "y"]);
}

/// Versions before 2026-11-28 freed a batch's slot, and moved the mark to it, when the ledger
/// said valid; a younger batch could then go. If the ledger later forgets the valid batch (it
/// says unknown), that batch is behind the mark and can never take the slot again: it goes
/// again as a new batch, after those added so far, instead of keeping its service busy for ever.
#[tokio::test]
async fn a_valid_batch_passed_under_an_older_version_and_then_forgotten_goes_again() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    for h in ["b1", "b2", "b3"] {
        batches.add(&NewBatch::new("s", h, h)).await.unwrap();
    }
    let (b1, b2) = (
        batches.get("b1").await.unwrap(),
        batches.get("b2").await.unwrap(),
    );
    // As the older version left it: b1 valid, b2 went after it and was committed, the slot
    // free and the mark at b2.
    set(
        &t,
        "b1",
        doc! { "status": "valid", "submitted": true, "last_submitted_at": b1.created_at },
    )
    .await;
    set(
        &t,
        "b2",
        doc! { "status": "committed", "submitted": true, "last_submitted_at": b2.created_at },
    )
    .await;
    set_service(
        &t,
        "s",
        doc! { "mark_at": b2.created_at, "mark_header": "b2" },
    )
    .await;
    // The ledger does not know b1 (it forgot it); the monitor records so.
    let ledger = Ledger::new(Duration::from_millis(5), Faults::NONE, 12);
    let monitor = Monitor::new(batches.clone(), ledger.clone());
    let changed = monitor.run_once().await.unwrap();
    assert!(
        changed
            .iter()
            .any(|b| b.header == "b1" && b.status == Some(BatchStatus::Unknown)),
        "{changed:?}"
    );
    let submitter = Submitter::new(
        batches.clone(),
        ledger.clone(),
        "me",
        Duration::from_secs(5),
    );
    let started = std::time::Instant::now();
    loop {
        let (b1, b3) = (
            batches.get("b1").await.unwrap(),
            batches.get("b3").await.unwrap(),
        );
        if b1.status == Some(BatchStatus::Committed) && b3.status == Some(BatchStatus::Committed) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "stuck: b1 {:?} submitted {}, b3 {:?} submitted {}",
            b1.status,
            b1.submitted,
            b3.status,
            b3.submitted
        );
        submitter.run_once().await.unwrap();
        monitor.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(ledger.breaches().is_empty(), "{:?}", ledger.breaches());
    assert_eq!(ledger.committed()["s"], vec!["b3", "b1"]);
    let (b1, b3) = (
        batches.get("b1").await.unwrap(),
        batches.get("b3").await.unwrap(),
    );
    assert!(b1.created_at > b3.created_at, "b1 stamped after b3");
}

/// What a step of the server's clock still does (docs/queue.md, Limits): a claimant whose
/// estimate of the server's clock was sampled before a failover to a primary 1 s ahead (its
/// estimate is 1 s behind the monitor's) holds a claim that, as the monitor sees it, expires 1 s
/// before the claimant's deadline. The monitor asks the ledger in that second, hears unknown
/// (nothing sent yet) and records it; the claimant, inside its deadline, sends; the batch is
/// taken and sent again. The same batch twice (a ledger that deduplicates by header takes it
/// once), and nothing else: no second batch of the service in flight, nothing out of order.
#[tokio::test]
async fn a_clock_step_between_a_claimant_and_a_monitor_sends_one_batch_twice_and_nothing_worse() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    for h in ["b1", "b2"] {
        batches.add(&NewBatch::new("s", h, h)).await.unwrap();
    }
    let behind = Tampered::start(&t).await;
    behind.link.hello_behind(1_000);
    let claimant_batches = behind.batches().await;
    let ledger = Ledger::new(Duration::from_millis(5), Faults::NONE, 14);
    let claimant = Submitter::new(
        claimant_batches,
        ledger.clone(),
        "behind",
        Duration::from_millis(1_500),
    );
    let b1 = batches.get("b1").await.unwrap();
    let claim = claimant
        .take(&b1)
        .await
        .unwrap()
        .expect("b1 is free to claim");
    let claimed = std::time::Instant::now();
    // Past the claim's expiry by the monitor's estimate, before the claimant's deadline.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let monitor = Monitor::new(batches.clone(), ledger.clone());
    let changed = monitor.run_once().await.unwrap();
    assert!(
        changed
            .iter()
            .any(|b| b.header == "b1" && b.status == Some(BatchStatus::Unknown)),
        "{changed:?}"
    );
    assert!(claim.usable(), "{:?} after the claim", claimed.elapsed());
    assert!(
        claimant.send(&claim).await.unwrap().is_none(),
        "sent, but the claim was no longer the batch's"
    );
    let other = Submitter::new(
        batches.clone(),
        ledger.clone(),
        "other",
        Duration::from_secs(5),
    );
    let started = std::time::Instant::now();
    while ledger.committed().get("s").map_or(0, Vec::len) < 2 {
        assert!(started.elapsed() < Duration::from_secs(10), "stuck");
        other.run_once().await.unwrap();
        monitor.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(ledger.repeats().len(), 1, "{:?}", ledger.repeats());
    assert!(
        ledger.repeats()[0].starts_with("b1 "),
        "{:?}",
        ledger.repeats()
    );
    assert!(ledger.breaches().is_empty(), "{:?}", ledger.breaches());
    assert_eq!(ledger.committed()["s"], vec!["b1", "b2"]);
}
