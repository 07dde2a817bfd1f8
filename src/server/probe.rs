//! Judges a server on every behaviour mongotx relies on, and refuses one that lacks a needed one.
//!
//! Everything in this crate rests on a few single-document guarantees (a duplicate `_id` refused,
//! conditional updates and find-and-modify atomic under contention, the server telling its time)
//! and on a handful of server behaviours the protocol uses (`$expr` and `$$NOW` in filters,
//! pipeline updates and their upserts, one `$$NOW` per statement, numeric `_id` equality,
//! findAndModify with a pipeline). Others only cost a feature or fidelity when lacking
//! (validators and their details, comparison order, `$inc` overflow, the shape of errors, `let`,
//! MongoDB 8.0's `bulkWrite`). [`verdict`] judges each on its own ([`crate::server::semantics`]),
//! so an unsuitable server gets a table saying what it lacks, what it does instead and which
//! fallback mongotx takes; [`probe`] refuses a server that lacks a needed one, with the sentence
//! the verdict prints for it.

use std::sync::atomic::Ordering;

use bson::{doc, oid::ObjectId, Document};
use mongodb::{Collection, Database};
use thiserror::Error;

use crate::error_kind::ErrorKind;
use crate::server::clock::{self, Topology};
use crate::server::codes::{error_code, VALIDATION_FAILED};
use crate::server::semantics::{self, Contention, Semantic};
use crate::server::summarize;

/// What the probe found out about a server that passed it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerCapabilities {
    /// The version string the server reports, if it answers `buildInfo`.
    pub version: Option<String>,
    /// Standalone, replica set or sharded, from the server's `hello` reply.
    pub topology: Topology,
    /// Whether the server enforces `$jsonSchema` collection validators.
    pub json_schema_validation: bool,
    /// Whether the server runs `bulkWrite` (MongoDB 8.0+) and reports each of its writes, so that
    /// a round of protocol writes can go in one message (see `StoreBuilder::batch_writes`).
    pub bulk_write: bool,
    /// How many concurrent callers ran each atomicity check.
    pub contention_tasks: usize,
    /// How many compare-and-set attempts lost the race and retried (shows the check contended).
    pub contention_retries: u64,
    /// Every relied-on behaviour checked, held or not (the needed ones all held, or the probe
    /// would have refused the server).
    pub semantics: Vec<Semantic>,
}

/// Every relied-on behaviour of a server, each judged on its own: what `mongotx-probe` prints.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Verdict {
    /// The version string the server reports, if it answers `buildInfo`.
    pub version: Option<String>,
    /// Standalone, replica set or sharded, from the server's `hello` reply.
    pub topology: Topology,
    /// How many concurrent callers ran each atomicity check.
    pub contention_tasks: usize,
    /// How many compare-and-set attempts lost the race and retried (shows the check contended).
    pub contention_retries: u64,
    /// One row per behaviour: the needed ones first, then those mongotx can do without.
    pub behaviours: Vec<Semantic>,
}

impl Verdict {
    /// Whether mongotx can run on the server: no needed behaviour is lacking.
    pub fn suitable(&self) -> bool {
        self.refusal().is_none()
    }

    /// The first needed behaviour the server lacks, as the error the probe refuses it with.
    pub fn refusal(&self) -> Option<ProbeError> {
        self.behaviours
            .iter()
            .find(|s| s.refusal().is_some())
            .map(|s| ProbeError::Lacks {
                name: s.name,
                what: s.what,
                detail: s.evidence.clone(),
            })
    }

    /// Whether the behaviour named `name` held.
    pub fn holds(&self, name: &str) -> bool {
        self.behaviours.iter().any(|s| s.name == name && s.holds())
    }
}

/// A needed behaviour the server lacks, or a failure while checking.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// The server lacks a behaviour mongotx cannot do without (the sentence is the one the
    /// verdict prints and a `Store` refuses the server with).
    #[error("{}", semantics::refusal(name, what, detail))]
    Lacks {
        /// The behaviour's short name (see [`Semantic::name`]).
        name: &'static str,
        /// What it is.
        what: &'static str,
        /// What the server did instead.
        detail: String,
    },
    /// The server could not be asked: a check's command failed otherwise than by the server's
    /// answer (no connection, a timeout, no privilege).
    #[error(
        "server probe step `{step}` failed on collection {collection}: {}",
        summarize(source)
    )]
    Database {
        /// Which check was running.
        step: &'static str,
        /// The scratch collection used.
        collection: String,
        /// The driver error.
        #[source]
        source: mongodb::error::Error,
    },
}

impl ProbeError {
    /// What kind of failure this is: [`ErrorKind::Unsupported`] for a property the server lacks,
    /// [`ErrorKind::Unavailable`] for a failure while checking.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ProbeError::Database { .. } => ErrorKind::Unavailable,
            _ => ErrorKind::Unsupported,
        }
    }

    /// Whether probing again may succeed (only a transient failure while checking).
    pub fn is_retryable(&self) -> bool {
        matches!(self, ProbeError::Database { source, .. } if crate::server::is_transient(source))
    }
}

/// How many concurrent callers [`probe`] runs each atomicity check with, and what `verdict` and
/// `mongotx-probe --tasks` are usually given: a lost update under contention shows only when
/// callers race, and this many race on every server tried while the probe stays a few seconds.
pub const DEFAULT_CONTENTION_TASKS: usize = 64;

/// Probes the server behind `db` with the default contention level; refuses it when it lacks a
/// needed behaviour.
pub async fn probe(db: &Database) -> Result<ServerCapabilities, ProbeError> {
    probe_with(db, DEFAULT_CONTENTION_TASKS).await
}

/// Probes the server behind `db`, running each atomicity check with `tasks` concurrent callers;
/// refuses it when it lacks a needed behaviour (the first, in the verdict's order).
pub async fn probe_with(db: &Database, tasks: usize) -> Result<ServerCapabilities, ProbeError> {
    let verdict = verdict(db, tasks).await?;
    if let Some(refused) = verdict.refusal() {
        return Err(refused);
    }
    Ok(ServerCapabilities {
        json_schema_validation: verdict.holds("json_schema_validation"),
        bulk_write: verdict.holds("bulk_write"),
        version: verdict.version,
        topology: verdict.topology,
        contention_tasks: verdict.contention_tasks,
        contention_retries: verdict.contention_retries,
        semantics: verdict.behaviours,
    })
}

/// Judges every behaviour mongotx relies on, each on its own, on the server behind `db` (in
/// scratch collections it drops after), running each atomicity check with `tasks` concurrent
/// callers. An error only when the server could not be asked at all; a server lacking behaviours
/// gets a [`Verdict`] saying which.
pub async fn verdict(db: &Database, tasks: usize) -> Result<Verdict, ProbeError> {
    let name = format!("mongotx_probe_{}", ObjectId::new().to_hex());
    let contention = Contention::new(tasks);
    let found = semantics::all(db, &name, &contention).await;
    // Best effort: a leftover scratch collection is harmless and must not mask the verdict.
    if let Ok(names) = db.list_collection_names().await {
        for leftover in names.iter().filter(|n| n.starts_with(&name)) {
            let _ = db.collection::<Document>(leftover).drop().await;
        }
    }
    let unasked = |step: &'static str, source| ProbeError::Database {
        step,
        collection: name.clone(),
        source,
    };
    let behaviours = found.map_err(|u| unasked(u.check, u.source))?;
    let hello = clock::hello(db)
        .await
        .map_err(|source| unasked("hello", source))?;
    let version = build_version(db).await;
    Ok(Verdict {
        version,
        topology: hello.topology,
        contention_tasks: contention.tasks,
        contention_retries: contention.retries.load(Ordering::Relaxed),
        behaviours,
    })
}

/// The version string the server reports, if it answers `buildInfo`.
pub(crate) async fn build_version(db: &Database) -> Option<String> {
    db.run_command(doc! { "buildInfo": 1 })
        .await
        .ok()
        .and_then(|d| d.get_str("version").ok().map(str::to_string))
}

/// Whether the server enforces a `$jsonSchema` validator (some accept and silently ignore it).
pub async fn validator_support(db: &Database) -> bool {
    let name = format!("mongotx_probe_validator_{}", ObjectId::new().to_hex());
    let created = db
        .run_command(doc! {
            "create": &name,
            "validator": { "$jsonSchema": { "bsonType": "object", "required": ["must"] } },
        })
        .await;
    if created.is_err() {
        return false;
    }
    let coll: Collection<Document> = db.collection(&name);
    let enforced = match coll.insert_one(doc! { "other": 1 }).await {
        Ok(_) => false,
        Err(e) => error_code(&e) == Some(VALIDATION_FAILED),
    };
    let _ = coll.drop().await;
    enforced
}
