//! Bad input gets a typed error and changes nothing: a value the JSON Schema refuses, a version
//! that cannot be, a NaN, a system field, an id of the wrong type, each refused before anything
//! is written. Where the server enforces validators (mongotx installs the schema as the
//! collection's validator), a raw driver write of such a document is refused there too.
//!
//! ```sh
//! cargo run --example bad_input                                   # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example bad_input
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use bson::{doc, Document};
use mongodb::error::{ErrorKind, WriteFailure};
use mongotx::{Adjust, CollectionSpec, Repository, Store, Update};
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
        balance: 5,
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_bad_input");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database (account `zoe`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!("\n-- Bad input gets a typed error and changes nothing");
    let spec = CollectionSpec::new("accounts", 1, include_str!("../schemas/accounts.json"))?;
    let accounts: Repository<Account> = store.repository(spec).await?;
    accounts.insert(&account("zoe", "Zoe")).await?;
    let v = accounts.get("zoe").await?.version;
    let raw = store.database().collection::<Document>("accounts");
    let before = raw.count_documents(doc! {}).await?;
    let refusals = [
        // An owner the schema refuses (empty), a version no document has (they start at 1).
        accounts.insert(&account("dora", "")).await.map(|_| 0),
        accounts
            .update("zoe", 0, &Update::new().set("owner", "x"))
            .await,
        // A balance that is not a long, a NaN increment, a system field, an id of another type.
        accounts
            .update("zoe", v, &Update::new().set("balance", "lots"))
            .await,
        accounts
            .adjust("zoe", v, &Adjust::new().by("balance", f64::NAN))
            .await,
        accounts
            .update("zoe", v, &Update::new().set("_version", 9_i64))
            .await,
        accounts.get(7).await.map(|_| 0),
    ];
    for refused in refusals {
        println!("  {}", refused.expect_err("bad input should be refused"));
    }
    let after = raw.count_documents(doc! {}).await?;
    assert_eq!(after, before, "nothing written");
    assert_eq!(accounts.get("zoe").await?.version, v, "nothing changed");

    let bad =
        doc! { "_id": "raw", "owner": "", "balance": "lots", "_schema": 1_i64, "_version": 1_i64 };
    let verdict = match raw.insert_one(bad).await {
        Err(e) => match *e.kind {
            ErrorKind::Write(WriteFailure::WriteError(ref w)) => {
                format!("refused, code {}", w.code)
            }
            _ => e.to_string(),
        },
        Ok(_) => {
            "stored; this server enforces no validator, mongotx's check is the only one".into()
        }
    };
    println!("  the same kind of document from a raw driver insert: {verdict}");
    Ok(())
}
