//! Reading providers (committed values, through any transaction holding them) and writing the
//! changes a decision made, conditionally on the generations read.

use std::collections::BTreeSet;
use std::sync::Arc;

use bson::{doc, Bson, Document};
use futures::TryStreamExt;

use crate::quota::decide::{Docs, Write};
use crate::quota::error::QuotaError;
use crate::quota::model::{ProviderDoc, ProviderId, Request, PROVIDERS_COLLECTION};
use crate::quota::ops::{
    classify_repo, classify_txn, stamped_docs, stored_or_restored, update_of, Step,
};
use crate::quota::Quota;
use crate::repo::error::RepoError;
use crate::repo::fields;
use crate::repo::find::Query;

impl Quota {
    pub(super) async fn read_one(&self, id: &ProviderId) -> Result<(i64, ProviderDoc), QuotaError> {
        match self.repo.get(id.to_bson()).await {
            Ok(found) => Ok((found.version, found.value)),
            Err(RepoError::NotFound { .. } | RepoError::Deleted { .. }) => {
                Err(QuotaError::UnknownProvider {
                    provider: id.clone(),
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The request's providers and all their ancestors (committed values).
    pub(super) async fn read_for(&self, request: &Request) -> Result<Docs, QuotaError> {
        let claimed: Vec<&ProviderId> = request.claims.iter().map(|(p, _)| p).collect();
        let mut docs = self.read_many(&claimed).await?;
        let missing: BTreeSet<ProviderId> = docs
            .values()
            .flat_map(|(_, doc)| doc.ancestors.iter())
            .filter(|a| !docs.contains_key(*a))
            .cloned()
            .collect();
        if !missing.is_empty() {
            let missing: Vec<&ProviderId> = missing.iter().collect();
            docs.extend(self.read_many(&missing).await?);
        }
        Ok(docs)
    }

    pub(super) async fn read_many(&self, ids: &[&ProviderId]) -> Result<Docs, QuotaError> {
        if let [id] = ids {
            let (generation, doc) = self.read_one(id).await?;
            if doc.parent.is_some() {
                self.remember_parent(id);
            }
            return Ok([((*id).clone(), (generation, doc))].into_iter().collect());
        }
        let list: Vec<Bson> = ids.iter().map(|id| id.to_bson()).collect();
        let docs = self.holding(doc! { "_id": { "$in": list } }).await?;
        match ids.iter().find(|id| !docs.contains_key(**id)) {
            Some(id) => Err(QuotaError::UnknownProvider {
                provider: (*id).clone(),
            }),
            None => Ok(docs),
        }
    }

    pub(super) async fn holding(&self, filter: Document) -> Result<Docs, QuotaError> {
        Ok(stamped_docs(
            self.repo.find(Query::new().filter(filter)).await?,
        ))
    }

    /// What [`holding`](Quota::holding) returns, read with a plain query, when that is enough:
    /// no provider found (nothing held), or exactly one, neither held by a transaction nor of an
    /// older schema, so its stored fields are its committed values. `None` when it takes the
    /// committed-value query to tell. The query also looks at the values a pending transaction
    /// would restore, so a provider whose committed entries only its undo still shows is found.
    pub(super) async fn holding_plainly(
        &self,
        filter: &Document,
    ) -> Result<Option<Docs>, QuotaError> {
        let found: Vec<Document> = self
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
        let unset = |field: &str| stored.get(field).is_none_or(|v| v == &Bson::Null);
        if !unset(fields::ACTIVE_TXN)
            || !unset(fields::DELETED)
            || stored.get_i64(fields::SCHEMA_VERSION).ok()
                != Some(self.repo.spec().schema_version())
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
    pub(super) async fn write(&self, writes: Vec<Write>) -> Result<Step, QuotaError> {
        if let [write] = writes.as_slice() {
            let update = update_of(&write.doc)?;
            return match self
                .repo
                .update(write.doc.id.to_bson(), write.generation, &update)
                .await
            {
                Ok(_) => Ok(Step::Done),
                Err(e) => classify_repo(e),
            };
        }
        let tx = self.txns.begin();
        for write in &writes {
            let update = update_of(&write.doc)?;
            if let Err(e) = tx
                .update(
                    &self.repo,
                    write.doc.id.to_bson(),
                    write.generation,
                    &update,
                )
                .await
            {
                return classify_txn(e);
            }
        }
        match tx.commit().await {
            Ok(_) => Ok(Step::Done),
            Err(e) => classify_txn(e),
        }
    }

    /// Waits for this process's other changes of the same providers (read again after this).
    pub(super) async fn queue<'a>(
        &self,
        ids: impl Iterator<Item = &'a ProviderId>,
    ) -> Vec<tokio::sync::OwnedMutexGuard<()>> {
        use std::hash::{Hash, Hasher};
        let stripes: BTreeSet<usize> = ids
            .map(|id| {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                id.hash(&mut h);
                usize::try_from(h.finish() % self.stripes.len() as u64).unwrap_or(0)
            })
            .collect();
        let mut guards = Vec::with_capacity(stripes.len());
        for stripe in stripes {
            guards.push(Arc::clone(&self.stripes[stripe]).lock_owned().await);
        }
        guards
    }

    pub(super) fn has_parent(&self, id: &ProviderId) -> bool {
        self.with_parent
            .lock()
            .map(|known| known.contains(id))
            .unwrap_or(false)
    }

    pub(super) fn remember_parent(&self, id: &ProviderId) {
        if let Ok(mut known) = self.with_parent.lock() {
            known.insert(id.clone());
        }
    }
}
