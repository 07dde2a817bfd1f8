//! Providers with many allocations, spread over stripes (see `src/quota/stripes.rs`): every
//! stored document stays small, the stripes' shares add up to the limit, no capacity is lost to
//! the spreading, a retry counts once across a split, a stale layout is found out, and the
//! operations that give back and read work across stripes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{raw_snapshot, TestDb};
use crate::quota_crash::{collect, coordinator_points, dying_at};
use bson::Document;
use mongotx::collections::PROVIDERS_COLLECTION;
use mongotx::quota::{NewProvider, ProviderId, Quota, QuotaError, Request};
use mongotx::Store;

/// The most entries a stripe holds (the library's `STRIPE_ENTRIES`).
const STRIPE_ENTRIES: usize = 32;

fn units(scope: &str) -> ProviderId {
    ProviderId::new(scope, "units")
}

/// The hash that addresses a request's stripe (the library's `stripes::hash`, restated: it is
/// part of the stored format, so a test spelling it out also pins it).
pub(crate) fn stripe_hash(consumer: &str, request: &str) -> u64 {
    use sha2::{Digest, Sha256};
    let mut digest = Sha256::new();
    digest.update(consumer.as_bytes());
    digest.update([0u8]);
    digest.update(request.as_bytes());
    let bytes = digest.finalize();
    u64::from_le_bytes(bytes[..8].try_into().unwrap())
}

/// Every entry of a stored stripe sits in the stripe its hash addresses: the stripe's number is
/// the low `bits` bits of the hash (a resend looks for its request there and nowhere else).
pub(crate) fn check_addresses(stripe: &Document) {
    let id = stripe.get_document("_id").unwrap();
    let number = id.get_i64("stripe").unwrap_or(0);
    let bits = stripe.get_i64("bits").unwrap_or(0);
    for e in stripe.get_array("held").unwrap() {
        let e = e.as_document().unwrap();
        let h = stripe_hash(e.get_str("c").unwrap(), e.get_str("r").unwrap());
        assert_eq!(
            h % (1_u64 << bits),
            number.unsigned_abs(),
            "an entry sits in a stripe its hash does not address: {e} in {stripe}"
        );
    }
}

/// The stored stripes of `scope`'s provider, checked: none over its share or holding more than
/// a stripe may, usage the sum of its entries, every entry where its hash points, and the
/// shares adding up to `limit`. Returns the stripe count.
pub(crate) async fn check_stripes(t: &TestDb, scope: &str, limit: i64) -> usize {
    let stripes: Vec<Document> = raw_snapshot(&t.db, PROVIDERS_COLLECTION)
        .await
        .into_iter()
        .filter(|d| d.get_document("_id").unwrap().get_str("scope").unwrap() == scope)
        .collect();
    let mut shares = 0;
    for doc in &stripes {
        assert!(!doc.contains_key("_txn"), "left held: {doc}");
        check_addresses(doc);
        let held = doc.get_array("held").unwrap();
        assert!(
            held.len() <= STRIPE_ENTRIES,
            "a stripe outgrew its bound: {doc}"
        );
        let sum: i64 = held
            .iter()
            .map(|e| e.as_document().unwrap().get_i64("n").unwrap())
            .sum();
        let (usage, share) = (doc.get_i64("usage").unwrap(), doc.get_i64("limit").unwrap());
        assert_eq!(usage, sum, "usage = entries: {doc}");
        assert_eq!(doc.get_i64("available").unwrap(), share - usage, "{doc}");
        shares += share;
    }
    assert_eq!(shares, limit, "the stripes' shares add up to the limit");
    stripes.len()
}

#[tokio::test]
async fn many_allocations_spread_over_small_stripes_and_a_consume_stays_one_write() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    quota
        .create(NewProvider::new(units("big"), 10_000))
        .await
        .unwrap();
    // Ids chosen here, so that where each request lands (its hash) is the same in every run.
    for i in 0..300 {
        quota
            .consume(&Request::with_id(format!("c{i}"), "r").take(units("big"), 2))
            .await
            .unwrap();
    }
    let stripes = check_stripes(&t, "big", 10_000).await;
    assert!(
        stripes >= 300 / STRIPE_ENTRIES,
        "{stripes} stripes for 300 allocations"
    );
    let p = quota.provider(units("big")).await.unwrap();
    assert_eq!((p.limit, p.usage, p.available), (10_000, 600, 9_400));
    assert_eq!(p.allocations.len(), 300);
    // With the layout known, a consume is one write of one small stripe.
    let mut single = 0;
    for i in 0..20 {
        let done = quota
            .consume(&Request::with_id(format!("d{i}"), "r").take(units("big"), 1))
            .await
            .unwrap();
        single += u32::from(done.writes == 1);
    }
    assert!(single >= 18, "only {single} of 20 consumes were one write");
    // A fresh handle (another process) starts from one stripe and learns the layout.
    let other = Quota::open(&Store::new(t.other_client_db().await))
        .await
        .unwrap();
    other
        .consume(&Request::new("late-comer").take(units("big"), 1))
        .await
        .unwrap();
    let p = other.provider(units("big")).await.unwrap();
    assert_eq!(p.usage, 621);
    check_stripes(&t, "big", 10_000).await;
}

#[tokio::test]
async fn stripes_lend_each_other_room_so_the_whole_limit_can_be_used_and_no_more() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    quota
        .create(NewProvider::new(units("tight"), 100))
        .await
        .unwrap();
    let mut granted = 0;
    let mut refusal = None;
    for i in 0..130 {
        match quota
            .consume(&Request::new(format!("c{i}")).take(units("tight"), 1))
            .await
        {
            Ok(_) => granted += 1,
            Err(QuotaError::QuotaExceeded { refusals, .. }) => refusal = Some(refusals),
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(granted, 100, "every unit of the limit, and not one more");
    let refusals = refusal.expect("the limit was reached");
    assert_eq!(refusals[0].provider, units("tight"));
    assert_eq!(
        (refusals[0].available, refusals[0].limit),
        (0, 100),
        "the provider's numbers"
    );
    assert!(check_stripes(&t, "tight", 100).await > 1, "it was striped");
    quota.release("c7").await.unwrap();
    quota
        .consume(&Request::new("after").take(units("tight"), 1))
        .await
        .expect("a released unit can be taken again, from whichever stripe it went back to");
    check_stripes(&t, "tight", 100).await;
}

#[tokio::test]
async fn a_retry_counts_once_across_splits_and_a_stale_layout() {
    let t = TestDb::new().await;
    let a = Quota::open(&t.store).await.unwrap();
    let b = Quota::open(&Store::new(t.other_client_db().await))
        .await
        .unwrap();
    a.create(NewProvider::new(units("p"), 1_000)).await.unwrap();
    let kept = Request::with_id("keeper", "job-1").take(units("p"), 5);
    b.consume(&kept).await.unwrap();
    // `a` makes the provider split several times; `b` still believes it has one stripe.
    for i in 0..200 {
        a.consume(&Request::new(format!("c{i}")).take(units("p"), 1))
            .await
            .unwrap();
    }
    assert!(check_stripes(&t, "p", 1_000).await >= 200 / STRIPE_ENTRIES);
    for quota in [&a, &b] {
        let again = quota.consume(&kept).await.unwrap();
        assert!(
            again.replayed,
            "the request was found where its hash now lives"
        );
    }
    assert_eq!(a.provider(units("p")).await.unwrap().usage, 205);
    // The same id asking for another amount is still a reuse, wherever it lives.
    assert!(matches!(
        b.consume(&Request::with_id("keeper", "job-1").take(units("p"), 6))
            .await,
        Err(QuotaError::RequestReused { .. })
    ));
    let released = b.release("keeper").await.unwrap();
    assert_eq!(released.returned, vec![(units("p"), 5)]);
    assert_eq!(a.provider(units("p")).await.unwrap().usage, 200);
    check_stripes(&t, "p", 1_000).await;
}

#[tokio::test]
async fn release_reserve_sweep_and_limits_work_across_stripes() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    quota
        .create(NewProvider::new(units("s"), 500))
        .await
        .unwrap();
    // One consumer with many requests: they land in different stripes.
    for i in 0..80 {
        quota
            .consume(&Request::with_id("wide", format!("r{i}")).take(units("s"), 2))
            .await
            .unwrap();
    }
    let short = quota
        .reserve(
            &Request::new("brief").take(units("s"), 10),
            Duration::from_millis(300),
        )
        .await
        .unwrap();
    assert!(check_stripes(&t, "s", 500).await > 2);
    let released = quota.release("wide").await.unwrap();
    assert_eq!(
        released.returned,
        vec![(units("s"), 160)],
        "one sum per provider"
    );
    assert_eq!(quota.provider(units("s")).await.unwrap().usage, 10);
    // Lowering the limit below usage refuses new consumes; raising it lets them in again.
    let lowered = quota.set_limit(units("s"), 4).await.unwrap();
    assert_eq!(
        (lowered.limit, lowered.usage, lowered.available),
        (4, 10, -6)
    );
    check_stripes(&t, "s", 4).await;
    assert!(matches!(
        quota.consume(&Request::new("x").take(units("s"), 1)).await,
        Err(QuotaError::QuotaExceeded { .. })
    ));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let swept = quota.sweep().await.unwrap();
    assert_eq!(swept.expired, 1);
    assert!(matches!(
        quota.confirm(&short).await,
        Err(QuotaError::ReservationExpired { .. })
    ));
    quota.set_limit(units("s"), 50).await.unwrap();
    check_stripes(&t, "s", 50).await;
    for i in 0..50 {
        quota
            .consume(&Request::new(format!("y{i}")).take(units("s"), 1))
            .await
            .unwrap();
    }
    let p = quota.provider(units("s")).await.unwrap();
    assert_eq!((p.limit, p.usage, p.available), (50, 50, 0));
    check_stripes(&t, "s", 50).await;
}

/// Processes (separate clients) consuming and releasing on one provider that splits under them:
/// an observer never sees it over its limit, and at the end usage is exactly what is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_consumers_across_splits_never_exceed_the_limit() {
    const LIMIT: i64 = 150;
    let t = TestDb::new().await;
    let mut quotas = Vec::new();
    for _ in 0..4 {
        quotas.push(
            Quota::open(&Store::new(t.other_client_db().await))
                .await
                .unwrap(),
        );
    }
    quotas[0]
        .create(NewProvider::new(units("hot"), LIMIT))
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicI64::new(0));
    let observer = {
        let (quota, stop, peak) = (quotas[0].clone(), stop.clone(), peak.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let p = quota.provider(units("hot")).await.unwrap();
                assert!(
                    p.usage <= p.limit,
                    "over the limit: {} of {}",
                    p.usage,
                    p.limit
                );
                assert_eq!(p.limit, LIMIT);
                peak.fetch_max(p.usage, Ordering::Relaxed);
            }
        })
    };
    let mut tasks = Vec::new();
    for task in 0..24 {
        let quota = quotas[task % quotas.len()].clone();
        tasks.push(tokio::spawn(async move {
            let mut held = BTreeMap::new();
            for i in 0..30 {
                let consumer = format!("t{task}-{i}");
                match quota
                    .consume(&Request::new(&consumer).take(units("hot"), 1 + (i % 3)))
                    .await
                {
                    Ok(_) => {
                        held.insert(consumer, 1 + (i % 3));
                    }
                    Err(QuotaError::QuotaExceeded { .. }) => {}
                    Err(e) if e.is_retryable() => {}
                    Err(e) => panic!("{e}"),
                }
                if i % 4 == 3 {
                    if let Some(c) = held.keys().next().cloned() {
                        quota.release(&c).await.unwrap();
                        held.remove(&c);
                    }
                }
            }
            held
        }));
    }
    let mut held = BTreeMap::new();
    for task in tasks {
        held.extend(task.await.expect("task panicked"));
    }
    stop.store(true, Ordering::SeqCst);
    observer.await.expect("observer saw a violation");
    let p = quotas[1].provider(units("hot")).await.unwrap();
    assert_eq!(
        p.usage,
        held.values().sum::<i64>(),
        "usage is exactly what is held"
    );
    let recorded: BTreeMap<String, i64> = p
        .allocations
        .iter()
        .map(|a| (a.consumer.clone(), a.amount))
        .collect();
    assert_eq!(recorded, held);
    assert!(peak.load(Ordering::Relaxed) > 0);
    assert!(check_stripes(&t, "hot", LIMIT).await > 1, "it was striped");
}

/// A split is a transaction of the stripe, stripe 0 and the new stripe: its coordinator dying at
/// any step leaves, once the GC has run, either the stripe whole or both halves, with every
/// request still found where its hash points and the shares adding up to the limit.
#[tokio::test]
async fn a_split_whose_coordinator_dies_at_any_step_leaves_the_provider_whole() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    let (mut crashed, mut split) = (0, 0);
    for (i, name) in coordinator_points().into_iter().enumerate() {
        for step in 0..4 {
            let scope = format!("split{i}-{step}");
            quota
                .create(NewProvider::new(units(&scope), 10_000))
                .await
                .unwrap();
            let fill: Vec<Request> = (0..STRIPE_ENTRIES)
                .map(|j| Request::with_id(format!("{scope}/f{j}"), "r").take(units(&scope), 1))
                .collect();
            for request in &fill {
                quota.consume(request).await.unwrap();
            }
            let dying = dying_at(&t, name, step).await;
            let last = Request::with_id(format!("{scope}/last"), "r").take(units(&scope), 1);
            match dying.consume(&last).await {
                Err(QuotaError::Transaction { source })
                    if source.to_string().contains("injected crash") =>
                {
                    crashed += 1
                }
                Ok(_) => continue, // this step does not exist for this transaction
                Err(other) => panic!("{scope}: {other}"),
            }
            tokio::time::sleep(Duration::from_millis(350)).await;
            collect(&t, &quota).await;
            let stripes = check_stripes(&t, &scope, 10_000).await;
            split += usize::from(stripes > 1);
            for request in &fill {
                assert!(quota.consume(request).await.unwrap().replayed, "{scope}");
            }
            assert!(!quota.consume(&last).await.unwrap().replayed, "{scope}");
            let p = quota.provider(units(&scope)).await.unwrap();
            assert_eq!((p.usage, p.allocations.len()), (33, 33), "{scope}");
            check_stripes(&t, &scope, 10_000).await;
        }
    }
    println!("crashed at {crashed} points; {split} splits had passed the commit point");
    assert!(crashed >= 10, "only {crashed} crashes");
    assert!(split > 0 && split < crashed);
}

/// A limit lowered below usage holds for the whole provider: releases give room back to their
/// own stripes, yet nothing is granted until the provider as a whole is under its limit again.
#[tokio::test]
async fn a_limit_lowered_below_usage_holds_across_stripes_until_usage_falls_under_it() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    quota
        .create(NewProvider::new(units("low"), 200))
        .await
        .unwrap();
    for i in 0..100 {
        quota
            .consume(&Request::new(format!("c{i}")).take(units("low"), 1))
            .await
            .unwrap();
    }
    assert!(check_stripes(&t, "low", 200).await >= 4);
    quota.set_limit(units("low"), 50).await.unwrap();
    for i in 0..30 {
        quota.release(&format!("c{i}")).await.unwrap();
    }
    for i in 0..20 {
        match quota
            .consume(&Request::new(format!("n{i}")).take(units("low"), 1))
            .await
        {
            Err(QuotaError::QuotaExceeded { refusals, .. }) => {
                assert_eq!((refusals[0].available, refusals[0].limit), (-20, 50));
            }
            other => panic!("granted over a lowered limit: {other:?}"),
        }
    }
    for i in 30..55 {
        quota.release(&format!("c{i}")).await.unwrap();
    }
    let mut granted = 0;
    for i in 0..10 {
        if quota
            .consume(&Request::new(format!("m{i}")).take(units("low"), 1))
            .await
            .is_ok()
        {
            granted += 1;
        }
    }
    assert_eq!(granted, 5, "exactly the room under the lowered limit");
    let p = quota.provider(units("low")).await.unwrap();
    assert_eq!((p.limit, p.usage, p.available), (50, 50, 0));
    check_stripes(&t, "low", 50).await;
}

/// Issue 47, case 1: a limit lowered while the provider is one full stripe. The split that the
/// next consume makes must not hand either half room the provider as a whole does not have.
#[tokio::test]
async fn a_limit_lowered_on_one_full_stripe_still_holds_after_it_splits() {
    let t = TestDb::new().await;
    let quota = Quota::open(&t.store).await.unwrap();
    let (p, q) = (ProviderId::new("s", "p"), ProviderId::new("s", "q"));
    quota
        .create(NewProvider::new(p.clone(), 100))
        .await
        .unwrap();
    quota
        .create(NewProvider::new(q.clone(), 100))
        .await
        .unwrap();
    for i in 0..STRIPE_ENTRIES {
        quota
            .consume(&Request::with_id(format!("c{i}"), "r").take(p.clone(), 1))
            .await
            .unwrap();
    }
    assert_eq!(
        check_stripes(&t, "s", 200).await,
        2,
        "p is still one stripe"
    );
    quota.set_limit(p.clone(), 20).await.unwrap();
    // Two providers: the checked path, which splits p's full stripe before deciding.
    let both = Request::with_id("both", "r")
        .take(p.clone(), 1)
        .take(q.clone(), 1);
    assert!(matches!(
        quota.consume(&both).await,
        Err(QuotaError::QuotaExceeded { .. })
    ));
    for i in 0..6 {
        quota.release(&format!("c{i}")).await.unwrap();
    }
    // Usage 26 over a limit of 20: every consume is refused, whichever stripe it lands in.
    for i in 0..20 {
        let single = Request::with_id(format!("n{i}"), "r").take(p.clone(), 1);
        match quota.consume(&single).await {
            Err(QuotaError::QuotaExceeded { refusals, .. }) => {
                assert_eq!((refusals[0].available, refusals[0].limit), (-6, 20));
            }
            other => panic!("granted over a lowered limit: {other:?}"),
        }
    }
    let now = quota.provider(p.clone()).await.unwrap();
    assert_eq!((now.limit, now.usage), (20, 26));
    // Under the limit again: exactly the room there is.
    for i in 6..16 {
        quota.release(&format!("c{i}")).await.unwrap();
    }
    let mut granted = 0;
    for i in 0..10 {
        let single = Request::with_id(format!("m{i}"), "r").take(p.clone(), 1);
        if quota.consume(&single).await.is_ok() {
            granted += 1;
        }
    }
    assert_eq!(granted, 4, "16 held under a limit of 20");
    let now = quota.provider(p.clone()).await.unwrap();
    assert_eq!((now.limit, now.usage, now.available), (20, 20, 0));
}
