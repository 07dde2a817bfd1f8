//! Owner-based transactions (OBT) and their two fences, in the race their reference design (a
//! storage volume manager's) is built for: API server 1 starts attaching a volume (dlv0),
//! reaches two of four storage nodes and stalls; API server 2 preempts the OBT, detaches the
//! volume everywhere and records it; when server 1 wakes up, every storage node refuses its stale
//! token (`Fence`) and the database refuses its owned transaction (`commit_owned`). The two API
//! servers are two clients of the same database.
//!
//! ```sh
//! cargo run --example obt_fence                                   # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example obt_fence
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use mongotx::obt::{Fence, FenceError, MemoryFence, NewObt, Obt, ObtError};
use mongotx::{CollectionSpec, Repository, Store, Transactions, Update};
use serde::{Deserialize, Serialize};

/// A distributed logical volume (`schemas/dlvs.json`).
#[derive(Debug, Serialize, Deserialize)]
struct Dlv {
    #[serde(rename = "_id")]
    name: String,
    size: i64,
    status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    token: Option<i64>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    // Two API servers: two clients, each with its own connection pool and clock samples.
    let client1 = mongodb::Client::with_uri_str(&server.uri).await?;
    let client2 = mongodb::Client::with_uri_str(&server.uri).await?;
    client1.database("mongotx_example_obt_fence").drop().await?;
    let server1 = Store::new(client1.database("mongotx_example_obt_fence"));
    let server2 = Store::new(client2.database("mongotx_example_obt_fence"));
    run(&server1, &server2).await?;
    server1.shutdown(Duration::from_secs(10)).await;
    server2.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour: `server1` and `server2` are the two API servers' stores, on one database through
/// two clients.
pub async fn run(server1: &Store, server2: &Store) -> Result<(), Box<dyn std::error::Error>> {
    let spec = CollectionSpec::new("dlvs", 1, include_str!("../schemas/dlvs.json"))?;
    let dlvs1: Repository<Dlv> = server1.repository(spec.clone()).await?;
    let dlvs2: Repository<Dlv> = server2.repository(spec).await?;
    let (name, size, status) = ("dlv0".into(), 3_000_000_000, "available".into());
    let dlv0 = Dlv {
        name,
        size,
        status,
        token: None,
    };
    dlvs1.insert(&dlv0).await?;
    let (obt1, obt2) = (Obt::open(server1).await?, Obt::open(server2).await?);
    let nodes: Vec<MemoryFence> = (0..4).map(|_| MemoryFence::new()).collect();

    println!("\n-- OBT: API server 1 starts attaching dlv0, reaches two of four nodes, stalls");
    let new = NewObt::new("t0", "api-1").lease(Duration::from_secs(30));
    let api1 = obt1.create(new).await?;
    for (i, node) in nodes.iter().enumerate().take(2) {
        node.admit("dlv0", api1.token).await?;
        println!("  dpv{i}: attach step with token {} admitted", api1.token);
    }
    obt1.advance("t0", "api-1", 1).await?;

    println!("\n-- OBT: API server 2 preempts the OBT, detaches dlv0 on all four nodes and in the database");
    let api2 = obt2.preempt("t0", "api-1", "api-2").await?;
    let (token1, token2) = (api1.token, api2.token);
    println!("  preempted: owner api-2, token {token2} (was {token1})");
    for node in &nodes {
        node.admit("dlv0", api2.token).await?;
    }
    let tx = Transactions::new(server2).begin();
    let current = dlvs2.get("dlv0").await?;
    let detach = Update::new()
        .set("status", "detached")
        .set("token", api2.token.get());
    tx.update(&dlvs2, "dlv0", current.version, &detach).await?;
    obt2.commit_owned(tx, &api2).await?;
    obt2.release("t0", "api-2").await?;
    println!("  dlv0 detached on dpv0-3, recorded, OBT released");

    println!("\n-- OBT: API server 1 wakes up and carries on with its attach: all refused");
    for (i, node) in nodes.iter().enumerate() {
        match node.admit("dlv0", api1.token).await {
            Err(e @ FenceError::StaleToken { .. }) => println!("  dpv{i}: {e}"),
            other => return Err(format!("dpv{i} should refuse {token1}: {other:?}").into()),
        }
    }
    let tx = Transactions::new(server1).begin();
    let seen = dlvs1.get("dlv0").await?;
    let attach = Update::new()
        .set("status", "attached")
        .set("token", api1.token.get());
    tx.update(&dlvs1, "dlv0", seen.version, &attach).await?;
    match obt1.commit_owned(tx, &api1).await {
        Err(e @ ObtError::Preempted { .. }) => println!("  database: {e}"),
        other => return Err(format!("server 1's write should be refused: {other:?}").into()),
    }
    let last = dlvs1.get("dlv0").await?;
    let (status, token) = (&last.status, last.token);
    println!("  dlv0 is {status} (written under token {token:?})");
    assert_eq!(last.status, "detached", "the volume ends detached");
    Ok(())
}
