//! Scale rows: what a query costs next to held documents, and commit latency up to 256
//! documents, each next to the raw driver measured in the same run (GC throughput is `gc`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId, Document};
use futures::StreamExt;
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use mongodb::options::ClientOptions;
use mongodb::{Client, Collection, Database};
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::{Finish, TxnOptions};
use mongotx::{Adjust, CollectionSpec, Query, Repository, Store, Transactions};

use crate::{stats, Account};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Counts the commands a client starts while switched on.
#[derive(Clone, Default)]
struct Counter {
    on: Arc<AtomicBool>,
    seen: Arc<AtomicUsize>,
}

impl Counter {
    async fn client(&self, uri: &str) -> Result<Client> {
        let mut options = ClientOptions::parse(uri).await?;
        let counter = self.clone();
        options.command_event_handler = Some(EventHandler::callback(move |event| {
            if matches!(event, CommandEvent::Started(_)) && counter.on.load(Ordering::SeqCst) {
                counter.seen.fetch_add(1, Ordering::SeqCst);
            }
        }));
        Ok(Client::with_options(options)?)
    }

    async fn count<T>(&self, work: impl std::future::Future<Output = T>) -> (T, usize) {
        self.seen.store(0, Ordering::SeqCst);
        self.on.store(true, Ordering::SeqCst);
        let out = work.await;
        self.on.store(false, Ordering::SeqCst);
        (out, self.seen.load(Ordering::SeqCst))
    }
}

fn spec(name: &str) -> Result<CollectionSpec> {
    Ok(CollectionSpec::new(
        name,
        1,
        include_str!("../../../schemas/accounts.json"),
    )?)
}

/// An account as mongotx stores it (schema version 1, version 1), for raw bulk inserts.
fn stored(id: String, owner: &str, balance: i64) -> Document {
    doc! { "_id": id, "owner": owner, "balance": balance, "_schema": 1_i64, "_version": 1_i64 }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Median of `samples` runs of `op` (after a fifth as many unmeasured).
async fn median<F, Fut, T>(samples: usize, mut op: F) -> Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    // A fifth as many warm-up runs first: the local server is a JVM.
    for _ in 0..samples / 5 {
        op().await?;
    }
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        op().await?;
        times.push(t.elapsed());
    }
    Ok(stats(times).median)
}

/// Medians of `samples` runs of `a` and of `b`, taken in turns (a, b, a, b, ...) after half as
/// many unmeasured turns, so that the server's warming up and any drift weigh on both alike: a
/// ratio of the two is then the ratio of their costs, not of the moments they ran at.
async fn paired_medians<A, FutA, TA, B, FutB, TB>(
    samples: usize,
    mut a: A,
    mut b: B,
) -> Result<(Duration, Duration)>
where
    A: FnMut() -> FutA,
    FutA: std::future::Future<Output = Result<TA>>,
    B: FnMut() -> FutB,
    FutB: std::future::Future<Output = Result<TB>>,
{
    for _ in 0..samples / 2 {
        a().await?;
        b().await?;
    }
    let (mut times_a, mut times_b) = (Vec::with_capacity(samples), Vec::with_capacity(samples));
    for _ in 0..samples {
        let t = Instant::now();
        a().await?;
        times_a.push(t.elapsed());
        let t = Instant::now();
        b().await?;
        times_b.push(t.elapsed());
    }
    Ok((stats(times_a).median, stats(times_b).median))
}

/// How long the query rows warm the server up before they measure.
const WARM_UP: Duration = Duration::from_secs(5);

/// One query row: H held, commands per query, and the two ratios to the raw driver.
pub(crate) struct QueryRow {
    pub(crate) held: usize,
    pub(crate) commands: usize,
    pub(crate) filter_ratio: f64,
    pub(crate) sorted_ratio: f64,
}

/// What the scale rows measured, for the charts.
#[derive(Default)]
pub(crate) struct ScaleRun {
    pub(crate) queries: Vec<QueryRow>,
    /// (k, commit / one update).
    pub(crate) commits: Vec<(usize, f64)>,
}

/// The tables; returns what they measured.
pub(crate) async fn rows(uri: &str, db_name: &str, samples: usize) -> Result<ScaleRun> {
    let counter = Counter::default();
    let client = counter.client(uri).await?;
    let db = client.database(db_name);
    let store = Store::new(db.clone());
    let mut run = ScaleRun::default();
    queries(&store, &db, &counter, samples * 2, &mut run).await?;
    commits(&store, &db, samples, &mut run).await?;
    modes(uri, &db, samples).await?;
    Ok(run)
}

/// Query cost next to H documents held by a pending transaction, H = 0 .. 10,000.
async fn queries(
    store: &Store,
    db: &Database,
    counter: &Counter,
    samples: usize,
    run: &mut ScaleRun,
) -> Result<()> {
    let repo: Repository<Account> = store.repository(spec("scale_query")?).await?;
    let raw: Collection<Document> = db.collection("scale_query");
    // 10 targets and 10,000 others, inserted raw in the stored shape.
    let docs: Vec<Document> = (0..10_010)
        .map(|i| {
            let owner = if i < 10 { "target" } else { "crowd" };
            stored(format!("q{i:05}"), owner, i as i64)
        })
        .collect();
    raw.insert_many(docs).await?;
    let filter = doc! { "owner": "target" };
    let pending = ObjectId::new();
    let hour = bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() + 3_600_000);
    db.collection::<Document>(mongotx::collections::TRANSACTIONS_COLLECTION)
        .insert_one(doc! {
            "_id": pending, "state": "staging", "created": bson::DateTime::now(), "deadline": hour,
            "entries": [{ "coll": "scale_phantoms", "id": "missing", "expected": 0_i64, "applied": 1_i64,
                          "schema": 1_i64, "op": { "kind": "insert", "doc": {} } }],
        })
        .await?;
    // The server's JIT takes a few hundred scans of 10,000 documents to settle (a raw find
    // measured before then is slower than one measured after): warm both queries up first, so
    // that the H = 0 row is not measured on a colder server than the rows after it.
    let warm = Instant::now();
    while warm.elapsed() < WARM_UP {
        repo.find(Query::new().filter(filter.clone())).await?;
        raw.find(filter.clone()).await?.collect::<Vec<_>>().await;
    }
    println!("\nquery cost next to H documents held by a pending transaction (10,010 documents, the filter matches 10; {samples} samples in turns with the raw find, after {} s of both)", WARM_UP.as_secs());
    println!("| H held | commands per query | find(filter) / raw | find(filter, sort desc, limit 10) / raw |");
    println!("| ---: | ---: | ---: | ---: |");
    let mut held = 0;
    for h in [0_usize, 100, 1_000, 10_000] {
        // Hold the next h - held of the crowd (a change of balance, not committed).
        let ids: Vec<String> = (10 + held..10 + h).map(|i| format!("q{i:05}")).collect();
        if !ids.is_empty() {
            raw.update_many(
                doc! { "_id": { "$in": ids } },
                vec![doc! { "$set": {
                    "_txn": pending,
                    "_hold": { "exp": hour, "op": "update", "restore": { "balance": "$balance", "_version": 1_i64 }, "unset": [], "changed": ["balance", "_version"] },
                    "balance": { "$add": ["$balance", 1_000_000_i64] },
                    "_version": 2_i64,
                } }],
            )
            .await?;
        }
        held = h;
        let (found, commands) = counter
            .count(repo.find(Query::new().filter(filter.clone())))
            .await;
        if found?.len() != 10 {
            return Err("the query did not find its 10 documents".into());
        }
        let sorted = || {
            Query::new()
                .filter(filter.clone())
                .sort(doc! { "balance": -1 })
                .limit(10)
        };
        let (find, base) = paired_medians(
            samples,
            || async { Ok(repo.find(Query::new().filter(filter.clone())).await?) },
            || async {
                let c = raw.find(filter.clone()).await?;
                Ok(c.collect::<Vec<_>>().await)
            },
        )
        .await?;
        let (find_sorted, base_sorted) = paired_medians(
            samples,
            || async { Ok(repo.find(sorted()).await?) },
            || async {
                let c = raw
                    .find(filter.clone())
                    .sort(doc! { "balance": -1 })
                    .limit(10)
                    .await?;
                Ok(c.collect::<Vec<_>>().await)
            },
        )
        .await?;
        let row = QueryRow {
            held: h,
            commands,
            filter_ratio: find.as_secs_f64() / base.as_secs_f64(),
            sorted_ratio: find_sorted.as_secs_f64() / base_sorted.as_secs_f64(),
        };
        println!(
            "| {h} | {commands} | {:.2}x ({:.2} / {:.2} ms) | {:.2}x ({:.2} / {:.2} ms) |",
            row.filter_ratio,
            ms(find),
            ms(base),
            row.sorted_ratio,
            ms(find_sorted),
            ms(base_sorted),
        );
        run.queries.push(row);
    }
    // An idle GC round next to the 10,000 pending holds.
    let gc = Gc::new(store, GcOptions::default());
    gc.run_round().await?;
    let (round, commands) = counter.count(gc.run_round()).await;
    round?;
    println!("an idle GC round next to 10,000 pending holds: {commands} commands");
    Ok(())
}

/// Commit latency for k documents (adjusts), k = 1 .. 256, next to one raw update.
async fn commits(store: &Store, db: &Database, samples: usize, run: &mut ScaleRun) -> Result<()> {
    let raw: Collection<Document> = db.collection("scale_raw");
    let repo: Repository<Account> = store.repository(spec("scale_commit")?).await?;
    let txns = Transactions::new(store);
    let samples = samples.clamp(5, 50);
    println!("\ncommit latency by k (adjusts, the default mode; {samples} samples)");
    println!("| k | commit | / one update |");
    println!("| ---: | ---: | ---: |");
    for k in [1_usize, 4, 16, 64, 256] {
        let ids: Vec<String> = (0..k).map(|i| format!("k{k}-{i:03}")).collect();
        let docs: Vec<Document> = ids.iter().map(|id| stored(id.clone(), "c", 0)).collect();
        db.collection::<Document>("scale_commit")
            .insert_many(docs)
            .await?;
        let one_update = median(samples, || async {
            Ok(raw
                .update_one(doc! { "_id": 0 }, doc! { "$inc": { "n": 1_i64 } })
                .await?)
        })
        .await?;
        let mut times = Vec::with_capacity(samples);
        for version in 1..=samples as i64 {
            times.push(commit_adjusting(&txns, &repo, &ids, version).await?);
        }
        let commit = stats(times).median;
        let ratio = commit.as_secs_f64() / one_update.as_secs_f64();
        println!("| {k} | {:.2} ms | {ratio:.2}x |", ms(commit));
        run.commits.push((k, ratio));
    }
    Ok(())
}

/// Stages an adjust of every account of `ids` (all at `version`) and returns how long the commit
/// took.
async fn commit_adjusting(
    txns: &Transactions,
    repo: &Repository<Account>,
    ids: &[String],
    version: i64,
) -> Result<Duration> {
    let tx = txns.begin();
    for id in ids {
        tx.adjust(
            repo,
            id.as_str(),
            version,
            &Adjust::new().by("balance", 1_i64),
        )
        .await?;
    }
    let t = Instant::now();
    tx.commit().await?;
    Ok(t.elapsed())
}

const MODES: [(Finish, &str); 2] = [
    (Finish::BeforeReturning, "finish before returning"),
    (Finish::InBackground, "return after the round"),
];

/// The two finishing modes side by side: commit latency for k = 1, 4, 16 and the throughput of
/// two-account transfers from 2, 8 and 32 clients, on 10 hot accounts and on 10,000.
async fn modes(uri: &str, db: &Database, samples: usize) -> Result<()> {
    let store = Store::new(db.clone());
    let raw: Collection<Document> = db.collection("scale_raw");
    let repo: Repository<Account> = store.repository(spec("scale_modes")?).await?;
    let samples = samples.clamp(20, 200);
    println!("\nfinishing modes: commit latency ({samples} samples, / one raw update measured alongside)");
    println!("| k | finish before returning | return after the round |");
    println!("| ---: | ---: | ---: |");
    for k in [1_usize, 4, 16] {
        let mut cells = Vec::new();
        for (finish, name) in MODES {
            let ids: Vec<String> = (0..k).map(|i| format!("{name}-{k}-{i:02}")).collect();
            let docs: Vec<Document> = ids.iter().map(|id| stored(id.clone(), "m", 0)).collect();
            db.collection::<Document>("scale_modes")
                .insert_many(docs)
                .await?;
            let txns = Transactions::with_options(&store, TxnOptions::default().finish(finish));
            let (mut ours, mut base) = (Vec::new(), Vec::new());
            for version in 1..=samples as i64 {
                ours.push(commit_adjusting(&txns, &repo, &ids, version).await?);
                let t = Instant::now();
                raw.update_one(doc! { "_id": 0 }, doc! { "$inc": { "n": 1_i64 } })
                    .await?;
                base.push(t.elapsed());
                if finish == Finish::InBackground {
                    // Let the background finish land before the next commit of the same documents.
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            let (ours, base) = (stats(ours).median, stats(base).median);
            cells.push(format!(
                "{:.2} ms, {:.2}x",
                ms(ours),
                ours.as_secs_f64() / base.as_secs_f64()
            ));
        }
        println!("| {k} | {} | {} |", cells[0], cells[1]);
    }
    println!(
        "\nfinishing modes: transfers per second (3 s each; conflicts retried are not counted)"
    );
    println!("| accounts | clients | finish before returning | return after the round |");
    println!("| ---: | ---: | ---: | ---: |");
    for accounts in [10_usize, 10_000] {
        let name = format!("scale_bank_{accounts}");
        let docs: Vec<Document> = (0..accounts)
            .map(|i| stored(format!("b{i}"), "b", 1_000_000))
            .collect();
        db.collection::<Document>(&name).insert_many(docs).await?;
        for clients in [2_usize, 8, 32] {
            let mut cells = Vec::new();
            for (finish, _) in MODES {
                let (rate, conflicts) =
                    transfers(uri, db.name(), &name, accounts, clients, finish).await?;
                cells.push(format!("{rate:.0} ({conflicts} conflicts)"));
            }
            println!("| {accounts} | {clients} | {} | {} |", cells[0], cells[1]);
        }
    }
    Ok(())
}

/// Transfers between random accounts of `coll` from `clients` clients (each its own client and
/// store) for three seconds; committed transfers per second and conflicts.
async fn transfers(
    uri: &str,
    db_name: &str,
    coll: &str,
    accounts: usize,
    clients: usize,
    finish: Finish,
) -> Result<(f64, u64)> {
    let mut banks = Vec::with_capacity(clients);
    for _ in 0..clients {
        let client = Client::with_uri_str(uri).await?;
        let store = Store::new(client.database(db_name));
        let bank: Repository<Account> = store.repository(spec(coll)?).await?;
        let txns = Transactions::with_options(&store, TxnOptions::default().finish(finish));
        banks.push((bank, txns));
    }
    crate::network::drive_transfers(banks, accounts, 3).await
}
