//! The batch queuer: batches of many services reach an external ledger one at a time per
//! service, in creation order, with any number of queuers, submitters and monitors running at
//! once. The queuer is the one-round serial strategy of the reference design (a planning document
//! for submitting batches to a distributed ledger in order): every round queues the batches the
//! ledger does not know, the delayed batches whose delay window has passed, and the oldest batch
//! of each service that has nothing in flight. It is a pure function from the batches and "now"
//! to the queue; [`Batches`] keeps them in the
//! database; a [`Submitter`] claims queued batches and submits them, a [`Monitor`] records what
//! the ledger says. A ledger simulator for tests and examples is in the test rig (`testkit::ledger`,
//! feature `testkit`).

mod claim;
mod error;
mod model;
mod queuer;
mod roles;
mod store;

pub use claim::{Claim, Submission, MAX_CLAIM};
pub use error::QueueError;
pub use model::{Batch, BatchStatus, DEFAULT_DELAY};
pub use roles::{Answer, LedgerApi, LedgerStatus, Monitor, Submitter};
pub use store::{Batches, NewBatch, BATCHES_SCHEMA, MAX_CONTENT, MAX_DELAY, SERVICES_SCHEMA};
