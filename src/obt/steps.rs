//! The steps every OBT operation is made of: issuing a fencing token above every token stored in
//! the namespace, reading the OBT as stored (live through any transaction holding its document,
//! or a released OBT's tombstone), and one conditional write that, when it matches nothing, reads
//! the OBT to judge why (done already, refused, or worth sending again).
//!
//! The stored format (`repo::format`): the token counter is marked with the format the store
//! writes (nothing for format 1) and, like every OBT write, matched only while it is of a format
//! this store reads; a counter or an OBT of a newer format is refused when read, so a write its
//! guard kept from matching ends in that typed refusal ([`ObtError::Format`]), nothing written.

use std::time::Instant;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use mongodb::options::ReturnDocument;

use crate::obt::checks;
use crate::obt::error::ObtError;
use crate::obt::model::{Observation, ObtDoc, ObtState, Token};
use crate::obt::Obt;
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields;
use crate::repo::format;
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

/// The body of [`Obt::issue_token`]: above every token an OBT of the namespace holds, however
/// the counter got behind.
pub(crate) async fn issue_token(obt: &Obt) -> Result<Token, ObtError> {
    let floor = token_floor(obt).await?;
    issue_token_above(obt, floor).await
}

/// The highest token stored in the namespace: every OBT's, released ones included (a released
/// OBT keeps its last token, see `ops::remove`). Every token ever handed to an owner was stored
/// in its OBT, and an OBT's token only grows, so this is at least every token an owner or a
/// fence can hold. One read on the `token` index.
pub(super) async fn token_floor(obt: &Obt) -> Result<Token, ObtError> {
    let top = obt
        .coll
        .find_one(doc! {})
        .sort(doc! { "token": -1 })
        .projection(doc! { "_id": 0, "token": 1 })
        .await
        .map_err(|e| RepoError::database(&checks::coll(obt), "*", "read the highest token", e))?;
    Ok(Token(
        top.and_then(|d| match d.get("token") {
            Some(Bson::Int64(t)) => Some(*t),
            Some(Bson::Int32(t)) => Some(i64::from(*t)),
            _ => None,
        })
        .unwrap_or(0),
    ))
}

/// Issues the namespace's next token, above `floor` whatever the counter says: one
/// `findAndModify` setting `last` to `max(last, floor) + 1`. A counter that was deleted (it is
/// created again) or restored from an old backup is lifted over the floor in the same write.
pub(super) async fn issue_token_above(obt: &Obt, floor: Token) -> Result<Token, ObtError> {
    let namespace = obt.repo.name();
    let writes = obt.store.writes_format().await?;
    let mut pace = Retry::tries(obt.options.retry, 9);
    let counter = guarded(obt, doc! { "_id": namespace });
    let next = format::mark_pipeline(
        vec![doc! {
        "$set": {
            "last": {
                "$add": [
                    { "$max": [{ "$ifNull": ["$last", 0_i64] }, floor.0] },
                    1_i64,
                ]
            }
        }
        }],
        writes,
    );
    loop {
        let issued = obt
            .tokens
            .find_one_and_update(counter.clone(), next.clone())
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
            // The counter may be of a newer format, which the guard kept from matching (so the
            // upsert tried to make it): refused. Otherwise two first upserts raced.
            Err(e) if crate::obt::fence::is_duplicate_key(&e) => {
                let found = obt
                    .tokens
                    .find_one(doc! { "_id": namespace })
                    .await
                    .map_err(|e| {
                        RepoError::database(obt.tokens.name(), namespace, "issue token", e)
                    })?;
                if let Some(found) = &found {
                    format::check_doc(found, obt.store.reads_format(), obt.tokens.name())?;
                }
                Some(e)
            }
            Err(e) if is_transient(&e) => Some(e),
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

/// `filter` of a write on an OBT or a token counter, matching it only while it is of a stored
/// format this store reads.
pub(super) fn guarded(obt: &Obt, filter: Document) -> Document {
    format::guard(filter, obt.store.reads_format())
}

// ----- reading -----

pub(super) fn state_of(obt: &Obt, id: &str, stored: Document) -> Result<ObtState, ObtError> {
    let version = stored.get_i64(fields::VERSION).map_err(|e| {
        obt.repo.malformed(
            &show_id(&Bson::from(id)),
            format!("no whole `_version`: {e}"),
        )
    })?;
    let doc: ObtDoc = bson::from_document(stored)
        .map_err(|e| obt.repo.malformed(&show_id(&Bson::from(id)), e.to_string()))?;
    Ok(ObtState::from_stored(doc, version))
}

/// An OBT document as stored.
pub(super) enum Stored {
    /// No document: the id was never used (or its tombstone was removed by hand).
    Absent,
    /// A released OBT: its tombstone keeps the owner that released it and its last token, so that
    /// no late copy of an earlier write can bring the id back with a lower token, and a release
    /// sent again can tell its own release from someone else's.
    Released {
        owner: Option<String>,
        token: Token,
        holder: Option<ObjectId>,
        /// When it was released (server time), and the stage its owner had reached then.
        at: Option<DateTime>,
        stage: Option<i64>,
    },
    /// A live OBT as committed, and the transaction holding its document, if any.
    Live(ObtState, Option<ObjectId>),
}

/// OBT `id` as stored (through any transaction holding its document).
pub(super) async fn stored(obt: &Obt, id: &str) -> Result<Stored, ObtError> {
    let key = Bson::from(id);
    let shown = show_id(&key);
    let stored = obt
        .coll
        .find_one(doc! { "_id": id })
        .await
        .map_err(|e| RepoError::database(&checks::coll(obt), id, "read", e))?;
    let Some(stored) = stored else {
        return Ok(Stored::Absent);
    };
    format::check_doc(&stored, obt.store.reads_format(), &checks::coll(obt))?;
    let holder = stored.get_object_id(fields::ACTIVE_TXN).ok();
    let owner = stored.get_str("owner").ok().map(str::to_string);
    let token = match stored.get("token") {
        Some(Bson::Int64(t)) => Some(Token(*t)),
        Some(Bson::Int32(t)) => Some(Token(i64::from(*t))),
        _ => None,
    };
    let at = stored.get_datetime(fields::DELETED).ok().copied();
    let stage = stored.get_i64("stage").ok();
    match obt.repo.committed(&shown, stored).await? {
        Committed::Live(doc) => Ok(Stored::Live(state_of(obt, id, doc)?, holder)),
        Committed::Deleted(_) | Committed::Absent => Ok(match token {
            Some(token) => Stored::Released {
                owner,
                token,
                holder,
                at,
                stage,
            },
            None => Stored::Absent,
        }),
    }
}

/// The committed OBT and the transaction holding its document, if any (`None` when there is
/// none or it was released).
pub(super) async fn committed(
    obt: &Obt,
    id: &str,
) -> Result<Option<(ObtState, Option<ObjectId>)>, ObtError> {
    Ok(match stored(obt, id).await? {
        Stored::Live(state, holder) => Some((state, holder)),
        Stored::Absent | Stored::Released { .. } => None,
    })
}

/// The body of [`Obt::get`].
pub(crate) async fn get(obt: &Obt, id: &str) -> Result<ObtState, ObtError> {
    checks::check_name(obt, "OBT id", id)?;
    match committed(obt, id).await? {
        Some((state, _)) => Ok(state),
        None => Err(checks::not_found(obt, id)),
    }
}

/// The body of [`Obt::observe`].
pub(crate) async fn observe(obt: &Obt, id: &str) -> Result<Observation, ObtError> {
    let state = obt.get(id).await?;
    Ok(Observation {
        state,
        seen_at: Instant::now(),
    })
}

/// The body of [`Obt::check`].
pub(crate) async fn check(
    obt: &Obt,
    id: &str,
    owner: &str,
    stage: i64,
) -> Result<ObtState, ObtError> {
    checks::check_name(obt, "owner", owner)?;
    checks::check_stage(obt, id, stage)?;
    let state = obt.get(id).await?;
    if state.owner != owner {
        return Err(checks::not_owner(obt, id, owner, &state));
    }
    if state.stage > stage {
        return Err(ObtError::StageReplayed {
            collection: checks::coll(obt),
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
    obt: &Obt,
    id: &str,
    what: &'static str,
    condition: Document,
    change: Document,
    judge: impl Fn(Option<&ObtState>) -> Verdict,
) -> Result<ObtState, ObtError> {
    match write_if(obt, id, what, condition, change, true, judge).await? {
        Some(state) => Ok(state),
        None => obt.get(id).await,
    }
}

/// One conditional write on OBT `id`, re-sent after transient errors and guards, with
/// `judge` deciding from the committed OBT whenever it matches nothing. With `post_image`
/// it is a `findAndModify` returning the OBT after the write; without, a plain update that
/// returns `None` when it lands (cheaper on some servers).
pub(super) async fn write_if(
    obt: &Obt,
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
        fields::SCHEMA_VERSION: obt.repo.spec().schema_version(),
    };
    filter.extend(condition);
    let filter = guarded(obt, filter);
    let mut change = change;
    change.insert("$inc", doc! { fields::VERSION: 1_i64 });
    let mut retry = Retry::until_deadline(obt.options.retry);
    let mut holder = None;
    loop {
        let written = if post_image {
            obt.coll
                .find_one_and_update(filter.clone(), change.clone())
                .return_document(ReturnDocument::After)
                .await
        } else {
            obt.coll
                .update_one(filter.clone(), change.clone())
                .await
                .map(|r| (r.matched_count == 1).then(Document::new))
        };
        let found = match written {
            Ok(Some(_)) if !post_image => return Ok(None),
            Ok(Some(stored)) => return state_of(obt, id, stored).map(Some),
            Ok(None) => committed(obt, id).await?,
            Err(e) if is_transient(&e) => {
                // It may have landed. Sending it again is safe: it is conditional, and if
                // the first copy landed the judge recognises the result.
                tracing::debug!(collection = %checks::coll(obt), id, what, error = %e, "obt: send failed, sending again");
                if retry.exhausted() {
                    return Err(RepoError::database(&checks::coll(obt), id, what, e).into());
                }
                retry.pause().await;
                continue;
            }
            Err(e) => return Err(RepoError::database(&checks::coll(obt), id, what, e).into()),
        };
        match judge(found.as_ref().map(|(state, _)| state)) {
            Verdict::Done(state) => return Ok(Some(state)),
            Verdict::Fail(e) => return Err(e),
            Verdict::Again => {}
        }
        let holding = found.and_then(|(_, h)| h);
        holder = holding.or(holder);
        wait_turn(obt, id, holding, holder, &mut retry).await?;
    }
}

/// Before writing OBT `id` again: gets the hold of `holding` out of the way if its outcome
/// is decided (then at once), otherwise backs off, or gives up as
/// [`RepoError::Locked`] (naming `last_holder`) once the wait budget is spent.
pub(super) async fn wait_turn(
    obt: &Obt,
    id: &str,
    holding: Option<ObjectId>,
    last_holder: Option<ObjectId>,
    retry: &mut Retry,
) -> Result<(), ObtError> {
    let key = Bson::from(id);
    if let Some(h) = holding {
        if obt.repo.settle_hold(&key, &show_id(&key), h).await? {
            return Ok(());
        }
    }
    if retry.exhausted() {
        return Err(RepoError::Locked {
            collection: checks::coll(obt),
            id: show_id(&key),
            holder: last_holder,
            waited: retry.elapsed(),
        }
        .into());
    }
    retry.pause().await;
    Ok(())
}
