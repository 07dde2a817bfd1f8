//! mongotx: all-or-nothing multi-document changes, optimistic locking, soft deletes and schema
//! versions on MongoDB, built only on single-document atomic operations, so they work the same on
//! a standalone `mongod`, a replica set, a sharded cluster, or a wire-compatible server without
//! native transactions.
//!
//! # Layout, in the order data flows
//!
//! - `server`: what the deployment is and what time it is on the server ([`ServerClock`],
//!   [`Topology`], [`Durability`]); the [`probe`] that refuses servers lacking the guarantees
//!   mongotx needs.
//! - `repo`: a [`Store`] opens typed [`Repository`] handles on collections described by a
//!   [`CollectionSpec`]; every document carries the system [`fields`]. Documents held by a
//!   transaction describe themselves (their hold), so reads see committed values and anyone can
//!   resolve a hold. Documents written without them (existing data) read as plain documents and
//!   are stamped by their first write or by an explicit [`Repository::adopt`].
//! - `txn`: [`Transactions`] stages and commits multi-document [`Transaction`]s; the [`Gc`]
//!   resolves what dead coordinators left behind.
//! - [`quota`]: limits shared by every instance of a service, built on the two layers above.
//! - [`obt`]: one owner at a time for a long operation, with fencing tokens and leases.
//! - [`ratelimit`]: N calls in any interval of W shared by workers on different hosts, with
//!   reservations, priorities and all-or-nothing grants across limiters.
//! - [`queue`]: ordered per-service submission of batches to a ledger, one at a time per service.
//! - Across them: a [`GcRunner`] runs the GC and the quota and rate-limiter sweeps on an interval
//!   (in a service, or as the `mongotx-gc` binary); every module's error converts into
//!   [`Error`], whose [`ErrorKind`] reads the same whichever module failed; one retry primitive
//!   paces every loop that sends something again; [`collections`] names every collection mongotx
//!   keeps records in.
//! - `testkit` (feature `testkit`, off by default): the test rig, a test server, fault
//!   injection, simulators and model explorers; the crate's own tests and examples use it.
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
pub mod obt;
pub mod queue;
pub mod quota;
pub mod ratelimit;
mod repo;
mod retry;
mod runner;
mod server;
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
pub use repo::adopt::{AdoptOptions, AdoptProgress, AdoptRefusal, AdoptReport};
#[doc(inline)]
pub use repo::background::Shutdown;
#[doc(inline)]
pub use repo::changes::{Adjust, Update};
#[doc(inline)]
pub use repo::collection::{CollectionSpec, SpecError, UpgradeStep};
#[doc(inline)]
pub use repo::error::{show_id, RepoError};
pub use repo::fields;
#[doc(inline)]
pub use repo::find::Query;
#[doc(inline)]
pub use repo::hold::record::TxnState;
#[doc(inline)]
pub use repo::meta::META_COLLECTION;
#[doc(inline)]
pub use repo::outcome::{HoldError, TxnStatus};
#[doc(inline)]
pub use repo::repository::{Repository, Stamped, FIRST_VERSION};
#[doc(inline)]
pub use repo::schema::{BsonType, JsonSchema, SchemaError, Violation};
#[doc(inline)]
pub use repo::store::{
    HoldResolver, NoTransactions, RecordResolver, ServerValidation, Store, StoreBuilder,
    TRANSACTIONS_COLLECTION,
};
#[doc(inline)]
pub use retry::LockWait;
#[doc(inline)]
pub use runner::{GcPass, GcRunner};
#[doc(inline)]
pub use server::clock::{ClockError, Durability, ServerClock, Topology};
#[doc(inline)]
pub use server::probe::{
    probe, probe_with, verdict, ProbeError, ServerCapabilities, Verdict, DEFAULT_CONTENTION_TASKS,
};
#[doc(inline)]
pub use server::semantics::{Semantic, Status};
#[doc(inline)]
pub use txn::error::TxnError;
#[doc(inline)]
pub use txn::gc::{Gc, GcOptions, RoundSummary};
#[doc(inline)]
pub use txn::transaction::{Finish, Outcome, Transaction, Transactions, TxnOptions, Written};
