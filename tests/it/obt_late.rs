//! OBT writes delivered late, retried after an error, issued from a lost counter, and judged by
//! the clock of a new primary (issue 47, cases 12 to 14).
//!
//! A late copy is held back by the wire proxy at the moment the test arms it: the sender's
//! connection is cut at once (it sees a network error and sends again), and the held copy
//! reaches the server on a connection of its own when the test lets it go, after whatever the
//! test did meanwhile. The test then has the copy's reply, so nothing here waits on a timer
//! to know a late copy has run.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::wire_proxy::{command_name, writes_in, Action, Rules, WireProxy};
use crate::common::TestDb;
use bson::{doc, Document};
use futures::TryStreamExt;
use mongotx::collections::{OBTS_COLLECTION, TOKENS_COLLECTION};
use mongotx::obt::{Fence, MemoryFence, NewObt, Obt, ObtError, ObtOptions, Token};
use mongotx::{Store, Update};

/// What happens to the next write on the OBT collection once armed.
enum Plan {
    /// Cut the sender's connection and deliver the write when the test says so.
    Late(
        tokio::sync::oneshot::Receiver<()>,
        tokio::sync::oneshot::Sender<Option<Document>>,
    ),
    /// Cut the sender's connection; the write never runs.
    Drop,
    /// Run the write and cut the connection instead of relaying the reply.
    LoseReply,
}

/// Acts on the first write on the OBT collection after the test arms it; forwards everything
/// else (token issues, reads, other collections).
#[derive(Clone)]
struct NextWrite {
    armed: Arc<Mutex<Option<Plan>>>,
    held: Arc<Mutex<Vec<Document>>>,
}

impl Rules for NextWrite {
    fn command(&self, command: &mut Document) -> Action {
        let on_obts = writes_in(command).iter().any(|w| {
            matches!(
                command_name(w),
                "insert" | "update" | "delete" | "findAndModify" | "findandmodify"
            ) && w.get_str(command_name(w)).ok() == Some(OBTS_COLLECTION)
        });
        if !on_obts {
            return Action::Forward;
        }
        let plan = self.armed.lock().unwrap().take();
        match plan {
            None => Action::Forward,
            Some(plan) => {
                self.held.lock().unwrap().push(command.clone());
                match plan {
                    Plan::Late(go, done) => Action::DeliverWhen(
                        Box::pin(async move {
                            let _ = go.await;
                        }),
                        done,
                    ),
                    Plan::Drop => Action::Drop,
                    Plan::LoseReply => Action::LoseReply,
                }
            }
        }
    }
}

/// A write held back by [`NextWrite`], delivered by [`Late::deliver`].
struct Late {
    go: tokio::sync::oneshot::Sender<()>,
    done: tokio::sync::oneshot::Receiver<Option<Document>>,
}

impl Late {
    /// Lets the held copy go and returns the server's reply to it.
    async fn deliver(self) -> Document {
        self.go.send(()).expect("the held copy's task is waiting");
        tokio::time::timeout(Duration::from_secs(30), self.done)
            .await
            .expect("the late copy was delivered within 30 s")
            .expect("the proxy held a copy")
            .expect("the server answered the late copy")
    }
}

/// The OBTs of `t`'s database behind a proxy whose next OBT write a test can hold back, drop, or
/// lose the reply of.
struct Proxied {
    obt: Obt,
    rules: NextWrite,
    _proxy: WireProxy,
}

impl Proxied {
    async fn new(t: &TestDb) -> Proxied {
        let rules = NextWrite {
            armed: Arc::new(Mutex::new(None)),
            held: Arc::new(Mutex::new(Vec::new())),
        };
        let proxy = WireProxy::start(&common::server_uri(), rules.clone()).await;
        let store = Store::new(proxy.client().await.database(t.db.name()));
        Proxied {
            obt: Obt::open(&store).await.unwrap(),
            rules,
            _proxy: proxy,
        }
    }

    /// Holds back the next OBT write until [`Late::deliver`].
    fn hold_next(&self) -> Late {
        let (go_tx, go_rx) = tokio::sync::oneshot::channel();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        *self.rules.armed.lock().unwrap() = Some(Plan::Late(go_rx, done_tx));
        Late {
            go: go_tx,
            done: done_rx,
        }
    }

    fn arm(&self, plan: Plan) {
        *self.rules.armed.lock().unwrap() = Some(plan);
    }

    /// The commands held (or dropped, or whose reply was lost) so far.
    fn held(&self) -> usize {
        self.rules.held.lock().unwrap().len()
    }
}

/// Whether the server refused `reply`'s write as a duplicate id: a late create that found the id
/// taken (live, or released with a token at least its own).
fn collided(reply: &Document) -> bool {
    let code = |d: &Document| match d.get("code") {
        Some(bson::Bson::Int32(c)) => i64::from(*c),
        Some(bson::Bson::Int64(c)) => *c,
        _ => 0,
    };
    code(reply) == 11000
        || reply.get_array("writeErrors").is_ok_and(|errors| {
            errors
                .iter()
                .filter_map(bson::Bson::as_document)
                .any(|e| code(e) == 11000)
        })
}

/// A plain repository the owned transactions write to.
async fn volumes(store: &Store) -> mongotx::Repository<Document> {
    let spec = mongotx::CollectionSpec::new(
        "volumes",
        1,
        r#"{"bsonType":"object","required":["_id","_schema","_version"],"properties":{
            "_id":{"bsonType":"string"},"_schema":{"bsonType":"long"},"_version":{"bsonType":"long"},
            "_txn":{"bsonType":"objectId"},"_hold":{"bsonType":"object"},"_deleted":{"bsonType":"date"},
            "_deleting":{"bsonType":"bool"},"status":{"bsonType":"string"}}}"#,
    )
    .unwrap();
    store.repository::<Document>(spec).await.unwrap()
}

fn lost(result: Result<impl std::fmt::Debug, ObtError>, what: &str) {
    match result {
        Err(e) if e.is_lost_ownership() && !e.is_retryable() => {}
        other => panic!("{what}: expected lost ownership, got {other:?}"),
    }
}

/// Case 12 as the review reproduced it: A's create is cut and its first copy delivered after B
/// preempted and released the OBT. The copy must bring nothing back: no OBT, the id's token
/// never lower than B's, and A's owned commit, heartbeat and release refused. Then the same
/// with A releasing the OBT itself before its create's first copy arrives.
#[tokio::test]
async fn a_create_delivered_late_after_a_preempt_and_release_brings_nothing_back() {
    let t = TestDb::new().await;
    let direct = Obt::open(&t.store).await.unwrap();
    let a = Proxied::new(&t).await;
    let vols = volumes(&t.store).await;
    vols.insert(&doc! { "_id": "vol1", "status": "free" })
        .await
        .unwrap();

    let late = a.hold_next();
    let mut owned = a.obt.create(NewObt::new("vol1", "A")).await.unwrap();
    assert_eq!(a.held(), 1, "the create's first copy is held back");
    let b = direct.preempt("vol1", "A", "B").await.unwrap();
    assert!(b.token > owned.token);
    direct.release_owned(&b).await.unwrap();

    let reply = late.deliver().await;
    let now = direct.get("vol1").await;
    assert!(
        matches!(now, Err(ObtError::NotFound { .. })),
        "the late create (reply {reply}) brought the OBT back: {now:?}"
    );
    assert!(collided(&reply), "the late create collided: {reply}");
    let volume = vols.get("vol1").await.unwrap();
    let txns = mongotx::Transactions::new(&t.store);
    let tx = txns.begin();
    tx.update(
        &vols,
        "vol1",
        volume.version,
        &Update::new().set("status", "attached-by-A"),
    )
    .await
    .unwrap();
    lost(a.obt.commit_owned(tx, &owned).await, "A's owned commit");
    assert_eq!(
        vols.get("vol1").await.unwrap().value.get_str("status"),
        Ok("free"),
        "nothing of A's was written"
    );
    lost(a.obt.heartbeat(&mut owned).await, "A's heartbeat");
    lost(a.obt.release_owned(&owned).await, "A's release");
    let again = direct.create(NewObt::new("vol1", "C")).await.unwrap();
    assert!(
        again.token > b.token,
        "the id's token never goes back: {} after {}",
        again.token,
        b.token
    );

    // A's own release, then its create's first copy.
    let late = a.hold_next();
    let owned = a.obt.create(NewObt::new("vol2", "A")).await.unwrap();
    a.obt.release_owned(&owned).await.unwrap();
    let reply = late.deliver().await;
    let now = direct.get("vol2").await;
    assert!(
        matches!(now, Err(ObtError::NotFound { .. })),
        "the late create (reply {reply}) brought vol2 back: {now:?}"
    );
    assert!(collided(&reply), "the late create collided: {reply}");
    let again = direct.create(NewObt::new("vol2", "A")).await.unwrap();
    assert!(again.token > owned.token);
}

/// The GC keeps a released OBT's tombstone whatever its retention (it is the id's last token),
/// so a create delivered after GC rounds still collides with it, while the other collections'
/// tombstones are purged as before.
#[tokio::test]
async fn the_gc_never_purges_a_released_obts_tombstone() {
    let t = TestDb::new().await;
    let direct = Obt::open(&t.store).await.unwrap();
    let a = Proxied::new(&t).await;
    let vols = volumes(&t.store).await;
    vols.insert(&doc! { "_id": "gone", "status": "free" })
        .await
        .unwrap();
    vols.delete("gone", 1).await.unwrap();
    let late = a.hold_next();
    let owned = a.obt.create(NewObt::new("v", "A")).await.unwrap();
    let b = direct.preempt("v", "A", "B").await.unwrap();
    direct.release_owned(&b).await.unwrap();
    let gc = mongotx::gc::Gc::new(
        &t.store,
        mongotx::gc::GcOptions::default().tombstone_retention(Some(Duration::ZERO)),
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let round = gc.run_round().await.unwrap();
    assert_eq!(round.purged, 1, "the volume's tombstone only: {round:?}");
    let kept =
        t.db.collection::<Document>(OBTS_COLLECTION)
            .find_one(doc! { "_id": "v" })
            .await
            .unwrap()
            .expect("the OBT's tombstone is kept");
    assert_eq!(kept.get_i64("token"), Ok(b.token.get()));
    let reply = late.deliver().await;
    assert!(collided(&reply), "the late create collided: {reply}");
    assert!(matches!(
        direct.get("v").await,
        Err(ObtError::NotFound { .. })
    ));
    lost(a.obt.release_owned(&owned).await, "A's release");
}

/// A preemption whose first copy arrives after the new owner released the OBT and the old owner
/// created it again (same owner name as the copy names): the copy's token is lower than the
/// OBT's, so it changes nothing.
#[tokio::test]
async fn a_preempt_delivered_late_changes_nothing() {
    let t = TestDb::new().await;
    let direct = Obt::open(&t.store).await.unwrap();
    let b = Proxied::new(&t).await;
    direct.create(NewObt::new("v", "A")).await.unwrap();
    let late = b.hold_next();
    let owned = b.obt.preempt("v", "A", "B").await.unwrap();
    assert_eq!(b.held(), 1);
    b.obt.release_owned(&owned).await.unwrap();
    let again = direct.create(NewObt::new("v", "A")).await.unwrap();
    let before = direct.get("v").await.unwrap();
    late.deliver().await;
    assert_eq!(direct.get("v").await.unwrap(), before, "untouched");

    // Delivered onto the released OBT: still released.
    direct.release_owned(&again).await.unwrap();
    let late = b.hold_next();
    let c = direct.create(NewObt::new("w", "A")).await.unwrap();
    let owned = b.obt.preempt("w", "A", "B").await.unwrap();
    direct.release("w", "B").await.unwrap();
    late.deliver().await;
    assert!(matches!(
        direct.get("w").await,
        Err(ObtError::NotFound { .. })
    ));
    assert!(owned.token > c.token);
}

/// A release whose first copy arrives after its owner created the OBT again: the copy names the
/// old token, so the new OBT stays.
#[tokio::test]
async fn a_release_delivered_late_leaves_a_later_obt_alone() {
    let t = TestDb::new().await;
    let direct = Obt::open(&t.store).await.unwrap();
    let a = Proxied::new(&t).await;
    let first = a.obt.create(NewObt::new("v", "A")).await.unwrap();
    let late = a.hold_next();
    a.obt.release_owned(&first).await.unwrap();
    assert_eq!(a.held(), 1);
    let second = a.obt.create(NewObt::new("v", "A")).await.unwrap();
    let before = direct.get("v").await.unwrap();
    late.deliver().await;
    let after = direct.get("v").await.unwrap();
    assert_eq!(after, before, "the later OBT is untouched");
    assert_eq!((after.owner.as_str(), after.token), ("A", second.token));
}

/// A heartbeat whose first copy arrives after a preemption: it names the old token, so the new
/// owner's OBT is not renewed or changed.
#[tokio::test]
async fn a_heartbeat_delivered_late_renews_only_the_ownership_it_names() {
    let t = TestDb::new().await;
    let direct = Obt::open(&t.store).await.unwrap();
    let a = Proxied::new(&t).await;
    let mut owned = a
        .obt
        .create(NewObt::new("v", "A").lease(Duration::from_secs(30)))
        .await
        .unwrap();
    let late = a.hold_next();
    a.obt.heartbeat(&mut owned).await.unwrap();
    assert_eq!(a.held(), 1);
    direct.preempt("v", "A", "B").await.unwrap();
    let before = direct.get("v").await.unwrap();
    late.deliver().await;
    assert_eq!(direct.get("v").await.unwrap(), before, "untouched");
    lost(a.obt.heartbeat(&mut owned).await, "A's heartbeat");
}

/// Case 14, the counter: deleted, or restored from an old backup, it must not hand out a token
/// at or below one an OBT holds (equal tokens pass a fence).
#[tokio::test]
async fn a_counter_lost_or_restored_from_an_old_backup_issues_above_every_stored_token() {
    let t = TestDb::new().await;
    let obt = Obt::open(&t.store).await.unwrap();
    let counters = t.db.collection::<Document>(TOKENS_COLLECTION);
    let a = obt.create(NewObt::new("a", "o")).await.unwrap();
    let backup = counters
        .find_one(doc! { "_id": OBTS_COLLECTION })
        .await
        .unwrap()
        .expect("the counter");
    obt.create(NewObt::new("b", "o")).await.unwrap();
    let b = obt.preempt("b", "o", "p").await.unwrap();
    let released = obt.create(NewObt::new("r", "o")).await.unwrap();
    obt.release_owned(&released).await.unwrap();
    let highest = released.token.max(b.token).max(a.token);
    let node = MemoryFence::new();
    node.admit("vol", b.token).await.unwrap();

    // Restored from the backup taken after the first create.
    counters
        .replace_one(doc! { "_id": OBTS_COLLECTION }, backup)
        .await
        .unwrap();
    let c = obt.create(NewObt::new("c", "o")).await.unwrap();
    assert!(
        c.token > highest,
        "a restored counter issued {} though {highest} is stored",
        c.token
    );
    let d = obt.create(NewObt::new("d", "o")).await.unwrap();
    assert!(d.token > c.token);
    assert!(
        node.admit("vol", d.token).await.is_ok() && node.admit("vol", b.token).await.is_err(),
        "the fence tells the owners apart"
    );
    let highest = d.token;

    // Deleted.
    counters
        .delete_one(doc! { "_id": OBTS_COLLECTION })
        .await
        .unwrap();
    let e = obt.issue_token().await.unwrap();
    assert!(
        e > highest,
        "a new counter issued {e} though {highest} is stored"
    );
    counters
        .delete_one(doc! { "_id": OBTS_COLLECTION })
        .await
        .unwrap();
    let p = obt.preempt("d", "o", "q").await.unwrap();
    assert!(p.token > highest);
    counters
        .delete_one(doc! { "_id": OBTS_COLLECTION })
        .await
        .unwrap();
    let r = obt.create(NewObt::new("r", "o")).await.unwrap();
    assert!(
        r.token > p.token,
        "the released id's tombstone and the other OBTs floor the counter"
    );
    let all: Vec<Token> =
        t.db.collection::<Document>(OBTS_COLLECTION)
            .find(doc! {})
            .await
            .unwrap()
            .try_collect::<Vec<_>>()
            .await
            .unwrap()
            .iter()
            .map(|d| Token(d.get_i64("token").unwrap()))
            .collect();
    let mut unique = all.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), all.len(), "no token stored twice: {all:?}");
}

/// Case 14, the release: a release whose first send fails must not report success to an owner
/// that had already lost the OBT (preempted, and the OBT released by the new owner), by token
/// or by name; one whose reply was lost after it landed reports success.
#[tokio::test]
async fn a_release_retried_after_an_error_tells_a_lost_obt_from_its_own_release() {
    let t = TestDb::new().await;
    let direct = Obt::open(&t.store).await.unwrap();
    let a = Proxied::new(&t).await;

    let owned = a.obt.create(NewObt::new("v", "A")).await.unwrap();
    let b = direct.preempt("v", "A", "B").await.unwrap();
    direct.release_owned(&b).await.unwrap();
    a.arm(Plan::Drop);
    lost(
        a.obt.release_owned(&owned).await,
        "release_owned of a lost OBT",
    );
    assert_eq!(a.held(), 1, "the first send was dropped");

    a.obt.create(NewObt::new("w", "A")).await.unwrap();
    direct.preempt("w", "A", "B").await.unwrap();
    direct.release("w", "B").await.unwrap();
    a.arm(Plan::Drop);
    lost(a.obt.release("w", "A").await, "release of a lost OBT");
    assert_eq!(a.held(), 2);

    // Its own release, whose reply was lost: success, once.
    let owned = a.obt.create(NewObt::new("x", "A")).await.unwrap();
    a.arm(Plan::LoseReply);
    a.obt.release_owned(&owned).await.unwrap();
    assert_eq!(a.held(), 3);
    assert!(matches!(
        direct.get("x").await,
        Err(ObtError::NotFound { .. })
    ));
    lost(a.obt.release_owned(&owned).await, "a second release");
    a.obt.create(NewObt::new("y", "A")).await.unwrap();
    a.arm(Plan::LoseReply);
    a.obt.release("y", "A").await.unwrap();
    assert_eq!(a.held(), 4);
    lost(a.obt.release("y", "A").await, "a second release by name");
}

/// The OBT collection's documents and token counter of `from`, copied to `to`: what a new primary
/// has when the old one steps down.
async fn replicate(from: &mongodb::Database, to: &mongodb::Database) {
    for name in [OBTS_COLLECTION, TOKENS_COLLECTION] {
        let docs: Vec<Document> = from
            .collection::<Document>(name)
            .find(doc! {})
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        let target = to.collection::<Document>(name);
        target.delete_many(doc! {}).await.unwrap();
        if !docs.is_empty() {
            target.insert_many(docs).await.unwrap();
        }
    }
}

/// Case 13: `take_over_expired` compares the last heartbeat's stamp, made by the primary of the
/// time, with the clock of the primary of now. After a failover to a primary whose clock is `d`
/// ahead, an owner silent for `s` is taken over once `s + d` reaches its lease: a forward step
/// of `d` shortens a live owner's lease by `d`. Its token still fences it. A contender whose
/// `clock_slack` covers the step waits the whole lease.
#[tokio::test]
async fn a_failover_to_a_primary_whose_clock_is_ahead_shortens_the_lease_by_the_step() {
    const LEASE: Duration = Duration::from_secs(10);
    const STEP: Duration = Duration::from_secs(6);
    let t = TestDb::new().await;
    let ahead = tokio::task::spawn_blocking(|| {
        mongotx::testkit::local_server::LocalServer::start_with(&[
            "--clock-offset".to_string(),
            format!("*=+{}s", STEP.as_secs()),
        ])
    })
    .await
    .expect("join")
    .expect("a local test server whose clocks run STEP ahead");
    let client = mongodb::Client::with_uri_str(ahead.uri()).await.unwrap();
    let new_db = client.database(t.db.name());
    let new_store = Store::new(new_db.clone());

    // The owner works on the old primary, and heartbeats.
    let old = Obt::open(&t.store).await.unwrap();
    let mut owned = old
        .create(NewObt::new("vol", "A").lease(LEASE))
        .await
        .unwrap();
    let beat = Instant::now();
    old.heartbeat(&mut owned).await.unwrap();

    // Failover: the new primary has the same documents and a clock STEP ahead.
    let new = Obt::open(&new_store).await.unwrap();
    let careful = Obt::with_options(&new_store, ObtOptions::default().clock_slack(STEP))
        .await
        .unwrap();
    replicate(&t.db, &new_db).await;
    let owner_on_new = Obt::open(&new_store).await.unwrap();

    // Silent 1 s: 7 s by the new primary's clock, still under the lease.
    tokio::time::sleep_until((beat + Duration::from_secs(1)).into()).await;
    assert!(matches!(
        new.take_over_expired("vol", "C").await,
        Err(ObtError::LeaseLive { .. })
    ));
    // Silent 6 s: 12 s by the new primary's clock, past the lease. The careful contender's
    // slack covers the step; the other takes a live owner over with 4 s of its lease left.
    tokio::time::sleep_until((beat + Duration::from_secs(6)).into()).await;
    assert!(matches!(
        careful.take_over_expired("vol", "C").await,
        Err(ObtError::LeaseLive { .. })
    ));
    let left = owned.lease_left().expect("a lease");
    let taken = new.take_over_expired("vol", "C").await.unwrap();
    assert!(
        left > LEASE - STEP - Duration::from_millis(1_500) && left <= LEASE - STEP,
        "taken over with {left:?} of the owner's lease left"
    );
    assert!(taken.token > owned.token);
    // The token fences the owner all the same.
    lost(owner_on_new.heartbeat(&mut owned).await, "A's heartbeat");
    let fence = MemoryFence::new();
    fence.admit("vol", taken.token).await.unwrap();
    assert!(fence.admit("vol", owned.token).await.is_err());

    drop(ahead);
}
