//! Rows on a real network shape: toxiproxy in front of the server adds a fixed latency each way,
//! and at each latency the run measures, against one conditional update in the same run, a commit
//! of k documents (one collection, and spread over k collections) in both finishing modes, what a
//! native MongoDB transaction's k + 1 sequential round trips cost, one operation of each domain
//! module, and the throughput of two-document transfers from many clients.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, Document};
use mongodb::options::ClientOptions;
use mongodb::{Client, Collection, Database};
use mongotx::obt::{NewObt, Obt};
use mongotx::options::{Finish, TxnOptions};
use mongotx::queue::{Batches, NewBatch};
use mongotx::quota::{NewProvider, Quota, Request};
use mongotx::ratelimit::{Attempt, Limit, Priority, RateLimits};
use mongotx::testkit::toxiproxy::Toxiproxy;
use mongotx::{Adjust, CollectionSpec, Repository, Store, Transactions};
use rand::Rng;

use crate::{micros, stats, Account};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Document counts per commit.
pub(crate) const KS: [usize; 3] = [1, 4, 16];
/// Client counts for the transfer throughput.
pub(crate) const CLIENTS: [usize; 3] = [1, 8, 32];
/// Accounts the transfers pick from.
const ACCOUNTS: usize = 256;
/// Document sets a commit row rotates through, so that a commit never meets the documents the
/// previous one is still freeing in the background.
const SETS: usize = 8;

/// How one commit row lays its documents out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// All k documents in one collection.
    One,
    /// One document in each of k collections.
    Spread,
}

/// How a commit row commits: where its documents are, whether it returns before finishing, and
/// whether a round's writes go as one bulkWrite (MongoDB 8.0+) or as one command each (older
/// servers, or `StoreBuilder::batch_writes(false)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mode {
    pub(crate) layout: Layout,
    pub(crate) finish: Finish,
    pub(crate) bulk: bool,
}

impl Mode {
    const fn new(layout: Layout, finish: Finish, bulk: bool) -> Mode {
        Mode {
            layout,
            finish,
            bulk,
        }
    }
}

/// The commit rows' modes, in the order they are measured and printed.
pub(crate) const MODES: [Mode; 5] = [
    Mode::new(Layout::Spread, Finish::InBackground, true),
    Mode::new(Layout::One, Finish::InBackground, true),
    Mode::new(Layout::Spread, Finish::InBackground, false),
    Mode::new(Layout::Spread, Finish::BeforeReturning, true),
    Mode::new(Layout::One, Finish::BeforeReturning, true),
];

/// Everything measured at one latency (medians in µs, throughput in transfers per second).
#[derive(Debug, Clone)]
pub(crate) struct AtLatency {
    pub(crate) one_way_ms: u64,
    pub(crate) update_us: f64,
    /// (k, mode, median µs).
    pub(crate) commits: Vec<(usize, Mode, f64)>,
    /// (k, median µs of k + 1 sequential conditional updates).
    pub(crate) native: Vec<(usize, f64)>,
    /// (k, median µs of k + 1 concurrent conditional updates, one per collection).
    pub(crate) floor: Vec<(usize, f64)>,
    /// (k, median µs of k of those updates in one bulkWrite with the last on its own), where the
    /// server has bulkWrite.
    pub(crate) floor_bulk: Vec<(usize, f64)>,
    /// (operation, median µs).
    pub(crate) domain: Vec<(&'static str, f64)>,
    /// (clients, transfers per second, conflicts retried).
    pub(crate) throughput: Vec<(usize, f64, u64)>,
}

impl AtLatency {
    /// The median of the commit row (k, mode).
    pub(crate) fn commit(&self, k: usize, mode: Mode) -> Option<f64> {
        self.commits
            .iter()
            .find(|(kk, m, _)| *kk == k && *m == mode)
            .map(|c| c.2)
    }
}

/// The server's address, for toxiproxy's upstream: the single host of `uri`.
async fn upstream(uri: &str) -> Result<SocketAddr, Error> {
    let options = ClientOptions::parse(uri).await?;
    let [host] = options.hosts.as_slice() else {
        return Err("the network rows need a server URI with a single host".into());
    };
    let text = host.to_string();
    let found = tokio::net::lookup_host(text.as_str()).await?.next();
    found.ok_or_else(|| format!("{text} does not resolve").into())
}

/// A client that goes through the proxy, with room for the 17 concurrent writes of a 16-document
/// commit and the background finishing of the one before.
async fn proxied(listen: SocketAddr, pool: u32) -> Result<Client, Error> {
    let mut options =
        ClientOptions::parse(format!("mongodb://{listen}/?directConnection=true")).await?;
    options.max_pool_size = Some(pool);
    options.min_pool_size = Some(pool.min(40));
    Ok(Client::with_options(options)?)
}

/// Runs every row at each one-way latency in `latencies` (milliseconds) and prints them.
pub(crate) async fn rows(
    uri: &str,
    db_name: &str,
    latencies: &[u64],
    samples: usize,
    seconds: u64,
) -> Result<Vec<AtLatency>, Error> {
    let toxiproxy = Toxiproxy::start(upstream(uri).await?).await?;
    let mut all = Vec::new();
    for &ms in latencies {
        toxiproxy.set_latency(Duration::from_millis(ms)).await?;
        let client = proxied(toxiproxy.listen(), 64).await?;
        let db = client.database(&format!("{db_name}_net{ms}"));
        let at = at_latency(&db, toxiproxy.listen(), ms, samples, seconds).await;
        db.drop().await?;
        let at = at?;
        print(&at);
        all.push(at);
    }
    toxiproxy.set_latency(Duration::ZERO).await?;
    Ok(all)
}

async fn accounts(store: &Store, name: &str) -> Result<Repository<Account>, Error> {
    let spec = CollectionSpec::new(name, 1, include_str!("../../../schemas/accounts.json"))?;
    Ok(store.repository::<Account>(spec).await?)
}

/// One conditional update of the raw driver on document `id` (version `v` → `v + 1`).
async fn conditional_update(raw: &Collection<Document>, id: &str, v: i64) -> Result<(), Error> {
    let r = raw
        .update_one(
            doc! { "_id": id, "_version": v, "_txn": null },
            doc! { "$set": { "owner": "P" }, "$inc": { "_version": 1_i64 } },
        )
        .await?;
    if r.matched_count != 1 {
        return Err(
            format!("raw conditional update of {id} at version {v} matched nothing").into(),
        );
    }
    Ok(())
}

/// Times one conditional update of document "u", whose version `v` it moves on.
async fn timed_update(raw: &Collection<Document>, v: &mut i64) -> Result<Duration, Error> {
    let t = Instant::now();
    conditional_update(raw, "u", *v).await?;
    *v += 1;
    Ok(t.elapsed())
}

async fn at_latency(
    db: &Database,
    listen: SocketAddr,
    ms: u64,
    samples: usize,
    seconds: u64,
) -> Result<AtLatency, Error> {
    let store = Store::new(db.clone());
    let raw = db.collection::<Document>("raw");
    raw.insert_one(doc! { "_id": "u", "owner": "O", "_version": 1_i64 })
        .await?;
    let mut raw_version = 1_i64;
    let mut baseline = Vec::new();
    let warmup = (samples / 5).max(5);
    // Warm-up: the pool fills (its connections are made in the background) and the server's
    // code paths get compiled before anything is timed.
    for _ in 0..warmup * 4 {
        timed_update(&raw, &mut raw_version).await?;
    }
    let rtt = {
        let mut probe = Vec::new();
        for _ in 0..warmup {
            probe.push(timed_update(&raw, &mut raw_version).await?);
        }
        stats(probe).median
    };
    // Each commit is timed alone: the finishing a commit leaves in the background (its commit
    // point, finishes and end: three rounds) is over before the next one starts.
    let settle = rtt * 6 + Duration::from_millis(2);
    let one = accounts(&store, "accounts").await?;
    let mut spread = Vec::new();
    for c in 0..16 {
        spread.push(accounts(&store, &format!("spread{c}")).await?);
    }
    // The commit path warms up too (the test server is a JVM: its compiler needs some thousand
    // passes through a code path before it runs fast).
    let txns = Transactions::new(&store);
    for repo in &spread {
        repo.insert(&Account {
            id: "warm".into(),
            owner: "W".into(),
            balance: 0,
        })
        .await?;
    }
    for round in 0..warmup * 60 {
        let tx = txns.begin();
        for repo in &spread {
            tx.adjust(
                repo,
                "warm",
                round as i64 + 1,
                &Adjust::new().by("balance", 1_i64),
            )
            .await?;
        }
        tx.commit().await?;
    }
    let mut commits = Vec::new();
    for mode in MODES {
        let store = Store::builder(db.clone()).batch_writes(mode.bulk).build();
        let txns = Transactions::with_options(&store, TxnOptions::default().finish(mode.finish));
        for k in KS {
            let repos: Vec<&Repository<Account>> = match mode.layout {
                Layout::One => vec![&one; k],
                Layout::Spread => spread.iter().take(k).collect(),
            };
            let tag = format!("{:?}-{:?}-{}-{k}", mode.finish, mode.layout, mode.bulk);
            let mut versions = [1_i64; SETS];
            for set in 0..SETS {
                for (i, repo) in repos.iter().enumerate() {
                    repo.insert(&Account {
                        id: format!("{tag}-{set}-{i}"),
                        owner: "T".into(),
                        balance: 0,
                    })
                    .await?;
                }
            }
            let mut got = Vec::with_capacity(samples);
            for round in 0..samples + warmup {
                let set = round % SETS;
                let tx = txns.begin();
                for (i, repo) in repos.iter().enumerate() {
                    tx.adjust(
                        repo,
                        format!("{tag}-{set}-{i}"),
                        versions[set],
                        &Adjust::new().by("balance", 1_i64),
                    )
                    .await?;
                }
                let t = Instant::now();
                tx.commit().await?;
                let took = t.elapsed();
                versions[set] += 1;
                tokio::time::sleep(settle).await;
                baseline.push(timed_update(&raw, &mut raw_version).await?);
                if round >= warmup {
                    got.push(took);
                }
            }
            commits.push((k, mode, micros(stats(got).median)));
        }
    }

    // The floor of any one-round protocol: k + 1 conditional updates sent at once, one per
    // collection, with the raw driver (what the server and the machine make of that many
    // concurrent writes, with no mongotx at all); and where the server has bulkWrite, the same
    // writes as the parallel commit sends them: k of them in one bulkWrite, one on its own.
    // Each document's version moves on by two per round (one for each form).
    let mut floor = Vec::new();
    let mut floor_bulk = Vec::new();
    for k in KS {
        let colls: Vec<Collection<Document>> = (0..=k)
            .map(|c| db.collection(&format!("floor{c}")))
            .collect();
        let id = format!("floor{k}");
        for coll in &colls {
            coll.insert_one(doc! { "_id": &id, "owner": "O", "_version": 1_i64 })
                .await?;
        }
        let mut got = Vec::with_capacity(samples);
        let mut bulk = Vec::with_capacity(samples);
        for round in 0..samples + warmup {
            let version = 2 * round as i64 + 1;
            // Timed as the commits are: after a pause, not back to back.
            tokio::time::sleep(settle).await;
            let t = Instant::now();
            futures::future::try_join_all(
                colls
                    .iter()
                    .map(|coll| conditional_update(coll, &id, version)),
            )
            .await?;
            let separate = t.elapsed();
            tokio::time::sleep(settle).await;
            let t = Instant::now();
            let together = bulk_floor(db, &colls, &id, version).await?;
            if round >= warmup {
                got.push(separate);
                if together {
                    bulk.push(t.elapsed());
                }
            }
        }
        floor.push((k, micros(stats(got).median)));
        if !bulk.is_empty() {
            floor_bulk.push((k, micros(stats(bulk).median)));
        }
    }

    // A native transaction writes its k documents one after the other, then commits: k + 1
    // sequential round trips, each a conditional update here.
    let mut native = Vec::new();
    for k in KS {
        let ids: Vec<String> = (0..=k).map(|i| format!("native{k}-{i}")).collect();
        for id in &ids {
            raw.insert_one(doc! { "_id": id, "owner": "O", "_version": 1_i64 })
                .await?;
        }
        let mut got = Vec::with_capacity(samples);
        for round in 0..samples + warmup {
            let t = Instant::now();
            for id in &ids {
                conditional_update(&raw, id, round as i64 + 1).await?;
            }
            if round >= warmup {
                got.push(t.elapsed());
            }
        }
        native.push((k, micros(stats(got).median)));
    }

    let domain = domain_rows(&store, samples, warmup).await?;
    for _ in 0..samples {
        baseline.push(timed_update(&raw, &mut raw_version).await?);
    }
    let update_us = micros(stats(baseline).median);

    let mut throughput = Vec::new();
    let bank = accounts(&store, "bank").await?;
    for i in 0..ACCOUNTS {
        bank.insert(&Account {
            id: format!("b{i}"),
            owner: "B".into(),
            balance: 1_000_000,
        })
        .await?;
    }
    for clients in CLIENTS {
        let (rate, conflicts) = transfers(db.name(), listen, clients, seconds).await?;
        throughput.push((clients, rate, conflicts));
    }
    Ok(AtLatency {
        one_way_ms: ms,
        update_us,
        commits,
        native,
        floor,
        floor_bulk,
        domain,
        throughput,
    })
}

/// The bulk floor's round: a bulkWrite of the conditional updates of `id` in every collection of
/// `colls` but the last, and one update in the last, sent at once (each at `version`, moving it
/// on by one). `false` when the server has no bulkWrite (nothing ran).
async fn bulk_floor(
    db: &Database,
    colls: &[Collection<Document>],
    id: &str,
    version: i64,
) -> Result<bool, Error> {
    use mongodb::options::UpdateOneModel;
    let Some((last, rest)) = colls.split_last() else {
        return Ok(false);
    };
    let models = rest.iter().map(|coll| {
        UpdateOneModel::builder()
            .namespace(coll.namespace())
            .filter(doc! { "_id": id, "_version": version + 1, "_txn": null })
            .update(doc! { "$set": { "owner": "P" }, "$inc": { "_version": 1_i64 } })
            .build()
    });
    let (together, alone) = futures::join!(
        async { db.client().bulk_write(models).ordered(false).await },
        conditional_update(last, id, version + 1),
    );
    alone?;
    match together {
        Ok(done) if done.matched_count == rest.len() as i64 => Ok(true),
        Ok(done) => Err(format!(
            "the bulk floor matched {} of {}",
            done.matched_count,
            rest.len()
        )
        .into()),
        Err(e)
            if matches!(
                *e.kind,
                mongodb::error::ErrorKind::IncompatibleServer { .. }
            ) =>
        {
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

/// One operation of each domain module, `samples` times each (the setup of each untimed).
async fn domain_rows(
    store: &Store,
    samples: usize,
    warmup: usize,
) -> Result<Vec<(&'static str, f64)>, Error> {
    let mut out = Vec::new();

    let quota = Quota::open(store).await?;
    quota
        .create(NewProvider::new(("bench", "cores"), i64::MAX / 4))
        .await?;
    let mut got = Vec::new();
    for i in 0..samples + warmup {
        let consumer = format!("c{i}");
        let request = Request::new(consumer.clone()).take(("bench", "cores"), 1);
        let t = Instant::now();
        quota.consume(&request).await?;
        let took = t.elapsed();
        quota.release(&consumer).await?;
        if i >= warmup {
            got.push(took);
        }
    }
    out.push(("quota consume", micros(stats(got).median)));

    let obt = Obt::open(store).await?;
    let mut got = Vec::new();
    for i in 0..samples + warmup {
        let id = format!("o{i}");
        obt.create(NewObt::new(&id, "owner-a")).await?;
        let t = Instant::now();
        obt.preempt(&id, "owner-a", "owner-b").await?;
        if i >= warmup {
            got.push(t.elapsed());
        }
    }
    out.push(("OBT preempt", micros(stats(got).median)));

    let limits = RateLimits::open(store).await?;
    limits
        .define(
            "api",
            Limit::new(1_000_000, Duration::from_secs(3600)).reserved(1_000),
        )
        .await?;
    let mut got = Vec::new();
    for i in 0..samples + warmup {
        let t = Instant::now();
        let granted = limits.try_reserve(&["api"], 1, Priority::High).await?;
        let took = t.elapsed();
        let Attempt::Granted(r) = granted else {
            return Err("a reserve was refused on an idle limiter".into());
        };
        limits.settle(&r, 0).await?;
        if i >= warmup {
            got.push(took);
        }
    }
    out.push(("rate-limiter reserve", micros(stats(got).median)));

    let batches = Batches::open(store).await?;
    let mut got = Vec::new();
    for i in 0..samples + warmup {
        let batch = batches
            .add(&NewBatch::new(format!("s{i}"), format!("h{i}"), "payload"))
            .await?;
        let t = Instant::now();
        let claim = batches
            .claim(&batch, "bench", Duration::from_secs(60))
            .await?;
        let took = t.elapsed();
        if claim.is_none() {
            return Err(format!("batch h{i} could not be claimed").into());
        }
        if i >= warmup {
            got.push(took);
        }
    }
    out.push(("queue claim", micros(stats(got).median)));
    Ok(out)
}

/// Transfers of one unit between two random accounts of `bank` from `clients` clients (each its
/// own connection pool and store) for `seconds`; returns committed transfers per second and the
/// conflicts retried.
async fn transfers(
    db_name: &str,
    listen: SocketAddr,
    clients: usize,
    seconds: u64,
) -> Result<(f64, u64), Error> {
    let mut banks = Vec::with_capacity(clients);
    for _ in 0..clients {
        let client = proxied(listen, 8).await?;
        let store = Store::new(client.database(db_name));
        let bank = accounts(&store, "bank").await?;
        let txns =
            Transactions::with_options(&store, TxnOptions::default().finish(Finish::InBackground));
        banks.push((bank, txns));
    }
    drive_transfers(banks, ACCOUNTS, seconds).await
}

/// Runs transfers of one unit between two random accounts `b0`.. of `accounts` from each
/// (repository, transactions) of `banks` at once for `seconds`; returns committed transfers per
/// second and the transfers that failed (conflicts).
pub(crate) async fn drive_transfers(
    banks: Vec<(Repository<Account>, Transactions)>,
    accounts: usize,
    seconds: u64,
) -> Result<(f64, u64), Error> {
    let done = Arc::new(AtomicU64::new(0));
    let conflicts = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for (bank, txns) in banks {
        // Connections first: the measured window is about transfers, not handshakes.
        bank.get("b0").await?;
        let (done, conflicts, stop) = (done.clone(), conflicts.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let (a, b) = {
                    let mut rng = rand::rng();
                    let a = rng.random_range(0..accounts);
                    let b = (a + rng.random_range(1..accounts)) % accounts;
                    (format!("b{a}"), format!("b{b}"))
                };
                match transfer(&bank, &txns, &a, &b).await {
                    Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                    Err(_) => conflicts.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let counted = done.load(Ordering::Relaxed);
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await?;
    }
    Ok((
        counted as f64 / elapsed.as_secs_f64(),
        conflicts.load(Ordering::Relaxed),
    ))
}

/// Reads both accounts and moves one unit from `a` to `b` at the versions read.
async fn transfer(
    bank: &Repository<Account>,
    txns: &Transactions,
    a: &str,
    b: &str,
) -> Result<(), Error> {
    let (from, to) = tokio::try_join!(bank.get(a), bank.get(b))?;
    let tx = txns.begin();
    tx.adjust(bank, a, from.version, &Adjust::new().by("balance", -1_i64))
        .await?;
    tx.adjust(bank, b, to.version, &Adjust::new().by("balance", 1_i64))
        .await?;
    tx.commit().await?;
    Ok(())
}

fn print(at: &AtLatency) {
    let ratio = |us: f64| us / at.update_us;
    println!(
        "\nnetwork: {} ms one way (toxiproxy), one conditional update {:.0} µs (median)",
        at.one_way_ms, at.update_us
    );
    println!(
        "{:<58} {:>12} {:>14}",
        "commit of k documents", "median µs", "/ one update"
    );
    for (k, mode, us) in &at.commits {
        let label = format!(
            "k = {k:<2} {}, {}{}",
            match mode.layout {
                Layout::One => "one collection",
                Layout::Spread => "spread",
            },
            match mode.finish {
                Finish::InBackground => "returns before finishing",
                _ => "finishes first",
            },
            if mode.bulk { "" } else { ", no bulkWrite" }
        );
        println!("{label:<58} {us:>12.0} {:>13.2}x", ratio(*us));
    }
    for (k, us) in &at.floor {
        let label = format!("k = {k:<2} floor ({} concurrent driver updates)", k + 1);
        println!("{label:<58} {us:>12.0} {:>13.2}x", ratio(*us));
    }
    for (k, us) in &at.floor_bulk {
        let label = format!("k = {k:<2} floor (bulkWrite of {k} beside 1 update)");
        println!("{label:<58} {us:>12.0} {:>13.2}x", ratio(*us));
    }
    for (k, us) in &at.native {
        let label = format!("k = {k:<2} native equivalent ({} round trips)", k + 1);
        println!("{label:<58} {us:>12.0} {:>13.2}x", ratio(*us));
    }
    for (name, us) in &at.domain {
        println!("{name:<58} {us:>12.0} {:>13.2}x", ratio(*us));
    }
    println!(
        "{:<58} {:>12} {:>14}",
        "2-document transfers", "per second", "conflicts"
    );
    for (clients, rate, conflicts) in &at.throughput {
        println!(
            "{:<58} {rate:>12.0} {conflicts:>14}",
            format!("{clients} clients")
        );
    }
}
