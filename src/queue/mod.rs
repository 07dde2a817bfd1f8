//! The batch queuer (in progress): batches of many services reach an external ledger one at a
//! time per service, in creation order. So far the queuer itself, the seed's one-round serial
//! strategy, as a pure function from the batches and "now" to the queue ([`one_round_serial`],
//! [`category`]), and the ledger simulator ([`ledger`]); the store-backed round and the
//! submitter and monitor roles come next.

pub mod ledger;
mod model;
mod queuer;

pub use model::{Batch, BatchStatus, DEFAULT_DELAY};
pub use queuer::{category, one_round_serial, Category};
