//! The contention record: conflicts and aborts counted by two stores (two instances of a
//! service) and written by each at most once per interval, summed exactly in the record and by
//! `mongotx contention`; a store with the record off writes nothing.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bson::{doc, Bson, Document};
use futures::TryStreamExt;
use mongotx::collections::CONTENTION_COLLECTION;
use mongotx::{CollectionSpec, RepoError, Repository, Store, Transactions, Update};

use crate::admin_coordination::{json, line, text};
use crate::common::{self, Account, TestDb};

/// The record's documents, by collection: (conflicts, aborts, flushes, sampled ids, minutes).
async fn record(t: &TestDb) -> BTreeMap<String, (i64, i64, i64, Vec<String>, usize)> {
    let docs: Vec<Document> =
        t.db.collection::<Document>(CONTENTION_COLLECTION)
            .find(doc! {})
            .sort(doc! { "at": 1 })
            .await
            .expect("read the record")
            .try_collect()
            .await
            .expect("read the record");
    let mut by = BTreeMap::new();
    for d in docs {
        let at = d.get_datetime("at").expect("at");
        assert_eq!(at.timestamp_millis() % 60_000, 0, "a minute: {d}");
        assert_eq!(
            d.get_datetime("expires")
                .expect("expires")
                .timestamp_millis(),
            at.timestamp_millis() + 24 * 3600 * 1000,
            "kept a day: {d}"
        );
        let id = d.get_document("_id").expect("_id");
        assert_eq!(id.get_str("c"), d.get_str("collection"));
        let entry = by
            .entry(d.get_str("collection").expect("collection").to_string())
            .or_insert((0, 0, 0, Vec::new(), 0));
        entry.0 += d.get_i64("conflicts").expect("conflicts");
        entry.1 += d.get_i64("aborts").expect("aborts");
        entry.2 += d.get_i64("flushes").expect("flushes");
        for id in d.get_array("ids").into_iter().flatten() {
            if let Bson::String(id) = id {
                entry.3.push(id.clone());
            }
        }
        entry.4 += 1;
    }
    for entry in by.values_mut() {
        entry.3.sort();
    }
    by
}

/// A store of its own on the test database (an instance of the service), writing its record
/// every `every`.
fn instance(db: mongodb::Database, every: Duration) -> Store {
    Store::builder(db).contention_flush_every(every).build()
}

async fn wallets(store: &Store) -> Repository<Account> {
    let spec = CollectionSpec::new("wallets", 1, include_str!("../../schemas/accounts.json"))
        .expect("spec");
    store.repository::<Account>(spec).await.expect("open")
}

/// An update of `id` at a version it no longer has: a conflict.
pub(crate) async fn stale_update(repo: &Repository<Account>, id: &str) {
    let err = repo
        .update(id, 1, &Update::new().set("owner", "late"))
        .await
        .expect_err("a stale update");
    assert!(matches!(err, RepoError::VersionConflict { .. }), "{err}");
}

/// The accounts of `store`, holding "alice" at version 2 (so an update at version 1 conflicts).
pub(crate) async fn alice_moved_on(store: &Store) -> Repository<Account> {
    let accounts = common::open_accounts(store).await;
    common::seed_accounts(&accounts, &[("alice", 10)]).await;
    accounts
        .update("alice", 1, &Update::new().set("owner", "moved"))
        .await
        .expect("move on");
    accounts
}

/// A transaction staged on `id` at `version`, whose document `mover` changes before the commit:
/// the commit conflicts (a conflict and an abort).
async fn conflicting_commit(
    store: &Store,
    staged: &Repository<Account>,
    mover: &Repository<Account>,
    id: &str,
    version: i64,
) {
    let tx = Transactions::new(store).begin();
    tx.update(staged, id, version, &Update::new().set("owner", "tx"))
        .await
        .expect("stage");
    mover
        .update(id, version, &Update::new().set("owner", "moved"))
        .await
        .expect("move on");
    tx.commit().await.expect_err("the commit conflicts");
}

/// Two instances conflict in known ways: repository writes at a stale version, a transaction
/// staging a change at a stale version, a commit whose document moved on after staging (a
/// conflict and an abort). After both stores shut down, the record and `mongotx contention`
/// count exactly those, each store having written once.
#[tokio::test]
async fn conflicts_of_two_instances_are_counted_exactly() {
    let t = TestDb::new().await;
    let a = instance(t.db.clone(), Duration::from_secs(3600));
    let b = instance(t.other_client_db().await, Duration::from_secs(3600));
    let accounts_a = common::open_accounts(&a).await;
    let accounts_b = common::open_accounts(&b).await;
    common::seed_accounts(
        &accounts_a,
        &[("alice", 10), ("bob", 10), ("carol", 10), ("dave", 10)],
    )
    .await;
    for id in ["alice", "bob", "dave"] {
        accounts_a
            .update(id, 1, &Update::new().set("owner", "moved"))
            .await
            .expect("move on");
    }
    // Instance A: three stale writes, a stale staging, and a commit that conflicts.
    for _ in 0..3 {
        stale_update(&accounts_a, "alice").await;
    }
    let txns = Transactions::new(&a);
    let tx = txns.begin();
    let err = tx
        .update(&accounts_a, "dave", 1, &Update::new().set("owner", "tx"))
        .await
        .expect_err("stale staging");
    assert!(err.to_string().contains("version"), "{err}");
    conflicting_commit(&a, &accounts_a, &accounts_b, "carol", 1).await;
    // Instance B: two stale writes of accounts, one of wallets.
    for _ in 0..2 {
        stale_update(&accounts_b, "bob").await;
    }
    let wallets_b = wallets(&b).await;
    wallets_b
        .insert(&Account::new("w1", "W", 1))
        .await
        .expect("insert");
    wallets_b
        .update("w1", 1, &Update::new().set("owner", "x"))
        .await
        .expect("move on");
    stale_update(&wallets_b, "w1").await;

    // Nothing is written before the interval, here an hour: shutting down writes it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(record(&t).await.is_empty());
    a.shutdown(Duration::from_secs(30)).await;
    b.shutdown(Duration::from_secs(30)).await;

    let stored = record(&t).await;
    let shown = |ids: &[&str]| ids.iter().map(|i| format!("{i:?}")).collect::<Vec<_>>();
    let (conflicts, aborts, flushes, ids, minutes) = &stored["accounts"];
    assert_eq!((*conflicts, *aborts, *flushes), (7, 1, 2), "{stored:?}");
    // Every event sampled (fewer than a flush keeps); the aborted commit's culprit twice.
    assert_eq!(
        *ids,
        shown(&["alice", "alice", "alice", "bob", "bob", "carol", "carol", "dave"])
    );
    let (w_conflicts, w_aborts, w_flushes, w_ids, _) = &stored["wallets"];
    assert_eq!((*w_conflicts, *w_aborts, *w_flushes), (1, 0, 1));
    assert_eq!(*w_ids, shown(&["w1"]));
    assert_eq!(stored.len(), 2, "{stored:?}");

    let db = t.db.name();
    let report = json(db, &["contention"]).await;
    assert_eq!(report["conflicts"], 8);
    assert_eq!(report["aborts"], 1);
    assert_eq!(report["collections_seen"], 2);
    let top = &report["collections"][0];
    assert_eq!(top["collection"], "accounts");
    assert_eq!(top["conflicts"], 7);
    assert_eq!(top["aborts"], 1);
    assert_eq!(top["minutes"], *minutes);
    let documents: Vec<(String, i64)> = top["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["id"].as_str().unwrap().to_string(),
                d["samples"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        documents,
        [
            ("\"alice\"".to_string(), 3),
            ("\"bob\"".to_string(), 2),
            ("\"carol\"".to_string(), 2),
            ("\"dave\"".to_string(), 1)
        ]
    );
    assert_eq!(report["collections"][1]["collection"], "wallets");
    assert_eq!(report["collections"][1]["conflicts"], 1);

    let lines = text(db, &["contention", "--top", "1", "--since", "30m"]).await;
    println!("{}", lines.join("\n"));
    assert_eq!(
        line(&lines, "total: "),
        "total: 8 conflicts, 1 abort in 2 collections"
    );
    assert_eq!(line(&lines, "showing "), "showing the top 1");
    assert_eq!(
        line(&lines, "1. "),
        format!(
            "1. accounts: 7 conflicts, 1 abort ({minutes} minute{} with any)",
            if *minutes == 1 { "" } else { "s" }
        )
    );
    assert_eq!(
        line(&lines, "   sampled documents: "),
        "   sampled documents: \"alice\" (3), \"bob\" (2), \"carol\" (2), \"dave\" (1)"
    );
    assert!(!lines.iter().any(|l| l.starts_with("2. ")));
}

/// With the record off, conflicts and aborts write nothing, even at shutdown.
#[tokio::test]
async fn a_store_with_the_record_off_writes_nothing() {
    let t = TestDb::new().await;
    let store = Store::builder(t.db.clone())
        .contention_record(false)
        .contention_flush_every(Duration::from_millis(10))
        .build();
    let accounts = alice_moved_on(&store).await;
    for _ in 0..3 {
        stale_update(&accounts, "alice").await;
    }
    conflicting_commit(&store, &accounts, &accounts, "alice", 2).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    store.shutdown(Duration::from_secs(10)).await;
    let names = t.db.list_collection_names().await.expect("list");
    assert!(
        !names.contains(&CONTENTION_COLLECTION.to_string()),
        "{names:?}"
    );
    let report = json(t.db.name(), &["contention"]).await;
    assert_eq!(report["conflicts"], 0);
    assert_eq!(report["collections"].as_array().unwrap().len(), 0);
    let names = t.db.list_collection_names().await.expect("list");
    assert!(!names.contains(&CONTENTION_COLLECTION.to_string()));
}

/// A conflict every 50 ms for 3.5 s, with an interval of one second: every conflict is
/// recorded, in at most one write per second the run lasted (and the one shutdown makes),
/// and the writes happen without shutdown too.
#[tokio::test]
async fn a_store_writes_at_most_once_per_interval() {
    let t = TestDb::new().await;
    let store = instance(t.db.clone(), Duration::from_secs(1));
    let accounts = alice_moved_on(&store).await;
    let started = Instant::now();
    let mut made = 0;
    while started.elapsed() < Duration::from_millis(3500) {
        stale_update(&accounts, "alice").await;
        made += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let written_before_shutdown = record(&t).await;
    let lasted = started.elapsed();
    store.shutdown(Duration::from_secs(30)).await;
    let stored = record(&t).await;
    let (conflicts, aborts, flushes, ids, _) = &stored["accounts"];
    assert_eq!((*conflicts, *aborts), (made, 0));
    let most = i64::try_from(lasted.as_secs()).unwrap() + 1;
    assert!(
        (2..=most).contains(flushes),
        "{flushes} writes in {lasted:?} (at most {most})"
    );
    assert!(ids.iter().all(|id| id == "\"alice\""));
    assert!(ids.len() <= 8 * usize::try_from(*flushes).unwrap());
    // Written by the interval, before shutdown.
    let (early, _, early_flushes, _, _) = &written_before_shutdown["accounts"];
    assert!(*early > 0 && *early_flushes >= 1);
    let indexes: Vec<Document> =
        t.db.collection::<Document>(CONTENTION_COLLECTION)
            .list_indexes()
            .await
            .expect("indexes")
            .map_ok(|i| {
                let mut d = doc! { "key": i.keys };
                if let Some(ttl) = i.options.and_then(|o| o.expire_after) {
                    d.insert("ttl", i64::try_from(ttl.as_secs()).unwrap());
                }
                d
            })
            .try_collect()
            .await
            .expect("indexes");
    assert!(
        indexes.contains(&doc! { "key": { "expires": 1 }, "ttl": 0_i64 }),
        "{indexes:?}"
    );
}
