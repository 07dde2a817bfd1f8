//! mongotx: all-or-nothing multi-document changes, optimistic locking and soft deletes on
//! MongoDB, built only on single-document atomic operations.
//!
//! Layers, bottom up:
//! - [`store`] and [`repository`]: typed collections of stamped documents (system [`fields`],
//!   versions, tombstones, schema versions and [`schema`] validation);
//! - [`hold`]: the seam where the transaction layer tells the repository what a held document means;
//! - [`transaction`], [`worklist`] and [`recovery`]: multi-document transactions (the
//!   ActiveTransaction worklist), active rollback and recovery of expired transactions;
//! - [`failpoint`]: fault injection at every write of the protocol, for crash tests;
//! - [`probe`], [`local_server`] and [`test_server`]: checking a server's guarantees and providing one
//!   for tests and the demo.

pub mod changes;
pub mod collection;
pub mod error;
pub mod failpoint;
pub mod fields;
pub mod gc;
pub mod hold;
pub mod local_server;
pub mod probe;
pub mod recovery;
pub mod repository;
pub mod schema;
pub mod store;
pub mod test_server;
pub mod transaction;
pub mod worklist;

pub use changes::{Adjust, Update};
pub use collection::{CollectionSpec, SpecError};
pub use error::{RepoError, TxnError};
pub use gc::{Gc, GcOptions, RoundSummary};
pub use hold::{CommittedView, HoldResolver, LockWait, NoTransactions};
pub use probe::{probe, probe_with, ProbeError, ServerCapabilities};
pub use recovery::TransactionHolds;
pub use repository::{Query, Repository, Stamped, FIRST_VERSION};
pub use schema::{BsonType, JsonSchema, SchemaError, Violation};
pub use store::{ServerValidation, Store, StoreBuilder};
pub use transaction::{Finish, Outcome, Transaction, Transactions, TxnOptions, Written};
