//! Stamps: a batch's place in its service's order, drawn from the service's counter before the
//! batch is inserted; and stamping a batch again, after everything of its service, when a batch
//! added later went ahead of it (its adder's check, or a claimant finding it passed).

use bson::{doc, DateTime, Document};
use mongodb::options::ReturnDocument;

use crate::queue::db::{check_service, db_error, guarded, now};
use crate::queue::error::QueueError;
use crate::queue::model::{Place, Strategy};
use crate::queue::Batches;
use crate::repo::format;
use crate::repo::names::shown;
use crate::server::codes;

/// A stamp drawn from a service's counter, and the service's strategy.
pub(crate) struct Drawn {
    pub at: DateTime,
    pub strategy: Strategy,
}

/// Draws a stamp for batch `header` of `service` from the service's counter (`newest`, which
/// it raises to the stamp), in one write: one millisecond after the newest stamp given so far,
/// after the batch in the slot (unless it is this one) and after the mark, and no earlier than
/// the server's time as estimated here. Stamps of a service are unique and rise in the order
/// they are drawn. The service's strategy is read in the same write (it is fixed from the
/// first draw on).
pub(crate) async fn draw(
    queue: &Batches,
    service: &str,
    header: &str,
    writes: i64,
) -> Result<Drawn, QueueError> {
    let now = now(queue).await?;
    // A missing field adds up to null, which `$max` leaves out.
    let stamp = doc! { "$max": [
        { "$add": ["$newest", 1] },
        now,
        { "$add": ["$mark_at", 1] },
        { "$cond": [{ "$ne": ["$holder.header", header] }, { "$add": ["$holder.at", 1] }, null] },
    ] };
    let mut tries = 0;
    let drawn = loop {
        tries += 1;
        let drawn = queue
            .services
            .find_one_and_update(
                guarded(queue, doc! { "_id": service }),
                format::mark_pipeline(vec![doc! { "$set": { "newest": stamp.clone() } }], writes),
            )
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await;
        match drawn {
            Ok(drawn) => break drawn,
            // Two first draws of a service at once: the loser's upsert finds the document
            // made when it draws again. Or the service is of a newer format (the guard did not
            // match it, so the upsert tried to make it): refused.
            Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) => {
                let found = queue
                    .services
                    .find_one(doc! { "_id": service })
                    .await
                    .map_err(|e| db_error(queue, header, "draw a stamp", e))?;
                if let Some(found) = &found {
                    check_service(queue, found)?;
                }
                if tries >= 2 {
                    return Err(db_error(queue, header, "draw a stamp", e));
                }
            }
            Err(e) => return Err(db_error(queue, header, "draw a stamp", e)),
        }
    };
    let malformed = |reason: String| QueueError::Malformed {
        collection: queue.name.clone(),
        header: header.to_string(),
        reason,
    };
    let drawn = drawn.ok_or_else(|| {
        malformed(format!(
            "the service {} vanished while drawing a stamp",
            shown(service)
        ))
    })?;
    let at = drawn.get_datetime("newest").ok().copied().ok_or_else(|| {
        malformed(format!(
            "the service {} has no newest stamp after drawing one",
            shown(service)
        ))
    })?;
    let strategy = Strategy::parse(drawn.get_str("strategy").ok()).ok_or_else(|| {
        malformed(format!(
            "the service {} has an unknown strategy",
            shown(service)
        ))
    })?;
    Ok(Drawn { at, strategy })
}

/// Stamps the batch at `place` again, after every stamp drawn for `service`, dropping any word
/// of the ledger it carries: only while it is still at `place`, with no submitter and no live
/// claim on it, and `condition` (the caller's terms on its status) holds. The new stamp, when it
/// was stamped. Adders, and claimants that find a batch passed, move batches this way.
pub(crate) async fn stamp_again(
    queue: &Batches,
    service: &str,
    place: &Place,
    condition: Document,
    writes: i64,
) -> Result<Option<DateTime>, QueueError> {
    let header = place.header.as_str();
    let again = draw(queue, service, header, writes).await?.at;
    let now = now(queue).await?;
    let mut filter = doc! {
        "_id": header,
        "created_at": DateTime::from_millis(place.at),
        "submitted": false,
        "$nor": [{ "claim.until": { "$gte": now } }],
    };
    filter.extend(condition);
    let stamped = queue
        .coll
        .update_one(
            guarded(queue, filter),
            format::mark_update(
                doc! { "$set": { "created_at": again }, "$unset": { "status": "" } },
                writes,
            ),
        )
        .await
        .map_err(|e| db_error(queue, header, "stamp again", e))?;
    Ok((stamped.matched_count == 1).then_some(again))
}
