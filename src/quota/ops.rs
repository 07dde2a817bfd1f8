//! The quota operations against the database: read, decide (`decide`), write conditionally.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{doc, Bson, DateTime, Document};
use futures::TryStreamExt;
use mongodb::IndexModel;

use crate::quota::decide::{self, Confirm, Docs, Take, Write};
use crate::quota::error::QuotaError;
use crate::quota::failpoint;
use crate::quota::model::{
    Consumed, Entry, NewProvider, Provider, ProviderDoc, ProviderId, Released, Request,
    Reservation, SweepSummary, PROVIDERS_COLLECTION,
};
use crate::quota::Quota;
use crate::repo::changes::Update;
use crate::repo::error::RepoError;
use crate::repo::fields;
use crate::repo::repository::{Query, Stamped};
use crate::server::clock::plus;
use crate::server::is_transient;
use crate::txn::error::TxnError;

/// Single-provider writes tried before falling back to the generation-checked path (which only
/// happens when the provider is held by a transaction or the server's clock ran past a send's
/// deadline).
const FAST_TRIES: u32 = 4;

/// The longest reservation.
const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

/// How a conditional write ended.
enum Step {
    Done,
    /// Nothing was written (a generation moved, a holder was in the way): re-read and decide again.
    Retry(String),
    /// It may or may not have been written: re-read; the entries tell.
    Ambiguous(String),
}

/// Re-read-and-retry budget of one call.
struct Attempts {
    what: String,
    started: Instant,
    attempts: u32,
}

impl Attempts {
    fn new(what: String) -> Attempts {
        Attempts {
            what,
            started: Instant::now(),
            attempts: 0,
        }
    }

    async fn again(&mut self, quota: &Quota, reason: String) -> Result<(), QuotaError> {
        self.attempts += 1;
        let retry = quota.options.retry;
        if self.started.elapsed() >= retry.max_wait {
            return Err(QuotaError::Contended {
                what: self.what.clone(),
                attempts: self.attempts,
                elapsed: self.started.elapsed(),
                last: reason,
            });
        }
        tracing::debug!(what = %self.what, attempt = self.attempts, %reason, "quota: re-reading");
        tokio::time::sleep(retry.backoff(self.attempts - 1)).await;
        Ok(())
    }
}

fn stamped_docs(found: Vec<Stamped<ProviderDoc>>) -> Docs {
    found
        .into_iter()
        .map(|s| (s.value.id.clone(), (s.version, s.value)))
        .collect()
}

fn update_of(doc: &ProviderDoc) -> Result<Update, QuotaError> {
    let held = bson::to_bson(&doc.held).map_err(|e| RepoError::Encode {
        collection: PROVIDERS_COLLECTION.to_string(),
        reason: e.to_string(),
    })?;
    Ok(Update::new()
        .set("limit", doc.limit)
        .set("usage", doc.usage)
        .set("available", doc.available)
        .set("held", held))
}

fn classify_repo(error: RepoError) -> Result<Step, QuotaError> {
    match error {
        RepoError::Database { ref source, .. } if is_transient(source) => {
            Ok(Step::Ambiguous(error.to_string()))
        }
        e if e.is_retryable() => Ok(Step::Retry(e.to_string())),
        e => Err(e.into()),
    }
}

fn classify_txn(error: TxnError) -> Result<Step, QuotaError> {
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
        for keys in [doc! { "held.c": 1, "held.r": 1 }, doc! { "held.exp": 1 }] {
            coll.create_index(IndexModel::builder().keys(keys).build())
                .await
                .map_err(|e| RepoError::database(PROVIDERS_COLLECTION, "*", "create index", e))?;
        }
        Ok(())
    }

    fn check(&self, name: &'static str) -> Result<(), QuotaError> {
        self.faults
            .check(name, 0)
            .map_err(|at| QuotaError::Crashed { at })
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

    /// Reads a provider: limit, usage, generation and who holds what.
    pub async fn provider(&self, id: impl Into<ProviderId>) -> Result<Provider, QuotaError> {
        let id = id.into();
        decide::check_provider(&id)?;
        let (generation, doc) = self.read_one(&id).await?;
        Ok(Provider::from_stored(doc, generation))
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
        let mut attempts = Attempts::new(format!("set limit of {id}"));
        loop {
            let (generation, doc) = self.read_one(&id).await?;
            let write = Write {
                generation,
                doc: decide::set_limit(&doc, limit),
            };
            match self.write(vec![write]).await? {
                Step::Done => return self.provider(id).await,
                Step::Retry(reason) | Step::Ambiguous(reason) => {
                    attempts.again(self, reason).await?
                }
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
        Ok(found
            .into_iter()
            .map(|s| Provider::from_stored(s.value, s.version))
            .collect())
    }

    // ----- consuming -----

    /// Takes the request's amounts from its providers and their ancestors, all or nothing, and
    /// records them under the request's consumer. Applying the same request again (a retry after
    /// a lost reply) counts once and returns `replayed`.
    pub async fn consume(&self, request: &Request) -> Result<Consumed, QuotaError> {
        decide::check_request(request)?;
        let (consumed, _) = self.take(request, None).await?;
        self.check(failpoint::CONSUME_AFTER)?;
        Ok(consumed)
    }

    /// Holds the request's amounts like [`consume`](Quota::consume) until
    /// [`confirm`](Quota::confirm)ed or [`cancel`](Quota::cancel)led; after `ttl` (server time)
    /// the GC returns them. Reserving the same request again returns the same reservation.
    pub async fn reserve(
        &self,
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
        let expires = plus(self.store.now().await?, ttl);
        let (_, stored) = self.take(request, Some(expires)).await?;
        self.check(failpoint::RESERVE_AFTER)?;
        Ok(Reservation {
            consumer: request.consumer.clone(),
            request: request.id.clone(),
            expires: stored.unwrap_or(expires),
        })
    }

    async fn take(
        &self,
        request: &Request,
        expires: Option<DateTime>,
    ) -> Result<(Consumed, Option<DateTime>), QuotaError> {
        if request.in_flight() {
            self.refuse_reuse_elsewhere(request).await?;
        }
        if let [(provider, amount)] = request.claims.as_slice() {
            if !self.has_parent(provider) {
                if let Some(done) = self.take_fast(request, provider, *amount, expires).await? {
                    return Ok(done);
                }
            }
        }
        self.take_checked(request, expires).await
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
    async fn refuse_reuse_elsewhere(&self, request: &Request) -> Result<(), QuotaError> {
        // Live entries only: a released request remembered at 0 (until its late copies can no
        // longer land) holds nothing, and after it is forgotten its id is free anyway.
        let filter = doc! { "held": { "$elemMatch": {
            "c": &request.consumer, "r": &request.id, "n": { "$gt": 0_i64 },
        } } };
        let found: Vec<Document> = self
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

    /// One provider without a parent: one update whose condition is the decision itself.
    /// `None` when the generation-checked path must decide instead.
    async fn take_fast(
        &self,
        request: &Request,
        provider: &ProviderId,
        amount: i64,
        expires: Option<DateTime>,
    ) -> Result<Option<(Consumed, Option<DateTime>)>, QuotaError> {
        let id = provider.to_bson();
        let shown = provider.to_string();
        let coll = self.repo.raw_collection();
        let mut writes = 0;
        let consumed = |replayed: bool, writes: u32| Consumed {
            consumer: request.consumer.clone(),
            request: request.id.clone(),
            replayed,
            writes,
            retries: 0,
        };
        for attempt in 0..FAST_TRIES {
            let now = self.store.now().await?;
            let deadline = plus(now, self.options.send_window);
            let mut entry = doc! { "c": &request.consumer, "r": &request.id, "n": amount };
            if let Some(expires) = expires {
                entry.insert("exp", expires);
            }
            if request.in_flight() {
                entry.insert("dl", deadline);
            }
            let filter = doc! {
                "_id": id.clone(),
                fields::SCHEMA_VERSION: self.repo.spec().schema_version(),
                fields::ACTIVE_TXN: null,
                fields::DELETED: null,
                "parent": null,
                "available": { "$gte": amount },
                "held": { "$not": { "$elemMatch": { "c": &request.consumer, "r": &request.id } } },
                "$expr": { "$lte": ["$$NOW", deadline] },
            };
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
                    tokio::time::sleep(self.options.retry.backoff(attempt)).await;
                    continue;
                }
                Err(e) => {
                    return Err(
                        RepoError::database(PROVIDERS_COLLECTION, &shown, "consume", e).into(),
                    )
                }
            }
            // Nothing matched: find out why from the document itself.
            let Some(stored) = self.repo.read_raw(&id, &shown).await? else {
                return Err(QuotaError::UnknownProvider {
                    provider: provider.clone(),
                });
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
                self.remember_parent(provider);
                return Ok(None);
            }
            let held = stored
                .get(fields::ACTIVE_TXN)
                .is_some_and(|v| v != &Bson::Null);
            if held
                || stored.get_i64(fields::SCHEMA_VERSION).ok()
                    != Some(self.repo.spec().schema_version())
            {
                return Ok(None);
            }
            let generation = stored.get_i64(fields::VERSION).unwrap_or_default();
            let doc: ProviderDoc = bson::from_document(stored)
                .map_err(|e| self.repo.malformed(&shown, e.to_string()))?;
            let docs: Docs = [(provider.clone(), (generation, doc))]
                .into_iter()
                .collect();
            match decide::take(request, &docs, expires, None, now)? {
                Take::Replay { expires } => {
                    if request.in_flight() {
                        self.keep_deadline(request, provider, deadline).await?;
                    }
                    return Ok(Some((consumed(true, writes), expires)));
                }
                // It changed between the write and the read, or the send arrived after its
                // deadline: try again.
                Take::Apply(_) => {}
            }
        }
        Ok(None)
    }

    /// A request found applied by a resend may have other copies in flight: its entry must keep
    /// their deadline so that a release remembers it until then.
    async fn keep_deadline(
        &self,
        request: &Request,
        provider: &ProviderId,
        deadline: DateTime,
    ) -> Result<(), QuotaError> {
        let mut attempts = Attempts::new(format!(
            "keep the deadline of request {} of consumer {}",
            request.id, request.consumer
        ));
        loop {
            let (generation, mut doc) = self.read_one(provider).await?;
            let Some(entry) = doc.held.iter_mut().find(|e| {
                e.is(&request.consumer, &request.id) && !e.is_tombstone() && e.dl.is_none()
            }) else {
                return Ok(());
            };
            entry.dl = Some(deadline);
            match self.write(vec![Write { generation, doc }]).await? {
                Step::Done => return Ok(()),
                Step::Retry(reason) | Step::Ambiguous(reason) => {
                    attempts.again(self, reason).await?
                }
            }
        }
    }

    /// The seed's algorithm: read the providers and their generations, decide, write all of
    /// them conditionally on the generations read (one transaction when there are several), and
    /// start over if any changed.
    async fn take_checked(
        &self,
        request: &Request,
        expires: Option<DateTime>,
    ) -> Result<(Consumed, Option<DateTime>), QuotaError> {
        let mut attempts = Attempts::new(format!(
            "consume request {} of consumer {}",
            request.id, request.consumer
        ));
        let mut writes = 0_u32;
        let mut guards = Vec::new();
        loop {
            let now = self.store.now().await?;
            let deadline = request
                .in_flight()
                .then(|| plus(now, self.options.send_window));
            let docs = self.read_for(request).await?;
            if docs.len() > 1 && guards.is_empty() {
                guards = self.queue(docs.keys()).await;
                continue;
            }
            let take = decide::take(request, &docs, expires, deadline, now)?;
            let writes_now = match take {
                Take::Replay { expires } => {
                    return Ok((
                        Consumed {
                            consumer: request.consumer.clone(),
                            request: request.id.clone(),
                            replayed: true,
                            writes,
                            retries: attempts.attempts,
                        },
                        expires,
                    ))
                }
                Take::Apply(writes_now) => writes_now,
            };
            writes += u32::try_from(writes_now.len()).unwrap_or(u32::MAX);
            match self.write(writes_now).await? {
                Step::Done => {
                    return Ok((
                        Consumed {
                            consumer: request.consumer.clone(),
                            request: request.id.clone(),
                            replayed: false,
                            writes,
                            retries: attempts.attempts,
                        },
                        expires,
                    ))
                }
                Step::Retry(reason) => attempts.again(self, reason).await?,
                Step::Ambiguous(reason) => {
                    request.mark_in_flight();
                    attempts.again(self, reason).await?
                }
            }
        }
    }

    // ----- returning -----

    /// Returns everything `consumer` holds (allocations and reservations, on every provider and
    /// ancestor), all at once. A consumer holding nothing is [`QuotaError::UnknownConsumer`],
    /// so a second release returns nothing twice.
    pub async fn release(&self, consumer: &str) -> Result<Released, QuotaError> {
        decide::check_name("consumer", consumer)?;
        let returned = self
            .remove_where(
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

    /// Turns a live reservation into an allocation (released with the consumer). Confirming it
    /// again is a no-op; after its expiry (server time) it is
    /// [`QuotaError::ReservationExpired`] and nothing changes.
    pub async fn confirm(&self, reservation: &Reservation) -> Result<(), QuotaError> {
        let (consumer, request) = (&reservation.consumer, &reservation.request);
        check_ids(consumer, request)?;
        let mut attempts = Attempts::new(format!(
            "confirm reservation {request} of consumer {consumer}"
        ));
        loop {
            let now = self.store.now().await?;
            let docs = self.holding(entry_filter(consumer, request)).await?;
            let writes = match decide::confirm(consumer, request, &docs, now) {
                Ok(Confirm::Done) => return Ok(()),
                Ok(Confirm::Apply(writes)) => writes,
                Err(QuotaError::UnknownReservation { .. }) if reservation.expires <= now => {
                    return Err(QuotaError::ReservationExpired {
                        consumer: consumer.clone(),
                        request: request.clone(),
                        expired_at: reservation.expires,
                    })
                }
                Err(e) => return Err(e),
            };
            match self.write(writes).await? {
                Step::Done => return Ok(()),
                Step::Retry(reason) | Step::Ambiguous(reason) => {
                    attempts.again(self, reason).await?
                }
            }
        }
    }

    /// Returns a reservation that was not confirmed. Once it has expired and the GC returned it,
    /// this is [`QuotaError::ReservationExpired`].
    pub async fn cancel(&self, reservation: &Reservation) -> Result<Released, QuotaError> {
        let (consumer, request) = (&reservation.consumer, &reservation.request);
        check_ids(consumer, request)?;
        let returned = self
            .remove_where(
                format!("cancel reservation {request} of consumer {consumer}"),
                entry_filter(consumer, request),
                |e, _| e.is(consumer, request) && e.exp.is_some(),
            )
            .await?;
        if returned.is_empty() {
            let now = self.store.now().await?;
            return Err(if reservation.expires <= now {
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

    /// One GC pass: returns every reservation past its expiry (server time), each across all its
    /// providers at once, and forgets released requests whose late copies can no longer land.
    /// Safe to run from any number of processes at once.
    pub async fn sweep(&self) -> Result<SweepSummary, QuotaError> {
        let mut summary = SweepSummary::default();
        let now = self.store.now().await?;
        let expired = self
            .holding(doc! { "held": { "$elemMatch": { "exp": { "$lte": now } } } })
            .await?;
        let pairs: BTreeSet<(String, String)> = expired
            .values()
            .flat_map(|(_, doc)| doc.held.iter())
            .filter(|e| e.exp.is_some_and(|exp| exp <= now))
            .map(|e| (e.c.clone(), e.r.clone()))
            .collect();
        let mut first_error = None;
        for (consumer, request) in pairs {
            let returned = self
                .remove_where(
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
        let stale = self
            .holding(doc! { "held": { "$elemMatch": { "n": 0_i64, "dl": { "$lte": now } } } })
            .await?;
        for (generation, doc) in stale.values() {
            if let Some(doc) = decide::pruned(doc, now) {
                let write = Write {
                    generation: *generation,
                    doc,
                };
                if let Step::Done = self.write(vec![write]).await? {
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
    async fn remove_where(
        &self,
        what: String,
        filter: Document,
        pick: impl Fn(&Entry, DateTime) -> bool,
    ) -> Result<Vec<(ProviderId, i64)>, QuotaError> {
        let mut attempts = Attempts::new(what);
        // What a write whose reply was lost would have returned: if the re-read finds nothing
        // left, that write landed.
        let mut unsure = None;
        let mut guards = Vec::new();
        loop {
            let now = self.store.now().await?;
            let docs = match self.holding_plainly(&filter).await? {
                Some(docs) => docs,
                None => self.holding(filter.clone()).await?,
            };
            if docs.len() > 1 && guards.is_empty() {
                guards = self.queue(docs.keys()).await;
                continue;
            }
            let (writes, returned) = decide::remove(&docs, |e| pick(e, now), now);
            if writes.is_empty() {
                return Ok(unsure.unwrap_or_default());
            }
            let step = match self.pull_fast(&docs, |e| pick(e, now), now).await? {
                Some(step) => step,
                None => self.write(writes).await?,
            };
            match step {
                Step::Done => return Ok(returned),
                Step::Retry(reason) => attempts.again(self, reason).await?,
                Step::Ambiguous(reason) => {
                    unsure = Some(returned);
                    attempts.again(self, reason).await?
                }
            }
        }
    }

    /// Removing entries from one provider that none of them must outlive as a tombstone: one
    /// update conditioned on those exact entries being there (not on the generation), so that
    /// releases on a busy provider do not conflict with its consumes. `None` when the
    /// generation-checked write must do it (several providers, a tombstone to keep, or the
    /// provider changed in a way the condition notices).
    async fn pull_fast(
        &self,
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
        let filter = doc! {
            "_id": id.to_bson(),
            fields::SCHEMA_VERSION: self.repo.spec().schema_version(),
            fields::ACTIVE_TXN: null,
            fields::DELETED: null,
            "$and": present,
        };
        let update = doc! {
            "$inc": { "usage": -amount, "available": amount, fields::VERSION: 1_i64 },
            "$pull": { "held": { "c": consumer, "r": { "$in": requests } } },
        };
        match self.repo.raw_collection().update_one(filter, update).await {
            Ok(result) if result.matched_count == 1 => Ok(Some(Step::Done)),
            Ok(_) => Ok(None),
            Err(e) if is_transient(&e) => Ok(Some(Step::Ambiguous(format!(
                "returning {amount} to {id}: {e}"
            )))),
            Err(e) => {
                Err(RepoError::database(PROVIDERS_COLLECTION, &id.to_string(), "release", e).into())
            }
        }
    }

    // ----- reading and writing -----

    async fn read_one(&self, id: &ProviderId) -> Result<(i64, ProviderDoc), QuotaError> {
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
    async fn read_for(&self, request: &Request) -> Result<Docs, QuotaError> {
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

    async fn read_many(&self, ids: &[&ProviderId]) -> Result<Docs, QuotaError> {
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

    async fn holding(&self, filter: Document) -> Result<Docs, QuotaError> {
        Ok(stamped_docs(
            self.repo.find(Query::new().filter(filter)).await?,
        ))
    }

    /// What [`holding`](Quota::holding) returns, read with a plain query, when that is enough:
    /// no provider found (nothing held), or exactly one, neither held by a transaction nor of an
    /// older schema, so its stored fields are its committed values. `None` when it takes the
    /// committed-value query to tell. The query also looks at the values a pending transaction
    /// would restore, so a provider whose committed entries only its undo still shows is found.
    async fn holding_plainly(&self, filter: &Document) -> Result<Option<Docs>, QuotaError> {
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
    async fn write(&self, writes: Vec<Write>) -> Result<Step, QuotaError> {
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
    async fn queue<'a>(
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

    fn has_parent(&self, id: &ProviderId) -> bool {
        self.with_parent
            .lock()
            .map(|known| known.contains(id))
            .unwrap_or(false)
    }

    fn remember_parent(&self, id: &ProviderId) {
        if let Ok(mut known) = self.with_parent.lock() {
            known.insert(id.clone());
        }
    }
}

fn entry_filter(consumer: &str, request: &str) -> Document {
    doc! { "held": { "$elemMatch": { "c": consumer, "r": request } } }
}

fn check_ids(consumer: &str, request: &str) -> Result<(), QuotaError> {
    decide::check_name("consumer", consumer)?;
    decide::check_name("request id", request)
}

/// `filter` on the stored fields, or on the values a pending transaction's hold would restore
/// (its undo copy under `_hold.restore`): a provider whose committed entries only the undo still
/// shows matches too.
fn stored_or_restored(filter: &Document) -> Document {
    let restored: Document = filter
        .iter()
        .map(|(k, v)| (format!("{}.restore.{k}", fields::HOLD), v.clone()))
        .collect();
    doc! { "$or": [filter.clone(), restored] }
}
