//! The hold a held document carries (`_hold`): what it stands for, its stored form, the document
//! as it was before the transaction, and the writes that undo or finish it (see the folder's doc
//! for the protocol they serve).

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use serde::{Deserialize, Serialize};

use crate::repo::fields::{self, mistyped, ACTIVE_TXN, HOLD};
use crate::repo::format;
use crate::repo::hold::write::Write;
use crate::repo::outcome::HoldError;

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
    /// had not landed, so that it never can (see `hold::staging`). A fence changes nothing: on an
    /// existing document its op is `check`, on an absent one `insert` (a placeholder).
    #[serde(default, skip_serializing_if = "is_false")]
    pub(crate) fence: bool,
    /// On a document a transaction created: the server's time of its creation, stamped by the
    /// create itself (`$currentDate`, on the collection's own clock, the clock that guards every
    /// other apply). Absent on every other hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) at: Option<DateTime>,
    /// The top-level field names of the document before the transaction, in their order, when
    /// the change removed one of them (an unset, or an upgrade's rename): putting it back with
    /// `$set` would append it after every other field, so the undo rebuilds the document in this
    /// order instead. Empty (and not stored) when the undo keeps the order by itself.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) order: Vec<String>,
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
        if let Some(at) = self.at {
            stored.insert(AT, at);
        }
        if !self.order.is_empty() {
            stored.insert(ORDER, self.order.clone());
        }
        stored
    }

    /// Whether this hold can never carry a committed change, whatever its transaction's record
    /// says: a fence, or a document its transaction created after the deadline (a create is an
    /// upsert the server's clock cannot refuse, so a late one lands, stamped too late; see
    /// [`Hold::created_late`]). Both read as the document under them (a late creation as
    /// absent), make their transaction unable to commit, and are undone, never finished.
    pub(crate) fn never_commits(&self) -> bool {
        self.fence || self.created_late()
    }

    /// Whether this is a transaction's own creation of its document that the server made after
    /// the deadline. The coordinator, readers, writers and the GC all judge a creation by this
    /// one stored fact, so they cannot disagree about whether it is in place.
    pub(crate) fn created_late(&self) -> bool {
        self.op == HoldKind::Insert && !self.fence && self.at.is_some_and(|at| at > self.exp)
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
            at: None,
            order: Vec::new(),
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
        if self.order.is_empty() {
            return Some(pre);
        }
        // The fields the document had, in their order, then any other (as the undo writes it).
        let mut ordered = Document::new();
        for name in &self.order {
            if let Some(value) = pre.remove(name) {
                ordered.insert(name.clone(), value);
            }
        }
        ordered.extend(pre);
        Some(ordered)
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
        if !self.order.is_empty() {
            if let Some(pipeline) = self.ordered_undo() {
                return Write::Pipeline(held, pipeline);
            }
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

impl Hold {
    /// The undo of a hold with an [`order`](Hold::order), as a pipeline update that rebuilds the
    /// document: each field of `order` in that order, from the hold's own `restore` where the
    /// change took it away or altered it (`$_hold.restore.<name>`), else as stored; then the
    /// system fields the document gained since it was read (a stamp), unless the undo removes
    /// them. The values are field paths, never literals or bound variables, so no value is read
    /// as an expression on any server; a field path that yields nothing leaves its field out.
    /// `None` when a name cannot be written as a field of an expression object (a `.` in it, or
    /// a leading `$`): the plain undo puts it back, at the end.
    fn ordered_undo(&self) -> Option<Vec<Document>> {
        let mut rebuilt = Document::new();
        let from = |name: &str| {
            if self.restore.contains_key(name) {
                Bson::String(format!("${HOLD}.restore.{name}"))
            } else {
                Bson::String(format!("${name}"))
            }
        };
        for name in &self.order {
            if name.is_empty() || name.contains('.') || name.starts_with('$') {
                return None;
            }
            if ALWAYS_UNSET.contains(&name.as_str()) || self.unset.contains(name) {
                continue;
            }
            rebuilt.insert(name.clone(), from(name));
        }
        for name in [fields::SCHEMA_VERSION, fields::VERSION] {
            if !rebuilt.contains_key(name) && !self.unset.iter().any(|u| u == name) {
                rebuilt.insert(name, from(name));
            }
        }
        Some(vec![doc! { "$replaceWith": rebuilt }])
    }
}

/// Where a hold records the field order of the document before it (see [`Hold::order`]).
pub(crate) const ORDER: &str = "order";

/// Where a hold lists the fields it changed (see [`Hold::changed`]), under `_hold`.
pub(crate) const CHANGED: &str = "changed";

/// The stored path of the list of changed fields, indexed in every managed collection.
pub(crate) const CHANGED_PATH: &str = "_hold.changed";

/// Where a created document's hold records the server's time of its creation, under `_hold`.
pub(crate) const AT: &str = "at";

/// The stored path of a created document's creation time (see [`Hold::at`]).
pub(crate) const AT_PATH: &str = "_hold.at";

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

/// Refuses the hold of `doc` (of collection `coll`) when it is of a stored format newer than
/// `reads`: what undoes or finishes it could mean something else there.
pub(crate) fn readable(doc: &Document, reads: i64, coll: &str) -> Result<(), HoldError> {
    let Ok(hold) = doc.get_document(HOLD) else {
        return Ok(());
    };
    let id = doc
        .get("_id")
        .map_or_else(|| "?".to_string(), Bson::to_string);
    format::check(hold, reads, coll, format_args!("{id} (its {HOLD})")).map_err(HoldError::format)
}

/// The hold a held document describes itself with; `Err` when it is missing or unreadable.
pub(crate) fn read_hold(doc: &Document) -> Result<Hold, String> {
    match doc.get(HOLD) {
        Some(Bson::Document(hold)) => bson::from_document(hold.clone())
            .map_err(|e| format!("system field `{HOLD}` cannot be read: {e}")),
        Some(other) => Err(mistyped(HOLD, "an object", other)),
        None => Err(format!(
            "the document is held (`{ACTIVE_TXN}` is set) but carries no `{HOLD}`"
        )),
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
            at: None,
            order: Vec::new(),
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
    fn a_creation_stamped_after_the_deadline_never_commits() {
        let exp = DateTime::from_millis(1_000);
        let created = |at: Option<i64>| Hold {
            at: at.map(DateTime::from_millis),
            ..hold(HoldKind::Insert, doc! {}, &[])
        };
        let mut on_time = created(Some(1_000));
        on_time.exp = exp;
        let mut late = created(Some(1_001));
        late.exp = exp;
        let mut unstamped = created(None);
        unstamped.exp = exp;
        assert!(!on_time.created_late() && !on_time.never_commits());
        assert!(late.created_late() && late.never_commits());
        assert!(!unstamped.created_late());
        // Only a creation: an update's hold carries no `at`, and a fence never commits anyway.
        let mut update = hold(HoldKind::Update, doc! {}, &[]);
        update.at = Some(DateTime::from_millis(5_000));
        assert!(!update.created_late());
        assert!(Hold::fence(exp, true).never_commits());
        // The stamp is read back from the stored hold.
        let mut stored = late.to_document();
        stored.insert(AT, DateTime::from_millis(1_001));
        let read: Hold = bson::from_document(stored).expect("decode");
        assert!(read.created_late());
    }

    #[test]
    fn an_undo_with_an_order_rebuilds_the_document_in_it_from_field_paths() {
        let t = ObjectId::new();
        let id = Bson::from("a");
        let mut h = hold(
            HoldKind::Update,
            doc! { "gone": 1, "n": 2, "_version": 4_i64 },
            &["fresh"],
        );
        h.order = ["_id", "gone", "n", "kept", "_schema", "_version"]
            .map(String::from)
            .to_vec();
        let Write::Pipeline(filter, pipeline) = h.undo(&id, t) else {
            panic!("an ordered undo is a pipeline");
        };
        assert_eq!(
            filter,
            doc! { "_id": "a", "_txn": t, "_hold.fence": { "$ne": true } }
        );
        assert_eq!(
            pipeline,
            vec![doc! { "$replaceWith": {
                "_id": "$_id",
                "gone": "$_hold.restore.gone",
                "n": "$_hold.restore.n",
                "kept": "$kept",
                "_schema": "$_schema",
                "_version": "$_hold.restore._version",
            } }]
        );
        // A name no expression object can hold: the plain undo, which keeps every value.
        h.order.push("a.b".into());
        assert!(matches!(h.undo(&id, t), Write::Update(..)));
        // The pre-image a reader sees is in the order too.
        let mut ordered = hold(HoldKind::Update, doc! { "gone": 1 }, &[]);
        ordered.order = ["_id", "gone", "n"].map(String::from).to_vec();
        let stored = doc! { "_id": "a", "n": 3, "_txn": t };
        let pre = ordered.pre_image(&stored).expect("pre-image");
        assert_eq!(pre.keys().collect::<Vec<_>>(), ["_id", "gone", "n"]);
    }
}
