//! Writing the contention record: the background task a store starts after the first event
//! since its last flush, which waits for the interval (or for shutdown), takes the counts and
//! adds them to the collection-and-minute documents of the record.
//!
//! The stored format (`repo::format`): a flush reads the format its store writes before it
//! writes anything (an instance of an older release in a fleet switched to a newer format
//! writes nothing), marks each document it adds to with it (nothing for format 1), and adds only
//! to a document of a format it reads; one of a newer format collides with the upsert, and is
//! refused, by format, in the failure logged.

use std::collections::BTreeMap;
use std::time::Duration;

use bson::{doc, DateTime, Document};
use mongodb::options::IndexOptions;
use mongodb::{Collection, IndexModel};

use crate::collections::CONTENTION_COLLECTION;
use crate::repo::contention::tally::Counts;
use crate::repo::error::RepoError;
use crate::repo::format;
use crate::repo::open;
use crate::repo::store::Store;
use crate::server::{clock, codes};

/// The JSON Schema of [`CONTENTION_COLLECTION`] (the project's `schemas/mongotx_contention.json`).
pub const CONTENTION_SCHEMA: &str = include_str!("../../../schemas/mongotx_contention.json");

/// Sampled ids a collection-and-minute document keeps (the newest).
pub(crate) const IDS_PER_BUCKET: i32 = 64;

/// The span of one document of the record.
pub(crate) const BUCKET: Duration = Duration::from_secs(60);

/// How long a document of the record is kept after its minute (by its TTL index).
pub(crate) const RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Starts the flush task of `store`: it waits for the store's interval, or less once shutdown
/// begins, then writes what the store counted meanwhile.
pub(super) fn start(store: &Store) {
    // Events are counted inside async calls, so there is a runtime; if not, the counts wait for
    // the next event that has one.
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        store.inner.contention.unschedule();
        return;
    };
    let (slot, closing) = store.inner.background.flush_slot();
    let store = store.clone();
    runtime.spawn(async move {
        let every = store.inner.contention.every();
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = closing.cancelled() => {}
        }
        flush(&store).await;
        drop(slot);
    });
}

/// Takes what `store` counted and writes it; a failure is logged, and those counts are lost.
async fn flush(store: &Store) {
    let taken = store.inner.contention.take();
    if taken.dropped > 0 {
        tracing::warn!(
            collection = CONTENTION_COLLECTION,
            dropped = taken.dropped,
            "contention record: events of more collections than it counts between two flushes were dropped"
        );
    }
    if taken.counts.is_empty() {
        return;
    }
    if let Err(error) = write(store, &taken.counts).await {
        let (conflicts, aborts) = taken
            .counts
            .values()
            .fold((0, 0), |(c, a), n| (c + n.conflicts, a + n.aborts));
        tracing::warn!(
            collection = CONTENTION_COLLECTION,
            %error,
            conflicts,
            aborts,
            "contention record: the flush failed; these counts are not recorded"
        );
    }
}

/// The record's collection, its validator installed and its indexes made (once per store).
async fn collection(store: &Store) -> Result<Collection<Document>, RepoError> {
    let fail = |operation| move |e| RepoError::database(CONTENTION_COLLECTION, "*", operation, e);
    store
        .inner
        .contention
        .collection()
        .get_or_try_init(|| async {
            let coll = open::validated_protocol_collection(
                store,
                CONTENTION_COLLECTION,
                CONTENTION_SCHEMA,
            )
            .await
            .map_err(fail("open"))?;
            coll.create_indexes([
                IndexModel::builder().keys(doc! { "at": 1 }).build(),
                IndexModel::builder()
                    .keys(doc! { "expires": 1 })
                    .options(IndexOptions::builder().expire_after(Duration::ZERO).build())
                    .build(),
            ])
            .await
            .map_err(fail("create indexes"))?;
            Ok(coll)
        })
        .await
        .cloned()
}

/// The start of the minute `at` falls in.
pub(crate) fn bucket_of(at: DateTime) -> DateTime {
    let span = i64::try_from(BUCKET.as_millis()).unwrap_or(60_000);
    DateTime::from_millis(at.timestamp_millis().div_euclid(span) * span)
}

/// Adds `counts` to the documents of this minute, one upsert per collection, all at once.
async fn write(store: &Store, counts: &BTreeMap<String, Counts>) -> Result<(), RepoError> {
    let writes = store.writes_format().await?;
    let reads = store.reads_format();
    let coll = collection(store).await?;
    let now = store.now().await.map_err(|source| RepoError::Clock {
        collection: CONTENTION_COLLECTION.to_string(),
        source,
    })?;
    let at = bucket_of(now);
    let expires = clock::plus(at, RETENTION);
    let writes = counts.iter().map(|(collection, n)| {
        let mut update = doc! {
            "$inc": {
                "conflicts": i64::try_from(n.conflicts).unwrap_or(i64::MAX),
                "aborts": i64::try_from(n.aborts).unwrap_or(i64::MAX),
                "flushes": 1_i64,
            },
            "$setOnInsert": { "collection": collection, "at": at, "expires": expires },
        };
        if !n.sample.is_empty() {
            update.insert(
                "$push",
                doc! { "ids": { "$each": &n.sample, "$slice": -IDS_PER_BUCKET } },
            );
        }
        let update = format::mark_update(update, writes);
        let coll = coll.clone();
        async move {
            let id = doc! { "c": collection, "at": at };
            let filter = format::guard(doc! { "_id": id.clone() }, reads);
            let fail = |e| RepoError::database(CONTENTION_COLLECTION, collection, "flush", e);
            let mut sent = coll
                .update_one(filter.clone(), update.clone())
                .upsert(true)
                .await;
            // Two instances creating the minute's document at once: the loser adds to it. Or
            // the document is of a newer format, which the guard kept from matching: refused.
            if sent
                .as_ref()
                .is_err_and(|e| codes::error_code(e) == Some(codes::DUPLICATE_KEY))
            {
                let found = coll.find_one(doc! { "_id": id }).await.map_err(fail)?;
                if let Some(found) = &found {
                    format::check_doc(found, reads, CONTENTION_COLLECTION)?;
                }
                sent = coll.update_one(filter, update).upsert(true).await;
            }
            sent.map(|_| ()).map_err(fail)
        }
    });
    for written in futures::future::join_all(writes).await {
        written?;
    }
    Ok(())
}
