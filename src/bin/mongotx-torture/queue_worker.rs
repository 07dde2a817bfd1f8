//! A batch-queue worker process: a submitter and a monitor over one collection of batches and
//! one ledger served over HTTP. It reports on stdout, a line per event, so a parent that kills
//! it knows what it had:
//!
//! - `claimed <header>` once it holds a batch's claim (the batch is marked submitted), before
//!   it sends it;
//! - `sent <header> <accepted|delayed>` once the answer is recorded;
//! - `status <header> <status>` for each status its monitor records.

use std::io::Write;
use std::time::{Duration, Instant};

use clap::Args;
use mongotx::queue::{BatchStatus, Batches, Monitor, QueueError, Submitter};
use mongotx::testkit::ledger_http::HttpLedger;
use mongotx::Store;

/// Arguments of a batch-queue worker.
#[derive(Debug, Args, Clone)]
pub(crate) struct QueueWorkerArgs {
    /// Connection string of the server.
    #[arg(long)]
    uri: String,
    /// Database holding the batches.
    #[arg(long, value_parser = crate::cli::database_name)]
    db: String,
    /// Base URL of the ledger server.
    #[arg(long)]
    ledger: String,
    /// Name recorded in its claims.
    #[arg(long)]
    name: String,
    /// How long a claim lasts.
    #[arg(long, value_parser = crate::duration, default_value = "5s")]
    claim_ttl: Duration,
    /// The delay window before a delayed batch is retried.
    #[arg(long, value_parser = crate::duration, default_value = "15s")]
    delay: Duration,
    /// Pause between two rounds that found nothing to do.
    #[arg(long, value_parser = crate::duration, default_value = "10ms")]
    poll: Duration,
    /// How long to run (killed processes stop sooner).
    #[arg(long = "for", value_parser = crate::duration, default_value = "1h")]
    run_for: Duration,
    /// Print the durations of submissions this often (`latencies` lines, for the soak).
    #[arg(long, value_parser = crate::duration)]
    latency_every: Option<Duration>,
}

/// Runs a submitter and a monitor until `--for` has passed.
pub(crate) async fn queue_worker(args: QueueWorkerArgs) -> Result<(), String> {
    let client = crate::client(&args.uri).await?;
    let store = Store::new(client.database(&args.db));
    let batches =
        Batches::with_collection(&store, mongotx::collections::BATCHES_COLLECTION, args.delay)
            .await
            .map_err(|e| format!("open: {e}"))?;
    let ledger = HttpLedger::new(&args.ledger);
    let until = Instant::now() + args.run_for;
    let submitter = Submitter::new(batches.clone(), ledger.clone(), &args.name, args.claim_ttl);
    let monitor = Monitor::new(batches.clone(), ledger);
    let poll = args.poll;
    let latencies = crate::latency::Latencies::every(args.latency_every);
    let submitting = tokio::spawn(async move {
        while Instant::now() < until {
            match submit_round(&batches, &submitter, &latencies).await {
                Ok(0) => tokio::time::sleep(poll).await,
                Ok(_) => {}
                Err(e) if e.is_retryable() => eprintln!("queue worker: {e}; going on"),
                Err(e) => return Err(format!("submitter: {e}")),
            }
        }
        Ok::<(), String>(())
    });
    let monitoring = tokio::spawn(async move {
        while Instant::now() < until {
            match monitor.run_once().await {
                Ok(changed) => {
                    for b in changed {
                        if let Some(status) = b.status {
                            say(&format!("status {} {status}", b.header));
                        }
                    }
                }
                Err(e) if e.is_retryable() => eprintln!("queue worker: {e}; going on"),
                Err(e) => return Err(format!("monitor: {e}")),
            }
            tokio::time::sleep(poll).await;
        }
        Ok::<(), String>(())
    });
    submitting.await.map_err(|e| format!("submitter: {e}"))??;
    monitoring.await.map_err(|e| format!("monitor: {e}"))??;
    Ok(())
}

/// One queuer round, then claim and send what it queued, saying so. Returns the batches sent.
async fn submit_round(
    batches: &Batches,
    submitter: &Submitter<HttpLedger>,
    latencies: &crate::latency::Latencies,
) -> Result<usize, QueueError> {
    let mut sent = 0;
    for batch in batches.round().await? {
        let Some(claim) = submitter.take(&batch).await? else {
            continue;
        };
        say(&format!("claimed {}", claim.batch.header));
        let started = Instant::now();
        if let Some(b) = submitter.send(&claim).await? {
            latencies.since("queue.submit", started);
            let word = match b.status {
                Some(BatchStatus::Delayed) => "delayed",
                _ => "accepted",
            };
            say(&format!("sent {} {word}", b.header));
            sent += 1;
        }
    }
    Ok(sent)
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}
