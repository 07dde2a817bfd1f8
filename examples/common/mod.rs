//! What the examples share: the server and a fresh database to run in, the printed steps and
//! their checks, the one-line report of a failure, and the accounts three of them move money
//! between.
//!
//! An example's `main` is `common::main("name", |example| async move { run(...).await })`:
//!
//! - the server is `MONGODB_URI` when set, otherwise the local test server (started for the run,
//!   stopped at its end); a server that does not answer within 10 s (`MONGOTX_CONNECT_TIMEOUT`,
//!   e.g. `300ms`, `30s`) ends the run;
//! - the database is a fresh `mongotx_example_<objectid>` (or `--db NAME`), dropped after a
//!   successful run unless `--keep` is given, and left for inspection after a failed one;
//! - a failure, whatever it is, is one line `EXAMPLE FAILED: <what>` on stderr and exit code 1.
//!
//! Every example and the demo include this file as their own `mod common;`, and each uses only
//! part of it.
#![allow(dead_code)]

use std::error::Error;
use std::future::Future;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Document};
use mongodb::error::ErrorKind;
use mongodb::options::ClientOptions;
use mongodb::{Client, Database};
use mongotx::options::LockWait;
use mongotx::testkit::test_server::{ServerKind, TestServer};
use mongotx::{fields, Adjust, CollectionSpec, Repository, Stamped, Store, Transaction, TxnError};
use serde::{Deserialize, Serialize};

/// What a tour returns: any error ends the example (see [`main`]).
pub type TourResult<T = ()> = Result<T, Box<dyn Error>>;

/// How long to look for the server when `MONGOTX_CONNECT_TIMEOUT` is unset.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

const USAGE: &str = "usage: [--db NAME] [--keep] (MONGODB_URI picks the server, MONGOTX_CONNECT_TIMEOUT how long to look for it)";

/// The server and database an example runs in.
pub struct Example {
    /// The store every tour of the run shares, on the run's database (see [`store`]).
    pub store: Store,
    uri: String,
    timeout: Duration,
}

impl Example {
    /// The run's database.
    pub fn db(&self) -> &Database {
        self.store.database()
    }

    /// A second client of the same server, as another process would have: its own connection
    /// pool and its own clock samples.
    pub async fn second_client(&self, app: &str) -> TourResult<Client> {
        Ok(connect(&self.uri, app, self.timeout).await?)
    }
}

/// Runs an example: connects, hands `tour` the fresh database, drops it afterwards and prints
/// `All steps behaved as described.`; on any failure prints one line `EXAMPLE FAILED: ...` on
/// stderr and exits 1.
pub async fn main<F, Fut>(name: &str, tour: F)
where
    F: FnOnce(Example) -> Fut,
    Fut: Future<Output = TourResult>,
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
    if let Err(error) = run(name, tour).await {
        eprintln!("EXAMPLE FAILED: {}", one_line(&error.to_string()));
        std::process::exit(1);
    }
}

async fn run<F, Fut>(name: &str, tour: F) -> TourResult
where
    F: FnOnce(Example) -> Fut,
    Fut: Future<Output = TourResult>,
{
    let (db_name, keep) = arguments()?;
    let timeout = connect_timeout()?;
    let server = TestServer::start()?;
    println!("== mongotx {name} ==");
    println!("server: {} at {}", server.kind(), shown_uri(&server));
    let client = connect(server.uri(), &format!("mongotx-example-{name}"), timeout).await?;
    let db_name =
        db_name.unwrap_or_else(|| format!("mongotx_example_{}", ObjectId::new().to_hex()));
    let db = client.database(&db_name);
    println!("database: {db_name}");
    let store = store(&db);
    let example = Example {
        store: store.clone(),
        uri: server.uri().to_string(),
        timeout,
    };
    let outcome = tokio::select! {
        outcome = tour(example) => outcome,
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
        return Err(if server.kind() == ServerKind::External {
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

/// The Store the tours share: a writer waits at most 800 ms for a document a transaction holds
/// (2 s by default) and purged tombstones keep their version floor for 500 ms (20 s by default),
/// so that the tours that show these waits run quickly.
pub fn store(db: &Database) -> Store {
    Store::builder(db.clone())
        .lock_wait(LockWait {
            max_wait: Duration::from_millis(800),
            ..LockWait::default()
        })
        .version_floor_grace(Duration::from_millis(500))
        .build()
}

/// Prints a step's title.
pub fn step(title: &str) {
    println!("\n-- {title}");
}

/// A self-check: `Err("expected {what}")` unless `condition` holds.
pub fn expect(condition: bool, what: &str) -> TourResult {
    if condition {
        Ok(())
    } else {
        Err(format!("expected {what}").into())
    }
}

/// `--db NAME` and `--keep`; anything else is refused.
fn arguments() -> TourResult<(Option<String>, bool)> {
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
fn database_name(name: &str) -> TourResult<String> {
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
fn connect_timeout() -> TourResult<Duration> {
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
fn shown_uri(server: &TestServer) -> String {
    let uri = server.uri();
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

/// A bank account: what `documents`, `transfer` and `crash_recovery` work on
/// (`schemas/accounts.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Account {
    #[serde(rename = "_id")]
    pub id: String,
    pub owner: String,
    pub balance: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Account {
    /// The same account with another owner.
    pub fn renamed(self, owner: &str) -> Account {
        Account {
            owner: owner.into(),
            ..self
        }
    }
}

/// An account owned by its id in capitals.
pub fn account(id: &str, balance: i64) -> Account {
    Account {
        id: id.into(),
        owner: id.to_uppercase(),
        balance,
        note: None,
    }
}

/// The `accounts` repository.
pub async fn accounts(store: &Store) -> TourResult<Repository<Account>> {
    let spec = CollectionSpec::new("accounts", 1, ACCOUNTS_SCHEMA)?;
    Ok(store.repository(spec).await?)
}

/// The accounts' JSON Schema: the system fields and the account's own.
pub const ACCOUNTS_SCHEMA: &str = include_str!("../../schemas/accounts.json");

/// The (balance, version) of each account, as read now.
pub async fn balances(accounts: &Repository<Account>, ids: &[&str]) -> TourResult<Vec<(i64, i64)>> {
    let mut out = Vec::new();
    for id in ids {
        let read = accounts.get(*id).await?;
        out.push((read.balance, read.version));
    }
    Ok(out)
}

/// How many accounts a transaction holds right now.
pub async fn held_accounts(db: &Database) -> TourResult<u64> {
    let held = doc! { fields::ACTIVE_TXN: { "$exists": true } };
    Ok(db
        .collection::<Document>("accounts")
        .count_documents(held)
        .await?)
}

/// Stages moving `amount` between two accounts as read.
pub async fn stage_transfer(
    tx: &Transaction,
    accounts: &Repository<Account>,
    (from, to): (&Stamped<Account>, &Stamped<Account>),
    amount: i64,
) -> Result<(), TxnError> {
    let by = |amount: i64| Adjust::new().by("balance", amount);
    tx.adjust(accounts, from.id.clone(), from.version, &by(-amount))
        .await?;
    tx.adjust(accounts, to.id.clone(), to.version, &by(amount))
        .await
}
