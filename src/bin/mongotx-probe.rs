//! Checks whether a server offers the guarantees mongotx needs, and prints what it found. Without
//! `--uri` (and `MONGODB_URI`) it probes the local test server, which it starts itself
//! (`MONGOTX_TEST_SERVER_ARGS=--no-bulk-write` plays MongoDB 4.4).

#[path = "shared/cli.rs"]
mod cli;

use std::time::Duration;

use clap::Parser;

/// The most concurrent callers an atomicity check may use (each is a task and, beyond the
/// driver's pool of 10, a wait for a connection; more only slows the probe down).
const MAX_TASKS: u64 = 10_000;

/// Probes a MongoDB (or wire-compatible) server for the single-document guarantees mongotx needs.
#[derive(Debug, Parser)]
#[command(name = "mongotx-probe", version)]
struct Args {
    /// Connection string of the server to probe (default: a local test server started for it).
    #[arg(long, env = "MONGODB_URI")]
    uri: Option<String>,
    /// Database in which the probe creates (and drops) its scratch collections.
    #[arg(long, default_value = "mongotx_probe", value_parser = cli::database_name)]
    db: String,
    /// Number of concurrent callers in each atomicity check (2 to 10000: a race needs two).
    #[arg(long, default_value_t = mongotx::DEFAULT_CONTENTION_TASKS as u64,
          value_parser = clap::value_parser!(u64).range(2..=MAX_TASKS))]
    tasks: u64,
    /// How long to look for the server before giving up (more than zero, at most an hour).
    #[arg(long, default_value = "10s", value_parser = cli::connect_timeout)]
    connect_timeout: Duration,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    // Kept alive until the probe is done.
    let mut _local = None;
    let uri = match args.uri.clone().filter(|u| !u.trim().is_empty()) {
        Some(uri) => uri,
        None => {
            match tokio::task::spawn_blocking(mongotx::testkit::local_server::LocalServer::start)
                .await
            {
                Ok(Ok(server)) => {
                    let uri = server.uri();
                    println!("probing the local test server at {uri}");
                    _local = Some(server);
                    uri
                }
                Ok(Err(e)) => {
                    eprintln!(
                        "mongotx-probe: no --uri given and the local test server failed: {}",
                        cli::one_line(&e.to_string())
                    );
                    std::process::exit(2);
                }
                Err(e) => {
                    eprintln!("mongotx-probe: {e}");
                    std::process::exit(2);
                }
            }
        }
    };
    let client = match cli::connect(&uri, "--uri", "mongotx-probe", args.connect_timeout).await {
        Ok(client) => client,
        Err(message) => {
            eprintln!("mongotx-probe: {message}");
            std::process::exit(2);
        }
    };
    // Bounded by the parser, so it fits.
    let tasks = usize::try_from(args.tasks).unwrap_or(mongotx::DEFAULT_CONTENTION_TASKS);
    match mongotx::probe_with(&client.database(&args.db), tasks).await {
        Ok(caps) => {
            println!("server accepted");
            println!(
                "  version: {}",
                caps.version.as_deref().unwrap_or("unknown")
            );
            println!("  duplicate _id rejected: yes");
            println!(
                "  conditional updates atomic: yes ({} tasks, {} lost races retried)",
                caps.contention_tasks, caps.contention_retries
            );
            println!(
                "  find-and-modify gives each caller its own post-image: yes ({} concurrent callers)",
                caps.contention_tasks
            );
            println!("  server time (localTime in hello): yes");
            println!("  topology: {}", caps.topology);
            println!(
                "  server-side $jsonSchema validation: {}",
                if caps.json_schema_validation {
                    "enforced"
                } else {
                    "not enforced"
                }
            );
            println!(
                "  bulkWrite (one message for a round of writes): {}",
                if caps.bulk_write { "yes" } else { "no" }
            );
            println!("  behaviours mongotx relies on (needed ones refuse the server if missing):");
            for semantic in &caps.semantics {
                println!(
                    "    {:<26} {:<5} {}{}{}",
                    semantic.name,
                    if semantic.held { "held" } else { "NOT" },
                    if semantic.needed { "[needed] " } else { "" },
                    semantic.what,
                    if semantic.held {
                        String::new()
                    } else {
                        format!(" -- {}", semantic.detail)
                    }
                );
            }
        }
        Err(e) => {
            eprintln!("mongotx-probe: {}", cli::one_line(&e.to_string()));
            std::process::exit(1);
        }
    }
}
