//! Reading many documents at once, on committed values: [`Query`] (filter, sort, skip, limit,
//! projection) and the repository's `find`, `find_stream` and `count`. The aggregation passes they
//! run, and why their answers are committed values, are in `repo::query`.

use bson::{doc, oid::ObjectId, Bson, Document};
use futures::{Stream, StreamExt, TryStreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::metrics::{self, Access};
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields;
use crate::repo::outcome::TxnStatus;
use crate::repo::projection;
use crate::repo::query;
use crate::repo::repository::{Repository, Stamped};

/// A query over live documents, evaluated on committed values: filter, sort, skip, limit and
/// projection, as in the driver's `find`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Query {
    filter: Document,
    sort: Option<Document>,
    skip: u64,
    limit: Option<i64>,
    projection: Option<Document>,
}

impl Query {
    /// Matches every live document.
    pub fn new() -> Query {
        Query::default()
    }

    /// Restricts to documents matching a MongoDB filter.
    pub fn filter(mut self, filter: Document) -> Query {
        self.filter = filter;
        self
    }

    /// Sorts the results (MongoDB sort document, e.g. `doc! { "name": 1 }`).
    pub fn sort(mut self, sort: Document) -> Query {
        self.sort = Some(sort);
        self
    }

    /// Skips the first `skip` matching documents (in sort order).
    pub fn skip(mut self, skip: u64) -> Query {
        self.skip = skip;
        self
    }

    /// Returns at most `limit` documents (0 means no limit, as in the driver). A negative limit
    /// is refused by [`Repository::find`] (`InvalidQuery`): the driver reads it as "one batch of
    /// that size", which a query on committed values has no use for.
    pub fn limit(mut self, limit: i64) -> Query {
        self.limit = (limit != 0).then_some(limit);
        self
    }

    /// Returns only some fields (`doc! { "owner": 1 }`) or all but some (`doc! { "note": 0 }`)
    /// of the caller's own; the result type must accept the documents so cut (fields it needs
    /// `Option` or `#[serde(default)]`). A stored document of an older schema version is upgraded
    /// from its projected fields. Computed fields, system fields and excluding `_id` are refused
    /// (`InvalidQuery`).
    pub fn projection(mut self, projection: Document) -> Query {
        self.projection = Some(projection);
        self
    }

    /// The sum of skip and limit, the rows a first pass must keep.
    fn window(&self) -> Option<i64> {
        let skip = i64::try_from(self.skip).unwrap_or(i64::MAX);
        self.limit.map(|l| l.saturating_add(skip))
    }
}

/// The body of [`Repository::find`].
pub(crate) async fn find<T>(
    repo: &Repository<T>,
    query: Query,
) -> Result<Vec<Stamped<T>>, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    check_query(repo, &query)?;
    let (filter, sort) = (&query.filter, query.sort.as_ref());
    let window = query.window();
    // Under a limit the whole first pass fits one reply (held candidates are a few bytes).
    let batch = window.and_then(|l| u32::try_from(l.saturating_add(query::HOLDER_BATCH)).ok());
    let mut first = query::holders_pass(filter, sort, window);
    if let Some(projection) = &query.projection {
        first.extend(projection::projection_stages(projection));
    }
    let rows = aggregate(repo, first, batch).await?;
    let mut holders: Vec<ObjectId> = rows.iter().filter_map(query::unknown_holder).collect();
    if holders.is_empty() {
        // The pass left room for held candidates beyond the limit; there were none.
        let limit = query
            .limit
            .map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(0));
        let skip = usize::try_from(query.skip).unwrap_or(usize::MAX);
        return rows
            .into_iter()
            .skip(skip)
            .take(limit)
            .map(|row| decode_row(repo, row))
            .collect();
    }
    // Under a limit the held candidates come first; a pass they filled may have left some.
    if window.is_some_and(|l| holders.len() as i64 >= l.saturating_add(query::HOLDER_BATCH)) {
        let all = aggregate(repo, query::holders_of(filter), Some(u32::MAX >> 1)).await?;
        holders.extend(all.iter().filter_map(|row| row.get_object_id("_id").ok()));
    }
    let committed = committed_among(repo, holders).await?;
    let batch = query.limit.and_then(|l| u32::try_from(l).ok());
    aggregate(repo, values_stages(repo, &query, &committed), batch)
        .await?
        .into_iter()
        .map(|row| decode_row(repo, row))
        .collect()
}

/// The body of [`Repository::find_stream`].
pub(crate) async fn find_stream<T>(
    repo: &Repository<T>,
    query: Query,
) -> Result<impl Stream<Item = Result<Stamped<T>, RepoError>> + Send + 'static, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
    T: 'static,
{
    check_query(repo, &query)?;
    let committed = committed_holders(repo, &query.filter).await?;
    let mut action = repo.coll.aggregate(values_stages(repo, &query, &committed));
    if let Some(batch) = query.limit.and_then(|l| u32::try_from(l).ok()) {
        action = action.batch_size(batch);
    }
    let cursor = action.await.map_err(|e| repo.db_error("*", "find", e))?;
    let repo = repo.clone();
    Ok(cursor.map(move |row| match row {
        Ok(row) => decode_row(&repo, row),
        Err(e) => Err(repo.db_error("*", "find", e)),
    }))
}

/// The body of [`Repository::count`].
pub(crate) async fn count<T>(repo: &Repository<T>, query: Query) -> Result<u64, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    check_query(repo, &query)?;
    let committed = committed_holders(repo, &query.filter).await?;
    let mut stages = values_stages(
        repo,
        &Query {
            projection: None,
            sort: None,
            ..query
        },
        &committed,
    );
    stages.push(doc! { "$count": "n" });
    let rows = aggregate(repo, stages, None).await?;
    let n = rows.first().and_then(|r| match r.get("n") {
        Some(Bson::Int32(n)) => u64::try_from(*n).ok(),
        Some(Bson::Int64(n)) => u64::try_from(*n).ok(),
        Some(Bson::Double(n)) if *n >= 0.0 => Some(*n as u64),
        _ => None,
    });
    Ok(n.unwrap_or(0))
}

fn check_query<T>(repo: &Repository<T>, query: &Query) -> Result<(), RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let problem = query::problem(&query.filter, query.sort.as_ref(), query.limit).or_else(|| {
        query
            .projection
            .as_ref()
            .and_then(projection::projection_problem)
    });
    match problem {
        Some(reason) => Err(RepoError::InvalidQuery {
            collection: repo.name().to_string(),
            reason,
        }),
        None => Ok(()),
    }
}

/// The committed transactions among those holding documents the filter can match.
async fn committed_holders<T>(
    repo: &Repository<T>,
    filter: &Document,
) -> Result<Vec<ObjectId>, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let holders: Vec<ObjectId> = aggregate(repo, query::holders_of(filter), Some(u32::MAX >> 1))
        .await?
        .iter()
        .filter_map(|row| row.get_object_id("_id").ok())
        .collect();
    committed_among(repo, holders).await
}

/// Which of `holders` committed (one batch of status reads).
async fn committed_among<T>(
    repo: &Repository<T>,
    mut holders: Vec<ObjectId>,
) -> Result<Vec<ObjectId>, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    holders.sort();
    holders.dedup();
    let Some(first) = holders.first().copied() else {
        return Ok(Vec::new());
    };
    metrics::holds_met(repo.name(), Access::Read, holders.len() as u64);
    let statuses = repo
        .store
        .inner
        .resolver
        .statuses(&repo.store, &holders)
        .await
        .map_err(|source| repo.hold_error("*", first, source))?;
    Ok(statuses
        .into_iter()
        .filter(|(_, status)| *status == TxnStatus::Committed)
        .map(|(txn, _)| txn)
        .collect())
}

/// The values pass of `query`, with `committed` taken as committed.
fn values_stages<T>(_repo: &Repository<T>, query: &Query, committed: &[ObjectId]) -> Vec<Document>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let mut stages = query::values_pass(&query.filter, query.sort.as_ref(), None, committed);
    if query.skip > 0 {
        stages.push(doc! { "$skip": i64::try_from(query.skip).unwrap_or(i64::MAX) });
    }
    if let Some(limit) = query.limit {
        stages.push(doc! { "$limit": limit });
    }
    if let Some(projection) = &query.projection {
        stages.extend(projection::projection_stages(projection));
    }
    stages
}

async fn aggregate<T>(
    repo: &Repository<T>,
    stages: Vec<Document>,
    batch: Option<u32>,
) -> Result<Vec<Document>, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let mut action = repo.coll.aggregate(stages);
    if let Some(batch) = batch {
        action = action.batch_size(batch);
    }
    // A filter the server cannot read is refused before it is sent (`query::problem`); what
    // the server still refuses is reported as its error, whole, as the source.
    action
        .await
        .map_err(|e| repo.db_error("*", "find", e))?
        .try_collect()
        .await
        .map_err(|e| repo.db_error("*", "find", e))
}

fn decode_row<T>(repo: &Repository<T>, mut row: Document) -> Result<Stamped<T>, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    row.remove(query::KNOWN_TAG);
    let id = row.get("_id").cloned().unwrap_or(Bson::Null);
    let shown = show_id(&id);
    if row.remove(query::UNREADABLE_TAG).is_some() {
        return Err(repo.malformed(
            &shown,
            format!(
                "it is held (`{}`) but its hold `{}` is missing or not a document",
                fields::ACTIVE_TXN,
                fields::HOLD
            ),
        ));
    }
    let whole = match row.remove(projection::ROOT_TAG) {
        Some(Bson::Document(mut whole)) => {
            whole.remove(query::KNOWN_TAG);
            Some(whole)
        }
        _ => None,
    };
    let mut stamped = repo.decode(&id, &shown, row)?;
    if let Some(whole) = whole.filter(|_| stamped.is_plain()) {
        stamped.version = fields::fingerprint(&whole);
    }
    Ok(stamped)
}
