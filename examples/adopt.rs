//! A service adopts mongotx on a collection it already has: plain documents written by the raw
//! driver (no system fields) read and query like any other, at a version that is a fingerprint
//! of their content; the first write of one stamps it, conditionally on its content being what
//! was read (a raw change in between is a `VersionConflict`); an explicit adoption, dry run
//! first, stamps the rest online in batches, reporting what the schema refuses. What other
//! writers do after adoption: `raw_writers.rs`.
//!
//! ```sh
//! cargo run --example adopt                                       # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example adopt
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use bson::{doc, Document};
use mongotx::adopt::{AdoptOptions, AdoptReport};
use mongotx::{Adjust, CollectionSpec, Query, RepoError, Store};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Account {
    #[serde(rename = "_id")]
    id: String,
    owner: String,
    balance: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_adopt");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database (collection `legacy_accounts`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!("\n-- A collection written with the raw driver: 500 accounts, no system fields");
    let raw = store.database().collection::<Document>("legacy_accounts");
    let legacy = (0..500).map(|i| {
        let (id, owner) = (format!("acct-{i:03}"), format!("owner-{}", i % 10));
        doc! { "_id": id, "owner": owner, "balance": 1_000_i64 }
    });
    raw.insert_many(legacy).await?;
    // One document the schema refuses (a balance that is text): adoption leaves it plain.
    let bad = doc! { "_id": "acct-bad", "owner": "owner-0", "balance": "a lot" };
    raw.insert_one(bad).await?;
    let schema = include_str!("../schemas/accounts.json");
    let spec = CollectionSpec::new("legacy_accounts", 1, schema)?.plain_documents(1);
    let accounts = store.repository::<Account>(spec.clone()).await?;
    let first = accounts.get("acct-001").await?;
    let (plain, version) = (first.is_plain(), first.version);
    println!(
        "  get(acct-001): balance {}, plain {plain}, version {version}",
        first.balance
    );
    assert!(
        plain && version < 0,
        "a plain document reads at a negative version"
    );
    let owner3 = Query::new().filter(doc! { "owner": "owner-3" });
    assert_eq!(
        accounts.count(owner3).await?,
        50,
        "queries see plain documents"
    );

    println!("\n-- Its first write stamps it, conditionally on the content read");
    let minus_100 = Adjust::new().by("balance", -100_i64);
    let stamped = accounts.adjust("acct-001", version, &minus_100).await?;
    println!("  adjust at the fingerprint: now version {stamped}");
    assert_eq!(stamped, 1, "the first write stamps version 1");
    let read = accounts.get("acct-002").await?;
    let change = doc! { "$set": { "owner": "changed by another writer" } };
    raw.update_one(doc! { "_id": "acct-002" }, change).await?;
    let late = accounts.adjust("acct-002", read.version, &minus_100).await;
    println!(
        "  after a raw change since the read: {}",
        late.as_ref().unwrap_err()
    );
    assert!(
        matches!(late, Err(RepoError::VersionConflict { .. })),
        "never a lost write"
    );

    println!(
        "\n-- Explicit adoption: a dry run, then the run, in batches, while the service works"
    );
    let dry = store.adopt(spec, AdoptOptions::new().dry_run(true)).await?;
    let (todo, done) = (dry.stamped, dry.already_stamped);
    println!(
        "  dry run: {todo} to stamp, {done} stamped, {} refused",
        dry.refused
    );
    let progress = |p: &AdoptReport| {
        let (seen, of, stamped) = (p.examined, p.plain_at_start, p.stamped);
        println!("    {seen} of {of} checked, {stamped} stamped");
    };
    let options = AdoptOptions::new().batch_size(100).progress(progress);
    let report = accounts.adopt(options).await?;
    for refusal in &report.refusals {
        let (id, field, rule) = (&refusal.id, &refusal.field, &refusal.rule);
        println!("  left plain: {id} (field `{field}`: {rule})");
    }
    // All but acct-001 (stamped by its write above) and acct-bad (refused by the schema).
    let counts = (report.stamped, report.already_stamped, report.refused);
    assert_eq!(counts, (499, 1, 1));
    let again = accounts.adopt(AdoptOptions::new()).await?;
    assert_eq!(again.stamped, 0, "a second run has nothing left to stamp");
    Ok(())
}
