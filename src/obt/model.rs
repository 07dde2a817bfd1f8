//! What the OBT module stores and what it hands to callers.

use std::fmt;
use std::time::{Duration, Instant};

use bson::DateTime;
use serde::{Deserialize, Serialize};

/// The JSON Schema of an OBT collection (the project's `schemas/obts.json`).
pub const OBTS_SCHEMA: &str = include_str!("../../schemas/obts.json");

/// The JSON Schema of [`TOKENS_COLLECTION`](crate::collections::TOKENS_COLLECTION) (the project's `schemas/obt_tokens.json`).
pub const TOKENS_SCHEMA: &str = include_str!("../../schemas/obt_tokens.json");

/// The JSON Schema of a fence collection (the project's `schemas/obt_fences.json`).
pub const FENCES_SCHEMA: &str = include_str!("../../schemas/obt_fences.json");

/// A fencing token: unique and strictly increasing across every OBT of a namespace and every
/// process, issued on create and on every preemption or take-over. Downstream resources admit a
/// token only if it is at least the highest they have seen (see [`Fence`](crate::obt::Fence)).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
#[serde(transparent)]
pub struct Token(pub i64);

impl Token {
    /// The number carried by downstream calls.
    pub fn get(self) -> i64 {
        self.0
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// An OBT as stored (system fields aside).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ObtDoc {
    #[serde(rename = "_id")]
    pub(crate) id: String,
    pub(crate) owner: String,
    pub(crate) stage: i64,
    pub(crate) token: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) lease_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) beat_at: Option<DateTime>,
}

/// An OBT as callers see it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ObtState {
    /// The OBT id (`t_id` in the reference design's HTTP interface).
    pub id: String,
    /// Its owner now (`t_owner` in the reference design's HTTP interface).
    pub owner: String,
    /// The owner's progress (`t_stage` in the reference design's HTTP interface).
    pub stage: i64,
    /// The fencing token of the current ownership.
    pub token: Token,
    /// How long the owner may stay silent before a contender may take over, if it holds a lease.
    pub lease: Option<Duration>,
    /// Server time of the owner's last sign of life.
    pub beat_at: Option<chrono::DateTime<chrono::Utc>>,
    /// The document version: moves on every change, heartbeats included.
    pub version: i64,
}

impl ObtState {
    pub(crate) fn from_stored(doc: ObtDoc, version: i64) -> ObtState {
        ObtState {
            id: doc.id,
            owner: doc.owner,
            stage: doc.stage,
            token: Token(doc.token),
            lease: doc.lease_ms.map(lease_of),
            beat_at: doc.beat_at.map(DateTime::to_chrono),
            version,
        }
    }
}

pub(crate) fn lease_of(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// What to create: an OBT owned by `owner` at stage 0, optionally with a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewObt {
    pub(crate) id: String,
    pub(crate) owner: String,
    pub(crate) lease: Option<Duration>,
}

impl NewObt {
    /// OBT `id` owned by `owner`; without a lease it changes hands only by explicit preemption.
    pub fn new(id: impl Into<String>, owner: impl Into<String>) -> NewObt {
        NewObt {
            id: id.into(),
            owner: owner.into(),
            lease: None,
        }
    }

    /// The owner keeps it alive with [`heartbeat`](crate::obt::Obt::heartbeat)s; after `lease`
    /// without one, a contender may take it over.
    pub fn lease(mut self, lease: Duration) -> NewObt {
        self.lease = Some(lease);
        self
    }
}

/// Proof of ownership: what an owner carries into heartbeats, fenced downstream calls (its
/// [`token`](Ownership::token)) and owned transactions.
#[derive(Debug, Clone, PartialEq)]
pub struct Ownership {
    /// The OBT id.
    pub id: String,
    /// Who owns it.
    pub owner: String,
    /// The fencing token of this ownership.
    pub token: Token,
    /// The stage when this handle was last updated.
    pub stage: i64,
    pub(crate) lease: Option<Duration>,
    /// When the lease runs out as this process sees it: the last successful heartbeat's send
    /// time plus the lease. A contender counts from a read that came after that send, so it
    /// cannot take over earlier.
    pub(crate) lease_until: Option<Instant>,
}

impl Ownership {
    pub(crate) fn new(state: ObtState, sent: Instant) -> Ownership {
        Ownership {
            lease_until: state.lease.map(|lease| sent + lease),
            id: state.id,
            owner: state.owner,
            token: state.token,
            stage: state.stage,
            lease: state.lease,
        }
    }

    /// How long this owner may still act before a contender may take over; `None` without a
    /// lease (only explicit preemption ends it). Fencing stays correct either way; this is for
    /// stopping early instead of being refused.
    pub fn lease_left(&self) -> Option<Duration> {
        self.lease_until
            .map(|until| until.saturating_duration_since(Instant::now()))
    }

    /// The lease this OBT carries.
    pub fn lease(&self) -> Option<Duration> {
        self.lease
    }
}

impl From<ObtState> for Ownership {
    /// Ownership as read, e.g. by an API server that has checked a caller's `t_owner` against
    /// the OBT: an owned transaction's guard still verifies it at the commit point. Its lease
    /// clock is unknown ([`lease_left`](Ownership::lease_left) is `None`).
    fn from(state: ObtState) -> Ownership {
        Ownership {
            id: state.id,
            owner: state.owner,
            token: state.token,
            stage: state.stage,
            lease: state.lease,
            lease_until: None,
        }
    }
}

/// A contender's reading of an OBT, the start of its own count towards a take-over.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// What it read.
    pub state: ObtState,
    /// When the read came back, on this process's monotonic clock.
    pub(crate) seen_at: Instant,
}

impl Observation {
    /// How long ago (monotonic) this reading was taken: if the OBT is unchanged since, its owner
    /// has been silent at least that long.
    pub fn silent_for(&self) -> Duration {
        self.seen_at.elapsed()
    }
}
