//! What an operator asks about a provider ([`Quota::report`], and [`inspect`] without a handle):
//! usage against the limit, stripe by stripe, the reservations outstanding and those past their
//! expiry waiting for the GC's sweep, all from one reading of one moment.

use bson::DateTime;
use serde::Serialize;

use crate::quota::access;
use crate::quota::decide;
use crate::quota::error::QuotaError;
use crate::quota::model::{Provider, ProviderId};
use crate::quota::Quota;
use crate::repo::store::Store;

/// A provider as an operator sees it: how full it is, who reserved what until when, and what
/// is stuck.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct ProviderReport {
    /// Which provider.
    pub provider: ProviderId,
    /// The server's time the report judges expiries by (this process's estimate of it).
    pub now: chrono::DateTime<chrono::Utc>,
    /// The most that may be in use.
    pub limit: i64,
    /// In use: allocations and reservations (expired ones too, until the sweep returns them),
    /// this provider's own and its descendants'.
    pub usage: i64,
    /// `limit - usage`; negative after the limit was lowered below the usage.
    pub available: i64,
    /// The part of `usage` held by reservations not yet confirmed.
    pub reserved: i64,
    /// The sum of its documents' versions; moves on every change.
    pub generation: i64,
    /// The provider it also consumes from.
    pub parent: Option<ProviderId>,
    /// Whether its limit was lowered below its usage and it has not come back under: it then
    /// refuses every consume, whatever a stripe's own room says.
    pub over: bool,
    /// Confirmed allocations held (one per consumer and request).
    pub allocations: usize,
    /// Distinct consumers holding allocations or reservations.
    pub consumers: usize,
    /// Released requests remembered until a late copy of them can no longer land.
    pub remembered: usize,
    /// Its documents: one while it has few allocations, several once it was spread over
    /// stripes, whose shares of the limit add up to it.
    pub stripes: Vec<StripeReport>,
    /// Reservations before their expiry, soonest to expire first.
    pub reservations: Vec<ReservationReport>,
    /// Reservations past their expiry, still counted until the GC's sweep
    /// ([`Quota::sweep`], run by `mongotx-gc`) returns them: stuck while no runner sweeps.
    pub expired: Vec<ReservationReport>,
}

/// One document of a provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct StripeReport {
    /// Its number (0: the provider's own document).
    pub stripe: i64,
    /// How many bits of a request's hash address it (0 for a provider of one stripe).
    pub bits: i64,
    /// Its share of the limit.
    pub limit: i64,
    /// What its entries hold.
    pub usage: i64,
    /// `limit - usage` of this stripe.
    pub available: i64,
    /// The provider's `over` mark, as this stripe carries it.
    pub over: bool,
    /// Entries it holds (allocations, reservations and remembered releases).
    pub entries: usize,
    /// Its version (the provider's generation is the sum).
    pub version: i64,
}

/// A reservation on a provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ReservationReport {
    /// Who reserved.
    pub consumer: String,
    /// The request it reserved under.
    pub request: String,
    /// How much it holds.
    pub amount: i64,
    /// When it expires, by the server's clock.
    pub expires: chrono::DateTime<chrono::Utc>,
    /// The stripe holding it.
    pub stripe: i64,
}

/// Reads `provider` of `store`'s database as [`Quota::report`] does, without opening the quota
/// collection: nothing is created or written (the `mongotx quota` command reads this way). A
/// provider that does not exist is [`QuotaError::UnknownProvider`].
pub async fn inspect(
    store: &Store,
    provider: impl Into<ProviderId>,
) -> Result<ProviderReport, QuotaError> {
    Quota::unopened(store)?.report(provider).await
}

/// The body of [`Quota::report`].
pub(crate) async fn report(quota: &Quota, id: ProviderId) -> Result<ProviderReport, QuotaError> {
    decide::check_provider(&id)?;
    let docs = access::read_at_once(quota, &id).await?;
    let now = quota
        .store
        .now()
        .await
        .map_err(|source| QuotaError::Clock { source })?;
    let stripes = docs
        .values()
        .map(|(version, d)| StripeReport {
            stripe: d.id.stripe,
            bits: d.bits,
            limit: d.limit,
            usage: d.usage,
            available: d.available,
            over: d.over,
            entries: d.held.len(),
            version: *version,
        })
        .collect();
    let mut reservations = Vec::new();
    let mut expired = Vec::new();
    let mut consumers = std::collections::BTreeSet::new();
    let (mut allocations, mut remembered) = (0, 0);
    for (_, d) in docs.values() {
        for e in &d.held {
            if e.is_tombstone() {
                remembered += 1;
                continue;
            }
            consumers.insert(e.c.clone());
            let Some(exp) = e.exp else {
                allocations += 1;
                continue;
            };
            let reservation = ReservationReport {
                consumer: e.c.clone(),
                request: e.r.clone(),
                amount: e.n,
                expires: exp.to_chrono(),
                stripe: d.id.stripe,
            };
            if exp <= now {
                expired.push(reservation);
            } else {
                reservations.push(reservation);
            }
        }
    }
    for list in [&mut reservations, &mut expired] {
        list.sort_by(|a, b| {
            (a.expires, &a.consumer, &a.request).cmp(&(b.expires, &b.consumer, &b.request))
        });
    }
    let over = docs.values().any(|(_, d)| d.over);
    let provider = Provider::from_stored(docs.into_values().collect())
        .ok_or_else(|| QuotaError::UnknownProvider { provider: id })?;
    Ok(ProviderReport {
        now: DateTime::to_chrono(now),
        limit: provider.limit,
        usage: provider.usage,
        available: provider.available,
        reserved: provider.reserved,
        generation: provider.generation,
        parent: provider.parent,
        provider: provider.id,
        over,
        allocations,
        consumers: consumers.len(),
        remembered,
        stripes,
        reservations,
        expired,
    })
}
