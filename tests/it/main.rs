//! The integration tests, one binary: each module is a subject (once a test binary of its own,
//! `tests/<subject>.rs`), `common` the harness they share. One subject runs with
//! `cargo test --test it <subject>::`, e.g. `cargo test --test it conformance::`.
//!
//! Every test runs in this one process. The harness's test server is started once, by the first
//! test that needs one, and shared: each test works in a database of its own, and a test that needs
//! a server of other settings, or one it stops, starts its own. No test sets an environment
//! variable of this process (a child's environment is set on its `Command`). The tests that run
//! fleets of worker processes take turns (`common::fleet_turn`), and the one test that bounds a
//! latency (the rate limiter's high-priority waits) has the machine to itself
//! (`common::machine::alone`).
//!
//! The subjects under `cfg(feature = "cli")` run the crate's production binaries
//! (`CARGO_BIN_EXE_*`), those under `cfg(feature = "rig-cli")` the benchmark's or the torture
//! run's too; the crate's dev-dependency on itself turns both features on for every test build.

mod common;

mod admin;
#[cfg(feature = "cli")]
mod admin_cli;
#[cfg(feature = "cli")]
mod admin_coordination;
mod adoption;
mod adoption_online;
mod adoption_props;
mod ambiguous;
mod bad_input;
#[cfg(feature = "rig-cli")]
mod bad_input_cli;
mod bad_input_obt;
mod bad_input_props;
mod bad_input_queue;
mod bad_input_quota;
mod bad_input_ratelimit;
mod bad_input_txn;
mod bulk_rounds;
mod clean_errors;
mod concurrency;
mod conformance;
#[cfg(feature = "cli")]
mod contention;
mod crash_sweep;
mod crud;
mod durability;
mod errors;
mod ferretdb;
mod format;
mod format_coordination;
mod gc_purge;
mod gc_race;
#[cfg(feature = "cli")]
mod gc_runner;
mod holds;
mod ids_and_inserts;
#[cfg(feature = "rig-cli")]
mod isolation;
mod late_delivery;
mod metrics;
#[cfg(feature = "rig-cli")]
mod mixed_versions;
mod obt;
mod obt_http;
mod obt_late;
#[cfg(feature = "rig-cli")]
mod obt_processes;
mod obt_race;
mod privileges;
mod queries;
mod query_equivalence;
mod queue;
mod queue_claim;
mod queue_parallel;
#[cfg(feature = "rig-cli")]
mod queue_processes;
mod quota;
mod quota_concurrency;
#[cfg(feature = "rig-cli")]
mod quota_crash;
mod quota_races;
mod quota_release;
mod quota_stripes;
mod ratelimit;
mod ratelimit_faults;
#[cfg(feature = "rig-cli")]
mod ratelimit_processes;
mod raw_changes;
mod scale;
mod schema_versions;
#[cfg(feature = "cli")]
mod server;
mod server_prefilter;
mod server_validation;
mod shutdown;
#[cfg(feature = "rig-cli")]
mod soak;
#[cfg(feature = "rig-cli")]
mod torture;
mod transactions;
mod unique_indexes;
mod validator_agreement;
mod versions;
mod write_count;
