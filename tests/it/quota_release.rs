//! `Quota::release_consumed` and `Quota::cancel`: giving back exactly what one consume or
//! reservation took, in one conditional update on a provider without a parent, and through the
//! general path everywhere else (a hierarchy, several providers, a stripe the handle does not
//! know, an entry that must stay as a tombstone, a reservation rebuilt from its ids, a reply that
//! was lost), with the same guarantees as `release`.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{self, raw_snapshot, TestDb};
use crate::quota::{assert_books_balance, through_proxy, watched};
use mongotx::collections::PROVIDERS_COLLECTION;
use mongotx::quota::{NewProvider, ProviderId, Quota, QuotaError, Request};
use mongotx::Store;

fn slots(scope: &str) -> ProviderId {
    ProviderId::new(scope, "slots")
}

#[tokio::test]
async fn a_consume_is_given_back_in_one_update_and_only_that_request() {
    let t = TestDb::new().await;
    let (quota, commands) = watched(&t).await;
    quota
        .create(NewProvider::new(slots("p"), 10))
        .await
        .unwrap();
    // The server clock is sampled once per handle; take that sample out of the count.
    let first = quota
        .consume(&Request::new("job").take(slots("p"), 2))
        .await
        .unwrap();
    let second = quota
        .consume(&Request::new("job").take(slots("p"), 3))
        .await
        .unwrap();
    commands.lock().unwrap().clear();
    let released = quota.release_consumed(&first).await.unwrap();
    assert_eq!(released.consumer, "job");
    assert_eq!(released.returned, vec![(slots("p"), 2)]);
    assert_eq!(
        *commands.lock().unwrap(),
        vec!["update".to_string()],
        "one conditional update and nothing else"
    );
    let p = quota.provider(slots("p")).await.unwrap();
    assert_eq!(
        (p.usage, p.available),
        (3, 7),
        "the other request still holds"
    );
    assert_eq!(p.allocations.len(), 1);
    assert_eq!(p.allocations[0].request, second.request);

    let before = raw_snapshot(&t.db, PROVIDERS_COLLECTION).await;
    match quota.release_consumed(&first).await {
        Err(QuotaError::UnknownRequest { consumer, request }) => {
            assert_eq!((consumer.as_str(), request), ("job", first.request.clone()));
        }
        other => panic!("expected UnknownRequest, got {other:?}"),
    }
    assert_eq!(
        raw_snapshot(&t.db, PROVIDERS_COLLECTION).await,
        before,
        "a second release changes nothing"
    );
    assert_eq!(
        quota.release("job").await.unwrap().returned,
        vec![(slots("p"), 3)]
    );
    assert!(matches!(
        quota.release_consumed(&second).await,
        Err(QuotaError::UnknownRequest { .. })
    ));
    assert_books_balance(&t).await;
}

#[tokio::test]
async fn a_hierarchy_and_several_providers_are_given_back_all_at_once() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    quota
        .create(NewProvider::new(slots("domain"), 10))
        .await
        .unwrap();
    quota
        .create(NewProvider::new(slots("project"), 8).parent(slots("domain")))
        .await
        .unwrap();
    quota
        .create(NewProvider::new(ProviderId::new("domain", "disk"), 100))
        .await
        .unwrap();
    let child = quota
        .consume(&Request::new("vm").take(slots("project"), 4))
        .await
        .unwrap();
    let both = quota
        .consume(
            &Request::new("vm")
                .take(slots("domain"), 1)
                .take(("domain", "disk"), 50),
        )
        .await
        .unwrap();
    let mut returned = quota.release_consumed(&child).await.unwrap().returned;
    returned.sort();
    let mut expected = vec![(slots("domain"), 4), (slots("project"), 4)];
    expected.sort();
    assert_eq!(returned, expected, "the child and its ancestor");
    assert_eq!(quota.provider(slots("domain")).await.unwrap().usage, 1);
    let mut returned = quota.release_consumed(&both).await.unwrap().returned;
    returned.sort();
    let mut expected = vec![
        (slots("domain"), 1),
        (ProviderId::new("domain", "disk"), 50),
    ];
    expected.sort();
    assert_eq!(returned, expected);
    for id in [
        slots("domain"),
        slots("project"),
        ProviderId::new("domain", "disk"),
    ] {
        assert_eq!(quota.provider(id).await.unwrap().usage, 0);
    }
    assert!(matches!(
        quota.release("vm").await,
        Err(QuotaError::UnknownConsumer { .. })
    ));
    assert_books_balance(&t).await;
}

/// A handle that never saw the provider striped sends the update to the wrong stripe, finds out
/// that nothing matched, and the general path gives the units back.
#[tokio::test]
async fn a_stale_layout_still_gives_back_across_stripes() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    let stale = Quota::open(&t.store).await.unwrap();
    quota
        .create(NewProvider::new(slots("big"), 1_000))
        .await
        .unwrap();
    // Seen through `stale` while it is still one document.
    stale.provider(slots("big")).await.unwrap();
    let mut taken = Vec::new();
    for i in 0..100 {
        taken.push(
            quota
                .consume(&Request::new(format!("c{i}")).take(slots("big"), 2))
                .await
                .unwrap(),
        );
    }
    let stripes = raw_snapshot(&t.db, PROVIDERS_COLLECTION).await.len();
    assert!(
        stripes > 2,
        "the provider was spread over {stripes} stripes"
    );
    for (i, consumed) in taken.iter().enumerate() {
        let handle = if i % 2 == 0 { &stale } else { &quota };
        let released = handle.release_consumed(consumed).await.unwrap();
        assert_eq!(released.returned, vec![(slots("big"), 2)]);
    }
    let p = quota.provider(slots("big")).await.unwrap();
    assert_eq!((p.usage, p.available), (0, 1_000));
    assert!(p.allocations.is_empty());
}

#[tokio::test]
async fn a_release_whose_reply_is_lost_returns_once() {
    let t = TestDb::new().await;
    let direct = Quota::open(&t.store).await.unwrap();
    direct
        .create(NewProvider::new(slots("p"), 10))
        .await
        .unwrap();
    let (_proxy, quota, seen) =
        through_proxy(&t, "release", || common::wire_proxy::Action::LoseReply).await;
    let taken = quota
        .consume(&Request::new("vm").take(slots("p"), 4))
        .await
        .unwrap();
    direct
        .consume(&Request::new("other").take(slots("p"), 3))
        .await
        .unwrap();
    let released = quota.release_consumed(&taken).await.unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 1, "the reply was lost");
    assert_eq!(released.returned, vec![(slots("p"), 4)]);
    assert!(matches!(
        quota.release_consumed(&taken).await,
        Err(QuotaError::UnknownRequest { .. })
    ));
    assert_eq!(direct.provider(slots("p")).await.unwrap().usage, 3);
    assert_books_balance(&t).await;
}

/// A consume whose first copy is still on its way leaves a deadline in its entry: giving it back
/// keeps the entry (at 0) until then, so the late copy finds it and takes nothing. The single
/// update must not drop such an entry.
#[tokio::test]
async fn a_consume_delivered_late_after_release_consumed_changes_nothing() {
    let t = TestDb::new().await;
    let direct = Quota::open(&t.store).await.unwrap();
    direct
        .create(NewProvider::new(slots("p"), 10))
        .await
        .unwrap();
    let (_proxy, quota, seen) = through_proxy(&t, "consume", || {
        common::wire_proxy::Action::DeliverLate(Duration::from_millis(2_000))
    })
    .await;
    let taken = quota
        .consume(&Request::new("vm").take(slots("p"), 4))
        .await
        .unwrap();
    let released = quota.release_consumed(&taken).await.unwrap();
    assert_eq!(released.returned, vec![(slots("p"), 4)]);
    assert_eq!(direct.provider(slots("p")).await.unwrap().usage, 0);
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(
        seen.load(Ordering::SeqCst),
        2,
        "the first copy arrived late"
    );
    let p = direct.provider(slots("p")).await.unwrap();
    assert_eq!(p.usage, 0, "the late copy did nothing");
    assert!(p.allocations.is_empty());
    assert_books_balance(&t).await;
}

/// 4 clients x 8 tasks consume and give back on one provider of 10 units, half of them racing a
/// `release` of the same consumer from another client: the limit is never passed (an observer
/// reads all along), every consume is given back exactly once, and the provider ends empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_clients_consume_and_give_back_without_passing_the_limit() {
    const LIMIT: i64 = 10;
    let t = TestDb::new().await;
    let mut handles = Vec::new();
    for _ in 0..4 {
        let client = common::client().await;
        handles.push(
            Quota::open(&Store::new(client.database(t.db.name())))
                .await
                .unwrap(),
        );
    }
    handles[0]
        .create(NewProvider::new(slots("hot"), LIMIT))
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let observer = {
        let (quota, stop) = (handles[1].clone(), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut highest = 0;
            while !stop.load(Ordering::SeqCst) {
                let p = quota.provider(slots("hot")).await.unwrap();
                assert!(p.usage <= LIMIT, "usage {} over the limit", p.usage);
                assert_eq!(p.usage + p.available, LIMIT);
                highest = highest.max(p.usage);
            }
            highest
        })
    };
    let (granted, returned) = (Arc::new(AtomicI64::new(0)), Arc::new(AtomicI64::new(0)));
    let mut tasks = Vec::new();
    for task in 0..32 {
        let quota = handles[task % 4].clone();
        let rival = handles[(task + 1) % 4].clone();
        let (granted, returned) = (Arc::clone(&granted), Arc::clone(&returned));
        tasks.push(tokio::spawn(async move {
            for i in 0..25 {
                let consumer = format!("t{task}-{i}");
                let amount = 1 + (task as i64 + i) % 3;
                let taken = match quota
                    .consume(&Request::new(consumer.clone()).take(slots("hot"), amount))
                    .await
                {
                    Ok(taken) => taken,
                    Err(QuotaError::QuotaExceeded { .. }) => continue,
                    Err(e) => panic!("consume: {e}"),
                };
                granted.fetch_add(amount, Ordering::SeqCst);
                let back = |r: Result<mongotx::quota::Released, QuotaError>| match r {
                    Ok(r) => r.returned.iter().map(|(_, n)| n).sum::<i64>(),
                    Err(QuotaError::UnknownRequest { .. } | QuotaError::UnknownConsumer { .. }) => {
                        0
                    }
                    Err(e) => panic!("release: {e}"),
                };
                let n = if i % 2 == 0 {
                    let (ours, theirs) =
                        tokio::join!(quota.release_consumed(&taken), rival.release(&consumer));
                    back(ours) + back(theirs)
                } else {
                    back(quota.release_consumed(&taken).await)
                };
                assert_eq!(n, amount, "{consumer}: given back exactly once");
                returned.fetch_add(n, Ordering::SeqCst);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    let highest = observer.await.unwrap();
    assert!(granted.load(Ordering::SeqCst) > 0);
    assert_eq!(
        granted.load(Ordering::SeqCst),
        returned.load(Ordering::SeqCst)
    );
    assert!(highest > 0, "the observer saw units in use");
    let p = handles[0].provider(slots("hot")).await.unwrap();
    assert_eq!((p.usage, p.available), (0, LIMIT));
    assert!(p.allocations.is_empty());
    assert_books_balance(&t).await;
}

#[tokio::test]
async fn a_reservation_is_cancelled_in_one_update_and_never_after_its_confirmation() {
    let t = TestDb::new().await;
    let (quota, commands) = watched(&t).await;
    quota
        .create(NewProvider::new(slots("p"), 10))
        .await
        .unwrap();
    let ttl = Duration::from_secs(600);
    let held = quota
        .reserve(&Request::new("job").take(slots("p"), 4), ttl)
        .await
        .unwrap();
    commands.lock().unwrap().clear();
    let cancelled = quota.cancel(&held).await.unwrap();
    assert_eq!(cancelled.returned, vec![(slots("p"), 4)]);
    assert_eq!(
        *commands.lock().unwrap(),
        vec!["update".to_string()],
        "one conditional update and nothing else"
    );
    assert!(matches!(
        quota.cancel(&held).await,
        Err(QuotaError::UnknownReservation { .. })
    ));

    // Confirmed first: the single update finds no entry with that expiry and changes nothing.
    let confirmed = quota
        .reserve(&Request::new("job").take(slots("p"), 3), ttl)
        .await
        .unwrap();
    quota.confirm(&confirmed).await.unwrap();
    let before = raw_snapshot(&t.db, PROVIDERS_COLLECTION).await;
    assert!(matches!(
        quota.cancel(&confirmed).await,
        Err(QuotaError::UnknownReservation { .. })
    ));
    assert_eq!(raw_snapshot(&t.db, PROVIDERS_COLLECTION).await, before);
    assert_eq!(quota.provider(slots("p")).await.unwrap().usage, 3);

    // Rebuilt from its ids (another process): looked up, then given back.
    let kept = quota
        .reserve(&Request::new("job").take(slots("p"), 2), ttl)
        .await
        .unwrap();
    let rebuilt = mongotx::quota::Reservation::new("job", kept.request.clone(), kept.expires);
    assert_eq!(rebuilt, kept, "equal: the same request and expiry");
    commands.lock().unwrap().clear();
    assert_eq!(
        quota.cancel(&rebuilt).await.unwrap().returned,
        vec![(slots("p"), 2)]
    );
    assert_eq!(
        *commands.lock().unwrap(),
        vec!["find".to_string(), "update".to_string()]
    );
    assert_eq!(quota.provider(slots("p")).await.unwrap().usage, 3);
    assert_books_balance(&t).await;
}

#[tokio::test]
async fn a_cancel_whose_reply_is_lost_returns_once() {
    let t = TestDb::new().await;
    let direct = Quota::open(&t.store).await.unwrap();
    direct
        .create(NewProvider::new(slots("p"), 10))
        .await
        .unwrap();
    let (_proxy, quota, seen) =
        through_proxy(&t, "release", || common::wire_proxy::Action::LoseReply).await;
    let held = quota
        .reserve(
            &Request::new("vm").take(slots("p"), 4),
            Duration::from_secs(600),
        )
        .await
        .unwrap();
    let cancelled = quota.cancel(&held).await.unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 1, "the reply was lost");
    assert_eq!(cancelled.returned, vec![(slots("p"), 4)]);
    assert!(matches!(
        quota.cancel(&held).await,
        Err(QuotaError::UnknownReservation { .. })
    ));
    assert_eq!(direct.provider(slots("p")).await.unwrap().usage, 0);
    assert_books_balance(&t).await;
}
