//! Quota races found by review (issue 47, cases 2 and 3), each played deterministically: the
//! wire proxy holds or drops one handle's commands while another handle acts in between.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bson::{Bson, Document};
use tokio::sync::Notify;

use crate::common::wire_proxy::{command_name, Action, Rules, WireProxy};
use crate::common::{self, raw_snapshot, TestDb};
use crate::quota_stripes::{check_stripes, stripe_hash};
use mongotx::collections::PROVIDERS_COLLECTION;
use mongotx::quota::{NewProvider, ProviderId, Quota, Request};
use mongotx::Store;

/// The first `count` request ids of consumer `c` whose hash `fits`.
fn ids(c: &str, count: usize, fits: impl Fn(u64) -> bool) -> Vec<String> {
    (0..)
        .map(|i| format!("r{i}"))
        .filter(|r| fits(stripe_hash(c, r)))
        .take(count)
        .collect()
}

/// Whether `value` holds an `$in` list of at least two values (a read of several stripes).
fn reads_several(value: &Bson) -> bool {
    match value {
        Bson::Document(d) => d.iter().any(|(k, v)| {
            (k == "$in" && v.as_array().is_some_and(|a| a.len() >= 2)) || reads_several(v)
        }),
        Bson::Array(a) => a.iter().any(reads_several),
        _ => false,
    }
}

fn on_providers(command: &Document) -> bool {
    command
        .get_str(command_name(command))
        .is_ok_and(|c| c == PROVIDERS_COLLECTION)
}

/// Drops the first `drops` updates of providers (the fast path's sends, so the handle falls
/// back to reading and deciding), then holds the first read of several stripes (the borrow's
/// reading) until `go` is notified.
struct DropThenHold {
    drops: usize,
    dropped: AtomicUsize,
    held: AtomicUsize,
    reached: Arc<Notify>,
    go: Arc<Notify>,
}

impl Rules for DropThenHold {
    fn command(&self, command: &mut Document) -> Action {
        if !on_providers(command) {
            return Action::Forward;
        }
        if command_name(command) == "update"
            && self.dropped.fetch_add(1, Ordering::SeqCst) < self.drops
        {
            return Action::Drop;
        }
        if command_name(command) == "aggregate"
            && self.dropped.load(Ordering::SeqCst) >= self.drops
            && reads_several(&Bson::Document(command.clone()))
            && self.held.fetch_add(1, Ordering::SeqCst) == 0
        {
            self.reached.notify_one();
            let go = Arc::clone(&self.go);
            return Action::After(Box::pin(async move { go.notified().await }));
        }
        Action::Forward
    }
}

/// Case 2: a consume that borrows share for its stripe while another handle splits that stripe.
/// The borrow reads the stripes after the split; the consume must not put its entry into the
/// stripe it addressed before the split (its hash now points to the new one), or a resend of
/// the same request finds nothing where it looks and takes a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_borrow_racing_a_split_keeps_the_entry_where_its_hash_points() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    let p = ProviderId::new("race", "units");
    quota.create(NewProvider::new(p.clone(), 64)).await.unwrap();
    // 16 + 16 entries by the hash's lowest bit: the 33rd consume splits stripe 0 into 0 and 1.
    let odd = ids("fill", 16, |h| h % 2 == 1);
    let even = ids("fill", 16 + 1 + 14 + 2, |h| h % 4 == 0);
    for r in odd.iter().chain(&even[..16]) {
        quota
            .consume(&Request::with_id("fill", r).take(p.clone(), 1))
            .await
            .unwrap();
    }
    // The split, then stripe 0 filled to 31 entries with 1 unit free.
    for r in &even[16..31] {
        quota
            .consume(&Request::with_id("fill", r).take(p.clone(), 1))
            .await
            .unwrap();
    }
    let stripes = raw_snapshot(&t.db, PROVIDERS_COLLECTION).await;
    let zero = stripes
        .iter()
        .find(|d| !d.get_document("_id").unwrap().contains_key("stripe"))
        .unwrap();
    assert_eq!(zero.get_array("held").unwrap().len(), 31, "{zero}");
    assert_eq!(zero.get_i64("available").unwrap(), 1, "{zero}");

    // X wants 5 in stripe 0, under a hash whose next bit sends it to stripe 2 after a split.
    let x = ids("x", 1, |h| h % 4 == 2).remove(0);
    let (reached, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let proxy = WireProxy::start(
        &common::server_uri(),
        DropThenHold {
            drops: 4,
            dropped: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            reached: Arc::clone(&reached),
            go: Arc::clone(&go),
        },
    )
    .await;
    let via_proxy = Quota::open(&Store::new(proxy.client().await.database(t.db.name())))
        .await
        .unwrap();
    // Learn the layout (one read) so that the borrow reads every stripe in one query.
    via_proxy.provider(p.clone()).await.unwrap();
    let request = Request::with_id("x", &x).take(p.clone(), 5);
    let consume = {
        let request = request.clone();
        tokio::spawn(async move { via_proxy.consume(&request).await })
    };
    reached.notified().await;
    // Meanwhile another handle fills stripe 0 and splits it into 0 and 2.
    for r in &even[31..33] {
        quota
            .consume(&Request::with_id("fill", r).take(p.clone(), 1))
            .await
            .unwrap();
    }
    assert!(check_stripes(&t, "race", 64).await >= 3, "stripe 0 split");
    go.notify_one();
    let first = consume.await.unwrap().unwrap();
    assert!(!first.replayed);
    check_stripes(&t, "race", 64).await;
    // The same request again (as the consume's own retry or a caller's would send it).
    let again = quota.consume(&request).await.unwrap();
    assert!(again.replayed, "one request held twice: {again:?}");
    let now = quota.provider(p.clone()).await.unwrap();
    assert_eq!(now.usage, 16 + 33 + 5);
    drop(proxy);
}

/// Gives each update of providers the next action of a script (then forwards).
struct Script(std::sync::Mutex<std::collections::VecDeque<Action>>);

impl Rules for Script {
    fn command(&self, command: &mut Document) -> Action {
        if !(on_providers(command) && command_name(command) == "update") {
            return Action::Forward;
        }
        self.0
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(Action::Forward)
    }
}

/// Case 3: one request sent by two processes under its id. The first process's copy lands
/// with its short deadline and its reply is lost; the second process's first copy is held in
/// the network (its deadline is much later) and its resend is told the request is applied. A
/// release after the first deadline must still remember the request until the held copy's
/// deadline, or the held copy, arriving after the release, takes the quota a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_still_in_flight_after_a_replay_cannot_take_again_after_a_release() {
    use mongotx::quota::QuotaOptions;
    use std::time::Duration;
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    let p = ProviderId::new("late", "units");
    quota.create(NewProvider::new(p.clone(), 10)).await.unwrap();
    let (deliver, held) = tokio::sync::oneshot::channel::<()>();
    let (delivered_tx, delivered) = tokio::sync::oneshot::channel::<Option<Document>>();
    let proxy = WireProxy::start(
        &common::server_uri(),
        Script(std::sync::Mutex::new(
            [
                Action::LoseReply,
                Action::Forward,
                Action::DeliverWhen(
                    Box::pin(async move {
                        let _ = held.await;
                    }),
                    delivered_tx,
                ),
            ]
            .into(),
        )),
    )
    .await;
    let store = Store::new(proxy.client().await.database(t.db.name()));
    let handle = |window: Duration| {
        let store = store.clone();
        async move {
            Quota::with_options(&store, QuotaOptions::default().send_window(window))
                .await
                .unwrap()
        }
    };
    let (short, long) = (
        handle(Duration::from_secs(1)).await,
        handle(Duration::from_secs(60)).await,
    );
    let request = Request::with_id("job", "r1").take(p.clone(), 5);
    // The first process: its copy lands, the reply is lost, its resend finds it applied.
    let first = short.consume(&request).await.unwrap();
    assert!(first.replayed, "{first:?}");
    // The second process: its first copy is held back, its resend finds it applied.
    let again = Request::with_id("job", "r1").take(p.clone(), 5);
    let second = long.consume(&again).await.unwrap();
    assert!(second.replayed, "{second:?}");
    // Past the first copy's deadline (1 s), well inside the held copy's (60 s).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let released = quota.release("job").await.unwrap();
    assert_eq!(released.returned, vec![(p.clone(), 5)]);
    deliver.send(()).unwrap();
    let reply = delivered.await.unwrap().expect("the held copy ran");
    assert_eq!(
        reply.get_i32("n").ok(),
        Some(0),
        "the held copy matched: {reply}"
    );
    let now = quota.provider(p.clone()).await.unwrap();
    assert_eq!(
        (now.usage, now.available),
        (0, 10),
        "a released request took the quota again: {now:?}"
    );
    drop(proxy);
}
