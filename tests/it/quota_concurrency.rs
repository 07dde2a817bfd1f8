//! Quota under real concurrency: several clients, many tasks, an observer reading throughout.
//! Usage never exceeds a limit at any observation, every refusal is `QuotaExceeded`, and at the
//! end usage equals what the tasks hold, exactly; with hierarchies, no partial allocation is ever
//! seen and every ancestor equals the sum of its children.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::TestDb;
use mongotx::quota::{NewProvider, ProviderId, Quota, QuotaError, Request};
use mongotx::Store;
use rand::Rng;

const CLIENTS: usize = 4;
const TASKS_PER_CLIENT: usize = 16;

#[derive(Default)]
struct Tally {
    consumed: AtomicU64,
    refused: AtomicU64,
    released: AtomicU64,
    observations: AtomicU64,
    /// The most re-reads one successful consume needed: how close a consume came to starving.
    most_retries: AtomicU64,
}

async fn quotas(t: &TestDb) -> Vec<Quota> {
    let mut quotas = Vec::new();
    for _ in 0..CLIENTS {
        let store = Store::new(t.other_client_db().await);
        quotas.push(Quota::open(&store).await.unwrap());
    }
    quotas
}

/// Runs `task(quota, task index)` on every client's tasks until `run_for` has passed; returns
/// what each task still holds: consumer -> amounts by provider.
async fn race<F, Fut>(quotas: &[Quota], run_for: Duration, task: F) -> BTreeMap<String, i64>
where
    F: Fn(Quota, usize, Instant) -> Fut,
    Fut: std::future::Future<Output = BTreeMap<String, i64>> + Send + 'static,
{
    let until = Instant::now() + run_for;
    let mut handles = Vec::new();
    for (c, quota) in quotas.iter().enumerate() {
        for i in 0..TASKS_PER_CLIENT {
            handles.push(tokio::spawn(task(quota.clone(), c * 100 + i, until)));
        }
    }
    let mut held = BTreeMap::new();
    for h in handles {
        held.extend(h.await.expect("task panicked"));
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_hot_provider_never_goes_over_its_limit() {
    let t = TestDb::new().await;
    let quotas = quotas(&t).await;
    let p = ProviderId::new("hot", "units");
    quotas[0]
        .create(NewProvider::new(p.clone(), 1000))
        .await
        .unwrap();
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));

    let observer = {
        let (quota, p, tally, stop) = (quotas[0].clone(), p.clone(), tally.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let seen = quota.provider(p.clone()).await.unwrap();
                assert!(seen.usage <= seen.limit, "over the limit: {seen:?}");
                let sum: i64 = seen.allocations.iter().map(|a| a.amount).sum();
                assert_eq!(seen.usage, sum, "usage is the sum of the allocations");
                tally.observations.fetch_add(1, Ordering::Relaxed);
            }
        })
    };

    let held = {
        let (p, tally) = (p.clone(), tally.clone());
        race(
            &quotas,
            Duration::from_secs(20),
            move |quota, task, until| {
                let (p, tally) = (p.clone(), tally.clone());
                async move {
                    let mut mine: Vec<(String, i64)> = Vec::new();
                    let mut n = 0;
                    while Instant::now() < until {
                        let (amount, release) = {
                            let mut rng = rand::rng();
                            (rng.random_range(1..=60_i64), rng.random_bool(0.45))
                        };
                        if release && !mine.is_empty() {
                            let (consumer, amount) = mine.remove(0);
                            let released = quota.release(&consumer).await.unwrap();
                            assert_eq!(released.returned, vec![(p.clone(), amount)]);
                            tally.released.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        n += 1;
                        let consumer = format!("t{task}-{n}");
                        match quota
                            .consume(&Request::new(&consumer).take(p.clone(), amount))
                            .await
                        {
                            Ok(done) => {
                                mine.push((consumer, amount));
                                tally.consumed.fetch_add(1, Ordering::Relaxed);
                                tally
                                    .most_retries
                                    .fetch_max(u64::from(done.retries), Ordering::Relaxed);
                            }
                            Err(QuotaError::QuotaExceeded { .. }) => {
                                tally.refused.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(other) => panic!("only QuotaExceeded may refuse: {other}"),
                        }
                    }
                    mine.into_iter().collect()
                }
            },
        )
        .await
    };
    stop.store(true, Ordering::SeqCst);
    observer.await.expect("observer saw a violation");

    let end = quotas[0].provider(p.clone()).await.unwrap();
    let expected: i64 = held.values().sum();
    assert_eq!(
        end.usage, expected,
        "usage equals the live allocations exactly"
    );
    let recorded: BTreeMap<String, i64> = end
        .allocations
        .iter()
        .map(|a| (a.consumer.clone(), a.amount))
        .collect();
    assert_eq!(
        recorded, held,
        "the provider records exactly who holds what"
    );
    println!(
        "consumed={} refused={} released={} observations={} final usage={} most retries={}",
        tally.consumed.load(Ordering::Relaxed),
        tally.refused.load(Ordering::Relaxed),
        tally.released.load(Ordering::Relaxed),
        tally.observations.load(Ordering::Relaxed),
        end.usage,
        tally.most_retries.load(Ordering::Relaxed),
    );
    assert!(
        tally.refused.load(Ordering::Relaxed) > 0,
        "the limit was reached"
    );
    assert!(tally.observations.load(Ordering::Relaxed) > 10);
}

const RESOURCES: [&str; 3] = ["cores", "ram", "disk"];
const PROJECTS: [&str; 3] = ["project/a", "project/b", "project/c"];
const DOMAIN: &str = "domain";

/// Reads every provider, then reads them all again: generations only grow, so when every one
/// is the same in both reads nothing changed in between and the first read is a consistent
/// snapshot (of the moment between the two). `None` when something changed meanwhile.
async fn snapshot(quota: &Quota) -> Option<BTreeMap<ProviderId, mongotx::quota::Provider>> {
    let mut reads = Vec::new();
    for _ in 0..2 {
        let mut all = BTreeMap::new();
        for scope in PROJECTS.iter().chain([&DOMAIN]) {
            for p in quota.usage(scope).await.ok()? {
                all.insert(p.id.clone(), p);
            }
        }
        reads.push(all);
    }
    let (first, second) = (&reads[0], &reads[1]);
    let same = first.len() == second.len()
        && first
            .iter()
            .all(|(id, p)| second.get(id).is_some_and(|q| q.generation == p.generation));
    same.then(|| reads.swap_remove(0))
}

fn check_snapshot(all: &BTreeMap<ProviderId, mongotx::quota::Provider>) {
    for (id, p) in all {
        assert!(p.usage <= p.limit, "over the limit: {p:?}");
        let sum: i64 = p.allocations.iter().map(|a| a.amount).sum();
        assert_eq!(p.usage, sum, "{id}");
    }
    for resource in RESOURCES {
        let domain = &all[&ProviderId::new(DOMAIN, resource)];
        let children: i64 = PROJECTS
            .iter()
            .map(|s| all[&ProviderId::new(*s, resource)].usage)
            .sum();
        assert_eq!(
            domain.usage, children,
            "{resource}: the domain is the sum of its projects"
        );
    }
    // Every request appears on all three resources of its project and of the domain, or nowhere.
    let mut places: BTreeMap<(String, String), BTreeSet<ProviderId>> = BTreeMap::new();
    for p in all.values() {
        for a in &p.allocations {
            places
                .entry((a.consumer.clone(), a.request.clone()))
                .or_default()
                .insert(p.id.clone());
        }
    }
    for ((consumer, request), at) in places {
        assert_eq!(
            at.len(),
            6,
            "partial allocation of {consumer}/{request}: {at:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_resources_in_a_hierarchy_are_all_or_nothing() {
    let t = TestDb::new().await;
    let quotas = quotas(&t).await;
    for resource in RESOURCES {
        quotas[0]
            .create(NewProvider::new((DOMAIN, resource), 600))
            .await
            .unwrap();
        for project in PROJECTS {
            quotas[0]
                .create(NewProvider::new((project, resource), 300).parent((DOMAIN, resource)))
                .await
                .unwrap();
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let observer = {
        let (quota, stop, tally) = (quotas[0].clone(), stop.clone(), tally.clone());
        tokio::spawn(async move {
            let mut inconsistent = 0_u64;
            while !stop.load(Ordering::SeqCst) {
                match snapshot(&quota).await {
                    Some(all) => {
                        check_snapshot(&all);
                        tally.observations.fetch_add(1, Ordering::Relaxed);
                    }
                    None => inconsistent += 1,
                }
            }
            inconsistent
        })
    };
    let held = {
        let tally = tally.clone();
        race(
            &quotas,
            Duration::from_secs(15),
            move |quota, task, until| {
                let tally = tally.clone();
                async move {
                    let mut mine: Vec<String> = Vec::new();
                    let mut n = 0;
                    while Instant::now() < until {
                        let (project, amounts, release) = {
                            let mut rng = rand::rng();
                            (
                                PROJECTS[rng.random_range(0..PROJECTS.len())],
                                [
                                    rng.random_range(1..=40_i64),
                                    rng.random_range(1..=40_i64),
                                    rng.random_range(1..=40_i64),
                                ],
                                rng.random_bool(0.45),
                            )
                        };
                        if release && !mine.is_empty() {
                            let consumer = mine.remove(0);
                            let released = quota.release(&consumer).await.unwrap();
                            assert_eq!(released.returned.len(), 6);
                            tally.released.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        n += 1;
                        let consumer = format!("t{task}-{n}");
                        let mut request = Request::new(&consumer);
                        for (resource, amount) in RESOURCES.iter().zip(amounts) {
                            request = request.take((project, *resource), amount);
                        }
                        match quota.consume(&request).await {
                            Ok(_) => {
                                mine.push(consumer);
                                tally.consumed.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(QuotaError::QuotaExceeded { .. }) => {
                                tally.refused.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) if e.is_retryable() => {
                                // Contended after the retry budget: nothing was taken.
                            }
                            Err(other) => panic!("unexpected refusal: {other}"),
                        }
                    }
                    mine.into_iter().map(|c| (c, 0)).collect()
                }
            },
        )
        .await
    };
    stop.store(true, Ordering::SeqCst);
    let inconsistent = observer.await.expect("observer saw a violation");
    let all = snapshot(&quotas[0]).await.expect("quiet snapshot");
    check_snapshot(&all);
    let holders: BTreeSet<String> = all
        .values()
        .flat_map(|p| p.allocations.iter().map(|a| a.consumer.clone()))
        .collect();
    assert_eq!(
        holders,
        held.keys().cloned().collect(),
        "exactly the live consumers hold quota"
    );
    println!(
        "consumed={} refused={} released={} consistent snapshots={} inconsistent={}",
        tally.consumed.load(Ordering::Relaxed),
        tally.refused.load(Ordering::Relaxed),
        tally.released.load(Ordering::Relaxed),
        tally.observations.load(Ordering::Relaxed),
        inconsistent
    );
    // Progress, not speed: enough rounds to have raced, even on a loaded machine.
    assert!(tally.consumed.load(Ordering::Relaxed) > 20);
    assert!(tally.observations.load(Ordering::Relaxed) > 0);
}
