//! mongotx: all-or-nothing multi-document changes, optimistic locking, soft deletes and schema
//! versions on MongoDB, built only on single-document atomic operations, so they work the same on
//! a standalone `mongod`, a replica set, a sharded cluster, or a wire-compatible server without
//! native transactions.
//!
//! # What to reach for
//!
//! The crate root holds what every user needs: a [`Store`] on a database opens typed
//! [`Repository`] handles on collections described by a [`CollectionSpec`] (every document
//! carries the system [`fields`]; reads return [`Stamped`] values); writes take an [`Update`] or
//! an [`Adjust`] at an expected version; [`Query`] finds committed values; [`Transactions`]
//! stages and commits multi-document [`Transaction`]s, whose [`Outcome`] lists what was
//! [`Written`]; a [`GcRunner`] resolves what dead coordinators left behind; [`Store::shutdown`]
//! waits for background work when a service stops ([`Shutdown`]). Every module's error converts
//! into [`Error`], whose [`ErrorKind`] reads the same whichever module failed, and [`Result`]
//! defaults to it; [`RepoError`] and [`TxnError`] are the errors of the root's handles.
//!
//! Everything else is in a module named for what it is:
//!
//! - [`options`]: the settings of the store and of transactions;
//! - [`schema`]: JSON Schemas, their violations, schema versions and upgrades;
//! - [`gc`]: one GC round at a time, its options and summaries;
//! - [`admin`]: what is stored, explained (the `mongotx` admin command's library): the status
//!   of a database, why a document is held, one transaction, settling an expired one by hand;
//! - [`adopt`]: taking existing (plain) documents under mongotx;
//! - [`server`]: the probe of a server's guarantees, its verdict, the deployment's topology;
//! - [`admin`]: reading what mongotx keeps about itself (the contention record), writing nothing;
//! - [`collections`]: every collection mongotx keeps records in by default;
//! - [`metrics`]: every metric mongotx records through the `metrics` facade (for the exporter a
//!   service installs), with what it counts; the operations run in `tracing` spans named
//!   `mongotx.<module>.<operation>`;
//! - the four coordination modules, built on the above: [`quota`] (limits shared by every
//!   instance of a service), [`obt`] (one owner at a time for a long operation, with fencing
//!   tokens and leases), [`ratelimit`] (N calls in any interval of W, with reservations,
//!   priorities and all-or-nothing grants across limiters) and [`queue`] (ordered per-service
//!   submission of batches to a ledger, one at a time per service);
//! - `testkit` (feature `testkit`, off by default): the test rig, a test server, fault
//!   injection, simulators and model explorers; the crate's own tests and examples use it.
//!
//! How the source is laid out (the layers beneath these names) is in `docs/layout.md`.
//!
//! # Example
//!
//! ```no_run
//! use mongotx::{Adjust, CollectionSpec, Store, Transactions};
//! # #[derive(serde::Serialize, serde::Deserialize)]
//! # struct Account { #[serde(rename = "_id")] id: String, balance: i64 }
//! # async fn demo(client: mongodb::Client, schema: &str) -> Result<(), Box<dyn std::error::Error>> {
//! let store = Store::new(client.database("bank"));
//! let accounts = store
//!     .repository::<Account>(CollectionSpec::new("accounts", 1, schema)?)
//!     .await?;
//! accounts.insert(&Account { id: "alice".into(), balance: 100 }).await?;
//! let alice = accounts.get("alice").await?;
//! accounts
//!     .adjust("alice", alice.version, &Adjust::new().by("balance", -30_i64))
//!     .await?;
//!
//! let txns = Transactions::new(&store);
//! let tx = txns.begin();
//! let alice = accounts.get("alice").await?;
//! tx.adjust(&accounts, "alice", alice.version, &Adjust::new().by("balance", -5_i64)).await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// The unit tests use the rig (the protocol models run on `testkit::explore`); the crate's
// dev-dependency on itself turns the feature on, so this fires only if that line goes.
#[cfg(all(test, not(feature = "testkit")))]
compile_error!("the unit tests need the `testkit` feature (see the dev-dependencies)");

pub mod collections;
mod error;
mod error_kind;
pub mod metrics;
pub mod obt;
pub mod queue;
pub mod quota;
pub mod ratelimit;
mod repo;
mod retry;
mod runner;
pub mod server;
#[cfg(feature = "testkit")]
#[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
pub mod testkit;
mod txn;

// The README's code blocks compile as doc tests, so that its example stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

pub use error::{Error, Result};
pub use error_kind::ErrorKind;
#[doc(inline)]
pub use repo::background::Shutdown;
#[doc(inline)]
pub use repo::changes::{Adjust, Update};
#[doc(inline)]
pub use repo::collection::CollectionSpec;
#[doc(inline)]
pub use repo::error::RepoError;
pub use repo::fields;
#[doc(inline)]
pub use repo::find::Query;
#[doc(inline)]
pub use repo::repository::{Repository, Stamped};
#[doc(inline)]
pub use repo::store::{Store, StoreBuilder};
#[doc(inline)]
pub use runner::GcRunner;
#[doc(inline)]
pub use txn::error::TxnError;
#[doc(inline)]
pub use txn::transaction::{Outcome, Transaction, Transactions, Written};

/// The settings of a [`Store`] and of [`Transactions`]: how long writers wait for a held
/// document, when a commit frees its documents, the write and read concerns, the validators.
/// (The domain modules keep their own options: `quota::QuotaOptions`, `obt::ObtOptions`, ...)
pub mod options {
    #[doc(inline)]
    pub use crate::repo::store::ServerValidation;
    #[doc(inline)]
    pub use crate::retry::LockWait;
    #[doc(inline)]
    pub use crate::server::clock::Durability;
    #[doc(inline)]
    pub use crate::txn::transaction::{Finish, TxnOptions};
}

/// Collection definitions beyond [`CollectionSpec`]: the JSON Schemas mongotx checks documents
/// against (the server checks them too where it can), their violations, and schema-version
/// upgrades.
pub mod schema {
    #[doc(inline)]
    pub use crate::repo::collection::{SpecError, UpgradeStep};
    #[doc(inline)]
    pub use crate::repo::schema::{BsonType, JsonSchema, SchemaError, Violation};
}

/// The GC, one round at a time ([`Gc`](crate::gc::Gc)) or on an interval ([`GcRunner`]): it
/// finishes or rolls back what dead coordinators left behind and purges old tombstones.
pub mod gc {
    #[doc(inline)]
    pub use crate::repo::outcome::HoldError;
    #[doc(inline)]
    pub use crate::runner::GcPass;
    #[doc(inline)]
    pub use crate::txn::gc::{Gc, GcOptions, RoundSummary};
}

/// Looking at what mongotx is doing in a database from the stored data alone, as the `mongotx`
/// admin command does. An [`Inspector`](crate::admin::Inspector) opened from a [`Store`] says
/// what holds a document and what happens next, reports a transaction or the whole database, and
/// settles an expired transaction as the GC would (the one thing here that writes).
/// [`contention`](crate::admin::contention) ranks collections by the conflicts and aborts every
/// instance counted (see [`StoreBuilder::contention_record`]). The coordination modules' states
/// are read by their own `inspect` functions, which open (and write) nothing:
/// [`quota::inspect`], [`ratelimit::inspect`], [`queue::inspect`], [`obt::inspect`]. Every report
/// derives `Serialize` (times in RFC 3339, durations in milliseconds).
pub mod admin {
    #[doc(inline)]
    pub use crate::repo::contention::{
        contention, CollectionContention, ContentionReport, SampledDocument, CONTENTION_SCHEMA,
    };
    #[doc(inline)]
    pub use crate::repo::hold::record::TxnState;
    #[doc(inline)]
    pub use crate::txn::inspect::{
        Action, ClaimedRecord, CommittedValue, DocState, DocumentState, Expired, Explanation,
        GcClaim, HeldCount, HoldInfo, Inspector, Next, Readers, RecordInfo, Resolved, ServerLine,
        Settlement, StateCount, Status, TxnReport, CLAIMS_LISTED,
    };
}

/// The version of what mongotx stores, so that two releases share a database through a rolling
/// upgrade: [`FORMAT`](crate::format::FORMAT) (the newest this release reads), the typed refusal of
/// anything newer ([`FormatError`](crate::format::FormatError)), and the gate's view of a database
/// ([`FormatStatus`](crate::format::FormatStatus): the format it writes and every instance's
/// announcement), switched with [`Store::set_format`] or `mongotx format set N`. docs/format.md
/// describes every stored field of every format.
pub mod format {
    #[doc(inline)]
    pub use crate::repo::format::{FormatError, FormatStatus, Instance, FIELD, FORMAT, UNMARKED};
}

/// Taking a collection of existing (plain) documents under mongotx: [`Store::adopt`] and the
/// `mongotx-adopt` command.
pub mod adopt {
    #[doc(inline)]
    pub use crate::repo::adopt::{AdoptOptions, AdoptProgress, AdoptRefusal, AdoptReport};
}
