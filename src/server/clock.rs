//! The server's view of the world that every mongotx process must share: what the deployment is
//! (standalone, replica set, sharded) and what time it is.
//!
//! Expiry decisions compare a deadline written by one process with "now" as seen by another. If
//! each used its own wall clock, a host whose clock runs 30 s ahead would see every live
//! transaction as expired. So every deadline and every "now" in mongotx is in the *server's* time:
//! a process asks the server for its `localTime` (the `hello` reply carries it), and between two
//! samples it advances that reading by the elapsed time of its own monotonic clock, which no wall
//! clock adjustment can move. The error is bounded by half a round trip plus the drift of the
//! monotonic clock over the resample interval.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error_kind::ErrorKind;
use bson::{doc, DateTime, Document};
use mongodb::Database;
use tokio::sync::Mutex;

/// What kind of deployment a server belongs to, as its `hello` reply tells.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Topology {
    /// A single `mongod` (or a wire-compatible server) without replication.
    Standalone,
    /// A member of the named replica set.
    ReplicaSet {
        /// The replica set name.
        name: String,
    },
    /// A `mongos` router of a sharded cluster.
    Sharded,
}

impl Topology {
    /// Whether writes can be acknowledged by one node and then lost in a failover.
    pub fn is_replicated(&self) -> bool {
        !matches!(self, Topology::Standalone)
    }
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Topology::Standalone => f.write_str("standalone"),
            Topology::ReplicaSet { name } => write!(f, "replica set {name:?}"),
            Topology::Sharded => f.write_str("sharded cluster (mongos)"),
        }
    }
}

/// How durably the protocol's writes are acknowledged and how its deciding reads are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Durability {
    /// Majority on replica sets and sharded clusters, the server default on a standalone server.
    #[default]
    Auto,
    /// Always `w: "majority"` writes and `readConcern: "majority"` reads for the protocol.
    Majority,
    /// The client's defaults. On a replica set a failover may then lose an acknowledged commit
    /// point; only for deployments where that is acceptable.
    ClientDefault,
}

impl Durability {
    /// Whether protocol writes and deciding reads use majority, on `topology`.
    pub fn majority_on(self, topology: &Topology) -> bool {
        match self {
            Durability::Auto => topology.is_replicated(),
            Durability::Majority => true,
            Durability::ClientDefault => false,
        }
    }
}

/// The parts of a `hello` reply mongotx uses.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Hello {
    pub(crate) topology: Topology,
    pub(crate) local_time: Option<DateTime>,
}

impl Hello {
    /// Reads a `hello` (or legacy `isMaster`) reply.
    pub(crate) fn parse(reply: &Document) -> Hello {
        let topology = if reply.get_str("msg").ok() == Some("isdbgrid") {
            Topology::Sharded
        } else if let Ok(name) = reply.get_str("setName") {
            Topology::ReplicaSet {
                name: name.to_string(),
            }
        } else {
            Topology::Standalone
        };
        Hello {
            topology,
            local_time: reply.get_datetime("localTime").ok().copied(),
        }
    }
}

/// Sends `hello`, or `isMaster` to servers that do not know `hello` yet.
pub(crate) async fn hello(db: &Database) -> mongodb::error::Result<Hello> {
    match db.run_command(doc! { "hello": 1 }).await {
        Ok(reply) => Ok(Hello::parse(&reply)),
        Err(e) if crate::server::codes::error_code(&e).is_some() => db
            .run_command(doc! { "isMaster": 1 })
            .await
            .map(|reply| Hello::parse(&reply)),
        Err(e) => Err(e),
    }
}

/// Why the server's time could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClockError {
    /// The server could not be asked.
    #[error(
        "reading the server's time failed: {}",
        crate::server::summarize(source)
    )]
    Database {
        /// The driver error.
        #[source]
        source: Box<mongodb::error::Error>,
    },
    /// The server's `hello` reply carries no `localTime`.
    #[error("the server does not report its time (no localTime in its hello reply); mongotx decides expiry by the server's clock")]
    NoLocalTime,
}

impl ClockError {
    /// What kind of failure this is (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            ClockError::Database { .. } => ErrorKind::Unavailable,
            ClockError::NoLocalTime => ErrorKind::Unsupported,
        }
    }

    /// Whether asking again may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, ClockError::Database { source } if crate::server::is_transient(source))
    }
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Server time, in milliseconds, at the instant `taken`.
    server_ms: i64,
    taken: Instant,
    /// How far `server_ms` may be from the server's clock at `taken`: the server read its
    /// clock somewhere within the round trip, and `server_ms` assumes the middle.
    error_ms: i64,
}

/// The server's time as seen from this process (cheap to clone; clones share samples).
#[derive(Debug, Clone)]
pub struct ServerClock {
    sample: Arc<Mutex<Option<Sample>>>,
    resample: Duration,
}

impl Default for ServerClock {
    fn default() -> ServerClock {
        ServerClock::new(Duration::from_secs(30))
    }
}

impl ServerClock {
    /// A clock that asks the server again once its last sample is older than `resample`.
    pub fn new(resample: Duration) -> ServerClock {
        ServerClock {
            sample: Arc::new(Mutex::new(None)),
            resample,
        }
    }

    /// The server's current time, estimated from the last sample (one `hello` when it is stale).
    pub async fn now(&self, db: &Database) -> Result<DateTime, ClockError> {
        Ok(self.now_within(db).await?.0)
    }

    /// The server's current time, estimated as [`now`](ServerClock::now) does, and how far the
    /// estimate may be from the server's clock either way: half the round trip of the `hello`
    /// it was sampled with, and a millisecond for the server's whole milliseconds. (The drift of
    /// this process's monotonic clock over a resample interval is left out: a few parts per
    /// million.) The estimate is of the instant the call began, or later.
    pub(crate) async fn now_within(
        &self,
        db: &Database,
    ) -> Result<(DateTime, Duration), ClockError> {
        let mut sample = self.sample.lock().await;
        let fresh = match *sample {
            Some(s) if s.taken.elapsed() < self.resample => s,
            _ => {
                let s = Self::take(db).await?;
                *sample = Some(s);
                s
            }
        };
        let error = Duration::from_millis(u64::try_from(fresh.error_ms).unwrap_or(0));
        Ok((advance(fresh), error))
    }

    async fn take(db: &Database) -> Result<Sample, ClockError> {
        let sent = Instant::now();
        let hello = hello(db).await.map_err(|source| ClockError::Database {
            source: Box::new(source),
        })?;
        let taken = Instant::now();
        let local = hello.local_time.ok_or(ClockError::NoLocalTime)?;
        // The server read its clock somewhere within the round trip: assume the middle.
        let trip = taken.duration_since(sent).as_millis();
        let half_trip = i64::try_from(trip / 2).unwrap_or(0);
        // Rounded up, and the millisecond the server's reading may have lost.
        let error_ms = i64::try_from(trip.div_ceil(2))
            .unwrap_or(i64::MAX)
            .saturating_add(1);
        Ok(Sample {
            server_ms: local.timestamp_millis().saturating_add(half_trip),
            taken,
            error_ms,
        })
    }
}

fn advance(sample: Sample) -> DateTime {
    let elapsed = i64::try_from(sample.taken.elapsed().as_millis()).unwrap_or(i64::MAX);
    DateTime::from_millis(sample.server_ms.saturating_add(elapsed))
}

/// `at` plus `by`, saturating.
pub(crate) fn plus(at: DateTime, by: Duration) -> DateTime {
    let ms = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
    DateTime::from_millis(at.timestamp_millis().saturating_add(ms))
}

/// `at` minus `by`, saturating.
pub(crate) fn minus(at: DateTime, by: Duration) -> DateTime {
    let ms = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
    DateTime::from_millis(at.timestamp_millis().saturating_sub(ms))
}

/// `to` minus `from`, or zero when `to` is not later: how long ago, or how long until.
pub(crate) fn between(from: DateTime, to: DateTime) -> Duration {
    let ms = to
        .timestamp_millis()
        .saturating_sub(from.timestamp_millis());
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// `at` in RFC 3339, UTC, to the millisecond (`2026-11-27T10:00:12.345Z`): how reports and
/// messages show a server time, so that a person reads one format everywhere.
pub(crate) fn rfc3339(at: DateTime) -> String {
    at.to_chrono()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// A duration for people, to two units at most: `850ms`, `4.2s`, `12s`, `3m 12s`, `2h 5m`,
/// `3d 4h`.
pub(crate) fn span(d: Duration) -> String {
    let secs = d.as_secs();
    match secs {
        0 => format!("{}ms", d.as_millis()),
        1..=9 => format!("{:.1}s", d.as_secs_f64()),
        10..=59 => format!("{secs}s"),
        60..=3_599 => format!("{}m {}s", secs / 60, secs % 60),
        3_600..=86_399 => format!("{}h {}m", secs / 3_600, secs % 3_600 / 60),
        _ => format!("{}d {}h", secs / 86_400, secs % 86_400 / 3_600),
    }
}

/// `at` in RFC 3339 with how far it is from `now`: `... (in 12s)`, `... (3m 5s ago)`.
pub(crate) fn relative(at: DateTime, now: DateTime) -> String {
    if at > now {
        format!("{} (in {})", rfc3339(at), span(between(now, at)))
    } else {
        format!("{} ({} ago)", rfc3339(at), span(between(at, now)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_replies_name_the_topology() {
        let standalone =
            Hello::parse(&doc! { "ismaster": true, "localTime": DateTime::from_millis(5) });
        assert_eq!(standalone.topology, Topology::Standalone);
        assert_eq!(standalone.local_time, Some(DateTime::from_millis(5)));
        let member = Hello::parse(&doc! { "isWritablePrimary": true, "setName": "rs0" });
        assert_eq!(member.topology, Topology::ReplicaSet { name: "rs0".into() });
        assert_eq!(member.local_time, None);
        assert_eq!(
            Hello::parse(&doc! { "msg": "isdbgrid" }).topology,
            Topology::Sharded
        );
    }

    #[test]
    fn majority_follows_the_topology_unless_told() {
        let rs = Topology::ReplicaSet { name: "rs".into() };
        assert!(Durability::Auto.majority_on(&rs));
        assert!(Durability::Auto.majority_on(&Topology::Sharded));
        assert!(!Durability::Auto.majority_on(&Topology::Standalone));
        assert!(Durability::Majority.majority_on(&Topology::Standalone));
        assert!(!Durability::ClientDefault.majority_on(&rs));
    }

    #[test]
    fn times_and_spans_read_the_same_everywhere() {
        let at = DateTime::from_millis(1_795_000_000_123);
        assert_eq!(rfc3339(at), "2026-11-18T11:06:40.123Z");
        assert_eq!(span(Duration::from_millis(850)), "850ms");
        assert_eq!(span(Duration::from_millis(4_250)), "4.2s");
        assert_eq!(span(Duration::from_secs(192)), "3m 12s");
        assert_eq!(span(Duration::from_secs(7_500)), "2h 5m");
        assert_eq!(span(Duration::from_secs(3 * 86_400 + 4 * 3_600)), "3d 4h");
        let later = plus(at, Duration::from_secs(12));
        assert_eq!(relative(later, at), "2026-11-18T11:06:52.123Z (in 12s)");
        assert_eq!(relative(at, later), "2026-11-18T11:06:40.123Z (12s ago)");
        assert_eq!(between(later, at), Duration::ZERO);
    }

    #[test]
    fn estimates_advance_with_the_monotonic_clock() {
        let past = Sample {
            server_ms: 1_000,
            taken: Instant::now() - Duration::from_millis(250),
            error_ms: 1,
        };
        let now = advance(past).timestamp_millis();
        assert!((1_250..1_400).contains(&now), "{now}");
    }
}
