//! Holds: a document held by a transaction describes itself, so that any reader, writer or GC can
//! resolve it without the transaction's coordinator and without its ActiveTransaction record.
//!
//! # What a held document carries
//!
//! Besides the transaction's change itself (the post-image is stored in the document's own fields,
//! so unique indexes judge it while it is still undecided), a held document has:
//!
//! - `_txn`: the transaction id;
//! - `_hold.exp`: the transaction's deadline, in the server's time;
//! - `_hold.op`: `insert`, `update` (also adjust and whole-document rewrites), `delete` or `check`;
//! - `_hold.restore` and `_hold.unset`: the undo. Setting the `restore` fields (the original
//!   top-level values, `_version` and, for rewrites, `_schema`) and removing the `unset` fields
//!   (those that did not exist before, plus `_txn`, `_hold` and `_deleting`) gives back exactly the
//!   document as it was before the transaction. An insert's undo is removing the document.
//!
//! # Who decides
//!
//! A transaction's outcome is whatever its record (the ActiveTransaction document) says first:
//! `committed` (the coordinator's commit point) or `aborted` (the coordinator giving up, or anyone
//! who finds it pending past its deadline). Both are writes conditional on the record still being
//! `pending`, so exactly one wins. The record is written before any document is held and deleted
//! only after every hold it knows of is resolved, so a hold whose record is absent belongs to a
//! transaction that has ended, and can only be one that did not commit: either it was rolled back,
//! or the hold was put there by one of its writes that the server executed after its sender had
//! given up (a late delivery). **An absent record means "not committed"**, and the hold is undone.
//!
//! # What readers see
//!
//! The committed value: for a holder that is pending, aborted or gone, the undo applied to the
//! stored document (an insert reads as absent); for a committed holder, the stored document (a
//! delete reads as deleted). Queries evaluate filter, sort and limit on the same committed values
//! (see `query`).
//!
//! # Why every resolution step is safe to repeat, race or arrive late
//!
//! Undo and finish writes are conditional on `_txn` still naming the transaction. While a
//! transaction holds a document nobody else may change it, so the undo restores exactly what was
//! there; after the hold is gone the same write matches nothing. A late duplicate of an apply can
//! only match the document at the version the transaction read, i.e. before its own change: it
//! puts the same hold back, which resolves the same way again.

use async_trait::async_trait;
use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use mongodb::Collection;
use serde::{Deserialize, Serialize};

use crate::repo::fields;
use crate::repo::store::Store;
use crate::repo::write::Write;

/// What a hold stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum HoldKind {
    /// The document did not exist before the transaction.
    Insert,
    /// Fields changed (update, adjust, or a rewrite into the current schema version).
    Update,
    /// The document is to become a tombstone; `_deleting` is set meanwhile.
    Delete,
    /// Unchanged, held so that its version cannot move until the transaction ends.
    Check,
}

/// The `_hold` field of a held document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Hold {
    /// The holder's deadline, in server time.
    pub(crate) exp: DateTime,
    /// What the hold stands for.
    pub(crate) op: HoldKind,
    /// Top-level fields (system fields included) to set back to undo the change.
    #[serde(default)]
    pub(crate) restore: Document,
    /// Top-level fields to remove to undo the change (besides `_txn`, `_hold`, `_deleting`).
    #[serde(default)]
    pub(crate) unset: Vec<String>,
}

/// Fields every undo removes: the hold itself and a pending delete's flag.
pub(crate) const ALWAYS_UNSET: [&str; 3] = [fields::ACTIVE_TXN, fields::HOLD, fields::DELETING];

impl HoldKind {
    /// The value stored in `_hold.op`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            HoldKind::Insert => "insert",
            HoldKind::Update => "update",
            HoldKind::Delete => "delete",
            HoldKind::Check => "check",
        }
    }
}

impl Hold {
    /// The stored form of the hold (what serde would write, built without a fallible encoder).
    pub(crate) fn to_document(&self) -> Document {
        doc! {
            "exp": self.exp,
            "op": self.op.as_str(),
            "restore": self.restore.clone(),
            "unset": self.unset.clone(),
        }
    }

    /// The document as it was before the transaction (`None`: it did not exist).
    pub(crate) fn pre_image(&self, stored: &Document) -> Option<Document> {
        if self.op == HoldKind::Insert {
            return None;
        }
        let mut pre = stored.clone();
        for (name, value) in &self.restore {
            pre.insert(name.clone(), value.clone());
        }
        for name in self.unset.iter().map(String::as_str).chain(ALWAYS_UNSET) {
            pre.remove(name);
        }
        Some(pre)
    }

    /// The write that undoes the change on document `id` held by `txn`.
    pub(crate) fn undo(&self, id: &Bson, txn: ObjectId) -> Write {
        let held = held_by(id, txn);
        if self.op == HoldKind::Insert {
            return Write::Delete(held);
        }
        let unset: Document = self
            .unset
            .iter()
            .map(String::as_str)
            .chain(ALWAYS_UNSET)
            .map(|name| (name.to_string(), Bson::String(String::new())))
            .collect();
        let mut update = doc! { "$unset": unset };
        if !self.restore.is_empty() {
            update.insert("$set", self.restore.clone());
        }
        Write::Update(held, update)
    }
}

/// The filter matching document `id` while `txn` holds it.
pub(crate) fn held_by(id: &Bson, txn: ObjectId) -> Document {
    doc! { "_id": id.clone(), fields::ACTIVE_TXN: txn }
}

/// The write that makes a committed change (other than a delete, which becomes a tombstone) final
/// on document `id` held by `txn`: the hold is dropped.
pub(crate) fn finish(id: &Bson, txn: ObjectId) -> Write {
    Write::Update(
        held_by(id, txn),
        doc! { "$unset": { fields::ACTIVE_TXN: "", fields::HOLD: "" } },
    )
}

/// Where a transaction is in its life, as its record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TxnState {
    /// Written; its changes may be in flight and are not visible.
    Pending,
    /// Past the commit point: its changes are the committed state.
    Committed,
    /// Decided not to commit: its changes are to be undone.
    Aborted,
}

impl TxnState {
    /// The value stored in the record's `state` field.
    pub fn as_str(self) -> &'static str {
        match self {
            TxnState::Pending => "pending",
            TxnState::Committed => "committed",
            TxnState::Aborted => "aborted",
        }
    }
}

/// Stored names of the record fields a hold's resolver reads.
pub(crate) mod record {
    /// `pending`, `committed` or `aborted`.
    pub(crate) const STATE: &str = "state";
    /// The deadline, in server time.
    pub(crate) const DEADLINE: &str = "deadline";
}

/// What a transaction's record says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnStatus {
    /// Still undecided; anyone may abort it once `deadline` (server time) has passed.
    Pending {
        /// The deadline.
        deadline: DateTime,
    },
    /// Committed.
    Committed,
    /// Aborted.
    Aborted,
    /// No record: the transaction ended, and any hold left of it did not commit.
    Absent,
}

/// Why a hold could not be resolved: one clean sentence, the driver error as its source.
#[derive(Debug, thiserror::Error)]
#[error("{reason}")]
pub struct HoldError {
    reason: String,
    #[source]
    source: Option<Box<mongodb::error::Error>>,
}

impl HoldError {
    /// An error described by `reason` alone.
    pub fn new(reason: impl Into<String>) -> HoldError {
        HoldError {
            reason: reason.into(),
            source: None,
        }
    }

    /// A driver failure while doing `what`.
    pub fn database(what: &str, source: mongodb::error::Error) -> HoldError {
        HoldError {
            reason: format!("{what} failed: {}", crate::server::summarize(&source)),
            source: Some(Box::new(source)),
        }
    }

    /// Whether trying again may succeed.
    pub fn is_retryable(&self) -> bool {
        self.source
            .as_deref()
            .is_some_and(crate::server::is_transient)
    }
}

/// Reads and decides transaction outcomes for holds; the seam between the repository layer and
/// the transaction layer (whose records these are). [`RecordResolver`] is the standard one.
#[async_trait]
pub trait HoldResolver: Send + Sync + 'static {
    /// What the record of `txn` says now.
    async fn status(&self, store: &Store, txn: ObjectId) -> Result<TxnStatus, HoldError>;

    /// Aborts `txn` if it is still pending with a deadline at or before `now` (server time);
    /// returns the status after the attempt.
    async fn abort_expired(
        &self,
        store: &Store,
        txn: ObjectId,
        now: DateTime,
    ) -> Result<TxnStatus, HoldError>;
}

/// The resolver that reads ActiveTransaction records from the store's transactions collection.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordResolver;

#[async_trait]
impl HoldResolver for RecordResolver {
    async fn status(&self, store: &Store, txn: ObjectId) -> Result<TxnStatus, HoldError> {
        let records = store
            .protocol_collection(store.transactions_collection())
            .await
            .map_err(|e| HoldError::database("reading the transaction record", e))?;
        let found = records
            .find_one(doc! { "_id": txn })
            .projection(doc! { record::STATE: 1, record::DEADLINE: 1 })
            .await
            .map_err(|e| HoldError::database("reading the transaction record", e))?;
        Ok(match found {
            None => TxnStatus::Absent,
            Some(found) => status_of(&found).map_err(HoldError::new)?,
        })
    }

    async fn abort_expired(
        &self,
        store: &Store,
        txn: ObjectId,
        now: DateTime,
    ) -> Result<TxnStatus, HoldError> {
        let records = store
            .protocol_collection(store.transactions_collection())
            .await
            .map_err(|e| HoldError::database("aborting the transaction", e))?;
        leave_pending(
            &records,
            txn,
            TxnState::Aborted,
            doc! { record::DEADLINE: { "$lte": now } },
        )
        .await
        .map_err(|e| HoldError::database("aborting the transaction", e))?;
        self.status(store, txn).await
    }
}

/// Moves transaction `txn` out of the pending state to `to`, conditionally on its record still
/// being pending (and on `extra`): the one kind of write that decides a transaction's outcome, so
/// the commit point and every abort race on the same condition and exactly one wins. Returns
/// whether this write was the one.
pub(crate) async fn leave_pending(
    records: &Collection<Document>,
    txn: ObjectId,
    to: TxnState,
    extra: Document,
) -> mongodb::error::Result<bool> {
    let mut filter = doc! { "_id": txn, record::STATE: TxnState::Pending.as_str() };
    filter.extend(extra);
    let result = records
        .update_one(filter, doc! { "$set": { record::STATE: to.as_str() } })
        .await?;
    Ok(result.matched_count == 1)
}

/// Reads the status of a stored record.
pub(crate) fn status_of(found: &Document) -> Result<TxnStatus, String> {
    let state = found
        .get(record::STATE)
        .cloned()
        .map(bson::from_bson::<TxnState>)
        .transpose()
        .map_err(|e| format!("the transaction record's state cannot be read: {e}"))?;
    Ok(match state {
        Some(TxnState::Committed) => TxnStatus::Committed,
        Some(TxnState::Aborted) => TxnStatus::Aborted,
        Some(TxnState::Pending) => TxnStatus::Pending {
            deadline: *found
                .get_datetime(record::DEADLINE)
                .map_err(|_| "the pending transaction record has no deadline".to_string())?,
        },
        None => return Err("the transaction record has no state".to_string()),
    })
}

/// The resolver used without a transaction layer: every hold counts as pending forever.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoTransactions;

#[async_trait]
impl HoldResolver for NoTransactions {
    async fn status(&self, _store: &Store, _txn: ObjectId) -> Result<TxnStatus, HoldError> {
        Ok(TxnStatus::Pending {
            deadline: DateTime::MAX,
        })
    }

    async fn abort_expired(
        &self,
        store: &Store,
        txn: ObjectId,
        _now: DateTime,
    ) -> Result<TxnStatus, HoldError> {
        self.status(store, txn).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> Document {
        doc! {
            "_id": "a", "_schema": 1_i64, "_version": 5_i64, "_txn": ObjectId::new(),
            "n": 7, "new": 1, "kept": true,
        }
    }

    fn hold(op: HoldKind, restore: Document, unset: &[&str]) -> Hold {
        Hold {
            exp: DateTime::from_millis(0),
            op,
            restore,
            unset: unset.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn pre_images_put_back_what_was_there() {
        let update = hold(
            HoldKind::Update,
            doc! { "n": 3, "_version": 4_i64 },
            &["new"],
        );
        let mut with_hold = stored();
        with_hold.insert(fields::HOLD, bson::to_document(&update).expect("encode"));
        assert_eq!(
            update.pre_image(&with_hold),
            Some(doc! { "_id": "a", "_schema": 1_i64, "_version": 4_i64, "n": 3, "kept": true })
        );
        assert_eq!(
            hold(HoldKind::Insert, doc! {}, &[]).pre_image(&stored()),
            None
        );
        let mut deleting = stored();
        deleting.insert(fields::DELETING, true);
        let delete = hold(HoldKind::Delete, doc! { "_version": 4_i64 }, &[]);
        assert_eq!(
            delete.pre_image(&deleting),
            Some(
                doc! { "_id": "a", "_schema": 1_i64, "_version": 4_i64, "n": 7, "new": 1, "kept": true }
            )
        );
    }

    #[test]
    fn undo_writes_match_only_the_holder() {
        let t = ObjectId::new();
        let id = Bson::from("a");
        assert_eq!(
            hold(HoldKind::Insert, doc! {}, &[]).undo(&id, t),
            Write::Delete(doc! { "_id": "a", "_txn": t })
        );
        let update = hold(
            HoldKind::Update,
            doc! { "n": 3, "_version": 4_i64 },
            &["new"],
        );
        assert_eq!(
            update.undo(&id, t),
            Write::Update(
                doc! { "_id": "a", "_txn": t },
                doc! {
                    "$unset": { "new": "", "_txn": "", "_hold": "", "_deleting": "" },
                    "$set": { "n": 3, "_version": 4_i64 },
                }
            )
        );
        assert_eq!(
            hold(HoldKind::Check, doc! {}, &[]).undo(&id, t),
            Write::Update(
                doc! { "_id": "a", "_txn": t },
                doc! { "$unset": { "_txn": "", "_hold": "", "_deleting": "" } }
            )
        );
    }

    #[test]
    fn holds_round_trip_through_bson() {
        let h = hold(HoldKind::Delete, doc! { "_version": 2_i64 }, &["x"]);
        let stored = h.to_document();
        assert_eq!(stored, bson::to_document(&h).expect("encode"));
        assert_eq!(stored.get_str("op").ok(), Some("delete"));
        assert_eq!(bson::from_document::<Hold>(stored).expect("decode"), h);
    }

    #[test]
    fn record_states_read_as_statuses() {
        let d = DateTime::from_millis(9);
        assert_eq!(
            status_of(&doc! { "state": "pending", "deadline": d }),
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
        assert!(status_of(&doc! { "state": "pending" }).is_err());
        assert!(status_of(&doc! { "state": "weird" }).is_err());
    }
}
