//! What an operator asks about an OBT ([`Obt::report`], and [`inspect`] without a handle): its
//! owner, stage and token, its lease by the server's clock, or the tombstone a release left.

use serde::Serialize;

use crate::obt::checks;
use crate::obt::error::ObtError;
use crate::obt::steps::{self, Stored};
use crate::obt::{Obt, ObtOptions};
use crate::repo::store::Store;
use crate::server::clock;

/// An OBT as an operator sees it: live (its owner, stage, token and lease) or released (the
/// tombstone keeps the owner that released it and its last token).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ObtReport {
    /// The OBT id.
    pub id: String,
    /// The collection (the token namespace) it is kept in.
    pub collection: String,
    /// The server's time the lease is judged by (this process's estimate of it).
    pub now: chrono::DateTime<chrono::Utc>,
    /// Whether it was released (what follows is then its tombstone's).
    pub released: bool,
    /// Its owner (for a released OBT, the owner that released it).
    pub owner: Option<String>,
    /// The owner's progress.
    pub stage: Option<i64>,
    /// The fencing token of the ownership (a released OBT keeps its last one; a new create of
    /// the id gets a higher one).
    pub token: i64,
    /// The document version (live OBTs): moves on every change, heartbeats included.
    pub version: Option<i64>,
    /// How long the owner may stay silent, in milliseconds; `None` without a lease (only an
    /// explicit preemption takes it over).
    pub lease_ms: Option<u64>,
    /// The owner's last sign of life, by the server's clock.
    pub beat_at: Option<chrono::DateTime<chrono::Utc>>,
    /// When the lease runs out without a heartbeat (`beat_at` + lease): from then a contender
    /// may take the OBT over (`take_over_expired` once the collection's clock slack has passed
    /// too).
    pub lease_until: Option<chrono::DateTime<chrono::Utc>>,
    /// `lease_until - now` in milliseconds, 0 once it has passed.
    pub lease_left_ms: Option<u64>,
    /// Whether the lease has run out at `now`.
    pub lease_expired: Option<bool>,
    /// When it was released, by the server's clock.
    pub released_at: Option<chrono::DateTime<chrono::Utc>>,
    /// The transaction holding its document, if one does: an owned commit in flight (its guard),
    /// or one left by a crashed owner for the GC.
    pub held_by: Option<String>,
}

/// Reads OBT `id` of `collection` in `store`'s database as [`Obt::report`] does, without
/// opening the collection: nothing is created or written (the `mongotx obt` command reads this
/// way). An id never used is [`ObtError::NotFound`].
pub async fn inspect(store: &Store, collection: &str, id: &str) -> Result<ObtReport, ObtError> {
    Obt::unopened(store, ObtOptions::default().collection(collection))?
        .report(id)
        .await
}

/// The body of [`Obt::report`].
pub(crate) async fn report(obt: &Obt, id: &str) -> Result<ObtReport, ObtError> {
    checks::check_name(obt, "OBT id", id)?;
    let stored = steps::stored(obt, id).await?;
    let now = obt.store.now().await.map_err(|source| {
        ObtError::from(crate::repo::error::RepoError::Clock {
            collection: checks::coll(obt),
            source,
        })
    })?;
    let mut report = ObtReport {
        id: id.to_string(),
        collection: checks::coll(obt),
        now: now.to_chrono(),
        released: false,
        owner: None,
        stage: None,
        token: 0,
        version: None,
        lease_ms: None,
        beat_at: None,
        lease_until: None,
        lease_left_ms: None,
        lease_expired: None,
        released_at: None,
        held_by: None,
    };
    match stored {
        Stored::Absent => return Err(checks::not_found(obt, id)),
        Stored::Released {
            owner,
            token,
            holder,
            at,
            stage,
        } => {
            report.released = true;
            report.owner = owner;
            report.stage = stage;
            report.token = token.0;
            report.released_at = at.map(bson::DateTime::to_chrono);
            report.held_by = holder.map(|h| h.to_hex());
        }
        Stored::Live(state, holder) => {
            let lease = state.lease;
            let beat_at = state.beat_at.map(bson::DateTime::from_chrono);
            let until = beat_at
                .zip(lease)
                .map(|(beat, lease)| clock::plus(beat, lease));
            let left = until.map(|u| u.timestamp_millis() - now.timestamp_millis());
            report.owner = Some(state.owner);
            report.stage = Some(state.stage);
            report.token = state.token.0;
            report.version = Some(state.version);
            report.lease_ms = lease.map(|l| u64::try_from(l.as_millis()).unwrap_or(u64::MAX));
            report.beat_at = state.beat_at;
            report.lease_until = until.map(bson::DateTime::to_chrono);
            report.lease_left_ms = left.map(|ms| u64::try_from(ms.max(0)).unwrap_or(0));
            report.lease_expired = left.map(|ms| ms <= 0);
            report.held_by = holder.map(|h| h.to_hex());
        }
    }
    Ok(report)
}
