//! Quota rows: consume latency next to one conditional update (on a bare counter and on a
//! document shaped like the provider) by live allocations on the provider (0 to 10,000), the
//! round trips a consume sends, a three-provider consume,
//! and 32 consumers on one hot provider next to raw `$inc` writers and to the algorithm of the
//! quota's reference design (read availability and generation, write only if the generation is
//! unchanged, otherwise read again) done with the raw driver.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, Document};
use mongodb::{Collection, Database};
use mongotx::collections::PROVIDERS_COLLECTION;
use mongotx::quota::{NewProvider, ProviderId, Quota, Request};
use mongotx::testkit::test_server::TestServer;
use mongotx::Store;

use crate::{counting_client, micros, plain_client, stats};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Plenty: the benchmark is about the write, not about running out.
const LIMIT: i64 = i64::MAX / 4;
/// Concurrent consumers on the hot provider.
const TASKS: usize = 32;
/// How long each hot-provider contender runs.
const WINDOW: Duration = Duration::from_secs(2);
/// Live allocations on the provider, for the latency rows and their chart.
const LIVE: [usize; 5] = [0, 10, 100, 1_000, 10_000];
/// At most this many samples where one consume rewrites thousands of entries: the median is
/// stable long before, and 1,000 samples at 10,000 live allocations would take minutes.
const LARGE_SAMPLES: usize = 200;

/// One latency row, for the chart.
pub(crate) struct LiveRow {
    /// Allocations live on the provider.
    pub(crate) live: usize,
    /// Consume / one conditional update on a bare counter.
    pub(crate) consume: f64,
    /// A conditional update of a document the provider's size / the same on a bare counter.
    pub(crate) same_size: f64,
}

/// The rows; returns the latency rows for the chart.
pub(crate) async fn rows(
    server: &TestServer,
    db: &Database,
    n: usize,
) -> Result<Vec<LiveRow>, Error> {
    let commands = Arc::new(AtomicU64::new(0));
    let client = plain_client(server).await?;
    let db = client.database(db.name());
    let quota = Quota::open(&Store::new(db.clone())).await?;
    // The same providers through a counting client: round trips are counted there, untimed.
    let counting = counting_client(server, Arc::clone(&commands)).await?;
    let counted = Quota::open(&Store::new(counting.database(db.name()))).await?;
    let raw = db.collection::<Document>("raw_providers");

    println!(
        "\nquota, consume latency ({n} samples each, interleaved; each consume released untimed):"
    );
    println!(
        "{:<24} {:>10} {:>10} {:>16} {:>20} {:>12}",
        "live allocations",
        "median µs",
        "p90 µs",
        "/ bare update",
        "/ same-size update",
        "round trips"
    );
    let mut live_rows = Vec::new();
    for live in LIVE {
        let samples = if live >= 1_000 {
            n.min(LARGE_SAMPLES)
        } else {
            n
        };
        let handles = (&quota, &counted, &*commands);
        live_rows.push(latency_row(handles, &db, &raw, live, samples).await?);
    }
    three_providers_row(&quota, &raw, n).await?;
    // The hot provider gets a database of its own: the test server reads `held.c` (a release's
    // lookup) by scanning the collection, so the rows above would otherwise slow it down.
    let hot_db = client.database(&format!("{}_hot", db.name()));
    let hot_quota = Quota::open(&Store::new(hot_db.clone())).await?;
    let hot = hot_provider_rows(&hot_quota, &hot_db.collection("raw_providers")).await;
    hot_db.drop().await?;
    hot.map(|()| live_rows)
}

/// The conditional update a plain counter needs: take one if one is there.
async fn take_one(raw: &Collection<Document>, id: &str) -> Result<(), Error> {
    raw.update_one(
        doc! { "_id": id, "available": { "$gte": 1_i64 } },
        doc! { "$inc": { "available": -1_i64, "usage": 1_i64 } },
    )
    .await?;
    Ok(())
}

async fn give_one(raw: &Collection<Document>, id: &str) -> Result<(), Error> {
    raw.update_one(
        doc! { "_id": id },
        doc! { "$inc": { "available": 1_i64, "usage": -1_i64 } },
    )
    .await?;
    Ok(())
}

/// Consume latency on a provider holding `live` other allocations, next to a conditional
/// update of a bare counter and of a copy of the provider's document (same size, same
/// generation check as the reference design's write).
async fn latency_row(
    (quota, counted, commands): (&Quota, &Quota, &AtomicU64),
    db: &Database,
    raw: &Collection<Document>,
    live: usize,
    n: usize,
) -> Result<LiveRow, Error> {
    let provider = ProviderId::new("bench", format!("live{live}"));
    quota
        .create(NewProvider::new(provider.clone(), LIMIT))
        .await?;
    fill(quota, &provider, live).await?;
    let (bare, shaped) = (format!("bare{live}"), format!("shaped{live}"));
    raw.insert_one(doc! { "_id": &bare, "available": LIMIT, "usage": 0_i64 })
        .await?;
    let mut copy = db
        .collection::<Document>(PROVIDERS_COLLECTION)
        .find_one(doc! { "_id.scope": "bench", "_id.resource": format!("live{live}") })
        .await?
        .ok_or("the provider just created is missing")?;
    copy.insert("_id", &shaped);
    let mut generation = copy.get_i64("_version")?;
    raw.insert_one(copy).await?;

    let warmup = (n / 5).max(20);
    let (mut ours, mut bare_times, mut shaped_times) = (Vec::new(), Vec::new(), Vec::new());
    let mut round_trips = 0;
    for i in 0..n + warmup {
        let consumer = format!("c{live}-{i}");
        let request = Request::new(consumer.clone()).take(provider.clone(), 1);
        let t = Instant::now();
        quota.consume(&request).await?;
        let took = t.elapsed();
        let counted_consumer = format!("k{live}-{i}");
        let before = commands.load(Ordering::Relaxed);
        counted
            .consume(&Request::new(counted_consumer.clone()).take(provider.clone(), 1))
            .await?;
        let sent = commands.load(Ordering::Relaxed) - before;
        counted.release(&counted_consumer).await?;

        let t = Instant::now();
        take_one(raw, &bare).await?;
        let bare_took = t.elapsed();

        let t = Instant::now();
        raw.update_one(
            doc! { "_id": &shaped, "_version": generation, "available": { "$gte": 1_i64 } },
            doc! { "$inc": { "available": -1_i64, "usage": 1_i64, "_version": 1_i64 } },
        )
        .await?;
        let shaped_took = t.elapsed();
        generation += 1;

        quota.release(&consumer).await?;
        if i >= warmup {
            ours.push(took);
            bare_times.push(bare_took);
            shaped_times.push(shaped_took);
            round_trips += sent;
        }
    }
    let (ours, bare, shaped) = (stats(ours), stats(bare_times), stats(shaped_times));
    println!(
        "{:<24} {:>10.1} {:>10.1} {:>15.2}x {:>19.2}x {:>12.2}",
        format!("{live} (consume)"),
        micros(ours.median),
        micros(ours.p90),
        ours.median.as_secs_f64() / bare.median.as_secs_f64(),
        ours.median.as_secs_f64() / shaped.median.as_secs_f64(),
        round_trips as f64 / n as f64
    );
    println!(
        "{:<24} {:>10.1} {:>10.1}   (same-size update {:.1} µs)",
        format!("{live} (bare update)"),
        micros(bare.median),
        micros(bare.p90),
        micros(shaped.median)
    );
    Ok(LiveRow {
        live,
        consume: ours.median.as_secs_f64() / bare.median.as_secs_f64(),
        same_size: shaped.median.as_secs_f64() / bare.median.as_secs_f64(),
    })
}

/// Gives `provider` `live` allocations of one unit, each a different consumer's, made by
/// `consume` (so the provider is striped as its consumers would leave it), then checks it reads
/// back whole.
async fn fill(quota: &Quota, provider: &ProviderId, live: usize) -> Result<(), Error> {
    for j in 0..live {
        quota
            .consume(&Request::new(format!("holder{j}")).take(provider.clone(), 1))
            .await?;
    }
    let read = quota.provider(provider.clone()).await?;
    let amount = i64::try_from(live)?;
    if read.usage != amount || read.allocations.len() != live {
        return Err(format!(
            "provider {provider}: usage {} and {} allocations after filling {live}",
            read.usage,
            read.allocations.len()
        )
        .into());
    }
    Ok(())
}

/// A consume of three providers (one transaction), released untimed after each sample.
async fn three_providers_row(
    quota: &Quota,
    raw: &Collection<Document>,
    n: usize,
) -> Result<(), Error> {
    for resource in ["cores", "ram", "disk"] {
        quota
            .create(NewProvider::new(("bench3", resource), LIMIT))
            .await?;
    }
    raw.insert_one(doc! { "_id": "bare3", "available": LIMIT, "usage": 0_i64 })
        .await?;
    let (mut three, mut bare) = (Vec::new(), Vec::new());
    for i in 0..(n / 5).max(20) {
        let request = Request::new(format!("m{i}"))
            .take(("bench3", "cores"), 1)
            .take(("bench3", "ram"), 1)
            .take(("bench3", "disk"), 1);
        let t = Instant::now();
        quota.consume(&request).await?;
        three.push(t.elapsed());
        let t = Instant::now();
        take_one(raw, "bare3").await?;
        bare.push(t.elapsed());
        quota.release(&format!("m{i}")).await?;
    }
    let (three, bare) = (stats(three), stats(bare));
    println!(
        "consume of three providers (one transaction): median {:.1} µs, p90 {:.1} µs = {:.2}x one bare update",
        micros(three.median),
        micros(three.p90),
        three.median.as_secs_f64() / bare.median.as_secs_f64()
    );
    Ok(())
}

/// Runs `TASKS` copies of `cycle` for `WINDOW`; returns the cycles completed and failed.
async fn contend<F, Fut>(cycle: F) -> Result<(u64, u64), Error>
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), Error>> + Send,
{
    let (done, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let until = Instant::now() + WINDOW;
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (cycle, done, failed) = (cycle.clone(), Arc::clone(&done), Arc::clone(&failed));
        tasks.push(tokio::spawn(async move {
            let mut i = 0;
            while Instant::now() < until {
                i += 1;
                match cycle(task, i).await {
                    Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    Ok((done.load(Ordering::Relaxed), failed.load(Ordering::Relaxed)))
}

/// How a hot-provider cycle gives its unit back.
#[derive(Clone, Copy)]
enum Release {
    /// `release_consumed` with what the consume returned: one update.
    Consumed,
    /// `release` by consumer name: a read to find what it holds, then the update.
    Consumer,
}

/// [`TASKS`] consumers taking one unit of `hot` and giving it back in a loop.
async fn hot_cycles(
    quota: &Quota,
    hot: &ProviderId,
    writes: &Arc<AtomicU64>,
    release: Release,
) -> Result<(u64, u64), Error> {
    let (quota, writes, hot) = (quota.clone(), Arc::clone(writes), hot.clone());
    contend(move |task, i| {
        let (quota, writes, hot) = (quota.clone(), Arc::clone(&writes), hot.clone());
        async move {
            let consumer = format!("h{task}-{i}");
            let done = quota
                .consume(&Request::new(consumer.clone()).take(hot, 1))
                .await?;
            writes.fetch_add(u64::from(done.writes), Ordering::Relaxed);
            match release {
                Release::Consumed => quota.release_consumed(&done).await?,
                Release::Consumer => quota.release(&consumer).await?,
            };
            Ok(())
        }
    })
    .await
}

/// 32 consumers on one provider, each taking one unit and giving it back in a loop: mongotx,
/// raw `$inc` updates, and the reference design's generation-checked algorithm done with the raw
/// driver.
async fn hot_provider_rows(quota: &Quota, raw: &Collection<Document>) -> Result<(), Error> {
    raw.insert_one(doc! { "_id": "hot", "available": LIMIT, "usage": 0_i64 })
        .await?;
    let raw_cycles = {
        let raw = raw.clone();
        contend(move |_, _| {
            let raw = raw.clone();
            async move {
                take_one(&raw, "hot").await?;
                give_one(&raw, "hot").await
            }
        })
        .await?
    };

    let hot = ProviderId::new("bench", "hot");
    quota.create(NewProvider::new(hot.clone(), LIMIT)).await?;
    let writes = Arc::new(AtomicU64::new(0));
    let by_grant = hot_cycles(quota, &hot, &writes, Release::Consumed).await?;
    let by_consumer = hot_cycles(quota, &hot, &writes, Release::Consumer).await?;
    let left = quota.provider(hot).await?;

    raw.insert_one(doc! { "_id": "seed", "available": LIMIT, "usage": 0_i64, "_version": 0_i64 })
        .await?;
    let seed_writes = Arc::new(AtomicU64::new(0));
    let seed = {
        let (raw, seed_writes) = (raw.clone(), Arc::clone(&seed_writes));
        contend(move |_, _| {
            let (raw, seed_writes) = (raw.clone(), Arc::clone(&seed_writes));
            async move {
                loop {
                    let found = raw
                        .find_one(doc! { "_id": "seed" })
                        .await?
                        .ok_or("the counter of the reference algorithm is missing")?;
                    let generation = found.get_i64("_version")?;
                    if found.get_i64("available")? < 1 {
                        return Err("the counter of the reference algorithm ran out".into());
                    }
                    seed_writes.fetch_add(1, Ordering::Relaxed);
                    let written = raw
                        .update_one(
                            doc! { "_id": "seed", "_version": generation },
                            doc! { "$inc": { "available": -1_i64, "usage": 1_i64, "_version": 1_i64 } },
                        )
                        .await?;
                    if written.matched_count == 1 {
                        break;
                    }
                }
                raw.update_one(
                    doc! { "_id": "seed" },
                    doc! { "$inc": { "available": 1_i64, "usage": -1_i64, "_version": 1_i64 } },
                )
                .await?;
                Ok(())
            }
        })
        .await?
    };

    let per_second = |cycles: u64| cycles as f64 / WINDOW.as_secs_f64();
    let retries =
        |writes: u64, cycles: u64| writes.saturating_sub(cycles) as f64 / cycles.max(1) as f64;
    let writes = writes.load(Ordering::Relaxed);
    let seed_writes = seed_writes.load(Ordering::Relaxed);
    println!(
        "\nquota, {TASKS} consumers on one hot provider for {} s, each consuming one unit and releasing it in a loop:",
        WINDOW.as_secs()
    );
    println!(
        "  raw $inc take + give back       {:>8.0} consumes/s",
        per_second(raw_cycles.0)
    );
    for (name, ours) in [
        ("consume + release_consumed", by_grant),
        ("consume + release(consumer)", by_consumer),
    ] {
        println!(
            "  {name:<31} {:>8.0} consumes/s = {:.2}x raw; failed {}",
            per_second(ours.0),
            per_second(ours.0) / per_second(raw_cycles.0).max(f64::MIN_POSITIVE),
            ours.1,
        );
    }
    println!(
        "  (both: retries per consume {:.3}; usage after {})",
        retries(writes, by_grant.0 + by_consumer.0),
        left.usage
    );
    println!(
        "  reference algorithm (raw driver){:>8.0} consumes/s = {:.2}x raw; retries per consume {:.3}",
        per_second(seed.0),
        per_second(seed.0) / per_second(raw_cycles.0).max(f64::MIN_POSITIVE),
        retries(seed_writes, seed.0)
    );
    Ok(())
}
