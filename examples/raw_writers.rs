//! After adoption, other writers keep writing beside mongotx: a raw driver writer that follows
//! the rule (change only documents no transaction holds, and bump `_version` with the change)
//! and a mongotx transaction on the same documents both count, nothing lost; a document the
//! schema refused stays plain, and a query that meets it names it instead of failing vaguely.
//! How the collection got adopted: `adopt.rs`.
//!
//! ```sh
//! cargo run --example raw_writers                                 # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example raw_writers
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use bson::{doc, Document};
use mongotx::adopt::AdoptOptions;
use mongotx::{fields, Adjust, CollectionSpec, Query, RepoError, Store, Transactions};
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
    let db = client.database("mongotx_example_raw_writers");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database (collection `old_accounts`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "\n-- An adopted collection: a raw writer that follows the rules, a transaction beside it"
    );
    let raw = store.database().collection::<Document>("old_accounts");
    raw.insert_many([
        doc! { "_id": "acct-010", "owner": "Ann", "balance": 1_000_i64 },
        doc! { "_id": "acct-011", "owner": "Ben", "balance": 1_000_i64 },
        doc! { "_id": "acct-bad", "owner": "Cid", "balance": "a lot" }, // the schema refuses it
    ])
    .await?;
    let schema = include_str!("../schemas/accounts.json");
    let spec = CollectionSpec::new("old_accounts", 1, schema)?.plain_documents(1);
    let accounts = store.repository::<Account>(spec).await?;
    let report = accounts.adopt(AdoptOptions::new()).await?;
    println!(
        "  adopted: {} stamped, {} refused",
        report.stamped, report.refused
    );

    // The raw writer's rule: only a document without `_txn` (free), and `_version` + 1.
    let free = doc! { "_id": "acct-010", fields::ACTIVE_TXN: { "$exists": false } };
    let change = doc! { "$inc": { "balance": 5_i64, fields::VERSION: 1_i64 } };
    let written = raw.update_one(free, change).await?;
    println!(
        "  the raw writer adds 5 to acct-010 (matched {})",
        written.matched_count
    );
    assert_eq!(written.matched_count, 1, "acct-010 was free");
    let by = |amount: i64| Adjust::new().by("balance", amount);
    Transactions::new(store)
        .run(|tx| {
            let accounts = accounts.clone();
            async move {
                let from = accounts.get("acct-010").await?;
                let to = accounts.get("acct-011").await?;
                tx.adjust(&accounts, "acct-010", from.version, &by(-250))
                    .await?;
                tx.adjust(&accounts, "acct-011", to.version, &by(250)).await
            }
        })
        .await?;
    let (from, to) = (
        accounts.get("acct-010").await?,
        accounts.get("acct-011").await?,
    );
    println!(
        "  a transfer of 250: acct-010 {} (version {}), acct-011 {} (version {})",
        from.balance, from.version, to.balance, to.version
    );
    assert_eq!(
        (from.balance, to.balance),
        (755, 1_250),
        "both changes count"
    );

    // The refused document cannot be read as an Account: a query that meets it names it.
    let everything = accounts.find(Query::new()).await;
    println!(
        "  a query over the whole collection: {}",
        everything.as_ref().unwrap_err()
    );
    assert!(matches!(&everything, Err(RepoError::Decode { id, .. }) if id.contains("acct-bad")));
    let readable = Query::new().filter(doc! { "_id": { "$ne": "acct-bad" } });
    let total: i64 = accounts
        .find(readable)
        .await?
        .iter()
        .map(|a| a.balance)
        .sum();
    println!("  the readable accounts hold {total} in all");
    assert_eq!(total, 2_000 + 5, "no money appeared or vanished");
    Ok(())
}
