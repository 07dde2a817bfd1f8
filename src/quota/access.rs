//! Reading providers (committed values, through any transaction holding them) and writing the
//! changes a decision made, conditionally on the generations read; for striped providers, the
//! handle's layouts, splitting and borrowing (the plans are `stripes`', free of I/O).

use std::collections::BTreeSet;
use std::sync::Arc;

use bson::{doc, Bson, Document};
use futures::TryStreamExt;

use crate::collections::PROVIDERS_COLLECTION;
use crate::quota::decide::stripe_of;
use crate::quota::decide::{Docs, Write};
use crate::quota::error::{QuotaError, Refusal};
use crate::quota::model::{ProviderDoc, ProviderId, Request, StripeId};
use crate::quota::ops::{
    classify_repo, classify_txn, stamped_docs, stored_or_restored, update_of, Attempts, Step,
};
use crate::quota::stripes::{borrow, hash, split, Full, Layout};
use crate::quota::Quota;
use crate::repo::error::RepoError;
use crate::repo::fields;
use crate::repo::find::Query;
use crate::repo::format;
use crate::txn::error::TxnError;

/// One stripe (committed values); a missing one is the provider's absence.
pub(super) async fn read_stripe(
    quota: &Quota,
    id: &StripeId,
) -> Result<(i64, ProviderDoc), QuotaError> {
    match quota.repo.get(id.to_bson()).await {
        Ok(found) => Ok((found.version, found.value)),
        Err(RepoError::NotFound { .. } | RepoError::Deleted { .. }) => {
            Err(QuotaError::UnknownProvider {
                provider: id.provider(),
            })
        }
        Err(e) => Err(e.into()),
    }
}

/// A provider's stripe 0 (committed values): the whole provider while it has one stripe.
pub(super) async fn read_one(
    quota: &Quota,
    id: &ProviderId,
) -> Result<(i64, ProviderDoc), QuotaError> {
    read_stripe(quota, &StripeId::new(id, 0)).await
}

/// The stripes a request touches (committed values): for each of its providers and all their
/// ancestors, the stripe its hash addresses (see `stripes`). `None` when a stripe was split
/// while it was read: read again.
pub(super) async fn read_for(quota: &Quota, request: &Request) -> Result<Option<Docs>, QuotaError> {
    let claimed: Vec<&ProviderId> = request.claims.iter().map(|(p, _)| p).collect();
    let mut docs = read_many(quota, &claimed).await?;
    let missing: BTreeSet<ProviderId> = docs
        .values()
        .flat_map(|(_, doc)| doc.ancestors.iter())
        .filter(|a| stripe_of(&docs, a).is_none())
        .cloned()
        .collect();
    if !missing.is_empty() {
        let missing: Vec<&ProviderId> = missing.iter().collect();
        docs.extend(read_many(quota, &missing).await?);
    }
    readdress(quota, docs, hash(&request.consumer, &request.id)).await
}

/// Replaces each striped provider's stripe 0 in `heads` with the stripe that holds hash `h`
/// (committed values); `None` when one was split since its layout was read.
pub(super) async fn readdress(
    quota: &Quota,
    heads: Docs,
    h: u64,
) -> Result<Option<Docs>, QuotaError> {
    let mut wanted = Vec::new();
    let mut docs = Docs::new();
    for (id, (generation, head)) in heads {
        let layout = Layout::of(&head);
        let provider = id.provider();
        learn(quota, &provider, layout.clone());
        match layout.locate(h) {
            Some((0, _)) => {
                docs.insert(id, (generation, head));
            }
            Some((stripe, bits)) => wanted.push((StripeId::new(&provider, stripe), bits)),
            None => {
                return Err(quota
                    .repo
                    .malformed(
                        &provider.to_string(),
                        "its stripes do not cover every request".into(),
                    )
                    .into())
            }
        }
    }
    if wanted.is_empty() {
        return Ok(Some(docs));
    }
    let ids: Vec<Bson> = wanted.iter().map(|(id, _)| id.to_bson()).collect();
    let found = holding(quota, doc! { "_id": { "$in": ids } }).await?;
    for (id, bits) in wanted {
        match found.get(&id) {
            Some((generation, doc)) if doc.bits == bits => {
                docs.insert(id, (*generation, doc.clone()));
            }
            _ => return Ok(None),
        }
    }
    Ok(Some(docs))
}

pub(super) async fn read_many(quota: &Quota, ids: &[&ProviderId]) -> Result<Docs, QuotaError> {
    if let [id] = ids {
        let (generation, doc) = read_one(quota, id).await?;
        if doc.parent.is_some() {
            remember_parent(quota, id);
        }
        return Ok([(doc.id.clone(), (generation, doc))].into_iter().collect());
    }
    let list: Vec<Bson> = ids.iter().map(|id| id.to_bson()).collect();
    let docs = holding(quota, doc! { "_id": { "$in": list } }).await?;
    match ids.iter().find(|id| stripe_of(&docs, id).is_none()) {
        Some(id) => Err(QuotaError::UnknownProvider {
            provider: (*id).clone(),
        }),
        None => Ok(docs),
    }
}

pub(super) async fn holding(quota: &Quota, filter: Document) -> Result<Docs, QuotaError> {
    Ok(stamped_docs(
        quota.repo.find(Query::new().filter(filter)).await?,
    ))
}

/// What [`holding`](Quota::holding) returns, read with a plain query, when that is enough:
/// no provider found (nothing held), or exactly one, neither held by a transaction nor of an
/// older schema, so its stored fields are its committed values. `None` when it takes the
/// committed-value query to tell. The query also looks at the values a pending transaction
/// would restore, so a provider whose committed entries only its undo still shows is found.
pub(super) async fn holding_plainly(
    quota: &Quota,
    filter: &Document,
) -> Result<Option<Docs>, QuotaError> {
    let found: Vec<Document> = quota
        .repo
        .raw_collection()
        .find(stored_or_restored(filter))
        .limit(2)
        .await
        .map_err(|e| RepoError::database(PROVIDERS_COLLECTION, "*", "find holders", e))?
        .try_collect()
        .await
        .map_err(|e| RepoError::database(PROVIDERS_COLLECTION, "*", "find holders", e))?;
    let [stored] = &found[..] else {
        return Ok(found.is_empty().then(Docs::new));
    };
    format::check_doc(stored, quota.store.reads_format(), PROVIDERS_COLLECTION)?;
    let unset = |field: &str| stored.get(field).is_none_or(|v| v == &Bson::Null);
    if !unset(fields::ACTIVE_TXN)
        || !unset(fields::DELETED)
        || stored.get_i64(fields::SCHEMA_VERSION).ok() != Some(quota.repo.spec().schema_version())
    {
        return Ok(None);
    }
    let Ok(generation) = stored.get_i64(fields::VERSION) else {
        return Ok(None);
    };
    let Ok(doc) = bson::from_document::<ProviderDoc>(stored.clone()) else {
        return Ok(None);
    };
    Ok(Some(
        [(doc.id.clone(), (generation, doc))].into_iter().collect(),
    ))
}

/// Writes every provider conditionally on the generation it was read at: one conditional
/// update for one provider, a transaction for several.
pub(super) async fn write(quota: &Quota, writes: Vec<Write>) -> Result<Step, QuotaError> {
    if let [write] = writes.as_slice() {
        let update = update_of(&write.doc)?;
        return match quota
            .repo
            .update(write.doc.id.to_bson(), write.generation, &update)
            .await
        {
            Ok(_) => Ok(Step::Done),
            Err(e) => classify_repo(e),
        };
    }
    in_transaction(quota, &writes, None).await
}

/// Writes `writes` (conditionally on their generations) and inserts `new` if there is one,
/// in one transaction (several providers' changes, or a split).
pub(super) async fn in_transaction(
    quota: &Quota,
    writes: &[Write],
    new: Option<&ProviderDoc>,
) -> Result<Step, QuotaError> {
    // Only an insert can meet an existing id: a new stripe made already by another split of
    // the same stripe, which won. Read again.
    let step_of = |e: TxnError| match e {
        TxnError::Document { ref source, .. }
            if matches!(**source, RepoError::DuplicateId { .. }) =>
        {
            Ok(Step::Retry(e.to_string()))
        }
        e => classify_txn(e),
    };
    let tx = quota.txns.begin();
    for write in writes {
        let update = update_of(&write.doc)?;
        if let Err(e) = tx
            .update(
                &quota.repo,
                write.doc.id.to_bson(),
                write.generation,
                &update,
            )
            .await
        {
            return step_of(e);
        }
    }
    if let Some(new) = new {
        if let Err(e) = tx.insert(&quota.repo, new).await {
            return step_of(e);
        }
    }
    match tx.commit().await {
        Ok(_) => Ok(Step::Done),
        Err(e) => step_of(e),
    }
}

/// Waits for this process's other changes of the same providers (read again after this).
pub(super) async fn queue<'a>(
    quota: &Quota,
    ids: impl Iterator<Item = &'a StripeId>,
) -> Vec<tokio::sync::OwnedMutexGuard<()>> {
    use std::hash::{Hash, Hasher};
    let stripes: BTreeSet<usize> = ids
        .map(|id| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            id.hash(&mut h);
            usize::try_from(h.finish() % quota.stripes.len() as u64).unwrap_or(0)
        })
        .collect();
    let mut guards = Vec::with_capacity(stripes.len());
    for stripe in stripes {
        guards.push(Arc::clone(&quota.stripes[stripe]).lock_owned().await);
    }
    guards
}

pub(super) fn has_parent(quota: &Quota, id: &ProviderId) -> bool {
    quota
        .with_parent
        .lock()
        .map(|known| known.contains(id))
        .unwrap_or(false)
}

pub(super) fn remember_parent(quota: &Quota, id: &ProviderId) {
    if let Ok(mut known) = quota.with_parent.lock() {
        known.insert(id.clone());
    }
}

/// Striped providers (see `stripes`): the handle's layouts, reading every stripe, splitting and
/// borrowing.
/// The layout this handle last saw for `provider` (a single stripe when it saw none).
pub(super) fn layout(quota: &Quota, provider: &ProviderId) -> Arc<Layout> {
    quota
        .layouts
        .lock()
        .ok()
        .and_then(|known| known.get(provider).cloned())
        .unwrap_or_else(|| Arc::new(Layout::single()))
}

/// Remembers a provider's layout (only striped ones are kept: the default is one stripe).
/// Stripes only split, so a layout with fewer stripes than the one known is an older
/// reading (another task's, landing late) and is not kept.
pub(super) fn learn(quota: &Quota, provider: &ProviderId, layout: Layout) {
    if layout.is_single() {
        return;
    }
    if let Ok(mut known) = quota.layouts.lock() {
        match known.get(provider) {
            Some(old) if old.len() > layout.len() => {}
            _ => {
                known.insert(provider.clone(), Arc::new(layout));
            }
        }
    }
}

/// Reads `provider`'s layout again from stripe 0 (after a write found the cached one stale).
pub(super) async fn relearn(quota: &Quota, provider: &ProviderId) -> Result<(), QuotaError> {
    let (_, head) = read_one(quota, provider).await?;
    learn(quota, provider, Layout::of(&head));
    Ok(())
}

/// Every stripe of `provider` (committed values), stripe 0 first, each as the layout read
/// from stripe 0 has it: read again while a split moves it.
pub(super) async fn read_stripes(quota: &Quota, provider: &ProviderId) -> Result<Docs, QuotaError> {
    // With the layout known, one query reads every stripe, stripe 0 among them; its layout then
    // says whether the query named them all (stripes only split, and a split extends stripe
    // 0's layout in the same transaction). Otherwise stripe 0 first, then the stripes it lists.
    let known = layout(quota, provider);
    if !known.is_single() {
        let ids: Vec<Bson> = known
            .stripes()
            .map(|s| StripeId::new(provider, s).to_bson())
            .collect();
        let docs = holding(quota, doc! { "_id": { "$in": ids } }).await?;
        if let Some((_, head)) = docs.get(&StripeId::new(provider, 0)) {
            let now = Layout::of(head);
            if complete(&now, &docs) {
                return Ok(docs);
            }
            learn(quota, provider, now);
        }
    }
    let mut attempts = Attempts::new(
        quota.options.retry,
        format!("read the stripes of {provider}"),
    );
    loop {
        let (generation, head) = read_one(quota, provider).await?;
        let layout = Layout::of(&head);
        learn(quota, provider, layout.clone());
        let mut docs: Docs = [(head.id.clone(), (generation, head))]
            .into_iter()
            .collect();
        if layout.is_single() {
            return Ok(docs);
        }
        let others: Vec<Bson> = layout
            .stripes()
            .filter(|s| *s != 0)
            .map(|s| StripeId::new(provider, s).to_bson())
            .collect();
        docs.extend(holding(quota, doc! { "_id": { "$in": others } }).await?);
        if complete(&layout, &docs) {
            return Ok(docs);
        }
        attempts
            .again(format!("{provider} was split while it was read"))
            .await?;
    }
}

/// Whether `docs` are every stripe of `layout`, each as the layout has it (a stripe split after
/// stripe 0 was read shows more bits).
fn complete(layout: &Layout, docs: &Docs) -> bool {
    layout.len() == docs.len()
        && docs
            .iter()
            .all(|(id, (_, d))| layout.bits_of(id.stripe) == Some(d.bits))
}

/// Every stripe of `provider` as of one moment: two readings back to back that agree (versions
/// only grow, so nothing moved between them). After a pause the pair is read afresh: comparing
/// with a reading from before the pause would ask the stripes to stand still for the pause too.
pub(super) async fn read_at_once(quota: &Quota, provider: &ProviderId) -> Result<Docs, QuotaError> {
    let mut attempts = Attempts::new(
        quota.options.retry,
        format!("read {provider} at one moment"),
    );
    loop {
        let first = read_stripes(quota, provider).await?;
        if first.len() <= 1 {
            return Ok(first);
        }
        let second = read_stripes(quota, provider).await?;
        let same = second.len() == first.len()
            && second
                .iter()
                .all(|(k, (v, _))| first.get(k).is_some_and(|(w, _)| v == w));
        if same {
            if attempts.retries() > 0 {
                tracing::debug!(
                    %provider,
                    pairs = attempts.retries() + 1,
                    elapsed_ms = attempts.elapsed().as_millis() as u64,
                    "quota: read at one moment"
                );
            }
            return Ok(second);
        }
        attempts
            .again(format!("{provider} changed while it was read"))
            .await?;
    }
}

/// Splits `stripe` of `provider` if it is still full (or only prunes it). Losing a race to
/// another writer is fine: the caller reads again either way.
pub(super) async fn split_stripe(
    quota: &Quota,
    provider: &ProviderId,
    stripe: i64,
) -> Result<(), QuotaError> {
    let now = quota.store.now().await?;
    // The stripe and stripe 0 (whose layout the split extends), in one query: read at
    // slightly different moments, they are still written only if neither changed since.
    let (head_id, target_id) = (StripeId::new(provider, 0), StripeId::new(provider, stripe));
    let ids: Vec<Bson> = [&head_id, &target_id]
        .into_iter()
        .map(StripeId::to_bson)
        .collect();
    let found = holding(quota, doc! { "_id": { "$in": ids } }).await?;
    let Some(target) = found.get(&target_id) else {
        return Ok(());
    };
    let head = match found.get(&head_id) {
        Some(head) if stripe != 0 => Some(head),
        Some(_) => None,
        None => return Ok(()),
    };
    match split(head, (target.0, &target.1), now) {
        Full::Keep => {}
        Full::Prune(prune) => {
            write(quota, vec![prune]).await?;
        }
        Full::Divide { writes, new } => {
            tracing::debug!(%provider, stripe, new = new.id.stripe, "quota: splitting a full stripe");
            in_transaction(quota, &writes, Some(&new)).await?;
        }
    }
    Ok(())
}

/// Moves share into `stripe` so that it has `need` available; the provider's refusal when
/// all of it lacks that. Losing a race is fine: the caller tries its consume again.
pub(super) async fn borrow_into(
    quota: &Quota,
    stripe: &StripeId,
    need: i64,
) -> Result<Option<Refusal>, QuotaError> {
    match plan_borrow(quota, stripe, need).await? {
        Ok(writes) => {
            write(quota, writes).await?;
            Ok(None)
        }
        Err(refusal) => Ok(Some(refusal)),
    }
}

/// The writes that move `need` units of share into `stripe` from the provider's other
/// stripes (conditional on the generations read), or the provider's refusal when the whole
/// of it lacks room.
pub(super) async fn plan_borrow(
    quota: &Quota,
    stripe: &StripeId,
    need: i64,
) -> Result<Result<Vec<Write>, Refusal>, QuotaError> {
    let provider = stripe.provider();
    let all = read_stripes(quota, &provider).await?;
    Ok(match borrow(&all, stripe, need) {
        Ok(writes) => Ok(writes),
        // Stripes read one after another can miss share on its way between them: a refusal
        // stands only on a reading of one moment.
        Err(_) => borrow(&read_at_once(quota, &provider).await?, stripe, need),
    })
}
