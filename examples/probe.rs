//! The server's verdict (`mongotx::server::verdict`): every behaviour mongotx relies on, each judged on
//! its own against the server, with concurrent callers for the single-document guarantees (a
//! duplicate `_id` refused, compare-and-set increments that lose nothing, find-and-modify calls
//! that each get their own post-image); for an optional behaviour the server lacks, the fallback
//! mongotx takes. `mongotx::server::probe` refuses a server lacking a needed one; the `mongotx-probe`
//! binary prints the whole table.
//!
//! ```sh
//! cargo run --example probe                                       # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example probe
//! ```

mod common;

use common::{expect, step, TourResult};

#[tokio::main]
async fn main() {
    common::main("probe", |example| async move { run(example.db()).await }).await;
}

/// Judges the server of `db` (it works in collections of its own there and removes them).
pub async fn run(db: &mongodb::Database) -> TourResult {
    let verdict = mongotx::server::verdict(db, mongotx::testkit::DEFAULT_CONTENTION_TASKS).await?;
    step("Server verdict");
    println!(
        "  server version {}, topology {}; {} concurrent callers in each atomicity check \
         ({} lost compare-and-set races retried)",
        verdict.version.as_deref().unwrap_or("unknown"),
        verdict.topology,
        verdict.contention_tasks,
        verdict.contention_retries
    );
    for semantic in &verdict.behaviours {
        println!(
            "  {:<27} {:<6} {}",
            semantic.name,
            semantic.status,
            if semantic.needed { "needed" } else { "" }
        );
        if let (Some(fallback), false) = (semantic.fallback, semantic.holds()) {
            println!("      without it: {fallback}");
        }
    }
    if let Some(refused) = verdict.refusal() {
        println!("  refused: {refused}");
    }
    expect(
        verdict.suitable(),
        "every behaviour mongotx cannot do without to hold",
    )
}
