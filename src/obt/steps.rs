//! The steps every OBT operation is made of: issuing a fencing token, reading the committed OBT
//! (through any transaction holding its document), and one conditional write that, when it
//! matches nothing, reads the OBT to judge why (done already, refused, or worth sending again).

use std::time::Instant;

use bson::{doc, oid::ObjectId, Bson, Document};
use mongodb::options::ReturnDocument;

use crate::obt::error::ObtError;
use crate::obt::model::{Observation, ObtDoc, ObtState, Token};
use crate::obt::Obt;
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields;
use crate::repo::hold::resolve::Committed;
use crate::retry::Retry;
use crate::server::is_transient;

/// What the read after a write that matched nothing says.
pub(super) enum Verdict {
    /// Nothing more to do (the write had landed, or the call is a no-op): the OBT now.
    Done(ObtState),
    /// The call cannot succeed.
    Fail(ObtError),
    /// The condition holds on the committed OBT: a guard was in the way, or it changed back and
    /// forth. Write again.
    Again,
}

impl Obt {
    // ----- tokens -----

    /// Issues the namespace's next fencing token: one `findAndModify` `$inc` on its counter.
    /// Strictly greater than every token issued before it in this namespace, by any process. A
    /// token whose reply was lost is simply never used, and neither is one taken by a call that a
    /// racing call beat (tokens may have gaps: fencing needs them to grow, not to be dense). A
    /// call whose input is wrong (a taken id, a missing OBT, another owner, no lease, a lease
    /// still running, an observation the OBT has moved past) is refused before it takes one.
    pub async fn issue_token(&self) -> Result<Token, ObtError> {
        let namespace = self.repo.name();
        let mut pace = Retry::tries(self.options.retry, 9);
        loop {
            let issued = self
                .tokens
                .find_one_and_update(
                    doc! { "_id": namespace },
                    doc! { "$inc": { "last": 1_i64 } },
                )
                .upsert(true)
                .return_document(ReturnDocument::After)
                .await;
            let failed = match issued {
                Ok(Some(counter)) => {
                    return counter.get_i64("last").map(Token).map_err(|e| {
                        RepoError::Malformed {
                            collection: crate::collections::TOKENS_COLLECTION.to_string(),
                            id: namespace.to_string(),
                            reason: format!("the token counter has no whole `last`: {e}"),
                        }
                        .into()
                    })
                }
                // Two first upserts of the counter raced, or the reply was lost.
                Ok(None) => None,
                Err(e) if is_transient(&e) || crate::obt::fence::is_duplicate_key(&e) => Some(e),
                Err(e) => {
                    return Err(RepoError::database(
                        crate::collections::TOKENS_COLLECTION,
                        namespace,
                        "issue token",
                        e,
                    )
                    .into())
                }
            };
            if !pace.next().await {
                let reason =
                    failed.map_or_else(|| "no counter returned".to_string(), |e| e.to_string());
                let tries = pace.pauses() + 1;
                return Err(RepoError::Malformed {
                    collection: crate::collections::TOKENS_COLLECTION.to_string(),
                    id: namespace.to_string(),
                    reason: format!("could not issue a token after {tries} tries: {reason}"),
                }
                .into());
            }
        }
    }

    // ----- reading -----

    pub(super) fn state_of(&self, id: &str, stored: Document) -> Result<ObtState, ObtError> {
        let version = stored.get_i64(fields::VERSION).map_err(|e| {
            self.repo.malformed(
                &show_id(&Bson::from(id)),
                format!("no whole `_version`: {e}"),
            )
        })?;
        let doc: ObtDoc = bson::from_document(stored).map_err(|e| {
            self.repo
                .malformed(&show_id(&Bson::from(id)), e.to_string())
        })?;
        Ok(ObtState::from_stored(doc, version))
    }

    /// The committed OBT and the transaction holding its document, if any.
    pub(super) async fn committed(
        &self,
        id: &str,
    ) -> Result<Option<(ObtState, Option<ObjectId>)>, ObtError> {
        let key = Bson::from(id);
        let shown = show_id(&key);
        let stored = self
            .coll
            .find_one(doc! { "_id": id })
            .await
            .map_err(|e| RepoError::database(&self.coll(), id, "read", e))?;
        let Some(stored) = stored else {
            return Ok(None);
        };
        let holder = stored.get_object_id(fields::ACTIVE_TXN).ok();
        match self.repo.committed(&shown, stored).await? {
            Committed::Live(doc) => Ok(Some((self.state_of(id, doc)?, holder))),
            Committed::Deleted(_) | Committed::Absent => Ok(None),
        }
    }

    /// The OBT as committed now.
    pub async fn get(&self, id: &str) -> Result<ObtState, ObtError> {
        self.check_name("OBT id", id)?;
        match self.committed(id).await? {
            Some((state, _)) => Ok(state),
            None => Err(self.not_found(id)),
        }
    }

    /// Reads the OBT as a contender: the start of its own count towards a
    /// [`take_over`](Obt::take_over).
    pub async fn observe(&self, id: &str) -> Result<Observation, ObtError> {
        let state = self.get(id).await?;
        Ok(Observation {
            state,
            seen_at: Instant::now(),
        })
    }

    /// Checks a call made under the OBT (the `t_id`, `t_owner` and `t_stage` that the reference
    /// design's HTTP interface passes with every call): `owner` owns it and `stage` is not older
    /// than its stage. Returns the OBT, whose token the call then carries to downstream fences.
    pub async fn check(&self, id: &str, owner: &str, stage: i64) -> Result<ObtState, ObtError> {
        self.check_name("owner", owner)?;
        self.check_stage(id, stage)?;
        let state = self.get(id).await?;
        if state.owner != owner {
            return Err(self.not_owner(id, owner, &state));
        }
        if state.stage > stage {
            return Err(ObtError::StageReplayed {
                collection: self.coll(),
                id: id.to_string(),
                current: state.stage,
                presented: stage,
            });
        }
        Ok(state)
    }

    // ----- writing -----

    /// One conditional write on OBT `id` returning the OBT after it (a `findAndModify`).
    pub(super) async fn conditional(
        &self,
        id: &str,
        what: &'static str,
        condition: Document,
        change: Document,
        judge: impl Fn(Option<&ObtState>) -> Verdict,
    ) -> Result<ObtState, ObtError> {
        match self
            .write_if(id, what, condition, change, true, judge)
            .await?
        {
            Some(state) => Ok(state),
            None => self.get(id).await,
        }
    }

    /// One conditional write on OBT `id`, re-sent after transient errors and guards, with
    /// `judge` deciding from the committed OBT whenever it matches nothing. With `post_image`
    /// it is a `findAndModify` returning the OBT after the write; without, a plain update that
    /// returns `None` when it lands (cheaper on some servers).
    pub(super) async fn write_if(
        &self,
        id: &str,
        what: &'static str,
        condition: Document,
        change: Document,
        post_image: bool,
        judge: impl Fn(Option<&ObtState>) -> Verdict,
    ) -> Result<Option<ObtState>, ObtError> {
        let mut filter = doc! {
            "_id": id,
            fields::ACTIVE_TXN: null,
            fields::DELETED: null,
            fields::SCHEMA_VERSION: self.repo.spec().schema_version(),
        };
        filter.extend(condition);
        let mut change = change;
        change.insert("$inc", doc! { fields::VERSION: 1_i64 });
        let mut retry = Retry::until_deadline(self.options.retry);
        let mut holder = None;
        loop {
            let written = if post_image {
                self.coll
                    .find_one_and_update(filter.clone(), change.clone())
                    .return_document(ReturnDocument::After)
                    .await
            } else {
                self.coll
                    .update_one(filter.clone(), change.clone())
                    .await
                    .map(|r| (r.matched_count == 1).then(Document::new))
            };
            let found = match written {
                Ok(Some(_)) if !post_image => return Ok(None),
                Ok(Some(stored)) => return self.state_of(id, stored).map(Some),
                Ok(None) => self.committed(id).await?,
                Err(e) if is_transient(&e) => {
                    // It may have landed. Sending it again is safe: it is conditional, and if
                    // the first copy landed the judge recognises the result.
                    tracing::debug!(collection = %self.coll(), id, what, error = %e, "obt: send failed, sending again");
                    if retry.exhausted() {
                        return Err(RepoError::database(&self.coll(), id, what, e).into());
                    }
                    retry.pause().await;
                    continue;
                }
                Err(e) => return Err(RepoError::database(&self.coll(), id, what, e).into()),
            };
            match judge(found.as_ref().map(|(state, _)| state)) {
                Verdict::Done(state) => return Ok(Some(state)),
                Verdict::Fail(e) => return Err(e),
                Verdict::Again => {}
            }
            let holding = found.and_then(|(_, h)| h);
            holder = holding.or(holder);
            self.wait_turn(id, holding, holder, &mut retry).await?;
        }
    }

    /// Before writing OBT `id` again: gets the hold of `holding` out of the way if its outcome
    /// is decided (then at once), otherwise backs off, or gives up as
    /// [`RepoError::Locked`] (naming `last_holder`) once the wait budget is spent.
    pub(super) async fn wait_turn(
        &self,
        id: &str,
        holding: Option<ObjectId>,
        last_holder: Option<ObjectId>,
        retry: &mut Retry,
    ) -> Result<(), ObtError> {
        let key = Bson::from(id);
        if let Some(h) = holding {
            if self.repo.settle_hold(&key, &show_id(&key), h).await? {
                return Ok(());
            }
        }
        if retry.exhausted() {
            return Err(RepoError::Locked {
                collection: self.coll(),
                id: show_id(&key),
                holder: last_holder,
                waited: retry.elapsed(),
            }
            .into());
        }
        retry.pause().await;
        Ok(())
    }
}
