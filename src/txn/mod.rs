//! The transaction layer: multi-document all-or-nothing changes on single-document writes.
//!
//! [`Transactions`] is the handle a user starts from; a [`Transaction`] stages actions (insert,
//! update, adjust, delete, check) and commits them. Inside, one idea per module: `worklist` turns
//! each entry into its writes without I/O; `stamps` readies the plain documents entries were
//! staged on; `committer` runs the commit protocol (its module doc
//! gives the steps and why each is safe when repeated, late or interrupted); `recovery` finishes or
//! rolls back whole transactions from their records, and `expired` decides those whose deadline
//! passed; [`Gc`] does that page by page, sweeps holds whose transaction ended, and purges
//! tombstones; `options` holds the settings and what a commit returns; `observe` the span and the
//! metrics of each commit and `run`; `failpoint` lets tests stop any party at any write; `inspect`
//! explains what is stored (the admin command's library) and settles one expired transaction by
//! hand, through the GC's own resolution. The layer stands on the repository layer (holds are
//! defined there) and never the
//! other way round.

pub(crate) mod claims;
pub(crate) mod committer;
pub(crate) mod error;
pub(crate) mod expired;
pub mod failpoint;
pub(crate) mod gc;
pub(crate) mod inspect;
pub(crate) mod observe;
pub(crate) mod options;
pub(crate) mod recovery;
pub(crate) mod stamps;
pub(crate) mod transaction;
pub(crate) mod worklist;
