//! GC throughput: how fast runners clear a backlog of expired transactions left by coordinators
//! that died, in each of the three places a coordinator can die (before the commit point, at it,
//! after it), by backlog size, with one runner and with two on the same backlog.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, Document};
use futures::StreamExt;
use mongodb::{Client, Database};
use mongotx::gc::{Gc, GcOptions};
use mongotx::options::{Finish, TxnOptions};
use mongotx::testkit::failpoint::{self, CrashAt, Failpoint};
use mongotx::{Adjust, CollectionSpec, Repository, Store, Transactions, TxnError};

use crate::Account;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Backlog sizes measured with one runner; the largest is measured with two as well.
pub(crate) const SIZES: [usize; 3] = [100, 1_000, 10_000];

/// Transactions of each kind cleared, unmeasured, before the rows.
const WARMUP: usize = 300;

/// The throughput the GC is held to (issue 32), drawn on the chart.
pub(crate) const TARGET: f64 = 2_000.0;

/// Where the coordinators died.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Death {
    /// Before the commit point: two of four changes sent, the record never written (it goes
    /// after every apply's failpoint): the GC's sweep undoes holds that have no record.
    Before,
    /// At the commit point: record and every change in place, nobody said so: the GC commits
    /// and finishes.
    At,
    /// After the commit point: committed, documents still held: the GC finishes.
    After,
}

impl Death {
    pub(crate) const ALL: [Death; 3] = [Death::Before, Death::At, Death::After];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Death::Before => "died before the commit point",
            Death::At => "died at the commit point",
            Death::After => "died after the commit point",
        }
    }

    fn failpoint(self) -> Failpoint {
        match self {
            Death::Before => Failpoint {
                name: failpoint::APPLY_BEFORE,
                step: 2,
            },
            Death::At => Failpoint {
                name: failpoint::COMMIT_BEFORE,
                step: 0,
            },
            Death::After => Failpoint {
                name: failpoint::COMMIT_AFTER,
                step: 0,
            },
        }
    }
}

/// One measured backlog.
pub(crate) struct GcRow {
    pub(crate) death: Death,
    pub(crate) backlog: usize,
    pub(crate) runners: usize,
    pub(crate) per_second: f64,
}

fn spec(name: &str) -> Result<CollectionSpec> {
    Ok(CollectionSpec::new(
        name,
        1,
        include_str!("../../../schemas/accounts.json"),
    )?)
}

/// Every row: each death at each size with one runner, and the largest with two.
pub(crate) async fn rows(uri: &str, db_name: &str) -> Result<Vec<GcRow>> {
    let client = Client::with_uri_str(uri).await?;
    let second = Client::with_uri_str(uri).await?;
    let db = client.database(db_name);
    let store = Store::new(db.clone());
    let other = Store::new(second.database(db_name));
    println!(
        "\nGC throughput: N expired 4-document transactions whose coordinators died, default page of {}",
        GcOptions::default().batch_size
    );
    println!("| where the coordinators died | N expired | runners | took | transactions/s |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    let mut rows = Vec::new();
    let largest = SIZES[SIZES.len() - 1];
    let plan = SIZES
        .iter()
        .map(|&n| (n, 1))
        .chain(std::iter::once((largest, 2)));
    let plan: Vec<(usize, usize)> = plan.collect();
    // Every other section warms up before it measures; here the first row (100 transactions, a
    // few rounds) otherwise pays for the server's first compilation of the GC's queries and
    // writes (it cleared 500 a second where the same row after it clears thousands).
    for death in Death::ALL {
        let name = format!("bench_gc_warmup_{}", death_tag(death));
        backlog(&store, &db, &name, death, WARMUP).await?;
        clear(&[&store], &db, &name, WARMUP).await?;
        db.collection::<Document>(&name).drop().await?;
    }
    for death in Death::ALL {
        for &(n, runners) in &plan {
            let name = format!("bench_gc_{}_{n}_{runners}", death_tag(death));
            backlog(&store, &db, &name, death, n).await?;
            let stores: Vec<&Store> = [&store, &other].into_iter().take(runners).collect();
            let took = clear(&stores, &db, &name, n).await?;
            let per_second = n as f64 / took.as_secs_f64();
            println!(
                "| {} | {n} | {runners} | {:.0} ms | {per_second:.0} |",
                death.label(),
                took.as_secs_f64() * 1e3
            );
            rows.push(GcRow {
                death,
                backlog: n,
                runners,
                per_second,
            });
            db.collection::<Document>(&name).drop().await?;
        }
    }
    Ok(rows)
}

fn death_tag(death: Death) -> &'static str {
    match death {
        Death::Before => "before",
        Death::At => "at",
        Death::After => "after",
    }
}

/// Leaves `n` expired transactions of four documents each in collection `name`, each by its own
/// coordinator that stops for good at `death`'s failpoint, and waits until all have expired.
async fn backlog(store: &Store, db: &Database, name: &str, death: Death, n: usize) -> Result<()> {
    let repo: Repository<Account> = store.repository(spec(name)?).await?;
    let docs: Vec<Document> = (0..4 * n)
        .map(|i| {
            doc! { "_id": format!("g{i:06}"), "owner": "gc", "balance": 100_i64,
            "_schema": 1_i64, "_version": 1_i64 }
        })
        .collect();
    db.collection::<Document>(name).insert_many(docs).await?;
    let timeout = Duration::from_secs(2);
    let dying = || {
        Transactions::with_options(
            store,
            TxnOptions::default()
                .timeout(timeout)
                .finish(Finish::BeforeReturning)
                .fault_injector(Arc::new(CrashAt(death.failpoint()))),
        )
    };
    futures::stream::iter(0..n)
        .map(|i| {
            let (txns, repo) = (dying(), &repo);
            async move {
                let tx = txns.begin();
                for j in 0..4 {
                    let id = format!("g{:06}", 4 * i + j);
                    tx.adjust(repo, id.as_str(), 1, &Adjust::new().by("balance", 1_i64))
                        .await?;
                }
                match tx.commit().await {
                    Err(TxnError::Crashed { .. }) => Ok(()),
                    Err(e) => Err(e.into()),
                    Ok(_) => Err("the coordinator should have stopped".into()),
                }
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<Result<()>>>()
        .await
        .into_iter()
        .collect::<Result<Vec<()>>>()?;
    // The last one's deadline has passed too, by the server's clock as well.
    tokio::time::sleep(timeout + Duration::from_millis(300)).await;
    Ok(())
}

/// Runs one GC runner per store on the backlog until `n` transactions are resolved and nothing of
/// them is left (no held document in `name`, no transaction record); the time it took. Fails if
/// the runners give up first.
///
/// The rounds' counts alone do not tell: two runners may both count one transaction (a sweep that
/// read a hold just before the other runner undid it and deleted the record writes an aborted
/// record again, which a later round deletes and counts), so the backlog itself is checked once
/// the counts reach `n`.
async fn clear(stores: &[&Store], db: &Database, name: &str, n: usize) -> Result<Duration> {
    let resolved = AtomicUsize::new(0);
    let started = Instant::now();
    let give_up = started + Duration::from_secs(600);
    let held = db.collection::<Document>(name);
    let records = db.collection::<Document>(mongotx::collections::TRANSACTIONS_COLLECTION);
    let cleared = || async {
        Ok::<bool, mongodb::error::Error>(
            held.count_documents(doc! { "_txn": { "$exists": true } })
                .await?
                == 0
                && records.count_documents(doc! {}).await? == 0,
        )
    };
    let runners = stores.iter().map(|store| {
        let (resolved, cleared) = (&resolved, &cleared);
        let gc = Gc::new(store, GcOptions::default());
        async move {
            let mut idle = 0;
            while Instant::now() < give_up {
                if resolved.load(Ordering::SeqCst) >= n && cleared().await? {
                    break;
                }
                let round = gc.run_round().await?;
                let done = round.finished + round.rolled_back;
                resolved.fetch_add(done, Ordering::SeqCst);
                // The other runner may hold the rest of the backlog for a moment.
                if done == 0 {
                    idle += 1;
                    if idle > 200 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                } else {
                    idle = 0;
                }
            }
            Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
        }
    });
    for result in futures::future::join_all(runners).await {
        result?;
    }
    let took = started.elapsed();
    let done = resolved.load(Ordering::SeqCst);
    if done < n || !cleared().await? {
        return Err(format!(
            "the GC counted {done} of {n} expired transactions resolved and left some behind"
        )
        .into());
    }
    Ok(took)
}
