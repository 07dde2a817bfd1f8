//! The batch queuer (in progress): batches of many services reach an external ledger one at a
//! time per service, in creation order. So far the queuer itself, the seed's one-round serial
//! strategy, as a pure function from the batches and "now" to the queue ([`one_round_serial`],
//! [`category`]), the ledger simulator ([`ledger`]), and batches in the database ([`Batches`]:
//! adding them, one queuer round over them); the submitter and monitor roles come next.

mod error;
pub mod ledger;
mod model;
mod queuer;
mod store;

pub use error::QueueError;
pub use model::{Batch, BatchStatus, DEFAULT_DELAY};
pub use queuer::{category, one_round_serial, Category};
pub use store::{Batches, NewBatch, BATCHES_COLLECTION, BATCHES_SCHEMA};
