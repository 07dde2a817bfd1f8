//! The ActiveTransaction record and the single-document writes of its worklist.
//!
//! Everything a crashed coordinator leaves behind must be recoverable from the record and from
//! the documents it holds. Each entry records, before anything is applied, the exact write that
//! applies it, the versions before and after, and the undo; the hold an apply puts on a document is
//! derived from the entry, so the record and the document describe the same undo. The functions
//! here turn an entry into each step's write (apply, finish, roll back) without doing any I/O.

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use serde::{Deserialize, Serialize};

use crate::repo::fields;
use crate::repo::format;
use crate::repo::hold::held::{self, Hold, HoldKind};
use crate::repo::hold::record::TxnState;
use crate::repo::hold::write::Write;
use crate::repo::ids;
use crate::repo::plain;

/// The ActiveTransaction record.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ActiveTransaction {
    /// The transaction id, stored in `_txn` of every document it holds.
    #[serde(rename = "_id")]
    pub(crate) id: ObjectId,
    /// Staging, committed or aborted: the only field that changes after the record is written.
    pub(crate) state: TxnState,
    /// When it was written (server time).
    pub(crate) created: DateTime,
    /// After this instant (server time) anyone may abort it (pending) or finish it (committed).
    pub(crate) deadline: DateTime,
    /// One entry per document, in lock order.
    pub(crate) entries: Vec<Entry>,
    /// The stored format of the record and of the holds it puts on (see `repo::format`).
    #[serde(rename = "_format", default = "unmarked")]
    pub(crate) format: i64,
}

fn unmarked() -> i64 {
    format::UNMARKED
}

/// A path and a value (dotted paths cannot be field names of a stored document).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct PathValue {
    /// Dotted path.
    pub(crate) path: String,
    /// Value.
    pub(crate) value: Bson,
}

/// What puts a document's fields back: top-level originals, and fields that did not exist.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Undo {
    /// Top-level fields and their values before the transaction.
    pub(crate) restore: Document,
    /// Top-level fields that did not exist before the transaction.
    pub(crate) absent: Vec<String>,
    /// The top-level field names before the transaction, in order, when the change removes one
    /// of them (see `Hold::order`); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) order: Vec<String>,
}

/// What one entry does to its document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub(crate) enum Op {
    /// Create the document (user fields, `_id` included).
    Insert {
        /// The user fields.
        doc: Document,
    },
    /// Set and unset fields.
    Update {
        /// Fields set.
        set: Vec<PathValue>,
        /// Fields removed.
        unset: Vec<String>,
        /// How to undo it.
        undo: Undo,
    },
    /// Increment numeric fields.
    Adjust {
        /// Increments.
        inc: Vec<PathValue>,
        /// How to undo it (originals, so a double comes back exactly).
        undo: Undo,
    },
    /// Replace a document stored in an older schema version with its upgraded, changed form.
    Rewrite {
        /// User fields after the change, in the current shape.
        post: Document,
        /// The stored document before (system fields included).
        pre: Document,
    },
    /// Delete the document (a tombstone once finished).
    Delete,
    /// Hold the document unchanged at the version read (read validation).
    Check,
    /// Hold the document unchanged while it matches `condition` (equality on fields), at
    /// whatever version: a guard that the document's other changes do not break.
    Guard {
        /// Field paths and the values they must have.
        condition: Document,
    },
}

/// One document's part of a transaction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Entry {
    /// Collection name.
    pub(crate) coll: String,
    /// Document id.
    pub(crate) id: Bson,
    /// Version the caller read (0 for an insert).
    pub(crate) expected: i64,
    /// Version once applied (the same as `expected` for a check).
    pub(crate) applied: i64,
    /// Schema version the collection is at (stamped by the change).
    pub(crate) schema: i64,
    /// The change.
    pub(crate) op: Op,
}

impl Entry {
    /// The hold an apply puts on the document, for a transaction with `deadline`.
    pub(crate) fn hold(&self, deadline: DateTime) -> Hold {
        let previous = doc! { fields::VERSION: self.expected };
        let mut order = Vec::new();
        let (op, restore, unset) = match &self.op {
            Op::Insert { .. } => (HoldKind::Insert, Document::new(), Vec::new()),
            Op::Update { undo, .. } | Op::Adjust { undo, .. } => {
                let mut restore = undo.restore.clone();
                restore.extend(previous);
                order = undo.order.clone();
                (HoldKind::Update, restore, undo.absent.clone())
            }
            Op::Rewrite { post, pre } => {
                // An upgrade may rename or drop fields: the undo puts them back in place.
                order = pre.keys().cloned().collect();
                let mut restore = pre.clone();
                restore.remove("_id");
                for name in held::ALWAYS_UNSET {
                    restore.remove(name);
                }
                let mut unset: Vec<String> = post
                    .keys()
                    .filter(|k| k.as_str() != "_id" && !restore.contains_key(k.as_str()))
                    .cloned()
                    .collect();
                if self.rewrites_plain() {
                    // Undone, it is the plain document again: no system field of its own.
                    unset.extend([fields::SCHEMA_VERSION, fields::VERSION].map(String::from));
                } else {
                    restore.extend(previous);
                }
                (HoldKind::Update, restore, unset)
            }
            Op::Delete => (HoldKind::Delete, previous, Vec::new()),
            Op::Check | Op::Guard { .. } => (HoldKind::Check, Document::new(), Vec::new()),
        };
        Hold {
            exp: deadline,
            op,
            restore,
            unset,
            fence: false,
            at: None,
            order,
        }
    }

    /// The conditional write that applies this entry for transaction `txn` (deadline `deadline`).
    ///
    /// No apply can take effect after the deadline on the server's clock: a change of an existing
    /// document is conditional on `$$NOW` being at or before it, and a new document records in its
    /// hold when the server created it (`_hold.at`): one created after the deadline never counts,
    /// for the coordinator or anyone else (see `Hold::created_late`).
    ///
    /// The hold is marked with the transaction's stored `format` (format 1 leaves it unmarked).
    pub(crate) fn apply(&self, txn: ObjectId, deadline: DateTime, format: i64) -> Write {
        let mut hold = self.hold(deadline).to_document();
        format::mark(&mut hold, format);
        let free = |schema: Bson| {
            doc! {
                "_id": self.id.clone(),
                fields::VERSION: self.expected,
                fields::ACTIVE_TXN: null,
                fields::DELETED: null,
                fields::SCHEMA_VERSION: schema,
                "$expr": { "$lte": ["$$NOW", deadline] },
            }
        };
        let mut held = doc! { fields::ACTIVE_TXN: txn, fields::HOLD: hold.clone() };
        match &self.op {
            Op::Insert { doc } => {
                let mut created = doc.clone();
                created.remove("_id");
                created.insert(fields::SCHEMA_VERSION, self.schema);
                created.insert(fields::VERSION, self.applied);
                created.insert(fields::ACTIVE_TXN, txn);
                // The hold field by field, so that `$currentDate` can stamp `_hold.at` beside it.
                let hold: Document = hold
                    .into_iter()
                    .map(|(k, v)| (format!("{}.{k}", fields::HOLD), v))
                    .collect();
                // The filter can match no stored document (none has `_version` missing and a
                // `_mongotx_absent` field), so the upsert creates one or meets a duplicate id.
                Write::Create(
                    doc! {
                        "_id": self.id.clone(),
                        fields::VERSION: { "$exists": false },
                        "_mongotx_absent": { "$exists": true },
                    },
                    doc! {
                        "$setOnInsert": created,
                        "$set": hold,
                        "$currentDate": { held::AT_PATH: true },
                    },
                )
            }
            Op::Update { set, unset, .. } => {
                held.insert(fields::VERSION, self.applied);
                for pv in set {
                    held.insert(pv.path.clone(), pv.value.clone());
                }
                let mut update = doc! { "$set": held };
                if !unset.is_empty() {
                    update.insert("$unset", blank_keys(unset.iter()));
                }
                Write::Update(free(Bson::Int64(self.schema)), update)
            }
            Op::Adjust { inc, .. } => {
                held.insert(fields::VERSION, self.applied);
                let inc: Document = inc
                    .iter()
                    .map(|pv| (pv.path.clone(), pv.value.clone()))
                    .collect();
                Write::Update(
                    free(Bson::Int64(self.schema)),
                    doc! { "$inc": inc, "$set": held },
                )
            }
            Op::Rewrite { post, pre } => {
                let mut full = post.clone();
                full.insert("_id", self.id.clone());
                full.insert(fields::SCHEMA_VERSION, self.schema);
                full.insert(fields::VERSION, self.applied);
                full.extend(held);
                if self.rewrites_plain() {
                    // A plain document has no version to condition on: its exact content is.
                    let filter = doc! { "$and": [
                        plain::unchanged(pre, false),
                        { "$expr": { "$lte": ["$$NOW", deadline] } },
                    ] };
                    return Write::Replace(filter, full);
                }
                let stored_schema = pre
                    .get(fields::SCHEMA_VERSION)
                    .cloned()
                    .unwrap_or(Bson::Null);
                Write::Replace(free(stored_schema), full)
            }
            Op::Delete => {
                held.insert(fields::VERSION, self.applied);
                held.insert(fields::DELETING, true);
                Write::Update(
                    free(doc! { "$lte": self.schema }.into()),
                    doc! { "$set": held },
                )
            }
            Op::Check => Write::Update(
                free(doc! { "$lte": self.schema }.into()),
                doc! { "$set": held },
            ),
            Op::Guard { condition } => {
                let mut filter = free(doc! { "$lte": self.schema }.into());
                filter.remove(fields::VERSION);
                filter.extend(condition.clone());
                Write::Update(filter, doc! { "$set": held })
            }
        }
    }

    /// Whether this entry rewrites a plain document whole (its expected version is the
    /// fingerprint of the content read, and it was not stamped first): the apply stamps it,
    /// conditional on that exact content, and the undo makes it the same plain document again.
    /// A transaction changes a plain document this way when a stamp alone cannot be written: the
    /// schema refuses its content (and the change fixes it), or it is of an older shape.
    pub(crate) fn rewrites_plain(&self) -> bool {
        fields::is_plain_version(self.expected) && matches!(self.op, Op::Rewrite { .. })
    }

    /// Whether `stored` matches this entry's guard condition (`true` for other entries).
    pub(crate) fn guard_holds(&self, stored: &Document) -> bool {
        let Op::Guard { condition } = &self.op else {
            return true;
        };
        condition.iter().all(|(path, want)| {
            crate::repo::changes::get_path(stored, path).is_some_and(|have| same_value(have, want))
        })
    }

    /// The guard's condition as shown in errors.
    pub(crate) fn guard_condition(&self) -> String {
        match &self.op {
            Op::Guard { condition } => condition.to_string(),
            _ => String::new(),
        }
    }

    /// Whether this entry is a guard (it has no version of its own to report).
    pub(crate) fn is_guard(&self) -> bool {
        matches!(self.op, Op::Guard { .. })
    }

    /// Whether finishing this entry turns the document into a tombstone.
    pub(crate) fn deletes(&self) -> bool {
        matches!(self.op, Op::Delete)
    }

    /// The write that makes this entry final after the commit point (not for deletes, whose
    /// tombstone the store writes).
    pub(crate) fn finish(&self, txn: ObjectId) -> Write {
        held::finish(&self.id, txn)
    }

    /// The write that undoes this entry if it is applied, putting back exactly the document as it
    /// was (version included). A document this transaction does not hold is left alone.
    pub(crate) fn rollback(&self, txn: ObjectId, deadline: DateTime) -> Write {
        self.hold(deadline).undo(&self.id, txn)
    }

    /// The key that orders entries for locking, equal for ids the server treats as one.
    pub(crate) fn lock_key(&self) -> (String, String) {
        (self.coll.clone(), ids::key(&self.id))
    }
}

/// Equality as the server's query sees it for the values a guard names: numbers of any width
/// compare by value.
fn same_value(have: &Bson, want: &Bson) -> bool {
    let number = |b: &Bson| match b {
        Bson::Int32(n) => Some(f64::from(*n)),
        Bson::Int64(n) => Some(*n as f64),
        Bson::Double(n) => Some(*n),
        _ => None,
    };
    match (have, want) {
        (Bson::Int64(a), Bson::Int64(b)) => a == b,
        _ => match (number(have), number(want)) {
            (Some(a), Some(b)) => a == b,
            _ => have == want,
        },
    }
}

/// `{ key: "" }` for each key, the shape `$unset` takes.
fn blank_keys<'a>(keys: impl Iterator<Item = &'a String>) -> Document {
    keys.map(|k| (k.clone(), Bson::String(String::new())))
        .collect()
}

/// The top-level field a dotted path starts in.
pub(crate) fn top_level(path: &str) -> &str {
    path.split('.').next().unwrap_or(path)
}

/// Records the originals of the top-level fields `paths` touch in `stored`.
/// Records the field order of `stored` in `undo` when the change removes one of its top-level
/// fields (`removed`: the paths it unsets), so that the undo can put it back in place.
pub(crate) fn keep_order<'a>(
    mut undo: Undo,
    stored: &Document,
    mut removed: impl Iterator<Item = &'a str>,
) -> Undo {
    if removed.any(|path| !path.contains('.') && stored.contains_key(path)) {
        undo.order = stored.keys().cloned().collect();
    }
    undo
}

pub(crate) fn undo_for<'a>(stored: &Document, paths: impl Iterator<Item = &'a str>) -> Undo {
    let mut undo = Undo::default();
    for path in paths {
        let top = top_level(path);
        if undo.restore.contains_key(top) || undo.absent.iter().any(|a| a == top) {
            continue;
        }
        match stored.get(top) {
            Some(value) => {
                undo.restore.insert(top.to_string(), value.clone());
            }
            None => undo.absent.push(top.to_string()),
        }
    }
    undo
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(op: Op) -> Entry {
        Entry {
            coll: "accounts".into(),
            id: Bson::from("a"),
            expected: 4,
            applied: 5,
            schema: 1,
            op,
        }
    }

    fn at() -> DateTime {
        DateTime::from_millis(1_000)
    }

    #[test]
    fn undo_records_each_top_level_field_once() {
        let stored = doc! { "a": { "b": 1 }, "c": 2 };
        let undo = undo_for(&stored, ["a.b", "a.x", "c", "d.e"].into_iter());
        assert_eq!(undo.restore, doc! { "a": { "b": 1 }, "c": 2 });
        assert_eq!(undo.absent, vec!["d".to_string()]);
    }

    /// Applying an entry and then its hold's undo, as the server would, gives back the document.
    #[test]
    fn apply_then_undo_is_the_identity() {
        let t = ObjectId::new();
        let before = doc! { "_id": "a", "_schema": 1_i64, "_version": 4_i64, "n": 3, "keep": "k" };
        let update = entry(Op::Update {
            set: vec![PathValue {
                path: "n".into(),
                value: Bson::Int32(9),
            }],
            unset: vec![],
            undo: Undo {
                restore: doc! { "n": 3 },
                absent: vec!["fresh".into()],
                order: Vec::new(),
            },
        });
        // The post-image as the apply leaves it.
        let mut held = before.clone();
        held.insert("n", 9);
        held.insert("fresh", true);
        held.insert("_version", 5_i64);
        held.insert("_txn", t);
        held.insert("_hold", update.hold(at()).to_document());
        assert_eq!(update.hold(at()).pre_image(&held), Some(before.clone()));

        let delete = entry(Op::Delete);
        let mut deleting = before.clone();
        deleting.insert("_version", 5_i64);
        deleting.insert("_deleting", true);
        deleting.insert("_txn", t);
        assert_eq!(delete.hold(at()).pre_image(&deleting), Some(before.clone()));

        let check = entry(Op::Check);
        let mut checked = before.clone();
        checked.insert("_txn", t);
        assert_eq!(check.hold(at()).pre_image(&checked), Some(before));
    }

    #[test]
    fn a_rewrite_undoes_to_the_old_shape() {
        let pre = doc! { "_id": "a", "_schema": 1_i64, "_version": 4_i64, "name": "Ada Lovelace" };
        let post = doc! { "given": "Ada", "family": "Lovelace" };
        let rewrite = entry(Op::Rewrite {
            post: post.clone(),
            pre: pre.clone(),
        });
        let mut held = post;
        held.insert("_id", "a");
        held.insert("_schema", 2_i64);
        held.insert("_version", 5_i64);
        held.insert("_txn", ObjectId::new());
        let mut pre_image = rewrite.hold(at()).pre_image(&held).expect("pre-image");
        // Field order differs; compare as sets of fields.
        let mut want: Vec<_> = pre.into_iter().collect();
        let mut got: Vec<_> = std::mem::take(&mut pre_image).into_iter().collect();
        want.sort_by(|a, b| a.0.cmp(&b.0));
        got.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(got, want);
    }

    #[test]
    fn applies_are_conditional_on_a_free_document_at_the_expected_version() {
        let t = ObjectId::new();
        let Write::Update(filter, update) = entry(Op::Check).apply(t, at(), 1) else {
            panic!("a check is an update");
        };
        assert_eq!(filter.get_i64("_version").ok(), Some(4));
        assert_eq!(filter.get("_txn"), Some(&Bson::Null));
        let set = update.get_document("$set").expect("$set");
        assert_eq!(set.get_object_id("_txn").ok(), Some(t));
        assert_eq!(
            set.get_document("_hold").and_then(|h| h.get_str("op")).ok(),
            Some("check")
        );
        assert!(
            !set.contains_key("_version"),
            "a check does not change the version"
        );
        assert_eq!(
            filter.get_document("$expr").ok(),
            Some(&doc! { "$lte": ["$$NOW", at()] }),
            "nothing applies after the deadline"
        );
    }

    #[test]
    fn an_insert_creates_the_held_document_and_stamps_when() {
        let t = ObjectId::new();
        let insert = entry(Op::Insert {
            doc: doc! { "_id": "a", "owner": "$not_a_path" },
        });
        let Write::Create(filter, update) = insert.apply(t, at(), 1) else {
            panic!("an insert is a create");
        };
        assert_eq!(filter.get_str("_id").ok(), Some("a"));
        let created = update.get_document("$setOnInsert").expect("$setOnInsert");
        assert_eq!(created.get_str("owner").ok(), Some("$not_a_path"));
        assert_eq!(created.get_object_id("_txn").ok(), Some(t));
        assert!(!created.contains_key("_id"));
        let set = update.get_document("$set").expect("$set");
        assert_eq!(set.get_str("_hold.op").ok(), Some("insert"));
        assert_eq!(set.get_datetime("_hold.exp").ok(), Some(&at()));
        assert_eq!(
            update.get_document("$currentDate").ok(),
            Some(&doc! { "_hold.at": true })
        );
    }

    #[test]
    fn ids_the_server_treats_as_one_share_a_lock_key() {
        let mut a = entry(Op::Check);
        a.id = Bson::Int32(7);
        let mut b = entry(Op::Check);
        b.id = Bson::Double(7.0);
        assert_eq!(a.lock_key(), b.lock_key());
    }

    #[test]
    fn the_worklist_round_trips_through_bson() {
        let txn = ActiveTransaction {
            id: ObjectId::new(),
            state: TxnState::Staging,
            created: DateTime::now(),
            deadline: DateTime::now(),
            entries: vec![
                entry(Op::Insert {
                    doc: doc! { "x": 1 },
                }),
                entry(Op::Update {
                    set: vec![PathValue {
                        path: "a.b".into(),
                        value: Bson::Int32(1),
                    }],
                    unset: vec!["c".into()],
                    undo: Undo::default(),
                }),
                entry(Op::Adjust {
                    inc: vec![],
                    undo: Undo::default(),
                }),
                entry(Op::Rewrite {
                    post: doc! {},
                    pre: doc! {},
                }),
                entry(Op::Delete),
                entry(Op::Check),
            ],
            format: 1,
        };
        let stored = bson::to_document(&txn).expect("encode");
        assert_eq!(stored.get_str("state").ok(), Some("staging"));
        let back: ActiveTransaction = bson::from_document(stored).expect("decode");
        assert_eq!(back.entries, txn.entries);
    }

    #[test]
    fn an_undo_keeps_the_order_only_when_the_change_removes_a_field() {
        let stored = doc! { "_id": "a", "x": 1, "y": 2 };
        let kept = keep_order(
            undo_for(&stored, ["x"].into_iter()),
            &stored,
            ["x"].into_iter(),
        );
        assert_eq!(kept.order, ["_id", "x", "y"]);
        let none = keep_order(
            undo_for(&stored, ["z"].into_iter()),
            &stored,
            ["z"].into_iter(),
        );
        assert!(
            none.order.is_empty(),
            "unsetting a missing field removes nothing"
        );
        let nested = keep_order(
            undo_for(&stored, ["x.q"].into_iter()),
            &stored,
            ["x.q"].into_iter(),
        );
        assert!(
            nested.order.is_empty(),
            "a nested unset keeps the top-level field in place"
        );
    }

    #[test]
    fn a_rewrite_of_a_plain_document_is_undone_to_the_plain_document() {
        let pre = doc! { "_id": "a", "name": "Ada L", "n": "7" };
        let mut rewrite = entry(Op::Rewrite {
            post: doc! { "_id": "a", "given": "Ada", "n": 7 },
            pre: pre.clone(),
        });
        rewrite.expected = -12;
        rewrite.applied = 1;
        assert!(rewrite.rewrites_plain());
        let hold = rewrite.hold(at());
        assert!(hold.unset.contains(&"_schema".to_string()));
        assert!(hold.unset.contains(&"_version".to_string()));
        assert!(!hold.restore.contains_key("_version"));
        assert_eq!(hold.order, ["_id", "name", "n"]);
        let Write::Replace(filter, _) = rewrite.apply(ObjectId::new(), at(), 1) else {
            panic!("a rewrite replaces");
        };
        // Conditional on the exact content and on the deadline, not on a version.
        let clauses = filter.get_array("$and").expect("two clauses");
        assert_eq!(clauses.len(), 2);
        assert!(!filter.contains_key("_version"));
        // The post-image, held, reads back as the plain document.
        let mut held =
            doc! { "_id": "a", "given": "Ada", "n": 7, "_schema": 1_i64, "_version": 1_i64 };
        held.insert("_txn", ObjectId::new());
        assert_eq!(
            hold.pre_image(&held)
                .map(|d| bson::to_vec(&d).expect("bytes")),
            Some(bson::to_vec(&pre).expect("bytes"))
        );
    }
}
