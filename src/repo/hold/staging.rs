//! Deciding a staging transaction: checking its participants, and fences.
//!
//! A staging record is committed once every participant it lists is held by its transaction's own
//! apply. Whoever meets it and finds that true writes `committed` (conditional on `staging`), so
//! that later readers need not look again. A participant that is not held may still be on its way:
//! before the deadline nobody may take that for "not committed", because the coordinator returns
//! as soon as its writes are acknowledged and never writes the commit point first. After the
//! deadline, a resolver *fences* each missing participant: it holds the document for the
//! transaction itself with a hold marked `fence` (or, when the document does not exist, inserts a
//! placeholder carrying that hold), so the apply, which needs a free document or a free id, can no
//! longer land. Only then does it write `aborted`. A fence changes no field and reads as the
//! document under it; it goes with the rest of the transaction's holds once it is decided.
//!
//! The coordinator returns committed only when its record and every apply were acknowledged well
//! before the deadline, so a resolver that fences after the deadline always finds every
//! participant in place for such a transaction and commits it: the two never disagree.
//!
//! [`RecordResolver`], the store's standard resolver, answers a reader or a writer this way.

use std::collections::{HashMap, HashSet};

use async_trait::async_trait;
use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use futures::future::join_all;
use futures::TryStreamExt;

use crate::repo::fields;
use crate::repo::hold::held::{self, Hold};
use crate::repo::hold::record::{
    self, decide, load, load_many, participants, status_of, Participant, TxnState,
};
use crate::repo::hold::resolve;
use crate::repo::hold::tombstone;
use crate::repo::ids;
use crate::repo::outcome::{HoldError, TxnStatus};
use crate::repo::store::{HoldResolver, RecordResolver, Store};

/// Where a participant stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Held by the transaction's own apply.
    Applied,
    /// Held by the transaction's fence.
    Fenced,
    /// Free, or absent: the apply could still land.
    Open,
    /// Held by another transaction.
    Other(ObjectId),
    /// Seen held by another transaction once the server's clock had passed the deadline: the
    /// apply never landed and never can.
    Shut,
}

/// What the record of `txn` says, a staging record whose participants are all applied being
/// committed (and written so).
pub(crate) async fn status(store: &Store, txn: ObjectId) -> Result<TxnStatus, HoldError> {
    let Some(found) = load(store, txn).await? else {
        return Ok(TxnStatus::Absent);
    };
    match status_of(&found).map_err(HoldError::new)? {
        TxnStatus::Pending { deadline } => {
            let places = places(store, txn, &participants(&found)?).await?;
            if places.iter().all(|p| *p == Place::Applied) {
                return decide(store, txn, TxnState::Committed, doc! {}).await;
            }
            Ok(TxnStatus::Pending { deadline })
        }
        other => Ok(other),
    }
}

/// What the records of `txns` say, read without writing anything and in a bounded number of
/// commands however many there are: one for the records, then, for the staging ones, one per
/// collection their participants live in (and one more for those that seem incomplete). A
/// staging record whose participants are all applied reads as committed (it is, whether or not
/// anyone has written so); a missing record as [`TxnStatus::Absent`]. Readers use this: they
/// need each holder's outcome, never to decide it.
pub(crate) async fn read_statuses(
    store: &Store,
    txns: &[ObjectId],
) -> Result<HashMap<ObjectId, TxnStatus>, HoldError> {
    let mut statuses: HashMap<ObjectId, TxnStatus> =
        txns.iter().map(|t| (*t, TxnStatus::Absent)).collect();
    if txns.is_empty() {
        return Ok(statuses);
    }
    let found = load_many(store, txns).await?;
    // Staging transactions, and for each collection the (transaction, id) pairs to look at.
    let mut staging: Vec<ObjectId> = Vec::new();
    let mut by_coll: HashMap<String, Vec<(ObjectId, Bson)>> = HashMap::new();
    for record in &found {
        let Ok(txn) = record.get_object_id("_id") else {
            continue;
        };
        let status = status_of(record).map_err(HoldError::new)?;
        if let TxnStatus::Pending { .. } = status {
            staging.push(txn);
            for p in participants(record)? {
                by_coll.entry(p.coll).or_default().push((txn, p.id));
            }
        }
        statuses.insert(txn, status);
    }
    if staging.is_empty() {
        return Ok(statuses);
    }
    let missing: HashSet<ObjectId> = not_applied(store, &by_coll)
        .await?
        .into_iter()
        .map(|(txn, _, _)| txn)
        .collect();
    for txn in &staging {
        if !missing.contains(txn) {
            statuses.insert(*txn, TxnStatus::Committed);
        }
    }
    // A participant found free may have been finished since the record was read: its
    // transaction wrote its commit point first (and ends its record only after every finish), so
    // the record read again tells. One more command, only when a staging transaction seems
    // incomplete.
    let unsure: Vec<ObjectId> = staging
        .into_iter()
        .filter(|t| missing.contains(t))
        .collect();
    if !unsure.is_empty() {
        let again: HashMap<ObjectId, Document> = load_many(store, &unsure)
            .await?
            .into_iter()
            .filter_map(|record| Some((record.get_object_id("_id").ok()?, record)))
            .collect();
        for txn in unsure {
            let status = match again.get(&txn) {
                Some(record) => status_of(record).map_err(HoldError::new)?,
                None => TxnStatus::Absent,
            };
            statuses.insert(txn, status);
        }
    }
    Ok(statuses)
}

/// For each staging record of `found`, the index of its first participant (in lock order) not
/// held by its own apply, or `None` when every one is: read in one command per collection they
/// live in, however many records there are. A transaction whose participants are all applied is
/// committed whoever decides it (a fence needs a free document, and an applied one stays held
/// until its transaction is decided), so a resolver may decide such transactions together.
/// Records that are not staging, or unreadable, are left out.
pub(crate) async fn first_missing(
    store: &Store,
    found: &[&Document],
) -> Result<HashMap<ObjectId, Option<usize>>, HoldError> {
    let mut staging: Vec<(ObjectId, Vec<Participant>)> = Vec::new();
    let mut by_coll: HashMap<String, Vec<(ObjectId, Bson)>> = HashMap::new();
    for record in found {
        let Ok(txn) = record.get_object_id("_id") else {
            continue;
        };
        if !matches!(status_of(record), Ok(TxnStatus::Pending { .. })) {
            continue;
        }
        let Ok(all) = participants(record) else {
            continue;
        };
        for p in &all {
            by_coll
                .entry(p.coll.clone())
                .or_default()
                .push((txn, p.id.clone()));
        }
        staging.push((txn, all));
    }
    let missing = not_applied(store, &by_coll).await?;
    Ok(staging
        .into_iter()
        .map(|(txn, all)| {
            let first = all
                .iter()
                .position(|p| missing.contains(&(txn, p.coll.clone(), ids::key(&p.id))));
            (txn, first)
        })
        .collect())
}

/// The participants in `by_coll` (collection -> (transaction, id)) not held by their own
/// transaction's apply, as (transaction, collection, id key): one command per collection, all at
/// once.
async fn not_applied(
    store: &Store,
    by_coll: &HashMap<String, Vec<(ObjectId, Bson)>>,
) -> Result<HashSet<(ObjectId, String, String)>, HoldError> {
    let looked = join_all(
        by_coll
            .iter()
            .map(|(coll, wanted)| missing_among(store, coll, wanted)),
    )
    .await;
    let mut missing = HashSet::new();
    for found in looked {
        missing.extend(found?);
    }
    Ok(missing)
}

/// Reads the participants `wanted` of collection `coll` in one command and returns those not
/// held by their own transaction's apply, as (transaction, collection, id key).
async fn missing_among(
    store: &Store,
    coll: &str,
    wanted: &[(ObjectId, Bson)],
) -> Result<HashSet<(ObjectId, String, String)>, HoldError> {
    let ids: Vec<Bson> = wanted.iter().map(|(_, id)| id.clone()).collect();
    let held: Vec<Document> = store
        .protocol_collection(coll)
        .await
        .map_err(|e| HoldError::database("reading participants", e))?
        .find(doc! { "_id": { "$in": ids } })
        .projection(place_fields())
        .batch_size(u32::try_from(wanted.len()).unwrap_or(u32::MAX))
        .await
        .map_err(|e| HoldError::database("reading participants", e))?
        .try_collect()
        .await
        .map_err(|e| HoldError::database("reading participants", e))?;
    let applied: HashMap<String, ObjectId> = held
        .iter()
        .filter(|d| !never_commits(d))
        .filter_map(|d| {
            let holder = d.get_object_id(fields::ACTIVE_TXN).ok()?;
            Some((ids::key(d.get("_id")?), holder))
        })
        .collect();
    Ok(wanted
        .iter()
        .map(|(txn, id)| (*txn, ids::key(id)))
        .filter(|(txn, key)| applied.get(key) != Some(txn))
        .map(|(txn, key)| (txn, coll.to_string(), key))
        .collect())
}

/// What a participant is read with to tell where it stands: its holder, and the parts of its
/// hold that say whether it can carry its transaction's change.
fn place_fields() -> Document {
    doc! {
        fields::ACTIVE_TXN: 1,
        held::FENCE: 1,
        "_hold.op": 1,
        "_hold.exp": 1,
        held::AT_PATH: 1,
    }
}

/// Whether the hold on `found` (read with [`place_fields`]) can never carry its transaction's
/// change: a fence, or a creation the server made after the deadline. Either way the
/// transaction is missing that participant for good, whoever looks.
fn never_commits(found: &Document) -> bool {
    held::read_hold(found).is_ok_and(|hold| hold.never_commits())
}

/// Decides the staging transaction `txn` (record `found`) whose deadline has passed: commits it if
/// every participant is applied; otherwise fences every open one and aborts it. A participant held
/// by another transaction leaves it undecided for now. `point(name, step)` is consulted before and
/// after each fence and around the deciding write (the GC's failpoints); `hold_error` maps this
/// module's errors into the caller's.
pub(crate) async fn decide_expired<E>(
    store: &Store,
    txn: ObjectId,
    found: &Document,
    point: &(dyn Fn(&'static str, usize) -> Result<(), E> + Sync),
    hold_error: &(dyn Fn(HoldError) -> E + Sync),
) -> Result<TxnStatus, E> {
    let deadline = match status_of(found).map_err(|e| hold_error(HoldError::new(e)))? {
        TxnStatus::Pending { deadline } => deadline,
        decided => return Ok(decided),
    };
    let all = participants(found).map_err(hold_error)?;
    // One fenced (or shut out) participant is enough: the transaction can then never commit.
    let mut fenced = None;
    let mut shut = false;
    let mut undecidable = false;
    for (step, participant) in all.iter().enumerate() {
        let mut place = place(store, txn, participant).await.map_err(hold_error)?;
        if let Place::Other(_) = place {
            place = shut_out(store, txn, participant, deadline)
                .await
                .map_err(hold_error)?;
        }
        // A fence that lost a race is read again; the document settles within a few tries.
        for _ in 0..4 {
            if place != Place::Open {
                break;
            }
            point(FENCE_BEFORE, step)?;
            let placed = fence(store, txn, participant, deadline)
                .await
                .map_err(hold_error)?;
            point(FENCE_AFTER, step)?;
            place = if placed {
                Place::Fenced
            } else {
                self::place(store, txn, participant)
                    .await
                    .map_err(hold_error)?
            };
        }
        match place {
            Place::Applied => {}
            Place::Fenced => {
                fenced = Some(participant);
                break;
            }
            Place::Shut => {
                shut = true;
                break;
            }
            Place::Open | Place::Other(_) => undecidable = true,
        }
    }
    if undecidable && fenced.is_none() && !shut {
        return Ok(TxnStatus::Pending { deadline });
    }
    let to = if fenced.is_none() && !shut {
        TxnState::Committed
    } else {
        TxnState::Aborted
    };
    point(DECIDE_BEFORE, 0)?;
    // An abort waits for the server's clock to pass the deadline: only then can no late copy of
    // an apply take effect, nor a late copy of the record be created staging.
    let extra = match to {
        TxnState::Aborted => record::past_deadline(),
        _ => doc! {},
    };
    let decided = decide(store, txn, to, extra).await.map_err(hold_error)?;
    point(DECIDE_AFTER, 0)?;
    if matches!(decided, TxnStatus::Committed | TxnStatus::Absent) {
        // Someone committed it before the fences went up and has freed those documents since,
        // or decided and ended it meanwhile (the record is gone): the fence sits on a document
        // its transaction is done with, and must go.
        if let Some(participant) = fenced {
            resolve::roll_back(store, &participant.coll, &participant.id, txn)
                .await
                .map_err(hold_error)?;
        }
    }
    Ok(decided)
}

/// What [`fence_one`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Missing {
    /// Every participant is held by the transaction's apply.
    None,
    /// A participant is fenced: the transaction can never commit.
    Fenced,
    /// A participant was seen held by another transaction after the deadline: the transaction
    /// can never commit, with nothing to undo there.
    Shut,
    /// No participant could be fenced: the missing ones are held by other transactions.
    Held,
}

/// Fences the first participant of `txn` whose apply is not in place (see the module doc).
pub(crate) async fn fence_one(
    store: &Store,
    txn: ObjectId,
    all: &[Participant],
    deadline: DateTime,
) -> Result<Missing, HoldError> {
    let mut held = false;
    for participant in all {
        let mut place = place(store, txn, participant).await?;
        if let Place::Other(_) = place {
            place = shut_out(store, txn, participant, deadline).await?;
        }
        for _ in 0..4 {
            if place != Place::Open {
                break;
            }
            place = if fence(store, txn, participant, deadline).await? {
                Place::Fenced
            } else {
                self::place(store, txn, participant).await?
            };
        }
        match place {
            Place::Applied => {}
            Place::Fenced => return Ok(Missing::Fenced),
            Place::Shut => return Ok(Missing::Shut),
            Place::Open | Place::Other(_) => held = true,
        }
    }
    Ok(if held { Missing::Held } else { Missing::None })
}

/// The failpoint names `decide_expired` hands to its caller.
pub(crate) const FENCE_BEFORE: &str = "fence.before";
/// After a fence.
pub(crate) const FENCE_AFTER: &str = "fence.after";
/// Before the deciding write.
pub(crate) const DECIDE_BEFORE: &str = "decide.before";
/// After the deciding write.
pub(crate) const DECIDE_AFTER: &str = "decide.after";

async fn places(
    store: &Store,
    txn: ObjectId,
    all: &[Participant],
) -> Result<Vec<Place>, HoldError> {
    join_all(all.iter().map(|p| place(store, txn, p)))
        .await
        .into_iter()
        .collect()
}

async fn place(
    store: &Store,
    txn: ObjectId,
    participant: &Participant,
) -> Result<Place, HoldError> {
    let found = store
        .protocol_collection(&participant.coll)
        .await
        .map_err(|e| HoldError::database("reading a participant", e))?
        .find_one(doc! { "_id": participant.id.clone() })
        .projection(place_fields())
        .await
        .map_err(|e| HoldError::database("reading a participant", e))?;
    let Some(found) = found else {
        return Ok(Place::Open);
    };
    Ok(match found.get(fields::ACTIVE_TXN) {
        Some(Bson::ObjectId(holder)) if *holder == txn => {
            // A creation stamped too late stops the transaction as a fence does.
            if never_commits(&found) {
                Place::Fenced
            } else {
                Place::Applied
            }
        }
        Some(Bson::ObjectId(holder)) => Place::Other(*holder),
        _ => Place::Open,
    })
}

/// Looks again at a participant held by another transaction, this time only if the server's clock
/// is past `deadline`: [`Place::Shut`] if it is (still) held by another then. The apply of `txn`
/// had not landed by that moment (the document would be `txn`'s until `txn` is decided), and it
/// cannot land after it: changes are conditional on the clock being at or before the deadline,
/// and a creation after it counts for nothing. Without this, two expired transactions each
/// holding what the other misses would wait on each other for ever.
async fn shut_out(
    store: &Store,
    txn: ObjectId,
    participant: &Participant,
    deadline: DateTime,
) -> Result<Place, HoldError> {
    let found = store
        .protocol_collection(&participant.coll)
        .await
        .map_err(|e| HoldError::database("reading a participant", e))?
        .find_one(doc! {
            "_id": participant.id.clone(),
            fields::ACTIVE_TXN: { "$exists": true, "$ne": txn },
            "$expr": { "$gt": ["$$NOW", deadline] },
        })
        .projection(doc! { fields::ACTIVE_TXN: 1 })
        .await
        .map_err(|e| HoldError::database("reading a participant", e))?;
    if found.is_some() {
        return Ok(Place::Shut);
    }
    place(store, txn, participant).await
}

/// Puts `txn`'s fence on `participant`: a fence hold on the document if it exists and is free,
/// a placeholder if it does not exist. Returns whether a fence was put.
pub(crate) async fn fence(
    store: &Store,
    txn: ObjectId,
    participant: &Participant,
    deadline: DateTime,
) -> Result<bool, HoldError> {
    let coll = store
        .protocol_collection(&participant.coll)
        .await
        .map_err(|e| HoldError::database("fencing a participant", e))?;
    let held = coll
        .update_one(
            doc! { "_id": participant.id.clone(), fields::ACTIVE_TXN: null },
            doc! { "$set": {
                fields::ACTIVE_TXN: txn,
                fields::HOLD: Hold::fence(deadline, false).to_document(),
            } },
        )
        .await
        .map_err(|e| HoldError::database("fencing a participant", e))?;
    if held.matched_count == 1 {
        tracing::debug!(collection = %participant.coll, txn = %txn, "fenced a participant");
        return Ok(true);
    }
    let placed = tombstone::write_placeholder(
        store,
        &coll,
        &participant.id,
        participant.schema,
        txn,
        Hold::fence(deadline, true).to_document(),
    )
    .await
    .map_err(|e| HoldError::database("fencing an absent participant", e))?;
    if placed {
        tracing::debug!(collection = %participant.coll, txn = %txn, "fenced an absent participant");
    }
    Ok(placed)
}

#[async_trait]
impl HoldResolver for RecordResolver {
    async fn status(&self, store: &Store, txn: ObjectId) -> Result<TxnStatus, HoldError> {
        self::status(store, txn).await
    }

    async fn statuses(
        &self,
        store: &Store,
        txns: &[ObjectId],
    ) -> Result<HashMap<ObjectId, TxnStatus>, HoldError> {
        read_statuses(store, txns).await
    }

    async fn abort_expired(
        &self,
        store: &Store,
        txn: ObjectId,
        now: DateTime,
    ) -> Result<TxnStatus, HoldError> {
        let Some(record) = load(store, txn).await? else {
            return Ok(TxnStatus::Absent);
        };
        match status_of(&record).map_err(HoldError::new)? {
            TxnStatus::Pending { deadline } if deadline <= now => {
                decide_expired(store, txn, &record, &|_, _| Ok(()), &|e| e).await
            }
            other => Ok(other),
        }
    }
}
