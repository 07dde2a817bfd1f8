//! OBT processes for the lease tests: an owner that heartbeats until it is killed, and a
//! contender that tries to take the OBT over for a while (run with a skewed clock in tests).

use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use mongotx::obt::{NewObt, Obt, ObtError};
use mongotx::Store;

/// Which take-over rule a contender uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Rule {
    /// Observe, wait the lease on this process's monotonic clock, take over if unchanged.
    Monotonic,
    /// Take over when the server's clock says the last heartbeat is older than the lease.
    Server,
}

/// Arguments of an OBT owner.
#[derive(Debug, Args)]
pub(crate) struct ObtOwnerArgs {
    /// Connection string of the server.
    #[arg(long)]
    uri: String,
    /// Database holding the OBTs.
    #[arg(long, value_parser = crate::cli::database_name)]
    db: String,
    /// The OBT id.
    #[arg(long)]
    id: String,
    /// This owner's name.
    #[arg(long)]
    owner: String,
    /// The lease it holds.
    #[arg(long, value_parser = crate::duration)]
    lease: Duration,
    /// Print the durations of its preemption and heartbeats this often (`latencies` lines, for
    /// the soak).
    #[arg(long, value_parser = crate::duration)]
    latency_every: Option<Duration>,
}

/// Arguments of an OBT contender.
#[derive(Debug, Args)]
pub(crate) struct ObtContenderArgs {
    /// Connection string of the server.
    #[arg(long)]
    uri: String,
    /// Database holding the OBTs.
    #[arg(long, value_parser = crate::cli::database_name)]
    db: String,
    /// The OBT id.
    #[arg(long)]
    id: String,
    /// This contender's name.
    #[arg(long)]
    owner: String,
    /// The take-over rule.
    #[arg(long, value_enum)]
    rule: Rule,
    /// How long to keep trying.
    #[arg(long = "for", value_parser = crate::duration)]
    for_: Duration,
}

async fn open(uri: &str, db: &str) -> Result<Obt, String> {
    let client = crate::client(uri).await?;
    Obt::open(&Store::new(client.database(db)))
        .await
        .map_err(|e| format!("open OBTs: {e}"))
}

/// Creates the OBT (or preempts it from whoever owns it), prints `owned <token>`, then heartbeats
/// every quarter lease until killed; exits with an error once it learns it lost the OBT.
pub(crate) async fn obt_owner(args: ObtOwnerArgs) -> Result<(), String> {
    let obt = open(&args.uri, &args.db).await?;
    let latencies = crate::latency::Latencies::every(args.latency_every);
    let created = obt
        .create(NewObt::new(&args.id, &args.owner).lease(args.lease))
        .await;
    let mut owned = match created {
        Ok(owned) => owned,
        Err(ObtError::Exists { owner, .. }) => {
            let started = Instant::now();
            let taken = obt
                .preempt(&args.id, &owner, &args.owner)
                .await
                .map_err(|e| format!("preempt: {e}"))?;
            latencies.since("obt.preempt", started);
            // Out now: the soak kills owners, often before a window would end.
            latencies.flush();
            taken
        }
        Err(e) => return Err(format!("create: {e}")),
    };
    println!("owned {}", owned.token);
    loop {
        tokio::time::sleep(args.lease / 4).await;
        let started = Instant::now();
        match obt.heartbeat(&mut owned).await {
            Ok(()) => latencies.since("obt.heartbeat", started),
            Err(e) if e.is_retryable() => eprintln!("heartbeat failed, trying again: {e}"),
            Err(e) => {
                println!("lost {e}");
                return Err(format!("lost the OBT: {e}"));
            }
        }
    }
}

/// Tries to take the OBT over until it succeeds (prints `took <token> after <ms>`) or the time
/// is up (prints `never` and fails).
pub(crate) async fn obt_contender(args: ObtContenderArgs) -> Result<(), String> {
    let obt = open(&args.uri, &args.db).await?;
    // The wall clock this process sees, so a test can confirm its skew took effect.
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    println!("clock {wall}");
    let started = Instant::now();
    let mut refusals = 0;
    while started.elapsed() < args.for_ {
        let attempt = match args.rule {
            Rule::Monotonic => {
                let observed = obt.observe(&args.id).await.map_err(|e| e.to_string())?;
                let lease = observed.state.lease.unwrap_or_default();
                tokio::time::sleep(lease).await;
                obt.take_over(&observed, &args.owner).await
            }
            Rule::Server => {
                let attempt = obt.take_over_expired(&args.id, &args.owner).await;
                if attempt.is_err() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                attempt
            }
        };
        match attempt {
            Ok(owned) => {
                println!(
                    "took {} after {} ms ({refusals} refusals)",
                    owned.token,
                    started.elapsed().as_millis()
                );
                return Ok(());
            }
            Err(ObtError::LeaseLive { .. } | ObtError::Changed { .. }) => refusals += 1,
            Err(e) => return Err(format!("take over: {e}")),
        }
    }
    println!("never ({refusals} refusals)");
    Err("did not take over".into())
}
