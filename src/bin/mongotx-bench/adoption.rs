//! Adopting existing data: an explicit adoption of a whole collection against the raw
//! `updateMany` that sets the same two fields on every document of a collection opened the same
//! way (the same sparse indexes and server validator; no client checks, no conditions), and a
//! `get` of a plain document against one of a stamped document, in one run.

use std::time::{Duration, Instant};

use bson::{doc, Document};
use mongodb::Database;
use mongotx::adopt::AdoptOptions;
use mongotx::options::ServerValidation;
use mongotx::{fields, CollectionSpec, Store};

use crate::{micros, stats, Account};

type BenchResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// How many times each side of the adoption row runs (alternating which goes first).
const ROUNDS: usize = 3;

fn spec(name: &str) -> BenchResult<CollectionSpec> {
    Ok(CollectionSpec::new(
        name,
        1,
        include_str!("../../../schemas/accounts.json"),
    )?)
}

/// `n` plain accounts in `coll`, as a service's raw driver would have written them.
async fn seed(db: &Database, coll: &str, n: usize) -> BenchResult {
    let raw = db.collection::<Document>(coll);
    for chunk in (0..n).collect::<Vec<_>>().chunks(10_000) {
        let docs: Vec<Document> = chunk
            .iter()
            .map(|i| doc! { "_id": format!("acct-{i:07}"), "owner": format!("owner-{}", i % 100), "balance": 1_000_i64 })
            .collect();
        raw.insert_many(docs).await?;
    }
    Ok(())
}

/// Makes every document of `coll` plain again (not timed).
async fn unstamp(db: &Database, coll: &str) -> BenchResult {
    db.collection::<Document>(coll)
        .update_many(
            doc! {},
            doc! { "$unset": { fields::SCHEMA_VERSION: "", fields::VERSION: "" } },
        )
        .await?;
    Ok(())
}

async fn adoption_row(db: &Database, store: &Store, setup: &str, docs: usize) -> BenchResult {
    let tag = setup.replace(' ', "_");
    let (ours_name, raw_name) = (format!("adopt_{tag}"), format!("raw_{tag}"));
    seed(db, &ours_name, docs).await?;
    seed(db, &raw_name, docs).await?;
    let repo = store.repository::<Document>(spec(&ours_name)?).await?;
    // The baseline's collection is opened too, so that it has the same indexes and validator: the
    // server checks a stamped document against the schema whoever stamps it.
    store.repository::<Document>(spec(&raw_name)?).await?;
    let raw = db.collection::<Document>(&raw_name);
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        for turn in [round % 2 == 0, round % 2 == 1] {
            if turn {
                let t = Instant::now();
                let report = repo.adopt(AdoptOptions::new()).await?;
                ours.push(t.elapsed());
                if report.stamped != docs as u64 {
                    return Err(format!("adoption stamped {} of {docs}", report.stamped).into());
                }
                unstamp(db, &ours_name).await?;
            } else {
                let t = Instant::now();
                let result = raw
                    .update_many(
                        doc! { fields::VERSION: { "$exists": false } },
                        doc! { "$set": { fields::SCHEMA_VERSION: 1_i64, fields::VERSION: 1_i64 } },
                    )
                    .await?;
                base.push(t.elapsed());
                if result.modified_count != docs as u64 {
                    return Err("the raw updateMany missed documents".into());
                }
                unstamp(db, &raw_name).await?;
            }
        }
    }
    let median = |mut v: Vec<Duration>| {
        v.sort_unstable();
        v[v.len() / 2]
    };
    let (ours, base) = (median(ours), median(base));
    let rate = |d: Duration| docs as f64 / d.as_secs_f64();
    println!(
        "\nexplicit adoption of {docs} plain documents, server validator {setup} (median of {ROUNDS} runs each):"
    );
    println!(
        "  {:<44} {:>9.2} s {:>10.0} documents/s",
        "raw updateMany setting _schema and _version",
        base.as_secs_f64(),
        rate(base)
    );
    println!(
        "  {:<44} {:>9.2} s {:>10.0} documents/s",
        "mongotx adopt (checked, conditional, batches)",
        ours.as_secs_f64(),
        rate(ours)
    );
    println!(
        "  ratio adopt / updateMany: {:.2}x",
        ours.as_secs_f64() / base.as_secs_f64()
    );

    Ok(())
}

pub(crate) async fn rows(db: &Database, n: usize, docs: usize) -> BenchResult {
    let store = Store::new(db.clone());
    adoption_row(db, &store, "validated", docs).await?;
    // Without the server's validator (a server that lacks validators, or an account that may not
    // install one), each stamp is conditional on the whole content the client checked.
    let unvalidated = Store::builder(db.clone())
        .server_validation(ServerValidation::Never)
        .build();
    adoption_row(db, &unvalidated, "not validated", docs).await?;

    // get of a plain document against a stamped one of the same content, interleaved.
    let accounts = store.repository::<Account>(spec("lazy")?).await?;
    let lazy = db.collection::<Document>("lazy");
    let total = n + n / 5;
    let mut docs_to_insert = Vec::with_capacity(2 * total);
    for i in 0..total {
        docs_to_insert.push(doc! { "_id": format!("plain-{i}"), "owner": "O", "balance": 7_i64 });
        docs_to_insert.push(doc! { "_id": format!("stamped-{i}"), "owner": "O", "balance": 7_i64, fields::SCHEMA_VERSION: 1_i64, fields::VERSION: 1_i64 });
    }
    lazy.insert_many(docs_to_insert).await?;
    let (mut plain, mut stamped) = (Vec::with_capacity(total), Vec::with_capacity(total));
    for i in 0..total {
        for first in [i % 2 == 0, i % 2 == 1] {
            let t = Instant::now();
            if first {
                let read = accounts.get(format!("plain-{i}")).await?;
                plain.push(t.elapsed());
                if !read.is_plain() {
                    return Err("a plain document read as stamped".into());
                }
            } else {
                accounts.get(format!("stamped-{i}")).await?;
                stamped.push(t.elapsed());
            }
        }
    }
    let warm = n / 5;
    let (plain, stamped) = (stats(plain.split_off(warm)), stats(stamped.split_off(warm)));
    println!("\nget of a plain document against a stamped one, {n} each:");
    println!(
        "  {:<44} {:>9.1} µs median, {:>9.1} µs p90",
        "get, stamped document",
        micros(stamped.median),
        micros(stamped.p90)
    );
    println!(
        "  {:<44} {:>9.1} µs median, {:>9.1} µs p90",
        "get, plain document (fingerprinted)",
        micros(plain.median),
        micros(plain.p90)
    );
    println!(
        "  ratio plain / stamped: {:.2}x",
        plain.median.as_secs_f64() / stamped.median.as_secs_f64()
    );
    Ok(())
}
