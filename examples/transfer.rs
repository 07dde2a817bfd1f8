//! A transfer between two accounts as one all-or-nothing transaction, rerun by the retry helper
//! `Transactions::run` when another writer changes an account under it; a read-only transaction
//! of checks for a consistent total; every deadline set and compared on one clock, the
//! server's. What a held document looks like to readers and writers: `holds.rs`; a coordinator
//! dying mid-commit: `crash_recovery.rs`.
//!
//! ```sh
//! cargo run --example transfer                                    # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example transfer
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use mongotx::{Adjust, CollectionSpec, Repository, Store, Transactions, Update};
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
    let db = client.database("mongotx_example_transfer");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database (accounts `dave` and `erin`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!("\n-- One clock for every deadline: the server's");
    let server = store.server_time().await?;
    let skew = chrono::Utc::now() - server;
    println!(
        "  server time {server}; this host's clock differs by {} ms",
        skew.num_milliseconds()
    );
    let topology = store.topology().await?;
    let writes = match topology.is_replicated() {
        true => "are majority-acknowledged",
        false => "use the client's write concern (a standalone server has no failover)",
    };
    println!(
        "  durability {:?} on a {topology}: protocol writes {writes}",
        store.durability()
    );

    println!("\n-- A transfer: one all-or-nothing transaction, rerun on conflict");
    let spec = CollectionSpec::new("accounts", 1, include_str!("../schemas/accounts.json"))?;
    let accounts: Repository<Account> = store.repository(spec).await?;
    for (id, owner, balance) in [("dave", "Dave", 300), ("erin", "Erin", 20)] {
        let (id, owner, note) = (id.into(), owner.into(), None);
        accounts
            .insert(&Account {
                id,
                owner,
                balance,
                note,
            })
            .await?;
    }
    let by = |amount: i64| Adjust::new().by("balance", amount);
    let txns = Transactions::new(store);
    let mut attempts = 0;
    let (moved, outcome) = txns
        .run(|tx| {
            attempts += 1;
            let first = attempts == 1;
            let accounts = accounts.clone();
            async move {
                let dave = accounts.get("dave").await?;
                let erin = accounts.get("erin").await?;
                if first {
                    // Someone else changes dave between our read and our commit.
                    let audit = Update::new().set("note", "audited");
                    accounts.update("dave", dave.version, &audit).await?;
                }
                tx.adjust(&accounts, "dave", dave.version, &by(-120))
                    .await?;
                tx.adjust(&accounts, "erin", erin.version, &by(120)).await?;
                Ok(120)
            }
        })
        .await?;
    let (dave, erin) = (accounts.get("dave").await?, accounts.get("erin").await?);
    println!("  moved {moved} from dave to erin in {attempts} attempts (the first met a VersionConflict)");
    println!(
        "  dave {} (version {}), erin {} (version {}); the commit wrote 2k + 3 = 7 times: \
         ActiveTransaction, 2 applies, commit point, 2 finishes, end",
        dave.balance, dave.version, erin.balance, erin.version
    );
    assert_eq!(attempts, 2, "one rerun after the conflict");
    assert_eq!((dave.balance, erin.balance), (180, 140));
    assert_eq!(outcome.version_of("accounts", "erin"), Some(erin.version));

    let (total, _) = txns
        .run(|tx| {
            let accounts = accounts.clone();
            async move {
                let mut total = 0;
                for id in ["dave", "erin"] {
                    let read = accounts.get(id).await?;
                    tx.check(&accounts, id, read.version)?;
                    total += read.balance;
                }
                Ok(total)
            }
        })
        .await?;
    println!("  a read-only transaction of two checks confirms a consistent total of {total}");
    assert_eq!(total, 320);
    Ok(())
}
