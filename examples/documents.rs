//! Documents with versions: insert, get, adjust and query; two writers of the same version (one
//! gets `VersionConflict`); soft deletes (`Deleted` is not `NotFound`, purged tombstones keep
//! their version floor); a schema upgrade on read; bad input refused with a typed error; tombstones
//! next to a plain unique index; ids compared as the server compares them.
//!
//! ```sh
//! cargo run --example documents                                   # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example documents
//! ```

mod common;

use std::time::Duration;

use bson::{doc, Document};
use common::{account, expect, step, Account, TourResult};
use mongotx::{
    fields, Adjust, CollectionSpec, Query, RepoError, Repository, Store, Transactions, TxnError,
    Update,
};
use serde::{Deserialize, Serialize};

#[tokio::main]
async fn main() {
    common::main(
        "documents",
        |example| async move { run(&example.store).await },
    )
    .await;
}

/// Every step of this example, on `store`'s database.
pub async fn run(store: &Store) -> TourResult {
    let accounts = common::accounts(store).await?;
    basics(&accounts).await?;
    conflict(&accounts).await?;
    delete(&accounts).await?;
    upgrade(store).await?;
    bad_input(&accounts, store.database()).await?;
    unique(store).await?;
    ids(store).await
}

async fn basics(accounts: &Repository<Account>) -> TourResult {
    step("Insert and read stamped documents");
    for (id, owner, balance) in [("alice", "Alice", 100), ("bob", "Bob", 50)] {
        let account = Account {
            id: id.into(),
            owner: owner.into(),
            balance,
            note: None,
        };
        accounts.insert(&account).await?;
    }
    let alice = accounts.get("alice").await?;
    println!(
        "  inserted alice and bob; get(alice) -> owner {:?}, balance {}, version {}",
        alice.owner, alice.balance, alice.version
    );
    expect(alice.version == 1, "version 1 after insert")?;

    let version = accounts
        .adjust("alice", 1, &Adjust::new().by("balance", 25_i64))
        .await?;
    let alice = accounts.get("alice").await?;
    println!(
        "  adjust(alice, balance += 25) -> balance {}, version {version}",
        alice.balance
    );
    expect(
        alice.balance == 125 && version == 2,
        "balance 125 at version 2",
    )?;

    let rich = accounts
        .find(
            Query::new()
                .filter(doc! { "balance": { "$gt": 60_i64 } })
                .sort(doc! { "_id": 1 }),
        )
        .await?;
    let ids: Vec<&str> = rich.iter().filter_map(|a| a.id.as_str()).collect();
    println!("  find(balance > 60) -> {ids:?}");
    expect(ids == ["alice"], "only alice above 60")
}

async fn conflict(accounts: &Repository<Account>) -> TourResult {
    step("Two concurrent updates of the same version: one wins, one gets VersionConflict");
    let read = accounts.get("alice").await?;
    println!("  both writers read alice at version {}", read.version);
    let rename = Update::new().set("owner", "Alice A.");
    let tag = Update::new().set("note", "VIP");
    let first = accounts.update("alice", read.version, &rename);
    let second = accounts.update("alice", read.version, &tag);
    let (a, b) = tokio::join!(first, second);
    let (winner, loser) = match (&a, &b) {
        (Ok(_), Err(_)) => ("owner -> \"Alice A.\"", &b),
        (Err(_), Ok(_)) => ("note -> \"VIP\"", &a),
        _ => return Err(format!("expected exactly one winner, got {a:?} and {b:?}").into()),
    };
    println!("  winner: {winner}");
    match loser {
        Err(
            error @ RepoError::VersionConflict {
                expected, actual, ..
            },
        ) => {
            println!("  loser: {error}");
            expect(actual == &(expected + 1), "actual = expected + 1")?;
        }
        other => return Err(format!("expected VersionConflict, got {other:?}").into()),
    }
    let reread = accounts.get("alice").await?;
    let retry = if reread.owner == "Alice A." {
        Update::new().set("note", "VIP")
    } else {
        Update::new().set("owner", "Alice A.")
    };
    let version = accounts.update("alice", reread.version, &retry).await?;
    let alice = accounts.get("alice").await?;
    println!(
        "  the loser re-reads (version {}) and retries -> version {version}: owner {:?}, note {:?}",
        reread.version, alice.owner, alice.note
    );
    expect(
        alice.owner == "Alice A." && alice.note.as_deref() == Some("VIP"),
        "both changes kept",
    )
}

async fn delete(accounts: &Repository<Account>) -> TourResult {
    step("Soft delete: Deleted is not NotFound");
    let bob = accounts.get("bob").await?;
    let version = accounts.delete("bob", bob.version).await?;
    println!("  delete(bob) -> tombstone at version {version}");
    match accounts.get("bob").await {
        Err(error @ RepoError::Deleted { .. }) => println!("  get(bob)   -> {error}"),
        other => return Err(format!("expected Deleted, got {other:?}").into()),
    }
    match accounts.get("carol").await {
        Err(error @ RepoError::NotFound { .. }) => println!("  get(carol) -> {error}"),
        other => return Err(format!("expected NotFound, got {other:?}").into()),
    }
    match accounts
        .update("bob", version, &Update::new().set("owner", "Zombie"))
        .await
    {
        Err(error @ RepoError::Deleted { .. }) => println!("  update(bob) -> {error}"),
        other => return Err(format!("expected Deleted, got {other:?}").into()),
    }
    tokio::time::sleep(Duration::from_millis(5)).await;
    let purged = accounts.purge_tombstones(Duration::ZERO).await?;
    let after = accounts.get("bob").await;
    println!(
        "  purge_tombstones(retention 0) removed {purged}; get(bob) -> {}",
        after
            .as_ref()
            .err()
            .map(ToString::to_string)
            .unwrap_or_default()
    );
    expect(
        matches!(after, Err(RepoError::NotFound { .. })),
        "NotFound after purge",
    )?;
    accounts.insert(&account("bob", 50)).await?;
    let again = accounts.get("bob").await?;
    println!(
        "  insert(bob) again -> version {}: above the purged tombstone's {version}, so no stale version can match",
        again.version
    );
    expect(again.version > version, "a version above the purged one")
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Profile {
    #[serde(rename = "_id")]
    id: String,
    given_name: String,
    family_name: String,
}

async fn upgrade(store: &Store) -> TourResult {
    step("Schema upgrade on read");
    let raw = store.database().collection::<Document>("profiles");
    // A profile written by an older release, in schema version 1: one `name` field.
    raw.insert_one(doc! {
        "_id": "ada", "name": "Ada Lovelace",
        fields::SCHEMA_VERSION: 1_i64, fields::VERSION: 1_i64,
    })
    .await?;
    println!("  stored (version 1 shape): {{ _id: \"ada\", name: \"Ada Lovelace\" }}");
    let spec = CollectionSpec::new("profiles", 2, include_str!("../schemas/profiles.json"))?
        .upgrade(1, |mut d: Document| {
            let name = d.get_str("name").map_err(|e| e.to_string())?.to_string();
            d.remove("name");
            let mut words = name.splitn(2, ' ');
            d.insert("given_name", words.next().unwrap_or_default());
            d.insert("family_name", words.next().unwrap_or_default());
            Ok(d)
        });
    let profiles: Repository<Profile> = store.repository(spec).await?;
    let ada = profiles.get("ada").await?;
    println!(
        "  get(ada) with code at schema version 2 -> given_name {:?}, family_name {:?} (stored as version {})",
        ada.given_name, ada.family_name, ada.stored_schema_version
    );
    expect(
        ada.given_name == "Ada" && ada.family_name == "Lovelace",
        "the split name",
    )?;
    let version = profiles
        .update(
            "ada",
            ada.version,
            &Update::new().set("family_name", "King"),
        )
        .await?;
    let stored = raw.find_one(doc! { "_id": "ada" }).await?;
    let stamped = stored
        .as_ref()
        .and_then(|d| d.get_i64(fields::SCHEMA_VERSION).ok());
    println!("  update(ada) -> version {version}; the document is now stored in schema version {stamped:?}");
    expect(stamped == Some(2), "the write to stamp schema version 2")
}

async fn bad_input(accounts: &Repository<Account>, db: &mongodb::Database) -> TourResult {
    step("Bad input gets a typed error and changes nothing");
    let accounts_raw = db.collection::<Document>("accounts");
    let count = || accounts_raw.count_documents(doc! {});
    let before = count().await?;
    let bad = Account {
        id: "dora".into(),
        owner: String::new(),
        balance: 1,
        note: None,
    };
    let results = [
        accounts.insert(&bad).await.map(|_| 0),
        accounts
            .update("alice", 0, &Update::new().set("owner", "x"))
            .await,
        accounts
            .update("alice", 4, &Update::new().set("balance", "lots"))
            .await,
        accounts
            .adjust("alice", 4, &Adjust::new().by("balance", f64::NAN))
            .await,
        accounts
            .update("alice", 4, &Update::new().set("_version", 9_i64))
            .await,
        accounts.get(7).await.map(|_| 0),
    ];
    for result in results {
        match result {
            Err(error) => println!("  {error}"),
            Ok(_) => return Err("bad input was accepted".into()),
        }
    }
    expect(count().await? == before, "no document count change")?;
    // Where the server enforces the schema too, a write that bypasses mongotx is refused there.
    let raw = accounts_raw
        .insert_one(doc! { "_id": "raw", "owner": "", "balance": "lots", "_schema": 1_i64, "_version": 1_i64 })
        .await;
    match raw {
        Err(e) => println!(
            "  a raw driver insert of the same kind of document: refused by the server's validator ({})",
            error_code(&e)
        ),
        Ok(_) => println!(
            "  a raw driver insert of the same kind of document: stored (this server does not enforce validators; mongotx's client-side check is the only one)"
        ),
    }
    Ok(())
}

/// The server's error code in a driver error, for display.
fn error_code(error: &mongodb::error::Error) -> String {
    use mongodb::error::{ErrorKind, WriteFailure};
    match error.kind.as_ref() {
        ErrorKind::Write(WriteFailure::WriteError(e)) => format!("code {}", e.code),
        ErrorKind::Command(e) => format!("code {}", e.code),
        _ => error.to_string(),
    }
}

async fn unique(store: &Store) -> TourResult {
    step("Tombstones next to a plain unique index");
    store
        .database()
        .collection::<Document>("members")
        .create_index(
            mongodb::IndexModel::builder()
                .keys(doc! { "owner": 1 })
                .options(
                    mongodb::options::IndexOptions::builder()
                        .unique(true)
                        .build(),
                )
                .build(),
        )
        .await?;
    let spec = CollectionSpec::new("members", 1, common::ACCOUNTS_SCHEMA)?;
    let members: Repository<Account> = store.repository(spec).await?;
    for id in ["m1", "m2", "m3"] {
        members.insert(&account(id, 1)).await?;
    }
    members.delete("m1", 1).await?;
    members.delete("m2", 1).await?;
    println!("  unique index on owner; deleted two members: both tombstones fit the index");
    members.insert(&account("m4", 1).renamed("M1")).await?;
    println!("  a new member takes the deleted member's owner \"M1\": the key is free again");
    match members.insert(&account("m5", 1).renamed("M3")).await {
        Err(error @ RepoError::DuplicateKey { .. }) => {
            println!("  a clash with a live member: {error}")
        }
        other => return Err(format!("expected DuplicateKey, got {other:?}").into()),
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Counter {
    #[serde(rename = "_id")]
    id: bson::Bson,
    n: i64,
}

async fn ids(store: &Store) -> TourResult {
    step("Ids as the server compares them: Int32 7, Int64 7 and Double 7.0 are one document");
    let spec = CollectionSpec::new("counters", 1, include_str!("../schemas/counters.json"))?;
    let counters: Repository<Counter> = store.repository(spec).await?;
    counters
        .insert(&Counter {
            id: bson::Bson::Int32(7),
            n: 0,
        })
        .await?;
    let read = counters.get(bson::Bson::Double(7.0)).await?;
    println!(
        "  inserted id Int32 7; get(Double 7.0) -> n {} at version {}",
        read.n, read.version
    );
    let tx = Transactions::new(store).begin();
    tx.adjust(
        &counters,
        bson::Bson::Int32(7),
        1,
        &Adjust::new().by("n", 1_i64),
    )
    .await?;
    match tx
        .adjust(
            &counters,
            bson::Bson::Int64(7),
            1,
            &Adjust::new().by("n", 1_i64),
        )
        .await
    {
        Err(error @ TxnError::DuplicateEntry { .. }) => {
            println!("  staging Int64 7 as well: {error}")
        }
        other => return Err(format!("expected DuplicateEntry, got {other:?}").into()),
    }
    tx.commit().await?;
    expect(
        counters.get(bson::Bson::Int64(7)).await?.n == 1,
        "one increment",
    )
}
