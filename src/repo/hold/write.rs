//! One conditional single-document write, as data: built by pure functions (holds, worklist
//! entries), run by [`run`], or with others in one round by [`run_together`]. Keeping the write
//! apart from its execution lets the protocol's decisions be unit-tested without a server and
//! lets every party send exactly the same write.
//!
//! # One message per round
//!
//! A transaction's applies (and its finishes) are independent single-document writes sent at
//! once. Sent as one command each, a round of k writes costs k messages through the network, the
//! driver's connection pool and the server's command dispatch: on a busy host that per-message
//! cost, not the network's latency, is what makes a 16-document round slower than one write.
//! MongoDB 8.0 has a command for many writes on any collections in one message (`bulkWrite`,
//! `Client::bulk_write` in the driver), so [`run_together`] sends the round as one unordered
//! `bulkWrite` there, and falls back to one command per write, all at once, on older servers.
//! Nothing about the protocol changes: each write in the bulk is still its own single-document
//! atomic write, conditional as before, executed in some order, possibly late, possibly not at
//! all (an unordered bulk keeps going past a refused write), exactly what the protocol already
//! allows for separate commands.

use bson::Document;
use futures::future::join_all;
use mongodb::error::{Error, ErrorKind, Result, WriteFailure};
use mongodb::options::{
    DeleteOneModel, ReplaceOneModel, ReturnDocument, UpdateOneModel, WriteModel,
};
use mongodb::results::VerboseBulkWriteResult;
use mongodb::Collection;

use crate::repo::store::Store;

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
    /// `update_one(filter, pipeline)`: an update computed from the stored document by the server.
    Pipeline(Document, Vec<Document>),
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
        Write::Pipeline(filter, pipeline) => coll
            .update_one(filter.clone(), pipeline.clone())
            .await
            .map(|r| r.matched_count),
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

/// Runs `writes` (each on its collection) in one round and returns each one's result in order, as
/// [`run`] would have: one `bulkWrite` command where the server has it and the store allows it,
/// otherwise one command each, all sent at once. (A create in a bulk is an upsert that reports
/// only whether it made the document; a caller that needs the document runs [`create`] itself.)
pub(crate) async fn run_together(
    store: &Store,
    writes: &[(Collection<Document>, Write)],
) -> Vec<Result<u64>> {
    if writes.len() > 1 && store.batches_writes() {
        match bulk(store, writes).await {
            Some(results) => return results,
            // Refused before anything ran: the server has no `bulkWrite`.
            None => store.no_bulk_write(),
        }
    }
    join_all(writes.iter().map(|(coll, write)| run(coll, write))).await
}

/// The round as one unordered `bulkWrite`; `None` when the server does not have the command.
async fn bulk(store: &Store, writes: &[(Collection<Document>, Write)]) -> Option<Vec<Result<u64>>> {
    let models = writes.iter().map(|(coll, write)| model(coll, write));
    let mut action = store
        .database()
        .client()
        .bulk_write(models)
        .ordered(false)
        .verbose_results();
    // Every collection of a round carries the protocol's concern.
    if let Some(concern) = writes.first().and_then(|(coll, _)| coll.write_concern()) {
        action = action.write_concern(concern.clone());
    }
    let n = writes.len();
    match action.await {
        Ok(done) => Some(
            (0..n)
                .map(|i| counted(&done, i).ok_or_else(|| unreported(i)))
                .collect(),
        ),
        Err(e) if lacks_bulk_write(&e) => None,
        Err(e) => Some((0..n).map(|i| one_of(&e, i)).collect()),
    }
}

fn model(coll: &Collection<Document>, write: &Write) -> WriteModel {
    let namespace = coll.namespace();
    match write {
        Write::Update(filter, update) => UpdateOneModel::builder()
            .namespace(namespace)
            .filter(filter.clone())
            .update(update.clone())
            .build()
            .into(),
        Write::Create(filter, update) => UpdateOneModel::builder()
            .namespace(namespace)
            .filter(filter.clone())
            .update(update.clone())
            .upsert(true)
            .build()
            .into(),
        Write::Replace(filter, replacement) => ReplaceOneModel::builder()
            .namespace(namespace)
            .filter(filter.clone())
            .replacement(replacement.clone())
            .build()
            .into(),
        Write::Delete(filter) => DeleteOneModel::builder()
            .namespace(namespace)
            .filter(filter.clone())
            .build()
            .into(),
        Write::Pipeline(filter, pipeline) => UpdateOneModel::builder()
            .namespace(namespace)
            .filter(filter.clone())
            .update(pipeline.clone())
            .build()
            .into(),
    }
}

/// What write `i` of a bulk matched, created or deleted, if the server reported it.
fn counted(done: &VerboseBulkWriteResult, i: usize) -> Option<u64> {
    let updated = |r: &mongodb::results::UpdateResult| {
        if r.upserted_id.is_some() {
            1
        } else {
            r.matched_count
        }
    };
    done.update_results
        .get(&i)
        .map(updated)
        .or_else(|| done.delete_results.get(&i).map(|r| r.deleted_count))
}

/// Whether a bulk was refused because the server has no `bulkWrite` (before 8.0, or a
/// wire-compatible server without it): then none of its writes ran.
fn lacks_bulk_write(e: &Error) -> bool {
    const COMMAND_NOT_FOUND: i32 = 59;
    matches!(e.kind.as_ref(), ErrorKind::IncompatibleServer { .. })
        || crate::server::codes::error_code(e) == Some(COMMAND_NOT_FOUND)
}

/// Write `i`'s own result out of a bulk that failed as a whole or in part.
fn one_of(e: &Error, i: usize) -> Result<u64> {
    let ErrorKind::BulkWrite(failure) = e.kind.as_ref() else {
        // The whole command failed (a network error, say): each write may or may not have run.
        return Err(e.clone());
    };
    if let Some(refused) = failure.write_errors.get(&i) {
        return Err(ErrorKind::Write(WriteFailure::WriteError(refused.clone())).into());
    }
    let done = match &failure.partial_result {
        Some(mongodb::error::PartialBulkWriteResult::Verbose(done)) => counted(done, i),
        _ => None,
    };
    match (done, failure.write_concern_errors.first()) {
        // Ran, but not as durably as asked: as `run` reports it.
        (Some(_), Some(concern)) => {
            Err(ErrorKind::Write(WriteFailure::WriteConcernError(concern.clone())).into())
        }
        (Some(n), None) => Ok(n),
        // Not reported (reading the results failed part-way): unknown, as after a lost reply.
        (None, _) => Err(std::error::Error::source(e)
            .and_then(|source| source.downcast_ref::<Error>())
            .cloned()
            .unwrap_or_else(|| e.clone())),
    }
}

fn unreported(i: usize) -> Error {
    Error::custom(format!("bulkWrite reported nothing for its write {i}"))
}
