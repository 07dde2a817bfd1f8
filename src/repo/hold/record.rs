//! The ActiveTransaction record as the hold protocol reads and writes it: the stored names of the
//! fields a resolver reads, the record's state and the participants it lists, and the conditional
//! writes that decide it (leaving `staging`) or put an `aborted` record in a missing one's place.
//! Whether a staging record's participants are in place is `staging`'s question.

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use futures::TryStreamExt;
use mongodb::Collection;
use serde::{Deserialize, Serialize};

use crate::repo::format;
use crate::repo::outcome::{HoldError, TxnStatus};
use crate::repo::store::Store;

/// Stored name of the record's state: `staging`, `committed` or `aborted`.
pub(crate) const STATE: &str = "state";
/// Stored name of the participants, in lock order (the transaction layer's entries).
pub(crate) const ENTRIES: &str = "entries";
/// Stored name of the deadline, in server time.
pub(crate) const DEADLINE: &str = "deadline";

/// Where a transaction is in its life, as its record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum TxnState {
    /// Written together with its changes. It is committed once the record and every participant's
    /// change are in place (an implicit commit), whether or not anyone has said so yet; anyone who
    /// meets it decides it by checking the participants (see `repo::hold::staging`).
    Staging,
    /// Explicitly committed: its changes are the committed state.
    Committed,
    /// Decided not to commit: its changes are to be undone.
    Aborted,
}

impl TxnState {
    /// The value stored in the record's `state` field.
    pub fn as_str(self) -> &'static str {
        match self {
            TxnState::Staging => "staging",
            TxnState::Committed => "committed",
            TxnState::Aborted => "aborted",
        }
    }
}

/// Moves transaction `txn` out of the staging state to `to`, conditionally on its record still
/// being staging (and on `extra`): the one kind of write that decides a transaction's outcome, so
/// the explicit commit and every abort race on the same condition and exactly one wins. Returns
/// whether this write was the one.
///
/// A record of a format newer than `reads` (the newest format the caller reads) is not matched:
/// the caller's next read of it refuses it.
pub(crate) async fn leave_staging(
    records: &Collection<Document>,
    txn: ObjectId,
    to: TxnState,
    extra: Document,
    reads: i64,
) -> mongodb::error::Result<bool> {
    let mut filter = doc! { "_id": txn, STATE: TxnState::Staging.as_str() };
    filter.extend(extra);
    filter.extend(format::readable(reads));
    let result = records
        .update_one(filter, doc! { "$set": { STATE: to.as_str() } })
        .await?;
    Ok(result.matched_count == 1)
}

/// The condition, added to a record's filter, that the records' own clock has passed its
/// deadline: what an abort waits for (no late copy of an apply or of the record can land after).
pub(crate) fn past_deadline() -> Document {
    doc! { "$expr": { "$gt": ["$$NOW", format!("${DEADLINE}")] } }
}

/// Reads the status of a stored record (a staging record reads as undecided; whether its
/// participants are in place is `staging`'s question).
pub(crate) fn status_of(found: &Document) -> Result<TxnStatus, String> {
    let state = found
        .get(STATE)
        .cloned()
        .map(bson::from_bson::<TxnState>)
        .transpose()
        .map_err(|e| format!("the transaction record's state cannot be read: {e}"))?;
    Ok(match state {
        Some(TxnState::Committed) => TxnStatus::Committed,
        Some(TxnState::Aborted) => TxnStatus::Aborted,
        Some(TxnState::Staging) => TxnStatus::Pending {
            deadline: *found
                .get_datetime(DEADLINE)
                .map_err(|_| "the staging transaction record has no deadline".to_string())?,
        },
        None => return Err("the transaction record has no state".to_string()),
    })
}

/// One document a transaction changes, as its record lists it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Participant {
    /// Collection name.
    pub(crate) coll: String,
    /// Document id.
    pub(crate) id: Bson,
    /// The collection's schema version (stamped on a placeholder).
    pub(crate) schema: i64,
}

/// The participants a record lists.
pub(crate) fn participants(found: &Document) -> Result<Vec<Participant>, HoldError> {
    let entries = found
        .get_array(ENTRIES)
        .map_err(|_| HoldError::new("the transaction record lists no participants"))?;
    entries
        .iter()
        .map(|entry| {
            let entry = entry
                .as_document()
                .ok_or_else(|| HoldError::new("a participant of the record is not a document"))?;
            let coll = entry
                .get_str("coll")
                .map_err(|_| HoldError::new("a participant of the record names no collection"))?;
            let id = entry
                .get("id")
                .ok_or_else(|| HoldError::new("a participant of the record has no id"))?;
            let schema = match entry.get("schema") {
                Some(Bson::Int64(n)) => *n,
                Some(Bson::Int32(n)) => i64::from(*n),
                _ => 1,
            };
            Ok(Participant {
                coll: coll.to_string(),
                id: id.clone(),
                schema,
            })
        })
        .collect()
}

/// The records collection with the protocol's concerns.
pub(crate) async fn records(store: &Store) -> Result<Collection<Document>, HoldError> {
    store
        .protocol_collection(store.transactions_collection())
        .await
        .map_err(|e| HoldError::database("opening the transaction records", e))
}

/// The ids of `collection` that the transactions with a record (any state) insert. A purge of
/// tombstones leaves these: a copy of such a transaction's create may still be on its way, and
/// while its record is there, a copy arriving in time would be counted (see `Store::purge_tombstones`).
/// Records live only while their transactions are in flight, so this reads a handful.
pub(crate) async fn inserted_ids(
    store: &Store,
    collection: &str,
) -> mongodb::error::Result<Vec<Bson>> {
    let inserting = doc! { "coll": collection, "op.kind": "insert" };
    let found: Vec<Document> = store
        .protocol_collection(store.transactions_collection())
        .await?
        .find(doc! { "entries": { "$elemMatch": inserting } })
        .projection(doc! { "entries.coll": 1, "entries.id": 1, "entries.op.kind": 1 })
        .await?
        .try_collect()
        .await?;
    Ok(found
        .iter()
        .filter_map(|record| record.get_array("entries").ok())
        .flatten()
        .filter_map(Bson::as_document)
        .filter(|entry| {
            entry.get_str("coll").ok() == Some(collection)
                && entry
                    .get_document("op")
                    .is_ok_and(|op| op.get_str("kind").ok() == Some("insert"))
        })
        .filter_map(|entry| entry.get("id").cloned())
        .collect())
}

/// Reads the record of `txn`; refused when it is of a format this store does not read.
pub(crate) async fn load(store: &Store, txn: ObjectId) -> Result<Option<Document>, HoldError> {
    let records = records(store).await?;
    let found = records
        .find_one(doc! { "_id": txn })
        .await
        .map_err(|e| HoldError::database("reading the transaction record", e))?;
    if let Some(found) = &found {
        readable(store, records.name(), found)?;
    }
    Ok(found)
}

/// Refuses a record of a format newer than `store` reads.
pub(crate) fn readable(store: &Store, records: &str, found: &Document) -> Result<(), HoldError> {
    format::check_doc(found, store.reads_format(), records).map_err(HoldError::format)
}

/// Reads the records of `txns` (those that exist) in one command.
pub(crate) async fn load_many(
    store: &Store,
    txns: &[ObjectId],
) -> Result<Vec<Document>, HoldError> {
    find_many(store, txns, None).await
}

/// Reads what [`status_of`] needs of the records of `txns` (those that exist) in one command:
/// their state and deadline, not their entries, which are most of a page's bytes.
pub(crate) async fn load_states(
    store: &Store,
    txns: &[ObjectId],
) -> Result<Vec<Document>, HoldError> {
    find_many(
        store,
        txns,
        Some(doc! { STATE: 1, DEADLINE: 1, format::FIELD: 1 }),
    )
    .await
}

async fn find_many(
    store: &Store,
    txns: &[ObjectId],
    projection: Option<Document>,
) -> Result<Vec<Document>, HoldError> {
    let fail = |e| HoldError::database("reading transaction records", e);
    let records = records(store).await?;
    let found: Vec<Document> = records
        .find(doc! { "_id": { "$in": txns.to_vec() } })
        .with_options(
            mongodb::options::FindOptions::builder()
                .projection(projection)
                .batch_size(u32::try_from(txns.len()).unwrap_or(u32::MAX))
                .build(),
        )
        .await
        .map_err(fail)?
        .try_collect()
        .await
        .map_err(fail)?;
    for record in &found {
        readable(store, records.name(), record)?;
    }
    Ok(found)
}

/// The time on the records' collection's own clock (its `$$NOW`), read through the first record
/// matching `filter`; `None` when none matches. That clock guards a record's creation, its abort
/// and its deletion, so it is the one that says whether a record's deadline has passed: on a
/// sharded cluster whose records' shard runs ahead of the clock `hello` reports, a record expires
/// by it before `hello`'s clock reaches the deadline.
pub(crate) async fn clock(
    records: &Collection<Document>,
    filter: Document,
) -> mongodb::error::Result<Option<DateTime>> {
    let first = records
        .aggregate(vec![
            doc! { "$match": filter },
            doc! { "$limit": 1 },
            doc! { "$project": { "_id": 0, "now": "$$NOW" } },
        ])
        .await?
        .try_next()
        .await?;
    Ok(first.and_then(|found| found.get_datetime("now").ok().copied()))
}

/// Writes the outcome `to` of staging transaction `txn` (if it is still staging) and returns the
/// status the record has afterwards, whoever decided it.
pub(crate) async fn decide(
    store: &Store,
    txn: ObjectId,
    to: TxnState,
    extra: Document,
) -> Result<TxnStatus, HoldError> {
    let records = records(store).await?;
    leave_staging(&records, txn, to, extra, store.reads_format())
        .await
        .map_err(|e| HoldError::database("deciding the transaction", e))?;
    match load(store, txn).await? {
        None => Ok(TxnStatus::Absent),
        Some(found) => status_of(&found).map_err(HoldError::new),
    }
}

/// Decides the staging transactions `txns` all as `to` in one write (each only if still staging,
/// and on `extra`),
/// then reads what their records say in one more command: a transaction without a record reads as
/// [`TxnStatus::Absent`]. For a resolver with a page of expired transactions whose outcome it has
/// settled (every participant applied, or one fenced).
pub(crate) async fn decide_many(
    store: &Store,
    txns: &[ObjectId],
    to: TxnState,
    extra: Document,
) -> Result<std::collections::HashMap<ObjectId, TxnStatus>, HoldError> {
    let mut statuses: std::collections::HashMap<ObjectId, TxnStatus> =
        txns.iter().map(|t| (*t, TxnStatus::Absent)).collect();
    if txns.is_empty() {
        return Ok(statuses);
    }
    records(store)
        .await?
        .update_many(
            {
                let mut filter =
                    doc! { "_id": { "$in": txns.to_vec() }, STATE: TxnState::Staging.as_str() };
                filter.extend(extra);
                filter.extend(format::readable(store.reads_format()));
                filter
            },
            doc! { "$set": { STATE: to.as_str() } },
        )
        .await
        .map_err(|e| HoldError::database("deciding transactions", e))?;
    let found = load_states(store, txns).await?;
    for found in found {
        if let Ok(txn) = found.get_object_id("_id") {
            statuses.insert(txn, status_of(&found).map_err(HoldError::new)?);
        }
    }
    Ok(statuses)
}

/// For many transactions found without a record at once: writes an `aborted` record (deadline
/// from `missing`, created at `now`, no participants) for each, in one command, and returns those
/// this call wrote. One whose record exists by now (a late copy arrived, or another resolver wrote
/// one) is left out, for the caller to read; see [`fence_record`].
pub(crate) async fn fence_records(
    store: &Store,
    missing: &[(ObjectId, DateTime)],
    now: DateTime,
) -> Result<std::collections::HashSet<ObjectId>, HoldError> {
    let mut written: std::collections::HashSet<ObjectId> =
        missing.iter().map(|(txn, _)| *txn).collect();
    if missing.is_empty() {
        return Ok(written);
    }
    let writes = store.writes_format().await.map_err(HoldError::format)?;
    let aborted: Vec<Document> = missing
        .iter()
        .map(|(txn, deadline)| {
            doc! {
                "_id": txn,
                STATE: TxnState::Aborted.as_str(),
                "created": now,
                DEADLINE: deadline,
                ENTRIES: [],
                format::FIELD: writes,
            }
        })
        .collect();
    match records(store)
        .await?
        .insert_many(aborted)
        .ordered(false)
        .await
    {
        Ok(_) => Ok(written),
        Err(e) => match *e.kind {
            mongodb::error::ErrorKind::InsertMany(mongodb::error::InsertManyError {
                write_errors: Some(ref failed),
                write_concern_error: None,
                ..
            }) => {
                for failure in failed {
                    if let Some((txn, _)) = missing.get(failure.index) {
                        written.remove(txn);
                    }
                }
                Ok(written)
            }
            _ => Err(HoldError::database(
                "writing aborted records in place of missing ones",
                e,
            )),
        },
    }
}

/// Makes sure transaction `txn` has a record, writing an `aborted` one (deadline `deadline`,
/// no participants) if it has none, so that no copy of its record still on its way can arrive as
/// `staging`; then returns what the record says.
pub(crate) async fn fence_record(
    store: &Store,
    txn: ObjectId,
    deadline: DateTime,
) -> Result<TxnStatus, HoldError> {
    let records = records(store).await?;
    let writes = store.writes_format().await.map_err(HoldError::format)?;
    let keep_or = |field: &str, value: Bson| doc! { "$ifNull": [format!("${field}"), value] };
    let update = vec![doc! { "$addFields": {
        format::FIELD: keep_or(format::FIELD, writes.into()),
        STATE: keep_or(STATE, TxnState::Aborted.as_str().into()),
        "created": keep_or("created", "$$NOW".into()),
        DEADLINE: keep_or(DEADLINE, deadline.into()),
        ENTRIES: keep_or(ENTRIES, doc! { "$literal": [] }.into()),
    } }];
    records
        .update_one(doc! { "_id": txn }, update)
        .upsert(true)
        .await
        .map_err(|e| {
            HoldError::database("writing an aborted record in place of a missing one", e)
        })?;
    match load(store, txn).await? {
        None => Ok(TxnStatus::Absent),
        Some(found) => status_of(&found).map_err(HoldError::new),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_list_their_participants() {
        let found = doc! {
            "_id": ObjectId::new(),
            "state": "staging",
            "entries": [
                { "coll": "a", "id": "x", "schema": 2_i64, "op": { "kind": "check" } },
                { "coll": "b", "id": 7, "op": { "kind": "delete" } },
            ],
        };
        assert_eq!(
            participants(&found).expect("participants"),
            vec![
                Participant {
                    coll: "a".into(),
                    id: Bson::from("x"),
                    schema: 2
                },
                Participant {
                    coll: "b".into(),
                    id: Bson::Int32(7),
                    schema: 1
                },
            ]
        );
        assert!(participants(&doc! { "state": "staging" }).is_err());
        assert!(participants(&doc! { "entries": [{ "id": 1 }] }).is_err());
    }

    #[test]
    fn record_states_read_as_statuses() {
        let d = DateTime::from_millis(9);
        assert_eq!(
            status_of(&doc! { "state": "staging", "deadline": d }),
            Ok(TxnStatus::Pending { deadline: d })
        );
        assert_eq!(
            status_of(&doc! { "state": "committed" }),
            Ok(TxnStatus::Committed)
        );
        assert_eq!(
            status_of(&doc! { "state": "aborted" }),
            Ok(TxnStatus::Aborted)
        );
        assert!(status_of(&doc! { "state": "staging" }).is_err());
        assert!(status_of(&doc! { "state": "pending", "deadline": d }).is_err());
        assert!(status_of(&doc! { "state": "weird" }).is_err());
    }
}
