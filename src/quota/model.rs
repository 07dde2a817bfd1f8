//! What the quota module stores and what it hands to callers.
//!
//! A provider is one document in [`PROVIDERS_COLLECTION`], or several once its allocations
//! outgrow one (stripes, see `stripes`). Its allocations live inside them, one entry per
//! (consumer, request), so that taking quota from a single provider and recording who took it is
//! one atomic write. A child provider's entries are mirrored in every ancestor, which
//! is how an ancestor's usage always equals its own allocations plus its descendants'.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bson::oid::ObjectId;
use bson::DateTime;
use serde::{Deserialize, Serialize};

/// The JSON Schema of [`PROVIDERS_COLLECTION`](crate::collections::PROVIDERS_COLLECTION) (the project's `schemas/quota_providers.json`).
pub const PROVIDERS_SCHEMA: &str = include_str!("../../schemas/quota_providers.json");

/// Names a provider: a resource within a scope, such as (`"project/42"`, `"cores"`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ProviderId {
    /// Who owns the budget: a project, a tenant, a team.
    pub scope: String,
    /// What is counted: cores, bytes of RAM, seats, API credits.
    pub resource: String,
}

impl ProviderId {
    /// The provider of `resource` in `scope`.
    pub fn new(scope: impl Into<String>, resource: impl Into<String>) -> ProviderId {
        ProviderId {
            scope: scope.into(),
            resource: resource.into(),
        }
    }

    /// The stored `_id`: fields in a fixed order, because the server compares embedded documents
    /// field by field.
    pub(crate) fn to_bson(&self) -> bson::Bson {
        bson::Bson::Document(bson::doc! { "scope": &self.scope, "resource": &self.resource })
    }
}

impl fmt::Display for ProviderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.scope, self.resource)
    }
}

impl<S: Into<String>, R: Into<String>> From<(S, R)> for ProviderId {
    fn from((scope, resource): (S, R)) -> ProviderId {
        ProviderId::new(scope, resource)
    }
}

/// Which document holds a part of a provider: stripe 0 is the provider's own document, the only
/// one until its allocations outgrow it (see `stripes`); the others are `_id: {scope, resource,
/// stripe}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) struct StripeId {
    pub(crate) scope: String,
    pub(crate) resource: String,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) stripe: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

impl StripeId {
    pub(crate) fn new(provider: &ProviderId, stripe: i64) -> StripeId {
        StripeId {
            scope: provider.scope.clone(),
            resource: provider.resource.clone(),
            stripe,
        }
    }

    /// The provider this is a part of.
    pub(crate) fn provider(&self) -> ProviderId {
        ProviderId::new(self.scope.clone(), self.resource.clone())
    }

    pub(crate) fn is(&self, provider: &ProviderId) -> bool {
        self.scope == provider.scope && self.resource == provider.resource
    }

    /// The stored `_id` (fields in a fixed order, see [`ProviderId::to_bson`]).
    pub(crate) fn to_bson(&self) -> bson::Bson {
        let mut id = bson::doc! { "scope": &self.scope, "resource": &self.resource };
        if self.stripe != 0 {
            id.insert("stripe", self.stripe);
        }
        bson::Bson::Document(id)
    }
}

impl fmt::Display for StripeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.stripe {
            0 => write!(f, "{}:{}", self.scope, self.resource),
            s => write!(f, "{}:{}#{s}", self.scope, self.resource),
        }
    }
}

/// One stripe of a provider's layout: its number and how many bits of a request's hash it
/// is addressed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Part {
    pub(crate) s: i64,
    pub(crate) bits: i64,
}

/// A provider's stripe as stored (system fields aside): the whole provider while it has one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ProviderDoc {
    #[serde(rename = "_id")]
    pub(crate) id: StripeId,
    /// This stripe's share of the provider's limit (the whole limit while it has one stripe).
    pub(crate) limit: i64,
    /// Sum of `n` over `held`; kept so that reads and conditions need no aggregation.
    pub(crate) usage: i64,
    /// `limit - usage`, negative after a limit was lowered below usage. The single-provider
    /// consume's whole condition is `available >= amount`.
    pub(crate) available: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) parent: Option<ProviderId>,
    /// Parent, grandparent, ... up to the root: fixed at creation, since parents never change.
    #[serde(default)]
    pub(crate) ancestors: Vec<ProviderId>,
    #[serde(default)]
    pub(crate) held: Vec<Entry>,
    /// The stripe holds the requests whose hash's low `bits` bits are its number.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) bits: i64,
    /// On stripe 0 of a provider with several: every stripe (the layout readers address by).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) stripes: Vec<Part>,
    /// On every stripe of a provider whose limit was lowered below its usage, until its usage
    /// is back under: a stripe's own room says nothing then (another stripe, or the half a split
    /// makes, holds the excess), so its consumes look at the whole provider.
    #[serde(default, skip_serializing_if = "is_false")]
    pub(crate) over: bool,
}

impl ProviderDoc {
    /// Whether this document is the whole provider (one stripe, never split).
    pub(crate) fn is_whole(&self) -> bool {
        self.bits == 0 && self.stripes.is_empty()
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// One (consumer, request)'s share of one provider.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Entry {
    /// Consumer.
    pub(crate) c: String,
    /// Request id: the idempotency key within the consumer.
    pub(crate) r: String,
    /// Amount held; 0 for a released request remembered until `dl`.
    pub(crate) n: i64,
    /// Set on a reservation: when (server time) the GC may return it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) exp: Option<DateTime>,
    /// Set when a copy of the consuming command may still be in flight: the server refuses every
    /// copy after this time, and a release keeps the entry (at 0) until then so a late copy finds
    /// it and does nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) dl: Option<DateTime>,
}

impl Entry {
    pub(crate) fn is(&self, consumer: &str, request: &str) -> bool {
        self.c == consumer && self.r == request
    }

    /// A released request kept only to stop late copies.
    pub(crate) fn is_tombstone(&self) -> bool {
        self.n == 0
    }
}

/// A provider's state as callers see it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Provider {
    /// Which provider.
    pub id: ProviderId,
    /// The most that may be in use.
    pub limit: i64,
    /// In use: allocations and live reservations, this provider's own and its descendants'.
    pub usage: i64,
    /// `limit - usage`; negative when the limit was lowered below usage.
    pub available: i64,
    /// The part of `usage` held by reservations not yet confirmed.
    pub reserved: i64,
    /// Bumped by every change, like the generation id of the quota's reference design: equal
    /// generations mean nothing changed.
    pub generation: i64,
    /// The provider this one also consumes from.
    pub parent: Option<ProviderId>,
    /// Who holds what, by request.
    pub allocations: Vec<Allocation>,
}

/// One request's share of a provider.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Allocation {
    /// The consumer holding it.
    pub consumer: String,
    /// The request that took it.
    pub request: String,
    /// How much.
    pub amount: i64,
    /// For a reservation, when it expires (server time); `None` for a confirmed allocation.
    pub expires: Option<chrono::DateTime<chrono::Utc>>,
}

impl Provider {
    /// The provider made of `stripes` (stripe 0 first, each with its version). Its generation
    /// is the sum of their versions: every change bumps one of them, so it still only grows.
    pub(crate) fn from_stored(stripes: Vec<(i64, ProviderDoc)>) -> Option<Provider> {
        let (_, head) = stripes.first()?;
        let (id, parent) = (head.id.provider(), head.parent.clone());
        let (mut limit, mut usage, mut generation) = (0_i64, 0_i64, 0_i64);
        let mut allocations = Vec::new();
        for (version, doc) in stripes {
            limit = limit.saturating_add(doc.limit);
            usage = usage.saturating_add(doc.usage);
            generation = generation.saturating_add(version);
            allocations.extend(doc.held.into_iter().filter(|e| !e.is_tombstone()).map(|e| {
                Allocation {
                    consumer: e.c,
                    request: e.r,
                    amount: e.n,
                    expires: e.exp.map(DateTime::to_chrono),
                }
            }));
        }
        Some(Provider {
            reserved: allocations
                .iter()
                .filter(|a| a.expires.is_some())
                .map(|a| a.amount)
                .sum(),
            id,
            limit,
            usage,
            available: limit.saturating_sub(usage),
            generation,
            parent,
            allocations,
        })
    }
}

/// What to create: a provider, its limit and optionally its parent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewProvider {
    pub(crate) id: ProviderId,
    pub(crate) limit: i64,
    pub(crate) parent: Option<ProviderId>,
}

impl NewProvider {
    /// A root provider with `limit`.
    pub fn new(id: impl Into<ProviderId>, limit: i64) -> NewProvider {
        NewProvider {
            id: id.into(),
            limit,
            parent: None,
        }
    }

    /// Makes every consumption of this provider consume from `parent` (and its ancestors) too.
    pub fn parent(mut self, parent: impl Into<ProviderId>) -> NewProvider {
        self.parent = Some(parent.into());
        self
    }
}

/// A consumer's request for amounts from one or more providers. Its id makes it idempotent:
/// consume (or reserve) the same `Request` again, for instance after a network error, and it
/// counts once. Clones share that identity.
#[derive(Debug, Clone)]
pub struct Request {
    pub(crate) consumer: String,
    pub(crate) id: String,
    pub(crate) claims: Vec<(ProviderId, i64)>,
    /// Whether a copy of this request may be in flight unseen: the caller chose the id (so an
    /// earlier process may have sent it), or one of our sends ended without a reply.
    pub(crate) maybe_in_flight: Arc<AtomicBool>,
}

impl Request {
    /// A request by `consumer` with a fresh, unique id.
    pub fn new(consumer: impl Into<String>) -> Request {
        Request {
            consumer: consumer.into(),
            id: ObjectId::new().to_hex(),
            claims: Vec::new(),
            maybe_in_flight: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A request by `consumer` under an id the caller keeps (for instance in its own database),
    /// so that a retry from another process still counts once.
    pub fn with_id(consumer: impl Into<String>, id: impl Into<String>) -> Request {
        Request {
            consumer: consumer.into(),
            id: id.into(),
            claims: Vec::new(),
            maybe_in_flight: Arc::new(AtomicBool::new(true)),
        }
    }

    /// Adds `amount` of `provider` to the request.
    pub fn take(mut self, provider: impl Into<ProviderId>, amount: i64) -> Request {
        self.claims.push((provider.into(), amount));
        self
    }

    /// The consumer.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The request id (the idempotency key).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The (provider, amount) pairs, in the order given.
    pub fn claims(&self) -> &[(ProviderId, i64)] {
        &self.claims
    }

    pub(crate) fn in_flight(&self) -> bool {
        self.maybe_in_flight.load(Ordering::Relaxed)
    }

    pub(crate) fn mark_in_flight(&self) {
        self.maybe_in_flight.store(true, Ordering::Relaxed);
    }
}

/// The result of a consume.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Consumed {
    /// The consumer.
    pub consumer: String,
    /// The request id.
    pub request: String,
    /// The request had already been applied (a retry); nothing was taken twice.
    pub replayed: bool,
    /// Conditional writes sent; 1 on the single-provider happy path.
    pub writes: u32,
    /// Times the request was re-read and retried because a provider changed in a way that
    /// mattered (only the multi-provider path, which checks generations, has those).
    pub retries: u32,
    /// The request's own claims, so that [`Quota::release_consumed`](crate::quota::Quota::release_consumed)
    /// can go straight to the providers holding it.
    pub(crate) claims: Vec<(ProviderId, i64)>,
}

/// What a release or cancel returned.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Released {
    /// The consumer.
    pub consumer: String,
    /// Amount returned to each provider (ancestors included), in provider order.
    pub returned: Vec<(ProviderId, i64)>,
}

/// A reservation: quota held until it is confirmed, cancelled, or expires and the GC returns it.
/// Two reservations are equal when they name the same request with the same expiry.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Reservation {
    /// The consumer.
    pub consumer: String,
    /// The request id it was made under.
    pub request: String,
    /// When it expires, in server time (whole milliseconds, as stored).
    pub expires: chrono::DateTime<chrono::Utc>,
    /// The request's claims when this handle made it (empty for one rebuilt from its ids), so
    /// that [`Quota::cancel`](crate::quota::Quota::cancel) can go straight to its provider.
    pub(crate) claims: Vec<(ProviderId, i64)>,
}

impl PartialEq for Reservation {
    fn eq(&self, other: &Reservation) -> bool {
        (&self.consumer, &self.request, self.expires)
            == (&other.consumer, &other.request, other.expires)
    }
}

impl Eq for Reservation {}

impl Reservation {
    /// A handle on a reservation known by its ids (for a process that persisted them).
    pub fn new(
        consumer: impl Into<String>,
        request: impl Into<String>,
        expires: chrono::DateTime<chrono::Utc>,
    ) -> Reservation {
        Reservation {
            consumer: consumer.into(),
            request: request.into(),
            expires,
            claims: Vec::new(),
        }
    }
}

/// What one quota sweep of the GC did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SweepSummary {
    /// Expired reservations returned.
    pub expired: u64,
    /// Provider documents (a striped provider has several) whose remembered released requests
    /// were forgotten.
    pub pruned: u64,
}
