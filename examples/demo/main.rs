//! A guided tour of every mongotx feature: runs the feature examples one after the other against
//! one server and one database, each step printing what happens and checking that it happened.
//!
//! ```sh
//! cargo run --example demo                                        # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example demo
//! cargo run --example demo -- --db NAME --keep                    # keep the database afterwards
//! ```
//!
//! The tours, in order: `probe`, `documents`, `ids`, `soft_delete`, `schema_upgrade`,
//! `bad_input`, `adopt`, `raw_writers`, `transfer`, `holds`, `crash_recovery`, `orphan_hold`,
//! `quota`, `obt_fence`, `ratelimit`, `ratelimit_multi`, `queue`, `queue_faults` and
//! `queue_parallel` (each also runs on its own: `cargo run --example NAME`). Any surprise ends the run with one line
//! `EXAMPLE FAILED: ...` on stderr and exit code 1 (`harness.rs`).

// Every included example declares its own `mod local_server;` (it is a program of its own too),
// so `examples/local_server/mod.rs` is compiled once per example here: harmless.
#![allow(clippy::duplicate_mod)]

mod harness;
#[path = "../local_server/mod.rs"]
mod local_server;

// Each example is included whole; its own `main` goes unused here.
#[path = "../adopt.rs"]
#[allow(dead_code)]
mod adopt;
#[path = "../bad_input.rs"]
#[allow(dead_code)]
mod bad_input;
#[path = "../crash_recovery.rs"]
#[allow(dead_code)]
mod crash_recovery;
#[path = "../documents.rs"]
#[allow(dead_code)]
mod documents;
#[path = "../holds.rs"]
#[allow(dead_code)]
mod holds;
#[path = "../ids.rs"]
#[allow(dead_code)]
mod ids;
#[path = "../obt_fence.rs"]
#[allow(dead_code)]
mod obt_fence;
#[path = "../orphan_hold.rs"]
#[allow(dead_code)]
mod orphan_hold;
#[path = "../probe.rs"]
#[allow(dead_code)]
mod probe;
#[path = "../queue.rs"]
#[allow(dead_code)]
mod queue;
#[path = "../queue_faults.rs"]
#[allow(dead_code)]
mod queue_faults;
#[path = "../queue_parallel.rs"]
#[allow(dead_code)]
mod queue_parallel;
#[path = "../quota.rs"]
#[allow(dead_code)]
mod quota;
#[path = "../ratelimit.rs"]
#[allow(dead_code)]
mod ratelimit;
#[path = "../ratelimit_multi.rs"]
#[allow(dead_code)]
mod ratelimit_multi;
#[path = "../raw_writers.rs"]
#[allow(dead_code)]
mod raw_writers;
#[path = "../schema_upgrade.rs"]
#[allow(dead_code)]
mod schema_upgrade;
#[path = "../soft_delete.rs"]
#[allow(dead_code)]
mod soft_delete;
#[path = "../transfer.rs"]
#[allow(dead_code)]
mod transfer;

#[tokio::main]
async fn main() {
    harness::main(|demo| async move {
        let store = &demo.store;
        probe::run(store).await?;
        documents::run(store).await?;
        ids::run(store).await?;
        soft_delete::run(store).await?;
        schema_upgrade::run(store).await?;
        bad_input::run(store).await?;
        adopt::run(store).await?;
        raw_writers::run(store).await?;
        transfer::run(store).await?;
        holds::run(store).await?;
        crash_recovery::run(store).await?;
        orphan_hold::run(store).await?;
        quota::run(store).await?;
        let api_server_2 = demo.second_store("mongotx-example-demo-2").await?;
        obt_fence::run(store, &api_server_2).await?;
        ratelimit::run(store).await?;
        ratelimit_multi::run(store).await?;
        queue::run(store).await?;
        queue_faults::run(store).await?;
        // Last: it switches the database to stored format 2.
        queue_parallel::run(store).await
    })
    .await;
}
