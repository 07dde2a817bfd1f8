//! The quota decisions, free of I/O: given providers as read (with their generations), what to
//! write and what to answer. The database layer reads, calls these, and writes conditionally on
//! the generations read, which is the algorithm of the quota's reference design (check
//! availability and read the generation, write only if the generation is unchanged, otherwise
//! read again and retry); the single-provider fast path
//! (`ops::take_fast`) encodes the same decision as the condition of one write instead.

use std::collections::{BTreeMap, BTreeSet};

use bson::DateTime;

use crate::quota::error::{QuotaError, Refusal};
use crate::quota::model::{Entry, NewProvider, ProviderDoc, ProviderId, Request, StripeId};
use crate::repo::fields::MAX_NAME;

/// Provider stripes as read: id -> (generation, stored value); a request's decision gets one per
/// provider, the one holding the request's entries (see `stripes`).
pub(crate) type Docs = BTreeMap<StripeId, (i64, ProviderDoc)>;

/// The stripe of `provider` in `docs`.
pub(crate) fn stripe_of<'a>(
    docs: &'a Docs,
    provider: &ProviderId,
) -> Option<(&'a StripeId, &'a (i64, ProviderDoc))> {
    docs.iter().find(|(id, _)| id.is(provider))
}

/// A provider's new value, to be written only if its generation is still the one read.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Write {
    pub(crate) generation: i64,
    pub(crate) doc: ProviderDoc,
}

/// What taking a request comes to.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Take {
    /// Already applied (a retry); `expires` is the reservation's expiry, if it is one.
    Replay { expires: Option<DateTime> },
    /// Write these (one per provider touched, ancestors included).
    Apply(Vec<Write>),
}

/// Checks a name: `what` says which (`provider scope`, `provider resource`, `consumer`,
/// `request id`). Names are copied into every provider (and ancestor) a request touches, hot
/// documents, so they stay under [`MAX_NAME`] bytes.
pub(crate) fn check_name(what: &'static str, value: &str) -> Result<(), QuotaError> {
    let invalid = |reason: String| QuotaError::InvalidName {
        what,
        name: value.to_string(),
        reason,
    };
    if value.is_empty() {
        return Err(invalid("it is empty".into()));
    }
    if value.len() > MAX_NAME {
        return Err(invalid(format!(
            "it has {} bytes, more than {MAX_NAME}",
            value.len()
        )));
    }
    // A NUL or a line break in an id is almost always a caller's encoding bug, and would make
    // errors and logs lie about what was asked.
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(invalid(format!(
            "it holds the control character U+{:04X}",
            u32::from(c)
        )));
    }
    Ok(())
}

/// Checks a provider id's parts.
pub(crate) fn check_provider(id: &ProviderId) -> Result<(), QuotaError> {
    check_name("provider scope", &id.scope)?;
    check_name("provider resource", &id.resource)
}

/// Checks a new provider before anything is read or written.
pub(crate) fn check_new(new: &NewProvider) -> Result<(), QuotaError> {
    check_provider(&new.id)?;
    check_limit(&new.id, new.limit)?;
    if let Some(parent) = &new.parent {
        check_provider(parent)?;
        if parent == &new.id {
            return Err(QuotaError::InvalidRequest {
                reason: format!("{} cannot be its own parent", new.id),
            });
        }
    }
    Ok(())
}

/// Checks a limit.
pub(crate) fn check_limit(id: &ProviderId, limit: i64) -> Result<(), QuotaError> {
    if limit < 0 {
        return Err(QuotaError::NegativeLimit {
            provider: id.clone(),
            limit,
        });
    }
    Ok(())
}

/// Checks a request before anything is read or written.
pub(crate) fn check_request(req: &Request) -> Result<(), QuotaError> {
    check_name("consumer", &req.consumer)?;
    check_name("request id", &req.id)?;
    if req.claims.is_empty() {
        return Err(QuotaError::InvalidRequest {
            reason: format!(
                "request {} of consumer {} names no provider",
                req.id, req.consumer
            ),
        });
    }
    let mut seen = BTreeSet::new();
    for (provider, amount) in &req.claims {
        check_provider(provider)?;
        if *amount <= 0 {
            return Err(QuotaError::InvalidAmount {
                provider: provider.clone(),
                amount: *amount,
            });
        }
        if !seen.insert(provider) {
            return Err(QuotaError::DuplicateProvider {
                provider: provider.clone(),
            });
        }
    }
    Ok(())
}

/// The providers a request touches: each claim's and its ancestors', needing `docs` for the
/// claimed providers only.
pub(crate) fn needs(req: &Request, docs: &Docs) -> Result<BTreeMap<ProviderId, i64>, QuotaError> {
    let mut needs: BTreeMap<ProviderId, i64> = BTreeMap::new();
    for (provider, amount) in &req.claims {
        let (_, (_, doc)) =
            stripe_of(docs, provider).ok_or_else(|| QuotaError::UnknownProvider {
                provider: provider.clone(),
            })?;
        for id in std::iter::once(provider).chain(doc.ancestors.iter()) {
            let total = needs.entry(id.clone()).or_insert(0);
            *total = total
                .checked_add(*amount)
                .ok_or_else(|| QuotaError::InvalidAmount {
                    provider: id.clone(),
                    amount: *amount,
                })?;
        }
    }
    Ok(needs)
}

/// Drops released requests whose late copies can no longer land.
fn prune(held: &mut Vec<Entry>, now: DateTime) -> bool {
    let before = held.len();
    held.retain(|e| !(e.is_tombstone() && e.dl.is_none_or(|dl| dl <= now)));
    held.len() != before
}

/// Decides a consume (`expires` = None) or a reservation (`expires` = Some) of `req`.
/// `dl` is stored in the new entries when a copy of the request may be in flight.
pub(crate) fn take(
    req: &Request,
    docs: &Docs,
    expires: Option<DateTime>,
    dl: Option<DateTime>,
    now: DateTime,
) -> Result<Take, QuotaError> {
    let needs = needs(req, docs)?;
    let mut found = Vec::new();
    let mut stripes = BTreeMap::new();
    for id in needs.keys() {
        let (stripe, (_, doc)) =
            stripe_of(docs, id).ok_or_else(|| QuotaError::UnknownProvider {
                provider: id.clone(),
            })?;
        stripes.insert(id, stripe);
        if let Some(entry) = doc.held.iter().find(|e| e.is(&req.consumer, &req.id)) {
            found.push((id, entry));
        }
    }
    if !found.is_empty() {
        let same = found.len() == needs.len()
            && found.iter().all(|(id, e)| match expires {
                None => e.exp.is_none() && (e.n == needs[*id] || e.is_tombstone()),
                Some(_) => e.exp.is_some() && e.n == needs[*id],
            });
        if !same {
            return Err(QuotaError::RequestReused {
                consumer: req.consumer.clone(),
                request: req.id.clone(),
            });
        }
        return Ok(Take::Replay {
            expires: found.iter().find_map(|(_, e)| e.exp),
        });
    }
    let refusals: Vec<Refusal> = needs
        .iter()
        .filter_map(|(id, need)| {
            let (_, doc) = &docs[stripes[id]];
            (doc.available < *need || doc.over).then(|| Refusal {
                provider: id.clone(),
                requested: *need,
                available: doc.available,
                limit: doc.limit,
            })
        })
        .collect();
    if !refusals.is_empty() {
        return Err(QuotaError::QuotaExceeded {
            consumer: req.consumer.clone(),
            request: req.id.clone(),
            refusals,
        });
    }
    let writes = needs
        .iter()
        .map(|(id, need)| {
            let (generation, doc) = &docs[stripes[id]];
            let mut doc = doc.clone();
            prune(&mut doc.held, now);
            doc.held.push(Entry {
                c: req.consumer.clone(),
                r: req.id.clone(),
                n: *need,
                exp: expires,
                dl,
            });
            doc.usage += need;
            doc.available -= need;
            Write {
                generation: *generation,
                doc,
            }
        })
        .collect();
    Ok(Take::Apply(writes))
}

/// Removes the entries `pick` selects from every provider in `docs` (entries that may still
/// have a late copy in flight stay, at 0, until their deadline); returns the writes and the
/// amount returned to each provider. Providers with nothing picked are left alone, apart from
/// forgetting expired tombstones where something else is written anyway. What went back to the
/// stripes of one provider is added up.
pub(crate) fn remove(
    docs: &Docs,
    pick: impl Fn(&Entry) -> bool,
    now: DateTime,
) -> (Vec<Write>, Vec<(ProviderId, i64)>) {
    let mut writes = Vec::new();
    let mut returned: BTreeMap<ProviderId, i64> = BTreeMap::new();
    for (id, (generation, doc)) in docs {
        if !doc.held.iter().any(|e| !e.is_tombstone() && pick(e)) {
            continue;
        }
        let mut doc = doc.clone();
        let mut amount = 0;
        let mut held = Vec::with_capacity(doc.held.len());
        for e in doc.held.drain(..) {
            if e.is_tombstone() || !pick(&e) {
                held.push(e);
                continue;
            }
            amount += e.n;
            if let Some(dl) = e.dl.filter(|dl| *dl > now) {
                held.push(Entry {
                    n: 0,
                    exp: None,
                    dl: Some(dl),
                    ..e
                });
            }
        }
        prune(&mut held, now);
        doc.held = held;
        doc.usage -= amount;
        doc.available += amount;
        // A provider of one stripe is its own whole: it is over exactly while its usage is.
        // (A striped one learns that it is back under by reading every stripe: `borrow`.)
        if doc.is_whole() {
            doc.over = doc.available < 0;
        }
        *returned.entry(id.provider()).or_default() += amount;
        writes.push(Write {
            generation: *generation,
            doc,
        });
    }
    (writes, returned.into_iter().collect())
}

/// What confirming a reservation comes to.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Confirm {
    /// Already confirmed (a retry).
    Done,
    /// Write these.
    Apply(Vec<Write>),
}

/// Decides confirming reservation (`consumer`, `request`) found in `docs`.
pub(crate) fn confirm(
    consumer: &str,
    request: &str,
    docs: &Docs,
    now: DateTime,
) -> Result<Confirm, QuotaError> {
    let entries: Vec<&Entry> = docs
        .values()
        .filter_map(|(_, doc)| doc.held.iter().find(|e| e.is(consumer, request)))
        .filter(|e| !e.is_tombstone())
        .collect();
    if entries.is_empty() {
        return Err(QuotaError::UnknownReservation {
            consumer: consumer.to_string(),
            request: request.to_string(),
        });
    }
    if entries.iter().all(|e| e.exp.is_none()) {
        return Ok(Confirm::Done);
    }
    if let Some(expired_at) = entries.iter().filter_map(|e| e.exp).find(|exp| *exp <= now) {
        return Err(QuotaError::ReservationExpired {
            consumer: consumer.to_string(),
            request: request.to_string(),
            expired_at: expired_at.to_chrono(),
        });
    }
    let writes = docs
        .values()
        .filter(|(_, doc)| doc.held.iter().any(|e| e.is(consumer, request)))
        .map(|(generation, doc)| {
            let mut doc = doc.clone();
            for e in doc.held.iter_mut().filter(|e| e.is(consumer, request)) {
                e.exp = None;
            }
            Write {
                generation: *generation,
                doc,
            }
        })
        .collect();
    Ok(Confirm::Apply(writes))
}

/// The provider of one stripe with a new limit (usage is untouched: a limit below it only
/// blocks new takes). Below its usage it is marked `over`, which a split hands to both halves:
/// each half's own `available` would otherwise show room the provider as a whole lacks.
pub(crate) fn set_limit(doc: &ProviderDoc, limit: i64) -> ProviderDoc {
    let mut doc = doc.clone();
    doc.limit = limit;
    doc.available = limit - doc.usage;
    doc.over = doc.available < 0;
    doc
}

/// The provider without tombstones past their deadline, if it had any.
pub(crate) fn pruned(doc: &ProviderDoc, now: DateTime) -> Option<ProviderDoc> {
    let mut doc = doc.clone();
    prune(&mut doc.held, now).then_some(doc)
}

/// A new provider's stored value.
pub(crate) fn new_provider(new: &NewProvider, parent: Option<&ProviderDoc>) -> ProviderDoc {
    let ancestors = match parent {
        Some(parent) => std::iter::once(parent.id.provider())
            .chain(parent.ancestors.iter().cloned())
            .collect(),
        None => Vec::new(),
    };
    ProviderDoc {
        id: StripeId::new(&new.id, 0),
        limit: new.limit,
        usage: 0,
        available: new.limit,
        parent: new.parent.clone(),
        ancestors,
        held: Vec::new(),
        bits: 0,
        stripes: Vec::new(),
        over: false,
    }
}

#[cfg(test)]
mod tests;
