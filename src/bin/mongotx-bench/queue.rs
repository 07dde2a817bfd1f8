//! Batch-queue rows: batches committed per second with 64 submitters (and 4 monitors) over 4
//! services, next to the serial bound (each service one batch per ledger cycle: one in flight,
//! committed after the ledger's delay), for two ledger delays; then one service under the
//! parallel strategy with 1, 4 and 16 independent key groups, next to the same service sent
//! serially in the same run.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::doc;
use mongodb::Database;
use mongotx::queue::{Batches, Monitor, NewBatch, Strategy, Submitter};
use mongotx::testkit::ledger::{Faults, Ledger};
use mongotx::Store;

type Error = Box<dyn std::error::Error + Send + Sync>;

const SUBMITTERS: usize = 64;
const MONITORS: usize = 4;
const SERVICES: usize = 4;

pub(crate) async fn rows(db: &Database) -> Result<(), Error> {
    println!(
        "\nbatch queue ({SUBMITTERS} submitters, {MONITORS} monitors, {SERVICES} services, \
         in-process ledger):"
    );
    println!(
        "{:<34} {:>9} {:>12} {:>14} {:>10}",
        "ledger commit delay", "batches", "committed/s", "serial bound/s", "/ bound"
    );
    for (delay_ms, per_service) in [(50u64, 25usize), (200, 8)] {
        let coll = format!("bench_batches_{delay_ms}");
        let store = Store::new(db.clone());
        let batches = Batches::with_collection(&store, &coll, Duration::from_secs(1)).await?;
        for i in 0..per_service {
            for s in 0..SERVICES {
                let h = format!("s{s}-{i:04}");
                batches.add(&NewBatch::new(format!("s{s}"), &h, &h)).await?;
            }
        }
        let delay = Duration::from_millis(delay_ms);
        let ledger = Ledger::new(delay, Faults::NONE, 1);
        let total = per_service * SERVICES;
        let crew = Crew {
            submitters: SUBMITTERS,
            // An idle submitter looks again after 50 to 150 ms: with 64 of them, one looks
            // every 1.5 ms on average, without 64 rounds per few milliseconds loading the server.
            idle: |i| Duration::from_millis(50 + (i as u64 * 37) % 101),
            monitors: MONITORS,
        };
        let took = crew.drive(db, &coll, &batches, &ledger, total).await?;
        let rate = total as f64 / took.as_secs_f64();
        let bound = SERVICES as f64 / delay.as_secs_f64();
        println!(
            "{:<34} {:>9} {:>12.1} {:>14.1} {:>9.2}x",
            format!("{delay_ms} ms"),
            total,
            rate,
            bound,
            rate / bound
        );
    }
    parallel_rows(db).await
}

/// Submitters and monitors for the parallel rows.
const PARALLEL_SUBMITTERS: usize = 16;
const PARALLEL_MONITORS: usize = 2;
/// The ledger's commit delay of the parallel rows.
const PARALLEL_DELAY: Duration = Duration::from_millis(50);

/// Batches committed per second for one service: sent serially, then under the parallel
/// strategy with the batches spread over 1, 4 and 16 key groups (each batch writes its group's
/// key), with a 50 ms ledger.
async fn parallel_rows(db: &Database) -> Result<(), Error> {
    println!(
        "
batch queue, one service, parallel strategy ({PARALLEL_SUBMITTERS} submitters, \
         {PARALLEL_MONITORS} monitors, ledger commit delay {} ms):",
        PARALLEL_DELAY.as_millis()
    );
    println!(
        "{:<34} {:>9} {:>12} {:>14} {:>10}",
        "strategy", "batches", "committed/s", "serial bound/s", "/ serial"
    );
    let bound = 1.0 / PARALLEL_DELAY.as_secs_f64();
    // A database of their own, switched to the stored format that keeps keys and strategies
    // (the rows before run on the format the benchmark's database has).
    let db = db.client().database(&format!("{}_parallel", db.name()));
    Store::new(db.clone()).set_format(2).await?;
    let db = &db;
    let serial = one_service(db, None, 40).await?;
    println!(
        "{:<34} {:>9} {:>12.1} {:>14.1} {:>9.2}x",
        "serial", 40, serial, bound, 1.0
    );
    for groups in [1usize, 4, 16] {
        let total = (groups * 12).max(40);
        let rate = one_service(db, Some(groups), total).await?;
        println!(
            "{:<34} {:>9} {:>12.1} {:>14.1} {:>9.2}x",
            format!("parallel, {groups} key groups"),
            total,
            rate,
            bound,
            rate / serial
        );
    }
    db.drop().await?;
    Ok(())
}

/// Adds `total` batches to one service (parallel with `groups` key groups, or serial), runs
/// the submitters and monitors until all are committed, and answers the batches committed per
/// second.
async fn one_service(db: &Database, groups: Option<usize>, total: usize) -> Result<f64, Error> {
    let coll = match groups {
        Some(g) => format!("bench_parallel_{g}"),
        None => "bench_parallel_serial".to_string(),
    };
    let store = Store::new(db.clone());
    let batches = Batches::with_collection(&store, &coll, Duration::from_secs(1)).await?;
    if groups.is_some() {
        batches.set_strategy("svc", Strategy::Parallel).await?;
    }
    let ledger = Ledger::new(PARALLEL_DELAY, Faults::NONE, 1);
    for i in 0..total {
        let h = format!("svc-{i:05}");
        let mut batch = NewBatch::new("svc", &h, &h);
        if let Some(g) = groups {
            batch = batch.with_keys(Vec::<String>::new(), [format!("g{}", i % g)]);
        }
        // The ledger checks the parallel rule on what it is told.
        ledger.declare(&batches.add(&batch).await?);
    }
    let crew = Crew {
        submitters: PARALLEL_SUBMITTERS,
        idle: |i| Duration::from_millis(5 + (i as u64 * 7) % 11),
        monitors: PARALLEL_MONITORS,
    };
    let took = crew.drive(db, &coll, &batches, &ledger, total).await?;
    let breaches = ledger.breaches();
    if !breaches.is_empty() {
        return Err(format!("the ledger saw breaches: {breaches:?}").into());
    }
    Ok(total as f64 / took.as_secs_f64())
}

/// The submitter and monitor tasks of a row: `submitters` submitters, the `i`-th looking again
/// `idle(i)` after a round that sent nothing, and `monitors` monitors, a pass every 5 ms.
struct Crew<F> {
    submitters: usize,
    idle: F,
    monitors: usize,
}

impl<F: Fn(usize) -> Duration> Crew<F> {
    /// Runs the crew on `batches` (collection `coll` of `db`) and `ledger` until `total` batches
    /// are committed; answers how long that took.
    async fn drive(
        &self,
        db: &Database,
        coll: &str,
        batches: &Batches,
        ledger: &Ledger,
        total: usize,
    ) -> Result<Duration, Error> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for i in 0..self.submitters {
            let submitter = Submitter::new(
                batches.clone(),
                ledger.clone(),
                format!("bench-{i}"),
                Duration::from_secs(10),
            );
            let stop = stop.clone();
            let idle = (self.idle)(i);
            tasks.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    match submitter.run_once().await {
                        Ok(sent) if sent.is_empty() => tokio::time::sleep(idle).await,
                        Ok(_) => {}
                        Err(e) => eprintln!("bench submitter: {e}"),
                    }
                }
            }));
        }
        for _ in 0..self.monitors {
            let monitor = Monitor::new(batches.clone(), ledger.clone());
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    if let Err(e) = monitor.run_once().await {
                        eprintln!("bench monitor: {e}");
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }));
        }
        let started = Instant::now();
        let raw = db.collection::<bson::Document>(coll);
        loop {
            let done = raw.count_documents(doc! { "status": "committed" }).await?;
            if done as usize >= total {
                break;
            }
            if started.elapsed() > Duration::from_secs(300) {
                stop.store(true, Ordering::Relaxed);
                return Err(format!("only {done} of {total} batches committed in 300 s").into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = started.elapsed();
        stop.store(true, Ordering::Relaxed);
        for task in tasks {
            task.await?;
        }
        Ok(took)
    }
}
