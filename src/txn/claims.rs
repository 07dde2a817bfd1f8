//! A GC runner's claims on expired transaction records, so that several runners share a backlog
//! instead of each resolving all of it. A claim only saves work: every write of a resolution is
//! conditional, so two runners on one record still change each document once; a runner that dies
//! leaves its claims to run out after [`CLAIM_LEASE`].

use std::collections::HashSet;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use futures::TryStreamExt;
use mongodb::Collection;

use crate::server::clock;
use crate::txn::error::TxnError;
use crate::txn::recovery::Env;

/// How long a runner's claim on a page of expired records keeps other runners off it.
pub(crate) const CLAIM_LEASE: Duration = Duration::from_secs(60);

/// Record fields of a claim: who, and until when (server time).
const CLAIM: &str = "gc";
const CLAIM_BY: &str = "gc.by";
/// The stored path of the time a claim runs out (server time), for whoever looks for claims.
pub(crate) const CLAIM_UNTIL: &str = "gc.until";

/// The claim stored on a record, if it carries one: the runner's name and when its claim runs
/// out (server time; a claim that ran out keeps nobody off the record, but stays stored until
/// the next runner claims it).
pub(crate) fn claim_of(record: &Document) -> Option<(ObjectId, DateTime)> {
    let claim = record.get_document(CLAIM).ok()?;
    Some((
        claim.get_object_id("by").ok()?,
        *claim.get_datetime("until").ok()?,
    ))
}

/// What [`Claims::take`] got of a page.
#[derive(Debug)]
pub(crate) struct Taken {
    /// The records this runner claimed, read again whole.
    pub(crate) mine: Vec<Document>,
    /// How many records of the page another runner's claim keeps this one off (dead or alive:
    /// nobody can tell from here), left to that runner until their claims run out.
    pub(crate) others: usize,
}

/// The claims of one GC runner, under its own name.
#[derive(Debug, Clone)]
pub(crate) struct Claims {
    runner: ObjectId,
}

impl Claims {
    /// Claims under a new runner name.
    pub(crate) fn new() -> Claims {
        Claims {
            runner: ObjectId::new(),
        }
    }

    /// Claims the records of `page` that no other runner has claimed (or whose claim has run out
    /// by `now`) and returns those, read again, with how many another runner's claim kept (a
    /// record gone meanwhile counts in neither).
    pub(crate) async fn take(
        &self,
        env: &Env,
        records: &Collection<Document>,
        page: Vec<Document>,
        now: DateTime,
    ) -> Result<Taken, TxnError> {
        let ids: Vec<Bson> = page.iter().filter_map(|d| d.get("_id").cloned()).collect();
        // The lease runs from the server's real time even in a round run as if it were later
        // (tools and tests): a claim is about this runner's work, not about the deadlines.
        let until = clock::plus(env.now(None).await?, CLAIM_LEASE);
        let fail = |e| TxnError::database(None, "claim expired transactions", e);
        records
            .update_many(
                doc! {
                    "_id": { "$in": ids.clone() },
                    "$or": [
                        { CLAIM_UNTIL: { "$exists": false } },
                        { CLAIM_UNTIL: { "$lte": now } },
                        { CLAIM_BY: self.runner },
                    ],
                },
                doc! { "$set": { CLAIM_BY: self.runner, CLAIM_UNTIL: until } },
            )
            .await
            .map_err(fail)?;
        // One command for both: this runner's records whole, the others' claims alone (their
        // entries are most of a page's bytes, and are another runner's business). A record let
        // go meanwhile has no claim at all: `$ifNull` makes that a null rather than a missing
        // value inside the new root (which the local test server cannot build).
        let mine = doc! { "$eq": [format!("${CLAIM_BY}"), self.runner] };
        let claim = doc! { "$ifNull": [format!("${CLAIM}"), Bson::Null] };
        let read: Vec<Document> = records
            .aggregate(vec![
                doc! { "$match": { "_id": { "$in": ids } } },
                doc! { "$replaceRoot": { "newRoot": {
                    "$cond": [mine, "$$ROOT", { "_id": "$_id", CLAIM: claim }],
                } } },
            ])
            .batch_size(u32::try_from(page.len()).unwrap_or(u32::MAX))
            .await
            .map_err(fail)?
            .try_collect()
            .await
            .map_err(fail)?;
        let (mine, others): (Vec<Document>, Vec<Document>) = read
            .into_iter()
            .partition(|d| claim_of(d).is_some_and(|(by, _)| by == self.runner));
        let others = others
            .iter()
            .filter(|d| claim_of(d).is_some_and(|(_, until)| until > now))
            .count();
        Ok(Taken { mine, others })
    }

    /// Lets go at once of this runner's claims on the records `left` (those a round could not
    /// resolve), for whoever comes next.
    pub(crate) async fn let_go(
        &self,
        records: &Collection<Document>,
        left: Vec<ObjectId>,
    ) -> Result<(), TxnError> {
        if left.is_empty() {
            return Ok(());
        }
        records
            .update_many(
                doc! { "_id": { "$in": left }, CLAIM_BY: self.runner },
                doc! { "$unset": { CLAIM: "" } },
            )
            .await
            .map_err(|e| TxnError::database(None, "let go of claims", e))?;
        Ok(())
    }

    /// `holders` less those whose record another runner has claimed (its claim not run out by
    /// `now`): that runner's record pass is resolving them at this moment, together, and a sweep
    /// of them as well only repeats its writes one by one.
    pub(crate) async fn others_left_out(
        &self,
        env: &Env,
        holders: Vec<ObjectId>,
        now: DateTime,
    ) -> Result<Vec<ObjectId>, TxnError> {
        let fail = |e| TxnError::database(None, "read the claims on held documents' records", e);
        let claimed: HashSet<ObjectId> = env
            .records(None)
            .await?
            .find(doc! {
                "_id": { "$in": holders.clone() },
                CLAIM_UNTIL: { "$gt": now },
                CLAIM_BY: { "$ne": self.runner },
            })
            .projection(doc! { "_id": 1 })
            .await
            .map_err(fail)?
            .try_collect::<Vec<Document>>()
            .await
            .map_err(fail)?
            .iter()
            .filter_map(|d| d.get_object_id("_id").ok())
            .collect();
        Ok(holders
            .into_iter()
            .filter(|h| !claimed.contains(h))
            .collect())
    }
}
