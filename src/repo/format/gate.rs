//! The compatibility gate: which format a database writes, and who may switch it.
//!
//! MongoDB's `featureCompatibilityVersion` is the model, without a server of our own: the
//! database writes one format, kept in `mongotx_meta` (`{_id: "format", writes: N}`, absent: 1),
//! and every store announces there which formats it reads (`{_id: "instance:<id>", reads,
//! writes, seen, until, ...}`, on the server's clock). A new format is switched on by an
//! explicit call ([`Store::set_format`](crate::Store::set_format), `mongotx format set N`) once
//! every live instance reads it; one that does not is named in the refusal.
//!
//! A store reads the switched-on format, and announces itself, at most every refresh interval
//! while it writes; an announcement is live for [`LIVE_FOR`] intervals. The switch cannot be
//! atomic with the announcements (they are other documents), so an instance of an old release
//! that starts just as the switch lands may write its own format for up to one interval: harmless,
//! since every release reads the formats before its own. What keeps a new format from being
//! misread is not the gate but the check of every stored thing before it is acted on (see the
//! module above); the gate keeps the fleet from writing what some of it would have to refuse.

use std::time::Duration;

use bson::{doc, Bson, Document};
use futures::TryStreamExt;
use mongodb::options::UpdateOptions;
use serde::Serialize;

use crate::repo::format::state::INSTANCE_PREFIX;
use crate::repo::format::{check_doc, FormatError, FIELD, UNMARKED};
use crate::repo::store::Store;
use crate::server::codes;

/// The id of the document saying which format the database writes.
pub(crate) const FORMAT_ID: &str = "format";
/// How many refresh intervals an announcement stays live without a newer one.
pub(crate) const LIVE_FOR: u32 = 6;
/// How long an announcement that stopped being renewed stays listed before it is deleted.
const KEPT_FOR: Duration = Duration::from_secs(24 * 3600);

/// The database's format and the instances that announced themselves, for an operator.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct FormatStatus {
    /// The format the database writes (switched on with `set_format`; 1 if never switched).
    pub writes: i64,
    /// The newest format this process reads ([`FORMAT`](crate::format::FORMAT)).
    pub reads: i64,
    /// This process's announcement id.
    pub instance: String,
    /// Every announcement kept (live ones first, then by when they were last renewed, newest
    /// first).
    pub instances: Vec<Instance>,
}

/// One store's announcement: which formats it reads and writes, and when it last said so.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Instance {
    /// The announcement's id (`instance:<24 hex digits>`).
    pub id: String,
    /// The host it runs on, as it said.
    pub host: String,
    /// Its process id.
    pub pid: i64,
    /// The mongotx release it runs.
    pub release: String,
    /// The newest format it reads.
    pub reads: i64,
    /// The format it writes, as of its last announcement.
    pub writes: i64,
    /// When it last announced itself (server time).
    pub seen: chrono::DateTime<chrono::Utc>,
    /// Whether the announcement is still live (renewed within its interval).
    pub live: bool,
}

impl std::fmt::Display for Instance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (mongotx {} on {}, pid {}, reads format {})",
            self.id, self.release, self.host, self.pid, self.reads
        )
    }
}

/// The format `store` writes now, from its cache when that is fresh; refused when the database
/// writes a format this store does not read (an old release in a fleet that switched).
pub(crate) async fn writes(store: &Store) -> Result<i64, FormatError> {
    let gate = &store.inner.gate;
    if let Some(writes) = gate.fresh() {
        return Ok(writes);
    }
    announce(store).await?;
    let writes = switched_on(store).await?;
    gate.remember(Some(writes));
    if writes > gate.reads {
        return Err(FormatError::Newer {
            collection: store.meta().name().to_string(),
            id: FORMAT_ID.to_string(),
            found: writes,
            known: gate.reads,
        });
    }
    Ok(writes)
}

/// The format the database writes, read now.
async fn switched_on(store: &Store) -> Result<i64, FormatError> {
    let meta = store.meta();
    let found = meta
        .find_one(doc! { "_id": FORMAT_ID })
        .await
        .map_err(|e| FormatError::unavailable("reading the format the database writes", e))?;
    let Some(found) = found else {
        return Ok(UNMARKED);
    };
    check_doc(&found, store.inner.gate.reads, meta.name())?;
    match found.get("writes") {
        Some(Bson::Int64(n)) if *n >= 1 => Ok(*n),
        Some(Bson::Int32(n)) if *n >= 1 => Ok(i64::from(*n)),
        other => Err(FormatError::Unreadable {
            collection: meta.name().to_string(),
            id: FORMAT_ID.to_string(),
            value: other.map_or_else(|| "nothing".to_string(), Bson::to_string),
        }),
    }
}

/// Writes (or renews) this store's announcement, on the server's clock.
async fn announce(store: &Store) -> Result<(), FormatError> {
    let gate = &store.inner.gate;
    let meta = store.meta();
    let live_ms = i64::try_from((gate.refresh * LIVE_FOR).as_millis()).unwrap_or(i64::MAX);
    let writes = gate.last_known();
    let update = vec![doc! { "$set": {
        FIELD: writes,
        "reads": gate.reads,
        "writes": writes,
        "host": host(),
        "pid": i64::from(std::process::id()),
        "release": env!("CARGO_PKG_VERSION"),
        "started": { "$ifNull": ["$started", "$$NOW"] },
        "seen": "$$NOW",
        "until": { "$add": ["$$NOW", live_ms] },
    } }];
    let written = meta
        .update_one(doc! { "_id": gate.id() }, update)
        .with_options(UpdateOptions::builder().upsert(true).build())
        .await;
    match written {
        Ok(_) => {}
        // A store whose user may only read writes nothing, so it has nothing to announce.
        Err(e) if codes::error_code(&e) == Some(codes::UNAUTHORIZED) => return Ok(()),
        Err(e) => return Err(FormatError::unavailable("announcing this instance", e)),
    }
    let first = gate
        .announced
        .lock()
        .map(|mut announced| !std::mem::replace(&mut *announced, true))
        .unwrap_or(false);
    if first {
        let kept_ms = i64::try_from(KEPT_FOR.as_millis()).unwrap_or(i64::MAX);
        let stale = doc! {
            "_id": { "$regex": format!("^{INSTANCE_PREFIX}") },
            "$expr": { "$lt": ["$until", { "$subtract": ["$$NOW", kept_ms] }] },
        };
        if let Err(e) = meta.delete_many(stale).await {
            tracing::debug!(error = %e, "deleting stale announcements failed; left for later");
        }
    }
    Ok(())
}

/// Deletes this store's announcement (a store shutting down is no longer live).
pub(crate) async fn retract(store: &Store) {
    let gate = &store.inner.gate;
    let announced = gate.announced.lock().map(|a| *a).unwrap_or(true);
    if !announced {
        return;
    }
    if let Err(e) = store.meta().delete_one(doc! { "_id": gate.id() }).await {
        tracing::debug!(error = %e, "retracting this instance's announcement failed; it lapses");
    }
}

/// The database's format and every announcement kept.
pub(crate) async fn status(store: &Store) -> Result<FormatStatus, FormatError> {
    let writes = switched_on(store).await?;
    let instances = instances(store).await?;
    Ok(FormatStatus {
        writes,
        reads: store.inner.gate.reads,
        instance: store.inner.gate.id(),
        instances,
    })
}

/// Every announcement kept, live ones first.
async fn instances(store: &Store) -> Result<Vec<Instance>, FormatError> {
    let meta = store.meta();
    let filter = doc! { "_id": { "$regex": format!("^{INSTANCE_PREFIX}") } };
    let listing = vec![
        doc! { "$match": filter },
        doc! { "$addFields": { "live": { "$gt": ["$until", "$$NOW"] } } },
        doc! { "$sort": { "live": -1, "seen": -1, "_id": 1 } },
    ];
    let found: Vec<Document> = meta
        .aggregate(listing)
        .await
        .map_err(|e| FormatError::unavailable("listing the instances", e))?
        .try_collect()
        .await
        .map_err(|e| FormatError::unavailable("listing the instances", e))?;
    found
        .iter()
        .map(|d| {
            check_doc(d, store.inner.gate.reads, meta.name())?;
            Ok(instance(d))
        })
        .collect()
}

fn instance(found: &Document) -> Instance {
    let long = |name: &str| match found.get(name) {
        Some(Bson::Int64(n)) => *n,
        Some(Bson::Int32(n)) => i64::from(*n),
        _ => 0,
    };
    let text = |name: &str| found.get_str(name).unwrap_or("?").to_string();
    Instance {
        id: text("_id"),
        host: text("host"),
        pid: long("pid"),
        release: text("release"),
        reads: long("reads"),
        writes: long("writes"),
        seen: found
            .get_datetime("seen")
            .map(|d| d.to_chrono())
            .unwrap_or_default(),
        live: found.get_bool("live").unwrap_or(false),
    }
}

/// Why a switch to `format` is refused, if it is: the live instances that do not read it.
pub(crate) enum Switch {
    /// Switched (or already so).
    Done(FormatStatus),
    /// A live instance does not read the format.
    Behind(Vec<Instance>),
}

/// Switches the database to write `format`, if every live instance reads it.
pub(crate) async fn switch(store: &Store, format: i64) -> Result<Switch, FormatError> {
    // Announced first, so that a store switching counts itself among the live ones.
    announce(store).await?;
    let behind: Vec<Instance> = instances(store)
        .await?
        .into_iter()
        .filter(|i| i.live && i.reads < format)
        .collect();
    if !behind.is_empty() {
        return Ok(Switch::Behind(behind));
    }
    let update = vec![doc! { "$set": {
        FIELD: format,
        "writes": format,
        "changed": "$$NOW",
    } }];
    store
        .meta()
        .update_one(doc! { "_id": FORMAT_ID }, update)
        .with_options(UpdateOptions::builder().upsert(true).build())
        .await
        .map_err(|e| FormatError::unavailable("switching the format", e))?;
    store.inner.gate.remember(None);
    Ok(Switch::Done(status(store).await?))
}

/// The host name, for an operator reading the announcements.
fn host() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".to_string())
}
