//! Input checks of the OBT operations and the errors they return, naming the collection, the
//! OBT and the owners and stages involved.

use crate::obt::error::ObtError;
use crate::obt::model::{ObtState, Ownership};
use crate::obt::{name_problem, shown, Obt};

/// Refuses an unusable id or owner name (`what` it is), naming the value.
pub(super) fn check_name(obt: &Obt, what: &str, value: &str) -> Result<(), ObtError> {
    match name_problem(value) {
        None => Ok(()),
        Some(problem) => Err(invalid(
            obt,
            format!("the {what} {} is unusable: {problem}", shown(value)),
        )),
    }
}

/// Refuses a negative stage for OBT `id`.
pub(super) fn check_stage(obt: &Obt, id: &str, stage: i64) -> Result<(), ObtError> {
    if stage < 0 {
        return Err(invalid(
            obt,
            format!(
                "OBT {}: stage {stage} is negative (stages start at 0)",
                shown(id)
            ),
        ));
    }
    Ok(())
}

/// Refuses an ownership handle that no call of this module hands out: its fields are public,
/// so an emptied id or owner, or a token never issued, would otherwise reach the database as
/// a condition that matches nothing and come back as a confusing loss of ownership.
pub(super) fn check_owned(obt: &Obt, owned: &Ownership) -> Result<(), ObtError> {
    check_name(obt, "OBT id of the ownership", &owned.id)?;
    check_name(obt, "owner of the ownership", &owned.owner)?;
    if owned.token.0 < 1 {
        return Err(invalid(
            obt,
            format!(
                "OBT {} of {}: token {} was never issued (tokens start at 1)",
                shown(&owned.id),
                shown(&owned.owner),
                owned.token
            ),
        ));
    }
    Ok(())
}

pub(super) fn invalid(obt: &Obt, reason: String) -> ObtError {
    ObtError::Invalid {
        collection: coll(obt),
        reason,
    }
}

pub(super) fn coll(obt: &Obt) -> String {
    obt.repo.name().to_string()
}

pub(super) fn not_found(obt: &Obt, id: &str) -> ObtError {
    ObtError::NotFound {
        collection: coll(obt),
        id: id.to_string(),
    }
}

pub(super) fn exists(obt: &Obt, id: String, now: ObtState) -> ObtError {
    ObtError::Exists {
        collection: coll(obt),
        id,
        owner: now.owner,
        token: now.token,
    }
}

pub(super) fn not_owner(obt: &Obt, id: &str, presented: &str, now: &ObtState) -> ObtError {
    ObtError::NotOwner {
        collection: coll(obt),
        id: id.to_string(),
        presented: presented.to_string(),
        current: now.owner.clone(),
        token: now.token,
    }
}

pub(super) fn preempted(obt: &Obt, owned: &Ownership, now: Option<&ObtState>) -> ObtError {
    ObtError::Preempted {
        collection: coll(obt),
        id: owned.id.clone(),
        owner: owned.owner.clone(),
        token: owned.token,
        now: now.map(|s| (s.owner.clone(), s.token)),
    }
}

pub(super) fn changed(obt: &Obt, observed: &ObtState, now: &ObtState) -> ObtError {
    ObtError::Changed {
        collection: coll(obt),
        id: observed.id.clone(),
        observed: observed.version,
        observed_token: observed.token,
        owner: now.owner.clone(),
        version: now.version,
        token: now.token,
    }
}
