//! The quota module against a real server: providers and limits, consume and release, the
//! single-write fast path, all-or-nothing claims, hierarchies, reservations and the GC sweep,
//! and typed refusals of bad input that leave the database untouched.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{raw_snapshot, TestDb};
use bson::Document;
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use mongodb::options::ClientOptions;
use mongodb::Client;
use mongotx::collections::PROVIDERS_COLLECTION;
use mongotx::quota::{NewProvider, ProviderId, Quota, QuotaError, Request, Reservation};
use mongotx::Store;

fn cores(scope: &str) -> ProviderId {
    ProviderId::new(scope, "cores")
}

async fn providers(t: &TestDb) -> Vec<Document> {
    raw_snapshot(&t.db, PROVIDERS_COLLECTION).await
}

/// Checks every provider's stored bookkeeping: usage is the sum of its entries, available is
/// limit - usage, nothing is held by a transaction.
pub(crate) async fn assert_books_balance(t: &TestDb) {
    for doc in providers(t).await {
        let held: i64 = doc
            .get_array("held")
            .expect("held")
            .iter()
            .map(|e| e.as_document().expect("entry").get_i64("n").expect("n"))
            .sum();
        let usage = doc.get_i64("usage").expect("usage");
        assert_eq!(usage, held, "usage is the sum of the entries: {doc}");
        assert_eq!(
            doc.get_i64("available").expect("available"),
            doc.get_i64("limit").expect("limit") - usage,
            "{doc}"
        );
        assert!(!doc.contains_key("_txn"), "left held: {doc}");
    }
}

#[tokio::test]
async fn providers_limits_generations_and_usage_by_scope() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    let created = quota
        .create(NewProvider::new(cores("project/42"), 10))
        .await
        .unwrap();
    assert_eq!(
        (created.limit, created.usage, created.available),
        (10, 0, 10)
    );
    quota
        .create(NewProvider::new(("project/42", "ram"), 4096))
        .await
        .unwrap();
    quota
        .create(NewProvider::new(cores("project/7"), 3))
        .await
        .unwrap();
    assert!(matches!(
        quota
            .create(NewProvider::new(cores("project/42"), 99))
            .await,
        Err(QuotaError::ProviderExists { .. })
    ));

    let g0 = quota
        .provider(cores("project/42"))
        .await
        .unwrap()
        .generation;
    quota
        .consume(&Request::new("vm-1").take(cores("project/42"), 8))
        .await
        .unwrap();
    let after = quota.provider(cores("project/42")).await.unwrap();
    assert_eq!((after.usage, after.available), (8, 2));
    assert_eq!(
        after.generation,
        g0 + 1,
        "every change bumps the generation"
    );
    assert_eq!(after.allocations.len(), 1);
    assert_eq!(after.allocations[0].consumer, "vm-1");

    // Lowering the limit below usage is allowed and only blocks new consumption.
    let lowered = quota.set_limit(cores("project/42"), 5).await.unwrap();
    assert_eq!(
        (lowered.limit, lowered.usage, lowered.available),
        (5, 8, -3)
    );
    assert_eq!(lowered.generation, g0 + 2);
    match quota
        .consume(&Request::new("vm-2").take(cores("project/42"), 1))
        .await
    {
        Err(QuotaError::QuotaExceeded { refusals, .. }) => {
            assert_eq!(
                (
                    refusals[0].requested,
                    refusals[0].available,
                    refusals[0].limit
                ),
                (1, -3, 5)
            );
        }
        other => panic!("expected QuotaExceeded, got {other:?}"),
    }
    quota.release("vm-1").await.unwrap();
    quota
        .consume(&Request::new("vm-2").take(cores("project/42"), 5))
        .await
        .unwrap();

    let scope = quota.usage("project/42").await.unwrap();
    let listed: Vec<(&str, i64, i64)> = scope
        .iter()
        .map(|p| (p.id.resource.as_str(), p.limit, p.usage))
        .collect();
    assert_eq!(listed, vec![("cores", 5, 5), ("ram", 4096, 0)]);
    assert_books_balance(&t).await;
}

/// A quota handle whose client records the name of every command it sends.
pub(crate) async fn watched(t: &TestDb) -> (Quota, Arc<Mutex<Vec<String>>>) {
    let commands = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = Arc::clone(&commands);
    let mut options = ClientOptions::parse(common::server_uri()).await.unwrap();
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(started) = event {
            if !matches!(
                started.command_name.as_str(),
                "hello" | "isMaster" | "ismaster"
            ) {
                seen.lock().unwrap().push(started.command_name.clone());
            }
        }
    }));
    let client = Client::with_options(options).unwrap();
    let quota = Quota::open(&Store::new(client.database(t.db.name())))
        .await
        .unwrap();
    (quota, commands)
}

#[tokio::test]
async fn a_single_provider_consume_is_one_command_on_the_wire() {
    let t = TestDb::new().await;
    let (quota, commands) = watched(&t).await;
    quota
        .create(NewProvider::new(cores("p"), 100))
        .await
        .unwrap();
    // The server clock is sampled once per handle; take that sample out of the count.
    quota
        .consume(&Request::new("warm-up").take(cores("p"), 1))
        .await
        .unwrap();
    for i in 0..5 {
        commands.lock().unwrap().clear();
        let consumed = quota
            .consume(&Request::new(format!("c{i}")).take(cores("p"), 2))
            .await
            .unwrap();
        assert_eq!(consumed.writes, 1);
        assert_eq!(
            *commands.lock().unwrap(),
            vec!["update".to_string()],
            "one conditional update and nothing else"
        );
    }
    // Returning them: one read to learn the amounts, one update conditioned on those entries.
    for i in 0..5 {
        commands.lock().unwrap().clear();
        let released = quota.release(&format!("c{i}")).await.unwrap();
        assert_eq!(released.returned, vec![(cores("p"), 2)]);
        assert_eq!(
            *commands.lock().unwrap(),
            vec!["find".to_string(), "update".to_string()],
            "one read and one conditional update"
        );
    }
    assert_eq!(quota.provider(cores("p")).await.unwrap().usage, 1);
}

#[tokio::test]
async fn two_consumers_race_for_the_last_units_and_exactly_one_wins() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    for round in 0..20 {
        let id = cores(&format!("race/{round}"));
        quota
            .create(NewProvider::new(id.clone(), 10))
            .await
            .unwrap();
        let (ra, rb) = (
            Request::new("a").take(id.clone(), 6),
            Request::new("b").take(id.clone(), 6),
        );
        let (a, b) = tokio::join!(quota.consume(&ra), quota.consume(&rb));
        let wins = [&a, &b].iter().filter(|r| r.is_ok()).count();
        assert_eq!(wins, 1, "round {round}: {a:?} / {b:?}");
        for r in [a, b] {
            if let Err(e) = r {
                assert!(matches!(e, QuotaError::QuotaExceeded { .. }), "{e}");
            }
        }
        assert_eq!(quota.provider(id).await.unwrap().usage, 6);
    }
    assert_books_balance(&t).await;
}

#[tokio::test]
async fn a_claim_on_three_resources_that_fails_on_one_leaves_the_others_untouched() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    for (resource, limit) in [("cores", 8), ("ram", 1024), ("disk", 50)] {
        quota
            .create(NewProvider::new(("p", resource), limit))
            .await
            .unwrap();
    }
    let before = providers(&t).await;
    let request = Request::new("vm")
        .take(("p", "cores"), 4)
        .take(("p", "ram"), 512)
        .take(("p", "disk"), 80);
    match quota.consume(&request).await {
        Err(QuotaError::QuotaExceeded { refusals, .. }) => {
            assert_eq!(refusals.len(), 1);
            assert_eq!(refusals[0].provider, ProviderId::new("p", "disk"));
            assert_eq!(
                (
                    refusals[0].requested,
                    refusals[0].available,
                    refusals[0].limit
                ),
                (80, 50, 50)
            );
        }
        other => panic!("expected QuotaExceeded on disk, got {other:?}"),
    }
    assert_eq!(providers(&t).await, before, "nothing was written");

    let fits = Request::new("vm")
        .take(("p", "cores"), 4)
        .take(("p", "ram"), 512)
        .take(("p", "disk"), 50);
    let consumed = quota.consume(&fits).await.unwrap();
    assert!(!consumed.replayed);
    assert!(quota.consume(&fits).await.unwrap().replayed);
    for (resource, usage) in [("cores", 4), ("ram", 512), ("disk", 50)] {
        assert_eq!(quota.provider(("p", resource)).await.unwrap().usage, usage);
    }
    let released = quota.release("vm").await.unwrap();
    assert_eq!(released.returned.len(), 3);
    assert!(matches!(
        quota.release("vm").await,
        Err(QuotaError::UnknownConsumer { .. })
    ));
    for resource in ["cores", "ram", "disk"] {
        assert_eq!(quota.provider(("p", resource)).await.unwrap().usage, 0);
    }
    assert_books_balance(&t).await;
}

#[tokio::test]
async fn a_child_consumes_from_its_ancestors_and_is_stopped_by_their_limits() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    quota
        .create(NewProvider::new(cores("domain"), 10))
        .await
        .unwrap();
    quota
        .create(NewProvider::new(cores("project/a"), 8).parent(cores("domain")))
        .await
        .unwrap();
    quota
        .create(NewProvider::new(cores("project/b"), 8).parent(cores("domain")))
        .await
        .unwrap();
    quota
        .create(NewProvider::new(cores("team/x"), 100).parent(cores("project/a")))
        .await
        .unwrap();
    assert!(matches!(
        quota
            .create(NewProvider::new(cores("orphan"), 1).parent(cores("nowhere")))
            .await,
        Err(QuotaError::UnknownProvider { .. })
    ));

    quota
        .consume(&Request::new("a1").take(cores("team/x"), 6))
        .await
        .unwrap();
    for (scope, usage) in [
        ("team/x", 6),
        ("project/a", 6),
        ("domain", 6),
        ("project/b", 0),
    ] {
        assert_eq!(
            quota.provider(cores(scope)).await.unwrap().usage,
            usage,
            "{scope}"
        );
    }
    // project/b has room for 5 but the domain only for 4.
    let before = providers(&t).await;
    match quota
        .consume(&Request::new("b1").take(cores("project/b"), 5))
        .await
    {
        Err(QuotaError::QuotaExceeded { refusals, .. }) => {
            assert_eq!(refusals.len(), 1);
            assert_eq!(refusals[0].provider, cores("domain"));
            assert_eq!((refusals[0].requested, refusals[0].available), (5, 4));
        }
        other => panic!("expected the domain to refuse, got {other:?}"),
    }
    assert_eq!(providers(&t).await, before, "nothing was written");
    quota
        .consume(&Request::new("b1").take(cores("project/b"), 4))
        .await
        .unwrap();
    let released = quota.release("a1").await.unwrap();
    assert_eq!(released.returned.len(), 3, "{released:?}");
    assert!(released.returned.iter().all(|(_, n)| *n == 6));
    for (scope, usage) in [
        ("team/x", 0),
        ("project/a", 0),
        ("domain", 4),
        ("project/b", 4),
    ] {
        assert_eq!(
            quota.provider(cores(scope)).await.unwrap().usage,
            usage,
            "{scope}"
        );
    }
    assert_books_balance(&t).await;
}

#[tokio::test]
async fn reservations_confirm_cancel_and_expire_through_the_gc_sweep() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    quota
        .create(NewProvider::new(cores("domain"), 10))
        .await
        .unwrap();
    quota
        .create(NewProvider::new(cores("project"), 10).parent(cores("domain")))
        .await
        .unwrap();

    let confirmed = quota
        .reserve(
            &Request::new("vm-1").take(cores("project"), 3),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    let p = quota.provider(cores("project")).await.unwrap();
    assert_eq!((p.usage, p.reserved), (3, 3));
    quota.confirm(&confirmed).await.unwrap();
    quota.confirm(&confirmed).await.unwrap();
    let p = quota.provider(cores("project")).await.unwrap();
    assert_eq!((p.usage, p.reserved), (3, 0));

    let cancelled = quota
        .reserve(
            &Request::new("vm-2").take(cores("project"), 2),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(quota.cancel(&cancelled).await.unwrap().returned.len(), 2);
    assert!(matches!(
        quota.cancel(&cancelled).await,
        Err(QuotaError::UnknownReservation { .. })
    ));

    let request = Request::new("vm-3").take(cores("project"), 4);
    let lapsing = quota
        .reserve(&request, Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!(
        quota
            .reserve(&request, Duration::from_millis(300))
            .await
            .unwrap(),
        lapsing,
        "reserving the same request again returns the same reservation"
    );
    assert_eq!(quota.provider(cores("domain")).await.unwrap().usage, 7);
    tokio::time::sleep(Duration::from_millis(600)).await;
    // Expired but not yet swept: confirming is refused and changes nothing; usage still counts
    // it, because only the GC returns it.
    let before = providers(&t).await;
    assert!(matches!(
        quota.confirm(&lapsing).await,
        Err(QuotaError::ReservationExpired { .. })
    ));
    assert_eq!(providers(&t).await, before);
    assert_eq!(quota.provider(cores("domain")).await.unwrap().usage, 7);

    let swept = quota.sweep().await.unwrap();
    assert_eq!(swept.expired, 1);
    for scope in ["domain", "project"] {
        let p = quota.provider(cores(scope)).await.unwrap();
        assert_eq!((p.usage, p.reserved), (3, 0), "{scope}");
    }
    assert!(matches!(
        quota.confirm(&lapsing).await,
        Err(QuotaError::ReservationExpired { .. })
    ));
    assert_eq!(quota.sweep().await.unwrap().expired, 0);
    assert_books_balance(&t).await;
}

#[tokio::test]
async fn bad_input_is_a_typed_error_and_writes_nothing() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    quota
        .create(NewProvider::new(cores("p"), 10))
        .await
        .unwrap();
    quota
        .create(NewProvider::new(cores("q"), 10))
        .await
        .unwrap();
    quota
        .consume(&Request::new("holder").take(cores("p"), 1))
        .await
        .unwrap();
    let before = providers(&t).await;

    let far = chrono::Utc::now() + chrono::Duration::days(36_500);
    let cases: Vec<(&str, Result<(), QuotaError>)> = vec![
        (
            "unknown provider",
            quota
                .consume(&Request::new("c").take(cores("p"), 1).take(cores("nope"), 1))
                .await
                .map(drop),
        ),
        (
            "zero amount",
            quota
                .consume(&Request::new("c").take(cores("p"), 0))
                .await
                .map(drop),
        ),
        (
            "negative amount",
            quota
                .consume(&Request::new("c").take(cores("q"), 2).take(cores("p"), -1))
                .await
                .map(drop),
        ),
        (
            "duplicate provider",
            quota
                .consume(&Request::new("c").take(cores("p"), 1).take(cores("p"), 1))
                .await
                .map(drop),
        ),
        (
            "no claims",
            quota.consume(&Request::new("c")).await.map(drop),
        ),
        (
            "empty consumer",
            quota
                .consume(&Request::new("").take(cores("p"), 1))
                .await
                .map(drop),
        ),
        (
            "overflowing total",
            quota
                .consume(
                    &Request::new("c")
                        .take(cores("p"), i64::MAX)
                        .take(cores("q"), 1),
                )
                .await
                .map(drop),
        ),
        (
            "negative limit",
            quota.set_limit(cores("p"), -1).await.map(drop),
        ),
        (
            "negative limit at creation",
            quota
                .create(NewProvider::new(cores("r"), -5))
                .await
                .map(drop),
        ),
        (
            "set limit of unknown",
            quota.set_limit(cores("nope"), 5).await.map(drop),
        ),
        ("unknown consumer", quota.release("nobody").await.map(drop)),
        (
            "zero ttl",
            quota
                .reserve(&Request::new("c").take(cores("p"), 1), Duration::ZERO)
                .await
                .map(drop),
        ),
        (
            "unknown reservation",
            quota.confirm(&Reservation::new("c", "nope", far)).await,
        ),
        (
            "reused request id",
            quota
                .consume(&Request::with_id("holder", "x").take(cores("p"), 1))
                .await
                .and(
                    quota
                        .consume(&Request::with_id("holder", "x").take(cores("p"), 2))
                        .await,
                )
                .map(drop),
        ),
    ];
    let mut kinds = Vec::new();
    for (what, result) in cases {
        let error = result.expect_err(what);
        assert!(!error.is_retryable(), "{what}: {error}");
        kinds.push(format!("{what}: {error}"));
    }
    // The reused-id case wrote its first (valid) consume; take it out of the comparison.
    quota.release("holder").await.unwrap();
    quota
        .consume(&Request::new("holder").take(cores("p"), 1))
        .await
        .unwrap();
    let after: Vec<Document> = providers(&t).await;
    assert_eq!(
        after
            .iter()
            .map(|d| d.get_i64("usage").unwrap())
            .collect::<Vec<_>>(),
        before
            .iter()
            .map(|d| d.get_i64("usage").unwrap())
            .collect::<Vec<_>>(),
        "{kinds:#?}"
    );
    assert_eq!(after.len(), before.len(), "nothing was created");
    for k in &kinds {
        println!("{k}");
    }
    assert!(kinds[0].contains("nope"), "{}", kinds[0]);
}

/// Counts the quota updates a proxy lets through, so a test can lose exactly one reply.
#[derive(Clone)]
struct LoseNth {
    target: &'static str,
    nth: usize,
    seen: Arc<AtomicUsize>,
    action: fn() -> common::wire_proxy::Action,
}

impl common::wire_proxy::Rules for LoseNth {
    fn command(&self, command: &mut Document) -> common::wire_proxy::Action {
        use crate::common::wire_proxy::{command_name, Action};
        if command_name(command) == "update"
            && command.get_str("update").ok() == Some(PROVIDERS_COLLECTION)
            && self.target_matches(command)
            && self.seen.fetch_add(1, Ordering::SeqCst) + 1 == self.nth
        {
            return (self.action)();
        }
        Action::Forward
    }
}

impl LoseNth {
    fn target_matches(&self, command: &Document) -> bool {
        let Some(u) = command
            .get_array("updates")
            .ok()
            .and_then(|u| u.first())
            .and_then(|s| s.as_document())
            .and_then(|s| s.get_document("u").ok())
        else {
            return false;
        };
        match self.target {
            "consume" => u.contains_key("$push"),
            // A release from one provider pulls its entries; from several, it rewrites them.
            _ => u.contains_key("$pull") || u.contains_key("$set"),
        }
    }
}

/// A quota handle whose client goes through a wire proxy that applies `action` to the first
/// quota update of kind `target` ("consume", or "release" for a pull or rewrite); the count of
/// such updates seen.
pub(crate) async fn through_proxy(
    t: &TestDb,
    target: &'static str,
    action: fn() -> common::wire_proxy::Action,
) -> (common::wire_proxy::WireProxy, Quota, Arc<AtomicUsize>) {
    let seen = Arc::new(AtomicUsize::new(0));
    let rules = LoseNth {
        target,
        nth: 1,
        seen: Arc::clone(&seen),
        action,
    };
    let proxy = common::wire_proxy::WireProxy::start(&common::server_uri(), rules).await;
    let store = Store::new(proxy.client().await.database(t.db.name()));
    let quota = Quota::open(&store).await.unwrap();
    (proxy, quota, seen)
}

#[tokio::test]
async fn a_consume_whose_reply_is_lost_counts_once() {
    let t = TestDb::new().await;
    let direct = Quota::open(&t.store).await.unwrap();
    direct
        .create(NewProvider::new(cores("p"), 10))
        .await
        .unwrap();
    let (_proxy, quota, seen) =
        through_proxy(&t, "consume", || common::wire_proxy::Action::LoseReply).await;
    let request = Request::new("vm").take(cores("p"), 4);
    let consumed = quota.consume(&request).await.unwrap();
    assert!(
        seen.load(Ordering::SeqCst) >= 2,
        "the reply was lost and resent"
    );
    assert!(consumed.replayed, "the resend found the first send applied");
    // The caller retrying on its own counts once too.
    assert!(quota.consume(&request).await.unwrap().replayed);
    assert_eq!(direct.provider(cores("p")).await.unwrap().usage, 4);
    assert_books_balance(&t).await;
}

#[tokio::test]
async fn a_release_whose_reply_is_lost_returns_once() {
    let t = TestDb::new().await;
    let direct = Quota::open(&t.store).await.unwrap();
    direct
        .create(NewProvider::new(cores("p"), 10))
        .await
        .unwrap();
    direct
        .consume(&Request::new("vm").take(cores("p"), 4))
        .await
        .unwrap();
    direct
        .consume(&Request::new("other").take(cores("p"), 3))
        .await
        .unwrap();
    let (_proxy, quota, seen) =
        through_proxy(&t, "release", || common::wire_proxy::Action::LoseReply).await;
    let released = quota.release("vm").await.unwrap();
    assert_eq!(
        seen.load(Ordering::SeqCst),
        1,
        "the release's reply was lost"
    );
    assert_eq!(released.returned, vec![(cores("p"), 4)]);
    assert!(matches!(
        quota.release("vm").await,
        Err(QuotaError::UnknownConsumer { .. })
    ));
    assert_eq!(direct.provider(cores("p")).await.unwrap().usage, 3);
    assert_books_balance(&t).await;
}

#[tokio::test]
async fn a_consume_delivered_late_after_its_release_changes_nothing() {
    let t = TestDb::new().await;
    let direct = Quota::open(&t.store).await.unwrap();
    direct
        .create(NewProvider::new(cores("p"), 10))
        .await
        .unwrap();
    let (_proxy, quota, seen) = through_proxy(&t, "consume", || {
        common::wire_proxy::Action::DeliverLate(Duration::from_millis(2_000))
    })
    .await;
    let request = Request::new("vm").take(cores("p"), 4);
    let consumed = quota.consume(&request).await.unwrap();
    assert!(
        !consumed.replayed,
        "the resend applied; the first copy is still on its way"
    );
    quota.release("vm").await.unwrap();
    assert_eq!(direct.provider(cores("p")).await.unwrap().usage, 0);
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    let p = direct.provider(cores("p")).await.unwrap();
    assert_eq!(
        p.usage, 0,
        "the late copy found the released request and did nothing"
    );
    assert!(p.allocations.is_empty());
    assert_books_balance(&t).await;
}

/// Confirm and cancel of one reservation racing from two clients: exactly one wins, and the
/// provider shows that one's outcome (a cancel must never return an allocation that a confirm
/// made of the entry it read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirm_and_cancel_racing_on_one_reservation_exactly_one_wins() {
    let t = TestDb::new().await;
    let one = Quota::open(&t.store).await.unwrap();
    let other_client = Client::with_uri_str(common::server_uri()).await.unwrap();
    let two = Quota::open(&Store::new(other_client.database(t.db.name())))
        .await
        .unwrap();
    one.create(NewProvider::new(cores("p"), 1_000))
        .await
        .unwrap();
    let (mut confirmed, mut cancelled) = (0, 0);
    for round in 0..40 {
        let consumer = format!("job{round}");
        let reservation = one
            .reserve(
                &Request::new(&consumer).take(cores("p"), 3),
                Duration::from_secs(60),
            )
            .await
            .unwrap();
        let (confirm, cancel) = tokio::join!(one.confirm(&reservation), two.cancel(&reservation));
        let held: i64 = one
            .provider(cores("p"))
            .await
            .unwrap()
            .allocations
            .iter()
            .filter(|a| a.consumer == consumer)
            .map(|a| a.amount)
            .sum();
        match (confirm, cancel) {
            (Ok(()), Err(QuotaError::UnknownReservation { .. })) => {
                confirmed += 1;
                assert_eq!(held, 3, "{consumer}: confirmed, so still held");
                one.release(&consumer).await.unwrap();
            }
            (Err(QuotaError::UnknownReservation { .. }), Ok(released)) => {
                cancelled += 1;
                assert_eq!(released.returned, vec![(cores("p"), 3)]);
                assert_eq!(held, 0, "{consumer}: cancelled, so returned");
            }
            other => panic!("{consumer}: confirm and cancel ended {other:?}"),
        }
        assert_eq!(one.provider(cores("p")).await.unwrap().usage, 0);
    }
    println!("{confirmed} confirms won, {cancelled} cancels won");
    assert_books_balance(&t).await;
}

/// A release finds its consumer's entries with an `$or` of the stored entries and of those a
/// pending transaction would restore; MongoDB answers an `$or` from indexes only when every
/// clause has one, and scans the whole collection otherwise
/// (https://www.mongodb.com/docs/manual/reference/operator/query/or/#-or-clauses-and-indexes).
/// So both are indexed, by consumer and request.
#[tokio::test]
async fn every_clause_of_the_release_query_has_an_index() {
    use futures::TryStreamExt;
    let t = TestDb::new().await;
    Quota::open(&t.store).await.unwrap();
    let keys: Vec<Document> =
        t.db.collection::<Document>(PROVIDERS_COLLECTION)
            .list_indexes()
            .await
            .unwrap()
            .try_collect::<Vec<_>>()
            .await
            .unwrap()
            .into_iter()
            .map(|index| index.keys)
            .collect();
    for wanted in [
        bson::doc! { "held.c": 1, "held.r": 1 },
        bson::doc! { "_hold.restore.held.c": 1, "_hold.restore.held.r": 1 },
    ] {
        assert!(keys.contains(&wanted), "no index {wanted} among {keys:?}");
    }
}
