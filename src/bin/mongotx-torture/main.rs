//! The torture run: bank transfers from several worker *processes*, read-only check transactions
//! from checker processes and two `mongotx-gc` runner processes, all at once, while processes are
//! killed with SIGKILL, connections are reset or stalled by toxiproxy, and commands are delivered
//! late (after the client saw its connection drop) by a wire proxy. Afterwards: the total is
//! exact, nothing is held, no transaction record is left, and every check transaction that
//! committed saw the exact total.
//!
//! ```text
//! workers, checkers, GC runners ──> toxiproxy (reset_peer, timeout) ──> wire proxy (late) ──> server
//! ```
//!
//! `mongotx-torture run --seconds 600` is the long form (`tools/torture.sh`); `cargo test` runs a
//! short form (`tests/it/torture.rs`). `--skews` gives processes clocks that run ahead or behind
//! (an LD_PRELOAD shim from `tools/skew`), and `--no-faults` turns the faults off, which is how the
//! clock-skew test checks that no live transaction is ever taken for expired. `--previous <DIR>`
//! runs every other process from the previous version's binaries (`tools/previous-version.sh`;
//! the mixed-version test, `tests/it/mixed_versions.rs`), and `--quota-workers N` adds quota
//! consumes to the run, checked at the end (`quota_run`).

mod append;
mod append_run;
mod chaos;
mod children;
#[path = "../shared/cli.rs"]
mod cli;
#[path = "../shared/font.rs"]
mod font;
mod latency;
mod obt_roles;
mod queue_worker;
mod quota_run;
mod quota_worker;
mod rate_worker;
mod roles;
mod soak;
#[allow(dead_code)] // The integration tests use the rest of the proxy.
mod wire_proxy;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

/// Torture-tests mongotx transactions across processes under crashes and network faults.
#[derive(Debug, Parser)]
// Without a role: an error naming what is missing, like any other bad command line, rather
// than the whole help text.
#[command(name = "mongotx-torture", version, arg_required_else_help = false)]
struct Args {
    #[command(subcommand)]
    role: Role,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Runs the whole torture: server, proxies, processes, faults, verification.
    Run(chaos::RunArgs),
    /// Runs every system at once for `--minutes`, sampling memory, latencies and collection
    /// sizes every `--interval`, and fails on a trend.
    ///
    /// Bank transfers (workers killed at random), check transactions, quota consumes and
    /// releases, a rate limiter with reservations, OBTs with preemption (owners killed at
    /// random), batches through the ledger simulator, two GC runners and the adoption of new
    /// plain documents. Samples go to `<out>/samples.jsonl`, charts beside them.
    ///
    /// It fails when, besides the torture run's end checks (exact total, nothing held, no
    /// record, the quota invariants): the resident memory of a long-lived process (not the
    /// killed ones, not the soak itself) grows through the second half of the run by more than
    /// max(20 % of its level there, 16 MiB), the least-squares slope over the second half's
    /// samples times the half's length; a system collection series (records, held documents,
    /// tombstones, providers, limiters, OBTs, tokens, the registry, batches, unadopted
    /// documents; not the instances' announcements, kept a day, nor the journal) grows likewise
    /// by more than max(20 %, 100 documents); or the p99 of an operation rises by more than 50 % from
    /// the first third of the run to the last (median of the windows' p99s, windows of 5
    /// operations or more, at least 3 windows in each third), unless it stays under 20 ms.
    #[command(verbatim_doc_comment)]
    Soak(soak::SoakArgs),
    /// Draws a soak run's charts from its samples file.
    SoakCharts(soak::charts::ChartArgs),
    /// A worker process: random transfers until killed.
    Worker(roles::WorkerArgs),
    /// A checker process: read-only check transactions over every account until killed.
    Checker(roles::CheckerArgs),
    /// A quota worker: consumes and releases across a quota hierarchy until killed.
    QuotaWorker(quota_worker::QuotaWorkerArgs),
    /// An OBT owner: holds an OBT with a lease and heartbeats until killed.
    ObtOwner(obt_roles::ObtOwnerArgs),
    /// An OBT contender: tries to take an OBT over for a while.
    ObtContender(obt_roles::ObtContenderArgs),
    /// A rate-limited worker: bulk and high-priority callers of an HTTP API through a limiter.
    RateWorker(rate_worker::RateWorkerArgs),
    /// A batch-queue worker: a submitter and a monitor of batches bound for a ledger.
    QueueWorker(queue_worker::QueueWorkerArgs),
    /// A list-append worker: reads and appends in transactions, each written to a history file
    /// for the isolation checker, until killed.
    AppendWorker(append::AppendArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("mongotx-torture: cannot start a runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match args.role {
            Role::Run(args) => chaos::run(args).await,
            Role::Soak(args) => soak::run(args).await,
            Role::SoakCharts(args) => soak::charts::run(args),
            Role::Worker(args) => roles::worker(args).await,
            Role::Checker(args) => roles::checker(args).await,
            Role::QuotaWorker(args) => quota_worker::quota_worker(args).await,
            Role::ObtOwner(args) => obt_roles::obt_owner(args).await,
            Role::ObtContender(args) => obt_roles::obt_contender(args).await,
            Role::RateWorker(args) => rate_worker::rate_worker(args).await,
            Role::QueueWorker(args) => queue_worker::queue_worker(args).await,
            Role::AppendWorker(args) => append::append_worker(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("mongotx-torture: {}", cli::one_line(&message));
            ExitCode::FAILURE
        }
    }
}

/// The longest duration any flag takes: a torture or one of its processes runs for hours, and
/// longer values would overflow the deadlines computed from them.
const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

/// Parses `500ms`, `3s`, ... for clap: more than zero (no flag here means anything at zero: a
/// zero timeout, lease or pause cannot work) and at most [`MAX_DURATION`].
fn duration(text: &str) -> Result<Duration, String> {
    cli::duration_within(text, MAX_DURATION)
}

/// A client of `uri` (from `--uri`) whose server answered within 5 s: the processes are
/// restarted when they give up, so they give up soon, and a ping says so at once where opening
/// the repositories would wait out the timeout several times over. A connection string that does
/// not parse, or a server that does not answer, is one line.
pub(crate) async fn client(uri: &str) -> Result<mongodb::Client, String> {
    cli::connect(uri, "--uri", "mongotx-torture", Duration::from_secs(5)).await
}
