//! Explicit adoption (`Repository::adopt`, `Store::adopt`, `mongotx-adopt`): every plain document
//! stamped once and nothing else changed, refusals reported, dry runs writing nothing, runs
//! interrupted anywhere (futures dropped, processes killed) resumed, and runs beside raw writers,
//! mongotx writers and transactions losing no write.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::{doc, Bson, Document};
use mongotx::adopt::AdoptOptions;
use mongotx::{fields, Adjust, Query, RepoError, Store, Transactions};
use rand::Rng;

use crate::common::{self, raw_snapshot, TestDb};

/// `n` plain accounts `p00000`..., balance 100; every 50th is one the schema refuses (a string
/// balance).
async fn seed(t: &TestDb, n: usize) -> Vec<Document> {
    let docs: Vec<Document> = (0..n)
        .map(|i| {
            let balance = if i % 50 == 49 {
                Bson::String("n/a".into())
            } else {
                Bson::Int64(100)
            };
            doc! { "_id": format!("p{i:05}"), "owner": format!("o{}", i % 7), "balance": balance }
        })
        .collect();
    t.db.collection::<Document>("accounts")
        .insert_many(docs.clone())
        .await
        .unwrap();
    docs
}

fn refused(doc: &Document) -> bool {
    matches!(doc.get("balance"), Some(Bson::String(_)))
}

/// Every stored document is its original, either untouched (plain) or with exactly `_schema: 1`
/// and `_version` added after its fields; says how many are stamped. `versions` gives the version
/// each stamped document must have (default 1).
fn check_stamped_once(
    originals: &[Document],
    stored: &[Document],
    versions: &HashMap<String, i64>,
) -> usize {
    assert_eq!(
        originals.len(),
        stored.len(),
        "documents were added or lost"
    );
    let by_id: HashMap<&str, &Document> = stored
        .iter()
        .map(|d| (d.get_str("_id").unwrap(), d))
        .collect();
    let mut stamped = 0;
    for original in originals {
        let id = original.get_str("_id").unwrap();
        let now = by_id[id];
        if now == original {
            continue;
        }
        let mut expected = original.clone();
        expected.insert(fields::SCHEMA_VERSION, 1_i64);
        expected.insert(fields::VERSION, versions.get(id).copied().unwrap_or(1));
        assert_eq!(now, &expected, "{id} was changed beyond its stamp");
        assert!(
            !refused(original),
            "{id} is refused by the schema but was stamped"
        );
        stamped += 1;
    }
    stamped
}

#[tokio::test]
async fn adoption_stamps_each_plain_document_once_reports_refusals_and_dry_runs_write_nothing() {
    let t = TestDb::new().await;
    let originals = seed(&t, 1_000).await;
    let accounts = common::open_accounts(&t.store).await;
    let batches = Arc::new(Mutex::new(0));
    let counted = Arc::clone(&batches);

    let dry = accounts
        .adopt(
            AdoptOptions::new()
                .dry_run(true)
                .batch_size(128)
                .listed_refusals(3),
        )
        .await
        .unwrap();
    assert_eq!(
        raw_snapshot(&t.db, "accounts").await,
        originals,
        "a dry run wrote"
    );
    assert!(dry.dry_run);
    assert_eq!((dry.plain_at_start, dry.examined), (1_000, 1_000));
    assert_eq!(
        (dry.stamped, dry.refused, dry.already_stamped),
        (980, 20, 0)
    );
    assert_eq!(dry.refusals.len(), 3);
    let first = &dry.refusals[0];
    assert_eq!(
        (first.id.as_str(), first.field.as_str()),
        ("\"p00049\"", "balance")
    );
    assert!(first.rule.contains("long"), "{first:?}");

    let report = accounts
        .adopt(
            AdoptOptions::new()
                .batch_size(128)
                .progress(move |_| *counted.lock().unwrap() += 1),
        )
        .await
        .unwrap();
    assert_eq!(
        (report.stamped, report.refused, report.already_stamped),
        (980, 20, 0)
    );
    assert_eq!(report.refusals.len(), 20);
    // Refused by the server as it writes, or by the client before: the field is named either way
    // (a server before 5.0 gives no details; then the client's check says which).
    assert!(
        report.refusals.iter().all(|r| r.field == "balance"),
        "{:?}",
        report.refusals
    );
    assert_eq!(
        *batches.lock().unwrap(),
        8,
        "1,000 documents in batches of 128"
    );
    let stored = raw_snapshot(&t.db, "accounts").await;
    assert_eq!(
        check_stamped_once(&originals, &stored, &HashMap::new()),
        980
    );

    // Again: nothing to do but the refused ones, which are reported again.
    let again = accounts.adopt(AdoptOptions::new()).await.unwrap();
    assert_eq!(
        (
            again.plain_at_start,
            again.stamped,
            again.already_stamped,
            again.refused
        ),
        (20, 0, 980, 20)
    );
    assert_eq!(raw_snapshot(&t.db, "accounts").await, stored);
    // A refused document is still readable as what it is, and a write that makes it valid
    // stamps it.
    let doc_repo = t
        .store
        .repository::<Document>(common::accounts_spec())
        .await
        .unwrap();
    let bad = doc_repo.get("p00049").await.unwrap();
    assert!(bad.is_plain());
    assert_eq!(
        doc_repo
            .update(
                "p00049",
                bad.version,
                &mongotx::Update::new().set("balance", 7_i64)
            )
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        accounts
            .count(Query::new().filter(doc! { "owner": "o0" }))
            .await
            .unwrap(),
        143
    );
    let batch_zero = accounts.adopt(AdoptOptions::new().batch_size(0)).await;
    assert!(
        matches!(batch_zero, Err(RepoError::InvalidQuery { .. })),
        "{batch_zero:?}"
    );
}

#[tokio::test]
async fn a_store_dry_run_opens_nothing_and_a_store_adoption_opens_the_collection() {
    let t = TestDb::new().await;
    let originals = seed(&t, 60).await;
    let report = t
        .store
        .adopt(common::accounts_spec(), AdoptOptions::new().dry_run(true))
        .await
        .unwrap();
    assert_eq!((report.stamped, report.refused), (59, 1));
    assert_eq!(raw_snapshot(&t.db, "accounts").await, originals);
    let meta = raw_snapshot(&t.db, mongotx::collections::META_COLLECTION).await;
    assert!(
        meta.is_empty(),
        "a dry run registered the collection: {meta:?}"
    );
    let report = t
        .store
        .adopt(common::accounts_spec(), AdoptOptions::new())
        .await
        .unwrap();
    assert_eq!((report.stamped, report.refused), (59, 1));
    // The collection's registry entry (beside the store's announcement of the formats it reads).
    let registered: Vec<_> = raw_snapshot(&t.db, mongotx::collections::META_COLLECTION)
        .await
        .into_iter()
        .filter(|d| {
            d.get_str("_id")
                .is_ok_and(|id| id.starts_with("collection:"))
        })
        .collect();
    assert_eq!(registered.len(), 1, "{registered:?}");
}

/// An adoption stopped anywhere (its future dropped after 0, 1, 2... ms: before its counts, with a
/// batch read, with a stamping command in flight) leaves every document plain or stamped once, and
/// the next run finishes the work.
#[tokio::test]
async fn an_adoption_stopped_anywhere_leaves_documents_plain_or_stamped_and_resumes() {
    let t = TestDb::new().await;
    let originals = seed(&t, 3_000).await;
    let accounts = common::open_accounts(&t.store).await;
    let mut stops = 0;
    let mut progressed = Vec::new();
    let mut after = Duration::ZERO;
    loop {
        let stopped =
            tokio::time::timeout(after, accounts.adopt(AdoptOptions::new().batch_size(100))).await;
        let stored = raw_snapshot(&t.db, "accounts").await;
        let stamped = check_stamped_once(&originals, &stored, &HashMap::new());
        progressed.push(stamped);
        match stopped {
            Err(_) => stops += 1,
            Ok(report) => {
                let report = report.unwrap();
                assert_eq!(stamped, 2_940);
                assert_eq!(report.already_stamped + report.stamped, 2_940);
                break;
            }
        }
        after += Duration::from_millis(if stops < 20 { 1 } else { 25 });
    }
    assert!(stops >= 10, "only {stops} stops: {progressed:?}");
    assert!(
        progressed.windows(2).any(|w| w[0] < w[1] && w[1] < 2_940),
        "no stop fell between two batches: {progressed:?}"
    );
}

/// `mongotx-adopt` killed with SIGKILL at random moments, then run to the end.
#[cfg(feature = "cli")]
#[tokio::test]
async fn the_adopt_command_killed_at_random_moments_resumes_to_the_end() {
    use std::process::{Command, Stdio};
    let t = TestDb::new().await;
    let originals = seed(&t, 20_000).await;
    let schema = concat!(env!("CARGO_MANIFEST_DIR"), "/schemas/accounts.json");
    let command = || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_mongotx-adopt"));
        c.args([
            "--uri",
            &common::server_uri(),
            "--db",
            t.db.name(),
            "--collection",
            "accounts",
            "--schema",
            schema,
            "--batch-size",
            "500",
            "--quiet",
        ])
        .env_remove("MONGODB_URI");
        c
    };
    let accounts = t.db.collection::<Document>("accounts");
    let mut kills = 0;
    let mut stamped_after_kills = Vec::new();
    for run in 0..6 {
        let mut child = command()
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start mongotx-adopt");
        // Killed once it has stamped this many more documents (the first run after its first
        // batch, the others anywhere in what is left): a kill timed by the clock alone missed
        // whole runs once the adoption got fast enough to finish before it.
        let before = stamped_after_kills.last().copied().unwrap_or(0) as u64;
        let target = before
            + if run == 0 {
                1
            } else {
                rand::rng().random_range(1..19_600_u64.saturating_sub(before).max(2))
            };
        let give_up = Instant::now() + Duration::from_secs(120);
        while child.try_wait().unwrap().is_none() && Instant::now() < give_up {
            let stamped = accounts
                .count_documents(doc! { fields::VERSION: { "$exists": true } })
                .await
                .unwrap();
            if stamped >= target {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap(); // SIGKILL
            kills += 1;
        }
        child.wait().unwrap();
        let stored = raw_snapshot(&t.db, "accounts").await;
        stamped_after_kills.push(check_stamped_once(&originals, &stored, &HashMap::new()));
    }
    let output = command().output().expect("run mongotx-adopt");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("refused by the schema (left plain): 400"),
        "{stdout}"
    );
    let stored = raw_snapshot(&t.db, "accounts").await;
    assert_eq!(
        check_stamped_once(&originals, &stored, &HashMap::new()),
        19_600
    );
    assert!(kills >= 1, "no run was killed: {stamped_after_kills:?}");
    assert!(
        stamped_after_kills[0] < 19_600,
        "the first run was killed mid-way: {stamped_after_kills:?}"
    );
    println!(
        "killed {kills} runs; stamped after each: {stamped_after_kills:?}; last run: {stdout}"
    );
}

/// What the writers beside an adoption did to each document: the balance they moved and the
/// version-bumping writes that landed after its stamp.
#[derive(Default)]
struct Ledger {
    delta: HashMap<String, i64>,
    bumps: HashMap<String, i64>,
}

impl Ledger {
    fn record(&mut self, id: &str, delta: i64, bumps: i64) {
        *self.delta.entry(id.to_string()).or_default() += delta;
        *self.bumps.entry(id.to_string()).or_default() += bumps;
    }
}

/// Two adoptions run while raw writers change plain documents (and stamped ones by the rules in
/// docs/adoption.md: only free ones, bumping `_version`), mongotx writers adjust documents plain
/// or stamped, and transactions move balances between them. After it all: every valid document
/// stamped exactly once (its version is 1 plus the writes that landed after its stamp), no field
/// lost or altered, every raw write there, the money conserved.
#[tokio::test]
async fn adoption_beside_raw_writers_mongotx_writers_and_transactions_loses_nothing() {
    const N: usize = 400;
    let t = TestDb::new().await;
    let originals = seed(&t, N).await;
    let accounts = common::open_accounts(&t.store).await;
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop_at = Instant::now() + Duration::from_secs(4);
    let valid: Vec<String> = originals
        .iter()
        .filter(|d| !refused(d))
        .map(|d| d.get_str("_id").unwrap().to_string())
        .collect();
    let pick = |valid: &[String]| valid[rand::rng().random_range(0..valid.len())].clone();

    let mut tasks = tokio::task::JoinSet::new();
    // Raw writers, on another client: plain documents freely, stamped ones by the rules.
    for _ in 0..2 {
        let (db, ledger, valid) = (
            t.other_client_db().await,
            Arc::clone(&ledger),
            valid.clone(),
        );
        tasks.spawn(async move {
            let raw = db.collection::<Document>("accounts");
            while Instant::now() < stop_at {
                let id = pick(&valid);
                let plain = raw
                    .update_one(
                        doc! { "_id": &id, fields::VERSION: { "$exists": false } },
                        doc! { "$inc": { "balance": 1_i64 } },
                    )
                    .await
                    .unwrap();
                if plain.matched_count == 1 {
                    ledger.lock().unwrap().record(&id, 1, 0);
                    continue;
                }
                let stamped = raw
                    .update_one(
                        doc! { "_id": &id, fields::ACTIVE_TXN: { "$exists": false } },
                        doc! { "$inc": { "balance": 1_i64, fields::VERSION: 1_i64 } },
                    )
                    .await
                    .unwrap();
                if stamped.matched_count == 1 {
                    ledger.lock().unwrap().record(&id, 1, 1);
                }
            }
        });
    }
    // mongotx writers: an adjust at the version read (a fingerprint while plain).
    for _ in 0..2 {
        let (accounts, ledger, valid) = (accounts.clone(), Arc::clone(&ledger), valid.clone());
        tasks.spawn(async move {
            while Instant::now() < stop_at {
                let id = pick(&valid);
                let Ok(read) = accounts.get(id.as_str()).await else {
                    continue;
                };
                match accounts
                    .adjust(
                        id.as_str(),
                        read.version,
                        &Adjust::new().by("balance", -1_i64),
                    )
                    .await
                {
                    // The first write of a plain document stamps it at 1: no bump after a stamp.
                    Ok(_) => ledger
                        .lock()
                        .unwrap()
                        .record(&id, -1, i64::from(!read.is_plain())),
                    Err(e) => assert!(e.is_retryable(), "{e}"),
                }
            }
        });
    }
    // Transactions moving 5 between two documents.
    {
        let (accounts, ledger, valid, store) = (
            accounts.clone(),
            Arc::clone(&ledger),
            valid.clone(),
            t.store.clone(),
        );
        tasks.spawn(async move {
            let txns = Transactions::new(&store);
            while Instant::now() < stop_at {
                let (from, to) = (pick(&valid), pick(&valid));
                if from == to {
                    continue;
                }
                let (Ok(a), Ok(b)) = (
                    accounts.get(from.as_str()).await,
                    accounts.get(to.as_str()).await,
                ) else {
                    continue;
                };
                let tx = txns.begin();
                let committed = async {
                    tx.adjust(
                        &accounts,
                        from.as_str(),
                        a.version,
                        &Adjust::new().by("balance", -5_i64),
                    )
                    .await?;
                    tx.adjust(
                        &accounts,
                        to.as_str(),
                        b.version,
                        &Adjust::new().by("balance", 5_i64),
                    )
                    .await?;
                    tx.clone().commit().await
                }
                .await;
                match committed {
                    Ok(_) => {
                        let mut ledger = ledger.lock().unwrap();
                        // A plain participant is stamped at 1 first, then changed: one bump.
                        ledger.record(&from, -5, 1);
                        ledger.record(&to, 5, 1);
                    }
                    Err(e) => assert!(e.is_retryable(), "{e}"),
                }
            }
        });
    }
    // Two adoptions at once, in small batches so that they overlap the writers.
    let mut reports = Vec::new();
    for _ in 0..2 {
        reports.push(tokio::spawn({
            let accounts = accounts.clone();
            async move { accounts.adopt(AdoptOptions::new().batch_size(20)).await }
        }));
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    let mut stamped_by_runs = 0;
    for report in reports {
        stamped_by_runs += report.await.unwrap().unwrap().stamped;
    }
    // A last run picks up documents that the raw writers changed after a run's read.
    let last = accounts.adopt(AdoptOptions::new()).await.unwrap();
    stamped_by_runs += last.stamped;
    common::assert_settled(&t, &["accounts"], "adoption beside writers").await;

    let stored = raw_snapshot(&t.db, "accounts").await;
    let ledger = ledger.lock().unwrap();
    let mut total = 0;
    let mut expected_total = 0;
    let mut mongotx_stamped = 0;
    for (original, now) in originals.iter().zip(&stored) {
        let id = original.get_str("_id").unwrap();
        assert_eq!(now.get_str("_id").unwrap(), id);
        if refused(original) {
            assert_eq!(now, original, "a refused document changed");
            continue;
        }
        let delta = ledger.delta.get(id).copied().unwrap_or(0);
        let balance = now.get_i64("balance").unwrap();
        assert_eq!(balance, 100 + delta, "{id}: a write was lost");
        total += balance;
        expected_total += 100 + delta;
        // Every field but the balance and the stamps is the original, in its place.
        let mut expected = original.clone();
        expected.insert("balance", balance);
        expected.insert(fields::SCHEMA_VERSION, 1_i64);
        let version = 1 + ledger.bumps.get(id).copied().unwrap_or(0);
        expected.insert(fields::VERSION, version);
        assert_eq!(
            now, &expected,
            "{id}: stamped more than once, or a field changed"
        );
        mongotx_stamped += 1;
    }
    assert_eq!(total, expected_total);
    assert!(stamped_by_runs <= mongotx_stamped);
    println!(
        "{mongotx_stamped} documents stamped ({stamped_by_runs} by the adoption runs, the rest by writes); writes: {}",
        ledger.delta.len()
    );
}

/// The store a service opens on a collection being adopted keeps working for its other
/// processes: a second store (another process) reads and writes the same documents.
#[tokio::test]
async fn another_store_sees_the_adoption_as_it_goes() {
    let t = TestDb::new().await;
    seed(&t, 10).await;
    let other = Store::new(t.other_client_db().await);
    let mine = common::open_accounts(&t.store).await;
    let theirs = common::open_accounts(&other).await;
    let plain = theirs.get("p00001").await.unwrap();
    mine.adopt(AdoptOptions::new()).await.unwrap();
    let err = theirs
        .adjust("p00001", plain.version, &Adjust::new().by("balance", 1_i64))
        .await
        .unwrap_err();
    assert!(
        matches!(err, RepoError::VersionConflict { actual: 1, .. }),
        "{err:?}"
    );
    let stamped = theirs.get("p00001").await.unwrap();
    assert_eq!(stamped.version, 1);
    assert_eq!(
        theirs
            .adjust("p00001", 1, &Adjust::new().by("balance", 1_i64))
            .await
            .unwrap(),
        2
    );
}

/// The steps docs/adoption.md gives to undo an adoption, run as written there (through the
/// driver): the collection is back to plain documents, with the changes made through mongotx.
#[tokio::test]
async fn an_adoption_is_undone_by_the_documented_commands() {
    let t = TestDb::new().await;
    let originals = seed(&t, 50).await;
    let accounts = common::open_accounts(&t.store).await;
    accounts.adopt(AdoptOptions::new()).await.unwrap();
    accounts
        .adjust("p00001", 1, &Adjust::new().by("balance", 5_i64))
        .await
        .unwrap();
    accounts.delete("p00002", 1).await.unwrap();
    common::assert_settled(&t, &["accounts"], "before the undo").await;

    let db = &t.db;
    let coll = db.collection::<Document>("accounts");
    assert_eq!(
        coll.count_documents(doc! { "_txn": { "$exists": true } })
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        db.collection::<Document>("mongotx_transactions")
            .count_documents(doc! { "entries.coll": "accounts" })
            .await
            .unwrap(),
        0
    );
    coll.delete_many(doc! { "_deleted": { "$exists": true } })
        .await
        .unwrap();
    coll.update_many(
        doc! {},
        doc! { "$unset": { "_schema": "", "_version": "", "_deleting": "", "_hold": "", "_txn": "" } },
    )
    .await
    .unwrap();
    db.run_command(doc! { "collMod": "accounts", "validator": {} })
        .await
        .unwrap();
    for index in ["_deleted_1", "_txn_1", "_hold.changed_1"] {
        coll.drop_index(index).await.unwrap();
    }
    let removed = db
        .collection::<Document>(mongotx::collections::META_COLLECTION)
        .delete_one(doc! { "_id": "collection:accounts" })
        .await
        .unwrap();
    assert_eq!(removed.deleted_count, 1);

    let mut expected: Vec<Document> = originals
        .into_iter()
        .filter(|d| d.get_str("_id") != Ok("p00002"))
        .collect();
    expected[1].insert("balance", 105_i64);
    assert_eq!(raw_snapshot(&t.db, "accounts").await, expected);
    let indexes = coll.list_index_names().await.unwrap();
    assert_eq!(indexes, vec!["_id_".to_string()]);
}

/// A service's own fields named like system fields (a `_deleted` soft-delete flag, an app-level
/// `_version` counter) make documents neither plain nor readable: adoption counts and names them
/// and leaves them as they are; stamped documents, tombstones and held ones are not among them.
#[tokio::test]
async fn documents_with_the_services_own_system_field_names_are_reported_unreadable() {
    let t = TestDb::new().await;
    // A service's own `_deleted` (a bool) and `_version` (alone) sit where mongotx's system
    // fields go: the test is about reporting them, so they stay when it ends.
    t.keeps_foreign_data();
    seed(&t, 5).await;
    let accounts = common::open_accounts(&t.store).await;
    let raw = t.db.collection::<Document>("accounts");
    raw.insert_many([
        doc! { "_id": "soft-deleted", "owner": "o", "balance": 1_i64, "_deleted": true },
        doc! { "_id": "app-versioned", "owner": "o", "balance": 1_i64, "_version": 3_i64 },
    ])
    .bypass_document_validation(true)
    .await
    .unwrap();
    accounts
        .insert(&crate::common::Account::new("stamped", "o", 1))
        .await
        .unwrap();
    accounts.delete("stamped", 1).await.unwrap();
    accounts
        .insert(&crate::common::Account::new("live", "o", 1))
        .await
        .unwrap();
    let before = raw_snapshot(&t.db, "accounts").await;
    let dry = accounts
        .adopt(AdoptOptions::new().dry_run(true))
        .await
        .unwrap();
    assert_eq!(dry.unreadable, 2, "{dry:?}");
    let mut ids = dry.unreadable_ids.clone();
    ids.sort();
    assert_eq!(ids, vec!["\"app-versioned\"", "\"soft-deleted\""]);
    assert_eq!(raw_snapshot(&t.db, "accounts").await, before);
    let report = accounts.adopt(AdoptOptions::new()).await.unwrap();
    assert_eq!((report.unreadable, report.stamped), (2, 5));
    for id in ["soft-deleted", "app-versioned"] {
        let now = raw.find_one(doc! { "_id": id }).await.unwrap().unwrap();
        let was = before.iter().find(|d| d.get_str("_id") == Ok(id)).unwrap();
        assert_eq!(&now, was, "{id} was changed");
    }
}
