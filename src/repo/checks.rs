//! The input checks of a repository: ids, expected versions, update paths and values, increments
//! and whole documents against the collection's schema. All of them run before anything touches
//! the database.

use bson::{Bson, Document};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::repo::changes::{self, Adjust, Update};
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields;
use crate::repo::fields::FIRST_VERSION;
use crate::repo::repository::Repository;
use crate::repo::schema::{BsonType, Violation};

pub(crate) fn check_write<T>(
    repo: &Repository<T>,
    id: &Bson,
    expected: i64,
) -> Result<(), RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    check_id(repo, id)?;
    // i64::MAX has no next version to write; a plain document's version is a fingerprint.
    if !(FIRST_VERSION..i64::MAX).contains(&expected) && !fields::is_plain_version(expected) {
        return Err(RepoError::InvalidVersion {
            collection: repo.name().to_string(),
            id: show_id(id),
            version: expected,
        });
    }
    Ok(())
}

pub(crate) fn check_id<T>(repo: &Repository<T>, id: &Bson) -> Result<(), RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let found = BsonType::of(id);
    if repo.id_types.contains(&found) {
        return Ok(());
    }
    Err(RepoError::InvalidId {
        collection: repo.name().to_string(),
        id: show_id(id),
        found: found.alias().to_string(),
        expected: repo
            .id_types
            .iter()
            .map(|t| t.alias())
            .collect::<Vec<_>>()
            .join(" or "),
    })
}

fn check_paths<'a, T>(
    repo: &Repository<T>,
    shown: &str,
    paths: impl Iterator<Item = &'a str>,
) -> Result<(), RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let paths: Vec<&str> = paths.collect();
    for path in &paths {
        if fields::is_system_path(path) {
            return Err(RepoError::SystemField {
                collection: repo.name().to_string(),
                id: shown.to_string(),
                field: path.to_string(),
            });
        }
        let problem = if *path == "_id" || path.starts_with("_id.") {
            Some("`_id` cannot be changed")
        } else {
            changes::path_problem(path)
        };
        if let Some(reason) = problem {
            return Err(repo.invalid(
                shown,
                Violation {
                    field: path.to_string(),
                    reason: reason.to_string(),
                },
            ));
        }
    }
    if let Some((a, b)) = changes::overlapping(&paths) {
        return Err(repo.invalid(
            shown,
            Violation {
                field: b.to_string(),
                reason: format!("conflicts with `{a}` in the same change"),
            },
        ));
    }
    Ok(())
}

pub(crate) fn check_update<T>(
    repo: &Repository<T>,
    shown: &str,
    update: &Update,
) -> Result<(), RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    if update.is_empty() {
        return Err(repo.empty(shown));
    }
    check_paths(repo, shown, update.paths())?;
    let schema = repo.spec.schema();
    for (path, value) in update.sets() {
        if let Some((field, reason)) = fields::bad_name(value, path.split('.').count()) {
            return Err(repo.invalid(
                shown,
                Violation {
                    field: format!("{path}.{field}"),
                    reason: reason.to_string(),
                },
            ));
        }
        schema
            .validate_set(path, value)
            .map_err(|v| repo.invalid(shown, v))?;
    }
    for path in update.unsets() {
        schema
            .validate_unset(path)
            .map_err(|v| repo.invalid(shown, v))?;
    }
    Ok(())
}

/// `InvalidIncrement` if one of `adjust`'s increments cannot be added to `stored` (a 64-bit
/// overflow, or a stored value that is not a number).
pub(crate) fn increment_refused<T>(
    repo: &Repository<T>,
    shown: &str,
    adjust: &Adjust,
    stored: &Document,
) -> Option<RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    adjust
        .problem_on(stored)
        .map(|(field, amount, reason)| RepoError::InvalidIncrement {
            collection: repo.name().to_string(),
            id: shown.to_string(),
            field: field.to_string(),
            amount: amount.to_string(),
            reason,
        })
}

pub(crate) fn check_adjust<T>(
    repo: &Repository<T>,
    shown: &str,
    adjust: &Adjust,
) -> Result<(), RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    if adjust.is_empty() {
        return Err(repo.empty(shown));
    }
    check_paths(
        repo,
        shown,
        adjust.increments().iter().map(|(p, _)| p.as_str()),
    )?;
    let schema = repo.spec.schema();
    for (path, amount) in adjust.increments() {
        if let Some(reason) = changes::increment_problem(amount) {
            return Err(RepoError::InvalidIncrement {
                collection: repo.name().to_string(),
                id: shown.to_string(),
                field: path.clone(),
                amount: amount.to_string(),
                reason: reason.to_string(),
            });
        }
        let by = BsonType::of(amount);
        match schema.allowed_types(path) {
            // Undeclared: the schema may still forbid the field outright.
            None => schema
                .validate_set(path, amount)
                .map_err(|v| repo.invalid(shown, v))?,
            Some(allowed) => {
                let numeric: Vec<BsonType> =
                    allowed.iter().copied().filter(|t| t.is_numeric()).collect();
                let reason = if numeric.is_empty() {
                    Some("the field is not numeric".to_string())
                } else {
                    numeric
                        .iter()
                        .map(|t| (t, promoted(*t, by)))
                        .find(|(_, result)| !allowed.contains(result))
                        .map(|(t, result)| {
                            format!(
                                "adding a {} to a {} field gives a {}, which the schema does not allow",
                                by.alias(),
                                t.alias(),
                                result.alias()
                            )
                        })
                };
                if let Some(reason) = reason {
                    return Err(repo.invalid(
                        shown,
                        Violation {
                            field: path.clone(),
                            reason,
                        },
                    ));
                }
            }
        }
    }
    Ok(())
}

pub(crate) fn encode<T>(repo: &Repository<T>, value: &T, shown: &str) -> Result<Document, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let doc = bson::to_document(value).map_err(|e| RepoError::Encode {
        collection: repo.name().to_string(),
        reason: e.to_string(),
    })?;
    if let Some(field) = doc.keys().find(|k| fields::is_system_path(k)) {
        return Err(RepoError::SystemField {
            collection: repo.name().to_string(),
            id: shown.to_string(),
            field: field.to_string(),
        });
    }
    if let Some((field, reason)) = fields::bad_name_in(&doc) {
        return Err(repo.invalid(
            shown,
            Violation {
                field,
                reason: reason.to_string(),
            },
        ));
    }
    Ok(doc)
}

pub(crate) fn validate<T>(
    repo: &Repository<T>,
    shown: &str,
    doc: &Document,
) -> Result<(), RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    repo.spec
        .schema()
        .validate(doc)
        .map_err(|v| repo.invalid(shown, v))
}

pub(crate) fn stamp<T>(repo: &Repository<T>, doc: &mut Document, version: i64)
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    doc.insert(fields::SCHEMA_VERSION, repo.spec.schema_version());
    doc.insert(fields::VERSION, version);
}

/// The BSON type `$inc` produces when adding a `by` to a `field` (ignoring int overflow).
fn promoted(field: BsonType, by: BsonType) -> BsonType {
    use BsonType::{Double, Int, Long};
    match (field, by) {
        (Double, _) | (_, Double) => Double,
        (Long, _) | (_, Long) => Long,
        (Int, Int) => Int,
        (other, _) => other,
    }
}
