//! A quota worker process: consumes three resources from random projects of a two-level
//! hierarchy and releases them (by consumer, or by what the consume returned), until it is
//! killed. Tests kill it at random moments and then
//! check that usage still equals the allocations everywhere.

use std::time::Duration;

use clap::Args;
use mongotx::quota::{Consumed, Quota, QuotaError, QuotaOptions, Request};
use mongotx::Store;
use rand::Rng;

/// Arguments of a quota worker.
#[derive(Debug, Args)]
pub(crate) struct QuotaWorkerArgs {
    /// Connection string of the server.
    #[arg(long)]
    uri: String,
    /// Database holding the providers.
    #[arg(long, value_parser = crate::cli::database_name)]
    db: String,
    /// Scopes of the projects to consume from (each a child of one domain).
    #[arg(long, value_delimiter = ',', required = true)]
    projects: Vec<String>,
    /// Resources every request takes.
    #[arg(long, value_delimiter = ',', required = true)]
    resources: Vec<String>,
    /// Deadline of the transactions spanning several providers.
    #[arg(long, default_value = "1s", value_parser = crate::duration)]
    txn_timeout: Duration,
    /// Print the durations of consumes and releases this often (`latencies` lines, for the soak).
    #[arg(long, value_parser = crate::duration)]
    latency_every: Option<Duration>,
}

/// Consumes and releases until killed; prints one line per hundred requests.
pub(crate) async fn quota_worker(args: QuotaWorkerArgs) -> Result<(), String> {
    let client = crate::client(&args.uri).await?;
    let store = Store::new(client.database(&args.db));
    let quota = Quota::with_options(
        &store,
        QuotaOptions::default().txn_timeout(args.txn_timeout),
    )
    .await
    .map_err(|e| format!("open quota: {e}"))?;
    let latencies = crate::latency::Latencies::every(args.latency_every);
    let me = std::process::id();
    let mut held: Vec<Consumed> = Vec::new();
    for n in 0_u64.. {
        let (project, amounts, release) = {
            let mut rng = rand::rng();
            let project = args.projects[rng.random_range(0..args.projects.len())].clone();
            let amounts: Vec<i64> = args
                .resources
                .iter()
                .map(|_| rng.random_range(1..=30))
                .collect();
            (project, amounts, rng.random_bool(0.45))
        };
        if release && !held.is_empty() {
            // Half by consumer name, half by what the consume returned.
            let taken = held.remove(0);
            let started = std::time::Instant::now();
            let released = if n % 2 == 0 {
                quota.release(&taken.consumer).await
            } else {
                quota.release_consumed(&taken).await
            };
            if released.is_ok() {
                latencies.since("quota.release", started);
            }
            match released {
                Ok(_)
                | Err(QuotaError::UnknownConsumer { .. } | QuotaError::UnknownRequest { .. }) => {}
                Err(e) => tracing::warn!(consumer = %taken.consumer, error = %e, "release failed"),
            }
            continue;
        }
        let consumer = format!("w{me}-{n}");
        let mut request = Request::new(&consumer);
        for (resource, amount) in args.resources.iter().zip(amounts) {
            request = request.take((project.as_str(), resource.as_str()), amount);
        }
        let started = std::time::Instant::now();
        match quota.consume(&request).await {
            Ok(taken) => {
                latencies.since("quota.consume", started);
                held.push(taken);
            }
            Err(e) => tracing::debug!(%consumer, error = %e, "consume refused"),
        }
        if n % 100 == 99 {
            println!("quota-worker {me}: {n} requests, holding {}", held.len());
        }
    }
    Ok(())
}
