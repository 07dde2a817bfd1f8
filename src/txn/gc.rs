//! The transaction GC: finishes or rolls back transactions whose deadline has passed, resolves
//! holds whose transaction has ended (an orphaned hold never outlives one round), and purges old
//! tombstones.
//!
//! Safe to run from several processes at once and next to live coordinators: aborting a pending
//! transaction and writing its commit point are both conditional on it still being pending, and
//! every finish or undo is conditional on the document still being held by it. Deadlines are
//! compared with the server's time, never this host's clock.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use futures::{StreamExt, TryStreamExt};
use tracing::Instrument;

use crate::metrics::{self, GcResolved};
use crate::repo::fields;
use crate::repo::hold::{held, record, resolve, write};
use crate::repo::meta;
use crate::repo::outcome::TxnStatus;
use crate::repo::store::Store;
use crate::server::clock;
use crate::txn::claims::Claims;
use crate::txn::error::TxnError;
use crate::txn::expired::{self, Resolution};
use crate::txn::failpoint::{self, Faults};
use crate::txn::recovery::Env;
use crate::txn::transaction::check_records_collection;

/// Settings of a GC.
#[derive(Clone)]
#[non_exhaustive]
pub struct GcOptions {
    /// How many expired transaction records a round reads and resolves at once (a page; a round
    /// goes through every page), and how many holders and held documents per holder one
    /// collection's sweep handles at most.
    pub batch_size: usize,
    /// Purge tombstones deleted longer ago than this (`None`: keep them).
    pub tombstone_retention: Option<Duration>,
    faults: crate::txn::failpoint::Injector,
}

impl Default for GcOptions {
    fn default() -> GcOptions {
        GcOptions {
            batch_size: 500,
            tombstone_retention: None,
            faults: Default::default(),
        }
    }
}

impl std::fmt::Debug for GcOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GcOptions")
            .field("batch_size", &self.batch_size)
            .field("tombstone_retention", &self.tombstone_retention)
            .finish()
    }
}

impl GcOptions {
    /// The largest [`batch_size`](GcOptions::batch_size) that [`validate`](GcOptions::validate)
    /// accepts: a page's record ids travel in one claim command, which must stay well under the
    /// 16 MiB a command may carry.
    pub const MAX_BATCH_SIZE: usize = 100_000;

    /// Checks that these options can work; every round (and [`Gc::resolve`]) refuses with
    /// [`TxnError::InvalidOptions`], before reading or writing anything, when they cannot: a
    /// `batch_size` of 0 (a page of nothing would never get through the backlog) or over
    /// [`GcOptions::MAX_BATCH_SIZE`]. (The GC also refuses a store whose transactions
    /// collection MongoDB or mongotx cannot use for records.) Any tombstone retention is
    /// accepted: zero purges every free tombstone, and one reaching before the epoch purges none.
    pub fn validate(&self) -> Result<(), TxnError> {
        if self.batch_size == 0 || self.batch_size > GcOptions::MAX_BATCH_SIZE {
            return Err(TxnError::InvalidOptions {
                option: "batch_size",
                value: self.batch_size.to_string(),
                reason: format!("a page holds 1 to {} records", GcOptions::MAX_BATCH_SIZE),
            });
        }
        Ok(())
    }

    /// Sets the page size of a round (see [`GcOptions::batch_size`]).
    pub fn batch_size(mut self, batch_size: usize) -> GcOptions {
        self.batch_size = batch_size;
        self
    }

    /// Sets (or clears) the tombstone retention.
    pub fn tombstone_retention(mut self, retention: Option<Duration>) -> GcOptions {
        self.tombstone_retention = retention;
        self
    }

    #[cfg(feature = "testkit")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
    /// Installs a fault injector (tests): the GC stops at the points it chooses.
    pub fn fault_injector(
        mut self,
        injector: std::sync::Arc<dyn crate::txn::failpoint::FaultInjector>,
    ) -> GcOptions {
        self.faults = Some(injector);
        self
    }
}

/// What one GC round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RoundSummary {
    /// Committed transactions whose documents were freed.
    pub finished: usize,
    /// Transactions rolled back.
    pub rolled_back: usize,
    /// Held documents whose transaction had ended (no record), undone one by one.
    pub swept: usize,
    /// Items that failed and are left for the next round.
    pub skipped: usize,
    /// Tombstones purged.
    pub purged: u64,
    /// Expired records this round left alone because another runner's claim on them had not run
    /// out (runners share a backlog by claiming pages of it): that runner is resolving them, or
    /// it died and they wait until its claims run out, 60 s after it took them. Each counts once
    /// a round.
    pub left_to_claims: usize,
}

/// How many pages of holders the sweep lists, to take one page of them at random.
const SWEEP_CANDIDATES: i64 = 8;

/// How many expired staging transactions a GC round decides at once (each decision reads its
/// participants and may fence one).
const PARALLEL_DECISIONS: usize = 32;

/// A GC over one database.
#[derive(Debug, Clone)]
pub struct Gc {
    env: Env,
    options: GcOptions,
    /// This runner's claims on pages of expired records.
    claims: Claims,
}

impl Gc {
    /// A GC over `store`'s database, with its settings (the transactions collection, the
    /// durability, the clock, the version-floor grace): the same records and concerns as the
    /// transactions it resolves.
    pub fn new(store: &Store, options: GcOptions) -> Gc {
        Gc {
            env: Env {
                store: store.clone(),
                faults: Faults::new(options.faults.clone()),
            },
            options,
            claims: Claims::new(),
        }
    }

    /// Refuses options, or a store's transactions collection, that cannot work (see
    /// [`GcOptions::validate`]).
    fn check(&self) -> Result<(), TxnError> {
        self.options.validate()?;
        check_records_collection(
            "transactions_collection",
            self.env.store.transactions_collection(),
        )
    }

    /// Runs one round now (server time).
    pub async fn run_round(&self) -> Result<RoundSummary, TxnError> {
        let started = Instant::now();
        let now = async {
            self.check()?;
            self.env.now(None).await
        }
        .await;
        match now {
            Ok(now) => self.round_at(now, &AtomicBool::new(false)).await,
            Err(e) => {
                // A round that could not start failed all the same.
                metrics::gc_round(started.elapsed(), None);
                Err(e)
            }
        }
    }

    /// Runs one round as if the server's time were `now`; stops between items once `stop` is set.
    ///
    /// An item that fails is logged and skipped (the next round retries it); an injected crash
    /// ends the round with `Err`, as the death of the process would.
    pub async fn run_round_at(
        &self,
        now: chrono::DateTime<chrono::Utc>,
        stop: &AtomicBool,
    ) -> Result<RoundSummary, TxnError> {
        self.round_at(DateTime::from_chrono(now), stop).await
    }

    /// [`run_round_at`](Gc::run_round_at) in the server's own representation, in a span
    /// `mongotx.gc.round`, counted in the GC's metrics (`crate::metrics`).
    pub(crate) async fn round_at(
        &self,
        now: DateTime,
        stop: &AtomicBool,
    ) -> Result<RoundSummary, TxnError> {
        let started = Instant::now();
        let result = self
            .round(now, stop)
            .instrument(tracing::info_span!("mongotx.gc.round"))
            .await;
        let resolved = result.as_ref().ok().map(|s| GcResolved {
            finished: s.finished as u64,
            rolled_back: s.rolled_back as u64,
            swept: s.swept as u64,
            skipped: s.skipped as u64,
            purged: s.purged,
        });
        metrics::gc_round(started.elapsed(), resolved);
        result
    }

    async fn round(&self, now: DateTime, stop: &AtomicBool) -> Result<RoundSummary, TxnError> {
        self.check()?;
        let mut summary = RoundSummary::default();
        self.resolve_expired(now, stop, &mut summary).await?;
        let collections = meta::managed(self.env.store.database())
            .await
            .map_err(|e| TxnError::database(None, "list managed collections", e))?;
        for collection in &collections {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            self.sweep(collection, now, stop, &mut summary).await?;
        }
        if let Some(retention) = self.options.tombstone_retention {
            for collection in &collections {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                match self
                    .env
                    .store
                    .purge_tombstones(collection, clock::minus(now, retention))
                    .await
                {
                    Ok(purged) => summary.purged += purged,
                    Err(e) => {
                        tracing::warn!(collection, error = %e, "purging tombstones failed; retrying next round");
                        summary.skipped += 1;
                    }
                }
            }
        }
        tracing::info!(
            finished = summary.finished,
            rolled_back = summary.rolled_back,
            swept = summary.swept,
            skipped = summary.skipped,
            purged = summary.purged,
            left_to_claims = summary.left_to_claims,
            "GC round"
        );
        Ok(summary)
    }

    /// Finishes or rolls back every transaction whose deadline is at or before `now` (or the
    /// records' own clock, when that is later), a page of `batch_size` records at a time (in
    /// deadline order, each record visited once a round): each page is resolved together (see
    /// `expired::resolve_expired_many`), so a page costs a few commands whatever its size, besides
    /// the staging transactions it has to decide.
    async fn resolve_expired(
        &self,
        now: DateTime,
        stop: &AtomicBool,
        summary: &mut RoundSummary,
    ) -> Result<(), TxnError> {
        // At least 1 (validated), so every page moves the round on.
        let page_size = self.options.batch_size.max(1);
        let limit = i64::try_from(page_size).unwrap_or(i64::MAX);
        let records = self.env.records(None).await?;
        // A deadline has passed once `now` or the records' own clock (which guards the abort and
        // the deletion of a record) has reached it, whichever comes first: where the records'
        // shard runs ahead of `hello`'s clock, waiting for `hello`'s would keep the documents of
        // a dead coordinator held longer than the records allow.
        let records_now = record::clock(&records, doc! {})
            .await
            .map_err(|e| TxnError::database(None, "read the records' clock", e))?;
        let expiry = records_now.map_or(now, |records_now| records_now.max(now));
        let mut after: Option<(DateTime, ObjectId)> = None;
        while !stop.load(Ordering::SeqCst) {
            let mut filter = doc! { "deadline": { "$lte": expiry } };
            if let Some((deadline, id)) = after {
                filter.insert(
                    "$or",
                    vec![
                        doc! { "deadline": { "$gt": deadline } },
                        doc! { "deadline": deadline, "_id": { "$gt": id } },
                    ],
                );
            }
            // Ids and deadlines only: the claim reads the whole records of the page it gets.
            let page: Vec<Document> = records
                .find(filter)
                .projection(doc! { "_id": 1, "deadline": 1 })
                .sort(doc! { "deadline": 1, "_id": 1 })
                .limit(limit)
                .batch_size(u32::try_from(page_size).unwrap_or(u32::MAX))
                .await
                .map_err(|e| TxnError::database(None, "find expired transactions", e))?
                .try_collect()
                .await
                .map_err(|e| TxnError::database(None, "find expired transactions", e))?;
            let Some(last) = page.last() else {
                break;
            };
            after = match (last.get_datetime("deadline"), last.get_object_id("_id")) {
                (Ok(deadline), Ok(id)) => Some((*deadline, id)),
                _ => {
                    tracing::warn!(record = %last, "a transaction record without a deadline or an ObjectId; the round stops here");
                    summary.skipped += 1;
                    break;
                }
            };
            let full = page.len() == page_size;
            let taken = self.claims.take(&self.env, &records, page, now).await?;
            summary.left_to_claims += taken.others;
            let page = taken.mine;
            // One page at a time: a page's resolution left unpolled beside the next page's
            // listing kept the driver's connections it had checked out, and the listing then
            // waited for one forever (a page has up to 32 decisions under way).
            let resolved =
                expired::resolve_expired_many(&self.env, page, expiry, PARALLEL_DECISIONS).await?;
            self.account(&records, resolved, summary).await?;
            if !full {
                break;
            }
        }
        Ok(())
    }

    /// Counts a resolved page in `summary` and lets go at once of the records that stay
    /// (undecidable yet, an aborted one before its deadline, a failure), for whoever comes next;
    /// only a runner that dies keeps its claims until they run out.
    async fn account(
        &self,
        records: &mongodb::Collection<Document>,
        resolved: Vec<(ObjectId, Result<Resolution, TxnError>)>,
        summary: &mut RoundSummary,
    ) -> Result<(), TxnError> {
        let mut left: Vec<ObjectId> = Vec::new();
        for (t, resolution) in resolved {
            match resolution {
                Ok(Resolution::Finished) => summary.finished += 1,
                Ok(Resolution::RolledBack) => summary.rolled_back += 1,
                Ok(Resolution::Gone) => {}
                Ok(Resolution::NotExpired) => left.push(t),
                Err(e) => {
                    tracing::warn!(txn = %t, error = %e, "GC could not resolve transaction; retrying next round");
                    summary.skipped += 1;
                    left.push(t);
                }
            }
        }
        self.claims.let_go(records, left).await
    }

    /// Resolves the held documents of `collection` whose transaction is decided or has no record:
    /// holds left by applies the server ran after their transaction had ended (see `repo::hold`),
    /// and holds of decided transactions nobody has finished. The holders are listed once each
    /// (one command, whatever is held) and their outcomes read in one batch, so holds of
    /// undecided transactions cost nothing more: those are the expired-record pass's business.
    async fn sweep(
        &self,
        collection: &str,
        now: DateTime,
        stop: &AtomicBool,
        summary: &mut RoundSummary,
    ) -> Result<(), TxnError> {
        let limit = i64::try_from(self.options.batch_size.max(1)).unwrap_or(i64::MAX);
        let coll = self.env.collection(None, collection).await?;
        let mut holders: Vec<ObjectId> = coll
            .aggregate(vec![
                doc! { "$match": { fields::ACTIVE_TXN: { "$exists": true } } },
                doc! { "$group": { "_id": format!("${}", fields::ACTIVE_TXN) } },
                doc! { "$limit": limit.saturating_mul(SWEEP_CANDIDATES) },
            ])
            .await
            .map_err(|e| TxnError::database(None, "list the holders of held documents", e))?
            .try_collect::<Vec<Document>>()
            .await
            .map_err(|e| TxnError::database(None, "list the holders of held documents", e))?
            .iter()
            .filter_map(|d| d.get_object_id("_id").ok())
            .collect();
        if holders.is_empty() {
            return Ok(());
        }
        // Runners sharing a backlog would all list the same holders first and do each other's
        // work (a holder carries no claim of its own): each takes its page at random among the
        // candidates, so two runners on a large backlog mostly take different holders.
        if holders.len() > self.options.batch_size.max(1) {
            use rand::seq::SliceRandom;
            holders.shuffle(&mut rand::rng());
            holders.truncate(self.options.batch_size.max(1));
        }
        let store = &self.env.store;
        let statuses = match store.resolver().statuses(store, &holders).await {
            Ok(statuses) => statuses,
            // One record of a newer format fails the page's one read: read them one by one, and
            // leave the ones this release cannot read to a release that can.
            Err(e) if e.format_error().is_some() => {
                self.statuses_one_by_one(&holders, summary).await?
            }
            Err(source) => {
                return Err(TxnError::Resolve {
                    txn: holders[0],
                    source,
                })
            }
        };
        // Holds of an undecided transaction are the record pass's business (once it expires);
        // any other is resolved here, including holds left of a transaction whose record is an
        // aborted one put in place of a missing record (it lists no entries). Holders are
        // resolved `PARALLEL_DECISIONS` at a time, each one's documents in turn (the first
        // settles the holder's record, which the others then only read).
        let decided: Vec<ObjectId> = holders
            .into_iter()
            .filter(|h| !matches!(statuses.get(h), Some(TxnStatus::Pending { .. })))
            .collect();
        if decided.is_empty() {
            return Ok(());
        }
        let holders = self.claims.others_left_out(&self.env, decided, now).await?;
        let holders = self
            .undo_together(&coll, collection, holders, now, &statuses, limit, summary)
            .await?;
        let ended: Vec<ObjectId> = holders
            .into_iter()
            .filter(|h| !matches!(statuses.get(h), Some(TxnStatus::Pending { .. })))
            .collect();
        let coll = &coll;
        let mut swept = futures::stream::iter(ended)
            .map(|holder| async move {
                self.sweep_holder(coll, collection, holder, limit, now, stop)
                    .await
            })
            .buffer_unordered(PARALLEL_DECISIONS);
        // The first crash ends the sweep there, dropping the holders still at work, as the
        // death of the process would.
        while let Some(result) = swept.next().await {
            let (undone, skipped) = result?;
            summary.swept += undone;
            summary.skipped += skipped;
        }
        Ok(())
    }

    /// What the records of `holders` say, read one at a time; a holder whose record is of a
    /// newer format reads as undecided (its holds are left alone) and counts as skipped.
    async fn statuses_one_by_one(
        &self,
        holders: &[ObjectId],
        summary: &mut RoundSummary,
    ) -> Result<HashMap<ObjectId, TxnStatus>, TxnError> {
        let store = &self.env.store;
        let mut statuses = HashMap::new();
        for holder in holders {
            match store.resolver().statuses(store, &[*holder]).await {
                Ok(found) => statuses.extend(found),
                Err(e) if e.format_error().is_some() => {
                    tracing::warn!(txn = %holder, error = %e, "left to a release that reads its format");
                    summary.skipped += 1;
                    let never = DateTime::from_millis(i64::MAX);
                    statuses.insert(*holder, TxnStatus::Pending { deadline: never });
                }
                Err(source) => {
                    return Err(TxnError::Resolve {
                        txn: *holder,
                        source,
                    })
                }
            }
        }
        Ok(statuses)
    }

    /// Undoes together the holds in `collection` of the holders whose transaction did not commit
    /// (aborted, or without a record): their documents are read in one command, a record missing
    /// is replaced by an aborted one (so that no copy of it still on its way can arrive as
    /// staging), and every undo goes in one round of writes. Returns the holders left for the
    /// one-by-one path: committed ones, undecided ones, and any whose undo did not go through.
    #[allow(clippy::too_many_arguments)]
    async fn undo_together(
        &self,
        coll: &mongodb::Collection<Document>,
        collection: &str,
        holders: Vec<ObjectId>,
        now: DateTime,
        statuses: &HashMap<ObjectId, TxnStatus>,
        limit: i64,
        summary: &mut RoundSummary,
    ) -> Result<Vec<ObjectId>, TxnError> {
        let ended = |h: &ObjectId| {
            matches!(
                statuses.get(h),
                Some(TxnStatus::Aborted | TxnStatus::Absent)
            )
        };
        let (undo, mut left): (Vec<ObjectId>, Vec<ObjectId>) =
            holders.into_iter().partition(|h| ended(h));
        if undo.is_empty() {
            return Ok(left);
        }
        let fail = |e| TxnError::database(None, "read held documents", e);
        let held: Vec<Document> = coll
            .find(doc! { fields::ACTIVE_TXN: { "$in": undo.clone() } })
            .limit(limit.saturating_mul(4))
            .await
            .map_err(fail)?
            .try_collect()
            .await
            .map_err(fail)?;
        // Each hold with what it says; an unreadable one goes the one-by-one way.
        let mut holds: Vec<(ObjectId, Bson, held::Hold)> = Vec::new();
        let mut aside: HashSet<ObjectId> = HashSet::new();
        for doc in &held {
            let (Ok(holder), Some(id)) = (doc.get_object_id(fields::ACTIVE_TXN), doc.get("_id"))
            else {
                continue;
            };
            // A hold of a newer format goes the one-by-one way too, which refuses it.
            let newer = held::readable(doc, self.env.store.reads_format(), "").is_err();
            match held::read_hold(doc) {
                Ok(hold) if !newer => holds.push((holder, id.clone(), hold)),
                _ => {
                    aside.insert(holder);
                }
            }
        }
        // Records first, for the holders that have none: an aborted one, dated by the hold.
        let missing: HashMap<ObjectId, DateTime> = holds
            .iter()
            .filter(|(h, _, hold)| {
                matches!(statuses.get(h), Some(TxnStatus::Absent)) && !hold.never_commits()
            })
            .map(|(h, _, hold)| (*h, hold.exp))
            .collect();
        let store = &self.env.store;
        let missing: Vec<(ObjectId, DateTime)> = missing.into_iter().collect();
        match record::fence_records(store, &missing, now).await {
            Ok(written) => {
                // A record exists after all: another runner's aborted one (then undo as well),
                // or the transaction's own that arrived late (then alone).
                let found: Vec<ObjectId> = missing
                    .iter()
                    .map(|(h, _)| *h)
                    .filter(|h| !written.contains(h))
                    .collect();
                if !found.is_empty() {
                    let now_aborted = store
                        .resolver()
                        .statuses(store, &found)
                        .await
                        .unwrap_or_default();
                    aside.extend(
                        found
                            .into_iter()
                            .filter(|h| !matches!(now_aborted.get(h), Some(TxnStatus::Aborted))),
                    );
                }
            }
            Err(e) => {
                tracing::debug!(collection, error = %e, "could not write aborted records together; resolving their holds alone");
                aside.extend(missing.iter().map(|(h, _)| *h));
            }
        }
        let mut writes = Vec::new();
        let mut owners = Vec::new();
        for (h, id, hold) in &holds {
            if aside.contains(h) {
                continue;
            }
            self.env.point(Some(*h), failpoint::GC_SWEEP_BEFORE, 0)?;
            writes.push((coll.clone(), hold.undo(id, *h)));
            owners.push((*h, id.clone()));
        }
        let sent = write::run_together(store, &writes).await;
        for ((h, id), result) in owners.into_iter().zip(sent) {
            match result {
                Ok(1) => {
                    summary.swept += 1;
                    tracing::info!(collection, txn = %h, "undid a hold whose transaction had ended");
                }
                // Undone meanwhile (another runner), or the hold changed: nothing of ours to
                // count; a hold still there is met again next round.
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(collection, txn = %h, id = %id, error = %e, "an undo failed; resolving it alone");
                    aside.insert(h);
                }
            }
            self.env.point(Some(h), failpoint::GC_SWEEP_AFTER, 0)?;
        }
        left.extend(aside);
        Ok(left)
    }

    /// Resolves the holds of `holder` (an ended transaction) in `collection`, one document after
    /// another; returns how many it undid and how many failed (left for the next round). `Err`
    /// only for an injected crash or a failed read of the held documents.
    async fn sweep_holder(
        &self,
        coll: &mongodb::Collection<Document>,
        collection: &str,
        holder: ObjectId,
        limit: i64,
        now: DateTime,
        stop: &AtomicBool,
    ) -> Result<(usize, usize), TxnError> {
        let held: Vec<Document> = coll
            .find(doc! { fields::ACTIVE_TXN: holder })
            .projection(doc! { "_id": 1 })
            .limit(limit)
            .await
            .map_err(|e| TxnError::database(None, "find held documents", e))?
            .try_collect()
            .await
            .map_err(|e| TxnError::database(None, "find held documents", e))?;
        let (mut undone, mut skipped) = (0, 0);
        for doc in held {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            let Some(id) = doc.get("_id") else {
                continue;
            };
            match self.undo_orphan(collection, id, holder, now).await {
                Ok(true) => {
                    undone += 1;
                    tracing::info!(collection, txn = %holder, "undid a hold whose transaction had ended");
                }
                Ok(false) => {}
                Err(crash) if crash.is_crash() => return Err(crash),
                Err(e) => {
                    tracing::warn!(collection, txn = %holder, error = %e, "GC could not resolve a hold; retrying next round");
                    skipped += 1;
                }
            }
        }
        Ok((undone, skipped))
    }

    /// Resolves the hold of `holder` (a decided or absent transaction) on `id`: a hold whose
    /// record is absent is taken for abandoned (an aborted record is put in place of the missing
    /// one first); says whether this call undid the hold.
    async fn undo_orphan(
        &self,
        collection: &str,
        id: &Bson,
        holder: ObjectId,
        now: DateTime,
    ) -> Result<bool, TxnError> {
        let store = &self.env.store;
        let hold_error = |source| TxnError::hold(Some(holder), collection, id, holder, source);
        self.env
            .point(Some(holder), failpoint::GC_SWEEP_BEFORE, 0)?;
        let (_, undone) = resolve::settle_at(store, collection, id, holder, Some(now))
            .await
            .map_err(hold_error)?;
        self.env.point(Some(holder), failpoint::GC_SWEEP_AFTER, 0)?;
        // Counted only when this round undid it: a hold that went meanwhile (its transaction
        // finished) or that was finished here for a committed transaction is no orphan.
        Ok(undone)
    }

    /// Resolves one transaction now if it has expired (used by tools and tests): `true` if this
    /// call finished or rolled it back, `false` if it had not expired or has no record (it ended
    /// and was cleaned up, or never existed: the two cannot be told apart, and neither needs
    /// anything done).
    pub async fn resolve(&self, txn: ObjectId) -> Result<bool, TxnError> {
        self.check()?;
        let now = self.env.now(Some(txn)).await?;
        let resolution = expired::resolve_expired(&self.env, txn, now).await?;
        Ok(matches!(
            resolution,
            Resolution::Finished | Resolution::RolledBack
        ))
    }
}
