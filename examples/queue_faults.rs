//! The ordered batch queue when things go wrong: the ledger finds one batch invalid and forgets
//! another (it answers "unknown"), and a submitter dies between claiming a batch and sending
//! it. Each service's batches still reach the ledger one at a time and in the order they were
//! created, the forgotten and the abandoned batches are sent again, and the invalid one never
//! is. The ledger is a small in-memory stand-in implementing `LedgerApi`.
//!
//! ```sh
//! cargo run --example queue_faults                                # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example queue_faults
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mongotx::queue::LedgerStatus::{self, Committed, Invalid, Pending, Unknown};
use mongotx::queue::DEFAULT_DELAY;
use mongotx::queue::{Answer, BatchStatus, Batches, LedgerApi, Monitor, NewBatch, Submitter};
use mongotx::Store;

/// The ledger stand-in: it commits a batch when first asked about it, finds `billing-2`
/// invalid, forgets `search-3` the first time, and notes breaches of the submitters' rules.
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<Books>>);

#[derive(Default)]
struct Books {
    taken: HashMap<String, (String, LedgerStatus)>, // header -> service, status
    committed: BTreeMap<String, Vec<String>>,       // service -> headers, in commit order
    done: usize,                                    // batches committed
    breaches: Vec<String>,
}

impl LedgerApi for Ledger {
    async fn submit(&self, service: &str, header: &str, _: &str) -> Result<Answer, String> {
        let books = &mut *self.0.lock().unwrap();
        let status = match (header, books.taken.get(header).map(|t| t.1)) {
            (_, Some(Pending | Committed)) => return Ok(Answer::Accepted),
            (_, Some(Invalid)) | ("billing-2", _) => Invalid,
            ("search-3", None) => Unknown, // taken, then forgotten
            _ => Pending,
        };
        let again = books.taken.get(header).is_some_and(|t| t.1 == Invalid);
        let busy = books
            .taken
            .values()
            .any(|(s, st)| s == service && *st == Pending);
        if again || busy {
            books.breaches.push(format!("{header} sent out of turn"));
        }
        books.taken.insert(header.into(), (service.into(), status));
        Ok(Answer::Accepted)
    }

    async fn status(&self, header: &str) -> Result<LedgerStatus, String> {
        let books = &mut *self.0.lock().unwrap();
        let Some((service, status)) = books.taken.get_mut(header) else {
            return Ok(Unknown);
        };
        if *status == Pending {
            *status = Committed;
            books.done += 1;
            let order = books.committed.entry(service.clone()).or_default();
            order.push(header.into());
        }
        Ok(*status)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_queue_faults");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database (collection `faulty_batches`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!("\n-- Batch queue: one batch invalid, one forgotten, a submitter dies mid-submission");
    let batches = Batches::with_collection(store, "faulty_batches", DEFAULT_DELAY).await?;
    let mut headers = Vec::new();
    for i in 1..=4 {
        for service in ["billing", "search", "mail"] {
            let header = format!("{service}-{i}");
            let batch = NewBatch::new(service, &header, format!("{service} events, part {i}"));
            batches.add(&batch).await?;
            headers.push(header);
        }
    }
    let ledger = Ledger::default();
    let submitter = |name, ttl| Submitter::new(batches.clone(), ledger.clone(), name, ttl);
    // The submitter that dies: it claims mail-1 (marking it submitted) and never sends it.
    let doomed = submitter("doomed", Duration::from_millis(300));
    let queued = batches.round().await?;
    let mail_1 = queued.iter().find(|b| b.header == "mail-1");
    let claim = doomed.take(mail_1.ok_or("mail-1 is queued")?).await?;
    println!("  submitter \"doomed\" claimed mail-1 and died before sending it");
    drop(claim.ok_or("no claim")?);

    let ttl = Duration::from_secs(5);
    let (alpha, beta) = (submitter("alpha", ttl), submitter("beta", ttl));
    let monitor = Monitor::new(batches.clone(), ledger.clone());
    let (started, limit) = (Instant::now(), Duration::from_secs(30));
    while ledger.0.lock().unwrap().done < headers.len() - 1 {
        assert!(started.elapsed() < limit, "not done within 30 s");
        alpha.run_once().await?;
        beta.run_once().await?;
        for b in monitor.run_once().await? {
            if let Some(status @ (BatchStatus::Invalid | BatchStatus::Unknown)) = b.status {
                let (header, status) = (&b.header, status.as_str());
                println!("  monitor: the ledger says {header} is {status}");
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let billing_2 = batches.get("billing-2").await?.status;
    assert_eq!(billing_2, Some(BatchStatus::Invalid));
    let books = ledger.0.lock().unwrap();
    for (service, committed) in &books.committed {
        println!("  ledger, {service}: committed in this order: {committed:?}");
        let created = headers.iter().filter(|h| h.starts_with(service.as_str()));
        let sendable = created.filter(|h| *h != "billing-2");
        assert!(
            committed.iter().eq(sendable),
            "once each, in creation order"
        );
    }
    assert!(books.breaches.is_empty(), "breaches: {:?}", books.breaches);
    println!("  billing-2 invalid and never sent again; search-3 and mail-1 sent again; no breach");
    Ok(())
}
