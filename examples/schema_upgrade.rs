//! Schema versions: a document stored by an older release (schema version 1, one `name`) is
//! upgraded on read by the collection's upgrade step (to version 2: `given_name` and
//! `family_name`), and stored in the new shape by its next write.
//!
//! ```sh
//! cargo run --example schema_upgrade                              # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example schema_upgrade
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use bson::{doc, Document};
use mongotx::{fields, CollectionSpec, Repository, Store, Update};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Profile {
    #[serde(rename = "_id")]
    id: String,
    given_name: String,
    family_name: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_schema_upgrade");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// Version 1 of a profile had one `name`; version 2 splits it in two.
fn split_name(mut d: Document) -> Result<Document, String> {
    let name = d.remove("name").and_then(|n| n.as_str().map(String::from));
    let name = name.ok_or("a version 1 profile has a name")?;
    let (given, family) = name.split_once(' ').unwrap_or((&name, ""));
    d.insert("given_name", given);
    d.insert("family_name", family);
    Ok(d)
}

/// The tour, on `store`'s database (collection `profiles`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!("\n-- Schema upgrade on read");
    let raw = store.database().collection::<Document>("profiles");
    let v1 = doc! { "_id": "ada", "name": "Ada Lovelace", "_schema": 1_i64, "_version": 1_i64 };
    raw.insert_one(v1).await?;
    println!("  stored by an older release (schema version 1): {{ _id: \"ada\", name: \"Ada Lovelace\" }}");
    let spec = CollectionSpec::new("profiles", 2, include_str!("../schemas/profiles.json"))?
        .upgrade(1, split_name);
    let profiles: Repository<Profile> = store.repository(spec).await?;
    let ada = profiles.get("ada").await?;
    println!(
        "  get(ada) at schema version 2 -> given_name {:?}, family_name {:?} (stored in version {})",
        ada.given_name, ada.family_name, ada.stored_schema_version
    );
    assert_eq!((&*ada.given_name, &*ada.family_name), ("Ada", "Lovelace"));
    let rename = Update::new().set("family_name", "King");
    let version = profiles.update("ada", ada.version, &rename).await?;
    let stored = raw
        .find_one(doc! { "_id": "ada" })
        .await?
        .ok_or("ada is stored")?;
    let shape = stored.get_i64(fields::SCHEMA_VERSION)?;
    println!("  update(ada) -> version {version}; now stored in schema version {shape}");
    assert_eq!(shape, 2, "the write stores the new shape");
    Ok(())
}
