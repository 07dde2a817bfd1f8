//! The OBT operations (create, preempt, take over, heartbeat, advance, release, and a transaction
//! committed only while owned): one conditional write each, and, when it matches nothing, a read
//! of the committed OBT that says why (or that the write had already landed, or that a guard is
//! in the way and the write should be sent again). The steps they share (tokens, reads, the
//! conditional write) are in `steps`; input checks and errors in `checks`.

use std::time::{Duration, Instant};

use bson::{doc, Bson, DateTime, Document};

use crate::obt::error::ObtError;
use crate::obt::model::{NewObt, Observation, ObtState, Ownership};
use crate::obt::steps::Verdict;
use crate::obt::{shown, Obt, MAX_LEASE};
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields;
use crate::retry::Retry;
use crate::server::is_transient;
use crate::txn::transaction::{Outcome, Transaction};

/// How many times a preemption takes a fresh token after finding a higher one already applied.
const REISSUES: usize = 8;

/// How long an owner whose last sign of life is stamped `beat` has been silent at `now` (both
/// server times; zero if `beat` is later).
fn silent_since(beat: chrono::DateTime<chrono::Utc>, now: DateTime) -> Duration {
    let ms = now
        .timestamp_millis()
        .saturating_sub(beat.timestamp_millis());
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

impl Obt {
    /// Creates OBT `id` owned by `new.owner` at stage 0 with a fresh token: one upsert that can
    /// only insert, stamped with the server's time. Sending the same create again after a lost
    /// reply returns the same ownership; an id that is taken is [`ObtError::Exists`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(obts: mongotx::obt::Obt) -> Result<(), mongotx::obt::ObtError> {
    /// use std::time::Duration;
    /// use mongotx::obt::NewObt;
    ///
    /// let new = NewObt::new("volume-7", "server-a").lease(Duration::from_secs(30));
    /// let mut owned = obts.create(new).await?;
    /// // Carry owned.token() to every downstream write (see `Fence`), renew the lease while
    /// // working, and move through the stages of the operation.
    /// obts.heartbeat(&mut owned).await?;
    /// obts.advance_owned(&mut owned, 1).await?;
    /// obts.release_owned(&owned).await?;
    /// # Ok(()) }
    /// ```
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
        let mut retry = Retry::until_deadline(self.options.retry);
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
                Err(e) if is_transient(&e) && !retry.exhausted() => {
                    tracing::debug!(collection = %self.coll(), id = %new.id, error = %e, "obt: create send failed, sending again");
                    retry.pause().await;
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
                None if !retry.exhausted() => {}
                None => {
                    return Err(RepoError::Locked {
                        collection: self.coll(),
                        id: show_id(&Bson::from(new.id.as_str())),
                        holder: None,
                        waited: retry.elapsed(),
                    }
                    .into())
                }
            }
            retry.pause().await;
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

    /// Preemption as in the reference design: takes OBT `id` from `current_owner` (who must own
    /// it now) for `new_owner`, with a new token. No waiting: the previous owner is fenced off
    /// from here on.
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
                            let silent = silent_since(
                                s.beat_at.unwrap_or(server_now.to_chrono()),
                                server_now,
                            );
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

    /// Releases (deletes) OBT `id`, which `owner` must own: the reference design's delete call,
    /// which identifies the owner by name only. A delete delivered late could remove a later OBT
    /// of the same id and owner name; owners that reuse names should use
    /// [`release_owned`](Obt::release_owned).
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
        let mut retry = Retry::until_deadline(self.options.retry);
        let mut unsure = false;
        loop {
            let deleted = self.coll.delete_one(filter.clone()).await;
            match deleted {
                Ok(r) if r.deleted_count == 1 => return Ok(()),
                Ok(_) => {}
                Err(e) if is_transient(&e) && !retry.exhausted() => {
                    unsure = true;
                    retry.pause().await;
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
            self.wait_turn(id, holder, holder, &mut retry).await?;
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
