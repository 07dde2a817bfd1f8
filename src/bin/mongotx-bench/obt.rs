//! OBT rows: create, preempt and advance latency next to one conditional update of a document of
//! the same shape, measured interleaved; token issue throughput with 32 concurrent callers next
//! to 32 callers of the same raw `findAndModify` `$inc`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, Document};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};
use mongotx::obt::{NewObt, Obt};
use mongotx::Store;

use crate::{micros, stats};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Concurrent token callers.
const CALLERS: usize = 32;
/// How long each throughput contender runs.
const WINDOW: Duration = Duration::from_secs(2);

pub(crate) async fn rows(db: &Database, n: usize) -> Result<(), Error> {
    let obt = Obt::open(&Store::new(db.clone())).await?;
    let raw = db.collection::<Document>("raw_obts");
    raw.insert_one(
        doc! { "_id": "raw", "owner": "a", "stage": 0_i64, "token": 1_i64, "_version": 1_i64 },
    )
    .await?;

    let warmup = (n / 5).max(20);
    // As many other documents as the OBT collection will hold, so both sides look one up among
    // as many (the local test server scans for some filters).
    let others: Vec<Document> = (0..n + warmup)
        .map(|i| doc! { "_id": format!("other{i}"), "owner": "x", "stage": 0_i64, "token": 1_i64, "_version": 1_i64 })
        .collect();
    raw.insert_many(others).await?;
    let (mut create, mut preempt, mut advance, mut heartbeat, mut base, mut fam) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for (version, i) in (1_i64..).step_by(2).zip(0..n + warmup) {
        let id = format!("t{i}");
        let t = Instant::now();
        obt.create(NewObt::new(&id, "owner-a")).await?;
        let created = t.elapsed();
        let t = Instant::now();
        let mut owned = obt.preempt(&id, "owner-a", "owner-b").await?;
        let preempted = t.elapsed();
        let t = Instant::now();
        obt.heartbeat(&mut owned).await?;
        let beat = t.elapsed();
        let t = Instant::now();
        obt.advance(&id, "owner-b", 1).await?;
        let advanced = t.elapsed();
        let t = Instant::now();
        raw.update_one(
            doc! { "_id": "raw", "_version": version },
            doc! { "$set": { "owner": format!("o{i}") }, "$inc": { "_version": 1_i64 } },
        )
        .await?;
        let one = t.elapsed();
        let t = Instant::now();
        raw.find_one_and_update(
            doc! { "_id": "raw", "_version": version + 1 },
            doc! { "$set": { "stage": 1_i64 }, "$inc": { "_version": 1_i64 } },
        )
        .return_document(ReturnDocument::After)
        .await?;
        let modified = t.elapsed();
        if i >= warmup {
            heartbeat.push(beat);
            fam.push(modified);
            create.push(created);
            preempt.push(preempted);
            advance.push(advanced);
            base.push(one);
        }
    }
    let base = stats(base);
    println!("\nobt ({n} samples each, interleaved):");
    println!(
        "{:<40} {:>12} {:>12} {:>14}",
        "operation", "median µs", "p90 µs", "/ one update"
    );
    let row = |label: &str, s: &crate::Stats| {
        println!(
            "{:<40} {:>12.1} {:>12.1} {:>13.2}x",
            label,
            micros(s.median),
            micros(s.p90),
            s.median.as_secs_f64() / base.median.as_secs_f64()
        );
    };
    row("conditional update (driver)", &base);
    row("findAndModify, post-image (driver)", &stats(fam));
    row("create (token + one upsert)", &stats(create));
    row("preempt (token + conditional write)", &stats(preempt));
    row("advance (one findAndModify)", &stats(advance));
    row("heartbeat (one conditional update)", &stats(heartbeat));

    let ours = {
        let obt = obt.clone();
        issue_for(move || {
            let obt = obt.clone();
            async move {
                obt.issue_token().await?;
                Ok(())
            }
        })
        .await?
    };
    let counter: Collection<Document> = db.collection("raw_tokens");
    let theirs = issue_for(move || {
        let counter = counter.clone();
        async move {
            counter
                .find_one_and_update(doc! { "_id": "raw" }, doc! { "$inc": { "last": 1_i64 } })
                .upsert(true)
                .return_document(ReturnDocument::After)
                .await?;
            Ok(())
        }
    })
    .await?;
    let per_second = |n: u64| n as f64 / WINDOW.as_secs_f64();
    println!(
        "token issue, {CALLERS} concurrent callers for {} s: {:.0} tokens/s vs raw findAndModify $inc {:.0}/s = {:.2}x",
        WINDOW.as_secs(),
        per_second(ours),
        per_second(theirs),
        per_second(ours) / per_second(theirs).max(f64::MIN_POSITIVE)
    );
    Ok(())
}

/// Runs `CALLERS` loops of `call` for `WINDOW`; returns how many calls succeeded.
async fn issue_for<F, Fut>(call: F) -> Result<u64, Error>
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), Error>> + Send,
{
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + WINDOW;
    let mut tasks = Vec::new();
    for _ in 0..CALLERS {
        let (call, done) = (call.clone(), Arc::clone(&done));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < until {
                if call().await.is_ok() {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    Ok(done.load(Ordering::Relaxed))
}
