//! The `mongotx` admin command against states the tests build, every printed field compared with
//! what the test reads from the database with the driver: a coordinator crashed mid-commit
//! (committed, and staging) explained by `why`, refused by `resolve` before its deadline with
//! nothing written, and settled by it after; `status` against records of every state, holds in
//! two collections and a dead GC runner's claims; `txn` against a worklist; and bad arguments.
//!
//! Exit statuses: 0 for a report; 2 for a bad command line (clap's: one line on stderr); 1 for an
//! answer that is a refusal (an unknown collection, document or transaction, a live
//! transaction), also one line.

use crate::common;

use std::process::Output;
use std::time::Duration;

use bson::{doc, oid::ObjectId, DateTime, Document};
use mongotx::testkit::failpoint;
use mongotx::{fields, Adjust, Repository, TxnError};
use serde_json::{json, Value};
use tokio::process::Command;

use crate::admin::{
    crashed_transfer, crashed_transfer_within, dying, gc_dies_at, past, record, rfc3339,
    stored_account,
};
use crate::common::refusals::snapshot;
use crate::common::{raw_snapshot, Account, TestDb};

pub const MONGOTX: &str = env!("CARGO_BIN_EXE_mongotx");
const GC: &str = env!("CARGO_BIN_EXE_mongotx-gc");

/// Runs `program` with `args` on the test server and `t`'s database (`--uri`, `--db` first).
pub async fn run(program: &str, t: &TestDb, args: &[&str]) -> Output {
    let uri = common::server_uri();
    let mut command = Command::new(program);
    command
        .args(["--uri", uri.as_str(), "--db", t.db.name()])
        .args(args)
        .env_remove("MONGODB_URI")
        .env_remove("RUST_LOG")
        .env("RUST_BACKTRACE", "0")
        .kill_on_drop(true);
    tokio::time::timeout(Duration::from_secs(120), command.output())
        .await
        .unwrap_or_else(|_| panic!("{program} {args:?}: still running after 120 s"))
        .unwrap_or_else(|e| panic!("{program} {args:?}: cannot run: {e}"))
}

/// Runs `mongotx ARGS` and returns its stdout; it must succeed.
pub async fn mongotx(t: &TestDb, args: &[&str]) -> String {
    let out = run(MONGOTX, t, args).await;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "mongotx {args:?} failed ({:?}): {stderr}",
        out.status
    );
    stdout.into_owned()
}

/// Runs `mongotx ARGS --json` and parses what it printed.
pub async fn mongotx_json(t: &TestDb, args: &[&str]) -> Value {
    let mut args = args.to_vec();
    args.push("--json");
    let printed = mongotx(t, &args).await;
    serde_json::from_str(&printed)
        .unwrap_or_else(|e| panic!("mongotx {args:?}: not JSON ({e}): {printed}"))
}

/// Runs `mongotx ARGS`, which must be refused with exit status `code` and one line on stderr
/// (clap's hints aside) containing `says`; returns that line.
async fn refused(t: &TestDb, args: &[&str], code: i32, says: &str) -> String {
    let out = run(MONGOTX, t, args).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "mongotx {args:?}: {stderr}");
    assert!(out.stdout.is_empty(), "mongotx {args:?} printed a report");
    let hint = |l: &str| {
        l.starts_with("Usage:")
            || l.starts_with("For more information")
            || l.starts_with("  tip:")
            || l.starts_with("  [")
    };
    // An indented line continues the one above (clap lists missing arguments so).
    let mut lines: Vec<String> = Vec::new();
    for line in stderr.lines().filter(|l| !l.trim().is_empty() && !hint(l)) {
        match lines.last_mut() {
            Some(last) if line.starts_with("  ") => last.push_str(line),
            _ => lines.push(line.to_string()),
        }
    }
    assert_eq!(
        lines.len(),
        1,
        "mongotx {args:?}: one line expected: {stderr}"
    );
    assert!(
        lines[0].contains(says),
        "mongotx {args:?}: {:?} lacks {says:?}",
        lines[0]
    );
    for mark in ["panicked", "Kind:", "Error {"] {
        assert!(!stderr.contains(mark), "mongotx {args:?}: {stderr}");
    }
    lines.remove(0)
}

/// The value of field `label` in a text report, its wrapped continuation lines joined.
fn field(text: &str, label: &str) -> String {
    let head = format!("{label}:");
    let mut lines = text.lines().skip_while(|l| !l.starts_with(&head));
    let Some(first) = lines.next() else {
        panic!("no field {label:?} in:\n{text}");
    };
    let mut value = first[head.len()..].trim().to_string();
    for more in lines.take_while(|l| l.starts_with(' ')) {
        value.push(' ');
        value.push_str(more.trim());
    }
    value
}

/// `mongotx resolve TXN` before the deadline: refused (exit 1) with the time left, nothing
/// written.
async fn resolve_is_refused_while_live(t: &TestDb, txn: ObjectId, state: &str) {
    let before = snapshot(&t.db).await;
    let line = refused(
        t,
        &["resolve", &txn.to_hex()],
        1,
        &format!("transaction {txn} is {state} and live: its deadline"),
    )
    .await;
    assert!(line.contains("away on the server's clock"), "{line}");
    let deadline = record(t, txn)
        .await
        .expect("record")
        .get_datetime("deadline")
        .copied();
    assert!(
        line.contains(&rfc3339(deadline.expect("deadline"))),
        "{line}"
    );
    assert_eq!(
        snapshot(&t.db).await,
        before,
        "a refused resolve wrote something"
    );
}

/// `mongotx resolve TXN --json` after the deadline: it settles the transfer of a and b
/// (adjusted 1->2) as `outcome`, deletes its record, and leaves a and b standing as `states`
/// (what each is, at which version). Returns the report.
async fn resolve_settles(
    t: &TestDb,
    txn: ObjectId,
    outcome: &str,
    states: [(&str, i64); 2],
) -> Value {
    let resolved = mongotx_json(t, &["resolve", &txn.to_hex()]).await;
    println!("{resolved:#}");
    assert_eq!(resolved["outcome"], outcome);
    assert_eq!(resolved["record_after"], Value::Null);
    let documents: Vec<Value> = ["a", "b"]
        .into_iter()
        .zip(states)
        .map(|(id, (is, version))| {
            json!({ "collection": "accounts", "id": id, "op": "adjust", "expected": 1,
                    "applied": 2, "state": { "is": is, "version": version } })
        })
        .collect();
    assert_eq!(resolved["documents"], Value::Array(documents));
    assert!(record(t, txn).await.is_none(), "the record is deleted");
    resolved
}

/// Accounts a (100) and b (50), and a transfer of 30 from a to b whose coordinator died at `at`
/// (b changed under it first with `outside`), leaving its record in `state`: the accounts, the
/// transaction and its stored deadline.
async fn crashed_at(
    t: &TestDb,
    at: &'static str,
    outside: bool,
    state: &str,
) -> (Repository<Account>, ObjectId, DateTime) {
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100), ("b", 50)]).await;
    let txn = crashed_transfer(t, &accounts, ("a", "b"), at, outside).await;
    let stored = record(t, txn).await.expect("the record stays");
    assert_eq!(stored.get_str("state"), Ok(state));
    let deadline = *stored.get_datetime("deadline").expect("deadline");
    (accounts, txn, deadline)
}

#[tokio::test]
async fn why_explains_a_coordinator_dead_after_its_commit_point_and_resolve_finishes_it() {
    let t = TestDb::new().await;
    let (_, txn, deadline) = crashed_at(&t, failpoint::COMMIT_AFTER, false, "committed").await;

    let why = mongotx_json(&t, &["why", "accounts", "a"]).await;
    assert_eq!(why["collection"], "accounts");
    assert_eq!(why["id"], "a");
    // Readers see the committed value: the new balance, at the change's version.
    assert_eq!(
        why["committed"],
        json!({ "is": "live", "version": 2, "schema_version": 1,
                "value": { "_id": "a", "owner": "A", "balance": 70 } })
    );
    let hold = &why["hold"];
    assert_eq!(hold["txn"]["$oid"], txn.to_hex());
    assert_eq!(hold["op"], "update");
    assert_eq!(hold["stored_version"], 2);
    assert_eq!(hold["record"]["state"], "committed");
    assert_eq!(hold["record"]["deadline"], rfc3339(deadline));
    assert_eq!(hold["hold_deadline"], rfc3339(deadline));
    assert_eq!(hold["record"]["overdue_ms"], Value::Null);
    assert_eq!(
        hold["others"],
        json!([{ "collection": "accounts", "id": "b", "op": "adjust", "expected": 1,
                 "applied": 2, "state": { "is": "held", "version": 2 } }])
    );
    assert_eq!(hold["next"]["action"], "finish");
    assert_eq!(hold["next"]["readers_see"], "new_values");
    assert_eq!(hold["next"]["gc_from"], rfc3339(deadline));

    let text = mongotx(&t, &["why", "accounts", "a"]).await;
    println!("{text}");
    assert_eq!(
        field(&text, "held by"),
        format!("transaction {txn} (update, stored version 2)")
    );
    assert_eq!(field(&text, "state"), "committed");
    assert!(field(&text, "deadline").starts_with(&format!("{} (in ", rfc3339(deadline))));
    assert_eq!(
        field(&text, "other documents"),
        "accounts/\"b\" (adjust 1->2): held by it (version 2)"
    );
    let next = field(&text, "next");
    assert!(
        next.contains(&format!(
            "the first GC round after the deadline, {}",
            rfc3339(deadline)
        )),
        "{next}"
    );

    resolve_is_refused_while_live(&t, txn, "committed").await;

    past(&t, deadline).await;
    let resolved = resolve_settles(&t, txn, "finished", [("finished", 2), ("finished", 2)]).await;
    assert_eq!(resolved["before"]["state"], "committed");
    assert_eq!(stored_account(&t, "a").await, (70, 2, None));
    assert_eq!(stored_account(&t, "b").await, (80, 2, None));
    common::assert_settled(&t, &["accounts"], "after mongotx resolve").await;
}

#[tokio::test]
async fn why_explains_a_coordinator_dead_while_staging_and_resolve_rolls_it_back() {
    let t = TestDb::new().await;
    // b changes under the transaction, so its apply is refused; the coordinator dies before
    // it can abort: a staging record, a held, b free at another version.
    let (accounts, txn, deadline) = crashed_at(&t, failpoint::ABORT_BEFORE, true, "staging").await;
    assert_eq!(stored_account(&t, "a").await, (70, 2, Some(txn)));
    assert_eq!(stored_account(&t, "b").await, (50, 2, None));

    let why = mongotx_json(&t, &["why", "accounts", "a"]).await;
    // Readers see the value from before the transaction.
    assert_eq!(
        why["committed"],
        json!({ "is": "live", "version": 1, "schema_version": 1,
                "value": { "_id": "a", "owner": "A", "balance": 100 } })
    );
    let hold = &why["hold"];
    assert_eq!(hold["txn"]["$oid"], txn.to_hex());
    assert_eq!(hold["record"]["state"], "staging");
    assert_eq!(hold["record"]["deadline"], rfc3339(deadline));
    assert_eq!(
        hold["others"],
        json!([{ "collection": "accounts", "id": "b", "op": "adjust", "expected": 1,
                 "applied": 2, "state": { "is": "changed", "version": 2 } }])
    );
    assert_eq!(hold["next"]["action"], "decide");
    assert_eq!(hold["next"]["readers_see"], "old_values");
    assert_eq!(hold["next"]["gc_from"], rfc3339(deadline));
    let says = hold["next"]["says"].as_str().expect("says");
    assert!(
        says.starts_with(&format!("staging, live until {}", rfc3339(deadline))),
        "{says}"
    );
    assert!(says.contains("accounts/\"b\" lacks its change"), "{says}");

    resolve_is_refused_while_live(&t, txn, "staging").await;

    past(&t, deadline).await;
    // Expired now: waiting for the GC, which will roll it back.
    let why = mongotx_json(&t, &["why", "accounts", "a"]).await;
    assert_eq!(why["hold"]["next"]["action"], "roll_back");
    assert_eq!(why["hold"]["next"]["gc_from"], Value::Null);
    let says = why["hold"]["next"]["says"].as_str().expect("says");
    assert!(says.starts_with("staging, expired "), "{says}");
    assert!(
        why["hold"]["record"]["overdue_ms"].as_u64().is_some(),
        "{why}"
    );

    resolve_settles(&t, txn, "rolled_back", [("as_read", 1), ("changed", 2)]).await;
    assert_eq!(stored_account(&t, "a").await, (100, 1, None));
    assert_eq!(stored_account(&t, "b").await, (50, 2, None));
    assert_eq!(
        accounts.get("b").await.expect("b").note.as_deref(),
        Some("outside")
    );
    common::assert_settled(&t, &["accounts"], "after mongotx resolve").await;
}

/// The report's time field `name` of `value`, parsed.
fn time_of(value: &Value) -> DateTime {
    let text = value
        .as_str()
        .unwrap_or_else(|| panic!("not a time: {value}"));
    let parsed =
        chrono::DateTime::parse_from_rfc3339(text).unwrap_or_else(|e| panic!("{text}: {e}"));
    DateTime::from_millis(parsed.timestamp_millis())
}

fn millis_between(from: DateTime, to: DateTime) -> i64 {
    to.timestamp_millis() - from.timestamp_millis()
}

/// The accounts, seeded with `seeds`, and the notes, both opened on `t`'s store.
async fn accounts_and_notes(
    t: &TestDb,
    seeds: &[(&str, i64)],
) -> (Repository<Account>, Repository<common::Note>) {
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, seeds).await;
    let notes = t
        .store
        .repository::<common::Note>(common::notes_spec())
        .await
        .expect("open notes");
    (accounts, notes)
}

#[tokio::test]
async fn status_matches_the_stored_records_holds_and_claims() {
    let t = TestDb::new().await;
    let seeds: Vec<(String, i64)> = (0..8).map(|i| (format!("acc{i}"), 100)).collect();
    let seeds: Vec<(&str, i64)> = seeds.iter().map(|(id, b)| (id.as_str(), *b)).collect();
    let (accounts, notes) = accounts_and_notes(&t, &seeds).await;
    let hour = Duration::from_secs(3600);

    // Live and committed, not finished: holds an account and a note it creates.
    let tx = dying(&t, failpoint::COMMIT_AFTER, hour).begin();
    tx.adjust(&accounts, "acc0", 1, &Adjust::new().by("balance", 5_i64))
        .await
        .expect("stage");
    tx.insert(
        &notes,
        &common::Note {
            id: None,
            text: "held".into(),
            tags: vec![],
        },
    )
    .await
    .expect("stage");
    assert!(matches!(tx.commit().await, Err(TxnError::Crashed { .. })));
    // Live and staging: holds acc2 (acc3 changed under it).
    crashed_transfer_within(
        &t,
        &accounts,
        ("acc2", "acc3"),
        failpoint::ABORT_BEFORE,
        true,
        hour,
    )
    .await;
    // Two committed whose deadline passes, claimed by a GC runner that dies mid-round.
    let short = Duration::from_secs(2);
    let e1 = crashed_transfer_within(
        &t,
        &accounts,
        ("acc4", "acc5"),
        failpoint::COMMIT_AFTER,
        false,
        short,
    )
    .await;
    let e2 = crashed_transfer_within(
        &t,
        &accounts,
        ("acc6", "acc7"),
        failpoint::COMMIT_AFTER,
        false,
        short,
    )
    .await;
    let last = *record(&t, e2)
        .await
        .expect("e2")
        .get_datetime("deadline")
        .expect("deadline");
    past(&t, last).await;
    gc_dies_at(&t, failpoint::GC_FINISH_BEFORE).await;

    let status = mongotx_json(&t, &["status"]).await;
    let now = time_of(&status["now"]);
    let records = raw_snapshot(&t.db, mongotx::collections::TRANSACTIONS_COLLECTION).await;
    assert_eq!(records.len(), 4);
    assert_eq!(status["database"], t.db.name());
    assert_eq!(status["transactions_collection"], "mongotx_transactions");
    assert_eq!(status["server"]["suitable"], true, "{}", status["server"]);
    assert!(status["server"]["verdict"]
        .as_str()
        .expect("verdict")
        .starts_with("suitable"));
    assert_eq!(status["unreadable_records"], 0);

    let deadline = |r: &Document| *r.get_datetime("deadline").expect("deadline");
    let mut rows = Vec::new();
    for state in ["staging", "committed", "aborted"] {
        let mine: Vec<&Document> = records
            .iter()
            .filter(|r| r.get_str("state") == Ok(state))
            .collect();
        let oldest = mine
            .iter()
            .map(|r| *r.get_datetime("created").expect("created"))
            .min();
        rows.push(json!({
            "state": state,
            "count": mine.len(),
            "expired": mine.iter().filter(|r| deadline(r) <= now).count(),
            "oldest_created": oldest.map(rfc3339),
            "oldest_age_ms": oldest.map(|at| millis_between(at, now)),
        }));
    }
    assert_eq!(status["transactions"], Value::Array(rows));
    assert_eq!(status["transactions"][1]["count"], 3, "three committed");
    assert_eq!(
        status["transactions"][1]["expired"], 2,
        "two of them expired"
    );

    let mut held = Vec::new();
    for coll in ["accounts", "notes"] {
        let n = raw_snapshot(&t.db, coll)
            .await
            .iter()
            .filter(|d| d.contains_key(fields::ACTIVE_TXN))
            .count();
        held.push(json!({ "collection": coll, "documents": n }));
    }
    assert_eq!(status["held"], Value::Array(held));
    assert_eq!(status["held"][0]["documents"], 6);

    let oldest = records
        .iter()
        .filter(|r| deadline(r) <= now)
        .min_by_key(|r| deadline(r))
        .expect("an expired record");
    assert_eq!(oldest.get_object_id("_id"), Ok(e1));
    let behind = millis_between(deadline(oldest), now);
    assert_eq!(
        status["oldest_expired"],
        json!({ "txn": { "$oid": e1.to_hex() }, "state": "committed",
                "deadline": rfc3339(deadline(oldest)), "overdue_ms": behind })
    );
    assert_eq!(status["gc_behind_ms"], behind);

    let mut claimed: Vec<(DateTime, ObjectId, ObjectId)> = records
        .iter()
        .filter_map(|r| {
            let gc = r.get_document("gc").ok()?;
            let until = *gc.get_datetime("until").ok()?;
            (until > now).then(|| {
                (
                    until,
                    r.get_object_id("_id").expect("id"),
                    gc.get_object_id("by").expect("by"),
                )
            })
        })
        .collect();
    claimed.sort();
    let mut ids: Vec<ObjectId> = claimed.iter().map(|(_, id, _)| *id).collect();
    ids.sort();
    let mut expired = vec![e1, e2];
    expired.sort();
    assert_eq!(ids, expired, "the dead runner claimed both expired records");
    assert_eq!(status["claimed"], 2);
    let claims: Vec<Value> = claimed
        .iter()
        .map(|(until, id, by)| {
            json!({
                "txn": { "$oid": id.to_hex() }, "state": "committed",
                "runner": { "$oid": by.to_hex() }, "until": rfc3339(*until),
                "left_ms": millis_between(now, *until),
            })
        })
        .collect();
    assert_eq!(status["claims"], Value::Array(claims));

    let text = mongotx(&t, &["status"]).await;
    println!("{text}");
    assert_eq!(field(&text, "database"), t.db.name());
    assert!(
        field(&text, "committed").starts_with("3 (2 expired; oldest written "),
        "{text}"
    );
    assert!(
        field(&text, "staging").starts_with("1 (0 expired; "),
        "{text}"
    );
    assert_eq!(field(&text, "aborted"), "0");
    assert_eq!(field(&text, "held"), "6 in accounts 1 in notes");
    assert!(field(&text, "oldest expired").starts_with(&format!("{e1} (committed), deadline ")));
    assert!(field(&text, "claimed").starts_with("2 record(s)"), "{text}");

    // The GC round summary counts what the dead runner's claims keep it off.
    let out = run(GC, &t, &["--once", "--no-quota", "--no-ratelimit"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout
            .lines()
            .any(|l| l
                == "round: finished=0 rolled_back=0 swept=0 skipped=0 purged=0 left_to_claims=2"),
        "{stdout}"
    );
    for txn in [e1, e2] {
        assert!(
            record(&t, txn).await.is_some(),
            "a claimed record was left alone"
        );
    }
}

#[tokio::test]
async fn txn_reports_the_worklist_and_where_each_document_stands() {
    let t = TestDb::new().await;
    let (accounts, notes) = accounts_and_notes(&t, &[("a", 100), ("b", 50), ("c", 10)]).await;
    // a applied, b refused (changed under it), c checked, a note created; the coordinator dies
    // before it can abort.
    let tx = dying(&t, failpoint::ABORT_BEFORE, Duration::from_secs(3600)).begin();
    tx.adjust(&accounts, "a", 1, &Adjust::new().by("balance", -30_i64))
        .await
        .expect("stage");
    tx.adjust(&accounts, "b", 1, &Adjust::new().by("balance", 30_i64))
        .await
        .expect("stage");
    tx.check(&accounts, "c", 1).expect("stage");
    let note = tx
        .insert(
            &notes,
            &common::Note {
                id: None,
                text: "x".into(),
                tags: vec![],
            },
        )
        .await
        .expect("stage");
    accounts
        .update("b", 1, &mongotx::Update::new().set("note", "outside"))
        .await
        .expect("outside write");
    let txn = match tx.commit().await {
        Err(TxnError::Crashed { txn: Some(txn), .. }) => txn,
        other => panic!("the coordinator should die: {other:?}"),
    };

    let report = mongotx_json(&t, &["txn", &txn.to_hex()]).await;
    let stored = record(&t, txn).await.expect("record");
    assert_eq!(report["txn"]["$oid"], txn.to_hex());
    assert_eq!(
        report["record"]["state"],
        stored.get_str("state").expect("state")
    );
    assert_eq!(report["record"]["state"], "staging");
    assert_eq!(
        report["record"]["created"],
        rfc3339(*stored.get_datetime("created").expect("created"))
    );
    assert_eq!(
        report["record"]["deadline"],
        rfc3339(*stored.get_datetime("deadline").expect("deadline"))
    );
    assert_eq!(report["record"]["claim"], Value::Null);
    // The worklist, in the record's order, each document's state from the document itself.
    let mut expected = Vec::new();
    for entry in stored.get_array("entries").expect("entries") {
        let entry = entry.as_document().expect("entry");
        let coll = entry.get_str("coll").expect("coll");
        let id = entry.get("id").expect("id").clone();
        let found =
            t.db.collection::<Document>(coll)
                .find_one(doc! { "_id": id.clone() })
                .await
                .expect("read")
                .expect("each document exists");
        let version = found.get_i64(fields::VERSION).expect("version");
        let state = match found.get_object_id(fields::ACTIVE_TXN) {
            Ok(holder) if holder == txn => json!({ "is": "held", "version": version }),
            Ok(other) => json!({ "is": "held_by_other", "txn": { "$oid": other.to_hex() } }),
            Err(_) if version == entry.get_i64("expected").expect("expected") => {
                json!({ "is": "as_read", "version": version })
            }
            Err(_) => json!({ "is": "changed", "version": version }),
        };
        expected.push(json!({
            "collection": coll,
            "id": serde_json::to_value(&id).expect("id"),
            "op": entry.get_document("op").expect("op").get_str("kind").expect("kind"),
            "expected": entry.get_i64("expected").expect("expected"),
            "applied": entry.get_i64("applied").expect("applied"),
            "state": state,
        }));
    }
    assert_eq!(report["documents"], Value::Array(expected));
    // What that truth is here, in lock order (collection, then id).
    let states: Vec<(&str, &str)> = report["documents"]
        .as_array()
        .expect("documents")
        .iter()
        .map(|d| {
            (
                d["op"].as_str().unwrap_or(""),
                d["state"]["is"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        states,
        [
            ("adjust", "held"),
            ("adjust", "changed"),
            ("check", "held"),
            ("insert", "held")
        ]
    );
    assert_eq!(
        report["documents"][3]["id"]["$oid"],
        note.as_object_id().expect("oid").to_hex()
    );
    assert_eq!(report["next"]["action"], "decide");

    let text = mongotx(&t, &["txn", &txn.to_hex()]).await;
    println!("{text}");
    assert_eq!(field(&text, "transaction"), txn.to_hex());
    assert_eq!(field(&text, "state"), "staging");
    assert!(
        field(&text, "documents")
            .starts_with("accounts/\"a\" (adjust 1->2): held by it (version 2)"),
        "{text}"
    );
}

#[tokio::test]
async fn bad_arguments_are_one_line_and_write_nothing() {
    let t = TestDb::new().await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("a", 100)]).await;
    let before = snapshot(&t.db).await;
    let unknown = ObjectId::new().to_hex();
    // The command line (exit status 2).
    for (args, says) in [
        (&["frobnicate"][..], "frobnicate"),
        (&["why"][..], "<COLLECTION>"),
        (&["why", "accounts"][..], "<ID>"),
        (
            &["why", "accounts", "a", "--id-json", "7"][..],
            "cannot be used with",
        ),
        (&["why", "accounts", "--id-json", "{nope"][..], "not JSON"),
        (
            &["why", "accounts", "--id-json", "[1]"][..],
            "cannot be an array",
        ),
        (
            &["why", "accounts", "--id-json", "null"][..],
            "cannot be null",
        ),
        (&["why", "", "a"][..], "cannot be empty"),
        (&["txn"][..], "<TXN>"),
        (&["txn", "not-an-id"][..], "is not a transaction id"),
        (&["resolve", "1234"][..], "is not a transaction id"),
    ] {
        refused(&t, args, 2, says).await;
    }
    // Answers that refuse (exit status 1).
    refused(
        &t,
        &["txn", &unknown],
        1,
        &format!("transaction {unknown}: no record and no document held by it"),
    )
    .await;
    refused(
        &t,
        &["resolve", &unknown],
        1,
        &format!("transaction {unknown}: no record"),
    )
    .await;
    refused(
        &t,
        &["why", "nosuch", "a"],
        1,
        "nosuch is not a collection mongotx manages",
    )
    .await;
    refused(
        &t,
        &["why", "accounts", "zzz"],
        1,
        "accounts/\"zzz\": no such document",
    )
    .await;
    refused(
        &t,
        &["why", "accounts", "--id-json", "7"],
        1,
        "accounts/7: no such document",
    )
    .await;
    assert_eq!(
        snapshot(&t.db).await,
        before,
        "a refused command wrote something"
    );
}
