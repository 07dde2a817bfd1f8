//! The demo's runner: the command line, the server and a fresh database, the shared store, and
//! the one-line report of any failure. Not an example to copy: the feature examples are.
//!
//! - the server is `MONGODB_URI` when set, otherwise the local test server (started for the run,
//!   stopped at its end); a server that does not answer within 10 s (`MONGOTX_CONNECT_TIMEOUT`,
//!   e.g. `300ms`, `30s`) ends the run;
//! - the database is a fresh `mongotx_example_<objectid>` (or `--db NAME`), dropped after a
//!   successful run unless `--keep` is given, and left for inspection after a failed one;
//! - a failure, whatever it is (an error, a failed `assert!` in a tour, ctrl-c), is one line
//!   `EXAMPLE FAILED: <what>` on stderr and exit code 1.

use std::error::Error;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Mutex;
use std::time::Duration;

use bson::{doc, oid::ObjectId};
use futures::FutureExt;
use mongodb::error::ErrorKind;
use mongodb::options::ClientOptions;
use mongodb::{Client, Database};
use mongotx::options::LockWait;
use mongotx::Store;

use crate::local_server;

type Failure = Box<dyn Error>;

/// How long to look for the server when `MONGOTX_CONNECT_TIMEOUT` is unset.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

const USAGE: &str = "usage: [--db NAME] [--keep] (MONGODB_URI picks the server, MONGOTX_CONNECT_TIMEOUT how long to look for it)";

/// What the tours run in.
pub struct Demo {
    /// The store every tour shares, on the run's database (see [`store`]).
    pub store: Store,
    uri: String,
    timeout: Duration,
}

impl Demo {
    /// A store on the same database through a second client of the same server, as another
    /// process would have: its own connection pool and its own clock samples.
    pub async fn second_store(&self, app: &str) -> Result<Store, Failure> {
        let client = connect(&self.uri, app, self.timeout).await?;
        Ok(store(&client.database(self.store.database().name())))
    }
}

/// Runs `tours` and prints `All steps behaved as described.`; on any failure prints one line
/// `EXAMPLE FAILED: ...` on stderr and exits 1.
pub async fn main<F, Fut>(tours: F)
where
    F: FnOnce(Demo) -> Fut,
    Fut: Future<Output = Result<(), Failure>>,
{
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                // The failpoints' crashes are the tours' own doing: no need to warn about them.
                tracing_subscriber::EnvFilter::new(
                    "warn,mongotx::txn::failpoint=off,mongotx::testkit::failpoint=off",
                )
            }),
        )
        .init();
    // A panic (a tour's failed `assert!`) is reported as the run's one line, not by the default
    // hook's several; the panicking tour is caught below, so the run still cleans up.
    std::panic::set_hook(Box::new(|info| {
        let message = match info.payload().downcast_ref::<&str>() {
            Some(text) => text.to_string(),
            None => info
                .payload()
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_default(),
        };
        let at = info
            .location()
            .map(|l| format!(" (at {}:{})", l.file(), l.line()));
        *PANIC.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(format!("{message}{}", at.unwrap_or_default()));
    }));
    let outcome = AssertUnwindSafe(run(tours)).catch_unwind().await;
    if let Err(error) = outcome.unwrap_or_else(|_| Err(panicked())) {
        eprintln!("EXAMPLE FAILED: {}", one_line(&error.to_string()));
        std::process::exit(1);
    }
}

/// The last panic's message and place.
static PANIC: Mutex<Option<String>> = Mutex::new(None);

/// The failure a caught panic is reported as.
fn panicked() -> Failure {
    let panic = PANIC.lock().unwrap_or_else(|p| p.into_inner()).take();
    format!("panicked: {}", panic.unwrap_or_default()).into()
}

async fn run<F, Fut>(tours: F) -> Result<(), Failure>
where
    F: FnOnce(Demo) -> Fut,
    Fut: Future<Output = Result<(), Failure>>,
{
    let (db_name, keep) = arguments()?;
    let timeout = connect_timeout()?;
    let server = local_server::start()?;
    let external = std::env::var("MONGODB_URI").is_ok_and(|uri| !uri.trim().is_empty());
    let kind = if external {
        "MONGODB_URI"
    } else {
        "the local test server"
    };
    println!("== mongotx demo ==");
    println!("server: {kind} at {}", shown_uri(&server.uri));
    let client = connect(&server.uri, "mongotx-example-demo", timeout).await?;
    let db_name =
        db_name.unwrap_or_else(|| format!("mongotx_example_{}", ObjectId::new().to_hex()));
    let db = client.database(&db_name);
    println!("database: {db_name}");
    let store = store(&db);
    let demo = Demo {
        store: store.clone(),
        uri: server.uri.clone(),
        timeout,
    };
    let outcome = tokio::select! {
        outcome = AssertUnwindSafe(tours(demo)).catch_unwind() => {
            outcome.unwrap_or_else(|_| Err(panicked()))
        }
        _ = tokio::signal::ctrl_c() => Err("interrupted (ctrl-c)".into()),
    };
    // As a service stopping does: wait for the background finishes of what was committed, so
    // that no committed document is left held for the GC.
    let report = store.shutdown(Duration::from_secs(10)).await;
    if report.unfinished > 0 {
        eprintln!(
            "{} committed transactions left for the GC to finish",
            report.unfinished
        );
    }
    if let Err(error) = outcome {
        return Err(if external {
            format!("{error} (database {db_name} left for inspection)").into()
        } else {
            error
        });
    }
    if !keep {
        db.drop().await.map_err(|e| describe(&e))?;
    }
    println!("\nAll steps behaved as described.");
    Ok(())
}

/// The store the tours share: a writer waits at most 800 ms for a document a transaction holds
/// (2 s by default) and purged tombstones keep their version floor for 500 ms (20 s by default),
/// so that the tours that show these waits run quickly.
fn store(db: &Database) -> Store {
    Store::builder(db.clone())
        .lock_wait(LockWait {
            max_wait: Duration::from_millis(800),
            ..LockWait::default()
        })
        .version_floor_grace(Duration::from_millis(500))
        .build()
}

/// `--db NAME` and `--keep`; anything else is refused.
fn arguments() -> Result<(Option<String>, bool), Failure> {
    let (mut db, mut keep) = (None, false);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--keep" => keep = true,
            "--db" => {
                let name = args.next().ok_or(format!("--db needs a value; {USAGE}"))?;
                db = Some(database_name(&name)?);
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => match other.strip_prefix("--db=") {
                Some(name) => db = Some(database_name(name)?),
                None => return Err(format!("unexpected argument {other:?}; {USAGE}").into()),
            },
        }
    }
    Ok((db, keep))
}

/// A database name MongoDB accepts: not empty, under 64 bytes, none of `/\. "$*<>:|?` or NUL.
fn database_name(name: &str) -> Result<String, Failure> {
    if name.is_empty() || name.len() >= 64 {
        return Err(format!("--db {name:?}: a database name has 1 to 63 bytes").into());
    }
    if let Some(c) = name
        .chars()
        .find(|c| "/\\. \"$*<>:|?".contains(*c) || c.is_control())
    {
        return Err(format!("--db {name:?}: a database name cannot contain {c:?}").into());
    }
    Ok(name.to_string())
}

/// `MONGOTX_CONNECT_TIMEOUT`: `300ms`, `30s` or a number of seconds, more than zero and at most
/// an hour.
fn connect_timeout() -> Result<Duration, Failure> {
    let Ok(text) = std::env::var("MONGOTX_CONNECT_TIMEOUT") else {
        return Ok(CONNECT_TIMEOUT);
    };
    let bad = || format!("bad MONGOTX_CONNECT_TIMEOUT {text:?}: give e.g. 300ms, 30s or 30");
    let trimmed = text.trim();
    let (number, unit) = match trimmed.strip_suffix("ms") {
        Some(n) => (n, 0.001),
        None => (trimmed.strip_suffix('s').unwrap_or(trimmed), 1.0),
    };
    let seconds: f64 = number.trim().parse().map_err(|_| bad())?;
    let timeout = Duration::try_from_secs_f64(seconds * unit).map_err(|_| bad())?;
    if timeout.is_zero() || timeout > Duration::from_secs(3600) {
        return Err(bad().into());
    }
    Ok(timeout)
}

/// The connection string to print: the host list only, never credentials.
fn shown_uri(uri: &str) -> String {
    match uri.split_once("://") {
        Some((scheme, rest)) => {
            let hosts = rest.rsplit_once('@').map_or(rest, |(_, hosts)| hosts);
            format!(
                "{scheme}://{}",
                hosts.split(['/', '?']).next().unwrap_or("")
            )
        }
        None => uri.to_string(),
    }
}

/// Connects to `uri` as `app`, looking for the server for at most `timeout`, and pings it.
async fn connect(uri: &str, app: &str, timeout: Duration) -> Result<Client, String> {
    let mut options = ClientOptions::parse(uri)
        .await
        .map_err(|e| format!("bad MONGODB_URI: {}", describe(&e)))?;
    options.server_selection_timeout = Some(timeout);
    options.connect_timeout = Some(timeout);
    options.app_name = Some(app.to_string());
    let hosts = options
        .hosts
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let client =
        Client::with_options(options).map_err(|e| format!("bad MONGODB_URI: {}", describe(&e)))?;
    client
        .database("admin")
        .run_command(doc! { "ping": 1 })
        .await
        .map_err(|e| {
            format!(
                "cannot reach the server at {hosts} within {timeout:?}: {}",
                describe(&e)
            )
        })?;
    Ok(client)
}

/// A driver error in one line: a server that could not be found says why (the first server's
/// own error), not the whole topology description.
fn describe(error: &mongodb::error::Error) -> String {
    let text = match error.kind.as_ref() {
        ErrorKind::ServerSelection { message, .. } => match message
            .split("Error: Kind: ")
            .nth(1)
            .and_then(|rest| rest.split(", labels").next())
        {
            Some(cause) => format!("no server answered ({cause})"),
            None => "no server answered".to_string(),
        },
        kind => kind.to_string(),
    };
    one_line(&text)
}

/// `text` with its line breaks folded into spaces.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}
