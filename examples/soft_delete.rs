//! Soft deletes: a deleted document becomes a tombstone, so reading it says `Deleted`, not
//! `NotFound`, and a write to it is refused; once purged it is `NotFound`, and a new document
//! with its id starts above the purged version (the version floor), so no stale version can ever
//! match. Tombstones sit beside a plain unique index: a deleted document's key is free again.
//!
//! ```sh
//! cargo run --example soft_delete                                 # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example soft_delete
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use bson::{doc, Document};
use mongodb::{options::IndexOptions, IndexModel};
use mongotx::{CollectionSpec, RepoError, Repository, Store, Update};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Account {
    #[serde(rename = "_id")]
    id: String,
    owner: String,
    balance: i64,
}

fn account(id: &str, owner: &str) -> Account {
    let (id, owner) = (id.into(), owner.into());
    Account {
        id,
        owner,
        balance: 1,
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_soft_delete");
    db.drop().await?;
    // Purged tombstones keep their version floor 500 ms before purging (20 s by default).
    let grace = Duration::from_millis(500);
    let store = Store::builder(db).version_floor_grace(grace).build();
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database (account `olga`, collection `members`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    const SCHEMA: &str = include_str!("../schemas/accounts.json");
    println!("\n-- Soft delete: Deleted is not NotFound");
    let accounts: Repository<Account> = store
        .repository(CollectionSpec::new("accounts", 1, SCHEMA)?)
        .await?;
    accounts.insert(&account("olga", "Olga")).await?;
    let version = accounts.delete("olga", 1).await?;
    println!("  delete(olga) -> tombstone at version {version}");
    let gone = accounts.get("olga").await;
    let never = accounts.get("nobody").await;
    let rename = Update::new().set("owner", "Zombie");
    let zombie = accounts.update("olga", version, &rename).await;
    for (what, result) in [("get(olga)", &gone), ("get(nobody)", &never)] {
        println!("  {what} -> {}", result.as_ref().unwrap_err());
    }
    println!("  update(olga) -> {}", zombie.as_ref().unwrap_err());
    assert!(matches!(gone, Err(RepoError::Deleted { .. })));
    assert!(matches!(never, Err(RepoError::NotFound { .. })));
    assert!(matches!(zombie, Err(RepoError::Deleted { .. })));

    tokio::time::sleep(Duration::from_millis(5)).await;
    let purged = accounts.purge_tombstones(Duration::ZERO).await?;
    let after = accounts.get("olga").await.err();
    let shown = after.as_ref().map_or("found".into(), ToString::to_string);
    println!("  purge_tombstones(retention 0) removed {purged}; get(olga) -> {shown}");
    assert!(
        matches!(after, Some(RepoError::NotFound { .. })),
        "NotFound after the purge"
    );
    accounts.insert(&account("olga", "Olga")).await?;
    let again = accounts.get("olga").await?.version;
    println!("  insert(olga) again -> version {again}, above the purged tombstone's {version}");
    assert!(again > version, "a version above the purged one");

    println!("\n-- Tombstones next to a plain unique index");
    let unique = IndexOptions::builder().unique(true).build();
    let index = IndexModel::builder()
        .keys(doc! { "owner": 1 })
        .options(unique)
        .build();
    let raw = store.database().collection::<Document>("members");
    raw.create_index(index).await?;
    let members: Repository<Account> = store
        .repository(CollectionSpec::new("members", 1, SCHEMA)?)
        .await?;
    for (id, owner) in [("m1", "M1"), ("m2", "M2"), ("m3", "M3")] {
        members.insert(&account(id, owner)).await?;
    }
    members.delete("m1", 1).await?;
    members.delete("m2", 1).await?;
    println!("  unique index on owner; deleted two members: both tombstones fit the index");
    members.insert(&account("m4", "M1")).await?;
    println!("  a new member takes the deleted member's owner \"M1\": the key is free again");
    match members.insert(&account("m5", "M3")).await {
        Err(error @ RepoError::DuplicateKey { .. }) => {
            println!("  a clash with a live one: {error}")
        }
        other => return Err(format!("expected DuplicateKey, got {other:?}").into()),
    }
    Ok(())
}
