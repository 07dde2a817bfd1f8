//! Four worker processes (each a queuer, a submitter and a monitor) move 5 services × 200
//! batches to one ledger served over HTTP, which finds 5 % of submissions invalid, forgets 5 %
//! (unknown) and answers 5 % delayed, while one worker is SIGKILLed every 1.5 to 2.5 s (each time
//! just after it claimed a batch, before it sent it) and started again. Half the batches are
//! added before the workers start, the other half while they run, in turn on a link of the
//! test's own and on a slow one (20 ms for each reply about the services) whose estimate of the
//! server's clock is 1 s behind. Afterwards: every batch is committed or invalid, every valid
//! batch was committed exactly once and in the order of its service's adds, the ledger never saw
//! two batches of one service in flight, and no invalid batch was submitted again. The same fleet
//! then moves 5 services × 200 batches under the parallel strategy, each batch declaring keys
//! (one in ten none) over four keys: every conflicting pair committed in the order of its stamps,
//! and the ledger never saw a batch sent while an older one it conflicts with was not final.

use crate::common;

use std::collections::{BTreeMap, HashSet};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::TestDb;
use bson::{doc, Document};
use mongotx::collections::BATCHES_COLLECTION;
use mongotx::queue::{Batch, Batches, NewBatch, Strategy};
use mongotx::testkit::ledger::{Faults, Ledger};
use mongotx::testkit::ledger_http::LedgerServer;

const SERVICES: usize = 5;
const PER_SERVICE: usize = 200;
const WORKERS: usize = 4;
/// Every batch settled well before this, or the test fails.
const LIMIT: Duration = Duration::from_secs(120);

/// What one worker process said.
#[derive(Debug, Default)]
struct Said {
    claimed: Vec<String>,
    sent: HashSet<String>,
    kill_at_claim: bool,
    killed_at_claim: Option<String>,
}

type Worker = common::worker::Worker<Said>;

/// A queue worker process on `ledger`.
fn start_worker(t: &TestDb, ledger: &str, name: &str) -> Worker {
    let mut command = Command::new(env!("CARGO_BIN_EXE_mongotx-torture"));
    command
        .args([
            "queue-worker",
            "--uri",
            &common::server_uri(),
            "--db",
            t.db.name(),
        ])
        .args(["--ledger", ledger, "--name", name])
        .args(["--claim-ttl", "2s", "--delay", "500ms", "--poll", "10ms"])
        .args(["--for", "600s"]);
    Worker::start(command, "queue worker", |words, said: &mut Said, killer| {
        match words {
            ["claimed", header] => {
                said.claimed.push(header.to_string());
                // Killed between taking a batch and sending it: the batch is marked submitted
                // under a claim nobody will ever use.
                if said.kill_at_claim && said.killed_at_claim.is_none() {
                    killer.kill();
                    said.killed_at_claim = Some(header.to_string());
                }
            }
            ["sent", header, _] => {
                said.sent.insert(header.to_string());
            }
            ["status", _, _] => {}
            _ => return false,
        }
        true
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_with_kills_commit_every_valid_batch_once_in_order() {
    fleet(false, PER_SERVICE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_with_kills_keep_every_conflict_chain_in_order_under_the_parallel_strategy()
{
    fleet(true, PER_SERVICE).await;
}

/// The keys batch `i` of service `s` declares under the parallel strategy (one in ten none).
fn keys_of(batch: NewBatch, i: usize, s: usize) -> NewBatch {
    if i % 10 == 3 {
        return batch;
    }
    let key = |n: usize| format!("k{}", n % 4);
    batch.with_keys([key(i * 3 + s)], [key(i * 7 + s * 5 + 1)])
}

/// The fleet, serial or parallel, with `per_service` batches of each service.
async fn fleet(parallel: bool, per_service: usize) {
    let _turn = common::fleet_turn(module_path!());
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.unwrap();
    if parallel {
        crate::queue_parallel::format_two(&t).await;
        for s in 0..SERVICES {
            batches
                .set_strategy(&format!("svc{s}"), Strategy::Parallel)
                .await
                .unwrap();
        }
    }
    let faults = Faults {
        invalid: 0.05,
        unknown: 0.05,
        delayed: 0.05,
        lost: 0.0,
    };
    let server = LedgerServer::start(Ledger::new(Duration::from_millis(20), faults, 2026))
        .await
        .unwrap();
    let ledger = server.ledger().clone();

    // Creation order: the order of the adds of each service (interleaved across services),
    // half of them before the workers start.
    let lagging = crate::queue_claim::Tampered::start(&t).await;
    lagging.link.hello_behind(1_000);
    lagging.link.slow_services(20);
    let handles = [batches.clone(), lagging.batches().await];
    let declare = ledger.clone();
    let adds = move |from: usize, to: usize| {
        let (handles, declare) = (handles.clone(), declare.clone());
        async move {
            let mut created: BTreeMap<String, Vec<String>> = BTreeMap::new();
            let mut added: Vec<Batch> = Vec::new();
            for i in from..to {
                for s in 0..SERVICES {
                    let service = format!("svc{s}");
                    let header = format!("{service}-{:03}", per_service - i);
                    let mut batch =
                        NewBatch::new(&service, &header, format!("content of {header}"));
                    if parallel {
                        batch = keys_of(batch, i, s);
                    }
                    let b = handles[(i + s) % 2].add(&batch).await.unwrap();
                    declare.declare(&b);
                    added.push(b);
                    created.entry(service).or_default().push(header);
                }
            }
            (created, added)
        }
    };
    let (mut created, mut added) = adds(0, per_service / 2).await;

    let started = Instant::now();
    let mut names = 0usize;
    let mut start = |t: &TestDb| {
        names += 1;
        start_worker(t, &server.url(), &format!("worker-{names}"))
    };
    let mut workers: Vec<Worker> = (0..WORKERS).map(|_| start(&t)).collect();
    let adding = tokio::spawn(adds(per_service / 2, per_service));
    let mut killed_at_claim = Vec::new();
    let mut kills = 0usize;
    let mut next_kill = Duration::from_secs(2);
    let open = doc! { "status": { "$nin": ["committed", "invalid"] } };
    let coll = t.db.collection::<Document>(BATCHES_COLLECTION);
    let mut adding = Some(adding);
    loop {
        if adding.as_ref().is_some_and(|a| a.is_finished()) {
            let (more, batches) = adding.take().unwrap().await.unwrap();
            for (service, headers) in more {
                created.entry(service).or_default().extend(headers);
            }
            added.extend(batches);
        }
        let left = coll.count_documents(open.clone()).await.unwrap();
        if left == 0 && adding.is_none() {
            break;
        }
        if started.elapsed() >= LIMIT {
            // Say where each service is stuck.
            let mut oldest: BTreeMap<String, Document> = BTreeMap::new();
            for d in common::raw_snapshot(&t.db, BATCHES_COLLECTION).await {
                let done = matches!(d.get_str("status"), Ok("committed" | "invalid"));
                let service = d.get_str("service_id").unwrap().to_string();
                let older = oldest.get(&service).is_none_or(|o| {
                    (
                        d.get_datetime("created_at").unwrap(),
                        d.get_str("_id").unwrap(),
                    ) < (
                        o.get_datetime("created_at").unwrap(),
                        o.get_str("_id").unwrap(),
                    )
                });
                if !done && older {
                    oldest.insert(service, d);
                }
            }
            let services = common::raw_snapshot(&t.db, "batches_services").await;
            panic!("{left} batches still open after {LIMIT:?}; oldest open per service: {oldest:#?}; services: {services:#?}");
        }
        if started.elapsed() >= next_kill {
            let slot = kills % WORKERS;
            workers[slot].said.lock().unwrap().kill_at_claim = true;
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut caught = None;
            while Instant::now() < deadline {
                caught = workers[slot].said.lock().unwrap().killed_at_claim.clone();
                if caught.is_some() || coll.count_documents(open.clone()).await.unwrap() == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let fresh = start(&t);
            let victim = std::mem::replace(&mut workers[slot], fresh);
            let said = victim.kill();
            if let Some(header) = caught {
                if !said.sent.contains(&header) {
                    killed_at_claim.push(header);
                }
            }
            kills += 1;
            next_kill =
                started.elapsed() + Duration::from_millis(2_000 + 1_000 * (kills as u64 % 3));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = started.elapsed();
    for worker in workers.drain(..) {
        worker.kill();
    }

    let breaches = ledger.breaches();
    let committed = ledger.committed();
    let stored = common::raw_snapshot(&t.db, BATCHES_COLLECTION).await;
    let invalid: HashSet<String> = stored
        .iter()
        .filter(|d| d.get_str("status") == Ok("invalid"))
        .map(|d| d.get_str("_id").unwrap().to_string())
        .collect();
    let committed_count: usize = committed.values().map(Vec::len).sum();
    println!(
        "{} batches of {SERVICES} services in {took:?} ({:.0} per s); {kills} kills, {} of them \
         between a claim and its submission; {} submissions; {committed_count} committed, {} \
         invalid; breaches: {}; batches sent again while the ledger had them: {}",
        SERVICES * per_service,
        (SERVICES * per_service) as f64 / took.as_secs_f64(),
        killed_at_claim.len(),
        ledger.submissions(),
        invalid.len(),
        breaches.len(),
        ledger.repeats().len(),
    );
    assert!(breaches.is_empty(), "{breaches:?}");
    assert!(kills >= 4, "a kill every 1.5 to 2.5 s: {kills}");
    assert!(
        !killed_at_claim.is_empty(),
        "some worker was killed holding a claim it had not sent"
    );
    assert!(!invalid.is_empty(), "the ledger found some batches invalid");
    if parallel {
        let invalid: Vec<String> = invalid.iter().cloned().collect();
        crate::queue_parallel::check_order(&ledger, &added, &invalid);
    }
    for (service, headers) in created.iter().filter(|_| !parallel) {
        let expected: Vec<&String> = headers.iter().filter(|h| !invalid.contains(*h)).collect();
        let got: Vec<&String> = committed
            .get(service)
            .map(|c| c.iter().collect())
            .unwrap_or_default();
        assert_eq!(
            got, expected,
            "{service}: every valid batch committed once, in the order of its adds"
        );
    }
    // The batches killed mid-submission were all settled in the end (the assertions above),
    // and nothing is left in a slot or claimed.
    let services = common::raw_snapshot(&t.db, "batches_services").await;
    assert!(
        services.iter().all(|d| !d.contains_key("holder")),
        "a slot is still held: {services:?}"
    );
    assert!(
        stored.iter().all(|d| !d.contains_key("claim")),
        "a claim is left behind"
    );
}
