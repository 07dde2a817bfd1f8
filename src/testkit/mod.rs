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
//! - [`explore`]: the exhaustive state explorer the protocol models run on (the commit
//!   protocol's model is a unit test; the rate limiter's is `ratelimit::model`).
//! - The rate limiter's third-party API simulator (`ratelimit::simulator`) and the batch
//!   queue's ledger simulator (`queue::ledger`, `queue::ledger_http`) stay next to the module they
//!   stand in for, behind the same feature.
//!
//! A feature rather than a second crate: the rig needs crate-private parts (the failpoints are
//! consulted by the commit protocol itself, the models reuse the modules' own planning code), and
//! the crate's tests and examples turn it on through a dev-dependency on the crate itself, so
//! `cargo test` and `cargo run --example ...` need no flag.

pub mod explore;
pub mod ferretdb;
pub(crate) mod http;
pub mod local_server;
pub mod test_server;
pub mod toxiproxy;

#[doc(inline)]
pub use crate::txn::failpoint;
