//! The quota operations against the database: read, decide (`decide`), write conditionally.
//! This file holds what they share (the retry budget, how a failed write is classified) and the
//! provider operations; consuming and reserving are in `consume`, giving back in `release`,
//! reading providers and writing decisions in `access`.

use std::collections::BTreeMap;
use std::time::Duration;

use bson::{doc, Document};
use mongodb::IndexModel;

use crate::collections::PROVIDERS_COLLECTION;
use crate::quota::decide::{self, Docs, Write};
use crate::quota::error::QuotaError;
use crate::quota::model::{NewProvider, Provider, ProviderDoc, ProviderId};
use crate::quota::stripes::share;
use crate::quota::Quota;
use crate::repo::changes::Update;
use crate::repo::error::RepoError;
use crate::repo::fields;
use crate::repo::find::Query;
use crate::repo::repository::Stamped;
use crate::retry::LockWait;
use crate::retry::Retry;
use crate::server::is_transient;
use crate::txn::error::TxnError;

/// Single-provider writes tried before falling back to the generation-checked path (which only
/// happens when the provider is held by a transaction or the server's clock ran past a send's
/// deadline).
pub(super) const FAST_TRIES: u32 = 4;

/// The longest reservation.
pub(super) const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

/// How a conditional write ended.
pub(super) enum Step {
    Done,
    /// Nothing was written (a generation moved, a holder was in the way): re-read and decide again.
    Retry(String),
    /// It may or may not have been written: re-read; the entries tell.
    Ambiguous(String),
}

/// Re-read-and-retry budget of one call.
pub(super) struct Attempts {
    what: String,
    retry: Retry,
}

impl Attempts {
    pub(super) fn new(policy: LockWait, what: String) -> Attempts {
        Attempts {
            what,
            retry: Retry::until_deadline(policy),
        }
    }

    /// Re-reads made so far (each one followed a pause).
    pub(super) fn retries(&self) -> u32 {
        self.retry.pauses()
    }

    pub(super) async fn again(&mut self, reason: String) -> Result<(), QuotaError> {
        let attempt = self.retry.pauses() + 1;
        if self.retry.exhausted() {
            return Err(QuotaError::Contended {
                what: self.what.clone(),
                attempts: attempt,
                elapsed: self.retry.elapsed(),
                last: reason,
            });
        }
        tracing::debug!(what = %self.what, attempt, %reason, "quota: re-reading");
        self.retry.pause().await;
        Ok(())
    }
}

pub(super) fn stamped_docs(found: Vec<Stamped<ProviderDoc>>) -> Docs {
    found
        .into_iter()
        .map(|s| (s.value.id.clone(), (s.version, s.value)))
        .collect()
}

pub(super) fn update_of(doc: &ProviderDoc) -> Result<Update, QuotaError> {
    let held = bson::to_bson(&doc.held).map_err(|e| RepoError::Encode {
        collection: PROVIDERS_COLLECTION.to_string(),
        reason: e.to_string(),
    })?;
    let mut update = Update::new()
        .set("limit", doc.limit)
        .set("usage", doc.usage)
        .set("available", doc.available)
        .set("held", held);
    // Set only once a provider is striped, so a provider of one stripe stays as before.
    if doc.bits != 0 {
        update = update.set("bits", doc.bits);
    }
    if doc.over {
        update = update.set("over", true);
    } else if doc.bits != 0 {
        update = update.unset("over");
    }
    if !doc.stripes.is_empty() {
        let stripes = bson::to_bson(&doc.stripes).map_err(|e| RepoError::Encode {
            collection: PROVIDERS_COLLECTION.to_string(),
            reason: e.to_string(),
        })?;
        update = update.set("stripes", stripes);
    }
    Ok(update)
}

pub(super) fn classify_repo(error: RepoError) -> Result<Step, QuotaError> {
    match error {
        RepoError::Database { ref source, .. } if is_transient(source) => {
            Ok(Step::Ambiguous(error.to_string()))
        }
        e if e.is_retryable() => Ok(Step::Retry(e.to_string())),
        e => Err(e.into()),
    }
}

pub(super) fn classify_txn(error: TxnError) -> Result<Step, QuotaError> {
    match error {
        TxnError::CommitUnknown { .. } => Ok(Step::Ambiguous(error.to_string())),
        TxnError::Document { source, .. } => classify_repo(*source),
        e if e.is_retryable() => Ok(Step::Retry(e.to_string())),
        e => Err(e.into()),
    }
}

impl Quota {
    pub(crate) async fn create_indexes(&self) -> Result<(), QuotaError> {
        let coll = self.repo.raw_collection();
        // A release, confirm or cancel finds its entries with an `$or` of the stored ones and
        // those a pending transaction would restore (`stored_or_restored`); MongoDB answers an
        // `$or` from indexes only when every branch has one, so the restored copy is indexed too.
        let restored = format!("{}.restore.held", fields::HOLD);
        for keys in [
            doc! { "held.c": 1, "held.r": 1 },
            doc! { format!("{restored}.c"): 1, format!("{restored}.r"): 1 },
            doc! { "held.exp": 1 },
        ] {
            coll.create_index(IndexModel::builder().keys(keys).build())
                .await
                .map_err(|e| RepoError::database(PROVIDERS_COLLECTION, "*", "create index", e))?;
        }
        Ok(())
    }

    pub(super) fn check(&self, name: &'static str) -> Result<(), QuotaError> {
        #[cfg(feature = "testkit")]
        return self
            .faults
            .check(name, 0)
            .map_err(|at| QuotaError::Crashed { at });
        // Without the test rig no injector can be installed: every point passes.
        #[cfg(not(feature = "testkit"))]
        {
            let _ = (&self.faults, name);
            Ok(())
        }
    }

    // ----- providers -----

    /// Creates a provider. A parent must exist already; parents never change afterwards, so a
    /// hierarchy can have no cycle.
    pub async fn create(&self, new: NewProvider) -> Result<Provider, QuotaError> {
        decide::check_new(&new)?;
        let parent = match &new.parent {
            Some(parent) => Some(self.read_one(parent).await?.1),
            None => None,
        };
        let doc = decide::new_provider(&new, parent.as_ref());
        match self.repo.insert(&doc).await {
            Ok(_) => {}
            Err(RepoError::DuplicateId { .. }) => {
                return Err(QuotaError::ProviderExists { provider: new.id })
            }
            Err(e) => return Err(e.into()),
        }
        if new.parent.is_some() {
            self.remember_parent(&new.id);
        }
        self.provider(new.id).await
    }

    /// Reads a provider: limit, usage, generation and who holds what, all of one moment.
    pub async fn provider(&self, id: impl Into<ProviderId>) -> Result<Provider, QuotaError> {
        let id = id.into();
        decide::check_provider(&id)?;
        let last = self.read_at_once(&id).await?;
        Provider::from_stored(last.into_values().collect())
            .ok_or(QuotaError::UnknownProvider { provider: id })
    }

    /// Sets a provider's limit. Lowering it below the usage is allowed: nothing is taken back,
    /// only new consumption is refused until usage falls under it.
    pub async fn set_limit(
        &self,
        id: impl Into<ProviderId>,
        limit: i64,
    ) -> Result<Provider, QuotaError> {
        let id = id.into();
        decide::check_provider(&id)?;
        decide::check_limit(&id, limit)?;
        let mut attempts = Attempts::new(self.options.retry, format!("set limit of {id}"));
        loop {
            // Every stripe is written, each conditionally on the version read, so the shares
            // are of one moment and add up to the new limit.
            let all = self.read_stripes(&id).await?;
            let writes = match all.values().collect::<Vec<_>>()[..] {
                [(generation, doc)] => vec![Write {
                    generation: *generation,
                    doc: decide::set_limit(doc, limit),
                }],
                _ => share(&all, limit),
            };
            match self.write(writes).await? {
                Step::Done => return self.provider(id).await,
                Step::Retry(reason) | Step::Ambiguous(reason) => attempts.again(reason).await?,
            }
        }
    }

    /// Every provider of `scope`, by resource.
    pub async fn usage(&self, scope: &str) -> Result<Vec<Provider>, QuotaError> {
        // A scope no provider can have (create refuses it) is a caller's mistake, not an empty
        // scope.
        decide::check_name("provider scope", scope)?;
        let found = self
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
                providers.push(self.provider(id).await?);
                continue;
            }
            providers.extend(Provider::from_stored(stripes));
        }
        Ok(providers)
    }
}

pub(super) fn entry_filter(consumer: &str, request: &str) -> Document {
    doc! { "held": { "$elemMatch": { "c": consumer, "r": request } } }
}

pub(super) fn check_ids(consumer: &str, request: &str) -> Result<(), QuotaError> {
    decide::check_name("consumer", consumer)?;
    decide::check_name("request id", request)
}

/// `filter` on the stored fields, or on the values a pending transaction's hold would restore
/// (its undo copy under `_hold.restore`): a provider whose committed entries only the undo still
/// shows matches too.
pub(super) fn stored_or_restored(filter: &Document) -> Document {
    let restored: Document = filter
        .iter()
        .map(|(k, v)| (format!("{}.restore.{k}", fields::HOLD), v.clone()))
        .collect();
    doc! { "$or": [filter.clone(), restored] }
}
