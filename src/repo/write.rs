//! One conditional single-document write, as data: built by pure functions (holds, worklist
//! entries), run by [`run`]. Keeping the write apart from its execution lets the protocol's
//! decisions be unit-tested without a server and lets every party send exactly the same write.

use bson::Document;
use mongodb::options::ReturnDocument;
use mongodb::Collection;

/// A filter and the write to run with it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Write {
    /// `update_one(filter, update)`.
    Update(Document, Document),
    /// `replace_one(filter, replacement)`.
    Replace(Document, Document),
    /// `delete_one(filter)`.
    Delete(Document),
    /// `findAndModify(filter, update, upsert)` whose filter matches no existing document: it
    /// creates one, or fails with a duplicate key when the id is taken.
    Create(Document, Document),
}

/// Runs `write` on `coll`; the result is how many documents it matched (1 for a create).
pub(crate) async fn run(coll: &Collection<Document>, write: &Write) -> mongodb::error::Result<u64> {
    match write {
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
        Write::Create(..) => create(coll, write).await.map(|_| 1),
    }
}

/// Runs a [`Write::Create`] and returns the document it created.
pub(crate) async fn create(
    coll: &Collection<Document>,
    write: &Write,
) -> mongodb::error::Result<Option<Document>> {
    let Write::Create(filter, update) = write else {
        return Err(mongodb::error::Error::custom("not a create"));
    };
    coll.find_one_and_update(filter.clone(), update.clone())
        .upsert(true)
        .return_document(ReturnDocument::After)
        .await
}
