//! mongotx: all-or-nothing multi-document changes, optimistic locking, soft deletes and schema
//! versions on MongoDB, built only on single-document atomic operations, so they work the same on
//! a standalone `mongod`, a replica set, a sharded cluster, or a wire-compatible server without
//! native transactions.
//!
//! # Layout, in the order data flows
//!
//! - `server`: what the deployment is and what time it is on the server ([`ServerClock`],
//!   [`Topology`], [`Durability`]); the [`probe`] that refuses servers lacking the guarantees
//!   mongotx needs; a server for tests and the demo ([`test_server`]).
//! - `repo`: a [`Store`] opens typed [`Repository`] handles on collections described by a
//!   [`CollectionSpec`]; every document carries the system [`fields`]. Documents held by a
//!   transaction describe themselves (their hold), so reads see committed values and anyone can
//!   resolve a hold.
//! - `txn`: [`Transactions`] stages and commits multi-document [`Transaction`]s; the [`Gc`]
//!   resolves what dead coordinators left behind; [`failpoint`]s let tests crash any party.
//! - [`quota`]: limits shared by every instance of a service, built on the two layers above.
//! - [`obt`]: one owner at a time for a long operation, with fencing tokens and leases.
//! - [`ratelimit`]: N calls in any interval of W shared by workers on different hosts, with
//!   reservations, priorities and all-or-nothing grants across limiters.
//! - [`queue`]: ordered per-service submission of batches to a ledger, one at a time per service.
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

pub mod explore;
pub mod obt;
pub mod queue;
pub mod quota;
pub mod ratelimit;
mod repo;
mod server;
mod txn;

#[doc(inline)]
pub use repo::changes::{Adjust, Update};
#[doc(inline)]
pub use repo::collection::{CollectionSpec, SpecError, UpgradeStep};
#[doc(inline)]
pub use repo::error::{show_id, RepoError};
pub use repo::fields;
#[doc(inline)]
pub use repo::hold::{
    HoldError, HoldResolver, NoTransactions, RecordResolver, TxnState, TxnStatus,
};
#[doc(inline)]
pub use repo::meta::META_COLLECTION;
#[doc(inline)]
pub use repo::repository::{Query, Repository, Stamped, FIRST_VERSION};
#[doc(inline)]
pub use repo::schema::{BsonType, JsonSchema, SchemaError, Violation};
#[doc(inline)]
pub use repo::store::{LockWait, ServerValidation, Store, StoreBuilder, TRANSACTIONS_COLLECTION};
#[doc(inline)]
pub use server::clock::{ClockError, Durability, ServerClock, Topology};
pub use server::local as local_server;
#[doc(inline)]
pub use server::probe::{
    probe, probe_with, ProbeError, ServerCapabilities, DEFAULT_CONTENTION_TASKS,
};
#[doc(inline)]
pub use server::semantics::Semantic;
pub use server::test_server;
#[cfg(feature = "cli")]
pub use server::toxiproxy;
#[doc(inline)]
pub use txn::error::TxnError;
pub use txn::failpoint;
#[doc(inline)]
pub use txn::gc::{parse_duration, Gc, GcOptions, RoundSummary};
#[doc(inline)]
pub use txn::transaction::{Finish, Outcome, Transaction, Transactions, TxnOptions, Written};
