//! Giving quota back: releasing what a consumer holds, confirming or cancelling a reservation,
//! and the sweep that returns expired reservations.

use std::collections::BTreeSet;

use bson::{doc, Bson, DateTime, Document};

use crate::collections::PROVIDERS_COLLECTION;
use crate::quota::access;
use crate::quota::decide::{self, Confirm, Docs, Write};
use crate::quota::error::QuotaError;
use crate::quota::model::{
    Consumed, Entry, ProviderId, Released, Reservation, StripeId, SweepSummary,
};
use crate::quota::ops::{check_ids, entry_filter, Attempts, Step};
use crate::quota::stripes::hash;
use crate::quota::Quota;
use crate::repo::error::RepoError;
use crate::repo::fields;
use crate::repo::format;
use crate::server::is_transient;

/// What the single update of a request of one claim came to.
enum Pulled {
    /// It landed: this went back.
    Landed(Vec<(ProviderId, i64)>),
    /// Its reply was lost: this went back if it landed.
    Unsure(Vec<(ProviderId, i64)>),
    /// It did not apply (or was not tried): the general path decides.
    No,
}

/// The body of [`Quota::release`].
pub(crate) async fn release(quota: &Quota, consumer: &str) -> Result<Released, QuotaError> {
    decide::check_name("consumer", consumer)?;
    let returned = remove_where(
        quota,
        format!("release consumer {consumer}"),
        doc! { "held.c": consumer },
        |e, _| e.c == consumer,
    )
    .await?;
    if returned.is_empty() {
        return Err(QuotaError::UnknownConsumer {
            consumer: consumer.to_string(),
        });
    }
    Ok(Released {
        consumer: consumer.to_string(),
        returned,
    })
}

/// The body of [`Quota::release_consumed`].
pub(crate) async fn release_consumed(
    quota: &Quota,
    consumed: &Consumed,
) -> Result<Released, QuotaError> {
    let (consumer, request) = (&consumed.consumer, &consumed.request);
    check_ids(consumer, request)?;
    let released = |returned| Released {
        consumer: consumer.clone(),
        returned,
    };
    let unsure = match pull_claim(quota, consumer, request, None, &consumed.claims).await? {
        Pulled::Landed(returned) => return Ok(released(returned)),
        Pulled::Unsure(returned) => Some(returned),
        Pulled::No => None,
    };
    let returned = remove_where(
        quota,
        format!("release request {request} of consumer {consumer}"),
        entry_filter(consumer, request),
        |e, _| e.is(consumer, request),
    )
    .await?;
    match (returned.is_empty(), unsure) {
        (false, _) => Ok(released(returned)),
        (true, Some(returned)) => Ok(released(returned)),
        (true, None) => Err(QuotaError::UnknownRequest {
            consumer: consumer.clone(),
            request: request.clone(),
        }),
    }
}

/// The body of [`Quota::confirm`].
pub(crate) async fn confirm(quota: &Quota, reservation: &Reservation) -> Result<(), QuotaError> {
    let (consumer, request) = (&reservation.consumer, &reservation.request);
    check_ids(consumer, request)?;
    let mut attempts = Attempts::new(
        quota.options.retry,
        format!("confirm reservation {request} of consumer {consumer}"),
    );
    loop {
        let now = quota.store.now().await?;
        let docs = access::holding(quota, entry_filter(consumer, request)).await?;
        let writes = match decide::confirm(consumer, request, &docs, now) {
            Ok(Confirm::Done) => return Ok(()),
            Ok(Confirm::Apply(writes)) => writes,
            Err(QuotaError::UnknownReservation { .. })
                if reservation.expires <= now.to_chrono() =>
            {
                return Err(QuotaError::ReservationExpired {
                    consumer: consumer.clone(),
                    request: request.clone(),
                    expired_at: reservation.expires,
                })
            }
            Err(e) => return Err(e),
        };
        match access::write(quota, writes).await? {
            Step::Done => return Ok(()),
            Step::Retry(reason) | Step::Ambiguous(reason) => attempts.again(reason).await?,
        }
    }
}

/// The body of [`Quota::cancel`].
pub(crate) async fn cancel(
    quota: &Quota,
    reservation: &Reservation,
) -> Result<Released, QuotaError> {
    let (consumer, request) = (&reservation.consumer, &reservation.request);
    check_ids(consumer, request)?;
    let exp = Some(DateTime::from_chrono(reservation.expires));
    let unsure = match pull_claim(quota, consumer, request, exp, &reservation.claims).await? {
        Pulled::Landed(returned) => {
            return Ok(Released {
                consumer: consumer.clone(),
                returned,
            })
        }
        Pulled::Unsure(returned) => Some(returned),
        Pulled::No => None,
    };
    let returned = remove_where(
        quota,
        format!("cancel reservation {request} of consumer {consumer}"),
        entry_filter(consumer, request),
        |e, _| e.is(consumer, request) && e.exp.is_some(),
    )
    .await?;
    if let (true, Some(returned)) = (returned.is_empty(), unsure) {
        return Ok(Released {
            consumer: consumer.clone(),
            returned,
        });
    }
    if returned.is_empty() {
        let now = quota.store.now().await?;
        return Err(if reservation.expires <= now.to_chrono() {
            QuotaError::ReservationExpired {
                consumer: consumer.clone(),
                request: request.clone(),
                expired_at: reservation.expires,
            }
        } else {
            QuotaError::UnknownReservation {
                consumer: consumer.clone(),
                request: request.clone(),
            }
        });
    }
    Ok(Released {
        consumer: consumer.clone(),
        returned,
    })
}

/// The body of [`Quota::sweep`].
pub(crate) async fn sweep(quota: &Quota) -> Result<SweepSummary, QuotaError> {
    let mut summary = SweepSummary::default();
    let now = quota.store.now().await?;
    let expired = access::holding(
        quota,
        doc! { "held": { "$elemMatch": { "exp": { "$lte": now } } } },
    )
    .await?;
    let pairs: BTreeSet<(String, String)> = expired
        .values()
        .flat_map(|(_, doc)| doc.held.iter())
        .filter(|e| e.exp.is_some_and(|exp| exp <= now))
        .map(|e| (e.c.clone(), e.r.clone()))
        .collect();
    let mut first_error = None;
    for (consumer, request) in pairs {
        let returned = remove_where(
            quota,
            format!("return expired reservation {request} of consumer {consumer}"),
            entry_filter(&consumer, &request),
            |e, now| e.is(&consumer, &request) && e.exp.is_some_and(|exp| exp <= now),
        )
        .await;
        match returned {
            Ok(returned) if !returned.is_empty() => {
                tracing::info!(%consumer, %request, "quota: returned an expired reservation");
                summary.expired += 1;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(%consumer, %request, error = %e, "quota: could not return an expired reservation; next round");
                first_error.get_or_insert(e);
            }
        }
    }
    let stale = access::holding(
        quota,
        doc! { "held": { "$elemMatch": { "n": 0_i64, "dl": { "$lte": now } } } },
    )
    .await?;
    for (generation, doc) in stale.values() {
        if let Some(doc) = decide::pruned(doc, now) {
            let write = Write {
                generation: *generation,
                doc,
            };
            if let Step::Done = access::write(quota, vec![write]).await? {
                summary.pruned += 1;
            }
        }
    }
    match first_error {
        Some(e) if summary.expired == 0 => Err(e),
        _ => Ok(summary),
    }
}

/// Removes the entries `pick` selects from the providers `filter` finds, all together,
/// re-reading on conflicts; returns what went back to each provider.
pub(super) async fn remove_where(
    quota: &Quota,
    what: String,
    filter: Document,
    pick: impl Fn(&Entry, DateTime) -> bool,
) -> Result<Vec<(ProviderId, i64)>, QuotaError> {
    let mut attempts = Attempts::new(quota.options.retry, what);
    // What a write whose reply was lost would have returned: if the re-read finds nothing
    // left, that write landed.
    let mut unsure = None;
    let mut guards = Vec::new();
    loop {
        let now = quota.store.now().await?;
        let docs = match access::holding_plainly(quota, &filter).await? {
            Some(docs) => docs,
            None => access::holding(quota, filter.clone()).await?,
        };
        if docs.len() > 1 && guards.is_empty() {
            guards = access::queue(quota, docs.keys()).await;
            continue;
        }
        let (writes, returned) = decide::remove(&docs, |e| pick(e, now), now);
        if writes.is_empty() {
            return Ok(unsure.unwrap_or_default());
        }
        let step = match pull_fast(quota, &docs, |e| pick(e, now), now).await? {
            Some(step) => step,
            None => access::write(quota, writes).await?,
        };
        match step {
            Step::Done => return Ok(returned),
            Step::Retry(reason) => attempts.again(reason).await?,
            Step::Ambiguous(reason) => {
                unsure = Some(returned);
                attempts.again(reason).await?
            }
        }
    }
}

/// Removing entries from one provider that none of them must outlive as a tombstone: one
/// update conditioned on those exact entries being there (not on the generation), so that
/// releases on a busy provider do not conflict with its consumes. `None` when the
/// generation-checked write must do it (several providers, a tombstone to keep, or the
/// provider changed in a way the condition notices).
pub(super) async fn pull_fast(
    quota: &Quota,
    docs: &Docs,
    pick: impl Fn(&Entry) -> bool,
    now: DateTime,
) -> Result<Option<Step>, QuotaError> {
    let [(id, (_, doc))] = docs.iter().collect::<Vec<_>>()[..] else {
        return Ok(None);
    };
    let picked: Vec<&Entry> = doc
        .held
        .iter()
        .filter(|e| !e.is_tombstone() && pick(e))
        .collect();
    if picked.is_empty() || picked.iter().any(|e| e.dl.is_some_and(|dl| dl > now)) {
        return Ok(None);
    }
    let or_null = |t: Option<DateTime>| t.map_or(Bson::Null, Bson::DateTime);
    let present: Vec<Document> = picked
        .iter()
        .map(|e| {
            doc! { "held": { "$elemMatch": {
                "c": &e.c, "r": &e.r, "n": e.n, "exp": or_null(e.exp), "dl": or_null(e.dl),
            } } }
        })
        .collect();
    let amount: i64 = picked.iter().map(|e| e.n).sum();
    let consumers: BTreeSet<&str> = picked.iter().map(|e| e.c.as_str()).collect();
    let requests: Vec<&str> = picked.iter().map(|e| e.r.as_str()).collect();
    let [consumer] = consumers.into_iter().collect::<Vec<_>>()[..] else {
        return Ok(None);
    };
    pull(
        quota,
        &id.to_string(),
        doc! { "_id": id.to_bson(), "$and": present },
        consumer,
        &requests,
        amount,
    )
    .await
}

/// [`pull_known`](Quota::pull_known) for a request of one claim, named by `claims`.
async fn pull_claim(
    quota: &Quota,
    consumer: &str,
    request: &str,
    exp: Option<DateTime>,
    claims: &[(ProviderId, i64)],
) -> Result<Pulled, QuotaError> {
    let [(provider, amount)] = claims else {
        return Ok(Pulled::No);
    };
    let returned = || vec![(provider.clone(), *amount)];
    Ok(
        match pull_known(quota, consumer, request, exp, provider, *amount).await? {
            Some(Step::Done) => Pulled::Landed(returned()),
            Some(Step::Ambiguous(_)) => Pulled::Unsure(returned()),
            Some(Step::Retry(_)) | None => Pulled::No,
        },
    )
}

/// [`release_consumed`](Quota::release_consumed) or [`cancel`](Quota::cancel) on one provider
/// without a parent: one update of the stripe the handle's layout says holds the request,
/// conditioned on its entry being there as the consume or reserve left it (that expiry, or
/// none; no deadline of a copy in flight). A confirmed reservation has no expiry any more, so
/// a cancel racing a confirm matches only before it. `None`
/// when that condition does not hold: the stripe split since, a transaction holds it, the
/// entry must stay as a tombstone, or the provider has a parent; the general path decides.
async fn pull_known(
    quota: &Quota,
    consumer: &str,
    request: &str,
    exp: Option<DateTime>,
    provider: &ProviderId,
    amount: i64,
) -> Result<Option<Step>, QuotaError> {
    if access::has_parent(quota, provider) {
        return Ok(None);
    }
    let Some((stripe, _)) = access::layout(quota, provider).locate(hash(consumer, request)) else {
        return Ok(None);
    };
    let stripe = StripeId::new(provider, stripe);
    let filter = doc! {
        "_id": stripe.to_bson(),
        "parent": null,
        "held": { "$elemMatch": {
            "c": consumer, "r": request, "n": amount,
            "exp": exp.map_or(Bson::Null, Bson::DateTime), "dl": null,
        } },
    };
    pull(
        quota,
        &stripe.to_string(),
        filter,
        consumer,
        &[request],
        amount,
    )
    .await
}

/// Takes `consumer`'s entries under `requests` (together `amount`) out of the one document
/// `filter` names, only while no transaction holds it.
async fn pull(
    quota: &Quota,
    shown: &str,
    mut filter: Document,
    consumer: &str,
    requests: &[&str],
    amount: i64,
) -> Result<Option<Step>, QuotaError> {
    filter.insert(fields::SCHEMA_VERSION, quota.repo.spec().schema_version());
    filter.insert(fields::ACTIVE_TXN, Bson::Null);
    filter.insert(fields::DELETED, Bson::Null);
    // A provider over a lowered limit may come back under it here, and a provider of one
    // stripe must then lose its `over` mark (`decide::remove`): the general path does that.
    filter.insert("over", doc! { "$ne": true });
    // And only while of a stored format this store reads (`repo::format`).
    let filter = format::guard(filter, quota.store.reads_format());
    let update = doc! {
        "$inc": { "usage": -amount, "available": amount, fields::VERSION: 1_i64 },
        "$pull": { "held": { "c": consumer, "r": { "$in": requests } } },
    };
    match quota.repo.raw_collection().update_one(filter, update).await {
        Ok(result) if result.matched_count == 1 => Ok(Some(Step::Done)),
        Ok(_) => Ok(None),
        Err(e) if is_transient(&e) => Ok(Some(Step::Ambiguous(format!(
            "returning {amount} to {shown}: {e}"
        )))),
        Err(e) => Err(RepoError::database(PROVIDERS_COLLECTION, shown, "release", e).into()),
    }
}
