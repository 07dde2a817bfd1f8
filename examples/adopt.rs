//! A service adopts mongotx on a collection it already has: plain documents written by the raw
//! driver (no system fields) read and query like any other, the first write of one stamps it
//! (conditionally on its content being what was read), an explicit adoption stamps the rest
//! online, reporting what the schema refuses, and a transaction runs on the adopted documents
//! while a raw writer that follows the rules keeps writing beside it.
//!
//! ```sh
//! cargo run --example adopt                                       # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example adopt
//! ```

mod common;

use bson::{doc, Document};
use common::{expect, step, Account, TourResult, ACCOUNTS_SCHEMA};
use mongotx::adopt::AdoptOptions;
use mongotx::{fields, Adjust, CollectionSpec, Query, RepoError, Store, Transactions};

#[tokio::main]
async fn main() {
    common::main("adopt", |example| async move { run(&example.store).await }).await;
}

/// The collection every step works on: written by the raw driver, as a service's data is.
const LEGACY: &str = "legacy_accounts";

/// Every step of this example, on `store`'s database (collection `legacy_accounts`).
pub async fn run(store: &Store) -> TourResult {
    let raw = store.database().collection::<Document>(LEGACY);
    step("A collection the service wrote with the raw driver: 500 accounts, no system fields");
    let legacy: Vec<Document> = (0..500)
        .map(|i| doc! { "_id": format!("acct-{i:03}"), "owner": format!("owner-{}", i % 10), "balance": 1_000_i64 })
        .collect();
    raw.insert_many(legacy).await?;
    // One document the schema refuses (a balance that is text): adoption leaves it plain.
    raw.insert_one(doc! { "_id": "acct-bad", "owner": "owner-0", "balance": "a lot" })
        .await?;

    let spec = CollectionSpec::new(LEGACY, 1, ACCOUNTS_SCHEMA)?.plain_documents(1);
    let accounts = store.repository::<Account>(spec.clone()).await?;
    let first = accounts.get("acct-001").await?;
    println!(
        "  get acct-001: balance {}, plain: {}, version {} (a fingerprint of its content)",
        first.balance,
        first.is_plain(),
        first.version
    );
    expect(
        first.is_plain() && first.version < 0,
        "a plain document reads, at a negative version",
    )?;
    let owner3 = accounts
        .count(Query::new().filter(doc! { "owner": "owner-3" }))
        .await?;
    expect(owner3 == 50, "queries see plain documents like any other")?;

    step("Its first write stamps it, conditionally on the content read");
    let stamped = accounts
        .adjust(
            "acct-001",
            first.version,
            &Adjust::new().by("balance", -100_i64),
        )
        .await?;
    println!("  adjust at the fingerprint: now version {stamped}");
    expect(
        stamped == 1,
        "the first write stamps the document at version 1",
    )?;
    let read = accounts.get("acct-002").await?;
    raw.update_one(
        doc! { "_id": "acct-002" },
        doc! { "$set": { "owner": "changed by another writer" } },
    )
    .await?;
    let conflict = accounts
        .adjust(
            "acct-002",
            read.version,
            &Adjust::new().by("balance", 1_i64),
        )
        .await;
    println!("  a raw change between the read and the write: {conflict:?}");
    expect(
        matches!(conflict, Err(RepoError::VersionConflict { .. })),
        "a raw change in between is a conflict, never a lost write",
    )?;

    step("Explicit adoption: a dry run, then the run, in batches, while the service works");
    let planned = store
        .adopt(spec.clone(), AdoptOptions::new().dry_run(true))
        .await?;
    println!(
        "  dry run: {} to stamp, {} already stamped, {} refused",
        planned.stamped, planned.already_stamped, planned.refused
    );
    let report = accounts
        .adopt(AdoptOptions::new().batch_size(100).progress(|so_far| {
            println!(
                "    {} of {} checked, {} stamped",
                so_far.examined, so_far.plain_at_start, so_far.stamped
            )
        }))
        .await?;
    for refusal in &report.refusals {
        println!(
            "  left plain: {} (field `{}`: {})",
            refusal.id, refusal.field, refusal.rule
        );
    }
    expect(
        report.stamped == 499 && report.already_stamped == 1 && report.refused == 1,
        "499 stamped, the one written before already stamped, the bad one refused",
    )?;
    let again = accounts.adopt(AdoptOptions::new()).await?;
    expect(again.stamped == 0, "a second run has nothing left to stamp")?;

    step("After adoption: a raw writer that follows the rules, and a transaction beside it");
    // The rule for other writers: change only free documents, and bump `_version` with the change,
    // so that a mongotx writer holding the old version gets a conflict instead of overwriting it.
    let written = raw
        .update_one(
            doc! { "_id": "acct-010", fields::ACTIVE_TXN: { "$exists": false } },
            doc! { "$inc": { "balance": 5_i64, fields::VERSION: 1_i64 } },
        )
        .await?;
    expect(
        written.matched_count == 1,
        "the raw writer changed a free document",
    )?;
    let txns = Transactions::new(store);
    txns.run(|tx| {
        let accounts = accounts.clone();
        async move {
            let from = accounts.get("acct-010").await?;
            let to = accounts.get("acct-011").await?;
            tx.adjust(
                &accounts,
                "acct-010",
                from.version,
                &Adjust::new().by("balance", -250_i64),
            )
            .await?;
            tx.adjust(
                &accounts,
                "acct-011",
                to.version,
                &Adjust::new().by("balance", 250_i64),
            )
            .await?;
            Ok(())
        }
    })
    .await?;
    let (from, to) = (
        accounts.get("acct-010").await?,
        accounts.get("acct-011").await?,
    );
    println!(
        "  acct-010: {} (version {}), acct-011: {} (version {})",
        from.balance, from.version, to.balance, to.version
    );
    expect(
        from.balance == 755 && to.balance == 1_250,
        "the transfer and the raw writer's change both count",
    )?;
    // The refused document cannot be read as an Account: a query that matches it says which.
    let everything = accounts.find(Query::new()).await;
    println!(
        "  a query over the whole collection: {:?}",
        everything.as_ref().err()
    );
    expect(
        matches!(&everything, Err(RepoError::Decode { id, .. }) if id.contains("acct-bad")),
        "the document mongotx cannot read is named",
    )?;
    let total: i64 = accounts
        .find(Query::new().filter(doc! { "_id": { "$ne": "acct-bad" } }))
        .await?
        .iter()
        .map(|a| a.balance)
        .sum();
    expect(
        total == 500 * 1_000 - 100 + 5,
        "no money appeared or vanished: the adjust and the raw writer's change count, the transfer moved",
    )?;
    Ok(())
}
