//! Why a document is as it is (`mongotx why`): its committed value, as a reader gets it, and if
//! it is held, by which transaction, in what state, and what happens next and when. Read only:
//! the holder's outcome is read as readers read it, never decided here.

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use serde::Serialize;

use crate::repo::error::{show_id, RepoError};
use crate::repo::fields::{self, SystemFields};
use crate::repo::hold::held::{self, Hold};
use crate::repo::hold::resolve::{self, Committed};
use crate::repo::ids;
use crate::repo::meta;
use crate::server::clock::rfc3339;
use crate::txn::error::TxnError;
use crate::txn::inspect::model::{ser, DocumentState, RecordInfo};
use crate::txn::inspect::next::{next, Next};
use crate::txn::inspect::report::stored;
use crate::txn::recovery::Env;

/// A document explained: what readers get, and what holds it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Explanation {
    /// The collection.
    pub collection: String,
    /// The document's id.
    pub id: Bson,
    /// The server's time the explanation was made at.
    #[serde(serialize_with = "ser::time")]
    pub now: DateTime,
    /// What a reader gets (`Repository::get`, `find`): the committed value, not a staged one.
    pub committed: CommittedValue,
    /// The transaction holding the document, if one does.
    pub hold: Option<HoldInfo>,
}

/// A document's committed value: what `Repository::get` resolves it to.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "is", rename_all = "snake_case")]
#[non_exhaustive]
pub enum CommittedValue {
    /// A live document.
    Live {
        /// Its version (a plain document's is negative: the fingerprint of its content).
        version: i64,
        /// The schema version it is stored at (0: a plain document, read at the version its
        /// collection declares for those).
        schema_version: i64,
        /// Its fields, `_id` included, system fields left out.
        value: Document,
    },
    /// A tombstone: reads fail `Deleted`.
    Deleted {
        /// The tombstone's version.
        version: i64,
    },
    /// Nothing: reads fail `NotFound` (a creation that has not committed, or a fence's
    /// placeholder).
    Absent,
}

/// The transaction holding a document, and what happens next.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct HoldInfo {
    /// The holding transaction.
    pub txn: ObjectId,
    /// What the hold stands for: `insert`, `update` (also an adjust or a rewrite), `delete` or
    /// `check` (`unreadable` when the hold cannot be read).
    pub op: &'static str,
    /// Whether the hold is a fence: a resolver's, so that the transaction's change can no longer
    /// land (it carries no change).
    pub fence: bool,
    /// Whether the hold is the transaction's creation of the document, made after its deadline
    /// (it never counts).
    pub created_late: bool,
    /// The version stored with the hold on (the staged change's, if the hold carries one).
    pub stored_version: i64,
    /// The deadline the hold carries (server time): the transaction's.
    #[serde(serialize_with = "ser::opt_time")]
    pub hold_deadline: Option<DateTime>,
    /// The transaction's record (`None`: it has none).
    pub record: Option<RecordInfo>,
    /// The transaction's other documents, each with where it stands (without a record, the
    /// other documents it holds).
    pub others: Vec<DocumentState>,
    /// What happens next to the transaction, and when.
    pub next: Next,
    /// What is particular to this document's hold (a fence, a late creation), if anything.
    pub note: Option<String>,
}

/// Explains document `id` of `collection`.
pub(crate) async fn why(env: &Env, collection: &str, id: Bson) -> Result<Explanation, TxnError> {
    check_managed(env, collection).await?;
    let shown = show_id(&id);
    let fail = |e| TxnError::database(None, "read the document", e);
    let stored_doc = env
        .collection(None, collection)
        .await?
        .find_one(doc! { "_id": id.clone() })
        .await
        .map_err(fail)?
        .ok_or_else(|| TxnError::UnknownDocument {
            collection: collection.to_string(),
            id: shown.clone(),
        })?;
    let malformed = |reason: String| {
        TxnError::document(
            None,
            RepoError::Malformed {
                collection: collection.to_string(),
                id: shown.clone(),
                reason,
            },
        )
    };
    let sys = SystemFields::read(&stored_doc).map_err(malformed)?;
    let now = env.now(sys.active_txn).await?;
    let committed = resolve::committed(&env.store, collection, stored_doc.clone())
        .await
        .map_err(|source| match sys.active_txn {
            Some(holder) => TxnError::hold(Some(holder), collection, &id, holder, source),
            None => malformed(source.to_string()),
        })?;
    let committed = match committed {
        Committed::Live(mut value) => {
            let sys = SystemFields::read(&value).map_err(malformed)?;
            fields::strip(&mut value);
            CommittedValue::Live {
                version: sys.version,
                schema_version: sys.schema_version,
                value,
            }
        }
        Committed::Deleted(version) => CommittedValue::Deleted { version },
        Committed::Absent => CommittedValue::Absent,
    };
    let hold = match sys.active_txn {
        None => None,
        Some(txn) => {
            Some(hold_info(env, collection, &id, &stored_doc, txn, sys.version, now).await?)
        }
    };
    Ok(Explanation {
        collection: collection.to_string(),
        id,
        now,
        committed,
        hold,
    })
}

/// What holds document `id` of `collection` (stored as `found`, at `version`) for transaction
/// `txn`, and what happens next.
async fn hold_info(
    env: &Env,
    collection: &str,
    id: &Bson,
    found: &Document,
    txn: ObjectId,
    version: i64,
    now: DateTime,
) -> Result<HoldInfo, TxnError> {
    let hold = held::read_hold(found).ok();
    let stored = stored(env, txn, now).await?;
    let next = next(now, stored.record.as_ref(), &stored.documents);
    let others = stored
        .documents
        .into_iter()
        .filter(|d| !(d.collection == collection && ids::same(&d.id, id)))
        .collect();
    Ok(HoldInfo {
        txn,
        op: hold.as_ref().map_or("unreadable", |h| h.op.as_str()),
        fence: hold.as_ref().is_some_and(|h| h.fence),
        created_late: hold.as_ref().is_some_and(Hold::created_late),
        stored_version: version,
        hold_deadline: hold.as_ref().map(|h| h.exp),
        record: stored.record,
        others,
        next,
        note: hold.as_ref().and_then(note),
    })
}

/// What is particular to a hold that carries no change to commit.
fn note(hold: &Hold) -> Option<String> {
    if hold.fence {
        let reads = if hold.op == held::HoldKind::Insert {
            "it is a placeholder, and reads as absent"
        } else {
            "it reads as the document under it"
        };
        return Some(format!(
            "This document carries a fence, not the transaction's change: a resolver deciding the \
             transaction after its deadline put it there so that the change can no longer land. \
             It changes nothing ({reads}) and goes with the rest of the transaction."
        ));
    }
    if hold.created_late() {
        let at = hold
            .at
            .map_or_else(String::new, |at| format!(" at {}", rfc3339(at)));
        return Some(format!(
            "The transaction created this document{at}, after its deadline {}: the creation \
             never counts, reads as absent and is removed with the rest of the transaction.",
            rfc3339(hold.exp)
        ));
    }
    None
}

/// Refuses a collection mongotx does not manage in the store's database.
pub(crate) async fn check_managed(env: &Env, collection: &str) -> Result<(), TxnError> {
    let db = env.store.database();
    let managed = meta::managed(db)
        .await
        .map_err(|e| TxnError::database(None, "list managed collections", e))?;
    if managed.iter().any(|m| m == collection) {
        return Ok(());
    }
    Err(TxnError::UnknownCollection {
        database: db.name().to_string(),
        collection: collection.to_string(),
        managed,
    })
}
