//! Resolving one held document: what readers see of it, and how a writer that meets it gets it
//! out of the way. Everything here works from the document's own hold and the holder's record
//! status (see the folder's doc for why that suffices); whole transactions are the transaction
//! layer's.

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use mongodb::Collection;

use crate::repo::fields::{self, SystemFields};
use crate::repo::hold::held::{self, Hold, HoldKind};
use crate::repo::hold::record;
use crate::repo::hold::tombstone;
use crate::repo::hold::write;
use crate::repo::outcome::{HoldError, TxnStatus};
use crate::repo::store::Store;

/// The committed value of a stored document.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Committed {
    /// This document (system fields included; no hold).
    Live(Document),
    /// A tombstone at this version.
    Deleted(i64),
    /// Nothing: the id is free.
    Absent,
}

/// How many times a read follows a document that changed while it was being resolved.
const MAX_REREADS: usize = 8;

/// The committed value of `stored` (read from `coll`), looking up its holder if it has one.
pub(crate) async fn committed(
    store: &Store,
    coll: &str,
    mut stored: Document,
) -> Result<Committed, HoldError> {
    for _ in 0..MAX_REREADS {
        let sys = SystemFields::read(&stored).map_err(HoldError::new)?;
        if sys.is_deleted() {
            return Ok(Committed::Deleted(sys.version));
        }
        let Some(holder) = sys.active_txn else {
            return Ok(Committed::Live(stored));
        };
        held::readable(&stored, store.reads_format(), coll)?;
        let hold = held::read_hold(&stored).map_err(HoldError::new)?;
        // A fence, or a creation stamped too late, is never part of a commit.
        if hold.never_commits() {
            return Ok(pre(&hold, &stored));
        }
        // A reader needs the outcome, not to decide it: read in a bounded number of commands.
        let status = store
            .inner
            .resolver
            .statuses(store, &[holder])
            .await?
            .remove(&holder)
            .unwrap_or(TxnStatus::Absent);
        match status {
            TxnStatus::Committed if sys.deleting => return Ok(Committed::Deleted(sys.version)),
            TxnStatus::Committed => {
                let mut doc = stored;
                doc.remove(fields::ACTIVE_TXN);
                doc.remove(fields::HOLD);
                return Ok(Committed::Live(doc));
            }
            TxnStatus::Pending { .. } | TxnStatus::Aborted => return Ok(pre(&hold, &stored)),
            TxnStatus::Absent => {
                // The holder ended between the two reads (its record goes only after its holds),
                // or this hold outlived it: only a fresh read tells which.
                let id = stored.get("_id").cloned().unwrap_or(Bson::Null);
                match reread(store, coll, &id).await? {
                    None => return Ok(Committed::Absent),
                    Some(fresh) if same_hold(&fresh, holder) => return Ok(pre(&hold, &fresh)),
                    Some(fresh) => stored = fresh,
                }
            }
        }
    }
    Err(HoldError::new(
        "the document kept changing while its holder was being looked up",
    ))
}

fn pre(hold: &Hold, stored: &Document) -> Committed {
    match hold.pre_image(stored) {
        Some(pre) => Committed::Live(pre),
        None => Committed::Absent,
    }
}

fn same_hold(doc: &Document, holder: ObjectId) -> bool {
    doc.get_object_id(fields::ACTIVE_TXN).ok() == Some(holder)
}

async fn reread(store: &Store, coll: &str, id: &Bson) -> Result<Option<Document>, HoldError> {
    store
        .protocol_collection(coll)
        .await
        .map_err(|e| HoldError::database("reading the held document", e))?
        .find_one(doc! { "_id": id.clone() })
        .await
        .map_err(|e| HoldError::database("reading the held document", e))
}

/// What a writer that met a held document should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    /// The hold was resolved (by us or meanwhile): try the write again now.
    Freed,
    /// The holder is alive and within its deadline: wait for it.
    Live,
}

/// How long a writer waits for the record of a hold whose record is absent before deciding that
/// it is not coming. A record sent with its applies arrives within milliseconds; one this late
/// was delayed in the network, and its transaction is aborted rather than waited on.
pub(crate) const ABSENT_GRACE: std::time::Duration = std::time::Duration::from_millis(250);

/// Resolves the hold of `holder` on document `id` of `coll` if its outcome is decided or its
/// deadline (server time) has passed; otherwise says to wait.
pub(crate) async fn settle(
    store: &Store,
    coll: &str,
    id: &Bson,
    holder: ObjectId,
) -> Result<Settled, HoldError> {
    settle_at(store, coll, id, holder, None)
        .await
        .map(|(settled, _)| settled)
}

/// [`settle`] as if the server's time were `now` (`None`: ask the clock).
///
/// - A hold of an undecided transaction waits until its deadline (passed on `hello`'s clock or on
///   the records' own, whichever gets there first); after it, the transaction is decided
///   (committed if every participant is in place, else fenced and aborted).
/// - A hold of a committed transaction is finished, one of an aborted transaction undone.
/// - A hold whose record is absent may belong to a transaction whose record is still on its way
///   (the record and the applies are sent together). It is waited on for [`ABSENT_GRACE`] of this
///   process's own time (a GC, which passes `now`, does not wait), or until the hold's deadline;
///   then an aborted record is put in the missing one's place, so that no copy of the record can
///   arrive as staging any more (a coordinator whose record was that late then finds it aborted
///   and rolls back), and the hold is undone.
/// - A fence is removed once its transaction is decided or gone.
///
/// The flag says whether this call itself undid the hold (the hold of a transaction that did not
/// commit): a hold found gone, or finished for a committed transaction, is not one.
pub(crate) async fn settle_at(
    store: &Store,
    coll: &str,
    id: &Bson,
    holder: ObjectId,
    now: Option<DateTime>,
) -> Result<(Settled, bool), HoldError> {
    let Some((_, stored)) = held(store, coll, id, holder).await? else {
        return Ok((Settled::Freed, false));
    };
    held::readable(&stored, store.reads_format(), coll)?;
    let hold = held::read_hold(&stored).map_err(HoldError::new)?;
    let resolver = &store.inner.resolver;
    let mut status = resolver.status(store, holder).await?;
    let expired = |deadline: DateTime| async move {
        let now = match now {
            Some(now) => now,
            None => store
                .now()
                .await
                .map_err(|e| HoldError::new(e.to_string()))?,
        };
        Ok::<_, HoldError>((deadline <= now).then_some(now))
    };
    match status {
        TxnStatus::Pending { deadline } => {
            let now = match expired(deadline).await? {
                Some(now) => now,
                // The records' clock, which guards the abort, may be ahead of `hello`'s.
                None => match records_clock(store, holder).await? {
                    Some(now) if deadline <= now => now,
                    _ => return Ok((Settled::Live, false)),
                },
            };
            status = resolver.abort_expired(store, holder, now).await?;
        }
        TxnStatus::Absent if !hold.never_commits() => {
            let patient = now.is_none() && store.absent_for(holder) < ABSENT_GRACE;
            if patient && expired(hold.exp).await?.is_none() {
                return Ok((Settled::Live, false));
            }
            status = record::fence_record(store, holder, hold.exp).await?;
        }
        _ => {}
    }
    match status {
        TxnStatus::Pending { .. } => Ok((Settled::Live, false)),
        TxnStatus::Committed if !hold.never_commits() => {
            roll_forward(store, coll, id, holder).await?;
            Ok((Settled::Freed, false))
        }
        TxnStatus::Committed | TxnStatus::Aborted | TxnStatus::Absent => {
            let undone = roll_back(store, coll, id, holder).await?;
            Ok((Settled::Freed, undone))
        }
    }
}

/// The time on the records' clock, read through the record of `holder` (`None`: it has none).
async fn records_clock(store: &Store, holder: ObjectId) -> Result<Option<DateTime>, HoldError> {
    record::clock(&record::records(store).await?, doc! { "_id": holder })
        .await
        .map_err(|e| HoldError::database("reading the records' clock", e))
}

/// The protocol's handle on `coll` and the document `id` as `holder` still holds it, if it does.
async fn held(
    store: &Store,
    coll: &str,
    id: &Bson,
    holder: ObjectId,
) -> Result<Option<(Collection<Document>, Document)>, HoldError> {
    let collection = store
        .protocol_collection(coll)
        .await
        .map_err(|e| HoldError::database("reading the held document", e))?;
    let found = collection
        .find_one(held::held_by(id, holder))
        .await
        .map_err(|e| HoldError::database("reading the held document", e))?;
    Ok(found.map(|doc| (collection, doc)))
}

/// Undoes the hold of `holder` on `id`, from the hold the document carries; says whether there
/// was one to undo.
pub(crate) async fn roll_back(
    store: &Store,
    coll: &str,
    id: &Bson,
    holder: ObjectId,
) -> Result<bool, HoldError> {
    let Some((collection, held)) = held(store, coll, id, holder).await? else {
        return Ok(false);
    };
    held::readable(&held, store.reads_format(), coll)?;
    let undo = held::read_hold(&held)
        .map_err(HoldError::new)?
        .undo(id, holder);
    let undone = write::run(&collection, &undo)
        .await
        .map_err(|e| HoldError::database("undoing the hold", e))?;
    tracing::debug!(collection = coll, txn = %holder, "undid a hold");
    Ok(undone == 1)
}

/// Makes the committed change of `holder` on `id` final.
pub(crate) async fn roll_forward(
    store: &Store,
    coll: &str,
    id: &Bson,
    holder: ObjectId,
) -> Result<(), HoldError> {
    let Some((collection, held)) = held(store, coll, id, holder).await? else {
        return Ok(());
    };
    let sys = SystemFields::read(&held).map_err(HoldError::new)?;
    held::readable(&held, store.reads_format(), coll)?;
    let hold = held::read_hold(&held).map_err(HoldError::new)?;
    if hold.never_commits() {
        // A fence carries no change to make final, and a creation stamped too late is no part
        // of the commit (it can only be a copy that arrived after the committed one was
        // finished and, since, deleted and purged): either only goes.
        roll_back(store, coll, id, holder).await?;
        return Ok(());
    }
    let finished = if hold.op == HoldKind::Delete {
        tombstone::write_tombstone(
            store,
            &collection,
            held::applied_by(id, holder),
            id,
            sys.schema_version,
            sys.version,
        )
        .await
    } else {
        write::run(&collection, &held::finish(id, holder)).await
    };
    finished.map_err(|e| HoldError::database("finishing the hold", e))?;
    tracing::debug!(collection = coll, txn = %holder, "finished a committed hold");
    Ok(())
}
