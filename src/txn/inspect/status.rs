//! What mongotx is doing in a database (`mongotx status`): the server's verdict in one line,
//! transactions by state and age, documents held per collection, how far the GC is behind, and
//! the GC runners' claims. A handful of commands, none of which reads a whole collection: the
//! records are grouped on the server, held documents counted through the `_txn` index.

use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use futures::future::join_all;
use futures::TryStreamExt;
use serde::Serialize;

use crate::repo::fields;
use crate::repo::hold::record::{TxnState, DEADLINE, STATE};
use crate::repo::meta;
use crate::server::clock;
use crate::server::probe;
use crate::server::semantics;
use crate::txn::claims::{claim_of, CLAIM_UNTIL};
use crate::txn::error::TxnError;
use crate::txn::inspect::model::ser;
use crate::txn::recovery::Env;

/// The most claims a status lists one by one (`Status::claimed` counts them all).
pub const CLAIMS_LISTED: usize = 100;

/// What mongotx is doing in one database.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Status {
    /// The database.
    pub database: String,
    /// The collection of transaction records.
    pub transactions_collection: String,
    /// The server's time the status was taken at; every age is measured from it.
    #[serde(serialize_with = "ser::time")]
    pub now: DateTime,
    /// What the server is, and whether it suits the protocol.
    pub server: ServerLine,
    /// Transactions by their record's state: staging, committed, aborted, in that order.
    pub transactions: Vec<StateCount>,
    /// Records whose state is none of the three (written by something other than mongotx).
    pub unreadable_records: u64,
    /// Documents held by a transaction, per collection mongotx manages (every one, held or not).
    pub held: Vec<HeldCount>,
    /// The record whose deadline passed longest ago, if any has: the GC's oldest backlog.
    pub oldest_expired: Option<Expired>,
    /// How far the GC is behind: how long ago the oldest expired record's deadline passed (zero
    /// when no record has expired). A GC keeping up holds this under its interval.
    #[serde(rename = "gc_behind_ms", serialize_with = "ser::millis")]
    pub gc_behind: Duration,
    /// How many records carry a GC runner's claim that has not run out.
    pub claimed: u64,
    /// Those claims, the first to run out first (at most [`CLAIMS_LISTED`]).
    pub claims: Vec<ClaimedRecord>,
}

/// The server in one line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ServerLine {
    /// The version the server reports, if it answers `buildInfo`.
    pub version: Option<String>,
    /// Standalone, replica set or sharded cluster, from `hello`.
    pub topology: Option<String>,
    /// Whether the server has what the protocol cannot do without, by the quick check a store
    /// runs when it opens its first collection (`None`: the check could not run).
    pub suitable: Option<bool>,
    /// The verdict in one sentence.
    pub verdict: String,
}

/// The transactions whose record is in one state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct StateCount {
    /// The state.
    pub state: TxnState,
    /// How many records are in it.
    pub count: u64,
    /// How many of those are past their deadline: the GC's to settle.
    pub expired: u64,
    /// When the oldest of them was written (server time).
    #[serde(serialize_with = "ser::opt_time")]
    pub oldest_created: Option<DateTime>,
    /// How old the oldest of them is.
    #[serde(rename = "oldest_age_ms", serialize_with = "ser::opt_millis")]
    pub oldest_age: Option<Duration>,
}

/// The held documents of one collection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct HeldCount {
    /// The collection.
    pub collection: String,
    /// How many of its documents a transaction holds (fences included).
    pub documents: u64,
}

/// An expired record: its transaction waits for the GC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Expired {
    /// The transaction.
    pub txn: ObjectId,
    /// Its record's state (`None`: unreadable).
    pub state: Option<TxnState>,
    /// Its deadline (server time).
    #[serde(serialize_with = "ser::time")]
    pub deadline: DateTime,
    /// How long ago that was.
    #[serde(rename = "overdue_ms", serialize_with = "ser::millis")]
    pub overdue: Duration,
}

/// A record a GC runner has claimed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ClaimedRecord {
    /// The transaction.
    pub txn: ObjectId,
    /// Its record's state (`None`: unreadable).
    pub state: Option<TxnState>,
    /// The runner's name.
    pub runner: ObjectId,
    /// When the claim runs out (server time); other runners leave the record until then.
    #[serde(serialize_with = "ser::time")]
    pub until: DateTime,
    /// How long until then.
    #[serde(rename = "left_ms", serialize_with = "ser::millis")]
    pub left: Duration,
}

/// Takes the status of `env`'s database.
pub(crate) async fn status(env: &Env) -> Result<Status, TxnError> {
    let now = env.now(None).await?;
    let db = env.store.database();
    let records = env.records(None).await?;
    let fail = |step| move |e| TxnError::database(None, step, e);
    let collections = meta::managed(db)
        .await
        .map_err(fail("list managed collections"))?;
    let (server, by_state, oldest, claims, held) = futures::join!(
        server_line(env),
        by_state(&records, now),
        oldest_expired(&records, now),
        claims(&records, now),
        held(env, &collections),
    );
    let (transactions, unreadable_records) = by_state?;
    let oldest_expired = oldest?;
    let (claimed, claims) = claims?;
    Ok(Status {
        database: db.name().to_string(),
        transactions_collection: env.store.transactions_collection().to_string(),
        now,
        server,
        transactions,
        unreadable_records,
        held: held?,
        gc_behind: oldest_expired
            .as_ref()
            .map_or(Duration::ZERO, |e| e.overdue),
        oldest_expired,
        claimed,
        claims,
    })
}

/// The records by state, grouped on the server; and how many have a state none of the three.
async fn by_state(
    records: &mongodb::Collection<Document>,
    now: DateTime,
) -> Result<(Vec<StateCount>, u64), TxnError> {
    let fail = |e| TxnError::database(None, "count transactions by state", e);
    let deadline = format!("${DEADLINE}");
    let groups: Vec<Document> = records
        .aggregate(vec![doc! { "$group": {
            "_id": format!("${STATE}"),
            "count": { "$sum": 1 },
            "expired": { "$sum": { "$cond": [{ "$lte": [deadline, now] }, 1, 0] } },
            "oldest": { "$min": "$created" },
        } }])
        .await
        .map_err(fail)?
        .try_collect()
        .await
        .map_err(fail)?;
    let mut unreadable = 0;
    let mut rows: Vec<StateCount> = [TxnState::Staging, TxnState::Committed, TxnState::Aborted]
        .into_iter()
        .map(|state| StateCount {
            state,
            count: 0,
            expired: 0,
            oldest_created: None,
            oldest_age: None,
        })
        .collect();
    for group in &groups {
        let count = number(group.get("count"));
        let state = group.get_str("_id").ok();
        match rows.iter_mut().find(|r| Some(r.state.as_str()) == state) {
            Some(row) => {
                row.count = count;
                row.expired = number(group.get("expired"));
                row.oldest_created = group.get_datetime("oldest").ok().copied();
                row.oldest_age = row.oldest_created.map(|at| clock::between(at, now));
            }
            None => unreadable += count,
        }
    }
    Ok((rows, unreadable))
}

/// A count the server returned (an Int32 or an Int64, by its size).
fn number(value: Option<&Bson>) -> u64 {
    match value {
        Some(Bson::Int32(n)) => u64::try_from(*n).unwrap_or(0),
        Some(Bson::Int64(n)) => u64::try_from(*n).unwrap_or(0),
        Some(Bson::Double(n)) if *n >= 0.0 => *n as u64,
        _ => 0,
    }
}

/// The record whose deadline passed longest ago.
async fn oldest_expired(
    records: &mongodb::Collection<Document>,
    now: DateTime,
) -> Result<Option<Expired>, TxnError> {
    let found = records
        .find_one(doc! { DEADLINE: { "$lte": now } })
        .sort(doc! { DEADLINE: 1, "_id": 1 })
        .projection(doc! { STATE: 1, DEADLINE: 1 })
        .await
        .map_err(|e| TxnError::database(None, "find the oldest expired record", e))?;
    Ok(found.and_then(|record| {
        let deadline = *record.get_datetime(DEADLINE).ok()?;
        Some(Expired {
            txn: record.get_object_id("_id").ok()?,
            state: state_of(&record),
            deadline,
            overdue: clock::between(deadline, now),
        })
    }))
}

fn state_of(record: &Document) -> Option<TxnState> {
    record
        .get(STATE)
        .cloned()
        .and_then(|s| bson::from_bson::<TxnState>(s).ok())
}

/// How many records carry a claim that has not run out, and the first [`CLAIMS_LISTED`] of them.
async fn claims(
    records: &mongodb::Collection<Document>,
    now: DateTime,
) -> Result<(u64, Vec<ClaimedRecord>), TxnError> {
    let fail = |e| TxnError::database(None, "read the GC runners' claims", e);
    let active = doc! { CLAIM_UNTIL: { "$gt": now } };
    let claimed = records
        .count_documents(active.clone())
        .await
        .map_err(fail)?;
    let listed: Vec<Document> = records
        .find(active)
        .sort(doc! { CLAIM_UNTIL: 1, "_id": 1 })
        .projection(doc! { STATE: 1, "gc": 1 })
        .limit(i64::try_from(CLAIMS_LISTED).unwrap_or(i64::MAX))
        .await
        .map_err(fail)?
        .try_collect()
        .await
        .map_err(fail)?;
    let claims = listed
        .iter()
        .filter_map(|record| {
            let (runner, until) = claim_of(record)?;
            Some(ClaimedRecord {
                txn: record.get_object_id("_id").ok()?,
                state: state_of(record),
                runner,
                until,
                left: clock::between(now, until),
            })
        })
        .collect();
    Ok((claimed, claims))
}

/// The held documents of each managed collection, counted through the `_txn` index.
async fn held(env: &Env, collections: &[String]) -> Result<Vec<HeldCount>, TxnError> {
    let counted = join_all(collections.iter().map(|coll| async move {
        let documents = env
            .collection(None, coll)
            .await?
            .count_documents(doc! { fields::ACTIVE_TXN: { "$exists": true } })
            .await
            .map_err(|e| TxnError::database(None, "count held documents", e))?;
        Ok::<_, TxnError>(HeldCount {
            collection: coll.clone(),
            documents,
        })
    }))
    .await;
    let mut held: Vec<HeldCount> = counted.into_iter().collect::<Result<_, _>>()?;
    held.sort_by(|a, b| a.collection.cmp(&b.collection));
    Ok(held)
}

/// The server in one line: its version and topology, and the quick check of what the protocol
/// needs (the one a store runs when it opens its first collection, on a scratch collection it
/// drops after). Never fails: what cannot be learned is said so.
async fn server_line(env: &Env) -> ServerLine {
    let db = env.store.database();
    let (version, topology, checked) = futures::join!(
        probe::build_version(db),
        env.store.topology(),
        semantics::essentials(db),
    );
    let (suitable, verdict) = match checked {
        Ok(Ok(())) => (
            Some(true),
            "suitable: it has every behaviour the protocol needs (the quick check; \
             `mongotx-probe` runs the full verdict, atomicity under contention included)"
                .to_string(),
        ),
        Ok(Err(lacking)) => (
            Some(false),
            lacking
                .refusal()
                .unwrap_or_else(|| format!("the server lacks `{}`", lacking.name)),
        ),
        Err(unasked) => (
            None,
            format!(
                "not checked: the check `{}` could not run ({})",
                unasked.check,
                crate::server::summarize(&unasked.source)
            ),
        ),
    };
    ServerLine {
        version,
        topology: topology.ok().map(|t| t.to_string()),
        suitable,
        verdict,
    }
}
