//! The ordered batch queue: three services' batches go to an external ledger (a simulator)
//! through two submitters and a monitor; the ledger finds one batch invalid and forgets another
//! (unknown), and a third submitter dies between claiming a batch and sending it. Each service's
//! batches still reach the ledger one at a time and in the order they were created, and the
//! invalid one is never sent again.
//!
//! ```sh
//! cargo run --example queue                                       # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example queue
//! ```

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{expect, step, TourResult};
use mongotx::queue::{BatchStatus, Batches, Monitor, NewBatch, Submitter};
use mongotx::testkit::ledger::{Fate, Faults, Ledger};
use mongotx::Store;

#[tokio::main]
async fn main() {
    common::main("queue", |example| async move { run(&example.store).await }).await;
}

/// Every step of this example, on `store`'s database.
pub async fn run(store: &Store) -> TourResult {
    step("Batch queue: 3 services × 4 batches to a ledger; one invalid, one unknown, one submitter dies mid-submission");
    // A short delay window for delayed batches (the default is 15 s, as in the queuer's
    // reference design).
    let batches = Batches::with_collection(store, "batches", Duration::from_millis(200)).await?;
    let ledger = Ledger::new(Duration::from_millis(30), Faults::NONE, 7);
    ledger.force("billing-2", Fate::Invalid);
    ledger.force("search-3", Fate::Forget);
    let mut created: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for i in 1..=4 {
        for service in ["billing", "search", "mail"] {
            let header = format!("{service}-{i}");
            batches
                .add(&NewBatch::new(
                    service,
                    &header,
                    format!("{service} events, part {i}"),
                ))
                .await?;
            created.entry(service.to_string()).or_default().push(header);
        }
    }
    println!("   added, per service in creation order: {created:?}");

    // The submitter that dies: it claims mail-1 (marking it submitted) and never sends it.
    let doomed = Submitter::new(
        batches.clone(),
        ledger.clone(),
        "doomed",
        Duration::from_millis(300),
    );
    let queued = batches.round().await?;
    let mail_1 = queued
        .iter()
        .find(|b| b.header == "mail-1")
        .ok_or("mail-1 was not queued first")?;
    let claim = doomed
        .take(mail_1)
        .await?
        .ok_or("the doomed submitter got no claim")?;
    println!(
        "   submitter \"doomed\" claimed {} (submitted = {}) and died before sending it",
        claim.batch.header, claim.batch.submitted
    );
    drop(claim);

    let submitters: Vec<_> = ["alpha", "beta"]
        .into_iter()
        .map(|name| {
            Submitter::new(
                batches.clone(),
                ledger.clone(),
                name,
                Duration::from_secs(5),
            )
        })
        .collect();
    let monitor = Monitor::new(batches.clone(), ledger.clone());
    let started = Instant::now();
    loop {
        for s in &submitters {
            s.run_once().await?;
        }
        for b in monitor.run_once().await? {
            if matches!(b.status, Some(BatchStatus::Invalid | BatchStatus::Unknown)) {
                println!(
                    "   monitor: the ledger says {} is {}",
                    b.header,
                    b.status.map_or("?", BatchStatus::as_str)
                );
            }
        }
        let open = ["billing", "search", "mail"]
            .iter()
            .flat_map(|s| (1..=4).map(move |i| format!("{s}-{i}")))
            .collect::<Vec<_>>();
        let mut left = 0;
        for header in &open {
            let b = batches.get(header).await?;
            if !matches!(
                b.status,
                Some(BatchStatus::Committed | BatchStatus::Invalid)
            ) {
                left += 1;
            }
        }
        if left == 0 {
            break;
        }
        if started.elapsed() > Duration::from_secs(30) {
            return Err(format!("{left} batches still open after 30 s").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let committed = ledger.committed();
    for (service, headers) in &committed {
        println!("   ledger, {service}: committed in this order: {headers:?}");
    }
    let expected = |service: &str| -> Vec<String> {
        created[service]
            .iter()
            .filter(|h| h.as_str() != "billing-2")
            .cloned()
            .collect()
    };
    for service in ["billing", "search", "mail"] {
        expect(
            committed.get(service) == Some(&expected(service)),
            &format!("{service}'s batches committed once each, in creation order"),
        )?;
    }
    expect(
        batches.get("billing-2").await?.status == Some(BatchStatus::Invalid),
        "billing-2 settled as invalid (and never sent again)",
    )?;
    expect(
        ledger.breaches().is_empty(),
        "no breach of the submitters' rules",
    )?;
    println!(
        "   {} submissions in {:.1} s; billing-2 invalid and not resubmitted; search-3 and mail-1 submitted again; no breach",
        ledger.submissions(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
