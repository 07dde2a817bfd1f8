//! Owner-based transactions against the server: the operations of their reference design (a
//! storage volume manager's: create, call under the OBT, preempt, release), tokens, both fences,
//! leases and take-overs, lost heartbeat replies, typed errors that write nothing.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{raw_snapshot, TestDb};
use bson::{doc, Document};
use mongotx::collections::{FENCES_COLLECTION, OBTS_COLLECTION, TOKENS_COLLECTION};
use mongotx::obt::{Fence, FenceError, MemoryFence, MongoFence, NewObt, Obt, ObtError, Token};
use mongotx::{RepoError, Store, Update};

async fn obts(t: &TestDb) -> Obt {
    Obt::open(&t.store).await.unwrap()
}

/// A plain repository the owned transactions write to.
async fn volumes(t: &TestDb) -> mongotx::Repository<Document> {
    let spec = mongotx::CollectionSpec::new(
        "volumes",
        1,
        r#"{"bsonType":"object","required":["_id","_schema","_version"],"properties":{
            "_id":{"bsonType":"string"},"_schema":{"bsonType":"long"},"_version":{"bsonType":"long"},
            "_txn":{"bsonType":"objectId"},"_hold":{"bsonType":"object"},"_deleted":{"bsonType":"date"},
            "_deleting":{"bsonType":"bool"},"status":{"bsonType":"string"},"by":{"bsonType":"long"}}}"#,
    )
    .unwrap();
    t.store.repository::<Document>(spec).await.unwrap()
}

#[tokio::test]
async fn the_reference_operations_create_preempt_advance_release() {
    let t = TestDb::new().await;
    let obt = obts(&t).await;
    let first = obt.create(NewObt::new("t0", "owner0")).await.unwrap();
    assert_eq!((first.owner.as_str(), first.stage), ("owner0", 0));
    let state = obt.get("t0").await.unwrap();
    assert_eq!(state.owner, "owner0");
    assert_eq!(state.token, first.token);

    // A call under the OBT at stage 1, then owner1 preempts it by naming the owner it replaces,
    // as in the reference design.
    let advanced = obt.advance("t0", "owner0", 1).await.unwrap();
    assert_eq!(advanced.stage, 1);
    assert_eq!(
        obt.advance("t0", "owner0", 1).await.unwrap().stage,
        1,
        "same stage: a retry"
    );
    let second = obt.preempt("t0", "owner0", "owner1").await.unwrap();
    assert_eq!(second.owner, "owner1");
    assert!(
        second.token > first.token,
        "a preemption issues a higher token"
    );
    assert_eq!(second.stage, 1, "the stage carries over to the new owner");
    assert!(matches!(
        obt.check("t0", "owner0", 1).await,
        Err(ObtError::NotOwner { ref current, .. }) if current == "owner1"
    ));
    assert_eq!(
        obt.check("t0", "owner1", 2).await.unwrap().token,
        second.token
    );
    obt.advance("t0", "owner1", 2).await.unwrap();
    assert!(matches!(
        obt.check("t0", "owner1", 1).await,
        Err(ObtError::StageReplayed {
            current: 2,
            presented: 1,
            ..
        })
    ));

    // Release by the owner; afterwards the OBT is gone and the id can be created again.
    assert!(matches!(
        obt.release("t0", "owner0").await,
        Err(ObtError::NotOwner { .. })
    ));
    obt.release("t0", "owner1").await.unwrap();
    assert!(matches!(
        obt.get("t0").await,
        Err(ObtError::NotFound { .. })
    ));
    assert!(matches!(
        obt.release("t0", "owner1").await,
        Err(ObtError::NotFound { .. })
    ));
    let third = obt.create(NewObt::new("t0", "owner2")).await.unwrap();
    assert!(third.token > second.token, "tokens keep rising across OBTs");
}

#[tokio::test]
async fn bad_input_is_a_typed_error_and_writes_nothing() {
    let t = TestDb::new().await;
    let obt = obts(&t).await;
    obt.create(NewObt::new("t0", "owner0")).await.unwrap();
    obt.advance("t0", "owner0", 3).await.unwrap();
    let before = (
        raw_snapshot(&t.db, OBTS_COLLECTION).await,
        raw_snapshot(&t.db, TOKENS_COLLECTION).await,
    );
    let mut kinds = Vec::new();
    let mut refused = |e: ObtError| kinds.push(e.to_string());
    macro_rules! refuse {
        ($call:expr, $pat:pat) => {
            match $call.await {
                Err(e @ $pat) => refused(e),
                other => panic!("{}: {other:?}", stringify!($call)),
            }
        };
    }
    refuse!(obt.create(NewObt::new("", "o")), ObtError::Invalid { .. });
    refuse!(obt.create(NewObt::new("t1", "")), ObtError::Invalid { .. });
    refuse!(
        obt.create(NewObt::new("t1", "o").lease(Duration::ZERO)),
        ObtError::Invalid { .. }
    );
    refuse!(obt.preempt("t0", "", "x"), ObtError::Invalid { .. });
    refuse!(obt.preempt("t0", "owner0", ""), ObtError::Invalid { .. });
    refuse!(obt.preempt("t0", "someone", "x"), ObtError::NotOwner { .. });
    refuse!(
        obt.preempt("nope", "owner0", "x"),
        ObtError::NotFound { .. }
    );
    refuse!(
        obt.advance("t0", "owner0", 2),
        ObtError::StageReplayed { .. }
    );
    refuse!(obt.advance("t0", "owner0", -1), ObtError::Invalid { .. });
    refuse!(obt.advance("t0", "someone", 9), ObtError::NotOwner { .. });
    refuse!(obt.release("t0", "someone"), ObtError::NotOwner { .. });
    refuse!(obt.release("nope", "owner0"), ObtError::NotFound { .. });
    refuse!(obt.release("", "owner0"), ObtError::Invalid { .. });
    refuse!(
        obt.create(NewObt::new("t0", "owner9")),
        ObtError::Exists { .. }
    );
    refuse!(obt.take_over_expired("t0", "x"), ObtError::NoLease { .. });
    refuse!(obt.get("nope"), ObtError::NotFound { .. });
    for k in &kinds {
        println!("{k}");
    }
    let after = (
        raw_snapshot(&t.db, OBTS_COLLECTION).await,
        raw_snapshot(&t.db, TOKENS_COLLECTION).await,
    );
    // Only a create and a preempt that got as far as taking a token move the counter; the OBTs
    // themselves are untouched.
    assert_eq!(after.0, before.0, "no OBT changed");
    assert!(kinds.iter().any(|k| k.contains("owned by owner0")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_unique_and_increasing_across_clients_and_tasks() {
    let t = TestDb::new().await;
    let mut handles = Vec::new();
    for _ in 0..4 {
        let db = t.other_client_db().await;
        handles.push(Obt::open(&Store::new(db)).await.unwrap());
    }
    let mut tasks = Vec::new();
    for task in 0..32 {
        let obt = handles[task % 4].clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            for _ in 0..40 {
                mine.push(obt.issue_token().await.unwrap());
            }
            mine
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        let mine = task.await.unwrap();
        assert!(
            mine.windows(2).all(|w| w[0] < w[1]),
            "one caller's tokens rise"
        );
        all.extend(mine);
    }
    let n = all.len();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), n, "no token handed out twice");
    assert_eq!(n, 32 * 40);
}

#[tokio::test]
async fn fences_refuse_lower_tokens_and_pass_equal_ones() {
    let t = TestDb::new().await;
    let memory = MemoryFence::new();
    let mongo = MongoFence::open(&t.store).await.unwrap();
    for fence in [&memory as &dyn Fence, &mongo as &dyn Fence] {
        fence.admit("dpv0", Token(5)).await.unwrap();
        fence.admit("dpv0", Token(5)).await.unwrap();
        fence.admit("dpv1", Token(3)).await.unwrap();
        match fence.admit("dpv0", Token(4)).await {
            Err(FenceError::StaleToken {
                resource,
                seen,
                presented,
            }) => {
                assert_eq!(
                    (resource.as_str(), seen, presented),
                    ("dpv0", Token(5), Token(4))
                );
            }
            other => panic!("{other:?}"),
        }
        fence.admit("dpv0", Token(9)).await.unwrap();
        assert_eq!(fence.seen("dpv0").await.unwrap(), Some(Token(9)));
        assert_eq!(fence.seen("dpv1").await.unwrap(), Some(Token(3)));
        assert!(matches!(
            fence.admit("", Token(9)).await,
            Err(FenceError::Invalid { .. })
        ));
        assert!(matches!(
            fence.admit("dpv0", Token(0)).await,
            Err(FenceError::Invalid { .. })
        ));
    }
    let stored = raw_snapshot(&t.db, FENCES_COLLECTION).await;
    assert_eq!(
        stored,
        vec![
            doc! { "_id": "dpv0", "token": 9_i64 },
            doc! { "_id": "dpv1", "token": 3_i64 }
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mongo_fence_under_concurrency_admits_only_in_order() {
    let t = TestDb::new().await;
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for task in 0..16_i64 {
        let db = t.other_client_db().await;
        let fence = MongoFence::open(&Store::new(db)).await.unwrap();
        let log = Arc::clone(&log);
        tasks.push(tokio::spawn(async move {
            for i in 0..30_i64 {
                let token = Token(1 + (i * 16 + task * 7) % 300);
                let started = std::time::Instant::now();
                let result = fence.admit("hot", token).await;
                let ended = std::time::Instant::now();
                log.lock().unwrap().push((
                    token,
                    result.map_err(|e| e.to_string()),
                    started,
                    ended,
                ));
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let log = log.lock().unwrap().clone();
    let admitted: Vec<Token> = log
        .iter()
        .filter(|(_, r, _, _)| r.is_ok())
        .map(|(t, _, _, _)| *t)
        .collect();
    let refused = log.iter().filter(|(_, r, _, _)| r.is_err()).count();
    // In real time: an admission that began after another had been acknowledged never carries a
    // lower token than it (the fence is one linearizable "admit if not lower").
    for (token, result, started, _) in &log {
        if result.is_ok() {
            for (earlier, done, _, ended) in &log {
                if done.is_ok() && ended < started {
                    assert!(
                        token >= earlier,
                        "admitted {token} after {earlier} was acknowledged"
                    );
                }
            }
        }
    }
    let highest = admitted.iter().max().copied().unwrap();
    let stored = MongoFence::open(&t.store)
        .await
        .unwrap()
        .seen("hot")
        .await
        .unwrap();
    assert_eq!(
        stored,
        Some(highest),
        "the fence keeps the highest admitted"
    );
    assert!(refused > 0, "some calls came in late");
    for (token, result, _, _) in log.iter() {
        if let Err(message) = result {
            assert!(message.contains("stale token"), "{message}");
            assert!(*token < highest);
        }
    }
}

#[tokio::test]
async fn an_owned_transaction_commits_only_while_owned() {
    let t = TestDb::new().await;
    let obt = obts(&t).await;
    let volumes = volumes(&t).await;
    volumes
        .insert(&doc! { "_id": "dlv0", "status": "available", "by": 0_i64 })
        .await
        .unwrap();
    let txns = common::finishing(&t.store);
    let mut api1 = obt
        .create(NewObt::new("dlv0", "api-1").lease(Duration::from_secs(30)))
        .await
        .unwrap();

    // Owned: commits, and a heartbeat between staging and commit does not break the guard.
    let tx = txns.begin();
    let v = volumes.get("dlv0").await.unwrap().version;
    tx.update(
        &volumes,
        "dlv0",
        v,
        &Update::new()
            .set("status", "attaching")
            .set("by", api1.token.0),
    )
    .await
    .unwrap();
    obt.heartbeat(&mut api1).await.unwrap();
    obt.commit_owned(tx, &api1).await.unwrap();
    assert_eq!(
        volumes
            .get("dlv0")
            .await
            .unwrap()
            .value
            .get_str("status")
            .unwrap(),
        "attaching"
    );

    // Preempted: the old owner's commit writes nothing.
    let api2 = obt.preempt("dlv0", "api-1", "api-2").await.unwrap();
    let before = raw_snapshot(&t.db, "volumes").await;
    let tx = txns.begin();
    let v = volumes.get("dlv0").await.unwrap().version;
    tx.update(
        &volumes,
        "dlv0",
        v,
        &Update::new().set("status", "attached"),
    )
    .await
    .unwrap();
    match obt.commit_owned(tx, &api1).await {
        Err(ObtError::Preempted { now, owner, .. }) => {
            assert_eq!(owner, "api-1");
            assert_eq!(now, Some(("api-2".to_string(), api2.token)));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        raw_snapshot(&t.db, "volumes").await,
        before,
        "nothing written"
    );
    common::assert_settled(&t, &["volumes", OBTS_COLLECTION], "after a refused commit").await;

    // The new owner's commit goes through.
    let tx = txns.begin();
    tx.update(
        &volumes,
        "dlv0",
        v,
        &Update::new().set("status", "detached"),
    )
    .await
    .unwrap();
    obt.commit_owned(tx, &api2).await.unwrap();
    assert_eq!(
        volumes
            .get("dlv0")
            .await
            .unwrap()
            .value
            .get_str("status")
            .unwrap(),
        "detached"
    );
}

#[tokio::test]
async fn a_paused_owner_is_taken_over_after_its_lease_and_everything_it_tries_is_refused() {
    let t = TestDb::new().await;
    let obt = obts(&t).await;
    let volumes = volumes(&t).await;
    volumes
        .insert(&doc! { "_id": "dlv0", "status": "available", "by": 0_i64 })
        .await
        .unwrap();
    let nodes: Vec<MemoryFence> = (0..4).map(|_| MemoryFence::new()).collect();
    let lease = Duration::from_millis(400);
    let mut api1 = obt
        .create(NewObt::new("attach/dlv0", "api-1").lease(lease))
        .await
        .unwrap();
    nodes[0].admit("dlv0", api1.token).await.unwrap();
    nodes[1].admit("dlv0", api1.token).await.unwrap();
    assert!(api1.lease_left().unwrap() > Duration::ZERO);

    // api-1 stalls. A contender that looks too early is refused; after a whole silent lease on
    // its own clock it takes over.
    let observed = obt.observe("attach/dlv0").await.unwrap();
    assert!(matches!(
        obt.take_over(&observed, "api-2").await,
        Err(ObtError::LeaseLive { .. })
    ));
    tokio::time::sleep(lease + Duration::from_millis(50)).await;
    assert_eq!(
        api1.lease_left(),
        Some(Duration::ZERO),
        "api-1 can tell its lease ran out"
    );
    let api2 = obt.take_over(&observed, "api-2").await.unwrap();
    assert!(api2.token > api1.token);
    for node in &nodes {
        node.admit("dlv0", api2.token).await.unwrap();
    }
    let txns = common::finishing(&t.store);
    let tx = txns.begin();
    let v = volumes.get("dlv0").await.unwrap().version;
    tx.update(
        &volumes,
        "dlv0",
        v,
        &Update::new()
            .set("status", "detached")
            .set("by", api2.token.0),
    )
    .await
    .unwrap();
    obt.commit_owned(tx, &api2).await.unwrap();
    let settled = raw_snapshot(&t.db, "volumes").await;

    // api-1 wakes up and carries on with its attach: every step is refused.
    for node in &nodes {
        assert!(matches!(
            node.admit("dlv0", api1.token).await,
            Err(FenceError::StaleToken { seen, presented, .. }) if seen == api2.token && presented == api1.token
        ));
    }
    let tx = txns.begin();
    tx.update(
        &volumes,
        "dlv0",
        v + 1,
        &Update::new().set("status", "attached"),
    )
    .await
    .unwrap();
    assert!(matches!(
        obt.commit_owned(tx, &api1).await,
        Err(ObtError::Preempted { .. })
    ));
    assert!(matches!(
        obt.heartbeat(&mut api1).await,
        Err(ObtError::Preempted { .. })
    ));
    assert!(matches!(
        obt.advance("attach/dlv0", "api-1", 5).await,
        Err(ObtError::NotOwner { .. })
    ));
    assert!(matches!(
        obt.release("attach/dlv0", "api-1").await,
        Err(ObtError::NotOwner { .. })
    ));
    assert_eq!(
        raw_snapshot(&t.db, "volumes").await,
        settled,
        "nothing of api-1's is visible"
    );
    assert_eq!(
        volumes
            .get("dlv0")
            .await
            .unwrap()
            .value
            .get_str("status")
            .unwrap(),
        "detached"
    );
}

#[tokio::test]
async fn a_heartbeating_owner_cannot_be_taken_over() {
    let t = TestDb::new().await;
    let obt = obts(&t).await;
    let lease = Duration::from_millis(300);
    let mut owner = obt
        .create(NewObt::new("t0", "alive").lease(lease))
        .await
        .unwrap();
    let observed = obt.observe("t0").await.unwrap();
    for _ in 0..6 {
        tokio::time::sleep(lease / 4).await;
        obt.heartbeat(&mut owner).await.unwrap();
    }
    // The contender has waited longer than the lease, but the OBT moved meanwhile.
    assert!(observed.silent_for() > lease);
    assert!(matches!(
        obt.take_over(&observed, "contender").await,
        Err(ObtError::Changed { .. })
    ));
    // By the server's clock the last heartbeat is recent.
    assert!(matches!(
        obt.take_over_expired("t0", "contender").await,
        Err(ObtError::LeaseLive { .. })
    ));
    assert_eq!(obt.get("t0").await.unwrap().owner, "alive");
    // Once it stops, the server's clock lets anyone take over after the lease.
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let taken = obt.take_over_expired("t0", "contender").await.unwrap();
    assert!(taken.token > owner.token);
    assert!(matches!(
        obt.heartbeat(&mut owner).await,
        Err(ObtError::Preempted { .. })
    ));
}

/// Loses the reply of the n-th OBT heartbeat (an update setting `beat_at` only).
#[derive(Clone)]
struct LoseHeartbeat {
    nth: usize,
    seen: Arc<AtomicUsize>,
}

impl common::wire_proxy::Rules for LoseHeartbeat {
    fn command(&self, command: &mut Document) -> common::wire_proxy::Action {
        use crate::common::wire_proxy::{command_name, Action};
        let heartbeat = command_name(command) == "update"
            && command
                .get_array("updates")
                .ok()
                .and_then(|u| u.first())
                .and_then(|u| u.as_document())
                .and_then(|u| u.get_document("u").ok())
                .is_some_and(|u| u.contains_key("$currentDate") && !u.contains_key("$set"));
        if heartbeat && self.seen.fetch_add(1, Ordering::SeqCst) + 1 == self.nth {
            return Action::LoseReply;
        }
        Action::Forward
    }
}

#[tokio::test]
async fn a_heartbeat_whose_reply_is_lost_is_settled_by_reading_back() {
    let t = TestDb::new().await;
    let direct = obts(&t).await;
    let seen = Arc::new(AtomicUsize::new(0));
    let proxy = common::wire_proxy::WireProxy::start(
        &common::server_uri(),
        LoseHeartbeat {
            nth: 1,
            seen: Arc::clone(&seen),
        },
    )
    .await;
    let obt = Obt::open(&Store::new(proxy.client().await.database(t.db.name())))
        .await
        .unwrap();
    let mut owned = obt
        .create(NewObt::new("t0", "owner").lease(Duration::from_secs(5)))
        .await
        .unwrap();
    let before = direct.get("t0").await.unwrap().version;
    obt.heartbeat(&mut owned).await.unwrap();
    assert!(
        seen.load(Ordering::SeqCst) >= 2,
        "the first reply was lost and it was sent again"
    );
    let after = direct.get("t0").await.unwrap();
    assert!(after.version > before, "renewed");
    assert_eq!(after.owner, "owner");

    // Lost again, and meanwhile someone preempted: the owner learns it lost, not "down".
    seen.store(0, Ordering::SeqCst);
    direct.preempt("t0", "owner", "other").await.unwrap();
    let err = obt.heartbeat(&mut owned).await.unwrap_err();
    assert!(matches!(err, ObtError::Preempted { .. }), "{err}");
    assert!(err.is_lost_ownership() && !err.is_retryable());
}

/// Once switched on, every command but the handshake fails as if the network were down.
struct Outage(Arc<std::sync::atomic::AtomicBool>);

impl common::wire_proxy::Rules for Outage {
    fn command(&self, command: &mut Document) -> common::wire_proxy::Action {
        use crate::common::wire_proxy::{command_name, Action};
        if !self.0.load(Ordering::SeqCst)
            || matches!(command_name(command), "hello" | "isMaster" | "ismaster")
        {
            return Action::Forward;
        }
        Action::Drop
    }
}

#[tokio::test]
async fn a_database_outage_is_not_mistaken_for_lost_ownership() {
    let t = TestDb::new().await;
    let obt = obts(&t).await;
    let mut owned = obt.create(NewObt::new("t0", "owner")).await.unwrap();
    let down = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let proxy =
        common::wire_proxy::WireProxy::start(&common::server_uri(), Outage(Arc::clone(&down)))
            .await;
    let cut = Obt::with_options(
        &Store::new(proxy.client().await.database(t.db.name())),
        mongotx::obt::ObtOptions::default().retry(mongotx::options::LockWait {
            max_wait: Duration::from_millis(300),
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(50),
        }),
    )
    .await
    .unwrap();
    down.store(true, Ordering::SeqCst);
    let err = cut.heartbeat(&mut owned).await.unwrap_err();
    assert!(!err.is_lost_ownership(), "{err}");
    assert!(
        matches!(&err, ObtError::Document { source } if matches!(**source, RepoError::Database { .. })),
        "{err}"
    );
    assert_eq!(obt.get("t0").await.unwrap().owner, "owner");
}

#[tokio::test]
async fn a_transaction_guard_takes_plain_equalities_and_fails_the_commit_when_they_stop_holding() {
    let t = TestDb::new().await;
    let volumes = volumes(&t).await;
    volumes
        .insert(&doc! { "_id": "dlv0", "status": "available", "by": 1_i64 })
        .await
        .unwrap();
    let txns = common::finishing(&t.store);
    let tx = txns.begin();
    for bad in [
        doc! {},
        doc! { "by": { "$gt": 0_i64 } },
        doc! { "_version": 1_i64 },
        doc! { "$where": "1" },
        doc! { "by": [1_i64] },
        doc! { "status": bson::Regex { pattern: "avail.*".into(), options: String::new() } },
    ] {
        let err = tx.guard(&volumes, "dlv0", bad.clone()).unwrap_err();
        assert!(
            matches!(err.repo_error(), Some(RepoError::InvalidQuery { .. })),
            "{bad}: {err}"
        );
    }
    assert!(tx.is_empty(), "nothing staged");

    // A guard that holds lets the commit through whatever the version; one that does not
    // fails it and nothing is written.
    let notes = volumes.clone();
    let tx = txns.begin();
    tx.guard(
        &volumes,
        "dlv0",
        doc! { "status": "available", "by": 1_i32 },
    )
    .unwrap();
    tx.insert(&notes, &doc! { "_id": "n1", "status": "x" })
        .await
        .unwrap();
    let outcome = tx.commit().await.unwrap();
    assert!(
        outcome.version_of("volumes", "dlv0").is_none(),
        "a guard reports no version"
    );
    assert!(outcome.version_of("volumes", "n1").is_some());

    let tx = txns.begin();
    tx.guard(&volumes, "dlv0", doc! { "status": "attached" })
        .unwrap();
    tx.insert(&notes, &doc! { "_id": "n2", "status": "x" })
        .await
        .unwrap();
    let before = raw_snapshot(&t.db, "volumes").await;
    let err = tx.commit().await.unwrap_err();
    assert!(
        matches!(err.repo_error(), Some(RepoError::ConditionFailed { .. })),
        "{err}"
    );
    assert_eq!(raw_snapshot(&t.db, "volumes").await, before);
    common::assert_settled(&t, &["volumes"], "after a failed guard").await;
}
