//! The server probe (`mongotx::probe`): checks, with concurrent callers, the single-document
//! guarantees mongotx is built on (a duplicate `_id` refused, compare-and-set increments that
//! lose nothing, find-and-modify calls that each get their own post-image) and reports what the
//! server offers: its version and topology, `$jsonSchema` validation, `bulkWrite`, and which of
//! the behaviours mongotx relies on hold. The `mongotx-probe` binary runs the same checks with
//! more options.
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

/// Probes the server of `db` (it works in collections of its own there and removes them).
pub async fn run(db: &mongodb::Database) -> TourResult {
    let caps = mongotx::probe(db).await?;
    step("Server probe");
    println!(
        "  duplicate _id rejected, {} concurrent compare-and-set increments lost nothing ({} retries), \
         {} concurrent find-and-modify calls each got their own post-image",
        caps.contention_tasks, caps.contention_retries, caps.contention_tasks
    );
    println!(
        "  server version {}, topology {}, server-side $jsonSchema validation: {}",
        caps.version.as_deref().unwrap_or("unknown"),
        caps.topology,
        if caps.json_schema_validation {
            "enforced"
        } else {
            "not enforced (validated on the client)"
        }
    );
    println!(
        "  bulkWrite (MongoDB 8.0+): {}",
        if caps.bulk_write {
            "yes: the writes of a commit round go in one message"
        } else {
            "no: the writes of a commit round go as one command each, all at once"
        }
    );
    let needed = caps.semantics.iter().filter(|s| s.needed).count();
    let held = caps.semantics.iter().filter(|s| s.held).count();
    let missing: Vec<&str> = caps
        .semantics
        .iter()
        .filter(|s| !s.held)
        .map(|s| s.name)
        .collect();
    println!(
        "  behaviours mongotx relies on: {held} of {} held, all {needed} it cannot do without among them; not held: {}",
        caps.semantics.len(),
        if missing.is_empty() {
            "none".to_string()
        } else {
            missing.join(", ")
        }
    );
    expect(
        caps.semantics.iter().all(|s| s.held || !s.needed),
        "every behaviour mongotx cannot do without to hold",
    )
}
