//! The ActiveTransaction document and the single-document operations of its worklist.
//!
//! Everything a crashed coordinator leaves behind must be recoverable from two places only: the
//! ActiveTransaction document and the documents that reference it. So each entry records, before
//! anything is applied, the exact write that applies it, the versions before and after, and the
//! top-level originals that undo it. The functions here turn an entry into the filter and update of
//! each step (apply, finish, roll back) and into the pre-image readers see while it is pending.

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use serde::{Deserialize, Serialize};

use crate::fields;

/// Default name of the collection holding ActiveTransaction documents.
pub const TRANSACTIONS_COLLECTION: &str = "mongotx_transactions";

/// Where a transaction is in its life; the only field that ever changes after it is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TxnState {
    /// Written, applies may be in flight; readers see pre-images.
    Pending,
    /// Past the commit point: the changes are the committed state and must be finished.
    Committed,
    /// Claimed by a GC (or a resolving writer) after its deadline: it must be rolled back.
    Aborted,
}

impl TxnState {
    /// The value stored in the ActiveTransaction document's `state` field.
    pub fn as_str(self) -> &'static str {
        match self {
            TxnState::Pending => "pending",
            TxnState::Committed => "committed",
            TxnState::Aborted => "aborted",
        }
    }
}

/// The ActiveTransaction document.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ActiveTransaction {
    /// The transaction id, stored in `_txn` of every document it holds.
    #[serde(rename = "_id")]
    pub id: ObjectId,
    /// Pending, committed or aborted.
    pub state: TxnState,
    /// After this instant a GC may claim it (pending) or finish it (committed).
    pub deadline: DateTime,
    /// When it was written.
    pub created: DateTime,
    /// One entry per document, in lock order.
    pub entries: Vec<Entry>,
}

/// A path and a value (dotted paths cannot be stored as field names everywhere).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathValue {
    /// Dotted path.
    pub path: String,
    /// Value.
    pub value: Bson,
}

/// What restores a document's user fields: top-level originals, and fields that were absent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Undo {
    /// Top-level fields and their values before the transaction.
    pub restore: Vec<PathValue>,
    /// Top-level fields that did not exist before the transaction.
    pub absent: Vec<String>,
}

/// What one entry does to its document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Op {
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
        /// How to undo it (originals, so a double round-trips exactly).
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
}

/// One document's part of a transaction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Collection name.
    pub coll: String,
    /// Document id.
    pub id: Bson,
    /// Version the caller read (0 for an insert).
    pub expected: i64,
    /// Version once applied (the same as `expected` for a check).
    pub applied: i64,
    /// Schema version the collection is at (stamped by the change).
    pub schema: i64,
    /// The change.
    pub op: Op,
}

/// A filter and the write to run with it.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    /// `insert_one` of this document; a free aborted-insert placeholder may be replaced instead.
    Insert(Document),
    /// `update_one(filter, update)`.
    Update(Document, Document),
    /// `replace_one(filter, replacement)`.
    Replace(Document, Document),
}

impl Entry {
    /// A short description for logs and errors.
    pub fn describe(&self) -> String {
        format!("{}/{}", self.coll, crate::error::show_id(&self.id))
    }

    /// The conditional write that applies this entry for transaction `txn`.
    pub fn apply(&self, txn: ObjectId) -> Write {
        let free = |schema: Bson| {
            doc! {
                "_id": self.id.clone(),
                fields::VERSION: self.expected,
                fields::ACTIVE_TXN: null,
                fields::DELETED: null,
                fields::SCHEMA_VERSION: schema,
            }
        };
        let hold = doc! { fields::VERSION: self.applied, fields::ACTIVE_TXN: txn };
        match &self.op {
            Op::Insert { doc } => {
                let mut full = doc.clone();
                full.insert("_id", self.id.clone());
                full.insert(fields::SCHEMA_VERSION, self.schema);
                full.insert(fields::VERSION, self.applied);
                full.insert(fields::ACTIVE_TXN, txn);
                Write::Insert(full)
            }
            Op::Update { set, unset, .. } => {
                let mut fields_set = hold;
                for pv in set {
                    fields_set.insert(pv.path.clone(), pv.value.clone());
                }
                let mut update = doc! { "$set": fields_set };
                if !unset.is_empty() {
                    update.insert("$unset", blank_keys(unset.iter()));
                }
                Write::Update(free(Bson::Int64(self.schema)), update)
            }
            Op::Adjust { inc, .. } => {
                let inc: Document = inc
                    .iter()
                    .map(|pv| (pv.path.clone(), pv.value.clone()))
                    .collect();
                Write::Update(
                    free(Bson::Int64(self.schema)),
                    doc! { "$inc": inc, "$set": hold },
                )
            }
            Op::Rewrite { post, pre } => {
                let stored_schema = pre
                    .get(fields::SCHEMA_VERSION)
                    .cloned()
                    .unwrap_or(Bson::Null);
                let mut full = post.clone();
                full.insert("_id", self.id.clone());
                full.insert(fields::SCHEMA_VERSION, self.schema);
                full.insert(fields::VERSION, self.applied);
                full.insert(fields::ACTIVE_TXN, txn);
                Write::Replace(free(stored_schema), full)
            }
            Op::Delete => {
                let mut set = hold;
                set.insert(fields::DELETING, true);
                Write::Update(
                    free(doc! { "$lte": self.schema }.into()),
                    doc! { "$set": set },
                )
            }
            Op::Check => Write::Update(
                free(doc! { "$lte": self.schema }.into()),
                doc! { "$set": { fields::ACTIVE_TXN: txn } },
            ),
        }
    }

    /// The write that frees the document after the commit point (a tombstone for a delete).
    pub fn finish(&self, txn: ObjectId) -> Write {
        let held = doc! { "_id": self.id.clone(), fields::ACTIVE_TXN: txn };
        match self.op {
            Op::Delete => Write::Replace(
                held,
                doc! {
                    "_id": self.id.clone(),
                    fields::SCHEMA_VERSION: self.schema,
                    fields::VERSION: self.applied,
                    fields::DELETED: DateTime::now(),
                },
            ),
            _ => Write::Update(held, doc! { "$unset": { fields::ACTIVE_TXN: "" } }),
        }
    }

    /// The write that undoes an applied entry and frees the document; bumps the version past the
    /// applied one so a delayed apply of the same entry can never land afterwards.
    pub fn rollback(&self, txn: ObjectId) -> Write {
        let held = doc! {
            "_id": self.id.clone(),
            fields::ACTIVE_TXN: txn,
            fields::VERSION: self.applied,
        };
        let undone = self.applied + 1;
        match &self.op {
            // An insert that never committed leaves a version-0 placeholder: it reads as NotFound,
            // a later insert may take its place, but a delayed insert of this entry cannot.
            Op::Insert { .. } => Write::Replace(
                held,
                doc! {
                    "_id": self.id.clone(),
                    fields::SCHEMA_VERSION: self.schema,
                    fields::VERSION: 0_i64,
                    fields::DELETED: DateTime::now(),
                },
            ),
            Op::Update { undo, .. } | Op::Adjust { undo, .. } => {
                let mut set = doc! { fields::VERSION: undone };
                for pv in &undo.restore {
                    set.insert(pv.path.clone(), pv.value.clone());
                }
                let mut unset = blank_keys(undo.absent.iter());
                unset.insert(fields::ACTIVE_TXN, "");
                Write::Update(held, doc! { "$set": set, "$unset": unset })
            }
            Op::Rewrite { pre, .. } => {
                let mut restored = pre.clone();
                restored.remove(fields::ACTIVE_TXN);
                restored.insert(fields::VERSION, undone);
                Write::Replace(held, restored)
            }
            Op::Delete => Write::Update(
                held,
                doc! {
                    "$set": { fields::VERSION: undone },
                    "$unset": { fields::DELETING: "", fields::ACTIVE_TXN: "" },
                },
            ),
            // No version condition: a GC's fence may have bumped the version under the hold.
            Op::Check => Write::Update(
                doc! { "_id": self.id.clone(), fields::ACTIVE_TXN: txn },
                doc! { "$unset": { fields::ACTIVE_TXN: "" } },
            ),
        }
    }

    /// The writes that fence this entry, found unapplied by a GC that claimed transaction `txn`
    /// (written at `created`), against a late apply: tried in order until one matches.
    ///
    /// A live document still at the expected version gets its version bumped, so the apply's
    /// filter can never match. That includes one held by another transaction: only a check (which
    /// never changes the document, and whose release does not look at the version) or a
    /// committed, unfinished change can hold a document at the version this entry read. An
    /// insert's id gets a free placeholder dated after `created`, which the coordinator of that
    /// transaction never takes over.
    pub fn fences(&self, txn: ObjectId, created: DateTime) -> Vec<Write> {
        match self.op {
            Op::Insert { .. } => {
                let at = DateTime::from_millis(
                    DateTime::now()
                        .timestamp_millis()
                        .max(created.timestamp_millis().saturating_add(1)),
                );
                vec![
                    Write::Update(
                        fields::free_placeholder_filter(&self.id),
                        doc! { "$set": { fields::DELETED: at } },
                    ),
                    Write::Insert(doc! {
                        "_id": self.id.clone(),
                        fields::SCHEMA_VERSION: self.schema,
                        fields::VERSION: 0_i64,
                        fields::DELETED: at,
                    }),
                ]
            }
            _ => vec![Write::Update(
                doc! {
                    "_id": self.id.clone(),
                    fields::VERSION: self.expected,
                    fields::ACTIVE_TXN: { "$ne": txn },
                    fields::DELETED: null,
                },
                doc! { "$set": { fields::VERSION: self.expected + 1 } },
            )],
        }
    }

    /// The version the document has after a rollback of this (applied) entry.
    pub fn rolled_back_version(&self) -> i64 {
        match self.op {
            Op::Insert { .. } => 0,
            Op::Check => self.applied,
            _ => self.applied + 1,
        }
    }

    /// What readers see of `stored` (held by this entry's pending transaction): the document as
    /// it was before, or `None` for an insert (it does not exist yet).
    pub fn pre_image(&self, stored: &Document) -> Option<Document> {
        let mut pre = match &self.op {
            Op::Insert { .. } => return None,
            Op::Rewrite { pre, .. } => pre.clone(),
            Op::Update { undo, .. } | Op::Adjust { undo, .. } => {
                let mut doc = stored.clone();
                for pv in &undo.restore {
                    doc.insert(pv.path.clone(), pv.value.clone());
                }
                for name in &undo.absent {
                    doc.remove(name);
                }
                doc
            }
            Op::Delete => {
                let mut doc = stored.clone();
                doc.remove(fields::DELETING);
                doc
            }
            Op::Check => stored.clone(),
        };
        pre.remove(fields::ACTIVE_TXN);
        pre.insert(fields::VERSION, self.expected);
        Some(pre)
    }
}

/// `{ key: "" }` for each key, the shape `$unset` takes.
fn blank_keys<'a>(keys: impl Iterator<Item = &'a String>) -> Document {
    keys.map(|k| (k.clone(), Bson::String(String::new())))
        .collect()
}

/// The top-level field a dotted path starts in.
pub fn top_level(path: &str) -> &str {
    path.split('.').next().unwrap_or(path)
}

/// Records the originals of the top-level fields `paths` touch in `stored`.
pub fn undo_for<'a>(stored: &Document, paths: impl Iterator<Item = &'a str>) -> Undo {
    let mut undo = Undo::default();
    for path in paths {
        let top = top_level(path);
        if undo.restore.iter().any(|pv| pv.path == top) || undo.absent.iter().any(|a| a == top) {
            continue;
        }
        match stored.get(top) {
            Some(value) => undo.restore.push(PathValue {
                path: top.to_string(),
                value: value.clone(),
            }),
            None => undo.absent.push(top.to_string()),
        }
    }
    undo
}

/// A stable key for lock order: collection, then the id's canonical extended JSON.
pub fn lock_key(entry: &Entry) -> (String, String) {
    (
        entry.coll.clone(),
        entry.id.clone().into_canonical_extjson().to_string(),
    )
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

    #[test]
    fn undo_records_each_top_level_field_once() {
        let stored = doc! { "a": { "b": 1 }, "c": 2 };
        let undo = undo_for(&stored, ["a.b", "a.x", "c", "d.e"].into_iter());
        assert_eq!(
            undo.restore,
            vec![
                PathValue {
                    path: "a".into(),
                    value: Bson::Document(doc! { "b": 1 })
                },
                PathValue {
                    path: "c".into(),
                    value: Bson::Int32(2)
                },
            ]
        );
        assert_eq!(undo.absent, vec!["d".to_string()]);
    }

    #[test]
    fn pre_images_restore_what_was_there() {
        let stored = doc! { "_id": "a", "_schema": 1_i64, "_version": 5_i64, "_txn": ObjectId::new(), "n": 7, "new": 1 };
        let undo = Undo {
            restore: vec![PathValue {
                path: "n".into(),
                value: Bson::Int32(3),
            }],
            absent: vec!["new".into()],
        };
        let pre = entry(Op::Update {
            set: vec![],
            unset: vec![],
            undo,
        })
        .pre_image(&stored)
        .expect("pre-image");
        assert_eq!(
            pre,
            doc! { "_id": "a", "_schema": 1_i64, "_version": 4_i64, "n": 3 }
        );
        assert_eq!(entry(Op::Insert { doc: doc! {} }).pre_image(&stored), None);
        let deleting =
            doc! { "_id": "a", "_version": 5_i64, "_deleting": true, "_txn": ObjectId::new() };
        assert_eq!(
            entry(Op::Delete).pre_image(&deleting),
            Some(doc! { "_id": "a", "_version": 4_i64 })
        );
    }

    #[test]
    fn state_names_are_what_serde_stores() {
        for state in [TxnState::Pending, TxnState::Committed, TxnState::Aborted] {
            assert_eq!(
                bson::to_bson(&state).expect("encode"),
                Bson::String(state.as_str().to_string())
            );
        }
    }

    #[test]
    fn the_worklist_round_trips_through_bson() {
        let txn = ActiveTransaction {
            id: ObjectId::new(),
            state: TxnState::Pending,
            deadline: DateTime::now(),
            created: DateTime::now(),
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
        };
        let stored = bson::to_document(&txn).expect("encode");
        let back: ActiveTransaction = bson::from_document(stored).expect("decode");
        assert_eq!(back.entries, txn.entries);
        assert_eq!(back.state, TxnState::Pending);
    }
}
