//! The OBT operations: one conditional write each, and, when it matches nothing, a read of the
//! committed OBT that says why (or that the write had already landed, or that a guard is in the
//! way and the write should be sent again).

use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use mongodb::options::ReturnDocument;

use crate::obt::error::ObtError;
use crate::obt::model::{NewObt, Observation, ObtDoc, ObtState, Ownership, Token};
use crate::obt::{name_problem, shown, Obt, MAX_LEASE};
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields;
use crate::repo::resolve::Committed;
use crate::server::is_transient;
use crate::txn::transaction::{Outcome, Transaction};

/// What the read after a write that matched nothing says.
enum Verdict {
    /// Nothing more to do (the write had landed, or the call is a no-op): the OBT now.
    Done(ObtState),
    /// The call cannot succeed.
    Fail(ObtError),
    /// The condition holds on the committed OBT: a guard was in the way, or it changed back and
    /// forth. Write again.
    Again,
}

/// How many times a preemption takes a fresh token after finding a higher one already applied.
const REISSUES: usize = 8;

/// How long an owner whose last sign of life is stamped `beat` has been silent at `now` (both
/// server times; zero if `beat` is later).
fn silent_since(beat: DateTime, now: DateTime) -> Duration {
    let ms = now
        .timestamp_millis()
        .saturating_sub(beat.timestamp_millis());
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

impl Obt {
    /// Refuses an unusable id or owner name (`what` it is), naming the value.
    fn check_name(&self, what: &str, value: &str) -> Result<(), ObtError> {
        match name_problem(value) {
            None => Ok(()),
            Some(problem) => Err(self.invalid(format!(
                "the {what} {} is unusable: {problem}",
                shown(value)
            ))),
        }
    }

    /// Refuses a negative stage for OBT `id`.
    fn check_stage(&self, id: &str, stage: i64) -> Result<(), ObtError> {
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
    fn check_owned(&self, owned: &Ownership) -> Result<(), ObtError> {
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

    fn invalid(&self, reason: String) -> ObtError {
        ObtError::Invalid {
            collection: self.coll(),
            reason,
        }
    }

    fn coll(&self) -> String {
        self.repo.name().to_string()
    }

    fn not_found(&self, id: &str) -> ObtError {
        ObtError::NotFound {
            collection: self.coll(),
            id: id.to_string(),
        }
    }

    fn exists(&self, id: String, now: ObtState) -> ObtError {
        ObtError::Exists {
            collection: self.coll(),
            id,
            owner: now.owner,
            token: now.token,
        }
    }

    fn not_owner(&self, id: &str, presented: &str, now: &ObtState) -> ObtError {
        ObtError::NotOwner {
            collection: self.coll(),
            id: id.to_string(),
            presented: presented.to_string(),
            current: now.owner.clone(),
            token: now.token,
        }
    }

    fn preempted(&self, owned: &Ownership, now: Option<&ObtState>) -> ObtError {
        ObtError::Preempted {
            collection: self.coll(),
            id: owned.id.clone(),
            owner: owned.owner.clone(),
            token: owned.token,
            now: now.map(|s| (s.owner.clone(), s.token)),
        }
    }

    fn changed(&self, observed: &ObtState, now: &ObtState) -> ObtError {
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

    // ----- tokens -----

    /// Issues the namespace's next fencing token: one `findAndModify` `$inc` on its counter.
    /// Strictly greater than every token issued before it in this namespace, by any process. A
    /// token whose reply was lost is simply never used, and neither is one taken by a call that a
    /// racing call beat (tokens may have gaps: fencing needs them to grow, not to be dense). A
    /// call whose input is wrong (a taken id, a missing OBT, another owner, no lease, a lease
    /// still running, an observation the OBT has moved past) is refused before it takes one.
    pub async fn issue_token(&self) -> Result<Token, ObtError> {
        let namespace = self.repo.name();
        let mut attempt = 0;
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
            let retry = match issued {
                Ok(Some(counter)) => {
                    return counter.get_i64("last").map(Token).map_err(|e| {
                        RepoError::Malformed {
                            collection: crate::obt::TOKENS_COLLECTION.to_string(),
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
                        crate::obt::TOKENS_COLLECTION,
                        namespace,
                        "issue token",
                        e,
                    )
                    .into())
                }
            };
            attempt += 1;
            if attempt > 8 {
                let reason =
                    retry.map_or_else(|| "no counter returned".to_string(), |e| e.to_string());
                return Err(RepoError::Malformed {
                    collection: crate::obt::TOKENS_COLLECTION.to_string(),
                    id: namespace.to_string(),
                    reason: format!("could not issue a token after {attempt} tries: {reason}"),
                }
                .into());
            }
            tokio::time::sleep(self.options.retry.backoff(attempt)).await;
        }
    }

    // ----- reading -----

    fn state_of(&self, id: &str, stored: Document) -> Result<ObtState, ObtError> {
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
    async fn committed(&self, id: &str) -> Result<Option<(ObtState, Option<ObjectId>)>, ObtError> {
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

    /// Checks a call made under the OBT (the seed's `t_id`, `t_owner`, `t_stage` on every call):
    /// `owner` owns it and `stage` is not older than its stage. Returns the OBT, whose token the
    /// call then carries to downstream fences.
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
    async fn conditional(
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
    async fn write_if(
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
        let started = Instant::now();
        let mut attempt = 0;
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
                    if started.elapsed() >= self.options.retry.max_wait {
                        return Err(RepoError::database(&self.coll(), id, what, e).into());
                    }
                    tokio::time::sleep(self.options.retry.backoff(attempt)).await;
                    attempt += 1;
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
            self.wait_turn(id, holding, holder, started, &mut attempt)
                .await?;
        }
    }

    /// Before writing OBT `id` again: gets the hold of `holding` out of the way if its outcome
    /// is decided (then at once), otherwise backs off, or gives up as
    /// [`RepoError::Locked`] (naming `last_holder`) once the wait budget is spent.
    async fn wait_turn(
        &self,
        id: &str,
        holding: Option<ObjectId>,
        last_holder: Option<ObjectId>,
        started: Instant,
        attempt: &mut u32,
    ) -> Result<(), ObtError> {
        let key = Bson::from(id);
        if let Some(h) = holding {
            if self.repo.settle_hold(&key, &show_id(&key), h).await? {
                return Ok(());
            }
        }
        if started.elapsed() >= self.options.retry.max_wait {
            return Err(RepoError::Locked {
                collection: self.coll(),
                id: show_id(&key),
                holder: last_holder,
                waited: started.elapsed(),
            }
            .into());
        }
        tokio::time::sleep(self.options.retry.backoff(*attempt)).await;
        *attempt += 1;
        Ok(())
    }

    /// Creates OBT `id` owned by `new.owner` at stage 0 with a fresh token: one upsert that can
    /// only insert, stamped with the server's time. Sending the same create again after a lost
    /// reply returns the same ownership; an id that is taken is [`ObtError::Exists`].
    pub async fn create(&self, new: NewObt) -> Result<Ownership, ObtError> {
        self.check_name("OBT id", &new.id)?;
        self.check_name("owner", &new.owner)?;
        let lease_ms = match new.lease {
            None => None,
            Some(lease) if lease.as_millis() == 0 || lease > MAX_LEASE => {
                return Err(self.invalid(format!(
                    "OBT {} of {}: lease {lease:?} is not between 1 ms and {MAX_LEASE:?}",
                    shown(&new.id),
                    shown(&new.owner)
                )))
            }
            Some(lease) => Some(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX)),
        };
        // A taken id is refused before a token is issued for it.
        if let Some((state, _)) = self.committed(&new.id).await? {
            return Err(self.exists(new.id, state));
        }
        let token = self.issue_token().await?;
        let mut fields = doc! {
            fields::SCHEMA_VERSION: self.repo.spec().schema_version(),
            fields::VERSION: 1_i64,
            "owner": &new.owner,
            "stage": 0_i64,
            "token": token.0,
        };
        if let Some(ms) = lease_ms {
            fields.insert("lease_ms", ms);
        }
        // Every stored OBT has a version, so this filter matches none: the upsert inserts or
        // collides with the id, and never changes an existing OBT.
        let filter = doc! { "_id": &new.id, fields::VERSION: { "$exists": false } };
        let change = doc! { "$setOnInsert": fields, "$currentDate": { "beat_at": true } };
        let sent = Instant::now();
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            let written = self
                .coll
                .update_one(filter.clone(), change.clone())
                .upsert(true)
                .await;
            match written {
                Ok(r) if r.upserted_id.is_some() => break,
                Ok(_) => {}
                Err(e) if crate::obt::fence::is_duplicate_key(&e) => {}
                Err(e) if is_transient(&e) && started.elapsed() < self.options.retry.max_wait => {
                    tracing::debug!(collection = %self.coll(), id = %new.id, error = %e, "obt: create send failed, sending again");
                    tokio::time::sleep(self.options.retry.backoff(attempt)).await;
                    attempt += 1;
                    continue;
                }
                Err(e) => {
                    return Err(RepoError::database(&self.coll(), &new.id, "create", e).into())
                }
            }
            match self.committed(&new.id).await? {
                // Our own earlier send landed.
                Some((state, _)) if state.owner == new.owner && state.token == token => {
                    return Ok(Ownership::new(state, sent))
                }
                Some((state, _)) => return Err(self.exists(new.id, state)),
                // Released meanwhile: try again, within the wait budget.
                None if started.elapsed() < self.options.retry.max_wait => {}
                None => {
                    return Err(RepoError::Locked {
                        collection: self.coll(),
                        id: show_id(&Bson::from(new.id.as_str())),
                        holder: None,
                        waited: started.elapsed(),
                    }
                    .into())
                }
            }
            tokio::time::sleep(self.options.retry.backoff(attempt)).await;
            attempt += 1;
        }
        let state = ObtState {
            id: new.id,
            owner: new.owner,
            stage: 0,
            token,
            lease: new.lease,
            beat_at: None,
            version: 1,
        };
        Ok(Ownership::new(state, sent))
    }

    /// The seed's preemption: takes OBT `id` from `current_owner` (who must own it now) for
    /// `new_owner`, with a new token. No waiting: the previous owner is fenced off from here on.
    pub async fn preempt(
        &self,
        id: &str,
        current_owner: &str,
        new_owner: &str,
    ) -> Result<Ownership, ObtError> {
        self.check_name("OBT id", id)?;
        self.check_name("current owner", current_owner)?;
        self.check_name("new owner", new_owner)?;
        // A missing OBT or another owner is refused before a token is issued.
        match self.committed(id).await? {
            None => return Err(self.not_found(id)),
            Some((s, _)) if s.owner != current_owner => {
                return Err(self.not_owner(id, current_owner, &s))
            }
            Some(_) => {}
        }
        for _ in 0..REISSUES {
            let token = self.issue_token().await?;
            let sent = Instant::now();
            let result = self
                .conditional(
                    id,
                    "preempt",
                    doc! { "owner": current_owner, "token": { "$lt": token.0 } },
                    doc! {
                        "$set": { "owner": new_owner, "token": token.0 },
                        "$currentDate": { "beat_at": true },
                    },
                    |now| match now {
                        None => Verdict::Fail(self.not_found(id)),
                        Some(s) if s.owner == new_owner && s.token == token => {
                            Verdict::Done(s.clone())
                        }
                        Some(s) if s.owner != current_owner => {
                            Verdict::Fail(self.not_owner(id, current_owner, s))
                        }
                        // Taken again by `current_owner` with a later token: take a newer one.
                        Some(s) if s.token >= token => Verdict::Fail(ObtError::Changed {
                            collection: self.coll(),
                            id: id.to_string(),
                            observed: s.version,
                            observed_token: token,
                            owner: s.owner.clone(),
                            version: s.version,
                            token: s.token,
                        }),
                        Some(_) => Verdict::Again,
                    },
                )
                .await;
            match result {
                Ok(state) => return Ok(Ownership::new(state, sent)),
                Err(ObtError::Changed { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(self.invalid(format!(
            "OBT {id}: preempted {REISSUES} times over by newer tokens of {current_owner}"
        )))
    }

    /// Takes over an OBT whose owner this process has seen silent for its whole lease on its own
    /// monotonic clock: `observed` must be at least the lease old, and the OBT must be exactly as
    /// observed (no heartbeat, stage change or other owner since). Never compares wall clocks.
    /// The lease counted is the committed OBT's, whatever the observation says.
    pub async fn take_over(
        &self,
        observed: &Observation,
        new_owner: &str,
    ) -> Result<Ownership, ObtError> {
        self.check_name("new owner", new_owner)?;
        let seen = &observed.state;
        self.check_name("OBT id of the observation", &seen.id)?;
        let silent = observed.silent_for();
        let lease_live = |owner: &str, lease: Duration| ObtError::LeaseLive {
            collection: self.coll(),
            id: seen.id.clone(),
            owner: owner.to_string(),
            silent,
            lease,
        };
        let no_lease = |owner: &str| ObtError::NoLease {
            collection: self.coll(),
            id: seen.id.clone(),
            owner: owner.to_string(),
        };
        let Some(lease) = seen.lease else {
            return Err(no_lease(&seen.owner));
        };
        if silent < lease {
            return Err(lease_live(&seen.owner, lease));
        }
        // A take-over the committed OBT already refuses is refused before a token is issued for
        // it: gone, or changed since observed. The lease is the committed one too: the
        // observation's fields are public, and a lease shortened there must not cut a live
        // owner's short (the lease never changes while the version stays the same).
        let Some((now, _)) = self.committed(&seen.id).await? else {
            return Err(self.not_found(&seen.id));
        };
        if now.version != seen.version || now.token != seen.token {
            return Err(self.changed(seen, &now));
        }
        match now.lease {
            None => return Err(no_lease(&now.owner)),
            Some(lease) if silent < lease => return Err(lease_live(&now.owner, lease)),
            Some(_) => {}
        }
        self.take_unchanged(seen, new_owner).await
    }

    /// Takes over an OBT whose last heartbeat is older than its lease by the server's clock: the
    /// write itself carries the condition (`beat_at <= $$NOW - lease`), so the server compares
    /// its own stamps with its own clock and no caller's clock is involved.
    pub async fn take_over_expired(
        &self,
        id: &str,
        new_owner: &str,
    ) -> Result<Ownership, ObtError> {
        self.check_name("OBT id", id)?;
        self.check_name("new owner", new_owner)?;
        // A missing OBT, one without a lease, or one whose lease is running by this process's
        // estimate of the server's clock is refused before a token is issued. The write itself
        // still decides by the server's own clock; the estimate only spares a token when the
        // answer is plain.
        let Some((seen, _)) = self.committed(id).await? else {
            return Err(self.not_found(id));
        };
        let Some(lease) = seen.lease else {
            return Err(ObtError::NoLease {
                collection: self.coll(),
                id: id.to_string(),
                owner: seen.owner,
            });
        };
        if let Some(beat) = seen.beat_at {
            let silent = silent_since(beat, self.store.now().await?);
            if silent < lease {
                return Err(ObtError::LeaseLive {
                    collection: self.coll(),
                    id: id.to_string(),
                    owner: seen.owner,
                    silent,
                    lease,
                });
            }
        }
        let token = self.issue_token().await?;
        // Only to tell a running lease from a guard in the way when the write misses.
        let server_now = self.store.now().await?;
        let sent = Instant::now();
        let state = self
            .conditional(
                id,
                "take over",
                doc! {
                    "lease_ms": { "$gt": 0_i64 },
                    "token": { "$lt": token.0 },
                    "$expr": { "$lte": ["$beat_at", { "$subtract": ["$$NOW", "$lease_ms"] }] },
                },
                doc! {
                    "$set": { "owner": new_owner, "token": token.0 },
                    "$currentDate": { "beat_at": true },
                },
                |now| match now {
                    None => Verdict::Fail(self.not_found(id)),
                    Some(s) if s.owner == new_owner && s.token == token => Verdict::Done(s.clone()),
                    Some(s) => match s.lease {
                        None => Verdict::Fail(ObtError::NoLease {
                            collection: self.coll(),
                            id: id.to_string(),
                            owner: s.owner.clone(),
                        }),
                        Some(lease) => {
                            let silent = silent_since(s.beat_at.unwrap_or(server_now), server_now);
                            if s.token > token || silent < lease {
                                Verdict::Fail(ObtError::LeaseLive {
                                    collection: self.coll(),
                                    id: id.to_string(),
                                    owner: s.owner.clone(),
                                    silent,
                                    lease,
                                })
                            } else {
                                // Expired as far as this process can tell: a guard is in the
                                // way, or the server's clock has not quite got there.
                                Verdict::Again
                            }
                        }
                    },
                },
            )
            .await?;
        tracing::info!(collection = %self.coll(), id, to = new_owner, token = %token, "obt: took over an OBT whose lease ran out");
        Ok(Ownership::new(state, sent))
    }

    /// Gives `seen` to `new_owner` with a new token if it is still exactly as seen.
    async fn take_unchanged(
        &self,
        seen: &ObtState,
        new_owner: &str,
    ) -> Result<Ownership, ObtError> {
        let token = self.issue_token().await?;
        let sent = Instant::now();
        let state = self
            .conditional(
                &seen.id,
                "take over",
                doc! { "token": seen.token.0, fields::VERSION: seen.version },
                doc! {
                    "$set": { "owner": new_owner, "token": token.0 },
                    "$currentDate": { "beat_at": true },
                },
                |now| match now {
                    None => Verdict::Fail(self.not_found(&seen.id)),
                    Some(s) if s.owner == new_owner && s.token == token => Verdict::Done(s.clone()),
                    Some(s) if s.version != seen.version || s.token != seen.token => {
                        Verdict::Fail(self.changed(seen, s))
                    }
                    Some(_) => Verdict::Again,
                },
            )
            .await?;
        tracing::info!(collection = %self.coll(), id = %seen.id, from = %seen.owner, to = new_owner, token = %token, "obt: took over a silent owner's OBT");
        Ok(Ownership::new(state, sent))
    }

    /// Renews the lease: one conditional write (this owner, this token). A reply that is lost is
    /// settled by sending it again and reading back; a preempted owner gets
    /// [`ObtError::Preempted`].
    pub async fn heartbeat(&self, owned: &mut Ownership) -> Result<(), ObtError> {
        self.check_owned(owned)?;
        let sent = Instant::now();
        self.write_if(
            &owned.id,
            "heartbeat",
            doc! { "owner": &owned.owner, "token": owned.token.0 },
            doc! { "$currentDate": { "beat_at": true } },
            false,
            |now| match now {
                Some(s) if s.owner == owned.owner && s.token == owned.token => Verdict::Again,
                other => Verdict::Fail(self.preempted(owned, other)),
            },
        )
        .await?;
        owned.lease_until = owned.lease.map(|lease| sent + lease);
        Ok(())
    }

    /// Moves OBT `id` of `owner` forward to `stage`. The same stage again is a no-op (a retry); an
    /// older one is [`ObtError::StageReplayed`].
    pub async fn advance(&self, id: &str, owner: &str, stage: i64) -> Result<ObtState, ObtError> {
        self.check_name("OBT id", id)?;
        self.check_name("owner", owner)?;
        self.check_stage(id, stage)?;
        self.conditional(
            id,
            "advance",
            doc! { "owner": owner, "stage": { "$lt": stage } },
            doc! { "$set": { "stage": stage }, "$currentDate": { "beat_at": true } },
            |now| match now {
                None => Verdict::Fail(self.not_found(id)),
                Some(s) if s.owner != owner => Verdict::Fail(self.not_owner(id, owner, s)),
                Some(s) if s.stage == stage => Verdict::Done(s.clone()),
                Some(s) if s.stage > stage => Verdict::Fail(ObtError::StageReplayed {
                    collection: self.coll(),
                    id: id.to_string(),
                    current: s.stage,
                    presented: stage,
                }),
                Some(_) => Verdict::Again,
            },
        )
        .await
    }

    /// Moves this ownership's OBT forward to `stage`, conditioned on the token as well as the
    /// owner, so no late copy can move a later OBT of the same id and owner name.
    pub async fn advance_owned(&self, owned: &mut Ownership, stage: i64) -> Result<(), ObtError> {
        self.check_owned(owned)?;
        self.check_stage(&owned.id, stage)?;
        let state = self
            .conditional(
                &owned.id,
                "advance",
                doc! { "owner": &owned.owner, "token": owned.token.0, "stage": { "$lt": stage } },
                doc! { "$set": { "stage": stage }, "$currentDate": { "beat_at": true } },
                |now| match now {
                    Some(s) if s.owner != owned.owner || s.token != owned.token => {
                        Verdict::Fail(self.preempted(owned, Some(s)))
                    }
                    None => Verdict::Fail(self.preempted(owned, None)),
                    Some(s) if s.stage == stage => Verdict::Done(s.clone()),
                    Some(s) if s.stage > stage => Verdict::Fail(ObtError::StageReplayed {
                        collection: self.coll(),
                        id: owned.id.clone(),
                        current: s.stage,
                        presented: stage,
                    }),
                    Some(_) => Verdict::Again,
                },
            )
            .await?;
        owned.stage = state.stage;
        Ok(())
    }

    /// Releases (deletes) OBT `id`, which `owner` must own: the seed's call, by owner name. A
    /// delete delivered late could remove a later OBT of the same id and owner name; owners that
    /// reuse names should use [`release_owned`](Obt::release_owned).
    pub async fn release(&self, id: &str, owner: &str) -> Result<(), ObtError> {
        self.check_name("OBT id", id)?;
        self.check_name("owner", owner)?;
        self.remove(id, doc! { "owner": owner }, |now| {
            (now.owner != owner).then(|| self.not_owner(id, owner, now))
        })
        .await
    }

    /// Releases the OBT this ownership holds (owner and token), so that no copy of the delete
    /// can remove a later OBT of the same id.
    pub async fn release_owned(&self, owned: &Ownership) -> Result<(), ObtError> {
        self.check_owned(owned)?;
        self.remove(
            &owned.id,
            doc! { "owner": &owned.owner, "token": owned.token.0 },
            |now| {
                (now.owner != owned.owner || now.token != owned.token)
                    .then(|| self.preempted(owned, Some(now)))
            },
        )
        .await
    }

    /// Deletes OBT `id` if it matches `condition`; `refuse` says why a committed OBT that does
    /// not match is not the caller's to delete.
    async fn remove(
        &self,
        id: &str,
        condition: Document,
        refuse: impl Fn(&ObtState) -> Option<ObtError>,
    ) -> Result<(), ObtError> {
        let mut filter = doc! { "_id": id, fields::ACTIVE_TXN: null };
        filter.extend(condition);
        let started = Instant::now();
        let mut attempt = 0;
        let mut unsure = false;
        loop {
            let deleted = self.coll.delete_one(filter.clone()).await;
            match deleted {
                Ok(r) if r.deleted_count == 1 => return Ok(()),
                Ok(_) => {}
                Err(e) if is_transient(&e) && started.elapsed() < self.options.retry.max_wait => {
                    unsure = true;
                    tokio::time::sleep(self.options.retry.backoff(attempt)).await;
                    attempt += 1;
                    continue;
                }
                Err(e) => return Err(RepoError::database(&self.coll(), id, "release", e).into()),
            }
            let holder = match self.committed(id).await? {
                // Gone: our earlier send landed (or it was never there).
                None if unsure => return Ok(()),
                None => return Err(self.not_found(id)),
                Some((state, holder)) => match refuse(&state) {
                    Some(e) => return Err(e),
                    None => holder,
                },
            };
            self.wait_turn(id, holder, holder, started, &mut attempt)
                .await?;
        }
    }

    // ----- the database fence -----

    /// Commits `tx` only if `owned` still owns its OBT at the commit point: the transaction
    /// carries a guard on the OBT (this owner, this token) that holds it until the transaction
    /// ends, so a preemption either happens before (the commit writes nothing and fails
    /// [`ObtError::Preempted`]) or waits until after. Heartbeats and stage changes by the owner
    /// itself do not break the guard.
    ///
    /// An ownership already lost when the call is made is refused after one read of the OBT,
    /// before the commit starts: the commit would otherwise write a transaction record and hold
    /// the transaction's documents, only to roll them back at the guard.
    pub async fn commit_owned(
        &self,
        tx: Transaction,
        owned: &Ownership,
    ) -> Result<Outcome, ObtError> {
        self.check_owned(owned)?;
        match self.committed(&owned.id).await? {
            Some((now, _)) if now.owner == owned.owner && now.token == owned.token => {}
            now => return Err(self.preempted(owned, now.as_ref().map(|(s, _)| s))),
        }
        tx.guard(
            &self.repo,
            owned.id.clone(),
            doc! { "owner": &owned.owner, "token": owned.token.0 },
        )?;
        match tx.commit().await {
            Ok(outcome) => Ok(outcome),
            // A document-level refusal means nothing was written. The guard may not have been
            // reached (entries apply in a fixed order), so when the refusal came from elsewhere
            // (a conflict with the newer owner's writes, typically) the OBT says whether
            // ownership was lost, which is the cause to report.
            Err(e) if e.repo_error().is_some() => match self.committed(&owned.id).await {
                Ok(Some((state, _)))
                    if state.owner != owned.owner || state.token != owned.token =>
                {
                    Err(self.preempted(owned, Some(&state)))
                }
                Ok(None) => Err(self.preempted(owned, None)),
                // Still the owner, or the OBT cannot be read (then nothing is known about
                // ownership): the commit's own error is the answer.
                Ok(Some(_)) | Err(_) => Err(e.into()),
            },
            Err(e) => Err(e.into()),
        }
    }
}
