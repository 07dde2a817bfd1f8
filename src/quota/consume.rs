//! Consuming and reserving quota: the single-provider fast path (one conditional update) and
//! the generation-checked path across providers and their ancestors (one transaction when there
//! are several).

use std::collections::BTreeSet;
use std::time::Duration;

use bson::{doc, Bson, DateTime, Document};
use futures::TryStreamExt;

use crate::collections::PROVIDERS_COLLECTION;
use crate::quota::access;
use crate::quota::decide::stripe_of;
use crate::quota::decide::{self, Docs, Take, Write};
use crate::quota::error::{QuotaError, Refusal};
use crate::quota::model::{Consumed, ProviderDoc, ProviderId, Request, Reservation, StripeId};
use crate::quota::ops::{self, stored_or_restored, Attempts, Step, FAST_TRIES, MAX_TTL};
use crate::quota::stripes::{hash, lend, STRIPE_ENTRIES};
use crate::quota::Quota;
use crate::repo::error::RepoError;
use crate::repo::fields;
use crate::repo::format;
use crate::retry::Retry;
use crate::server::clock::plus;
use crate::server::is_transient;
use crate::txn::failpoint;

/// The body of [`Quota::consume`].
pub(crate) async fn consume(quota: &Quota, request: &Request) -> Result<Consumed, QuotaError> {
    decide::check_request(request)?;
    let (consumed, _) = take(quota, request, None).await?;
    ops::check(quota, failpoint::QUOTA_CONSUME_AFTER)?;
    Ok(consumed)
}

/// The body of [`Quota::reserve`].
pub(crate) async fn reserve(
    quota: &Quota,
    request: &Request,
    ttl: Duration,
) -> Result<Reservation, QuotaError> {
    decide::check_request(request)?;
    // Expiries are stored in whole milliseconds: a ttl under one would expire as it is made.
    if ttl < Duration::from_millis(1) || ttl > MAX_TTL {
        return Err(QuotaError::InvalidTtl {
            consumer: request.consumer.clone(),
            request: request.id.clone(),
            ttl,
        });
    }
    let expires = plus(quota.store.now().await?, ttl);
    let (_, stored) = take(quota, request, Some(expires)).await?;
    ops::check(quota, failpoint::QUOTA_RESERVE_AFTER)?;
    Ok(Reservation {
        consumer: request.consumer.clone(),
        request: request.id.clone(),
        expires: stored.unwrap_or(expires).to_chrono(),
        claims: request.claims.clone(),
    })
}

pub(super) async fn take(
    quota: &Quota,
    request: &Request,
    expires: Option<DateTime>,
) -> Result<(Consumed, Option<DateTime>), QuotaError> {
    if request.in_flight() {
        refuse_reuse_elsewhere(quota, request).await?;
    }
    if let Some(done) = fast_if_served(quota, request, expires).await? {
        return Ok(done);
    }
    take_checked(quota, request, expires).await
}

/// Refuses a request whose (consumer, id) already holds part of a provider this request
/// does not touch: the id is in use for other providers. The writes only look at the
/// providers they touch, so without this the same id would count a second time elsewhere.
///
/// Only a request whose id the caller chose (or that was resent) can meet its id elsewhere,
/// so only those pay this read; a fresh id keeps the single-write fast path. One plain query
/// on the indexed entries, which also looks at the values a pending transaction would
/// restore; a concurrent first use of the same id elsewhere can still slip past, as it is
/// then a race between two different requests under one id.
pub(super) async fn refuse_reuse_elsewhere(
    quota: &Quota,
    request: &Request,
) -> Result<(), QuotaError> {
    // Live entries only: a released request remembered at 0 (until its late copies can no
    // longer land) holds nothing, and after it is forgotten its id is free anyway.
    let filter = doc! { "held": { "$elemMatch": {
        "c": &request.consumer, "r": &request.id, "n": { "$gt": 0_i64 },
    } } };
    let found: Vec<Document> = quota
        .repo
        .raw_collection()
        .find(stored_or_restored(&filter))
        .projection(doc! { "_id": 1, "ancestors": 1 })
        .await
        .map_err(|e| RepoError::database(PROVIDERS_COLLECTION, "*", "find request", e))?
        .try_collect()
        .await
        .map_err(|e| RepoError::database(PROVIDERS_COLLECTION, "*", "find request", e))?;
    /// What the query projects of a provider.
    #[derive(serde::Deserialize)]
    struct Holder {
        #[serde(rename = "_id")]
        id: ProviderId,
        #[serde(default)]
        ancestors: Vec<ProviderId>,
    }
    // A document of another shape cannot be a provider holding this request.
    let holders: Vec<(ProviderId, Vec<ProviderId>)> = found
        .into_iter()
        .filter_map(|stored| bson::from_document::<Holder>(stored).ok())
        .map(|h| (h.id, h.ancestors))
        .collect();
    let claimed: BTreeSet<&ProviderId> = request.claims.iter().map(|(p, _)| p).collect();
    // A claimed provider's entry is mirrored in its ancestors: those are not elsewhere.
    let touched: BTreeSet<&ProviderId> = holders
        .iter()
        .filter(|(id, _)| claimed.contains(id))
        .flat_map(|(id, ancestors)| std::iter::once(id).chain(ancestors.iter()))
        .collect();
    if holders.iter().any(|(id, _)| !touched.contains(id)) {
        return Err(QuotaError::RequestReused {
            consumer: request.consumer.clone(),
            request: request.id.clone(),
        });
    }
    Ok(())
}

/// One provider without a parent: one update of the request's stripe whose condition is the
/// decision itself. `None` when the generation-checked path must decide instead.
pub(super) async fn take_fast(
    quota: &Quota,
    request: &Request,
    provider: &ProviderId,
    amount: i64,
    expires: Option<DateTime>,
) -> Result<Option<(Consumed, Option<DateTime>)>, QuotaError> {
    let h = hash(&request.consumer, &request.id);
    let coll = quota.repo.raw_collection();
    let mut writes = 0;
    let consumed = |replayed: bool, writes: u32| Consumed {
        consumer: request.consumer.clone(),
        request: request.id.clone(),
        replayed,
        writes,
        retries: 0,
        claims: request.claims.clone(),
    };
    let mut pace = Retry::until_deadline(quota.options.retry);
    for _ in 0..FAST_TRIES {
        let Some((stripe, bits)) = access::layout(quota, provider).locate(h) else {
            return Ok(None);
        };
        let stripe = StripeId::new(provider, stripe);
        let shown = stripe.to_string();
        let now = quota.store.now().await?;
        let deadline = plus(now, quota.options.send_window);
        let mut entry = doc! { "c": &request.consumer, "r": &request.id, "n": amount };
        if let Some(expires) = expires {
            entry.insert("exp", expires);
        }
        if request.in_flight() {
            entry.insert("dl", deadline);
        }
        // Matched only while of a stored format this store reads (`repo::format`): one of a
        // newer format is refused by the read that explains the miss.
        let filter = format::guard(
            doc! {
            "_id": stripe.to_bson(),
            // The stripe still holds this hash (a split bumps it) and has room for one more
            // entry: a full one is split first.
            "bits": if bits == 0 { Bson::Null } else { Bson::Int64(bits) },
            format!("held.{}", STRIPE_ENTRIES - 1): { "$exists": false },
            fields::SCHEMA_VERSION: quota.repo.spec().schema_version(),
            fields::ACTIVE_TXN: null,
            fields::DELETED: null,
            "parent": null,
            "over": { "$ne": true },
            "available": { "$gte": amount },
            "held": { "$not": { "$elemMatch": { "c": &request.consumer, "r": &request.id } } },
            "$expr": { "$lte": ["$$NOW", deadline] },
            },
            quota.store.reads_format(),
        );
        let update = doc! {
            "$inc": { "usage": amount, "available": -amount, fields::VERSION: 1_i64 },
            "$push": { "held": entry },
        };
        writes += 1;
        match coll.update_one(filter, update).await {
            Ok(result) if result.matched_count == 1 => {
                return Ok(Some((consumed(false, writes), expires)))
            }
            Ok(_) => {}
            Err(e) if is_transient(&e) => {
                // The update may have been applied, or may still be: from now on every
                // send of this request leaves a deadline in its entry.
                request.mark_in_flight();
                tracing::debug!(provider = %shown, error = %e, "quota: consume send failed, resending");
                pace.pause().await;
                continue;
            }
            Err(e) => {
                return Err(RepoError::database(PROVIDERS_COLLECTION, &shown, "consume", e).into())
            }
        }
        // Nothing matched: find out why from the stripe itself.
        let stored = quota.repo.read_raw(&stripe.to_bson(), &shown).await?;
        if let Some(stored) = &stored {
            format::check_doc(stored, quota.store.reads_format(), PROVIDERS_COLLECTION)?;
        }
        let Some(stored) = stored else {
            if stripe.stripe == 0 {
                return Err(QuotaError::UnknownProvider {
                    provider: provider.clone(),
                });
            }
            access::relearn(quota, provider).await?;
            continue;
        };
        if stored
            .get(fields::DELETED)
            .is_some_and(|v| v != &Bson::Null)
        {
            return Err(QuotaError::UnknownProvider {
                provider: provider.clone(),
            });
        }
        if stored.get("parent").is_some_and(|v| v != &Bson::Null) {
            access::remember_parent(quota, provider);
            return Ok(None);
        }
        let held = stored
            .get(fields::ACTIVE_TXN)
            .is_some_and(|v| v != &Bson::Null);
        if held
            || stored.get_i64(fields::SCHEMA_VERSION).ok()
                != Some(quota.repo.spec().schema_version())
        {
            return Ok(None);
        }
        let generation = stored.get_i64(fields::VERSION).unwrap_or_default();
        let doc: ProviderDoc =
            bson::from_document(stored).map_err(|e| quota.repo.malformed(&shown, e.to_string()))?;
        if doc.bits != bits {
            // Split since this handle read the layout.
            access::relearn(quota, provider).await?;
            continue;
        }
        let (full, striped) = (doc.held.len() >= STRIPE_ENTRIES, doc.bits != 0);
        let docs: Docs = [(stripe.clone(), (generation, doc))].into_iter().collect();
        match decide::take(request, &docs, expires, None, now) {
            Ok(Take::Replay { expires }) => {
                if request.in_flight() {
                    keep_deadline(quota, request, &stripe, deadline).await?;
                }
                return Ok(Some((consumed(true, writes), expires)));
            }
            Ok(Take::Apply(_)) if full => {
                access::split_stripe(quota, provider, stripe.stripe).await?
            }
            // It changed between the write and the read, or the send arrived after its
            // deadline: try again.
            Ok(Take::Apply(_)) => {}
            // A striped provider's refusal is its stripe's: borrow, and refuse with the
            // provider's own numbers only when the whole of it lacks room.
            Err(QuotaError::QuotaExceeded { .. }) if striped => {
                if let Some(refusal) = access::borrow_into(quota, &stripe, amount).await? {
                    return Err(QuotaError::QuotaExceeded {
                        consumer: request.consumer.clone(),
                        request: request.id.clone(),
                        refusals: vec![refusal],
                    });
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

/// A request found applied by a resend may have other copies in flight, sent after the one that
/// landed and so with later deadlines: its entry must keep the latest of them (`deadline` is
/// this send's, no earlier than any copy sent before it) so that a release remembers it until
/// no copy can land any more.
pub(super) async fn keep_deadline(
    quota: &Quota,
    request: &Request,
    stripe: &StripeId,
    deadline: DateTime,
) -> Result<(), QuotaError> {
    let mut attempts = Attempts::new(
        quota.options.retry,
        format!(
            "keep the deadline of request {} of consumer {}",
            request.id, request.consumer
        ),
    );
    loop {
        let (generation, mut doc) = access::read_stripe(quota, stripe).await?;
        let Some(entry) = doc.held.iter_mut().find(|e| {
            e.is(&request.consumer, &request.id)
                && !e.is_tombstone()
                && e.dl.is_none_or(|dl| dl < deadline)
        }) else {
            return Ok(());
        };
        entry.dl = Some(deadline);
        match access::write(quota, vec![Write { generation, doc }]).await? {
            Step::Done => return Ok(()),
            Step::Retry(reason) | Step::Ambiguous(reason) => attempts.again(reason).await?,
        }
    }
}

/// The algorithm of the quota's reference design: read the providers and their generations,
/// decide, write all of them conditionally on the generations read (one transaction when
/// there are several), and start over if any changed.
pub(super) async fn take_checked(
    quota: &Quota,
    request: &Request,
    expires: Option<DateTime>,
) -> Result<(Consumed, Option<DateTime>), QuotaError> {
    let mut attempts = Attempts::new(
        quota.options.retry,
        format!(
            "consume request {} of consumer {}",
            request.id, request.consumer
        ),
    );
    let mut writes = 0_u32;
    let mut guards = Vec::new();
    loop {
        let now = quota.store.now().await?;
        let deadline = request
            .in_flight()
            .then(|| plus(now, quota.options.send_window));
        let Some(docs) = access::read_for(quota, request).await? else {
            attempts
                .again("a stripe was split while it was read".into())
                .await?;
            continue;
        };
        if docs.len() > 1 && guards.is_empty() {
            guards = access::queue(quota, docs.keys()).await;
            continue;
        }
        if let Some(full) = docs
            .keys()
            .find(|id| docs[*id].1.held.len() >= STRIPE_ENTRIES)
        {
            access::split_stripe(quota, &full.provider(), full.stripe).await?;
            attempts.again(format!("{full} was full")).await?;
            continue;
        }
        let take = match decide::take(request, &docs, expires, deadline, now) {
            Ok(take) => take,
            Err(QuotaError::QuotaExceeded { refusals, .. }) => {
                if let Some((stripe, need)) = lone_striped(&docs, &refusals) {
                    match borrow_and_take(
                        quota,
                        request,
                        &docs,
                        &stripe,
                        need,
                        (expires, deadline),
                        now,
                    )
                    .await?
                    {
                        Some(take) => take,
                        None => {
                            attempts.again("share moved between stripes".into()).await?;
                            continue;
                        }
                    }
                } else {
                    // A striped provider's refusal is its stripe's: borrow, and refuse with the
                    // provider's own numbers only when the whole of it lacks room.
                    let mut refused = Vec::new();
                    for r in refusals {
                        match stripe_of(&docs, &r.provider) {
                            Some((stripe, (_, doc))) if doc.bits != 0 => refused
                                .extend(access::borrow_into(quota, stripe, r.requested).await?),
                            _ => refused.push(r),
                        }
                    }
                    if !refused.is_empty() {
                        return Err(QuotaError::QuotaExceeded {
                            consumer: request.consumer.clone(),
                            request: request.id.clone(),
                            refusals: refused,
                        });
                    }
                    attempts.again("share moved between stripes".into()).await?;
                    continue;
                }
            }
            Err(e) => return Err(e),
        };
        let writes_now = match take {
            Take::Replay { expires } => {
                // A copy sent by the fast path before this one fell back here may still be on
                // its way: it must find the request remembered when it lands.
                if let Some(deadline) = deadline {
                    for (stripe, (_, doc)) in &docs {
                        if doc
                            .held
                            .iter()
                            .any(|e| e.is(&request.consumer, &request.id))
                        {
                            keep_deadline(quota, request, stripe, deadline).await?;
                        }
                    }
                }
                return Ok((
                    Consumed {
                        consumer: request.consumer.clone(),
                        request: request.id.clone(),
                        replayed: true,
                        writes,
                        retries: attempts.retries(),
                        claims: request.claims.clone(),
                    },
                    expires,
                ));
            }
            Take::Apply(writes_now) => writes_now,
        };
        writes += u32::try_from(writes_now.len()).unwrap_or(u32::MAX);
        match access::write(quota, writes_now).await? {
            Step::Done => {
                return Ok((
                    Consumed {
                        consumer: request.consumer.clone(),
                        request: request.id.clone(),
                        replayed: false,
                        writes,
                        retries: attempts.retries(),
                        claims: request.claims.clone(),
                    },
                    expires,
                ))
            }
            Step::Retry(reason) => {
                // Nothing was written: others changed the stripe between this path's read and
                // its write. On a hot provider that happens to nearly every attempt, because
                // the single-update path of the other consumers needs no read first; going
                // back to it is what keeps this request from starving behind them.
                if let Some((mut done, stored)) = fast_if_served(quota, request, expires).await? {
                    done.retries += attempts.retries();
                    return Ok((done, stored));
                }
                attempts.again(reason).await?
            }
            Step::Ambiguous(reason) => {
                request.mark_in_flight();
                attempts.again(reason).await?
            }
        }
    }
}

/// The single-update path again, for a request that it serves (one provider, no parent).
async fn fast_if_served(
    quota: &Quota,
    request: &Request,
    expires: Option<DateTime>,
) -> Result<Option<(Consumed, Option<DateTime>)>, QuotaError> {
    match request.claims.as_slice() {
        [(provider, amount)] if !access::has_parent(quota, provider) => {
            take_fast(quota, request, provider, *amount, expires).await
        }
        _ => Ok(None),
    }
}

/// One striped provider whose stripe lacks room: borrows `need` into `stripe` and takes the
/// request in one write, so that the share borrowed for it cannot go to another consume in
/// between (under many consumers near the limit it otherwise could, every time). `None`: the
/// room moved on meanwhile, read again.
async fn borrow_and_take(
    quota: &Quota,
    request: &Request,
    docs: &Docs,
    stripe: &StripeId,
    need: i64,
    (expires, deadline): (Option<DateTime>, Option<DateTime>),
    now: DateTime,
) -> Result<Option<Take>, QuotaError> {
    let borrowed = match access::plan_borrow(quota, stripe, need).await? {
        Ok(borrowed) => borrowed,
        Err(refusal) => {
            return Err(QuotaError::QuotaExceeded {
                consumer: request.consumer.clone(),
                request: request.id.clone(),
                refusals: vec![refusal],
            })
        }
    };
    let Some((lent, others)) = lend(docs, stripe, borrowed.clone()) else {
        return Ok(None);
    };
    match decide::take(request, &lent, expires, deadline, now) {
        Ok(Take::Apply(mut together)) => {
            together.extend(others);
            Ok(Some(Take::Apply(together)))
        }
        Ok(replay @ Take::Replay { .. }) => Ok(Some(replay)),
        // The share moved, but not enough for this request (a provider back under a lowered
        // limit is shared out afresh, evenly): write the move anyway, or the next attempt would
        // plan the same one and never get further.
        Err(QuotaError::QuotaExceeded { .. }) => {
            access::write(quota, borrowed).await?;
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// The stripe and amount of the one refusal of a request on one striped provider, the case
/// [`Quota::borrow_and_take`] serves.
fn lone_striped(docs: &Docs, refusals: &[Refusal]) -> Option<(StripeId, i64)> {
    match (docs.len(), refusals) {
        (1, [refusal]) => stripe_of(docs, &refusal.provider)
            .filter(|(_, (_, doc))| doc.bits != 0)
            .map(|(stripe, _)| (stripe.clone(), refusal.requested)),
        _ => None,
    }
}
