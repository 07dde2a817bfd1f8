//! The provider operations behind [`Quota::create`], [`Quota::provider`], [`Quota::set_limit`]
//! and [`Quota::usage`]: create, read whole, change the limit (every stripe at once), list a
//! scope.

use std::collections::BTreeMap;

use bson::doc;

use crate::quota::access;
use crate::quota::decide;
use crate::quota::error::QuotaError;
use crate::quota::model::{NewProvider, Provider, ProviderDoc, ProviderId};
use crate::quota::ops::{Attempts, Step};
use crate::quota::stripes;
use crate::quota::Quota;
use crate::repo::error::RepoError;
use crate::repo::find::Query;

/// The body of [`Quota::create`].
pub(crate) async fn create(quota: &Quota, new: NewProvider) -> Result<Provider, QuotaError> {
    decide::check_new(&new)?;
    let parent = match &new.parent {
        Some(parent) => Some(access::read_one(quota, parent).await?.1),
        None => None,
    };
    let doc = decide::new_provider(&new, parent.as_ref());
    match quota.repo.insert(&doc).await {
        Ok(_) => {}
        Err(RepoError::DuplicateId { .. }) => {
            return Err(QuotaError::ProviderExists { provider: new.id })
        }
        Err(e) => return Err(e.into()),
    }
    if new.parent.is_some() {
        access::remember_parent(quota, &new.id);
    }
    quota.provider(new.id).await
}

/// The body of [`Quota::provider`].
pub(crate) async fn provider(
    quota: &Quota,
    id: impl Into<ProviderId>,
) -> Result<Provider, QuotaError> {
    let id = id.into();
    decide::check_provider(&id)?;
    let last = access::read_at_once(quota, &id).await?;
    Provider::from_stored(last.into_values().collect())
        .ok_or(QuotaError::UnknownProvider { provider: id })
}

/// The body of [`Quota::set_limit`].
pub(crate) async fn set_limit(
    quota: &Quota,
    id: impl Into<ProviderId>,
    limit: i64,
) -> Result<Provider, QuotaError> {
    let id = id.into();
    decide::check_provider(&id)?;
    decide::check_limit(&id, limit)?;
    let mut attempts = Attempts::new(quota.options.retry, format!("set limit of {id}"));
    loop {
        // Every stripe is written, each conditionally on the version read, so the shares
        // are of one moment and add up to the new limit.
        let all = access::read_stripes(quota, &id).await?;
        let writes = stripes::new_limit(&all, limit);
        match access::write(quota, writes).await? {
            Step::Done => return quota.provider(id).await,
            Step::Retry(reason) | Step::Ambiguous(reason) => attempts.again(reason).await?,
        }
    }
}

/// The body of [`Quota::usage`].
pub(crate) async fn usage(quota: &Quota, scope: &str) -> Result<Vec<Provider>, QuotaError> {
    // A scope no provider can have (create refuses it) is a caller's mistake, not an empty
    // scope.
    decide::check_name("provider scope", scope)?;
    let found = quota
        .repo
        .find(
            Query::new()
                .filter(doc! { "_id.scope": scope })
                .sort(doc! { "_id.resource": 1 }),
        )
        .await?;
    // A striped provider's stripes share its scope: each provider is made of its own.
    let mut by_provider: BTreeMap<ProviderId, Vec<(i64, ProviderDoc)>> = BTreeMap::new();
    for s in found {
        by_provider
            .entry(s.value.id.provider())
            .or_default()
            .push((s.version, s.value));
    }
    let mut providers = Vec::with_capacity(by_provider.len());
    for (id, stripes) in by_provider {
        // One query reads a striped provider's stripes at different moments: read it whole.
        if stripes.len() > 1 || stripes.iter().any(|(_, d)| d.bits != 0) {
            providers.push(quota.provider(id).await?);
            continue;
        }
        providers.extend(Provider::from_stored(stripes));
    }
    Ok(providers)
}
