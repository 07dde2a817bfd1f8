//! The lock-wait write path of update, adjust, replace and delete: one conditional write on the
//! happy path; when it matches nothing, the document is read to say why, and the write fails (not
//! found, deleted, changed, schema too new), waits for or resolves the hold it met (bounded by the
//! store's lock-wait policy), upgrades an older shape in memory and writes it whole, stamps a plain
//! document with the change (conditional on its whole content: see `repo::plain`), or goes again.

use bson::{doc, oid::ObjectId, Bson, Document};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::metrics::{self, Access};
use crate::repo::checks;
use crate::repo::contention;
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields;
use crate::repo::hold::resolve::{self, Settled};
use crate::repo::hold::tombstone;
use crate::repo::plain;
use crate::repo::repository::{other_index, Change, Repository, Waiter};
use crate::server::codes;

/// What a failed conditional write should do next, after looking at the document.
enum Next {
    Retry,
    Wait(ObjectId),
    Fail(RepoError),
    Upgrade(Document, i64),
    /// A plain document with the content the caller read (its fingerprint matched).
    Adopt(Document),
}

pub(super) async fn write<T>(
    repo: &Repository<T>,
    id: Bson,
    expected: i64,
    change: Change<'_>,
) -> Result<i64, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let shown = show_id(&id);
    let new_version = expected + 1;
    let current = repo.spec.schema_version();
    let filter = happy_filter(repo, &id, expected, &change);
    let mut waiter = Waiter::new(repo.store.inner.lock_wait);
    // A plain document's version is a fingerprint no stored `_version` has: the conditional
    // write could match nothing, so the document is read first.
    let mut skip_write = fields::is_plain_version(expected);
    loop {
        if std::mem::take(&mut skip_write) {
            match diagnose(repo, &id, &shown, expected, current, &change).await? {
                Next::Adopt(stored) => {
                    if let Some(version) = write_plain(repo, &id, &shown, stored, &change).await? {
                        return Ok(version);
                    }
                }
                Next::Fail(error) => return Err(error),
                Next::Wait(holder) => wait_for(repo, &id, &shown, holder, &mut waiter).await?,
                Next::Retry | Next::Upgrade(..) => {}
            }
            if waiter.retry.exhausted() {
                return Err(locked(repo, &shown, &waiter));
            }
            skip_write = true;
            continue;
        }
        let written = match &change {
            Change::Delete => {
                tombstone::write_tombstone(
                    &repo.store,
                    &repo.coll,
                    filter.clone(),
                    &id,
                    current,
                    new_version,
                )
                .await
            }
            Change::Replace(value) => {
                let mut replacement = value.clone();
                checks::stamp(repo, &mut replacement, new_version);
                repo.coll
                    .replace_one(filter.clone(), replacement)
                    .await
                    .map(|r| r.matched_count)
            }
            Change::Update(_) | Change::Adjust(_) => repo
                .coll
                .update_one(filter.clone(), happy_update(repo, new_version, &change))
                .await
                .map(|r| r.matched_count),
        };
        match written {
            Ok(1) => {
                tracing::debug!(collection = repo.name(), id = %shown, version = new_version, "{}", change.verb());
                return Ok(new_version);
            }
            Ok(_) => {}
            Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) => {
                let index = other_index(&e).unwrap_or_else(|| "_id_".to_string());
                return Err(repo.duplicate_key(&shown, index));
            }
            Err(e) => return Err(repo.write_error(&shown, change.verb(), e)),
        }

        match diagnose(repo, &id, &shown, expected, current, &change).await? {
            Next::Fail(error) => return Err(error),
            Next::Upgrade(stored, stored_schema) => {
                if write_upgraded(repo, &id, &shown, expected, stored, stored_schema, &change)
                    .await?
                {
                    return Ok(new_version);
                }
            }
            Next::Adopt(stored) => {
                if let Some(version) = write_plain(repo, &id, &shown, stored, &change).await? {
                    return Ok(version);
                }
            }
            Next::Retry => {}
            Next::Wait(holder) => wait_for(repo, &id, &shown, holder, &mut waiter).await?,
        }
        if waiter.retry.exhausted() {
            return Err(locked(repo, &shown, &waiter));
        }
    }
}

/// Deals with document `id` held by `holder`: resolves it if its outcome is decided or its
/// deadline passed, else pauses; fails with `Locked` once the lock-wait budget is spent.
pub(super) async fn wait_for<T>(
    repo: &Repository<T>,
    id: &Bson,
    shown: &str,
    holder: ObjectId,
    waiter: &mut Waiter,
) -> Result<(), RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let settled = resolve::settle(&repo.store, repo.name(), id, holder)
        .await
        .map_err(|source| repo.hold_error(shown, holder, source))?;
    // A resolved holder is retried at once, unless the same one is still there.
    let again = waiter.last_holder == Some(holder);
    if !again {
        metrics::holds_met(repo.name(), Access::Write, 1);
    }
    waiter.last_holder = Some(holder);
    if settled == Settled::Freed && !again {
        return Ok(());
    }
    if waiter.retry.exhausted() {
        return Err(locked(repo, shown, waiter));
    }
    waiter.retry.pause().await;
    Ok(())
}

fn locked<T>(repo: &Repository<T>, shown: &str, waiter: &Waiter) -> RepoError
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    RepoError::Locked {
        collection: repo.name().to_string(),
        id: shown.to_string(),
        holder: waiter.last_holder,
        waited: waiter.retry.elapsed(),
    }
}

/// The filter of the single write attempted first.
fn happy_filter<T>(repo: &Repository<T>, id: &Bson, expected: i64, change: &Change<'_>) -> Document
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let current = repo.spec.schema_version();
    let mut filter = doc! {
        "_id": id.clone(),
        fields::VERSION: expected,
        fields::ACTIVE_TXN: null,
        fields::DELETED: null,
    };
    match change {
        // Field-level changes are only safe on documents already in the current shape.
        Change::Update(_) => {
            filter.insert(fields::SCHEMA_VERSION, current);
        }
        Change::Adjust(adjust) => {
            filter.insert(fields::SCHEMA_VERSION, current);
            filter.insert("$and", adjust.applicable());
        }
        // A whole new value (or a tombstone) may replace any older shape.
        Change::Replace(_) | Change::Delete => {
            filter.insert(fields::SCHEMA_VERSION, doc! { "$lte": current });
        }
    }
    filter
}

/// The update document of a field-level change.
fn happy_update<T>(_repo: &Repository<T>, new_version: i64, change: &Change<'_>) -> Document
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    match change {
        Change::Update(update) => {
            let mut set = doc! {};
            for (path, value) in update.sets() {
                set.insert(path.clone(), value.clone());
            }
            set.insert(fields::VERSION, new_version);
            let mut op = doc! { "$set": set };
            if !update.unsets().is_empty() {
                let unset: Document = update
                    .unsets()
                    .iter()
                    .map(|p| (p.clone(), Bson::String(String::new())))
                    .collect();
                op.insert("$unset", unset);
            }
            op
        }
        Change::Adjust(adjust) => {
            let inc: Document = adjust
                .increments()
                .iter()
                .map(|(p, v)| (p.clone(), v.clone()))
                .collect();
            doc! { "$inc": inc, "$set": { fields::VERSION: new_version } }
        }
        Change::Replace(_) | Change::Delete => doc! {},
    }
}

/// Reads the document after a write matched nothing and decides what to do.
async fn diagnose<T>(
    repo: &Repository<T>,
    id: &Bson,
    shown: &str,
    expected: i64,
    current: i64,
    change: &Change<'_>,
) -> Result<Next, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let Some(stored) = repo.read_raw(id, shown).await? else {
        return Ok(Next::Fail(RepoError::NotFound {
            collection: repo.name().to_string(),
            id: shown.to_string(),
        }));
    };
    let sys = repo.system_fields(shown, &stored)?;
    if sys.is_deleted() {
        return Ok(Next::Fail(RepoError::Deleted {
            collection: repo.name().to_string(),
            id: shown.to_string(),
            version: sys.version,
        }));
    }
    if let Some(holder) = sys.active_txn {
        return Ok(Next::Wait(holder));
    }
    if sys.schema_version > current {
        return Ok(Next::Fail(repo.too_new(shown, sys.schema_version)));
    }
    if sys.version != expected {
        contention::conflict(repo.store(), repo.name(), id);
        return Ok(Next::Fail(RepoError::VersionConflict {
            collection: repo.name().to_string(),
            id: shown.to_string(),
            expected,
            actual: sys.version,
        }));
    }
    if sys.plain {
        return Ok(Next::Adopt(stored));
    }
    if sys.schema_version < current && matches!(change, Change::Update(_) | Change::Adjust(_)) {
        return Ok(Next::Upgrade(stored, sys.schema_version));
    }
    if let Change::Adjust(adjust) = change {
        if let Some(error) = checks::increment_refused(repo, shown, adjust, &stored) {
            return Ok(Next::Fail(error));
        }
    }
    // The document matches now: a holder came and went between the write and the read.
    Ok(Next::Retry)
}

/// Applies `change` to the plain document `stored` (read at the version the caller named)
/// and stamps it, in one write conditional on the whole stored document being unchanged (see
/// `repo::plain`): the new value (upgraded from the plain schema version and changed in
/// memory, or the replacement, or a tombstone) at the collection's first version. `None`
/// when the document changed before the write landed (the caller reads it again).
async fn write_plain<T>(
    repo: &Repository<T>,
    id: &Bson,
    shown: &str,
    stored: Document,
    change: &Change<'_>,
) -> Result<Option<i64>, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let version = repo.first_version(shown).await?;
    let filter = plain::unchanged(&stored, repo.store.binary_collation(repo.name()));
    let current = repo.spec.schema_version();
    if let Change::Adjust(adjust) = change {
        if let Some(written) =
            adjust_decimal_on_server(repo, shown, &stored, adjust, &filter, version).await?
        {
            return Ok(written);
        }
    }
    let replacement = match change {
        Change::Delete => None,
        Change::Replace(value) => {
            let mut doc = value.clone();
            checks::stamp(repo, &mut doc, version);
            Some(doc)
        }
        Change::Update(_) | Change::Adjust(_) => {
            let from = repo.spec.plain_schema_version();
            let mut doc = repo.upgrade(shown, stored, from)?;
            let applied = match change {
                Change::Update(update) => update.apply_to(&mut doc),
                Change::Adjust(adjust) => {
                    if let Some(refused) = checks::increment_refused(repo, shown, adjust, &doc) {
                        return Err(refused);
                    }
                    adjust.apply_to(&mut doc)
                }
                Change::Replace(_) | Change::Delete => Ok(()),
            };
            applied.map_err(|violation| repo.invalid(shown, violation))?;
            checks::stamp(repo, &mut doc, version);
            Some(doc)
        }
    };
    let written = match replacement {
        None => {
            tombstone::write_tombstone(&repo.store, &repo.coll, filter, id, current, version).await
        }
        Some(doc) => {
            // The document goes back whole: a field name mongotx could not address (one the
            // raw driver stored) would not survive the round trip as written.
            if let Some((field, reason)) = fields::bad_name_in(&doc) {
                return Err(repo.invalid(
                    shown,
                    crate::repo::schema::Violation {
                        field,
                        reason: reason.to_string(),
                    },
                ));
            }
            checks::validate(repo, shown, &doc)?;
            repo.coll
                .replace_one(filter, doc)
                .await
                .map(|r| r.matched_count)
        }
    };
    match written {
        Ok(1) => {
            tracing::debug!(collection = repo.name(), id = %shown, version, "{} stamped a plain document", change.verb());
            Ok(Some(version))
        }
        Ok(_) => Ok(None),
        Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) => {
            let index = other_index(&e).unwrap_or_else(|| "_id_".to_string());
            Err(repo.duplicate_key(shown, index))
        }
        Err(e) => Err(repo.write_error(shown, change.verb(), e)),
    }
}

/// The first adjust of a plain document that holds a decimal where it adds: the sum is left to
/// the server's `$inc` (as for a stamped document; mongotx does no decimal arithmetic of its
/// own), in the one write that stamps it, conditional on the content read. Only for a document
/// whose plain schema version is the current one (an upgrade would need the sum in memory), and
/// only where every increment can be applied (`Adjust::applicable`). `None` when this is not that
/// case (the caller goes on as usual); `Some(None)` when the document changed before the write.
async fn adjust_decimal_on_server<T>(
    repo: &Repository<T>,
    shown: &str,
    stored: &Document,
    adjust: &crate::repo::changes::Adjust,
    unchanged: &Document,
    version: i64,
) -> Result<Option<Option<i64>>, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let decimal_sum = adjust.increments().iter().any(|(path, _)| {
        matches!(
            crate::repo::changes::get_path(stored, path),
            Some(Bson::Decimal128(_))
        )
    });
    let current = repo.spec.schema_version();
    if !decimal_sum || repo.spec.plain_schema_version() != current {
        return Ok(None);
    }
    // The rest of the document must be one the schema accepts, as for any first write; the sum's
    // type was checked against the schema when the adjust was (`checks::check_adjust`).
    plain::refusal(&repo.spec, stored).map_err(|v| repo.invalid(shown, v))?;
    let inc: Document = adjust
        .increments()
        .iter()
        .map(|(p, v)| (p.clone(), v.clone()))
        .collect();
    let mut filter = unchanged.clone();
    let mut clauses = match filter.remove("$and") {
        Some(Bson::Array(clauses)) => clauses,
        _ => Vec::new(),
    };
    clauses.extend(adjust.applicable().into_iter().map(Bson::Document));
    filter.insert("$and", clauses);
    let update = doc! {
        "$inc": inc,
        "$set": { fields::SCHEMA_VERSION: current, fields::VERSION: version },
    };
    match repo.coll.update_one(filter, update).await {
        Ok(r) if r.matched_count == 1 => {
            tracing::debug!(collection = repo.name(), id = %shown, version, "adjust stamped a plain document (decimal sum on the server)");
            Ok(Some(Some(version)))
        }
        Ok(_) => Ok(Some(None)),
        Err(e) => Err(repo.write_error(shown, "adjust", e)),
    }
}

/// Applies a field-level change to an older-shape document by upgrading it in memory and
/// replacing it whole, still conditional on the version and stored shape read.
async fn write_upgraded<T>(
    repo: &Repository<T>,
    id: &Bson,
    shown: &str,
    expected: i64,
    stored: Document,
    stored_schema: i64,
    change: &Change<'_>,
) -> Result<bool, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let mut doc = repo.upgrade(shown, stored, stored_schema)?;
    let applied = match change {
        Change::Update(update) => update.apply_to(&mut doc),
        Change::Adjust(adjust) => adjust.apply_to(&mut doc),
        Change::Replace(_) | Change::Delete => Ok(()),
    };
    applied.map_err(|violation| repo.invalid(shown, violation))?;
    checks::stamp(repo, &mut doc, expected + 1);
    checks::validate(repo, shown, &doc)?;
    let filter = doc! {
        "_id": id.clone(),
        fields::VERSION: expected,
        fields::SCHEMA_VERSION: stored_schema,
        fields::ACTIVE_TXN: null,
        fields::DELETED: null,
    };
    let result = match repo.coll.replace_one(filter, doc).await {
        Ok(result) => result,
        Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) => {
            let index = other_index(&e).unwrap_or_else(|| "_id_".to_string());
            return Err(repo.duplicate_key(shown, index));
        }
        Err(e) => return Err(repo.write_error(shown, change.verb(), e)),
    };
    if result.matched_count == 1 {
        tracing::info!(collection = repo.name(), id = %shown, from = stored_schema, to = repo.spec.schema_version(), "upgraded document on write");
    }
    Ok(result.matched_count == 1)
}
