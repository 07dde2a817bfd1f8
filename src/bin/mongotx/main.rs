//! `mongotx`, the admin command: what mongotx is doing in a database, and why a document is
//! held. Every subcommand reads the data (only `resolve` writes to it, and only what the GC would;
//! `status` checks the server as a store does, on a scratch collection it creates and drops); each prints
//! `field: value` lines for people, or one JSON object with `--json` for scripts. Bad arguments
//! are one line on stderr and exit status 2 (clap's convention); a failure to reach the server or
//! a refusal is one line and exit status 1 (so is an answer that something does not exist: an
//! unknown collection, document or transaction).

#[path = "../shared/cli.rs"]
mod cli;
mod contention;
mod coordination;
mod format;
mod output;
mod resolve;
mod status;
mod txn;
mod why;

use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand};
use mongotx::Store;

/// Inspects mongotx's transactions, holds and coordination documents in one database.
#[derive(Debug, Parser)]
#[command(name = "mongotx", version)]
struct Args {
    /// MongoDB connection string.
    #[arg(long, env = "MONGODB_URI", global = true)]
    uri: Option<String>,
    /// Database to inspect.
    #[arg(long, value_parser = cli::database_name, global = true)]
    db: Option<String>,
    /// Collection of transaction records.
    #[arg(long, default_value = mongotx::collections::TRANSACTIONS_COLLECTION,
        value_parser = cli::collection_name, global = true)]
    transactions_collection: String,
    /// How long to look for the server before giving up (more than zero, at most an hour).
    #[arg(long, default_value = "10s", value_parser = cli::connect_timeout, global = true)]
    connect_timeout: Duration,
    /// Print one JSON object instead of lines of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

/// The subcommands, one file each.
#[derive(Debug, Subcommand)]
enum Command {
    /// The server's verdict, transactions by state and age, held documents per collection, the
    /// oldest expired record and how far the GC is behind, and the GC runners' claims. (The
    /// verdict comes from the quick check, which creates and drops a scratch collection; with
    /// only the `read` role it says "not checked".)
    Status(status::Args),
    /// A document's committed value and version, and if it is held: by which transaction, in
    /// what state, and what happens next and when.
    Why(why::Args),
    /// A transaction's record, its worklist and the state of each of its documents.
    Txn(txn::Args),
    /// Settles one expired transaction now, as the GC would (writes; refuses a live one).
    Resolve(resolve::Args),
    /// A quota provider: usage against its limit, stripes, outstanding reservations.
    Quota(coordination::QuotaArgs),
    /// A rate limiter: its limit, calls counted in the window, outstanding reservations.
    Limiter(coordination::LimiterArgs),
    /// A service's batch queue: pending batches, the next one and its state.
    Queue(coordination::QueueArgs),
    /// An owner-based transaction: its owner, stage, lease and token.
    Obt(coordination::ObtArgs),
    /// The collections and sampled documents with the most conflicts and aborts, across every
    /// instance (from the record the library keeps in the database).
    Contention(contention::Args),
    /// The stored format the database writes and which formats each instance reads; `format
    /// set N` switches it once every live instance reads N.
    Format(format::Args),
}

/// What a subcommand is run with: the store on the database, and the output mode.
pub(crate) struct Context {
    /// The store on `--db`, with `--transactions-collection`.
    pub(crate) store: Store,
    /// `--json`.
    pub(crate) json: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("mongotx: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    // Global flags cannot be required in clap, so their absence is refused here, as clap refuses
    // any other bad argument: one line and exit status 2.
    let missing = |what: &str| -> ! {
        Args::command()
            .error(clap::error::ErrorKind::MissingRequiredArgument, what)
            .exit()
    };
    let Some(uri) = args.uri.as_deref() else {
        missing("no server given: pass --uri or set MONGODB_URI")
    };
    let Some(db_name) = args.db.as_deref() else {
        missing("no database given: pass --db")
    };
    let client = cli::connect(uri, "--uri", "mongotx", args.connect_timeout).await?;
    let db = client.database(db_name);
    cli::ping(&db).await?;
    let store = Store::builder(db)
        .transactions_collection(args.transactions_collection.clone())
        .build();
    let ctx = Context {
        store,
        json: args.json,
    };
    match args.command {
        Command::Status(a) => status::run(&ctx, a).await,
        Command::Why(a) => why::run(&ctx, a).await,
        Command::Txn(a) => txn::run(&ctx, a).await,
        Command::Resolve(a) => resolve::run(&ctx, a).await,
        Command::Quota(a) => coordination::quota(&ctx, a).await,
        Command::Limiter(a) => coordination::limiter(&ctx, a).await,
        Command::Queue(a) => coordination::queue(&ctx, a).await,
        Command::Obt(a) => coordination::obt(&ctx, a).await,
        Command::Contention(a) => contention::run(&ctx, a).await,
        Command::Format(a) => format::run(&ctx, a).await,
    }
}
