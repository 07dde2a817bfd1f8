//! The test rig, behind the non-default `testkit` feature: what the crate's own tests, examples
//! and binaries run against, kept out of the library a service depends on.
//!
//! - [`test_server`]: the server the tests and examples talk to (`MONGODB_URI`, a Docker
//!   container with the `docker` feature, or the local one), and [`local_server`], which builds
//!   and runs the MongoDB-wire-compatible stand-in from `tools/test-server`.
//! - [`toxiproxy`]: drops, resets and delays commands between a client and the server.
//! - [`ferretdb`]: FerretDB 1.24 on SQLite, a third-party wire-compatible server to judge.
//! - [`failpoint`]: named points where an injected fault stops a coordinator or the GC, as a
//!   killed process would (installed with `TxnOptions::fault_injector`,
//!   `GcOptions::fault_injector` and `QuotaOptions::fault_injector`, which exist only with
//!   this feature).
//! - [`explore`]: the exhaustive state explorer the protocol models run on: the commit
//!   protocol's (`commit_model`, a unit test run by CI with `--ignored`), the batch queue's
//!   parallel strategy's (`queue_model`, unit tests) and the rate limiter's ([`ratelimit_model`]).
//! - [`api_simulator`]: a third-party API with a rate limit, for the rate limiter's tests;
//!   [`ledger`] and [`ledger_http`]: the external ledger the batch queue submits to, in process
//!   and over HTTP.
//!
//! A feature rather than a second crate: the rig needs crate-private parts (the failpoints are
//! consulted by the commit protocol itself, the models reuse the modules' own planning code), and
//! the crate's tests and examples turn it on through a dev-dependency on the crate itself, so
//! `cargo test` and `cargo run --example ...` need no flag.

pub mod api_simulator;
#[cfg(test)]
mod commit_model;
pub mod explore;
pub mod ferretdb;
pub(crate) mod http;
pub mod ledger;
pub mod ledger_http;
pub mod local_server;
#[cfg(test)]
mod queue_model;
pub mod ratelimit_model;
pub mod test_server;
pub mod toxiproxy;

#[doc(inline)]
pub use crate::txn::failpoint;

// Seams the library keeps to itself, open to tests: how a store learns the fate of the
// transaction holding a document (one test swaps it), and the probe with a chosen amount of
// contention (the probe command's `--tasks`; its default is public as
// `server::DEFAULT_CONTENTION_TASKS`, and stays here under its old name).
#[doc(inline)]
pub use crate::repo::outcome::TxnStatus;
#[doc(inline)]
pub use crate::repo::store::{HoldResolver, NoTransactions, RecordResolver};
#[doc(inline)]
pub use crate::server::probe::{probe_with, DEFAULT_CONTENTION_TASKS};
