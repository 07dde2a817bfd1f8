//! The OBT race: 32 tasks over 4 clients keep preempting one OBT for 20 s and, while they own it,
//! make fenced downstream calls and owned transactions. Checked afterwards from the fences' logs
//! and the database: tokens unique and increasing, no downstream resource ever admitted a token
//! lower than one it admitted before, and no owned transaction of a preempted owner committed.
//!
//! Owned transactions only insert entries of their own, so nothing but the OBT guard can refuse
//! them; and owners commit even after a node has refused them (as a stalled owner that did not
//! look would), so the guard is what stops them.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::TestDb;
use bson::{doc, Document};
use mongotx::obt::{Fence, FenceError, MemoryFence, MongoFence, NewObt, Obt, ObtError, Token};
use mongotx::{Store, Transactions};
use rand::Rng;

const RESOURCES: usize = 3;

/// A storage node: an in-process fence whose every decision is logged in the order it was made.
#[derive(Default)]
struct Node {
    fence: MemoryFence,
    log: Mutex<Vec<(Token, bool)>>,
}

impl Node {
    async fn call(&self, token: Token) -> Result<(), FenceError> {
        // The log lock is held across the decision, so the log order is the admission order.
        let mut log = self.log.lock().unwrap();
        let result = futures::executor::block_on(self.fence.admit("dlv0", token));
        log.push((token, result.is_ok()));
        result
    }
}

fn ledger_spec() -> mongotx::CollectionSpec {
    mongotx::CollectionSpec::new(
        "ledger",
        1,
        r#"{"bsonType":"object","required":["_id","_schema","_version"],"properties":{
            "_id":{"bsonType":"string"},"_schema":{"bsonType":"long"},"_version":{"bsonType":"long"},
            "_txn":{"bsonType":"objectId"},"_hold":{"bsonType":"object"},"_deleted":{"bsonType":"date"},
            "_deleting":{"bsonType":"bool"},"seq":{"bsonType":"long"},"token":{"bsonType":"long"},
            "owner":{"bsonType":"string"}}}"#,
    )
    .unwrap()
}

#[derive(Default)]
struct Counts {
    preempts: AtomicU64,
    lost_races: AtomicU64,
    admitted: AtomicU64,
    stale: AtomicU64,
    committed: AtomicU64,
    preempted_commits: AtomicU64,
    conflicts: AtomicU64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_tasks_preempting_one_obt_never_break_either_fence() {
    let t = TestDb::new().await;
    let setup = Obt::open(&t.store).await.unwrap();
    setup.create(NewObt::new("vol", "nobody")).await.unwrap();
    let ledger = t.store.repository::<Document>(ledger_spec()).await.unwrap();

    let mut clients = Vec::new();
    for _ in 0..4 {
        let store = Store::new(t.other_client_db().await);
        let obt = Obt::open(&store).await.unwrap();
        let ledger = store.repository::<Document>(ledger_spec()).await.unwrap();
        clients.push((store, obt, ledger));
    }
    let nodes: Arc<Vec<Node>> = Arc::new((0..RESOURCES).map(|_| Node::default()).collect());
    let mongo_log = Arc::new(Mutex::new(Vec::<(Token, Result<(), String>)>::new()));
    // (owner, token, when the preemption returned)
    let handed_out = Arc::new(Mutex::new(Vec::<(String, Token, Instant)>::new()));
    // (token, when the commit began, whether it committed)
    let commits = Arc::new(Mutex::new(Vec::<(Token, Instant, bool)>::new()));
    let counts = Arc::new(Counts::default());
    let until = Instant::now() + Duration::from_secs(20);

    let mut tasks = Vec::new();
    for task in 0..32 {
        let (store, obt, ledger) = clients[task % 4].clone();
        let mongo = MongoFence::open(&store).await.unwrap();
        let (nodes, mongo_log, handed_out, commits, counts) = (
            Arc::clone(&nodes),
            Arc::clone(&mongo_log),
            Arc::clone(&handed_out),
            Arc::clone(&commits),
            Arc::clone(&counts),
        );
        tasks.push(tokio::spawn(async move {
            let me = format!("w{task}");
            let txns = Transactions::new(&store);
            while Instant::now() < until {
                // Owners get a few milliseconds between preemptions, on average, to do their work.
                let wait = rand::rng().random_range(50..300);
                tokio::time::sleep(Duration::from_millis(wait)).await;
                let current = match obt.get("vol").await {
                    Ok(s) => s,
                    Err(e) => panic!("{me}: read the OBT: {e}"),
                };
                let owned = match obt.preempt("vol", &current.owner, &me).await {
                    Ok(owned) => owned,
                    Err(ObtError::NotOwner { .. }) => {
                        counts.lost_races.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    Err(e) => panic!("{me}: preempt: {e}"),
                };
                counts.preempts.fetch_add(1, Ordering::Relaxed);
                handed_out
                    .lock()
                    .unwrap()
                    .push((me.clone(), owned.token, Instant::now()));
                let pause = rand::rng().random_range(0..3);
                tokio::time::sleep(Duration::from_millis(pause)).await;

                // Downstream calls, each fenced by the token.
                for node in nodes.iter() {
                    match node.call(owned.token).await {
                        Ok(()) => counts.admitted.fetch_add(1, Ordering::Relaxed),
                        Err(FenceError::StaleToken { .. }) => {
                            counts.stale.fetch_add(1, Ordering::Relaxed)
                        }
                        Err(e) => panic!("{me}: node: {e}"),
                    };
                }
                let result = mongo.admit("dlv0", owned.token).await;
                mongo_log
                    .lock()
                    .unwrap()
                    .push((owned.token, result.map_err(|e| e.to_string())));

                // An owned transaction that only inserts an entry of its own: if anything
                // refuses it, it is the guard.
                let tx = txns.begin();
                let attempt = counts.preempts.load(Ordering::Relaxed);
                tx.insert(
                    &ledger,
                    &doc! { "_id": format!("{me}-{}-{attempt}", owned.token), "token": owned.token.0, "owner": &me },
                )
                .await
                .unwrap();
                let began = Instant::now();
                let outcome = obt.commit_owned(tx, &owned).await;
                commits
                    .lock()
                    .unwrap()
                    .push((owned.token, began, outcome.is_ok()));
                match outcome {
                    Ok(_) => counts.committed.fetch_add(1, Ordering::Relaxed),
                    Err(ObtError::Preempted { .. }) => {
                        counts.preempted_commits.fetch_add(1, Ordering::Relaxed)
                    }
                    Err(e) if e.is_retryable() => counts.conflicts.fetch_add(1, Ordering::Relaxed),
                    Err(e) => panic!("{me}: owned commit: {e}"),
                };
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }

    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    println!(
        "preempts {}, lost preempt races {}, node calls admitted {}, refused as stale {}, owned commits {}, refused as preempted {}, conflicts {}",
        load(&counts.preempts),
        load(&counts.lost_races),
        load(&counts.admitted),
        load(&counts.stale),
        load(&counts.committed),
        load(&counts.preempted_commits),
        load(&counts.conflicts)
    );

    // Tokens: unique, each task's rising, and the OBT ends with the highest.
    let handed_out = handed_out.lock().unwrap().clone();
    let mut tokens: Vec<Token> = handed_out.iter().map(|(_, t, _)| *t).collect();
    let n = tokens.len();
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens.len(), n, "a token was handed out twice");
    let mut per_task: BTreeMap<&str, Vec<Token>> = BTreeMap::new();
    for (owner, token, _) in &handed_out {
        per_task.entry(owner).or_default().push(*token);
    }
    for (owner, mine) in &per_task {
        assert!(
            mine.windows(2).all(|w| w[0] < w[1]),
            "{owner}'s tokens fell"
        );
    }
    let last = setup.get("vol").await.unwrap();
    assert_eq!(
        Some(&last.token),
        tokens.last(),
        "the OBT holds the newest token"
    );

    // Downstream: no node admitted a token lower than one it had admitted before.
    for (i, node) in nodes.iter().enumerate() {
        let log = node.log.lock().unwrap();
        let mut highest = Token(0);
        for (token, admitted) in log.iter() {
            if *admitted {
                assert!(
                    *token >= highest,
                    "node {i} admitted {token} after {highest}"
                );
                highest = *token;
            } else {
                assert!(
                    *token < highest,
                    "node {i} refused {token} below nothing higher"
                );
            }
        }
    }
    let mongo_log = mongo_log.lock().unwrap().clone();
    let highest = mongo_log
        .iter()
        .filter(|(_, r)| r.is_ok())
        .map(|(t, _)| *t)
        .max()
        .unwrap();
    assert_eq!(
        MongoFence::open(&t.store)
            .await
            .unwrap()
            .seen("dlv0")
            .await
            .unwrap(),
        Some(highest)
    );
    for (token, result) in mongo_log.iter() {
        if let Err(message) = result {
            assert!(
                message.contains("stale token") && *token < highest,
                "{message}"
            );
        }
    }

    // Database: no owned commit went through after a newer owner's preemption had returned
    // before it began; and exactly the commits the tasks saw succeed are in the ledger.
    let commits = commits.lock().unwrap().clone();
    for (token, began, committed) in &commits {
        if !committed {
            continue;
        }
        if let Some((owner, newer, at)) = handed_out
            .iter()
            .find(|(_, newer, at)| newer > token && at < began)
        {
            panic!("the commit of token {token} began {:?} after {owner} had preempted with token {newer}", began.duration_since(*at));
        }
    }
    let entries = ledger.find(mongotx::Query::new()).await.unwrap();
    assert_eq!(entries.len() as u64, load(&counts.committed));
    for entry in &entries {
        let token = Token(entry.value.get_i64("token").unwrap());
        assert!(
            commits.iter().any(|(t, _, ok)| *t == token && *ok),
            "entry {} was never reported committed",
            entry.id
        );
    }

    assert!(load(&counts.preempts) > 100, "too little contention");
    assert!(
        load(&counts.stale) > 0,
        "no owner was ever fenced off downstream"
    );
    assert!(
        load(&counts.preempted_commits) > 0,
        "no preempted owner ever tried to commit"
    );
    assert!(load(&counts.committed) > 10);
    common::assert_settled(
        &t,
        &["ledger", mongotx::collections::OBTS_COLLECTION],
        "after the race",
    )
    .await;
}
