//! Giving quota back: releasing what a consumer holds, confirming or cancelling a reservation,
//! and the sweep that returns expired reservations.

use std::collections::BTreeSet;

use bson::{doc, Bson, DateTime, Document};

use crate::collections::PROVIDERS_COLLECTION;
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

impl Quota {
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

    /// Returns what one consume took (from its providers and their ancestors), all at once,
    /// leaving the consumer's other requests as they are. The [`Consumed`] names the providers,
    /// so on one provider without a parent this is a single conditional update, where
    /// [`release`](Quota::release) first has to find what the consumer holds. Releasing the same
    /// request again is [`QuotaError::UnknownRequest`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(quota: mongotx::quota::Quota) -> Result<(), mongotx::quota::QuotaError> {
    /// use mongotx::quota::{ProviderId, Request};
    ///
    /// let slots = ProviderId::new("team-a", "upload-slots");
    /// let taken = quota.consume(&Request::new("upload-9").take(slots, 1)).await?;
    /// // ... the upload ends:
    /// quota.release_consumed(&taken).await?;
    /// # Ok(()) }
    /// ```
    pub async fn release_consumed(&self, consumed: &Consumed) -> Result<Released, QuotaError> {
        let (consumer, request) = (&consumed.consumer, &consumed.request);
        check_ids(consumer, request)?;
        let released = |returned| Released {
            consumer: consumer.clone(),
            returned,
        };
        let unsure = match self
            .pull_claim(consumer, request, None, &consumed.claims)
            .await?
        {
            Pulled::Landed(returned) => return Ok(released(returned)),
            Pulled::Unsure(returned) => Some(returned),
            Pulled::No => None,
        };
        let returned = self
            .remove_where(
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

    /// Turns a live reservation into an allocation (released with the consumer). Confirming it
    /// again is a no-op; after its expiry (server time) it is
    /// [`QuotaError::ReservationExpired`] and nothing changes.
    pub async fn confirm(&self, reservation: &Reservation) -> Result<(), QuotaError> {
        let (consumer, request) = (&reservation.consumer, &reservation.request);
        check_ids(consumer, request)?;
        let mut attempts = Attempts::new(
            self.options.retry,
            format!("confirm reservation {request} of consumer {consumer}"),
        );
        loop {
            let now = self.store.now().await?;
            let docs = self.holding(entry_filter(consumer, request)).await?;
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
            match self.write(writes).await? {
                Step::Done => return Ok(()),
                Step::Retry(reason) | Step::Ambiguous(reason) => attempts.again(reason).await?,
            }
        }
    }

    /// Returns a reservation that was not confirmed. Once it has expired and the GC returned it,
    /// this is [`QuotaError::ReservationExpired`]. A reservation this handle's `reserve` returned
    /// on one provider without a parent goes back in a single conditional update; one rebuilt
    /// with [`Reservation::new`] is first looked up.
    pub async fn cancel(&self, reservation: &Reservation) -> Result<Released, QuotaError> {
        let (consumer, request) = (&reservation.consumer, &reservation.request);
        check_ids(consumer, request)?;
        let exp = Some(DateTime::from_chrono(reservation.expires));
        let unsure = match self
            .pull_claim(consumer, request, exp, &reservation.claims)
            .await?
        {
            Pulled::Landed(returned) => {
                return Ok(Released {
                    consumer: consumer.clone(),
                    returned,
                })
            }
            Pulled::Unsure(returned) => Some(returned),
            Pulled::No => None,
        };
        let returned = self
            .remove_where(
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
            let now = self.store.now().await?;
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
    pub(super) async fn remove_where(
        &self,
        what: String,
        filter: Document,
        pick: impl Fn(&Entry, DateTime) -> bool,
    ) -> Result<Vec<(ProviderId, i64)>, QuotaError> {
        let mut attempts = Attempts::new(self.options.retry, what);
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
        self.pull(
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
        &self,
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
            match self
                .pull_known(consumer, request, exp, provider, *amount)
                .await?
            {
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
        &self,
        consumer: &str,
        request: &str,
        exp: Option<DateTime>,
        provider: &ProviderId,
        amount: i64,
    ) -> Result<Option<Step>, QuotaError> {
        if self.has_parent(provider) {
            return Ok(None);
        }
        let Some((stripe, _)) = self.layout(provider).locate(hash(consumer, request)) else {
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
        self.pull(&stripe.to_string(), filter, consumer, &[request], amount)
            .await
    }

    /// Takes `consumer`'s entries under `requests` (together `amount`) out of the one document
    /// `filter` names, only while no transaction holds it.
    async fn pull(
        &self,
        shown: &str,
        mut filter: Document,
        consumer: &str,
        requests: &[&str],
        amount: i64,
    ) -> Result<Option<Step>, QuotaError> {
        filter.insert(fields::SCHEMA_VERSION, self.repo.spec().schema_version());
        filter.insert(fields::ACTIVE_TXN, Bson::Null);
        filter.insert(fields::DELETED, Bson::Null);
        let update = doc! {
            "$inc": { "usage": -amount, "available": amount, fields::VERSION: 1_i64 },
            "$pull": { "held": { "c": consumer, "r": { "$in": requests } } },
        };
        match self.repo.raw_collection().update_one(filter, update).await {
            Ok(result) if result.matched_count == 1 => Ok(Some(Step::Done)),
            Ok(_) => Ok(None),
            Err(e) if is_transient(&e) => Ok(Some(Step::Ambiguous(format!(
                "returning {amount} to {shown}: {e}"
            )))),
            Err(e) => Err(RepoError::database(PROVIDERS_COLLECTION, shown, "release", e).into()),
        }
    }
}
