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

mod common;

use std::time::Duration;

use common::{expect, step, TourResult};
use mongotx::obt::{Fence, FenceError, MemoryFence, NewObt, Obt, ObtError};
use mongotx::{CollectionSpec, Repository, Store, Transactions, Update};
use serde::{Deserialize, Serialize};

#[tokio::main]
async fn main() {
    common::main("obt_fence", |example| async move {
        let second = example.second_client("mongotx-example-obt_fence-2").await?;
        let server2 = common::store(&second.database(example.db().name()));
        run(&example.store, &server2).await
    })
    .await;
}

/// Every step of this example: `server1` and `server2` are the two API servers' stores, on the
/// same database through two clients.
pub async fn run(server1: &Store, server2: &Store) -> TourResult {
    #[derive(Debug, Serialize, Deserialize)]
    struct Dlv {
        #[serde(rename = "_id")]
        name: String,
        size: i64,
        status: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        token: Option<i64>,
    }
    let spec = CollectionSpec::new("dlvs", 1, include_str!("../schemas/dlvs.json"))?;
    let dlvs1: Repository<Dlv> = server1.repository(spec.clone()).await?;
    let dlvs2: Repository<Dlv> = server2.repository(spec).await?;
    dlvs1
        .insert(&Dlv {
            name: "dlv0".into(),
            size: 3_000_000_000,
            status: "available".into(),
            token: None,
        })
        .await?;
    let (obt1, obt2) = (Obt::open(server1).await?, Obt::open(server2).await?);
    let (txns1, txns2) = (Transactions::new(server1), Transactions::new(server2));
    let nodes: Vec<MemoryFence> = (0..4).map(|_| MemoryFence::new()).collect();

    step("OBT: API server 1 starts attaching dlv0, reaches two of four storage nodes, then stalls");
    let api1 = obt1
        .create(NewObt::new("t0", "api-1").lease(Duration::from_secs(30)))
        .await?;
    for (i, node) in nodes.iter().enumerate().take(2) {
        node.admit("dlv0", api1.token).await?;
        println!("  dpv{i}: attach step with token {} admitted", api1.token);
    }
    obt1.advance("t0", "api-1", 1).await?;

    step("OBT: API server 2 preempts the OBT and detaches dlv0 on all four nodes and in the database");
    let api2 = obt2.preempt("t0", "api-1", "api-2").await?;
    println!(
        "  preempted: owner api-2, token {} (was {})",
        api2.token, api1.token
    );
    for node in &nodes {
        node.admit("dlv0", api2.token).await?;
    }
    let tx = txns2.begin();
    let current = dlvs2.get("dlv0").await?;
    tx.update(
        &dlvs2,
        "dlv0",
        current.version,
        &Update::new()
            .set("status", "detached")
            .set("token", api2.token.get()),
    )
    .await?;
    obt2.commit_owned(tx, &api2).await?;
    obt2.release("t0", "api-2").await?;
    println!("  dlv0 detached on dpv0-3, recorded, OBT released");

    step("OBT: API server 1 wakes up and carries on with its attach: every call is rejected");
    for (i, node) in nodes.iter().enumerate() {
        match node.admit("dlv0", api1.token).await {
            Err(e @ FenceError::StaleToken { .. }) => println!("  dpv{i}: {e}"),
            other => {
                return Err(format!("dpv{i} should refuse token {}: {other:?}", api1.token).into())
            }
        }
    }
    let tx = txns1.begin();
    let seen = dlvs1.get("dlv0").await?;
    tx.update(
        &dlvs1,
        "dlv0",
        seen.version,
        &Update::new()
            .set("status", "attached")
            .set("token", api1.token.get()),
    )
    .await?;
    match obt1.commit_owned(tx, &api1).await {
        Err(e @ ObtError::Preempted { .. }) => println!("  database: {e}"),
        other => return Err(format!("server 1's write should be refused: {other:?}").into()),
    }
    let last = dlvs1.get("dlv0").await?;
    println!(
        "  dlv0 is {} (written under token {:?})",
        last.value.status, last.value.token
    );
    expect(
        last.value.status == "detached",
        "the volume to end detached",
    )?;
    Ok(())
}
