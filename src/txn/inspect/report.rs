//! One transaction as it stands: its record, its worklist with where each document stands, and
//! what happens next (`mongotx txn`). Read only.

use bson::{doc, oid::ObjectId, DateTime, Document};
use serde::Serialize;

use crate::txn::error::TxnError;
use crate::txn::inspect::documents::{entry_states, held_by};
use crate::txn::inspect::model::{ser, DocumentState, RecordInfo};
use crate::txn::inspect::next::{next, Next};
use crate::txn::recovery::Env;
use crate::txn::worklist::ActiveTransaction;

/// A transaction's record, its documents and what happens next to it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct TxnReport {
    /// The transaction.
    pub txn: ObjectId,
    /// The server's time the report was made at.
    #[serde(serialize_with = "ser::time")]
    pub now: DateTime,
    /// Its record (`None`: it has none, and `documents` are the holds found of it). Records
    /// carry no coordinator's name: a coordinator is whoever runs `commit`, and the record is
    /// all anyone needs to settle it.
    pub record: Option<RecordInfo>,
    /// Its documents: the worklist's, in lock order, each with where it stands; without a record,
    /// the documents of managed collections it holds.
    pub documents: Vec<DocumentState>,
    /// What happens next, and when.
    pub next: Next,
}

/// What is stored of a transaction.
pub(crate) struct Stored {
    /// The record whole, as read (`None`: there is none).
    pub(crate) raw: Option<Document>,
    /// The record, parsed.
    pub(crate) parsed: Option<ActiveTransaction>,
    /// The record read for a person.
    pub(crate) record: Option<RecordInfo>,
    /// Where each document stands (see [`TxnReport::documents`]).
    pub(crate) documents: Vec<DocumentState>,
}

impl Stored {
    /// Whether nothing at all is stored of the transaction.
    pub(crate) fn is_empty(&self) -> bool {
        self.raw.is_none() && self.documents.is_empty()
    }
}

/// Reads what is stored of transaction `txn`, its deadline measured at `now`.
pub(crate) async fn stored(env: &Env, txn: ObjectId, now: DateTime) -> Result<Stored, TxnError> {
    let raw = env
        .records(Some(txn))
        .await?
        .find_one(doc! { "_id": txn })
        .await
        .map_err(|e| TxnError::database(Some(txn), "read the record", e))?;
    let Some(raw) = raw else {
        return Ok(Stored {
            raw: None,
            parsed: None,
            record: None,
            documents: held_by(env, txn).await?,
        });
    };
    let parsed =
        bson::from_document::<ActiveTransaction>(raw.clone()).map_err(|e| TxnError::Malformed {
            txn,
            reason: e.to_string(),
        })?;
    Ok(Stored {
        record: Some(RecordInfo::new(&parsed, &raw, now)),
        documents: entry_states(env, txn, parsed.state, &parsed.entries).await?,
        raw: Some(raw),
        parsed: Some(parsed),
    })
}

/// The report on transaction `txn`; [`TxnError::UnknownTransaction`] when nothing is stored of
/// it.
pub(crate) async fn report(env: &Env, txn: ObjectId) -> Result<TxnReport, TxnError> {
    let now = env.now(Some(txn)).await?;
    let found = stored(env, txn, now).await?;
    if found.is_empty() {
        return Err(TxnError::UnknownTransaction { txn });
    }
    Ok(TxnReport {
        txn,
        now,
        next: next(now, found.record.as_ref(), &found.documents),
        record: found.record,
        documents: found.documents,
    })
}
