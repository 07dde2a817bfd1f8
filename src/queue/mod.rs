//! The batch queuer: batches of many services reach an external ledger one at a time per
//! service, in creation order, with any number of queuers, submitters and monitors running at
//! once. The queuer is the one-round serial strategy of the reference design (a planning document
//! for submitting batches to a distributed ledger in order): every round queues the batches the
//! ledger does not know, the delayed batches whose delay window has passed, and the oldest batch
//! of each service that has nothing in flight. It is a pure function from the batches and "now"
//! to the queue; [`Batches`] keeps them in the
//! database; a [`Submitter`] claims queued batches and submits them, a [`Monitor`] records what
//! the ledger says. A ledger simulator for tests and benchmarks is in the test rig (`testkit::ledger`,
//! feature `testkit`).
//!
//! Every method of [`Batches`] is declared in this file and delegates: adding batches and queuer
//! rounds to `store` (stamps drawn and drawn again in `stamp`), claiming and recording to
//! `claim`, the parallel strategy's claim and adder's check to `parallel`, the roles'
//! conveniences to `roles`, the operator's view of a service to `report` (also read without
//! opening the collection by [`inspect`]); `db` reads and guards the stored documents for all
//! of them.

mod claim;
mod db;
mod error;
mod model;
mod parallel;
mod queuer;
mod report;
mod roles;
mod stamp;
mod store;

pub use claim::{Claim, Submission, MAX_CLAIM};
pub use error::QueueError;
pub use model::{conflicts, Batch, BatchStatus, Keys, Strategy, DEFAULT_DELAY, MAX_KEYS};
pub use report::{inspect, BatchReport, BatchState, QueueReport, SlotReport};
pub use roles::{Answer, LedgerApi, LedgerStatus, Monitor, Submitter};
pub use store::{NewBatch, BATCHES_SCHEMA, MAX_CONTENT, MAX_DELAY, SERVICES_SCHEMA};

use std::time::Duration;

use bson::Document;
use mongodb::Collection;

use crate::metrics;
use crate::repo::store::Store;
use claim::Claimed;

/// The batches of one collection; cheap to clone.
#[derive(Debug, Clone)]
pub struct Batches {
    store: Store,
    pub(crate) coll: Collection<Document>,
    pub(crate) services: Collection<Document>,
    pub(crate) name: String,
    delay: Duration,
}

impl Batches {
    /// Opens the default collection of batches, with a 15 s delay window ([`DEFAULT_DELAY`], the
    /// default of the queuer's reference design).
    #[tracing::instrument(name = "mongotx.queue.open", skip_all)]
    pub async fn open(store: &Store) -> Result<Batches, QueueError> {
        store::open(store).await
    }

    /// Opens `collection`, retrying delayed batches `delay` after their last submission (zero:
    /// at once). A collection name the queue cannot use, or a delay over [`MAX_DELAY`], is
    /// [`QueueError::Invalid`], before anything is created.
    #[tracing::instrument(name = "mongotx.queue.open", skip_all, fields(collection = collection))]
    pub async fn with_collection(
        store: &Store,
        collection: &str,
        delay: Duration,
    ) -> Result<Batches, QueueError> {
        store::with_collection(store, collection, delay).await
    }

    /// A handle that opened nothing (no collection, index or validator made), for reading a
    /// database that must not change ([`inspect`]); never handed out, since its writes would go
    /// to collections nobody set up.
    pub(crate) fn unopened(
        store: &Store,
        collection: &str,
        delay: Duration,
    ) -> Result<Batches, QueueError> {
        store::check_collection(store, collection, delay)?;
        Ok(Batches {
            store: store.clone(),
            coll: store.database().collection(collection),
            services: store
                .database()
                .collection(&format!("{collection}{}", store::SERVICES_SUFFIX)),
            name: collection.to_string(),
            delay,
        })
    }

    /// What an operator asks about `service`'s queue: its open batches in order, each with
    /// where it stands (never sent, with a submitter and until when, its claim run out, at the
    /// ledger, unknown, delayed until when), what a submitter sends next by the one-round
    /// serial rule (so what [`round`](Batches::round) would hand out), the service's slot and
    /// mark, and how long its oldest open batch has waited. Writes nothing.
    pub async fn report(&self, service: &str) -> Result<QueueReport, QueueError> {
        report::report(self, service).await
    }

    /// Adds a batch, created now. Adding the same batch again changes nothing; reusing its
    /// header for another service or content is [`QueueError::HeaderReused`].
    ///
    /// Its stamp (`created_at`) is drawn from its service's counter before the batch is
    /// inserted: after every stamp given to a batch of the service, so the order of stamps is
    /// the order of `add` calls that did not overlap (overlapping ones in the order they drew),
    /// whatever the clocks say, and the batch is never claimable anywhere but in its place. Once
    /// inserted it is stamped again, before `add` returns, if a batch of an overlapping add that
    /// drew later went to the ledger ahead of it: no batch is ever stamped before one that went
    /// ahead of it. Four round trips (a look for the header, the draw, the insert, a look at the
    /// service).
    ///
    /// Adding a stored batch again (a retry after an add that failed, or whose caller died)
    /// makes that last check itself while another batch may still go ahead of it, so the batch
    /// returned is in its final place. Two adds of one batch at the same time are the exception:
    /// its place is final once both have returned.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(batches: mongotx::queue::Batches) -> Result<(), mongotx::queue::QueueError> {
    /// use mongotx::queue::NewBatch;
    ///
    /// let batch = batches.add(&NewBatch::new("service-a", "batch-0001", "payload")).await?;
    /// // Submitters take each service's batches one at a time, oldest first:
    /// for next in batches.round().await? {
    ///     println!("submit {} of {}", next.header, next.service_id);
    /// }
    /// # let _ = batch;
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(name = "mongotx.queue.add", skip_all, fields(service = %batch.service_id, batch = %batch.header))]
    pub async fn add(&self, batch: &NewBatch) -> Result<Batch, QueueError> {
        match store::add(self, batch).await? {
            store::Added::Placed(batch) => Ok(batch),
            store::Added::ToPlace { at, writes, again } => {
                parallel::place_after_went(self, batch, at, writes, again).await
            }
        }
    }

    /// One queuer round: the batches to submit now, by the one-round serial strategy (batches
    /// the ledger does not know, delayed batches past their window, then the oldest batch of each
    /// service with nothing in flight), over every stored batch the ledger has not settled, at the
    /// server's time.
    #[tracing::instrument(name = "mongotx.queue.round", skip_all)]
    pub async fn round(&self) -> Result<Vec<Batch>, QueueError> {
        store::round(self).await
    }

    /// Chooses how `service`'s batches go to the ledger: one at a time in creation order
    /// ([`Strategy::Serial`], what a service has unless told otherwise), or
    /// [`Strategy::Parallel`]: batches whose declared [`Keys`] do not conflict go together,
    /// and of two that conflict the older is committed or found invalid at the ledger before the
    /// younger is sent (see [`conflicts`]; a batch that declares no keys conflicts with every
    /// batch of its service).
    ///
    /// A service's strategy is chosen before its first batch: once a batch of the service was
    /// added, choosing the strategy it has changes nothing, and choosing another is
    /// [`QueueError::Invalid`], with nothing written; so is an unusable service id.
    #[tracing::instrument(name = "mongotx.queue.set_strategy", skip_all, fields(service = service, strategy = %strategy))]
    pub async fn set_strategy(&self, service: &str, strategy: Strategy) -> Result<(), QueueError> {
        parallel::set_strategy(self, service, strategy).await
    }

    /// The stored batch `header`.
    #[tracing::instrument(name = "mongotx.queue.get", skip_all, fields(batch = header))]
    pub async fn get(&self, header: &str) -> Result<Batch, QueueError> {
        store::get(self, header).await
    }

    /// Takes `batch` (from a queuer round) for submission, for at most `ttl`. `None` when it
    /// is not this caller's to submit now: another submitter has it, its service has another
    /// batch in flight, an older batch of its service must go first, or it moved on. Nothing
    /// is left taken when it answers `None`.
    ///
    /// Two round trips (see the module's doc). The claim lands only before it runs out by the
    /// server's clock, so a `ttl` too short to reach the server answers `None`; its
    /// [`deadline`](Claim::deadline) comes earlier than its expiry by the uncertainty of this
    /// process's estimate of the server's clock, so a `ttl` within it leaves no time to send.
    ///
    /// A batch that does not exist is [`QueueError::UnknownBatch`]; an unusable claimant name
    /// (empty, over [`MAX_NAME`](crate::fields::MAX_NAME) bytes, with a NUL) or a `ttl` under a
    /// millisecond or over [`MAX_CLAIM`] is [`QueueError::Invalid`]; nothing is written.
    #[tracing::instrument(name = "mongotx.queue.claim", skip_all, fields(service = %batch.service_id, batch = %batch.header, claimant = claimant))]
    pub async fn claim(
        &self,
        batch: &Batch,
        claimant: &str,
        ttl: Duration,
    ) -> Result<Option<Claim>, QueueError> {
        let claimed = match claim::terms(self, batch, claimant, ttl).await {
            Ok(terms) if batch.strategy == Strategy::Parallel => {
                parallel::claim(self, batch, &terms).await
            }
            Ok(terms) => claim::claim(self, batch, &terms).await,
            Err(e) => Err(e),
        };
        metrics::queue_claim(claimed.as_ref().map_or("error", Claimed::label));
        claimed.map(Claimed::into_claim)
    }

    /// Records what the submission under `claim` came to, and gives the claim back. Accepted:
    /// the batch is pending and stays with the ledger (`submitted`). Delayed: it is retried
    /// after the delay window. A claim taken over meanwhile is [`QueueError::NotClaimant`], and
    /// nothing is written.
    #[tracing::instrument(name = "mongotx.queue.record", skip_all, fields(service = %claim.batch.service_id, batch = %claim.batch.header, outcome = ?outcome))]
    pub async fn record(&self, claim: &Claim, outcome: Submission) -> Result<Batch, QueueError> {
        claim::record(self, claim, outcome).await
    }

    /// Records the ledger's status of a batch with a submitter or at the ledger (the monitor's
    /// write). `seen` is the batch as read before the ledger was asked: the status is written
    /// only if the batch is still so (same status, `submitted` and last submission), since an
    /// answer about an earlier state says nothing about a later one; otherwise
    /// [`QueueError::Contended`], and the next pass asks again. Unknown clears `submitted`, so
    /// the batch is queued again; committed and invalid free the service's slot (the ledger is
    /// done with the batch), valid does not (the ledger may still forget a valid batch, and it
    /// must then go again before any younger one). The statuses go one way only:
    ///
    /// - with a submitter (`submitted`, and nothing yet, unknown or delayed) → pending, valid,
    ///   committed, invalid, unknown (unknown only if the submitter's claim had expired when
    ///   the ledger was asked: until then it may still be sending; here that is taken as the
    ///   time of this call, and [`record_answer`](Batches::record_answer) takes the time the
    ///   question was asked; it clears `submitted`, also of an unknown batch whose new
    ///   submitter died);
    /// - pending → valid, committed, invalid, unknown; valid → committed, unknown (a valid
    ///   batch the ledger forgets is sent again, still ahead of the younger ones);
    /// - unknown or delayed without a submitter → only by a new submission
    ///   ([`record`](Batches::record)).
    ///
    /// Recording the status a batch already has changes nothing. Anything else is
    /// [`QueueError::InvalidTransition`], and nothing is written.
    #[tracing::instrument(name = "mongotx.queue.record_status", skip_all, fields(service = %seen.service_id, batch = %seen.header, status = ?status))]
    pub async fn record_status(
        &self,
        seen: &Batch,
        status: BatchStatus,
    ) -> Result<Batch, QueueError> {
        claim::record_status(self, seen, status, None).await
    }

    /// Records the ledger's answer to a question asked at `asked_at`, as
    /// [`record_status`](Batches::record_status) does: `asked_at` is the server's time read
    /// (with [`Store::server_time`](crate::Store::server_time) on this collection's store) before
    /// the ledger was asked. An unknown for a batch with a submitter is recorded only if the
    /// submitter's claim had expired by then, with the store's estimate of the server's time
    /// taken at its earliest: a question asked while the claim was live may have been overtaken
    /// by the submission (a submitter sends only before its claim expires), and its answer says
    /// nothing about the batch now ([`QueueError::Contended`]). [`Monitor`] records its answers
    /// this way.
    #[tracing::instrument(name = "mongotx.queue.record_answer", skip_all, fields(service = %seen.service_id, batch = %seen.header, status = ?status))]
    pub async fn record_answer(
        &self,
        seen: &Batch,
        status: BatchStatus,
        asked_at: chrono::DateTime<chrono::Utc>,
    ) -> Result<Batch, QueueError> {
        let (_, error) = db::now_within(self).await?;
        let asked = crate::server::clock::minus(bson::DateTime::from_chrono(asked_at), error);
        claim::record_status(self, seen, status, Some(asked)).await
    }

    /// The batches a monitor asks the ledger about: at the ledger (pending, valid), or with a
    /// submitter (which may have died after sending) and no answer recorded since.
    #[tracing::instrument(name = "mongotx.queue.watched", skip_all)]
    pub async fn watched(&self) -> Result<Vec<Batch>, QueueError> {
        roles::watched(self).await
    }
}
