//! Documents with versions: insert, get, adjust and query; two writers of the same version, one
//! of which gets `VersionConflict` (naming both versions) and retries on a fresh read.
//!
//! ```sh
//! cargo run --example documents                                   # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example documents
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use bson::doc;
use mongotx::{Adjust, CollectionSpec, Query, RepoError, Repository, Store, Update};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Account {
    #[serde(rename = "_id")]
    id: String,
    owner: String,
    balance: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_documents");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database (accounts `alice` and `bob`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!("\n-- Insert, read, adjust and query versioned documents");
    let spec = CollectionSpec::new("accounts", 1, include_str!("../schemas/accounts.json"))?;
    let accounts: Repository<Account> = store.repository(spec).await?;
    for (id, owner, balance) in [("alice", "Alice", 100), ("bob", "Bob", 50)] {
        let (id, owner, note) = (id.into(), owner.into(), None);
        let account = Account {
            id,
            owner,
            balance,
            note,
        };
        accounts.insert(&account).await?;
    }
    let alice = accounts.get("alice").await?;
    println!(
        "  get(alice) -> owner {:?}, balance {}, version {}",
        alice.owner, alice.balance, alice.version
    );
    assert_eq!(alice.version, 1, "version 1 after the insert");
    let version = accounts
        .adjust("alice", 1, &Adjust::new().by("balance", 25_i64))
        .await?;
    let alice = accounts.get("alice").await?;
    println!(
        "  adjust(alice, balance += 25) -> balance {}, version {version}",
        alice.balance
    );
    assert_eq!((alice.balance, version), (125, 2));
    let query = Query::new()
        .filter(doc! { "balance": { "$gt": 60_i64 } })
        .sort(doc! { "_id": 1 });
    let rich: Vec<String> = accounts
        .find(query)
        .await?
        .into_iter()
        .map(|a| a.value.id)
        .collect();
    println!("  find(balance > 60) -> {rich:?}");
    assert_eq!(rich, ["alice"]);

    println!("\n-- Two concurrent updates of the same version: one wins, one gets VersionConflict");
    let read = accounts.get("alice").await?;
    let rename = Update::new().set("owner", "Alice A.");
    let tag = Update::new().set("note", "VIP");
    let (a, b) = tokio::join!(
        accounts.update("alice", read.version, &rename),
        accounts.update("alice", read.version, &tag)
    );
    let (loser, retry) = match (a, b) {
        (Ok(_), Err(e)) => (e, &tag),
        (Err(e), Ok(_)) => (e, &rename),
        other => return Err(format!("expected exactly one winner, got {other:?}").into()),
    };
    println!("  both read version {}; the loser: {loser}", read.version);
    let RepoError::VersionConflict {
        expected, actual, ..
    } = loser
    else {
        return Err(format!("expected VersionConflict, got {loser:?}").into());
    };
    assert_eq!(
        actual,
        expected + 1,
        "the winner's write is the one in between"
    );
    let reread = accounts.get("alice").await?;
    let version = accounts.update("alice", reread.version, retry).await?;
    let alice = accounts.get("alice").await?;
    println!(
        "  it re-reads (version {}) and retries -> version {version}: owner {:?}, note {:?}",
        reread.version, alice.owner, alice.note
    );
    assert_eq!(
        (alice.owner.as_str(), alice.note.as_deref()),
        ("Alice A.", Some("VIP"))
    );

    Ok(())
}
