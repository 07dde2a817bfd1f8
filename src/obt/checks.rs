//! Input checks of the OBT operations and the errors they return, naming the collection, the
//! OBT and the owners and stages involved.

use crate::obt::error::ObtError;
use crate::obt::model::{ObtState, Ownership};
use crate::obt::{name_problem, shown, Obt};

impl Obt {
    /// Refuses an unusable id or owner name (`what` it is), naming the value.
    pub(super) fn check_name(&self, what: &str, value: &str) -> Result<(), ObtError> {
        match name_problem(value) {
            None => Ok(()),
            Some(problem) => Err(self.invalid(format!(
                "the {what} {} is unusable: {problem}",
                shown(value)
            ))),
        }
    }

    /// Refuses a negative stage for OBT `id`.
    pub(super) fn check_stage(&self, id: &str, stage: i64) -> Result<(), ObtError> {
        if stage < 0 {
            return Err(self.invalid(format!(
                "OBT {}: stage {stage} is negative (stages start at 0)",
                shown(id)
            )));
        }
        Ok(())
    }

    /// Refuses an ownership handle that no call of this module hands out: its fields are public,
    /// so an emptied id or owner, or a token never issued, would otherwise reach the database as
    /// a condition that matches nothing and come back as a confusing loss of ownership.
    pub(super) fn check_owned(&self, owned: &Ownership) -> Result<(), ObtError> {
        self.check_name("OBT id of the ownership", &owned.id)?;
        self.check_name("owner of the ownership", &owned.owner)?;
        if owned.token.0 < 1 {
            return Err(self.invalid(format!(
                "OBT {} of {}: token {} was never issued (tokens start at 1)",
                shown(&owned.id),
                shown(&owned.owner),
                owned.token
            )));
        }
        Ok(())
    }

    pub(super) fn invalid(&self, reason: String) -> ObtError {
        ObtError::Invalid {
            collection: self.coll(),
            reason,
        }
    }

    pub(super) fn coll(&self) -> String {
        self.repo.name().to_string()
    }

    pub(super) fn not_found(&self, id: &str) -> ObtError {
        ObtError::NotFound {
            collection: self.coll(),
            id: id.to_string(),
        }
    }

    pub(super) fn exists(&self, id: String, now: ObtState) -> ObtError {
        ObtError::Exists {
            collection: self.coll(),
            id,
            owner: now.owner,
            token: now.token,
        }
    }

    pub(super) fn not_owner(&self, id: &str, presented: &str, now: &ObtState) -> ObtError {
        ObtError::NotOwner {
            collection: self.coll(),
            id: id.to_string(),
            presented: presented.to_string(),
            current: now.owner.clone(),
            token: now.token,
        }
    }

    pub(super) fn preempted(&self, owned: &Ownership, now: Option<&ObtState>) -> ObtError {
        ObtError::Preempted {
            collection: self.coll(),
            id: owned.id.clone(),
            owner: owned.owner.clone(),
            token: owned.token,
            now: now.map(|s| (s.owner.clone(), s.token)),
        }
    }

    pub(super) fn changed(&self, observed: &ObtState, now: &ObtState) -> ObtError {
        ObtError::Changed {
            collection: self.coll(),
            id: observed.id.clone(),
            observed: observed.version,
            observed_token: observed.token,
            owner: now.owner.clone(),
            version: now.version,
            token: now.token,
        }
    }
}
