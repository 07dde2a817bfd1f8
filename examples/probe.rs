//! The server's verdict (`mongotx::server::verdict`): every behaviour mongotx relies on, each
//! judged on its own against the server, with concurrent callers for the single-document
//! guarantees (a duplicate `_id` refused, compare-and-set increments that lose nothing,
//! find-and-modify calls that each get their own post-image); for an optional behaviour the
//! server lacks, the fallback mongotx takes. `mongotx::server::probe` refuses a server lacking a
//! needed one (a store runs it when it opens its first collection); the `mongotx-probe` binary
//! prints the whole table.
//!
//! ```sh
//! cargo run --example probe                                       # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example probe
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use mongotx::Store;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_probe");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// Concurrent callers in each atomicity check (the `mongotx-probe` binary's default).
const CONTENTION_TASKS: usize = 64;

/// Judges the server of `store`'s database (the checks work in collections of their own there
/// and remove them).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!("\n-- Server verdict");
    let verdict = mongotx::server::verdict(store.database(), CONTENTION_TASKS).await?;
    println!(
        "  server version {}, topology {}; {} concurrent callers in each atomicity check \
         ({} lost compare-and-set races retried)",
        verdict.version.as_deref().unwrap_or("unknown"),
        verdict.topology,
        verdict.contention_tasks,
        verdict.contention_retries
    );
    for behaviour in &verdict.behaviours {
        let needed = if behaviour.needed { "needed" } else { "" };
        println!("  {:<27} {:<6} {needed}", behaviour.name, behaviour.status);
        if let (Some(fallback), false) = (behaviour.fallback, behaviour.holds()) {
            println!("      without it: {fallback}");
        }
    }
    if let Some(refused) = verdict.refusal() {
        println!("  refused: {refused}");
    }
    assert!(
        verdict.suitable(),
        "every behaviour mongotx cannot do without should hold"
    );
    Ok(())
}
