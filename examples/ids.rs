//! Ids as the server compares them: a document inserted with the id Int32 7 is read by the id
//! Double 7.0, and a transaction refuses to stage Int64 7 next to Int32 7 (`DuplicateEntry`):
//! they are one document, so two entries would be two writes of it.
//!
//! ```sh
//! cargo run --example ids                                         # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example ids
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use bson::Bson;
use mongotx::{Adjust, CollectionSpec, Repository, Store, Transactions, TxnError};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Counter {
    #[serde(rename = "_id")]
    id: Bson,
    n: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_ids");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database (collection `counters`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "\n-- Ids as the server compares them: Int32 7, Int64 7 and Double 7.0 are one document"
    );
    let spec = CollectionSpec::new("counters", 1, include_str!("../schemas/counters.json"))?;
    let counters: Repository<Counter> = store.repository(spec).await?;
    let id = Bson::Int32(7);
    counters.insert(&Counter { id, n: 0 }).await?;
    let read = counters.get(Bson::Double(7.0)).await?;
    println!(
        "  inserted id Int32 7; get(Double 7.0) -> n {} at version {}",
        read.n, read.version
    );
    assert_eq!(read.version, 1);

    let tx = Transactions::new(store).begin();
    let one = Adjust::new().by("n", 1_i64);
    tx.adjust(&counters, Bson::Int32(7), 1, &one).await?;
    match tx.adjust(&counters, Bson::Int64(7), 1, &one).await {
        Err(error @ TxnError::DuplicateEntry { .. }) => println!("  staging Int64 7 too: {error}"),
        other => return Err(format!("expected DuplicateEntry, got {other:?}").into()),
    }
    tx.commit().await?;
    let after = counters.get(Bson::Int64(7)).await?;
    println!("  committed: n {} at version {}", after.n, after.version);
    assert_eq!(after.n, 1, "one increment, not two");
    Ok(())
}
