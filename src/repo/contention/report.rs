//! Reading the contention record: the collections with the most conflicts and aborts over the
//! last minutes, summed over every instance, with their most frequent sampled documents.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bson::{doc, Bson, Document};
use futures::TryStreamExt;
use serde::Serialize;

use crate::collections::CONTENTION_COLLECTION;
use crate::repo::contention::flush::bucket_of;
use crate::repo::error::RepoError;
use crate::repo::format;
use crate::repo::store::Store;
use crate::server::clock;

/// Sampled documents a report shows per collection, most frequent first.
const DOCUMENTS_SHOWN: usize = 5;

/// The contention record over a span of time: who conflicts most, across every instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ContentionReport {
    /// The server's time of the reading (this process's estimate of it).
    pub now: chrono::DateTime<chrono::Utc>,
    /// The start of the oldest minute counted: the minute `since` before `now` falls in.
    pub since: chrono::DateTime<chrono::Utc>,
    /// Collections with any conflict or abort in the span, before `top` cut the list.
    pub collections_seen: usize,
    /// Conflicts in the span, over every collection.
    pub conflicts: u64,
    /// Aborts in the span, over every collection (an abort counts in each collection its
    /// transaction touched).
    pub aborts: u64,
    /// The collections with the most conflicts and aborts together, most first (ties by name).
    pub collections: Vec<CollectionContention>,
}

/// One collection's conflicts and aborts over the span.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CollectionContention {
    /// The collection.
    pub collection: String,
    /// Writes or staged changes that named a version the document no longer had.
    pub conflicts: u64,
    /// Transaction attempts rolled back that touched the collection.
    pub aborts: u64,
    /// Minutes of the span with any (each a document of the record).
    pub minutes: u64,
    /// The most frequent documents among the sampled ones, most first (ties by id).
    pub documents: Vec<SampledDocument>,
}

/// A document sampled in conflicts or aborts of its collection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct SampledDocument {
    /// Its id, as errors show ids (a string in quotes, any other value as extended JSON).
    pub id: String,
    /// How often it was sampled: a sample, not a count of its conflicts (each instance keeps a
    /// few ids per collection per flush), but a document that conflicts more is sampled more.
    pub samples: u64,
}

/// Reads the contention record of `store`'s database over the last `since` (from the start of
/// the minute that falls in, by the server's clock) and ranks its collections by conflicts and
/// aborts together, keeping the `top` first. Writes nothing; a database without a record reads
/// as one without contention. A document of the record of a stored format newer than this
/// process reads is refused ([`RepoError::Format`]).
///
/// ```no_run
/// # async fn demo(store: mongotx::Store) -> Result<(), mongotx::RepoError> {
/// use std::time::Duration;
///
/// let report = mongotx::admin::contention(&store, Duration::from_secs(3600), 10).await?;
/// for c in &report.collections {
///     println!("{}: {} conflicts, {} aborts", c.collection, c.conflicts, c.aborts);
/// }
/// # Ok(()) }
/// ```
pub async fn contention(
    store: &Store,
    since: Duration,
    top: usize,
) -> Result<ContentionReport, RepoError> {
    let now = store.now().await.map_err(|source| RepoError::Clock {
        collection: CONTENTION_COLLECTION.to_string(),
        source,
    })?;
    let from = bucket_of(clock::minus(now, since));
    let fail = |e| RepoError::database(CONTENTION_COLLECTION, "*", "read the contention record", e);
    let docs: Vec<Document> = store
        .database()
        .collection::<Document>(CONTENTION_COLLECTION)
        .find(doc! { "at": { "$gte": from } })
        .await
        .map_err(fail)?
        .try_collect()
        .await
        .map_err(fail)?;
    let mut by_collection: BTreeMap<String, (CollectionContention, HashMap<String, u64>)> =
        BTreeMap::new();
    for d in &docs {
        // A minute of a newer format may count something else: the report is refused rather
        // than summed wrongly.
        format::check_doc(d, store.reads_format(), CONTENTION_COLLECTION)?;
        let Ok(name) = d.get_str("collection") else {
            continue;
        };
        let (summary, ids) = by_collection.entry(name.to_string()).or_insert_with(|| {
            (
                CollectionContention {
                    collection: name.to_string(),
                    conflicts: 0,
                    aborts: 0,
                    minutes: 0,
                    documents: Vec::new(),
                },
                HashMap::new(),
            )
        });
        summary.conflicts = summary.conflicts.saturating_add(count(d, "conflicts"));
        summary.aborts = summary.aborts.saturating_add(count(d, "aborts"));
        summary.minutes += 1;
        for id in d.get_array("ids").into_iter().flatten() {
            if let Bson::String(id) = id {
                *ids.entry(id.clone()).or_default() += 1;
            }
        }
    }
    let mut collections: Vec<CollectionContention> = by_collection
        .into_values()
        .map(|(mut summary, ids)| {
            let mut documents: Vec<SampledDocument> = ids
                .into_iter()
                .map(|(id, samples)| SampledDocument { id, samples })
                .collect();
            documents.sort_by(|a, b| b.samples.cmp(&a.samples).then_with(|| a.id.cmp(&b.id)));
            documents.truncate(DOCUMENTS_SHOWN);
            summary.documents = documents;
            summary
        })
        .collect();
    let total = |c: &CollectionContention| c.conflicts.saturating_add(c.aborts);
    collections.sort_by(|a, b| {
        total(b)
            .cmp(&total(a))
            .then_with(|| a.collection.cmp(&b.collection))
    });
    let report = ContentionReport {
        now: now.to_chrono(),
        since: from.to_chrono(),
        collections_seen: collections.len(),
        conflicts: collections.iter().map(|c| c.conflicts).sum(),
        aborts: collections.iter().map(|c| c.aborts).sum(),
        collections: collections.into_iter().take(top).collect(),
    };
    Ok(report)
}

/// A counter of a document of the record (0 if absent or not a whole number).
fn count(d: &Document, field: &str) -> u64 {
    let n = match d.get(field) {
        Some(Bson::Int64(n)) => *n,
        Some(Bson::Int32(n)) => i64::from(*n),
        _ => 0,
    };
    u64::try_from(n).unwrap_or(0)
}
