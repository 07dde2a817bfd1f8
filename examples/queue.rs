//! The ordered batch queue: three services' batches go to an external ledger through two
//! submitters and a monitor, which may run in any number of processes; each service's batches
//! reach the ledger one at a time and in the order they were created. The ledger is a small
//! in-memory stand-in implementing `LedgerApi`, the trait your ledger's client implements. What
//! happens when the ledger refuses or forgets a batch, or a submitter dies: `queue_faults.rs`.
//!
//! ```sh
//! cargo run --example queue                                       # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example queue
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mongotx::queue::LedgerStatus::{self, Committed, Unknown};
use mongotx::queue::{Answer, BatchStatus, Batches, LedgerApi, Monitor, NewBatch, Submitter};
use mongotx::Store;

/// The ledger stand-in: it takes a batch, commits it when first asked about it, and notes a
/// breach of the submitters' rule (one batch of a service at a time).
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<Books>>);

#[derive(Default)]
struct Books {
    in_flight: HashMap<String, String>,       // header -> service
    committed: BTreeMap<String, Vec<String>>, // service -> headers, in commit order
    breaches: Vec<String>,
}

impl LedgerApi for Ledger {
    async fn submit(&self, service: &str, header: &str, _: &str) -> Result<Answer, String> {
        let mut books = self.0.lock().unwrap();
        if books.in_flight.values().any(|s| s == service) {
            let breach = format!("{header} sent while {service} has a batch in flight");
            books.breaches.push(breach);
        }
        books.in_flight.insert(header.into(), service.into());
        Ok(Answer::Accepted)
    }

    async fn status(&self, header: &str) -> Result<LedgerStatus, String> {
        let mut books = self.0.lock().unwrap();
        if let Some(service) = books.in_flight.remove(header) {
            let done = books.committed.entry(service).or_default();
            done.push(header.into());
        }
        let known = books.committed.values().flatten().any(|h| h == header);
        Ok(if known { Committed } else { Unknown })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_queue");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database (collection `batches`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!("\n-- Batch queue: 3 services × 4 batches, two submitters and a monitor");
    let batches = Batches::open(store).await?;
    let mut headers = Vec::new();
    for i in 1..=4 {
        for service in ["billing", "search", "mail"] {
            let header = format!("{service}-{i}");
            let batch = NewBatch::new(service, &header, format!("{service} events, part {i}"));
            batches.add(&batch).await?;
            headers.push(header);
        }
    }
    println!("  added, in creation order: {headers:?}");

    let (ledger, claim_ttl) = (Ledger::default(), Duration::from_secs(5));
    let alpha = Submitter::new(batches.clone(), ledger.clone(), "alpha", claim_ttl);
    let beta = Submitter::new(batches.clone(), ledger.clone(), "beta", claim_ttl);
    let monitor = Monitor::new(batches.clone(), ledger.clone());
    let (started, limit) = (Instant::now(), Duration::from_secs(30));
    loop {
        alpha.run_once().await?;
        beta.run_once().await?;
        monitor.run_once().await?;
        let done: usize = ledger
            .0
            .lock()
            .unwrap()
            .committed
            .values()
            .map(Vec::len)
            .sum();
        if done == headers.len() {
            break;
        }
        assert!(started.elapsed() < limit, "not done within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for header in &headers {
        let status = batches.get(header).await?.status;
        assert_eq!(
            status,
            Some(BatchStatus::Committed),
            "the monitor recorded it"
        );
    }
    let books = ledger.0.lock().unwrap();
    for (service, committed) in &books.committed {
        println!("  ledger, {service}: committed in this order: {committed:?}");
        let created = headers.iter().filter(|h| h.starts_with(service.as_str()));
        assert!(committed.iter().eq(created), "once each, in order");
    }
    assert!(books.breaches.is_empty(), "breaches: {:?}", books.breaches);
    let took = started.elapsed().as_secs_f64();
    println!("  all 12 committed in {took:.1} s, one at a time per service; no breach");
    Ok(())
}
