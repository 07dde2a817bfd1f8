//! A guided tour of every mongotx feature: runs the feature examples one after the other against
//! one server and one database, each step printing what happens and checking that it happened.
//!
//! ```sh
//! cargo run --example demo                                        # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example demo
//! cargo run --example demo -- --db NAME --keep                    # keep the database afterwards
//! ```
//!
//! The tours, in order: `probe`, `documents`, `adopt`, `transfer`, `crash_recovery`, `quota`,
//! `obt_fence`, `ratelimit` and `queue` (each also runs on its own: `cargo run --example NAME`).
//! Any surprise ends the run with one line `EXAMPLE FAILED: ...` on stderr and exit code 1.

// Every included example declares its own `mod common;` (it is a program of its own too), so
// `examples/common/mod.rs` is compiled once per example here: harmless, its items are only
// used within each copy.
#![allow(clippy::duplicate_mod)]

mod common;

// Each example is included whole; its own `main` goes unused here.
#[path = "adopt.rs"]
#[allow(dead_code)]
mod adopt;
#[path = "crash_recovery.rs"]
#[allow(dead_code)]
mod crash_recovery;
#[path = "documents.rs"]
#[allow(dead_code)]
mod documents;
#[path = "obt_fence.rs"]
#[allow(dead_code)]
mod obt_fence;
#[path = "probe.rs"]
#[allow(dead_code)]
mod probe;
#[path = "queue.rs"]
#[allow(dead_code)]
mod queue;
#[path = "quota.rs"]
#[allow(dead_code)]
mod quota;
#[path = "ratelimit.rs"]
#[allow(dead_code)]
mod ratelimit;
#[path = "transfer.rs"]
#[allow(dead_code)]
mod transfer;

#[tokio::main]
async fn main() {
    common::main("demo", |example| async move {
        let store = &example.store;
        probe::run(example.db()).await?;
        documents::run(store).await?;
        adopt::run(store).await?;
        transfer::run(store).await?;
        crash_recovery::run(store).await?;
        quota::run(store).await?;
        let second = example.second_client("mongotx-example-demo-2").await?;
        obt_fence::run(store, &common::store(&second.database(example.db().name()))).await?;
        ratelimit::run(store).await?;
        queue::run(store).await
    })
    .await;
}
