//! Optimistic locking under real concurrency: many tasks on many clients.

use crate::common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::common::{Account, TestDb};
use mongotx::{Adjust, RepoError, Repository, Store, Update};

const CLIENTS: usize = 4;

/// One repository per client, all on the test database.
async fn repositories(t: &TestDb) -> Vec<Repository<Account>> {
    let mut repos = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        let store = Store::new(t.other_client_db().await);
        repos.push(
            store
                .repository::<Account>(common::accounts_spec())
                .await
                .unwrap(),
        );
    }
    repos
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_tasks_of_fifty_read_modify_write_increments_end_at_1600() {
    const TASKS: usize = 32;
    const INCREMENTS: usize = 50;
    let t = TestDb::new().await;
    let repos = repositories(&t).await;
    repos[0]
        .insert(&Account::new("counter", "C", 0))
        .await
        .unwrap();

    let conflicts = Arc::new(AtomicU64::new(0));
    // Every task reads version 1 before anyone writes, so contention is certain, not likely.
    let all_read = Arc::new(tokio::sync::Barrier::new(TASKS));
    let mut handles = Vec::with_capacity(TASKS);
    for task in 0..TASKS {
        let repo = repos[task % CLIENTS].clone();
        let conflicts = Arc::clone(&conflicts);
        let all_read = Arc::clone(&all_read);
        handles.push(tokio::spawn(async move {
            let mut versions = Vec::with_capacity(INCREMENTS);
            let mut first = true;
            for _ in 0..INCREMENTS {
                loop {
                    let read = repo.get("counter").await?;
                    if std::mem::take(&mut first) {
                        all_read.wait().await;
                    }
                    // Half the tasks write a field, half write the whole value.
                    let written = if task % 2 == 0 {
                        let update = Update::new().set("balance", read.balance + 1);
                        repo.update("counter", read.version, &update).await
                    } else {
                        let mut value = read.value.clone();
                        value.balance += 1;
                        repo.replace("counter", read.version, &value).await
                    };
                    match written {
                        Ok(version) => {
                            versions.push(version);
                            break;
                        }
                        Err(RepoError::VersionConflict {
                            expected, actual, ..
                        }) => {
                            assert!(
                                actual > expected,
                                "versions only grow: {expected} -> {actual}"
                            );
                            conflicts.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(other) => return Err(other),
                    }
                }
            }
            Ok::<_, RepoError>(versions)
        }));
    }
    let mut all_versions = BTreeSet::new();
    for handle in handles {
        for version in handle.await.unwrap().unwrap() {
            assert!(
                all_versions.insert(version),
                "version {version} was handed out twice"
            );
        }
    }

    let total = (TASKS * INCREMENTS) as i64;
    let end = repos[1].get("counter").await.unwrap();
    assert_eq!(end.balance, total);
    assert_eq!(end.version, total + 1);
    assert_eq!(all_versions, (2..=total + 1).collect::<BTreeSet<i64>>());
    let conflicts = conflicts.load(Ordering::Relaxed);
    println!("{TASKS} tasks x {INCREMENTS} increments on {CLIENTS} clients: {total} writes, {conflicts} version conflicts retried");
    assert!(
        conflicts >= (TASKS - 1) as u64,
        "all tasks read version 1 first, so at least {} writes must conflict",
        TASKS - 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_adjusts_with_retries_lose_nothing() {
    const TASKS: usize = 16;
    const ADJUSTS: usize = 20;
    let t = TestDb::new().await;
    let repos = repositories(&t).await;
    repos[0]
        .insert(&Account::new("pot", "P", 1_000))
        .await
        .unwrap();

    let all_read = Arc::new(tokio::sync::Barrier::new(TASKS));
    let mut handles = Vec::new();
    for task in 0..TASKS {
        let repo = repos[task % CLIENTS].clone();
        let all_read = Arc::clone(&all_read);
        handles.push(tokio::spawn(async move {
            let mut retries = 0_u64;
            let mut first = true;
            for _ in 0..ADJUSTS {
                let amount = if task % 2 == 0 { 3_i64 } else { -1_i64 };
                loop {
                    let version = repo.get("pot").await?.version;
                    if std::mem::take(&mut first) {
                        all_read.wait().await;
                    }
                    match repo
                        .adjust("pot", version, &Adjust::new().by("balance", amount))
                        .await
                    {
                        Ok(_) => break,
                        Err(e) if e.is_retryable() => retries += 1,
                        Err(e) => return Err(e),
                    }
                }
            }
            Ok::<_, RepoError>(retries)
        }));
    }
    let mut retries = 0;
    for handle in handles {
        retries += handle.await.unwrap().unwrap();
    }
    let end = repos[2].get("pot").await.unwrap();
    let expected = 1_000 + (TASKS / 2 * ADJUSTS) as i64 * 3 - (TASKS / 2 * ADJUSTS) as i64;
    assert_eq!(end.balance, expected);
    assert_eq!(end.version, 1 + (TASKS * ADJUSTS) as i64);
    assert!(
        retries >= (TASKS - 1) as u64,
        "all tasks read version 1 first, so at least {} adjusts must be retried",
        TASKS - 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_inserts_of_one_id_have_exactly_one_winner() {
    let t = TestDb::new().await;
    let repos = repositories(&t).await;
    let mut handles = Vec::new();
    for task in 0..24 {
        let repo = repos[task % CLIENTS].clone();
        handles.push(tokio::spawn(async move {
            repo.insert(&Account::new("race", &format!("owner{task}"), task as i64))
                .await
        }));
    }
    let mut winners = 0;
    for handle in handles {
        match handle.await.unwrap() {
            Ok(_) => winners += 1,
            Err(RepoError::DuplicateId { .. }) => {}
            Err(other) => panic!("{other:?}"),
        }
    }
    assert_eq!(winners, 1);
    assert_eq!(repos[0].get("race").await.unwrap().version, 1);
}
