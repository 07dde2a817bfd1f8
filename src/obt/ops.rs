//! The OBT operations (create, preempt, take over, heartbeat, advance, release, and a transaction
//! committed only while owned): one conditional write each, and, when it matches nothing, a read
//! of the committed OBT that says why (or that the write had already landed, or that a guard is
//! in the way and the write should be sent again). The steps they share (tokens, reads, the
//! conditional write) are in `steps`; input checks and errors in `checks`.

use std::time::{Duration, Instant};

use bson::{doc, Bson, DateTime, Document};
use mongodb::options::ReturnDocument;

use crate::obt::checks;
use crate::obt::error::ObtError;
use crate::obt::model::{NewObt, Observation, ObtState, Ownership, Token};
use crate::obt::steps;
use crate::obt::steps::{Stored, Verdict};
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

/// The body of [`Obt::create`].
pub(crate) async fn create(obt: &Obt, new: NewObt) -> Result<Ownership, ObtError> {
    checks::check_name(obt, "OBT id", &new.id)?;
    checks::check_name(obt, "owner", &new.owner)?;
    let lease_ms = match new.lease {
        None => None,
        Some(lease) if lease.as_millis() == 0 || lease > MAX_LEASE => {
            return Err(checks::invalid(
                obt,
                format!(
                    "OBT {} of {}: lease {lease:?} is not between 1 ms and {MAX_LEASE:?}",
                    shown(&new.id),
                    shown(&new.owner)
                ),
            ))
        }
        Some(lease) => Some(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX)),
    };
    // A taken id is refused before a token is issued for it. A released one keeps its last
    // token, which the new one must exceed (as it exceeds every token of the namespace).
    let (found, mut floor) =
        tokio::try_join!(steps::stored(obt, &new.id), steps::token_floor(obt))?;
    match found {
        Stored::Live(state, _) => return Err(checks::exists(obt, new.id, state)),
        Stored::Released { token, .. } => floor = floor.max(token),
        Stored::Absent => {}
    }
    let mut retry = Retry::until_deadline(obt.options.retry);
    for _ in 0..REISSUES {
        let token = steps::issue_token_above(obt, floor).await?;
        match create_with(obt, &new, lease_ms, token, &mut retry).await? {
            Created::Owned(owned) => return Ok(owned),
            Created::Outrun(higher) => floor = floor.max(higher),
        }
    }
    Err(RepoError::Locked {
        collection: checks::coll(obt),
        id: show_id(&Bson::from(new.id.as_str())),
        holder: None,
        waited: retry.elapsed(),
    }
    .into())
}

/// What one token's create came to.
enum Created {
    Owned(Ownership),
    /// The id was created and released again meanwhile with this higher token: this token can
    /// never land (nor can any copy of it still on its way); take one above it.
    Outrun(Token),
}

/// Creates OBT `new.id` with `token`: one upsert that inserts it, or turns the tombstone of a
/// released OBT with a lower token into it, and never changes a live OBT. A copy delivered late
/// finds either a live OBT or a tombstone with a token at least its own (the id's token only
/// grows), and collides with the id.
async fn create_with(
    obt: &Obt,
    new: &NewObt,
    lease_ms: Option<i64>,
    token: Token,
    retry: &mut Retry,
) -> Result<Created, ObtError> {
    let mut set = doc! {
        fields::SCHEMA_VERSION: obt.repo.spec().schema_version(),
        "owner": &new.owner,
        "stage": 0_i64,
        "token": token.0,
    };
    let mut unset = doc! { fields::DELETED: "", fields::DELETING: "", fields::HOLD: "" };
    match lease_ms {
        Some(ms) => set.insert("lease_ms", ms),
        None => unset.insert("lease_ms", ""),
    };
    // No condition here is an equality but the id's, so an insert holds only what the change
    // sets (a `_txn: null` would be copied into it).
    // (An OBT of a newer format is not matched either: the upsert collides with its id, and
    // the read below refuses it.)
    let filter = steps::guarded(
        obt,
        doc! {
            "_id": &new.id,
            fields::DELETED: { "$exists": true },
            fields::ACTIVE_TXN: { "$not": { "$type": "objectId" } },
            "token": { "$lt": token.0 },
        },
    );
    let change = doc! {
        "$set": set,
        "$unset": unset,
        "$currentDate": { "beat_at": true },
        "$inc": { fields::VERSION: 1_i64 },
    };
    let sent = Instant::now();
    loop {
        let written = obt
            .coll
            .find_one_and_update(filter.clone(), change.clone())
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await;
        match written {
            Ok(Some(stored)) => {
                let state = steps::state_of(obt, &new.id, stored)?;
                return Ok(Created::Owned(Ownership::new(state, sent)));
            }
            Ok(None) => {}
            Err(e) if crate::obt::fence::is_duplicate_key(&e) => {}
            Err(e) if is_transient(&e) && !retry.exhausted() => {
                tracing::debug!(collection = %checks::coll(obt), id = %new.id, error = %e, "obt: create send failed, sending again");
                retry.pause().await;
                continue;
            }
            Err(e) => {
                return Err(RepoError::database(&checks::coll(obt), &new.id, "create", e).into())
            }
        }
        match steps::stored(obt, &new.id).await? {
            // Our own earlier send landed.
            Stored::Live(state, _) if state.owner == new.owner && state.token == token => {
                return Ok(Created::Owned(Ownership::new(state, sent)))
            }
            Stored::Live(state, _) => return Err(checks::exists(obt, new.id.clone(), state)),
            Stored::Released { token: now, .. } if now >= token => return Ok(Created::Outrun(now)),
            Stored::Released {
                holder: Some(holder),
                ..
            } => {
                steps::wait_turn(obt, &new.id, Some(holder), Some(holder), retry).await?;
                continue;
            }
            // Released with a lower token (a race with the release), or gone: send again.
            Stored::Released { .. } | Stored::Absent if !retry.exhausted() => {}
            Stored::Released { .. } | Stored::Absent => {
                return Err(RepoError::Locked {
                    collection: checks::coll(obt),
                    id: show_id(&Bson::from(new.id.as_str())),
                    holder: None,
                    waited: retry.elapsed(),
                }
                .into())
            }
        }
        retry.pause().await;
    }
}

/// The body of [`Obt::preempt`].
pub(crate) async fn preempt(
    obt: &Obt,
    id: &str,
    current_owner: &str,
    new_owner: &str,
) -> Result<Ownership, ObtError> {
    checks::check_name(obt, "OBT id", id)?;
    checks::check_name(obt, "current owner", current_owner)?;
    checks::check_name(obt, "new owner", new_owner)?;
    // A missing OBT or another owner is refused before a token is issued.
    let (found, mut floor) = tokio::try_join!(steps::committed(obt, id), steps::token_floor(obt))?;
    match found {
        None => return Err(checks::not_found(obt, id)),
        Some((s, _)) if s.owner != current_owner => {
            return Err(checks::not_owner(obt, id, current_owner, &s))
        }
        Some((s, _)) => floor = floor.max(s.token),
    }
    for _ in 0..REISSUES {
        let token = steps::issue_token_above(obt, floor).await?;
        let sent = Instant::now();
        let result = steps::conditional(
            obt,
            id,
            "preempt",
            doc! { "owner": current_owner, "token": { "$lt": token.0 } },
            doc! {
                "$set": { "owner": new_owner, "token": token.0 },
                "$currentDate": { "beat_at": true },
            },
            |now| match now {
                None => Verdict::Fail(checks::not_found(obt, id)),
                Some(s) if s.owner == new_owner && s.token == token => Verdict::Done(s.clone()),
                Some(s) if s.owner != current_owner => {
                    Verdict::Fail(checks::not_owner(obt, id, current_owner, s))
                }
                // Taken again by `current_owner` with a later token: take a newer one.
                Some(s) if s.token >= token => Verdict::Fail(ObtError::Changed {
                    collection: checks::coll(obt),
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
            Err(ObtError::Changed { token: now, .. }) => floor = floor.max(now),
            Err(e) => return Err(e),
        }
    }
    Err(checks::invalid(
        obt,
        format!("OBT {id}: preempted {REISSUES} times over by newer tokens of {current_owner}"),
    ))
}

/// The body of [`Obt::take_over`].
pub(crate) async fn take_over(
    obt: &Obt,
    observed: &Observation,
    new_owner: &str,
) -> Result<Ownership, ObtError> {
    checks::check_name(obt, "new owner", new_owner)?;
    let seen = &observed.state;
    checks::check_name(obt, "OBT id of the observation", &seen.id)?;
    let silent = observed.silent_for();
    let lease_live = |owner: &str, lease: Duration| ObtError::LeaseLive {
        collection: checks::coll(obt),
        id: seen.id.clone(),
        owner: owner.to_string(),
        silent,
        lease,
    };
    let no_lease = |owner: &str| ObtError::NoLease {
        collection: checks::coll(obt),
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
    let (found, floor) =
        tokio::try_join!(steps::committed(obt, &seen.id), steps::token_floor(obt))?;
    let Some((now, _)) = found else {
        return Err(checks::not_found(obt, &seen.id));
    };
    if now.version != seen.version || now.token != seen.token {
        return Err(checks::changed(obt, seen, &now));
    }
    match now.lease {
        None => return Err(no_lease(&now.owner)),
        Some(lease) if silent < lease => return Err(lease_live(&now.owner, lease)),
        Some(_) => {}
    }
    take_unchanged(obt, seen, new_owner, floor.max(now.token)).await
}

/// The body of [`Obt::take_over_expired`].
pub(crate) async fn take_over_expired(
    obt: &Obt,
    id: &str,
    new_owner: &str,
) -> Result<Ownership, ObtError> {
    checks::check_name(obt, "OBT id", id)?;
    checks::check_name(obt, "new owner", new_owner)?;
    // A missing OBT, one without a lease, or one whose lease (and the clock slack) is running
    // by this process's estimate of the server's clock is refused before a token is issued.
    // The write itself still decides by the server's own clock; the estimate only spares a
    // token when the answer is plain.
    let slack = obt.options.clock_slack;
    let slack_ms = i64::try_from(slack.as_millis()).unwrap_or(i64::MAX);
    let (found, floor) = tokio::try_join!(steps::committed(obt, id), steps::token_floor(obt))?;
    let Some((seen, _)) = found else {
        return Err(checks::not_found(obt, id));
    };
    let Some(lease) = seen.lease else {
        return Err(ObtError::NoLease {
            collection: checks::coll(obt),
            id: id.to_string(),
            owner: seen.owner,
        });
    };
    if let Some(beat) = seen.beat_at {
        let silent = silent_since(beat, obt.store.now().await?);
        if silent < lease.saturating_add(slack) {
            return Err(ObtError::LeaseLive {
                collection: checks::coll(obt),
                id: id.to_string(),
                owner: seen.owner,
                silent,
                lease,
            });
        }
    }
    let token = steps::issue_token_above(obt, floor.max(seen.token)).await?;
    // Only to tell a running lease from a guard in the way when the write misses.
    let server_now = obt.store.now().await?;
    let sent = Instant::now();
    let state = steps::conditional(
        obt,
        id,
        "take over",
        doc! {
            "lease_ms": { "$gt": 0_i64 },
            "token": { "$lt": token.0 },
            "$expr": {
                "$lte": [
                    "$beat_at",
                    { "$subtract": ["$$NOW", { "$add": ["$lease_ms", slack_ms] }] },
                ]
            },
        },
        doc! {
            "$set": { "owner": new_owner, "token": token.0 },
            "$currentDate": { "beat_at": true },
        },
        |now| match now {
            None => Verdict::Fail(checks::not_found(obt, id)),
            Some(s) if s.owner == new_owner && s.token == token => Verdict::Done(s.clone()),
            Some(s) => match s.lease {
                None => Verdict::Fail(ObtError::NoLease {
                    collection: checks::coll(obt),
                    id: id.to_string(),
                    owner: s.owner.clone(),
                }),
                Some(lease) => {
                    let silent =
                        silent_since(s.beat_at.unwrap_or(server_now.to_chrono()), server_now);
                    if s.token > token || silent < lease.saturating_add(slack) {
                        Verdict::Fail(ObtError::LeaseLive {
                            collection: checks::coll(obt),
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
    tracing::info!(collection = %checks::coll(obt), id, to = new_owner, token = %token, "obt: took over an OBT whose lease ran out");
    Ok(Ownership::new(state, sent))
}

/// Gives `seen` to `new_owner` with a new token above `floor` (at least `seen`'s) if it is
/// still exactly as seen.
async fn take_unchanged(
    obt: &Obt,
    seen: &ObtState,
    new_owner: &str,
    floor: Token,
) -> Result<Ownership, ObtError> {
    let token = steps::issue_token_above(obt, floor).await?;
    let sent = Instant::now();
    let state = steps::conditional(
        obt,
        &seen.id,
        "take over",
        doc! { "token": seen.token.0, fields::VERSION: seen.version },
        doc! {
            "$set": { "owner": new_owner, "token": token.0 },
            "$currentDate": { "beat_at": true },
        },
        |now| match now {
            None => Verdict::Fail(checks::not_found(obt, &seen.id)),
            Some(s) if s.owner == new_owner && s.token == token => Verdict::Done(s.clone()),
            Some(s) if s.version != seen.version || s.token != seen.token => {
                Verdict::Fail(checks::changed(obt, seen, s))
            }
            Some(_) => Verdict::Again,
        },
    )
    .await?;
    tracing::info!(collection = %checks::coll(obt), id = %seen.id, from = %seen.owner, to = new_owner, token = %token, "obt: took over a silent owner's OBT");
    Ok(Ownership::new(state, sent))
}

/// The body of [`Obt::heartbeat`].
pub(crate) async fn heartbeat(obt: &Obt, owned: &mut Ownership) -> Result<(), ObtError> {
    checks::check_owned(obt, owned)?;
    let sent = Instant::now();
    steps::write_if(
        obt,
        &owned.id,
        "heartbeat",
        doc! { "owner": &owned.owner, "token": owned.token.0 },
        doc! { "$currentDate": { "beat_at": true } },
        false,
        |now| match now {
            Some(s) if s.owner == owned.owner && s.token == owned.token => Verdict::Again,
            other => Verdict::Fail(checks::preempted(obt, owned, other)),
        },
    )
    .await?;
    owned.lease_until = owned.lease.map(|lease| sent + lease);
    Ok(())
}

/// The body of [`Obt::advance`].
pub(crate) async fn advance(
    obt: &Obt,
    id: &str,
    owner: &str,
    stage: i64,
) -> Result<ObtState, ObtError> {
    checks::check_name(obt, "OBT id", id)?;
    checks::check_name(obt, "owner", owner)?;
    checks::check_stage(obt, id, stage)?;
    steps::conditional(
        obt,
        id,
        "advance",
        doc! { "owner": owner, "stage": { "$lt": stage } },
        doc! { "$set": { "stage": stage }, "$currentDate": { "beat_at": true } },
        |now| match now {
            None => Verdict::Fail(checks::not_found(obt, id)),
            Some(s) if s.owner != owner => Verdict::Fail(checks::not_owner(obt, id, owner, s)),
            Some(s) if s.stage == stage => Verdict::Done(s.clone()),
            Some(s) if s.stage > stage => Verdict::Fail(ObtError::StageReplayed {
                collection: checks::coll(obt),
                id: id.to_string(),
                current: s.stage,
                presented: stage,
            }),
            Some(_) => Verdict::Again,
        },
    )
    .await
}

/// The body of [`Obt::advance_owned`].
pub(crate) async fn advance_owned(
    obt: &Obt,
    owned: &mut Ownership,
    stage: i64,
) -> Result<(), ObtError> {
    checks::check_owned(obt, owned)?;
    checks::check_stage(obt, &owned.id, stage)?;
    let state = steps::conditional(
        obt,
        &owned.id,
        "advance",
        doc! { "owner": &owned.owner, "token": owned.token.0, "stage": { "$lt": stage } },
        doc! { "$set": { "stage": stage }, "$currentDate": { "beat_at": true } },
        |now| match now {
            Some(s) if s.owner != owned.owner || s.token != owned.token => {
                Verdict::Fail(checks::preempted(obt, owned, Some(s)))
            }
            None => Verdict::Fail(checks::preempted(obt, owned, None)),
            Some(s) if s.stage == stage => Verdict::Done(s.clone()),
            Some(s) if s.stage > stage => Verdict::Fail(ObtError::StageReplayed {
                collection: checks::coll(obt),
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

/// The body of [`Obt::release`].
pub(crate) async fn release(obt: &Obt, id: &str, owner: &str) -> Result<(), ObtError> {
    checks::check_name(obt, "OBT id", id)?;
    checks::check_name(obt, "owner", owner)?;
    remove(
        obt,
        id,
        doc! { "owner": owner },
        |now| (now.owner != owner).then(|| checks::not_owner(obt, id, owner, now)),
        |by, _| by == owner,
    )
    .await
}

/// The body of [`Obt::release_owned`].
pub(crate) async fn release_owned(obt: &Obt, owned: &Ownership) -> Result<(), ObtError> {
    checks::check_owned(obt, owned)?;
    remove(
        obt,
        &owned.id,
        doc! { "owner": &owned.owner, "token": owned.token.0 },
        |now| {
            (now.owner != owned.owner || now.token != owned.token)
                .then(|| checks::preempted(obt, owned, Some(now)))
        },
        |by, token| by == owned.owner && token == owned.token,
    )
    .await
}

/// Releases OBT `id` if it matches `condition`: turns it into a tombstone (`_deleted` set) that
/// keeps the owner that released it and its last token. `refuse` says why a live OBT that does
/// not match is not the caller's to release; `mine` whether a tombstone's owner and token are
/// what this call releases.
///
/// The tombstone is what makes the release safe to send again and every other write safe to
/// deliver late: no write matches a tombstone but a create with a higher token, so a late create,
/// preempt, heartbeat or release changes nothing; and a release sent again after an error finds
/// either its own tombstone (its earlier send landed: done) or another owner's, or a live OBT
/// that is not its own (the caller had lost the OBT: refused as a call that was never retried
/// would be).
async fn remove(
    obt: &Obt,
    id: &str,
    condition: Document,
    refuse: impl Fn(&ObtState) -> Option<ObtError>,
    mine: impl Fn(&str, Token) -> bool,
) -> Result<(), ObtError> {
    let mut filter = doc! { "_id": id, fields::ACTIVE_TXN: null, fields::DELETED: null };
    filter.extend(condition);
    let filter = steps::guarded(obt, filter);
    let change = doc! {
        "$currentDate": { fields::DELETED: true },
        "$inc": { fields::VERSION: 1_i64 },
    };
    let mut retry = Retry::until_deadline(obt.options.retry);
    let mut unsure = false;
    loop {
        let released = obt.coll.update_one(filter.clone(), change.clone()).await;
        match released {
            Ok(r) if r.matched_count == 1 => return Ok(()),
            Ok(_) => {}
            Err(e) if is_transient(&e) && !retry.exhausted() => {
                unsure = true;
                retry.pause().await;
                continue;
            }
            Err(e) => return Err(RepoError::database(&checks::coll(obt), id, "release", e).into()),
        }
        let holder = match steps::stored(obt, id).await? {
            // Our earlier send landed: the tombstone is ours.
            Stored::Released {
                owner: Some(by),
                token,
                ..
            } if unsure && mine(&by, token) => return Ok(()),
            // Released before this call (by the caller or anyone else), or never there.
            Stored::Released { .. } | Stored::Absent => return Err(checks::not_found(obt, id)),
            Stored::Live(state, holder) => match refuse(&state) {
                Some(e) => return Err(e),
                None => holder,
            },
        };
        steps::wait_turn(obt, id, holder, holder, &mut retry).await?;
    }
}

/// The body of [`Obt::commit_owned`].
pub(crate) async fn commit_owned(
    obt: &Obt,
    tx: Transaction,
    owned: &Ownership,
) -> Result<Outcome, ObtError> {
    checks::check_owned(obt, owned)?;
    match steps::committed(obt, &owned.id).await? {
        Some((now, _)) if now.owner == owned.owner && now.token == owned.token => {}
        now => return Err(checks::preempted(obt, owned, now.as_ref().map(|(s, _)| s))),
    }
    tx.guard(
        &obt.repo,
        owned.id.clone(),
        doc! { "owner": &owned.owner, "token": owned.token.0 },
    )?;
    match tx.commit().await {
        Ok(outcome) => Ok(outcome),
        // A document-level refusal means nothing was written. The guard may not have been
        // reached (entries apply in a fixed order), so when the refusal came from elsewhere
        // (a conflict with the newer owner's writes, typically) the OBT says whether
        // ownership was lost, which is the cause to report.
        Err(e) if e.repo_error().is_some() => match steps::committed(obt, &owned.id).await {
            Ok(Some((state, _))) if state.owner != owned.owner || state.token != owned.token => {
                Err(checks::preempted(obt, owned, Some(&state)))
            }
            Ok(None) => Err(checks::preempted(obt, owned, None)),
            // Still the owner, or the OBT cannot be read (then nothing is known about
            // ownership): the commit's own error is the answer.
            Ok(Some(_)) | Err(_) => Err(e.into()),
        },
        Err(e) => Err(e.into()),
    }
}
