//! Where each document of a transaction stands, read from the documents themselves: one query
//! per collection for a worklist, one per managed collection for the holds of a transaction
//! without a record. Nothing here writes.

use std::collections::HashMap;

use bson::{doc, oid::ObjectId, Bson, Document};
use futures::future::join_all;
use futures::TryStreamExt;

use crate::repo::fields::{self, SystemFields};
use crate::repo::hold::held;
use crate::repo::hold::record::TxnState;
use crate::repo::ids;
use crate::repo::meta;
use crate::txn::error::TxnError;
use crate::txn::inspect::model::{DocState, DocumentState};
use crate::txn::recovery::Env;
use crate::txn::worklist::{Entry, Op};

/// The most held documents listed per collection for a transaction without a record (a
/// worklist is bounded by the record's size; these are not, in principle).
const HELD_LISTED: i64 = 1_000;

/// Where each entry of transaction `txn` (its record in `state`) stands, in the worklist's order.
pub(crate) async fn entry_states(
    env: &Env,
    txn: ObjectId,
    state: TxnState,
    entries: &[Entry],
) -> Result<Vec<DocumentState>, TxnError> {
    let stored = read(env, txn, entries.iter().map(|e| (e.coll.as_str(), &e.id))).await?;
    Ok(entries
        .iter()
        .map(|entry| {
            let found = stored.get(&(entry.coll.clone(), ids::key(&entry.id)));
            DocumentState::of_entry(entry, state_of(txn, Some((state, entry)), found))
        })
        .collect())
}

/// `docs` (documents of transaction `txn` no worklist lists) read again: where each stands now.
pub(crate) async fn restate(
    env: &Env,
    txn: ObjectId,
    docs: Vec<DocumentState>,
) -> Result<Vec<DocumentState>, TxnError> {
    let stored = read(
        env,
        txn,
        docs.iter().map(|d| (d.collection.as_str(), &d.id)),
    )
    .await?;
    Ok(docs
        .into_iter()
        .map(|mut doc| {
            let found = stored.get(&(doc.collection.clone(), ids::key(&doc.id)));
            doc.state = state_of(txn, None, found);
            doc
        })
        .collect())
}

/// The stored documents of `wanted` (collection, id) that exist, keyed by collection and id key:
/// one query per collection, all at once.
async fn read<'a>(
    env: &Env,
    txn: ObjectId,
    wanted: impl Iterator<Item = (&'a str, &'a Bson)>,
) -> Result<HashMap<(String, String), Document>, TxnError> {
    let mut by_coll: HashMap<&str, Vec<Bson>> = HashMap::new();
    for (coll, id) in wanted {
        by_coll.entry(coll).or_default().push(id.clone());
    }
    let read = join_all(by_coll.into_iter().map(|(coll, ids)| async move {
        let found = find(env, txn, coll, doc! { "_id": { "$in": ids } }, None).await?;
        Ok::<_, TxnError>((coll.to_string(), found))
    }))
    .await;
    let mut stored = HashMap::new();
    for found in read {
        let (coll, docs) = found?;
        for doc in docs {
            if let Some(key) = doc.get("_id").map(ids::key) {
                stored.insert((coll.clone(), key), doc);
            }
        }
    }
    Ok(stored)
}

/// The documents of every managed collection that transaction `txn` holds (at most
/// [`HELD_LISTED`] per collection): what is left of a transaction without a record.
pub(crate) async fn held_by(env: &Env, txn: ObjectId) -> Result<Vec<DocumentState>, TxnError> {
    let collections = meta::managed(env.store.database())
        .await
        .map_err(|e| TxnError::database(Some(txn), "list managed collections", e))?;
    let read = join_all(collections.iter().map(|coll| async move {
        let found = find(
            env,
            txn,
            coll,
            doc! { fields::ACTIVE_TXN: txn },
            Some(HELD_LISTED),
        )
        .await?;
        Ok::<_, TxnError>(
            found
                .iter()
                .map(|d| DocumentState {
                    collection: coll.clone(),
                    id: d.get("_id").cloned().unwrap_or(Bson::Null),
                    op: held::read_hold(d).map_or("held", |hold| hold.op.as_str()),
                    expected: None,
                    applied: None,
                    state: state_of(txn, None, Some(d)),
                })
                .collect::<Vec<_>>(),
        )
    }))
    .await;
    let mut all = Vec::new();
    for found in read {
        all.extend(found?);
    }
    Ok(all)
}

/// The documents of `coll` matching `filter` (whole: a plain document's version is the
/// fingerprint of all of it), in `_id` order.
async fn find(
    env: &Env,
    txn: ObjectId,
    coll: &str,
    filter: Document,
    limit: Option<i64>,
) -> Result<Vec<Document>, TxnError> {
    let fail = |e| TxnError::database(Some(txn), "read the transaction's documents", e);
    let coll = env.collection(Some(txn), coll).await?;
    let mut found = coll.find(filter).sort(doc! { "_id": 1 });
    if let Some(limit) = limit {
        found = found.limit(limit);
    }
    found.await.map_err(fail)?.try_collect().await.map_err(fail)
}

/// Where the stored document `found` (`None`: there is none) stands for transaction `txn`,
/// whose record (in that state) lists it as `entry` (`None`: no record lists it). A free
/// document counts as finished only for a committed transaction: a version alone cannot tell
/// the transaction's change from someone else's later one.
pub(crate) fn state_of(
    txn: ObjectId,
    entry: Option<(TxnState, &Entry)>,
    found: Option<&Document>,
) -> DocState {
    let Some(found) = found else {
        return DocState::Missing;
    };
    let Ok(sys) = SystemFields::read(found) else {
        return DocState::Unreadable;
    };
    match sys.active_txn {
        Some(holder) if holder == txn => match held::read_hold(found) {
            Ok(hold) if hold.fence => DocState::Fenced,
            Ok(hold) if hold.created_late() => DocState::CreatedLate,
            _ => DocState::Held {
                version: sys.version,
            },
        },
        Some(other) => DocState::HeldByOther { txn: other },
        None => {
            let version = sys.version;
            let committed = |state| state == TxnState::Committed;
            match entry {
                Some((s, e)) if sys.is_deleted() && e.op == Op::Delete && committed(s) => {
                    DocState::Finished { version }
                }
                _ if sys.is_deleted() => DocState::Deleted { version },
                None => DocState::Free { version },
                Some((_, e)) if version == e.expected => DocState::AsRead { version },
                Some((s, e)) if version == e.applied && committed(s) => {
                    DocState::Finished { version }
                }
                Some(_) => DocState::Changed { version },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repo::hold::held::{Hold, HoldKind};
    use bson::DateTime;

    fn entry(op: Op, expected: i64, applied: i64) -> Entry {
        Entry {
            coll: "a".into(),
            id: Bson::from("x"),
            expected,
            applied,
            schema: 1,
            op,
        }
    }

    fn stored(version: i64, holder: Option<(ObjectId, Hold)>, deleted: bool) -> Document {
        let mut d = doc! { "_id": "x", "_schema": 1_i64, "_version": version, "n": 1 };
        if let Some((t, hold)) = holder {
            d.insert(fields::ACTIVE_TXN, t);
            d.insert(fields::HOLD, hold.to_document());
        }
        if deleted {
            d.insert(fields::DELETED, DateTime::from_millis(1));
        }
        d
    }

    fn hold(op: HoldKind) -> Hold {
        Hold {
            exp: DateTime::from_millis(10),
            op,
            restore: Document::new(),
            unset: Vec::new(),
            fence: false,
            at: None,
            order: Vec::new(),
        }
    }

    #[test]
    fn a_document_stands_where_its_hold_and_version_say() {
        let t = ObjectId::new();
        let other = ObjectId::new();
        let update = entry(
            Op::Update {
                set: Vec::new(),
                unset: Vec::new(),
                undo: Default::default(),
            },
            3,
            4,
        );
        let held = stored(4, Some((t, hold(HoldKind::Update))), false);
        let state =
            |found: &Document| state_of(t, Some((TxnState::Committed, &update)), Some(found));
        assert_eq!(state(&held), DocState::Held { version: 4 });
        let fenced = stored(
            3,
            Some((t, Hold::fence(DateTime::from_millis(10), false))),
            false,
        );
        assert_eq!(state(&fenced), DocState::Fenced);
        let mut late = hold(HoldKind::Insert);
        late.at = Some(DateTime::from_millis(11));
        assert_eq!(
            state(&stored(1, Some((t, late)), false)),
            DocState::CreatedLate
        );
        let theirs = stored(3, Some((other, hold(HoldKind::Check))), false);
        assert_eq!(state(&theirs), DocState::HeldByOther { txn: other });
        assert_eq!(
            state(&stored(4, None, false)),
            DocState::Finished { version: 4 }
        );
        assert_eq!(
            state(&stored(3, None, false)),
            DocState::AsRead { version: 3 }
        );
        assert_eq!(
            state(&stored(9, None, false)),
            DocState::Changed { version: 9 }
        );
        assert_eq!(
            state(&stored(9, None, true)),
            DocState::Deleted { version: 9 }
        );
        assert_eq!(
            state_of(
                t,
                Some((TxnState::Staging, &update)),
                Some(&stored(4, None, false))
            ),
            DocState::Changed { version: 4 },
            "free at the change's version before any commit: someone else's change"
        );
        assert_eq!(
            state_of(t, Some((TxnState::Committed, &update)), None),
            DocState::Missing
        );
        let delete = entry(Op::Delete, 3, 4);
        assert_eq!(
            state_of(
                t,
                Some((TxnState::Committed, &delete)),
                Some(&stored(4, None, true))
            ),
            DocState::Finished { version: 4 }
        );
        assert_eq!(
            state_of(t, None, Some(&stored(3, None, false))),
            DocState::Free { version: 3 }
        );
        let unreadable = doc! { "_id": "x", "_version": "four" };
        assert_eq!(state(&unreadable), DocState::Unreadable);
    }
}
