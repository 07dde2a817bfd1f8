//! The rate limiter's operations: define, reserve (try once, or wait), settle, read.
//!
//! Every operation reads the stored format its store writes before its first write, and every
//! write marks the limiter it rewrites with it (nothing for format 1) and matches the limiter
//! only while it is of a format this store reads (`repo::format`); every reading of a limiter
//! refuses one of a newer format, so a write the guard kept from matching ends in that typed
//! refusal ([`RateLimitError::Format`]), and nothing is written.
//!
//! (Over 700 lines: each operation is one conditional write and the read that explains
//! its refusal, and the pure parts, the writes' filters and updates, are already in `plan`.)

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bson::oid::ObjectId;
use bson::{doc, DateTime, Document};
use futures::future::join_all;
use futures::TryStreamExt;
use mongodb::options::ReturnDocument;
use tokio::sync::Notify;

use crate::metrics;
use crate::ratelimit::error::RateLimitError;
use crate::ratelimit::limit::{Attempt, CallReservation, Grant, Limit, Priority, Settled, Usage};
use crate::ratelimit::limit::{Phase, Settling};
use crate::ratelimit::plan::{
    self, grant_update, queue_update, settle_update, Out, Ticket, View, Window,
};
use crate::ratelimit::RateLimits;
use crate::server::clock::plus;
use crate::server::codes;

use crate::repo::fields::MAX_NAME;
use crate::repo::format;

pub(crate) use crate::repo::names::shown;

/// Times a grant or a settlement is sent when its reply is lost.
const TRIES: u32 = 3;

/// A waiting bulk caller's key and its places in the queues it joined.
struct Queue {
    key: String,
    tickets: HashMap<String, Ticket>,
}

/// How one limiter answered a grant.
enum One {
    /// Granted, by the limit the limiter has now (which a process may have cached otherwise,
    /// if the limiter was deleted and defined again).
    Granted(Grant, Limit),
    /// Refused; the limiter as the refusing write left it, which says when there will be room.
    Refused { view: Box<View> },
}

fn coll_name(rate: &RateLimits) -> &str {
    &rate.options.collection
}

/// Refuses limiter document `doc` when it is of a stored format newer than this store reads:
/// its counts could mean something else there (see `repo::format`).
pub(crate) fn check_format(rate: &RateLimits, doc: &Document) -> Result<(), RateLimitError> {
    format::check_doc(doc, rate.store.reads_format(), coll_name(rate)).map_err(RateLimitError::from)
}

/// `filter` of a write on a limiter, matching it only while it is of a format this store reads.
fn guarded(rate: &RateLimits, filter: Document) -> Document {
    format::guard(filter, rate.store.reads_format())
}

/// The format this store writes limiters in, read before an operation's first write: an
/// instance of an older release in a fleet switched to a newer format writes nothing.
async fn writes(rate: &RateLimits) -> Result<i64, RateLimitError> {
    Ok(rate.store.writes_format().await?)
}

/// After an upsert on `name` collided with an existing limiter (the guard keeps one of a newer
/// format from matching, so the server tried to insert): the typed refusal if that is why.
async fn refuse_newer(rate: &RateLimits, name: &str) -> Result<(), RateLimitError> {
    let found = rate
        .coll
        .find_one(doc! { "_id": name })
        .await
        .map_err(|e| db_error(rate, name, "read", e))?;
    match found {
        Some(doc) => check_format(rate, &doc),
        None => Ok(()),
    }
}

fn db_error(
    rate: &RateLimits,
    limiter: &str,
    op: &'static str,
    e: mongodb::error::Error,
) -> RateLimitError {
    RateLimitError::database(coll_name(rate), limiter, op, e)
}

/// The body of [`RateLimits::sweep`].
pub(crate) async fn sweep(rate: &RateLimits) -> Result<u64, RateLimitError> {
    let names: Vec<Document> = rate
        .coll
        .find(doc! {})
        .projection(doc! { "_id": 1 })
        .await
        .map_err(|e| db_error(rate, "*", "list the limiters", e))?
        .try_collect()
        .await
        .map_err(|e| db_error(rate, "*", "list the limiters", e))?;
    let writes = writes(rate).await?;
    let mut changed = 0;
    // A limiter of a newer format is left alone (the guard does not match it), to the
    // instances that read it.
    for name in names.iter().filter_map(|d| d.get_str("_id").ok()) {
        let result = rate
            .coll
            .update_one(
                guarded(rate, doc! { "_id": name }),
                format::mark_pipeline(plan::prune_update(), writes),
            )
            .await
            .map_err(|e| db_error(rate, name, "prune the limiter", e))?;
        changed += result.modified_count;
    }
    Ok(changed)
}

/// The body of [`RateLimits::define`].
pub(crate) async fn define(
    rate: &RateLimits,
    name: &str,
    limit: Limit,
) -> Result<(), RateLimitError> {
    check_name(rate, name)?;
    if let Some(reason) = limit.problem() {
        return Err(RateLimitError::InvalidLimit {
            collection: coll_name(rate).to_string(),
            limiter: name.to_string(),
            reason,
        });
    }
    let writes = writes(rate).await?;
    let mut fields = limit.to_fields();
    fields.extend(plan::initial_fields(&limit));
    format::mark(&mut fields, writes);
    let mut attempt = 0;
    let stored = loop {
        attempt += 1;
        let result = rate
            .coll
            .find_one_and_update(
                guarded(rate, doc! { "_id": name }),
                doc! { "$setOnInsert": fields.clone() },
            )
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await;
        match result {
            Ok(Some(doc)) => break doc,
            Ok(None) => {}
            // Two definers raced on the upsert (the loser finds the winner's document), or
            // the limiter is of a newer format (refused here).
            Err(e) if codes::error_code(&e) == Some(codes::DUPLICATE_KEY) && attempt < 3 => {
                refuse_newer(rate, name).await?;
            }
            Err(e) => return Err(db_error(rate, name, "define", e)),
        }
        if attempt >= 3 {
            return Err(malformed(rate, name, "the upsert returned no document"));
        }
    };
    match Limit::from_fields(&stored) {
        Some(existing) if existing == limit => {
            if !stored.contains_key("slot_ms") {
                // Written by an earlier mongotx: its log of reservations becomes slots.
                rate.coll
                    .update_one(
                        guarded(rate, doc! { "_id": name, "slot_ms": { "$exists": false } }),
                        format::mark_pipeline(plan::upgrade_update(&limit), writes),
                    )
                    .await
                    .map_err(|e| db_error(rate, name, "move to slots", e))?;
            } else if !stored.contains_key("log") {
                // Moved to slots (or created) by a mongotx that left no log: workers of the
                // version before slots would count an empty one.
                rate.coll
                    .update_one(
                        guarded(rate, doc! { "_id": name, "log": { "$exists": false } }),
                        format::mark_update(
                            doc! { "$set": { "log": plan::closed_log(&limit) } },
                            writes,
                        ),
                    )
                    .await
                    .map_err(|e| db_error(rate, name, "close the log", e))?;
            }
            cache(rate, name, limit);
            Ok(())
        }
        Some(existing) => Err(RateLimitError::LimitMismatch {
            collection: coll_name(rate).to_string(),
            limiter: name.to_string(),
            existing: existing.to_string(),
            wanted: limit.to_string(),
        }),
        None => Err(malformed(
            rate,
            name,
            "its limit fields are missing or out of range",
        )),
    }
}

/// The body of [`RateLimits::limit`].
pub(crate) async fn limit(rate: &RateLimits, name: &str) -> Result<Limit, RateLimitError> {
    if let Some(limit) = cached(rate, name) {
        return Ok(limit);
    }
    check_name(rate, name)?;
    let doc = rate
        .coll
        .find_one(doc! { "_id": name })
        .projection(doc! { "slots": 0, "granted": 0, "settled": 0, "log": 0, "wait": 0 })
        .await
        .map_err(|e| db_error(rate, name, "read", e))?
        .ok_or_else(|| unknown(rate, name))?;
    check_format(rate, &doc)?;
    let limit = Limit::from_fields(&doc)
        .ok_or_else(|| malformed(rate, name, "its limit fields are missing or out of range"))?;
    cache(rate, name, limit);
    Ok(limit)
}

/// The body of [`RateLimits::usage`].
pub(crate) async fn usage(rate: &RateLimits, name: &str) -> Result<Usage, RateLimitError> {
    check_name(rate, name)?;
    Ok(read(rate, name).await?.usage())
}

/// The body of [`RateLimits::try_reserve`].
pub(crate) async fn try_reserve(
    rate: &RateLimits,
    limiters: &[&str],
    n: u32,
    priority: Priority,
) -> Result<Attempt, RateLimitError> {
    let limits = validate(rate, limiters, n, priority).await?;
    attempt(rate, &limits, n, priority, None).await
}

/// The body of [`RateLimits::reserve`].
pub(crate) async fn reserve(
    rate: &RateLimits,
    limiters: &[&str],
    n: u32,
    priority: Priority,
) -> Result<CallReservation, RateLimitError> {
    reserve_within(rate, limiters, n, priority, rate.options.max_wait).await
}

/// The body of [`RateLimits::reserve_within`].
pub(crate) async fn reserve_within(
    rate: &RateLimits,
    limiters: &[&str],
    n: u32,
    priority: Priority,
    max_wait: Duration,
) -> Result<CallReservation, RateLimitError> {
    let limits = validate(rate, limiters, n, priority).await?;
    let started = Instant::now();
    let mut queue = Queue {
        key: ObjectId::new().to_hex(),
        tickets: HashMap::new(),
    };
    let poll = poll(rate, shortest_window(&limits));
    // Whether it found no room at once (what the waits metric counts).
    let mut had_to_wait = false;
    let result = loop {
        let wakers: Vec<Arc<Notify>> = limits.iter().map(|(name, _)| waker(rate, name)).collect();
        let mut woken: Vec<_> = wakers.iter().map(|w| Box::pin(w.notified())).collect();
        for w in &mut woken {
            w.as_mut().enable();
        }
        let queued = (priority == Priority::Bulk).then_some(&mut queue);
        let attempt = match attempt(rate, &limits, n, priority, queued).await {
            Ok(attempt) => attempt,
            Err(e) => break Err(e),
        };
        let after = match attempt {
            Attempt::Granted(reservation) => break Ok(reservation),
            Attempt::Wait { after, .. } => after,
        };
        had_to_wait = true;
        let waited = started.elapsed();
        if waited >= max_wait {
            break Err(RateLimitError::TimedOut {
                collection: coll_name(rate).to_string(),
                limiters: limiters.join(","),
                requested: n,
                waited,
            });
        }
        let sleep = after.min(poll).min(max_wait - waited);
        tokio::select! {
            _ = tokio::time::sleep(sleep) => {}
            _ = futures::future::select_all(woken) => {}
        }
    };
    if !queue.tickets.is_empty() {
        // Best effort, as leaving is: if the format is refused now, the entries expire.
        if let Ok(writes) = rate.store.writes_format().await {
            leave_queues(rate, writes, &queue.key, queue.tickets.keys()).await;
        }
    }
    if had_to_wait {
        let outcome = match &result {
            Ok(_) => "granted",
            Err(RateLimitError::TimedOut { .. }) => "timed_out",
            Err(_) => "failed",
        };
        metrics::ratelimit_waited(outcome, started.elapsed());
    }
    result
}

/// The body of [`RateLimits::settle`].
pub(crate) async fn settle(
    rate: &RateLimits,
    reservation: &CallReservation,
    made: u32,
) -> Result<Settled, RateLimitError> {
    if made > reservation.calls {
        return Err(RateLimitError::MadeExceedsReserved {
            reservation: reservation.id,
            made,
            reserved: reservation.calls,
        });
    }
    if reservation.namespace != rate.coll.namespace().to_string() {
        // Granted by another collection of limiters: its slots mean nothing here.
        for name in &reservation.limiters {
            rate.limit(name).await?;
        }
        return Err(RateLimitError::UnknownReservation {
            collection: coll_name(rate).to_string(),
            limiter: reservation.limiters.join(","),
            reservation: reservation.id,
        });
    }
    // Read before this call owns the settlement: refused here, it leaves it to another call.
    let writes = writes(rate).await?;
    // One settlement per reservation, whichever clone sends it: this call owns it from here,
    // and another call is refused without a write, unless this one fails and it reports the
    // same calls made (then it sends the same settlement again).
    {
        let mut settling = lock(&reservation.settling);
        match settling.phase {
            Phase::Open => {}
            Phase::Sent { made: first } if first == made => {}
            Phase::Sending { made: first }
            | Phase::Sent { made: first }
            | Phase::Done { made: first } => {
                return Err(RateLimitError::AlreadySettled {
                    collection: coll_name(rate).to_string(),
                    limiter: reservation.limiters.join(","),
                    reservation: reservation.id,
                    made: first,
                })
            }
        }
        settling.phase = Phase::Sending { made };
    }
    // Dropped before it ends (the caller gave up on it), the settlement may still land: it
    // can be sent again, as after an error.
    let owner = Owner {
        settling: &reservation.settling,
        made,
    };
    let outcomes = join_all(
        reservation
            .limiters
            .iter()
            .zip(&reservation.grants)
            .enumerate()
            .map(|(i, (name, grant))| settle_one(rate, name, reservation, i, *grant, made, writes)),
    )
    .await;
    let mut settled = Settled::Returned {
        unused: reservation.calls - made,
    };
    let mut failure = None;
    for outcome in outcomes {
        match outcome {
            Ok(Settled::Expired) if settled != Settled::Unconfirmed => settled = Settled::Expired,
            Ok(Settled::Unconfirmed) => settled = Settled::Unconfirmed,
            Ok(_) => {}
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    if let Some(e) = failure {
        // Sent, and perhaps landed on some limiters: the same settlement may be sent again.
        return Err(e);
    }
    owner.done();
    // Only unused calls free room now; calls made keep theirs for a window, and waiters
    // already sleep until then.
    if made < reservation.calls {
        for name in &reservation.limiters {
            waker(rate, name).notify_waiters();
        }
    }
    Ok(settled)
}

fn lock(settling: &Mutex<Settling>) -> MutexGuard<'_, Settling> {
    // Every change leaves the state whole, so one left by a panicking task is still sound.
    settling.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The `settle` call that owns a reservation's settlement: unless it ends settled, the
/// settlement is left `Sent`, to be sent again by a call reporting the same calls made.
struct Owner<'a> {
    settling: &'a Mutex<Settling>,
    made: u32,
}

impl Owner<'_> {
    fn done(self) {
        lock(self.settling).phase = Phase::Done { made: self.made };
    }
}

impl Drop for Owner<'_> {
    fn drop(&mut self) {
        let mut settling = lock(self.settling);
        if settling.phase == (Phase::Sending { made: self.made }) {
            settling.phase = Phase::Sent { made: self.made };
        }
    }
}

/// Settles a reservation on one limiter (the `index`th of its limiters): one write, sent again
/// when its fate is unknown (an I/O error) or when it came outside its window of server time.
///
/// Each sending may apply only inside its window, which starts after the end of every earlier
/// sending's (`Track::after`, kept with the reservation across calls and clones), so two sendings
/// of the settlement can never both apply, whatever the network delays and however many
/// settlements the limiter has forgotten meanwhile. Before sending again after an I/O error, the
/// sender waits until the limiter's clock has passed the earlier sending's window (by the time
/// the limiter's last reply reported, advanced by this process's monotonic clock; a sending that
/// still comes too early is told so and changes nothing).
async fn settle_one(
    rate: &RateLimits,
    name: &str,
    reservation: &CallReservation,
    index: usize,
    grant: Grant,
    made: u32,
    writes: i64,
) -> Result<Settled, RateLimitError> {
    let key = reservation.id.to_hex();
    let send_window = i64::try_from(rate.options.send_window.as_millis()).unwrap_or(i64::MAX / 4);
    if let Some(outcome) = lock(&reservation.settling).tracks[index].outcome {
        // Settled there by an earlier call that failed on another limiter.
        return Ok(outcome);
    }
    // The limiter's clock as its last reply gave it (the grant's, at first), and when that
    // reply came: the estimate of that clock needs no round trip, and is the clock of the very
    // node that holds the limiter (a shard's clock may differ from what `hello` says).
    let mut replied = grant.clock;
    // Sendings whose fate is unknown, and sendings that came outside their window.
    let (mut unknown, mut outside) = (0, 0);
    loop {
        let (at, when) = replied;
        let mut now = at.saturating_add(i64::try_from(when.elapsed().as_millis()).unwrap_or(0));
        // After the end of every earlier sending's window, and the limit's skew more: a primary
        // change to a node whose clock is behind by up to the skew cannot bring an earlier
        // window back.
        let after = lock(&reservation.settling).tracks[index]
            .after
            .map(|a| a.saturating_add(grant.skew_ms));
        if let Some(after) = after.filter(|&a| now <= a) {
            let wait = u64::try_from(after - now + 1).unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(wait)).await;
            now = after + 1;
        }
        let window = Window {
            after,
            until: now.saturating_add(send_window),
        };
        let resend = {
            let mut settling = lock(&reservation.settling);
            let track = &mut settling.tracks[index];
            let resend = track.unknown > 0;
            // Counted as sent (and its fate unknown) before it leaves, in case this call is
            // dropped while it waits.
            track.after = Some(track.after.map_or(window.until, |a| a.max(window.until)));
            track.unknown += 1;
            resend
        };
        let update = settle_update(
            &key,
            reservation.calls,
            reservation.priority,
            grant,
            made,
            resend,
            Some(window),
        );
        let written = rate
            .coll
            .find_one_and_update(
                guarded(rate, doc! { "_id": name, "slot_ms": { "$exists": true } }),
                format::mark_pipeline(update, writes),
            )
            .projection(doc! { "out": 1, "read_at": 1 })
            .return_document(ReturnDocument::After)
            .await;
        let doc = match written {
            Ok(found) => {
                // The write ran: this sending's fate is known.
                lock(&reservation.settling).tracks[index].unknown -= 1;
                match found {
                    Some(doc) => doc,
                    None => return Err(absent(rate, name).await),
                }
            }
            Err(e) if crate::server::is_transient(&e) && unknown + 1 < TRIES => {
                unknown += 1;
                continue;
            }
            Err(e) => return Err(db_error(rate, name, "settle", e)),
        };
        let out = Out::of(&doc, &key)
            .ok_or_else(|| malformed(rate, name, "the settling write returned no outcome"))?;
        let outcome = if out.ok || out.seen {
            Some(Settled::Returned {
                unused: reservation.calls - made,
            })
        } else if out.lost {
            Some(Settled::Unconfirmed)
        } else if !out.here {
            // Its end's slot stopped counting: it aged out whole.
            Some(Settled::Expired)
        } else {
            None
        };
        if let Some(outcome) = outcome {
            lock(&reservation.settling).tracks[index].outcome = Some(outcome);
            return Ok(outcome);
        }
        if !(out.early || out.late) {
            return Err(malformed(
                rate,
                name,
                "the settling write neither applied nor said why",
            ));
        }
        // It came before its window (the estimate of the limiter's clock ran ahead) or after
        // it (a slow link, or an estimate behind): it did nothing. Send it again, by the
        // limiter's clock as this reply gives it.
        let at = doc
            .get_datetime("read_at")
            .map_err(|_| malformed(rate, name, "the server did not report its time (read_at)"))?;
        replied = (at.timestamp_millis(), Instant::now());
        outside += 1;
        if outside >= TRIES {
            return Err(RateLimitError::Contended {
                collection: coll_name(rate).to_string(),
                limiter: name.to_string(),
                what: "settle",
                tries: TRIES,
            });
        }
    }
}

/// Why a write on `name` found no limiter to write: none, one of a stored format newer than
/// this store reads (the write's guard kept it from matching), or one in an earlier shape.
async fn absent(rate: &RateLimits, name: &str) -> RateLimitError {
    match rate.coll.find_one(doc! { "_id": name }).await {
        Ok(None) => unknown(rate, name),
        Ok(Some(doc)) => match check_format(rate, &doc) {
            Err(newer) => newer,
            Ok(()) => match View::parse(&doc, DateTime::now()) {
                Err(reason) => malformed(rate, name, &reason),
                Ok(_) => malformed(rate, name, "it changed format while being written"),
            },
        },
        Err(e) => db_error(rate, name, "read", e),
    }
}

/// One grant on every limiter, all or nothing. A bulk caller that waits passes its
/// `queue`: limiters that refuse it queue it.
async fn attempt(
    rate: &RateLimits,
    limits: &[(String, Limit)],
    n: u32,
    priority: Priority,
    mut queue: Option<&mut Queue>,
) -> Result<Attempt, RateLimitError> {
    let writes = writes(rate).await?;
    let id = ObjectId::new();
    let sent = Instant::now();
    let single = limits.len() == 1;
    let answers = {
        let tickets = queue.as_deref().map(|q| &q.tickets);
        join_all(limits.iter().map(|(name, _)| {
            let ticket = tickets.and_then(|t| t.get(name));
            grant_one(rate, name, id, n, priority, ticket, single, writes)
        }))
        .await
    };
    let mut granted = Vec::new();
    let mut refused = Vec::new();
    let mut failure = None;
    for ((name, limit), answer) in limits.iter().zip(answers) {
        match answer {
            Ok(One::Granted(grant, now)) => {
                if now != *limit {
                    cache(rate, name, now);
                }
                granted.push((name, grant, now));
            }
            Ok(One::Refused { view }) => refused.push((name, limit, view)),
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    if failure.is_none() && refused.is_empty() {
        if let Some(q) = queue {
            if !single {
                leave_queues(rate, writes, &q.key, q.tickets.keys()).await;
            }
            q.tickets.clear();
        }
        // The limits the granting writes returned: a reservation's deadline is the hold its
        // limiters count it by.
        let hold = granted
            .iter()
            .map(|(_, _, l)| l.hold)
            .min()
            .unwrap_or_default();
        let counted_for = granted
            .iter()
            .map(|(_, _, l)| {
                l.hold - hold
                    + l.grace
                    + l.span()
                    + Duration::from_millis(u64::try_from(plan::slot_ms(l)).unwrap_or(u64::MAX / 4))
            })
            .max()
            .unwrap_or_default();
        return Ok(Attempt::Granted(CallReservation {
            id,
            namespace: rate.coll.namespace().to_string(),
            limiters: limits.iter().map(|(name, _)| name.clone()).collect(),
            grants: granted.iter().map(|(_, g, _)| *g).collect(),
            settling: Arc::new(Mutex::new(Settling::new(limits.len()))),
            calls: n,
            priority,
            deadline: sent + hold,
            counted_for,
        }));
    }
    // All or nothing: take back what was granted. No call was made under it.
    let key = id.to_hex();
    join_all(
        granted
            .iter()
            .map(|(name, grant, _)| withdraw(rate, name, &key, n, priority, *grant, writes)),
    )
    .await;
    for (name, _, _) in &granted {
        waker(rate, name).notify_waiters();
    }
    if let Some(e) = failure {
        return Err(e);
    }
    let mut at: Option<DateTime> = None;
    let mut after = Duration::ZERO;
    for (name, limit, view) in refused {
        let ttl = queue_ttl(rate, limit);
        let view = match queue.as_deref_mut() {
            None => view,
            Some(q) => {
                let queued = join_queue(rate, name, ttl, &q.key, n, writes).await?;
                if let Some(w) = queued.wait.iter().find(|w| w.key == q.key) {
                    let ticket = Ticket {
                        key: q.key.clone(),
                        since: w.since,
                        exp: w.exp,
                    };
                    q.tickets.insert(name.clone(), ticket);
                }
                Box::new(queued)
            }
        };
        let ticket = queue.as_deref().and_then(|q| q.tickets.get(name.as_str()));
        // Pending reservations are usually settled with their calls made, which frees room
        // sooner than their ends say: wake then, and look again.
        let when = view
            .likely_fits_at(n, priority, ticket)
            .unwrap_or_else(|| plus(view.now, poll(rate, shortest_window(limits))));
        let wait = Duration::from_millis(
            u64::try_from(when.timestamp_millis() - view.now.timestamp_millis()).unwrap_or(0),
        );
        if at.is_none() || wait > after {
            after = wait;
            at = Some(when);
        }
    }
    Ok(Attempt::Wait {
        at: at.unwrap_or_else(DateTime::now).to_chrono(),
        after,
    })
}

/// Asks `name` for `n` calls under reservation `id`: one write that answers with the
/// limiter, granted or not; sent again with the same key when its reply is lost (the
/// limiter then finds the earlier grant instead of counting it twice). `writes` is the format
/// the attempt read before its first write, the same for every limiter it asks.
#[allow(clippy::too_many_arguments)] // the grant's own inputs, and the attempt's format
async fn grant_one(
    rate: &RateLimits,
    name: &str,
    id: ObjectId,
    n: u32,
    priority: Priority,
    ticket: Option<&Ticket>,
    leave_queue: bool,
    writes: i64,
) -> Result<One, RateLimitError> {
    let key = id.to_hex();
    let leaving = ticket.filter(|_| leave_queue).map(|t| t.key.as_str());
    let mut round = 0;
    let doc = loop {
        round += 1;
        let update =
            format::mark_pipeline(grant_update(&key, n, priority, ticket, leaving), writes);
        let written = rate
            .coll
            .find_one_and_update(
                guarded(rate, doc! { "_id": name, "slot_ms": { "$exists": true } }),
                update,
            )
            // The recent grants and settlements stay on the server: `out` says what a caller
            // needs of them.
            .projection(doc! { "granted": 0, "settled": 0 })
            .return_document(ReturnDocument::After)
            .await;
        match written {
            Ok(Some(doc)) => break doc,
            Ok(None) => return Err(absent(rate, name).await),
            Err(e) if crate::server::is_transient(&e) && round < TRIES => {}
            Err(e) => return Err(db_error(rate, name, "reserve", e)),
        }
    };
    let received = Instant::now();
    let out = Out::of(&doc, &key)
        .ok_or_else(|| malformed(rate, name, "the granting write returned no outcome"))?;
    if out.ok {
        let limit = Limit::from_fields(&doc)
            .ok_or_else(|| malformed(rate, name, "its limit fields are missing or out of range"))?;
        return plan::granted(&doc, received)
            .map(|g| One::Granted(g, limit))
            .ok_or_else(|| {
                malformed(
                    rate,
                    name,
                    "a grant is missing from the recent grants it was added to",
                )
            });
    }
    Ok(One::Refused {
        view: Box::new(reading(rate, name, &doc)?),
    })
}

/// Puts (or keeps) a bulk caller in `name`'s queue and reads the limiter.
async fn join_queue(
    rate: &RateLimits,
    name: &str,
    ttl: Duration,
    key: &str,
    n: u32,
    writes: i64,
) -> Result<View, RateLimitError> {
    let now = rate
        .store
        .now()
        .await
        .map_err(|e| RateLimitError::Clock(Box::new(e)))?;
    let found = rate
        .coll
        .find_one_and_update(
            guarded(rate, doc! { "_id": name }),
            format::mark_update(queue_update(key, n, now, plus(now, ttl)), writes),
        )
        .return_document(ReturnDocument::After)
        .await
        .map_err(|e| db_error(rate, name, "queue", e))?;
    match found {
        Some(doc) => reading(rate, name, &doc),
        None => Err(absent(rate, name).await),
    }
}

/// Takes a caller out of the queues of `names` (best effort: an entry left behind expires).
async fn leave_queues<'a>(
    rate: &RateLimits,
    writes: i64,
    key: &str,
    names: impl Iterator<Item = &'a String>,
) {
    let path = format!("wait.{key}");
    let removals = names.map(|name| {
        let path = path.clone();
        async move {
            if let Err(e) = rate
                .coll
                .update_one(
                    guarded(rate, doc! { "_id": name }),
                    format::mark_update(doc! { "$unset": { path: "" } }, writes),
                )
                .await
            {
                tracing::debug!(limiter = %name, error = %e, "leaving the queue failed; the entry expires");
            }
        }
    });
    join_all(removals).await;
}

/// Takes back a grant no call was made under (another limiter of the request refused): a
/// settlement of none of its calls. Best effort: a grant left in place only counts until it
/// ages out, as a dead worker's would.
async fn withdraw(
    rate: &RateLimits,
    name: &str,
    key: &str,
    n: u32,
    priority: Priority,
    grant: Grant,
    writes: i64,
) {
    let result = rate
        .coll
        .update_one(
            guarded(rate, doc! { "_id": name, "slot_ms": { "$exists": true } }),
            // Its only sending: nothing else can apply it.
            format::mark_pipeline(
                settle_update(key, n, priority, grant, 0, false, None),
                writes,
            ),
        )
        .await;
    if let Err(e) = result {
        tracing::debug!(limiter = name, error = %e, "withdrawing a partial grant failed");
    }
}

/// Reads a limiter with the server's time of the reading.
async fn read(rate: &RateLimits, name: &str) -> Result<View, RateLimitError> {
    let doc = read_doc(rate, name).await?;
    reading(rate, name, &doc)
}

/// A limiter document as stored, with `read_at`: the server's time of the reading.
pub(crate) async fn read_doc(rate: &RateLimits, name: &str) -> Result<Document, RateLimitError> {
    let mut cursor = rate
        .coll
        .aggregate(vec![
            doc! { "$match": { "_id": name } },
            doc! { "$addFields": { "read_at": "$$NOW" } },
        ])
        .await
        .map_err(|e| db_error(rate, name, "read", e))?;
    let doc = cursor
        .try_next()
        .await
        .map_err(|e| db_error(rate, name, "read", e))?
        .ok_or_else(|| unknown(rate, name))?;
    Ok(doc)
}

/// A limiter document with `read_at`, the server's time it was read (or written) at.
pub(crate) fn reading(
    rate: &RateLimits,
    name: &str,
    doc: &Document,
) -> Result<View, RateLimitError> {
    check_format(rate, doc)?;
    let now = doc
        .get_datetime("read_at")
        .copied()
        .map_err(|_| malformed(rate, name, "the server did not report its time (read_at)"))?;
    View::parse(doc, now).map_err(|reason| malformed(rate, name, &reason))
}

// The maps only ever gain entries, so one left by a panicking task is still sound.
fn waker(rate: &RateLimits, name: &str) -> Arc<Notify> {
    let mut wakers = rate
        .shared
        .wakers
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    wakers.entry(name.to_string()).or_default().clone()
}

fn cached(rate: &RateLimits, name: &str) -> Option<Limit> {
    let limits = rate
        .shared
        .limits
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    limits.get(name).copied()
}

fn cache(rate: &RateLimits, name: &str, limit: Limit) {
    let mut limits = rate
        .shared
        .limits
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    limits.insert(name.to_string(), limit);
}

/// How long a queued caller stays in the queue without coming back. A waiter comes back at
/// least once a poll; a dead one should not hold the queue up for much longer than that.
fn queue_ttl(rate: &RateLimits, limit: &Limit) -> Duration {
    poll(rate, limit.window) * 3 / 2 + Duration::from_millis(200)
}

/// The longest a waiter on limiters whose shortest window is `window` sleeps without news.
fn poll(rate: &RateLimits, window: Duration) -> Duration {
    rate.options
        .poll
        .unwrap_or_else(|| (window / 8).clamp(Duration::from_millis(5), Duration::from_secs(5)))
}

/// The shortest window of `limits`.
fn shortest_window(limits: &[(String, Limit)]) -> Duration {
    limits
        .iter()
        .map(|(_, l)| l.window)
        .min()
        .unwrap_or(Duration::from_secs(1))
}

async fn validate(
    rate: &RateLimits,
    limiters: &[&str],
    n: u32,
    priority: Priority,
) -> Result<Vec<(String, Limit)>, RateLimitError> {
    if limiters.is_empty() {
        return Err(RateLimitError::InvalidRequest {
            reason: format!("{}: a reservation names no limiter", coll_name(rate)),
        });
    }
    let mut seen = HashSet::new();
    for name in limiters {
        check_name(rate, name)?;
        if !seen.insert(*name) {
            return Err(RateLimitError::InvalidRequest {
                reason: format!(
                    "{}: limiter {} is named twice in one reservation",
                    coll_name(rate),
                    shown(name)
                ),
            });
        }
    }
    let mut limits = Vec::with_capacity(limiters.len());
    for name in limiters {
        let limit = rate.limit(name).await?;
        if n == 0 {
            return Err(RateLimitError::ZeroCalls {
                collection: coll_name(rate).to_string(),
                limiter: name.to_string(),
            });
        }
        let most = limit.max_for(priority);
        if n > most {
            return Err(RateLimitError::TooManyCalls {
                collection: coll_name(rate).to_string(),
                limiter: name.to_string(),
                requested: n,
                most,
                priority: priority.to_string(),
            });
        }
        limits.push((name.to_string(), limit));
    }
    Ok(limits)
}

pub(crate) fn check_name(rate: &RateLimits, name: &str) -> Result<(), RateLimitError> {
    let invalid = |why: String| RateLimitError::InvalidRequest {
        reason: format!("{}: limiter name {} {why}", coll_name(rate), shown(name)),
    };
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(invalid(format!(
            "must have 1 to {MAX_NAME} bytes, not {}",
            name.len()
        )));
    }
    // A NUL or a line break in a name is almost always a caller's encoding bug, and would
    // make errors and logs lie about which limiter was asked.
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(invalid(format!(
            "holds the control character U+{:04X}",
            u32::from(c)
        )));
    }
    Ok(())
}

fn unknown(rate: &RateLimits, name: &str) -> RateLimitError {
    RateLimitError::UnknownLimiter {
        collection: coll_name(rate).to_string(),
        limiter: name.to_string(),
    }
}

pub(crate) fn malformed(rate: &RateLimits, name: &str, reason: &str) -> RateLimitError {
    RateLimitError::Malformed {
        collection: coll_name(rate).to_string(),
        limiter: name.to_string(),
        reason: reason.to_string(),
    }
}
