//! Judges a server on every behaviour mongotx relies on and prints the verdict: one row per
//! behaviour (holds, lacks, n/a, with the evidence, and for an optional one lacking the fallback
//! mongotx takes), then whether mongotx can run on it. Exits 1 when a needed behaviour is lacking
//! (each printed with the sentence a `Store` refuses the server with), 2 when the server could
//! not be asked. Without `--uri` (and `MONGODB_URI`) it probes the local test server, which it
//! starts itself (`MONGOTX_TEST_SERVER_ARGS=--no-bulk-write` plays MongoDB 4.4), when built with
//! the test rig (feature `testkit`); the production build needs a server named.

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
    /// Connection string of the server to probe (required, unless the command was built with
    /// the test rig: then a local test server is started for it).
    #[arg(long, env = "MONGODB_URI")]
    uri: Option<String>,
    /// Database in which the probe creates (and drops) its scratch collections.
    #[arg(long, default_value = "mongotx_probe", value_parser = cli::database_name)]
    db: String,
    /// Number of concurrent callers in each atomicity check (2 to 10000: a race needs two).
    #[arg(long, default_value_t = mongotx::server::DEFAULT_CONTENTION_TASKS as u64,
          value_parser = clap::value_parser!(u64).range(2..=MAX_TASKS))]
    tasks: u64,
    /// How long to look for the server before giving up (more than zero, at most an hour).
    #[arg(long, default_value = "10s", value_parser = cli::connect_timeout)]
    connect_timeout: Duration,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let (uri, _local) = match args.uri.clone().filter(|u| !u.trim().is_empty()) {
        Some(uri) => (uri, None),
        None => match local_server().await {
            Ok((uri, server)) => (uri, Some(server)),
            Err(message) => {
                eprintln!("mongotx-probe: {message}");
                std::process::exit(2);
            }
        },
    };
    let client = match cli::connect(&uri, "--uri", "mongotx-probe", args.connect_timeout).await {
        Ok(client) => client,
        Err(message) => {
            eprintln!("mongotx-probe: {message}");
            std::process::exit(2);
        }
    };
    // Bounded by the parser, so it fits.
    let tasks = usize::try_from(args.tasks).unwrap_or(mongotx::server::DEFAULT_CONTENTION_TASKS);
    match mongotx::server::verdict(&client.database(&args.db), tasks).await {
        Ok(verdict) => {
            print!("{}", report(&verdict));
            if !verdict.suitable() {
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("mongotx-probe: {}", cli::one_line(&e.to_string()));
            std::process::exit(2);
        }
    }
}

/// A local test server to probe when no `--uri` is given (kept alive by the caller until the
/// probe is done), with its address.
#[cfg(feature = "testkit")]
async fn local_server() -> Result<(String, mongotx::testkit::local_server::LocalServer), String> {
    match tokio::task::spawn_blocking(mongotx::testkit::local_server::LocalServer::start).await {
        Ok(Ok(server)) => {
            let uri = server.uri();
            println!("probing the local test server at {uri}");
            Ok((uri, server))
        }
        Ok(Err(e)) => Err(format!(
            "no --uri given and the local test server failed: {}",
            cli::one_line(&e.to_string())
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// Without the test rig there is no server to start: a server must be named.
#[cfg(not(feature = "testkit"))]
async fn local_server() -> Result<(String, std::convert::Infallible), String> {
    Err(
        "no server to probe: give its connection string with --uri or MONGODB_URI (this build \
         has no local test server; it comes with the `testkit` feature)"
            .to_string(),
    )
}

/// The verdict as a table: one row per behaviour, then the fallbacks taken and the decision.
fn report(verdict: &mongotx::server::Verdict) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "server {} ({}); atomicity checked with {} concurrent callers, {} lost races retried",
        verdict.version.as_deref().unwrap_or("of unknown version"),
        verdict.topology,
        verdict.contention_tasks,
        verdict.contention_retries
    );
    let width = verdict
        .behaviours
        .iter()
        .map(|s| s.name.len())
        .max()
        .unwrap_or(0);
    let _ = writeln!(out, "{:<width$}  needed  verdict  evidence", "behaviour");
    for semantic in &verdict.behaviours {
        let _ = writeln!(
            out,
            "{:<width$}  {:<6}  {:<7}  {}: {}",
            semantic.name,
            if semantic.needed { "yes" } else { "no" },
            semantic.status,
            semantic.what,
            cli::one_line(&semantic.evidence)
        );
        if let (Some(fallback), false) = (semantic.fallback, semantic.holds()) {
            let _ = writeln!(
                out,
                "{:<width$}                   without it: {fallback}",
                ""
            );
        }
    }
    let refusals: Vec<String> = verdict
        .behaviours
        .iter()
        .filter_map(|s| s.refusal())
        .collect();
    if refusals.is_empty() {
        let fallbacks: Vec<&str> = verdict
            .behaviours
            .iter()
            .filter(|s| s.fallback.is_some() && !s.holds())
            .map(|s| s.name)
            .collect();
        let _ = writeln!(
            out,
            "verdict: suitable{}",
            if fallbacks.is_empty() {
                String::new()
            } else {
                format!(" (without {})", fallbacks.join(", "))
            }
        );
    } else {
        for refusal in refusals {
            let _ = writeln!(out, "verdict: refused: {}", cli::one_line(&refusal));
        }
    }
    out
}
