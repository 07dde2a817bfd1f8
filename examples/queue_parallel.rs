//! The batch queue's parallel strategy: a service's batches declare the accounts they read and
//! write, and those that touch different accounts are at the ledger together, while those that
//! touch the same account still go one after the other, in the order they were added. A batch
//! that declares nothing waits for every older batch of its service. The strategy needs stored
//! format 2, so the tour switches its database to it first.
//!
//! ```sh
//! cargo run --example queue_parallel                              # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example queue_parallel
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mongotx::queue::LedgerStatus::{self, Committed, Unknown};
use mongotx::queue::{Answer, Batches, LedgerApi, Monitor, NewBatch, Strategy, Submitter};
use mongotx::Store;

/// The ledger stand-in: it takes a batch (the account it touches is the header's first part, or
/// `*` for all), commits it when first asked, and notes a breach of the rule: a batch sent while
/// an older one touching the same account is still in flight.
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<Books>>);

#[derive(Default)]
struct Books {
    in_flight: HashMap<String, String>, // header -> account
    most_in_flight: usize,
    committed: BTreeMap<String, Vec<String>>, // account -> headers, in commit order
    breaches: Vec<String>,
}

fn account(header: &str) -> String {
    header.split('/').next().unwrap_or(header).to_string()
}

impl LedgerApi for Ledger {
    async fn submit(&self, _: &str, header: &str, _: &str) -> Result<Answer, String> {
        let mut books = self.0.lock().unwrap();
        let mine = account(header);
        if books
            .in_flight
            .values()
            .any(|a| *a == mine || a == "*" || mine == "*")
        {
            books
                .breaches
                .push(format!("{header} sent beside a conflicting batch"));
        }
        books.in_flight.insert(header.into(), mine);
        books.most_in_flight = books.most_in_flight.max(books.in_flight.len());
        Ok(Answer::Accepted)
    }

    async fn status(&self, header: &str) -> Result<LedgerStatus, String> {
        let mut books = self.0.lock().unwrap();
        if let Some(account) = books.in_flight.remove(header) {
            books
                .committed
                .entry(account)
                .or_default()
                .push(header.into());
        }
        let known = books.committed.values().flatten().any(|h| h == header);
        Ok(if known { Committed } else { Unknown })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_queue_parallel");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database (collection `batches`, service `payments`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!("\n-- Batch queue, parallel strategy: 4 accounts × 3 batches, then one for all");
    store.set_format(2).await?; // every instance of this database reads format 2
    let batches = Batches::open(store).await?;
    batches.set_strategy("payments", Strategy::Parallel).await?; // before its first batch
    let mut headers = Vec::new();
    for i in 1..=3 {
        for acct in ["acct-a", "acct-b", "acct-c", "acct-d"] {
            let header = format!("{acct}/{i}");
            let new = NewBatch::new("payments", &header, format!("{acct}: payment {i}"));
            batches.add(&new.with_keys([acct], [acct])).await?;
            headers.push(header);
        }
    }
    let audit = NewBatch::new("payments", "*/audit", "audit of every account");
    batches.add(&audit).await?; // no keys declared: conflicts with every batch
    headers.push("*/audit".into());

    let ledger = Ledger::default();
    let submitter = Submitter::new(batches.clone(), ledger.clone(), "a", Duration::from_secs(5));
    let monitor = Monitor::new(batches.clone(), ledger.clone());
    let (started, limit) = (Instant::now(), Duration::from_secs(30));
    let committed = |l: &Ledger| {
        l.0.lock()
            .unwrap()
            .committed
            .values()
            .map(Vec::len)
            .sum::<usize>()
    };
    while committed(&ledger) < headers.len() {
        submitter.run_once().await?;
        monitor.run_once().await?;
        assert!(started.elapsed() < limit, "not done within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let books = ledger.0.lock().unwrap();
    for (acct, done) in &books.committed {
        println!("  ledger, {acct}: committed in this order: {done:?}");
        let added = headers.iter().filter(|h| account(h) == *acct);
        assert!(done.iter().eq(added), "once each, in the order added");
    }
    assert!(books.breaches.is_empty(), "breaches: {:?}", books.breaches);
    assert_eq!(books.most_in_flight, 4, "one batch per account at a time");
    println!(
        "  all {} committed; at most {} in flight together, never two of one account",
        headers.len(),
        books.most_in_flight
    );
    Ok(())
}
