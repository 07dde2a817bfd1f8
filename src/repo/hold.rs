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
//! A transaction's outcome is decided by its record (the ActiveTransaction document), written in
//! the same round as the applies, in state `staging`, listing its participants. It is committed as
//! soon as the record and every participant's apply are in place (an *implicit* commit: nobody has
//! to write anything more for it to be final). Anyone who meets a staging record decides it for
//! good with one write conditional on the record still being `staging`: `committed` when every
//! participant is held by the transaction, or, once its deadline has passed, `aborted` after
//! putting a *fence* on every participant whose apply is missing, so that it can never land (see
//! `repo::staging`). Exactly one conditional write wins.
//!
//! A hold whose record is absent is not committed (an implicit commit needs the record): either
//! its record has not arrived yet, or its transaction ended and this hold was put back by a late
//! copy of an apply. Nobody undoes it before its deadline; after that, a resolver first writes an
//! `aborted` record in its place (so that no late copy of the record can still arrive as
//! `staging`), then undoes the hold. A record can only be created as `staging` while the server's
//! clock is before its deadline, and an aborted record is deleted only once that has passed (or
//! by a coordinator that knows no copy of its record is still in flight), so a transaction that
//! was aborted can never come back.
//!
//! # What readers see
//!
//! The committed value: for a holder that is undecided, aborted or gone, the undo applied to the
//! stored document (an insert reads as absent); for a committed holder, the stored document (a
//! delete reads as deleted). A fence reads as the document it sits on (a placeholder as absent),
//! whatever its holder's state. Queries evaluate filter, sort and limit on the same committed values
//! (see `query`).
//!
//! # Why every resolution step is safe to repeat, race or arrive late
//!
//! Undo and finish writes are conditional on `_txn` still naming the transaction. While a
//! transaction holds a document nobody else may change it, so the undo restores exactly what was
//! there; after the hold is gone the same write matches nothing. A late duplicate of an apply can
//! only match the document at the version the transaction read, i.e. before its own change: it
//! puts the same hold back, which resolves the same way again.

use std::collections::HashMap;

use async_trait::async_trait;
use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use mongodb::Collection;
use serde::{Deserialize, Serialize};

use crate::repo::fields;
use crate::repo::staging;
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
    /// Set on a fence: a hold a resolver put on a participant of a staging transaction whose apply
    /// had not landed, so that it never can (see `repo::staging`). A fence changes nothing: on an
    /// existing document its op is `check`, on an absent one `insert` (a placeholder).
    #[serde(default, skip_serializing_if = "is_false")]
    pub(crate) fence: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
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
    /// The stored form of the hold: what serde would write (built without a fallible encoder),
    /// plus the fields it changed (see [`Hold::changed`]), which reading it back ignores.
    pub(crate) fn to_document(&self) -> Document {
        let mut stored = doc! {
            "exp": self.exp,
            "op": self.op.as_str(),
            "restore": self.restore.clone(),
            "unset": self.unset.clone(),
            CHANGED: self.changed(),
        };
        if self.fence {
            stored.insert("fence", true);
        }
        stored
    }

    /// The top-level fields whose committed value differs from the stored one while the hold is
    /// on (restored or removed by its undo). Stored beside the hold so that a query can find the
    /// held documents whose pre-image may match it where the stored value does not, by an index,
    /// without looking at every held document (see `repo::query`).
    pub(crate) fn changed(&self) -> Vec<String> {
        let mut names: Vec<String> = self.restore.keys().cloned().collect();
        names.extend(
            self.unset
                .iter()
                .filter(|n| !self.restore.contains_key(n.as_str()))
                .cloned(),
        );
        names
    }

    /// The fence a resolver puts on a participant of `txn`'s: `placeholder` when the document does
    /// not exist (the fence is then a document of its own, removed when the fence is).
    pub(crate) fn fence(exp: DateTime, placeholder: bool) -> Hold {
        Hold {
            exp,
            op: if placeholder {
                HoldKind::Insert
            } else {
                HoldKind::Check
            },
            restore: Document::new(),
            unset: Vec::new(),
            fence: true,
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
        // A fence and the transaction's own hold never sit on a document at once, but one can
        // follow the other: each undo matches only its own kind.
        let mut held = held_by(id, txn);
        held.insert(
            FENCE,
            if self.fence {
                Bson::Boolean(true)
            } else {
                doc! { "$ne": true }.into()
            },
        );
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

/// Where a hold lists the fields it changed (see [`Hold::changed`]), under `_hold`.
pub(crate) const CHANGED: &str = "changed";

/// The stored path of the list of changed fields, indexed in every managed collection.
pub(crate) const CHANGED_PATH: &str = "_hold.changed";

/// The stored path of a hold's fence flag.
pub(crate) const FENCE: &str = "_hold.fence";

/// The filter matching document `id` while `txn` holds it (with its own change or a fence).
pub(crate) fn held_by(id: &Bson, txn: ObjectId) -> Document {
    doc! { "_id": id.clone(), fields::ACTIVE_TXN: txn }
}

/// The filter matching document `id` while `txn` holds it with its own change (not a fence).
pub(crate) fn applied_by(id: &Bson, txn: ObjectId) -> Document {
    doc! { "_id": id.clone(), fields::ACTIVE_TXN: txn, FENCE: { "$ne": true } }
}

/// The write that makes a committed change (other than a delete, which becomes a tombstone) final
/// on document `id` held by `txn`: the hold is dropped.
pub(crate) fn finish(id: &Bson, txn: ObjectId) -> Write {
    Write::Update(
        applied_by(id, txn),
        doc! { "$unset": { fields::ACTIVE_TXN: "", fields::HOLD: "" } },
    )
}

/// Where a transaction is in its life, as its record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TxnState {
    /// Written together with its changes. It is committed once the record and every participant's
    /// change are in place (an implicit commit), whether or not anyone has said so yet; anyone who
    /// meets it decides it by checking the participants (see `repo::staging`).
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

/// Stored names of the record fields a hold's resolver reads.
pub(crate) mod record {
    /// `staging`, `committed` or `aborted`.
    pub(crate) const STATE: &str = "state";
    /// The participants, in lock order (the transaction layer's entries).
    pub(crate) const ENTRIES: &str = "entries";
    /// The deadline, in server time.
    pub(crate) const DEADLINE: &str = "deadline";
}

/// What a transaction's record says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnStatus {
    /// Still undecided (staging, with a participant not in place); anyone may decide it once
    /// `deadline` (server time) has passed.
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
    /// What the record of `txn` says now (a staging record whose participants are all in place
    /// is committed, and is written so).
    async fn status(&self, store: &Store, txn: ObjectId) -> Result<TxnStatus, HoldError>;

    /// What the records of `txns` say, for a reader: nothing is written, and a staging record
    /// whose participants are all in place reads as committed. The standard resolver reads them
    /// all in a bounded number of commands (see `RecordResolver`); this default asks
    /// [`HoldResolver::status`] for each, all at once.
    async fn statuses(
        &self,
        store: &Store,
        txns: &[ObjectId],
    ) -> Result<HashMap<ObjectId, TxnStatus>, HoldError> {
        let found = futures::future::join_all(txns.iter().map(|t| self.status(store, *t))).await;
        txns.iter()
            .zip(found)
            .map(|(t, status)| status.map(|s| (*t, s)))
            .collect()
    }

    /// Decides `txn` if it is still undecided with a deadline at or before `now` (server time):
    /// commits it if every participant is in place, else fences the missing ones and aborts it.
    /// Returns the status after the attempt.
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
        staging::status(store, txn).await
    }

    async fn statuses(
        &self,
        store: &Store,
        txns: &[ObjectId],
    ) -> Result<HashMap<ObjectId, TxnStatus>, HoldError> {
        staging::read_statuses(store, txns).await
    }

    async fn abort_expired(
        &self,
        store: &Store,
        txn: ObjectId,
        now: DateTime,
    ) -> Result<TxnStatus, HoldError> {
        let Some(record) = staging::load(store, txn).await? else {
            return Ok(TxnStatus::Absent);
        };
        match status_of(&record).map_err(HoldError::new)? {
            TxnStatus::Pending { deadline } if deadline <= now => {
                staging::decide_expired(store, txn, &record, &|_, _| Ok(()), &|e| e).await
            }
            other => Ok(other),
        }
    }
}

/// Moves transaction `txn` out of the staging state to `to`, conditionally on its record still
/// being staging (and on `extra`): the one kind of write that decides a transaction's outcome, so
/// the explicit commit and every abort race on the same condition and exactly one wins. Returns
/// whether this write was the one.
pub(crate) async fn leave_staging(
    records: &Collection<Document>,
    txn: ObjectId,
    to: TxnState,
    extra: Document,
) -> mongodb::error::Result<bool> {
    let mut filter = doc! { "_id": txn, record::STATE: TxnState::Staging.as_str() };
    filter.extend(extra);
    let result = records
        .update_one(filter, doc! { "$set": { record::STATE: to.as_str() } })
        .await?;
    Ok(result.matched_count == 1)
}

/// Reads the status of a stored record (a staging record reads as undecided; whether its
/// participants are in place is `repo::staging`'s question).
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
        Some(TxnState::Staging) => TxnStatus::Pending {
            deadline: *found
                .get_datetime(record::DEADLINE)
                .map_err(|_| "the staging transaction record has no deadline".to_string())?,
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
            fence: false,
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
    fn undo_writes_match_only_the_holder_and_its_kind_of_hold() {
        let t = ObjectId::new();
        let id = Bson::from("a");
        let own = doc! { "_id": "a", "_txn": t, "_hold.fence": { "$ne": true } };
        assert_eq!(
            hold(HoldKind::Insert, doc! {}, &[]).undo(&id, t),
            Write::Delete(own.clone())
        );
        let update = hold(
            HoldKind::Update,
            doc! { "n": 3, "_version": 4_i64 },
            &["new"],
        );
        assert_eq!(
            update.undo(&id, t),
            Write::Update(
                own.clone(),
                doc! {
                    "$unset": { "new": "", "_txn": "", "_hold": "", "_deleting": "" },
                    "$set": { "n": 3, "_version": 4_i64 },
                }
            )
        );
        assert_eq!(
            hold(HoldKind::Check, doc! {}, &[]).undo(&id, t),
            Write::Update(
                own,
                doc! { "$unset": { "_txn": "", "_hold": "", "_deleting": "" } }
            )
        );
        let fenced = doc! { "_id": "a", "_txn": t, "_hold.fence": true };
        let exp = DateTime::from_millis(5);
        assert_eq!(
            Hold::fence(exp, true).undo(&id, t),
            Write::Delete(fenced.clone())
        );
        assert_eq!(
            Hold::fence(exp, false).undo(&id, t),
            Write::Update(
                fenced,
                doc! { "$unset": { "_txn": "", "_hold": "", "_deleting": "" } }
            )
        );
        let stored = doc! { "_id": "a", "_schema": 1_i64, "_version": 2_i64, "n": 1 };
        assert_eq!(Hold::fence(exp, false).pre_image(&stored), Some(stored));
        assert_eq!(
            Hold::fence(exp, true).to_document().get_bool("fence"),
            Ok(true)
        );
        assert!(!update.to_document().contains_key("fence"));
    }

    #[test]
    fn holds_round_trip_through_bson() {
        let h = hold(HoldKind::Delete, doc! { "_version": 2_i64 }, &["x"]);
        let mut stored = h.to_document();
        let changed = stored.remove(CHANGED);
        assert_eq!(stored, bson::to_document(&h).expect("encode"));
        assert_eq!(changed, Some(bson::bson!(["_version", "x"])));
        assert_eq!(stored.get_str("op").ok(), Some("delete"));
        assert_eq!(bson::from_document::<Hold>(stored).expect("decode"), h);
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
