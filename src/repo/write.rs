//! One conditional single-document write, as data: built by pure functions (holds, worklist
//! entries), run by [`run`]. Keeping the write apart from its execution lets the protocol's
//! decisions be unit-tested without a server and lets every party send exactly the same write.

use bson::Document;
use mongodb::Collection;

/// A filter and the write to run with it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Write {
    /// `insert_one` of this document.
    Insert(Document),
    /// `update_one(filter, update)`.
    Update(Document, Document),
    /// `replace_one(filter, replacement)`.
    Replace(Document, Document),
    /// `delete_one(filter)`.
    Delete(Document),
}

/// Runs `write` on `coll`; the result is how many documents it matched (1 for an insert).
pub(crate) async fn run(coll: &Collection<Document>, write: &Write) -> mongodb::error::Result<u64> {
    match write {
        Write::Insert(doc) => coll.insert_one(doc).await.map(|_| 1),
        Write::Update(filter, update) => coll
            .update_one(filter.clone(), update.clone())
            .await
            .map(|r| r.matched_count),
        Write::Replace(filter, replacement) => coll
            .replace_one(filter.clone(), replacement)
            .await
            .map(|r| r.matched_count),
        Write::Delete(filter) => coll
            .delete_one(filter.clone())
            .await
            .map(|r| r.deleted_count),
    }
}
