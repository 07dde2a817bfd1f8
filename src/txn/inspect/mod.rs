//! Looking at what mongotx is doing in a database, from the stored data alone: the library
//! behind the `mongotx` admin command, public so that a service can answer the same questions
//! (an incident page, a health endpoint) without shelling out.
//!
//! [`Inspector`] is the handle; its methods are declared here and each calls the file doing the
//! work:
//!
//! - `status`: the server's verdict, transactions by state and age, held documents per
//!   collection, how far the GC is behind, the GC runners' claims ([`Status`]);
//! - `why`: a document's committed value, and if it is held, by which transaction, in what
//!   state, and what happens next and when ([`Explanation`]);
//! - `report`: one transaction's record, worklist and documents ([`TxnReport`]);
//! - `resolve`: settling one expired transaction now, as the GC would ([`Resolved`]); the only
//!   one that writes;
//! - `next`: the rules that say what happens next, restated from the resolvers' code (no I/O);
//! - `documents`: where each document of a transaction stands; `model`: what the reports share;
//!   `text`: the reports as `field: value` lines.
//!
//! Every time is the server's (`hello`'s clock, as every deadline is), never this host's.

mod documents;
mod model;
mod next;
mod report;
mod resolve;
mod status;
mod text;
mod why;

use bson::{oid::ObjectId, Bson};

pub use model::{DocState, DocumentState, GcClaim, RecordInfo};
pub use next::{Action, Next, Readers};
pub use report::TxnReport;
pub use resolve::{Resolved, Settlement};
pub use status::{
    ClaimedRecord, Expired, HeldCount, ServerLine, StateCount, Status, CLAIMS_LISTED,
};
pub use why::{CommittedValue, Explanation, HoldInfo};

use crate::repo::store::Store;
use crate::txn::error::TxnError;
use crate::txn::failpoint::Faults;
use crate::txn::recovery::Env;

/// A handle for looking at transactions and holds in one store's database (the records
/// collection, durability and clock are the store's), and for settling an expired transaction
/// by hand. Opening one does no I/O; every method but [`resolve`](Inspector::resolve) only
/// reads (`status` also runs the store's quick server check on a scratch collection it drops).
#[derive(Debug, Clone)]
pub struct Inspector {
    env: Env,
}

impl Inspector {
    /// An inspector on `store`'s database.
    pub fn new(store: &Store) -> Inspector {
        Inspector {
            env: Env {
                store: store.clone(),
                faults: Faults::none(),
            },
        }
    }

    /// What mongotx is doing in the database: the first look in an incident. Its server line
    /// comes from the quick check a store runs when it opens its first collection, which creates
    /// and drops a scratch collection: the one write here (a user with only the `read` role gets
    /// the line "not checked" and the rest of the report).
    pub async fn status(&self) -> Result<Status, TxnError> {
        status::status(&self.env).await
    }

    /// Why document `id` of `collection` reads as it does, and what holds it: refused with
    /// [`TxnError::UnknownCollection`] for a collection mongotx does not manage, and
    /// [`TxnError::UnknownDocument`] for an id nothing is stored under.
    pub async fn why(
        &self,
        collection: &str,
        id: impl Into<Bson>,
    ) -> Result<Explanation, TxnError> {
        why::why(&self.env, collection, id.into()).await
    }

    /// Transaction `txn`'s record, its documents and what happens next to it;
    /// [`TxnError::UnknownTransaction`] when nothing is stored of it.
    pub async fn transaction(&self, txn: ObjectId) -> Result<TxnReport, TxnError> {
        report::report(&self.env, txn).await
    }

    /// Settles transaction `txn` now, as the GC would, once its deadline has passed on the
    /// server's clock: refused with [`TxnError::Live`] (nothing written) before that, and with
    /// [`TxnError::UnknownTransaction`] when nothing is stored of it.
    pub async fn resolve(&self, txn: ObjectId) -> Result<Resolved, TxnError> {
        resolve::resolve(&self.env, txn).await
    }
}
