//! The batch queuer: batches of many services reach an external ledger one at a time per
//! service, in creation order, with any number of queuers, submitters and monitors running at
//! once. The queuer is the seed's one-round serial strategy, as a pure function from the batches
//! and "now" to the queue ([`one_round_serial`], [`category`]); [`Batches`] keeps them in the
//! database; a [`Submitter`] claims queued batches and submits them, a [`Monitor`] records what
//! the ledger says; [`ledger`] is a ledger simulator for tests and the demo.

mod claim;
mod error;
pub mod ledger;
#[cfg(feature = "cli")]
pub mod ledger_http;
mod model;
mod queuer;
mod roles;
mod store;

pub use claim::{Claim, Submission, MAX_CLAIM};
pub use error::QueueError;
pub use model::{Batch, BatchStatus, DEFAULT_DELAY};
pub use queuer::{category, one_round_serial, Category};
pub use roles::{LedgerApi, Monitor, Submitter};
pub use store::{
    Batches, NewBatch, BATCHES_COLLECTION, BATCHES_SCHEMA, MAX_CONTENT, MAX_DELAY, MAX_NAME,
    SERVICES_SCHEMA, SERVICES_SUFFIX,
};
