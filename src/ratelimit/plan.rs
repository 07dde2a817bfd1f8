//! The admission rule, twice: as the server evaluates it inside the granting write (an update
//! pipeline over the limiter document and `$$NOW`), and as a worker evaluates it over a document
//! it read, to say when a refused request will fit; and the writes themselves, as update
//! pipelines so every time they use is the server's `$$NOW`.
//!
//! (Over 700 lines, half of them the unit tests of the view: the writes and the view that
//! mirrors them on the worker's side belong together.)
//!
//! # Slots
//!
//! A reservation's calls reach the API by its *end*: grant + hold + grace while it is pending,
//! the settle time once settled. The limiter does not keep reservations one by one (their number
//! is unbounded: an API allowing 100,000 calls an hour may have as many outstanding); it keeps
//! how many calls end in each *slot* of server time, `slot_ms` wide, bulk and high-priority
//! apart. A slot numbered `s` holds the ends in `[s * slot_ms, (s + 1) * slot_ms)` and counts
//! while its last millisecond is at most `span` old (`span`: the window plus [`SLACK`] for the
//! clock's millisecond rounding), so every call counts at least as long as its own end says,
//! and at most one slot longer: the limiter is conservative by less than `slot_ms`. `slot_ms`
//! is the limiter's whole reach (window + skew + hold + grace + slack) over `SLOTS`, so at most
//! `SLOTS + 1` slots count at once, and with those that stopped counting less than
//! [`PRUNE_AFTER_MS`] ago (every write keeps them that long) a limiter holds at most
//! `ceil((reach + PRUNE_AFTER_MS) / slot_ms) + 1`, whatever the number of calls or reservations
//! (131 for a 1 s window with the default hold; `SLOTS + 101` with 1 ms slots), and a write reads
//! and rewrites only those.
//!
//! A grant adds its calls to the slot of its pending end; a settlement takes them out of it and
//! adds the calls made to the slot of the settle time (never later than the pending end). A
//! reservation never settled stays counted in its pending end's slot until that slot ages out.
//!
//! # The rule
//!
//! With `bulk` and `high` the calls the live slots hold for each kind of caller and `ahead` the
//! calls of bulk callers queued before this one:
//!
//! - high-priority: `bulk + high + n <= calls`;
//! - bulk: `bulk + max(reserved, high) + ahead + n <= calls`.
//!
//! So bulk callers leave `reserved - high` free whenever high-priority callers hold less than
//! `reserved`, and a high-priority request of that size always fits.
//!
//! # Lost replies
//!
//! The last [`RECENT`] grants (`granted`: key, end slot, calls, priority, sequence number) and
//! settlements (`settled`: key, sequence number) stay in the document. A grant sent again after
//! a lost reply finds its key among the grants and is not counted twice (beyond the last
//! [`RECENT`] it would be: counted twice, which only wastes room until it ages out). Each sending
//! of a settlement applies only inside its [`Window`] of server time, and the windows of one
//! settlement's sendings do not overlap, so whichever sending applies, every other one runs
//! before or after it. A later one finds its key among the settlements; if it does not, and a
//! settlement made after the reservation's grant has already been dropped from the list
//! (`evicted`), the earlier sending may have landed and been dropped, so the resend changes
//! nothing. An earlier one still on its way arrives after its window and changes nothing,
//! however many settlements the list has forgotten since. A settlement is applied at most once,
//! and one that cannot be confirmed leaves the reservation counted in full, the safe side.

use std::time::Instant;

use bson::{doc, Bson, DateTime, Document};

use crate::ratelimit::limit::{Grant, Limit, Priority, SLACK};

/// Grants and settlements a limiter remembers for replies that were lost.
pub(crate) const RECENT: i64 = 32;

/// A bulk caller's place in the queue: its ticket and the server time it first queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ticket {
    pub key: String,
    pub since: DateTime,
    /// When the queue forgets it unless it comes back.
    pub exp: DateTime,
}

/// Milliseconds a call keeps counting after its end.
pub(crate) fn span_ms(limit: &Limit) -> i64 {
    ms(limit.span())
}

/// The width of one slot of `limit`'s limiter.
pub(crate) fn slot_ms(limit: &Limit) -> i64 {
    limit.slot_ms()
}

fn ms(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

/// How long after it stops counting a slot is removed (or a queued caller after its expiry):
/// late enough that no reader still computing with it is surprised. It adds up to
/// `ceil(100 / slot_ms)` slots to a limiter's document.
const PRUNE_AFTER_MS: i64 = 100;

/// The server's time in milliseconds, as the first stage of every write stores it.
const NOW_MS: &str = "$_now";

/// The first stage of every write: the server's time, once, in milliseconds, and the first slot
/// that counts (`_count`) and the first that is kept (`_keep`) at that time (see [`counting`]).
fn clock_stage(reading: bool) -> Document {
    let first = |margin_ms: i64| {
        slot_of(Bson::Document(doc! { "$subtract": [
            { "$toLong": "$$NOW" },
            { "$add": ["$window_ms", { "$ifNull": ["$skew_ms", long(0)] }, ms(SLACK) + margin_ms] },
        ] }))
    };
    let mut set = doc! {
        "_now": { "$toLong": "$$NOW" },
        "_count": first(0),
        "_keep": first(PRUNE_AFTER_MS),
    };
    if reading {
        // The document the write returns is a reading, with its time.
        set.insert("read_at", "$$NOW");
    }
    doc! { "$set": set }
}

fn long(v: i64) -> Bson {
    Bson::Int64(v)
}

fn array(field: &str) -> Bson {
    Bson::Document(doc! { "$ifNull": [format!("${field}"), []] })
}

fn seq() -> Bson {
    Bson::Document(doc! { "$ifNull": ["$seq", long(0)] })
}

/// The slot holding the server time `at_ms` (an expression in milliseconds).
fn slot_of(at_ms: Bson) -> Bson {
    Bson::Document(doc! { "$toLong": { "$floor": { "$divide": [at_ms, "$slot_ms"] } } })
}

/// Whether the slot named `slot` (a variable: `$$x`) counts at `_now`, or is kept (`from`:
/// `"$_count"` or `"$_keep"`, the first slot that does, set by the clock stage).
///
/// A slot `s` counts while its last millisecond is at most the window (and [`SLACK`]) old:
/// `(s + 1) * slot_ms - 1 >= cut`, with `cut = now - window - SLACK`, which for whole numbers is
/// `s >= floor(cut / slot_ms)`, the slot holding `cut`. So the clock stage works out that slot
/// once and each slot is one comparison (it was a dozen operators per slot on every write).
fn counting(slot: &str, from: &str) -> Document {
    doc! { "$gte": [format!("{slot}.s"), from] }
}

/// The fields the clock stage adds, which every write drops at its end.
const CLOCK_FIELDS: [&str; 3] = ["_now", "_count", "_keep"];

/// The slots every write keeps: those that count, and those that stopped counting less than
/// [`PRUNE_AFTER_MS`] ago (so that a reader still computing with them is not surprised).
fn kept_slots() -> Bson {
    Bson::Document(doc! { "$filter": {
        "input": array("slots"),
        "as": "x",
        "cond": counting("$$x", "$_keep"),
    } })
}

/// The slots that count now (`_live`, set by an earlier stage, holds them; [`held`] sums them).
fn live_slots() -> Bson {
    Bson::Document(doc! { "$filter": {
        "input": array("slots"),
        "as": "x",
        "cond": counting("$$x", "$_count"),
    } })
}

/// The calls of one kind (`b` bulk, `h` high priority) the slots that count hold: a sum over
/// the field's values, not a fold building a document per slot (the fold was a tenth of a
/// grant's evaluation on the local server).
fn held(kind: &str) -> Bson {
    Bson::Document(doc! { "$sum": format!("$_live.{kind}") })
}

/// Every entry's `sub` in the array `field` (empty when the field is missing).
fn values(field: &str, sub: &str) -> Bson {
    Bson::Document(doc! { "$ifNull": [format!("${field}.{sub}"), []] })
}

/// The slots of field `field` with `bulk` and `high` (expressions, negative to take away) added
/// to slot `slot`, never below zero.
fn add_to(field: &str, slot: Bson, bulk: Bson, high: Bson) -> Bson {
    let floor = |v: Bson| match v {
        Bson::Int64(n) => long(n.max(0)),
        v => Bson::Document(doc! { "$max": [long(0), v] }),
    };
    // Adding zero to a count (never negative) leaves it as it is.
    let plus = |count: &str, v: &Bson| {
        if *v == long(0) {
            Bson::from(count)
        } else {
            floor(Bson::Document(doc! { "$add": [count, v.clone()] }))
        }
    };
    let here = doc! { "$eq": ["$$x.s", slot.clone()] };
    let slots = array(field);
    Bson::Document(doc! { "$cond": [
        { "$in": [slot.clone(), values(field, "s")] },
        { "$map": {
            "input": slots.clone(),
            "as": "x",
            "in": { "$cond": [
                here,
                {
                    "s": "$$x.s",
                    "b": plus("$$x.b", &bulk),
                    "h": plus("$$x.h", &high),
                },
                "$$x",
            ] },
        } },
        { "$concatArrays": [slots, [{ "s": slot, "b": floor(bulk), "h": floor(high) }]] },
    ] })
}

/// `n` calls as (bulk, high) for a caller of `priority`.
fn split(n: i64, priority: Priority) -> (Bson, Bson) {
    match priority {
        Priority::High => (long(0), long(n)),
        Priority::Bulk => (long(n), long(0)),
    }
}

/// Whether `key` is among the recent entries of `field`.
fn remembered(field: &str, key: &str) -> Bson {
    Bson::Document(doc! { "$in": [key, values(field, "k")] })
}

/// Where `key` is among the recent grants (-1: it is not).
fn grant_index(key: &str) -> Bson {
    Bson::Document(doc! { "$indexOfArray": [values("granted", "k"), key] })
}

/// Field `sub` of the recent grant at `_i` (set by an earlier stage); missing if there is none.
fn earlier(sub: &str) -> Bson {
    Bson::Document(doc! { "$cond": [
        { "$gte": ["$_i", long(0)] },
        { "$arrayElemAt": [values("granted", sub), "$_i"] },
        // A field no limiter has: the value is missing, as the grant's is.
        "$_absent",
    ] })
}

/// `field`'s recent entries with `entry` added (the oldest dropped beyond [`RECENT`]).
fn remember(field: &str, entry: Document) -> Bson {
    Bson::Document(doc! { "$slice": [{ "$concatArrays": [array(field), [entry]] }, -RECENT] })
}

fn entries(field: &str) -> Bson {
    Bson::Document(doc! { "$objectToArray": { "$ifNull": [format!("${field}"), {}] } })
}

/// Calls of bulk callers queued before `ticket` (all queued callers for a caller not queued).
fn ahead_expr(ticket: Option<&Ticket>) -> Bson {
    let live = doc! { "$gte": ["$$w.v.exp", "$$NOW"] };
    let cond = match ticket {
        None => live,
        Some(t) => doc! { "$and": [
            live,
            { "$ne": ["$$w.k", &t.key] },
            { "$or": [
                { "$lt": ["$$w.v.since", t.since] },
                { "$and": [ { "$eq": ["$$w.v.since", t.since] }, { "$lt": ["$$w.k", &t.key] } ] },
            ] },
        ] },
    };
    Bson::Document(doc! { "$sum": { "$map": {
        "input": { "$filter": { "input": entries("wait"), "as": "w", "cond": cond } },
        "as": "w",
        "in": "$$w.v.n",
    } } })
}

/// The server-side admission test for `n` calls, over `_live` (the slots that count, set by an
/// earlier stage).
fn fits_expr(n: u32, priority: Priority, ticket: Option<&Ticket>) -> Bson {
    let n = i64::from(n);
    Bson::Document(match priority {
        Priority::High => doc! { "$lte": [ { "$add": [held("b"), held("h"), n] }, "$calls" ] },
        Priority::Bulk => doc! { "$lte": [
            { "$add": [held("b"), { "$max": ["$reserved", held("h")] }, ahead_expr(ticket), n] },
            "$calls"
        ] },
    })
}

/// The queue without callers gone for a while, and without `leaving`.
fn pruned_wait(leaving: Option<&str>) -> Bson {
    let live = doc! { "$gte": ["$$x.v.exp", { "$subtract": ["$$NOW", PRUNE_AFTER_MS] }] };
    let keep = match leaving {
        None => live,
        Some(key) => doc! { "$and": [live, { "$ne": ["$$x.k", key] }] },
    };
    let pruned = doc! { "$arrayToObject": [ { "$filter": {
        "input": entries("wait"),
        "as": "x",
        "cond": keep,
    } } ] };
    // Most of the time nobody waits: an empty queue stays as it is.
    Bson::Document(doc! { "$cond": [{ "$eq": ["$wait", { "$literal": {} }] }, "$wait", pruned] })
}

/// The stage that drops the temporary fields (the clock stage's too).
fn unset(fields: &[&str]) -> Document {
    let all = CLOCK_FIELDS.iter().chain(fields);
    doc! { "$unset": all.map(|f| Bson::from(*f)).collect::<Vec<_>>() }
}

/// The one entry of a limiter's `log`, kept for workers of the version before slots.
pub(crate) const MOVED: &str = "moved-to-slots";

/// The `log` every limiter in slots keeps for workers of the version before slots, which may
/// still run during a rolling upgrade (and write to it if no validator refuses them: one the
/// service could not install). They counted this log of reservations, one entry each, and
/// granted only if its live entries left room; this one holds the whole limit until the year
/// 9999, settled (never moved to "now" by their estimate of when room frees), so they grant
/// nothing more on a limiter the slots count: the calls they hold still count in the slots they
/// were moved to, and new grants go through the slots only.
pub(crate) fn closed_log(limit: &Limit) -> Document {
    doc! {
        MOVED: {
            "n": i64::from(limit.calls),
            "p": false,
            "e": DateTime::from_millis(253_402_300_799_999),
            "s": true,
        }
    }
}

/// The fields a new limiter of `limit` starts with (besides the limit's own).
pub(crate) fn initial_fields(limit: &Limit) -> Document {
    doc! {
        "slot_ms": slot_ms(limit),
        "slots": [],
        "granted": [],
        "settled": [],
        "evicted": long(-1),
        "seq": long(0),
        "wait": {},
        "log": closed_log(limit),
    }
}

/// The sweeping write: slots that stopped counting and callers gone dropped, nothing added. A
/// limiter nobody writes to keeps its stale slots until a write like this one comes.
pub(crate) fn prune_update() -> Vec<Document> {
    vec![
        clock_stage(false),
        doc! { "$set": { "slots": kept_slots(), "wait": pruned_wait(None) } },
        unset(&[]),
    ]
}

/// The granting write, sent with the limiter's id alone as its filter so that it always
/// answers with the limiter (a refusal too: the document it returns says when there will be
/// room). `n` calls are added to the slot of `$$NOW + hold + grace` if they fit and `key` was
/// not granted already; `out` says what happened (`ok`: granted, now or by an earlier sending);
/// the grant is remembered in `granted`. A granted bulk caller leaves the queue (`leaving`).
pub(crate) fn grant_update(
    key: &str,
    n: u32,
    priority: Priority,
    ticket: Option<&Ticket>,
    leaving: Option<&str>,
) -> Vec<Document> {
    let (bulk, high) = split(i64::from(n), priority);
    let entry = doc! {
        "k": key,
        "s": "$_end",
        "n": i64::from(n),
        "p": priority == Priority::High,
        "q": { "$add": [seq(), long(1)] },
    };
    let mut effects = doc! {
        "slots": { "$cond": ["$_ok", add_to("slots", Bson::from("$_end"), bulk, high), array("slots")] },
        "granted": { "$cond": ["$_ok", remember("granted", entry), array("granted")] },
        "seq": { "$cond": ["$_ok", { "$add": [seq(), long(1)] }, seq()] },
        "out": {
            "k": key,
            "ok": { "$or": [{ "$gte": ["$_i", long(0)] }, "$_ok"] },
            "s": { "$cond": ["$_ok", "$_end", earlier("s")] },
            "q": { "$cond": ["$_ok", { "$add": [seq(), long(1)] }, earlier("q")] },
        },
    };
    if leaving.is_some() {
        effects.insert(
            "wait",
            doc! { "$cond": ["$_ok", pruned_wait(leaving), "$wait"] },
        );
    }
    vec![
        clock_stage(true),
        doc! { "$set": {
            "slots": kept_slots(),
            "wait": pruned_wait(None),
            "_i": grant_index(key),
            "_end": slot_of(Bson::Document(doc! { "$add": [NOW_MS, "$hold_ms", "$grace_ms"] })),
            "_live": live_slots(),
        } },
        doc! { "$set": { "_ok": { "$and": [{ "$lt": ["$_i", long(0)] }, fits_expr(n, priority, ticket)] } } },
        doc! { "$set": effects },
        unset(&["_i", "_end", "_live", "_ok"]),
    ]
}

/// The interval of server time, in milliseconds, in which one sending of a settlement may apply:
/// after `after` (the latest `until` of the settlement's earlier sendings, if any) and until
/// `until`. The sendings of one settlement get disjoint intervals, so whichever applies, every
/// other one either ran before it (and left its key among the recent settlements, or, being
/// dropped from them, makes a resend `lost`) or runs after it (and finds it the same way): a
/// late copy can never apply a second time, however many settlements came in between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    pub after: Option<i64>,
    pub until: i64,
}

/// The settling write for reservation `key` (`n` calls of `priority`, granted as `grant`):
/// takes its calls out of its end's slot and adds the `made` ones to the slot of `$$NOW` (or its
/// end's, if that is earlier), unless its key is among the recent settlements, the time is past
/// its end's slot (then it is counted in full until it ages out), the time is outside the
/// sending's `window` (`early`, `late`: this sending does nothing, another may), or, when
/// `resend`, a settlement made since its grant was already dropped from the recent ones (it may
/// be this one). `out` says which. A withdrawal (a grant taken back before the caller saw it,
/// one sending) has no window.
pub(crate) fn settle_update(
    key: &str,
    n: u32,
    priority: Priority,
    grant: Grant,
    made: u32,
    resend: bool,
    window: Option<Window>,
) -> Vec<Document> {
    let (bulk, high) = split(-i64::from(n), priority);
    let (made_bulk, made_high) = split(i64::from(made), priority);
    let taken = add_to("slots", long(grant.end), bulk, high);
    // The calls made go to the slot of the settle time, from the slots with the reservation
    // taken out (`_t`). None made adds nothing: the filter below drops an empty slot anyway.
    let (take, settled_slots) = if made == 0 {
        (None, taken)
    } else {
        (
            Some(doc! { "$set": { "_t": { "$cond": ["$_ok", taken, []] } } }),
            add_to("_t", Bson::from("$_at"), made_bulk, made_high),
        )
    };
    let lost = if resend {
        Bson::Document(doc! { "$gte": [{ "$ifNull": ["$evicted", long(-1)] }, long(grant.seq)] })
    } else {
        Bson::Boolean(false)
    };
    let dropped = doc! { "$arrayElemAt": [values("settled", "q"), 0] };
    let early = match window.and_then(|w| w.after) {
        Some(after) => Bson::Document(doc! { "$lte": [NOW_MS, long(after)] }),
        None => Bson::Boolean(false),
    };
    let late = match window {
        Some(w) => Bson::Document(doc! { "$gt": [NOW_MS, long(w.until)] }),
        None => Bson::Boolean(false),
    };
    let mut stages = vec![
        clock_stage(true),
        doc! { "$set": {
            "slots": kept_slots(),
            "_seen": remembered("settled", key),
            "_lost": lost,
            "_early": early,
            "_late": late,
            "_at": { "$min": [slot_of(Bson::from(NOW_MS)), long(grant.end)] },
        } },
        // Past its end's slot, a reservation is counted in full and left alone (its calls may
        // still be arriving until its end; after that its slot only ages out).
        doc! { "$set": {
            "_here": { "$and": [
                { "$lte": [NOW_MS, { "$subtract": [{ "$multiply": [long(grant.end + 1), "$slot_ms"] }, long(1)] }] },
                { "$in": [long(grant.end), values("slots", "s")] },
            ] },
        } },
        doc! { "$set": { "_ok": { "$and": [
            { "$not": ["$_seen"] },
            { "$not": ["$_lost"] },
            "$_here",
            { "$not": ["$_early"] },
            { "$not": ["$_late"] },
        ] } } },
    ];
    stages.extend(take);
    stages.extend([
        doc! { "$set": {
            // A slot a settlement empties goes (its pending end's, when all its calls came back).
            "slots": { "$cond": ["$_ok", { "$filter": {
                "input": settled_slots,
                "as": "x",
                "cond": { "$gt": [{ "$add": ["$$x.b", "$$x.h"] }, long(0)] },
            } }, array("slots")] },
            "evicted": { "$cond": [
                { "$and": ["$_ok", { "$gte": [{ "$size": array("settled") }, RECENT] }] },
                { "$max": [{ "$ifNull": ["$evicted", long(-1)] }, dropped] },
                { "$ifNull": ["$evicted", long(-1)] },
            ] },
            "settled": { "$cond": ["$_ok", remember("settled", doc! { "k": key, "q": { "$add": [seq(), long(1)] } }), array("settled")] },
            "seq": { "$cond": ["$_ok", { "$add": [seq(), long(1)] }, seq()] },
            "out": {
                "k": key,
                "ok": "$_ok",
                "seen": "$_seen",
                "lost": "$_lost",
                "here": "$_here",
                "early": "$_early",
                "late": "$_late",
            },
        } },
        unset(&["_seen", "_lost", "_early", "_late", "_at", "_here", "_ok", "_t"]),
    ]);
    stages
}

/// The write that moves a limiter written by an earlier version of mongotx (a `log` of
/// reservations, one entry each) to slots: every live entry's calls go to the slot of the latest
/// end among them, which counts each of them at least as long as its own end did.
pub(crate) fn upgrade_update(limit: &Limit) -> Vec<Document> {
    let log = Bson::Document(doc! { "$filter": {
        "input": entries("log"),
        "as": "x",
        "cond": { "$ne": ["$$x.k", MOVED] },
    } });
    let total = |high: bool| {
        Bson::Document(doc! { "$sum": { "$map": {
            "input": { "$filter": { "input": log.clone(), "as": "x", "cond": { "$eq": [{ "$ifNull": ["$$x.v.p", false] }, high] } } },
            "as": "x",
            "in": "$$x.v.n",
        } } })
    };
    let latest = doc! { "$max": { "$map": { "input": log.clone(), "as": "x", "in": { "$toLong": "$$x.v.e" } } } };
    let mut fields = initial_fields(limit);
    fields.remove("wait");
    fields.insert(
        "slots",
        doc! { "$cond": [
            { "$gt": [{ "$size": log.clone() }, 0] },
            [{ "s": slot_of(Bson::Document(latest)), "b": { "$toLong": total(false) }, "h": { "$toLong": total(true) } }],
            [],
        ] },
    );
    fields.insert("wait", doc! { "$ifNull": ["$wait", {}] });
    fields.insert("log", doc! { "$literal": closed_log(limit) });
    vec![
        doc! { "$set": { "slot_ms": slot_ms(limit) } },
        doc! { "$set": fields },
    ]
}

/// The queueing write: caller `key` wants `n` calls, queued since `since` (kept from its first
/// queueing) and live until `exp`. These two times are this process's estimate of the server's
/// clock: they only order the queue and let a dead caller drop out of it, so an estimate a few
/// milliseconds off is harmless. `read_at` records the server's time of the write, so the
/// document it returns is a reading with its time.
pub(crate) fn queue_update(key: &str, n: u32, since: DateTime, exp: DateTime) -> Document {
    doc! {
        "$min": { format!("wait.{key}.since"): since },
        "$set": {
            format!("wait.{key}.n"): i64::from(n),
            format!("wait.{key}.exp"): exp,
        },
        "$currentDate": { "read_at": true },
    }
}

/// What a write's `out` field says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Out {
    pub ok: bool,
    pub seen: bool,
    pub lost: bool,
    pub here: bool,
    pub early: bool,
    pub late: bool,
}

impl Out {
    /// The outcome of the write of `key` in the document it returned (`None`: it is not there,
    /// which a document returned by that very write cannot be).
    pub fn of(doc: &Document, key: &str) -> Option<Out> {
        let out = doc.get_document("out").ok()?;
        if out.get_str("k").ok()? != key {
            return None;
        }
        let flag = |k: &str| out.get_bool(k).unwrap_or(false);
        Some(Out {
            ok: flag("ok"),
            seen: flag("seen"),
            lost: flag("lost"),
            here: flag("here"),
            early: flag("early"),
            late: flag("late"),
        })
    }
}

/// The grant a granting write reported in its `out` (made now, or found among the recent ones).
pub(crate) fn granted(doc: &Document, received: Instant) -> Option<Grant> {
    let out = doc.get_document("out").ok()?;
    Some(Grant {
        end: out.get_i64("s").ok()?,
        seq: out.get_i64("q").ok()?,
        clock: (
            doc.get_datetime("read_at").ok()?.timestamp_millis(),
            received,
        ),
        // Limiters defined before the skew have none.
        skew_ms: doc.get_i64("skew_ms").unwrap_or(0),
    })
}

/// One slot: the calls that end in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Slot {
    pub s: i64,
    pub bulk: u32,
    pub high: u32,
}

/// One queued bulk caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Waiter {
    pub key: String,
    pub n: u32,
    pub since: DateTime,
    pub exp: DateTime,
}

/// A limiter document as read, with the server's time of the reading.
#[derive(Debug, Clone)]
pub(crate) struct View {
    pub limit: Limit,
    pub slot_ms: i64,
    pub now: DateTime,
    pub slots: Vec<Slot>,
    pub wait: Vec<Waiter>,
}

impl View {
    /// Parses a limiter document; `now` is the server's time it was read at.
    pub fn parse(doc: &Document, now: DateTime) -> Result<View, String> {
        let limit =
            Limit::from_fields(doc).ok_or("its limit fields are missing or out of range")?;
        let slot_ms = match doc.get_i64("slot_ms") {
            Ok(ms) if ms > 0 => ms,
            _ if doc.contains_key("log") => {
                return Err(
                    "it was written by an earlier mongotx (a log of reservations, not slots); \
                     `define` it again to move it to slots"
                        .into(),
                )
            }
            _ => return Err("it has no whole positive `slot_ms`".into()),
        };
        let int = |d: &Document, k: &str| {
            d.get_i64(k)
                .ok()
                .or_else(|| d.get_i32(k).ok().map(i64::from))
                .and_then(|v| u32::try_from(v).ok())
        };
        let mut slots = Vec::new();
        for (i, value) in doc.get_array("slots").into_iter().flatten().enumerate() {
            let slot = value
                .as_document()
                .ok_or_else(|| format!("slot {i} is not a document"))?;
            match (slot.get_i64("s"), int(slot, "b"), int(slot, "h")) {
                (Ok(s), Some(bulk), Some(high)) => slots.push(Slot { s, bulk, high }),
                _ => return Err(format!("slot {i} is incomplete")),
            }
        }
        let mut wait = Vec::new();
        if let Ok(waiters) = doc.get_document("wait") {
            for (key, value) in waiters {
                let w = value
                    .as_document()
                    .ok_or_else(|| format!("waiter {key} is not a document"))?;
                let date = |k: &str| w.get_datetime(k).ok().copied();
                match (int(w, "n"), date("since"), date("exp")) {
                    (Some(n), Some(since), Some(exp)) => wait.push(Waiter {
                        key: key.clone(),
                        n,
                        since,
                        exp,
                    }),
                    _ => return Err(format!("waiter {key} is incomplete")),
                }
            }
        }
        Ok(View {
            limit,
            slot_ms,
            now,
            slots,
            wait,
        })
    }

    /// The last millisecond of slot `s`.
    fn last_ms(&self, s: i64) -> i64 {
        s.saturating_add(1).saturating_mul(self.slot_ms) - 1
    }

    fn counts_at(&self, slot: &Slot, at: DateTime) -> bool {
        self.last_ms(slot.s) >= at.timestamp_millis() - span_ms(&self.limit)
    }

    /// Calls counted at `at` for bulk and for high-priority callers.
    pub fn counted(&self, at: DateTime) -> (u32, u32) {
        let (mut bulk, mut high) = (0u32, 0u32);
        for slot in self.slots.iter().filter(|s| self.counts_at(s, at)) {
            bulk = bulk.saturating_add(slot.bulk);
            high = high.saturating_add(slot.high);
        }
        (bulk, high)
    }

    /// Calls of live bulk callers queued ahead of `ticket` at `at`.
    pub fn ahead(&self, ticket: Option<&Ticket>, at: DateTime) -> u32 {
        self.wait
            .iter()
            .filter(|w| w.exp >= at)
            .filter(|w| match ticket {
                None => true,
                Some(t) => {
                    w.key != t.key && (w.since < t.since || (w.since == t.since && w.key < t.key))
                }
            })
            .fold(0u32, |sum, w| sum.saturating_add(w.n))
    }

    fn fits_with(&self, n: u32, priority: Priority, ahead: u32, at: DateTime) -> bool {
        let (bulk, high) = self.counted(at);
        let calls = u64::from(self.limit.calls);
        match priority {
            Priority::High => u64::from(bulk) + u64::from(high) + u64::from(n) <= calls,
            Priority::Bulk => {
                u64::from(bulk)
                    + u64::from(self.limit.reserved.max(high))
                    + u64::from(ahead)
                    + u64::from(n)
                    <= calls
            }
        }
    }

    /// What the rule counts as queued ahead of a caller of `priority` (high priority never
    /// queues behind bulk callers).
    fn ahead_of(&self, priority: Priority, ticket: Option<&Ticket>) -> u32 {
        match priority {
            Priority::High => 0,
            Priority::Bulk => self.ahead(ticket, self.now),
        }
    }

    /// Whether `n` calls fit at the reading's time.
    #[cfg(test)]
    pub fn fits(&self, n: u32, priority: Priority, ticket: Option<&Ticket>) -> bool {
        self.fits_with(n, priority, self.ahead_of(priority, ticket), self.now)
    }

    /// The earliest server time at which `n` calls fit as slots age out, the queue ahead
    /// staying as it is; `None` if they never fit that way (the queue must move first).
    pub fn fits_at(&self, n: u32, priority: Priority, ticket: Option<&Ticket>) -> Option<DateTime> {
        let ahead = self.ahead_of(priority, ticket);
        if self.fits_with(n, priority, ahead, self.now) {
            return Some(self.now);
        }
        let span = span_ms(&self.limit);
        let mut leaving: Vec<i64> = self
            .slots
            .iter()
            .filter(|s| self.counts_at(s, self.now))
            .map(|s| self.last_ms(s.s) + span + 1)
            .collect();
        leaving.sort_unstable();
        leaving.dedup();
        leaving
            .into_iter()
            .map(DateTime::from_millis)
            .find(|&at| self.fits_with(n, priority, ahead, at))
    }

    /// The slot of the reading's time.
    fn current_slot(&self) -> i64 {
        self.now.timestamp_millis().div_euclid(self.slot_ms)
    }

    /// [`fits_at`](View::fits_at) if the pending reservations (the calls in slots after the
    /// current one) are settled now with every call made, the usual case: the earliest a
    /// waiter can hope for (it is never later).
    pub fn likely_fits_at(
        &self,
        n: u32,
        priority: Priority,
        ticket: Option<&Ticket>,
    ) -> Option<DateTime> {
        let current = self.current_slot();
        let mut settled_now = self.clone();
        let (mut bulk, mut high) = (0u32, 0u32);
        settled_now.slots.retain(|s| {
            if s.s > current {
                bulk = bulk.saturating_add(s.bulk);
                high = high.saturating_add(s.high);
            }
            s.s <= current
        });
        if bulk > 0 || high > 0 {
            settled_now.slots.push(Slot {
                s: current,
                bulk,
                high,
            });
        }
        settled_now.fits_at(n, priority, ticket)
    }

    /// The usage summary of the reading.
    pub fn usage(&self) -> crate::ratelimit::limit::Usage {
        let (bulk, high) = self.counted(self.now);
        let current = self.current_slot();
        crate::ratelimit::limit::Usage {
            limit: self.limit,
            now: self.now.to_chrono(),
            bulk,
            high,
            pending: self
                .slots
                .iter()
                .filter(|s| s.s > current)
                .fold(0u32, |sum, s| {
                    sum.saturating_add(s.bulk).saturating_add(s.high)
                }),
            waiting: self.wait.iter().filter(|w| w.exp >= self.now).count(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ratelimit::limit::SLOTS;
    use std::time::Duration;

    /// A view with 1 ms slots (each end its own slot, as the exact rule would count) unless
    /// `slot_ms` says otherwise.
    fn view(
        limit: Limit,
        slot_ms: i64,
        now: i64,
        ends: &[(u32, bool, i64)],
        wait: &[(&str, u32, i64, i64)],
    ) -> View {
        let mut slots: Vec<Slot> = Vec::new();
        for &(n, high, end) in ends {
            let s = end.div_euclid(slot_ms);
            let slot = match slots.iter_mut().find(|x| x.s == s) {
                Some(slot) => slot,
                None => {
                    slots.push(Slot {
                        s,
                        bulk: 0,
                        high: 0,
                    });
                    slots.last_mut().unwrap()
                }
            };
            if high {
                slot.high += n;
            } else {
                slot.bulk += n;
            }
        }
        View {
            limit,
            slot_ms,
            now: DateTime::from_millis(now),
            slots,
            wait: wait
                .iter()
                .map(|&(key, n, since, exp)| Waiter {
                    key: key.into(),
                    n,
                    since: DateTime::from_millis(since),
                    exp: DateTime::from_millis(exp),
                })
                .collect(),
        }
    }

    fn limit() -> Limit {
        // span = 1000 + 2 ms
        Limit::new(10, Duration::from_secs(1)).reserved(3)
    }

    /// The most slots a limiter holds after a write at any time `now`: from the first it keeps
    /// (`window + SLACK + PRUNE_AFTER_MS` back) to that of the latest pending end (`hold +
    /// grace` ahead), by brute force over a whole period of slot boundaries.
    fn most_slots_kept(limit: &Limit) -> i64 {
        let w = slot_ms(limit);
        let ahead = ms(limit.hold) + ms(limit.grace);
        let back = span_ms(limit) + PRUNE_AFTER_MS;
        (1_000_000..1_000_000 + w)
            .map(|now| (now + ahead).div_euclid(w) - (now - back).div_euclid(w) + 1)
            .max()
            .unwrap()
    }

    /// Issue 47, case 7: the docs said "at most 130 slots" (128 for the reach, 2 for the ends),
    /// forgetting the 100 ms of slots kept after they stop counting. The bound is
    /// `ceil((reach + 100 ms) / slot) + 1`: 131 for a 1 s window with the default hold, 229 for
    /// a reach of 128 ms (1 ms slots), and never more than `SLOTS + ceil(100 ms / slot) + 1`.
    #[test]
    fn a_limiter_holds_at_most_the_slots_its_reach_and_the_pruning_delay_span() {
        let bound = |l: &Limit| {
            let reach = span_ms(l) + ms(l.hold) + ms(l.grace);
            let w = slot_ms(l);
            (reach + PRUNE_AFTER_MS + w - 1) / w + 1
        };
        let second = Limit::new(10, Duration::from_secs(1));
        let tiny = Limit::new(5, Duration::from_millis(26))
            .hold(Duration::from_millis(100))
            .grace(Duration::ZERO);
        let cases = [
            (second, 131),
            (tiny, 229),
            (Limit::new(100_000, Duration::from_secs(3600)), 130),
            (
                Limit::new(4, Duration::from_millis(300)).hold(Duration::from_millis(7)),
                129,
            ),
        ];
        for (limit, most) in cases {
            assert_eq!(slot_ms(&tiny), 1);
            assert_eq!(most_slots_kept(&limit), most, "{limit}");
            assert_eq!(bound(&limit), most, "{limit}");
            let w = slot_ms(&limit);
            assert!(most <= SLOTS + (PRUNE_AFTER_MS + w - 1) / w + 1, "{limit}");
        }
    }

    #[test]
    fn slots_cut_the_reach_into_at_most_slots_pieces() {
        // reach = 1000 + 1000 (hold: one window) + 100 + 2 ms
        assert_eq!(slot_ms(&limit()), (2102 + SLOTS - 1) / SLOTS);
        let tiny = Limit::new(5, Duration::from_millis(3)).hold(Duration::from_millis(1));
        assert_eq!(slot_ms(&tiny), 1, "never below a millisecond");
        let hour = Limit::new(100_000, Duration::from_secs(3600));
        assert!(slot_ms(&hour) * SLOTS >= 3_600_000 + 10_000 + 100 + 2);
    }

    #[test]
    fn an_end_counts_for_one_widened_window_and_at_most_one_slot_more() {
        let v = view(
            limit(),
            1,
            10_000,
            &[(4, false, 8_998), (2, false, 8_997)],
            &[],
        );
        assert_eq!(
            v.counted(v.now),
            (4, 0),
            "end + 1002 ms >= now counts, older does not"
        );
        // 10 ms slots: 8_997 shares the slot [8_990, 9_000) with 8_998 and counts as long.
        let v = view(
            limit(),
            10,
            10_000,
            &[(4, false, 8_998), (2, false, 8_997), (1, false, 8_989)],
            &[],
        );
        assert_eq!(v.counted(v.now), (6, 0));
        assert_eq!(v.counted(DateTime::from_millis(10_001)), (6, 0));
        assert_eq!(v.counted(DateTime::from_millis(10_002)), (0, 0));
    }

    #[test]
    fn bulk_leaves_the_reserved_part_to_high_priority() {
        let v = view(limit(), 1, 10_000, &[(6, false, 10_000)], &[]);
        assert!(v.fits(1, Priority::Bulk, None), "6 + 3 + 1 <= 10");
        assert!(!v.fits(2, Priority::Bulk, None), "6 + 3 + 2 > 10");
        assert!(
            v.fits(2, Priority::High, None),
            "the reserved part is there"
        );
        assert!(
            v.fits(4, Priority::High, None),
            "high priority may use all that is left"
        );
        let v = view(
            limit(),
            1,
            10_000,
            &[(6, false, 10_000), (2, true, 10_000)],
            &[],
        );
        assert!(
            v.fits(1, Priority::High, None),
            "3 reserved - 2 held leaves 1"
        );
        assert!(v.fits(1, Priority::Bulk, None), "6 + max(3, 2) + 1 <= 10");
        let v = view(
            limit(),
            1,
            10_000,
            &[(4, false, 10_000), (5, true, 10_000)],
            &[],
        );
        assert!(
            !v.fits(2, Priority::Bulk, None),
            "high priority beyond its part takes from bulk"
        );
    }

    #[test]
    fn bulk_callers_queue_first_come_first_served() {
        let wait = [
            ("b", 3, 100, 20_000),
            ("a", 2, 200, 20_000),
            ("dead", 5, 50, 9_000),
        ];
        let v = view(limit(), 1, 10_000, &[(2, false, 10_000)], &wait);
        // Not queued: everyone live is ahead (the dead waiter's entry has expired).
        assert_eq!(v.ahead(None, v.now), 5);
        let first = Ticket {
            key: "b".into(),
            since: DateTime::from_millis(100),
            exp: DateTime::from_millis(20_000),
        };
        let second = Ticket {
            key: "a".into(),
            since: DateTime::from_millis(200),
            exp: DateTime::from_millis(20_000),
        };
        assert_eq!(v.ahead(Some(&first), v.now), 0);
        assert_eq!(v.ahead(Some(&second), v.now), 3);
        assert!(
            v.fits(3, Priority::Bulk, Some(&first)),
            "2 + 3 + 0 + 3 <= 10"
        );
        assert!(
            !v.fits(3, Priority::Bulk, Some(&second)),
            "2 + 3 + 3 + 3 > 10"
        );
        assert!(v.fits(2, Priority::Bulk, Some(&second)));
        // Same queueing time: the ticket decides.
        let tie = [("x", 4, 100, 20_000), ("y", 4, 100, 20_000)];
        let v = view(limit(), 1, 10_000, &[], &tie);
        let x = Ticket {
            key: "x".into(),
            since: DateTime::from_millis(100),
            exp: DateTime::from_millis(20_000),
        };
        let y = Ticket {
            key: "y".into(),
            since: DateTime::from_millis(100),
            exp: DateTime::from_millis(20_000),
        };
        assert_eq!((v.ahead(Some(&x), v.now), v.ahead(Some(&y), v.now)), (0, 4));
    }

    #[test]
    fn fits_at_is_when_enough_slots_age_out() {
        let v = view(
            limit(),
            1,
            10_000,
            &[(3, false, 9_500), (3, false, 9_800), (1, false, 9_990)],
            &[],
        );
        assert!(!v.fits(2, Priority::Bulk, None), "7 + 3 + 2 > 10");
        // The 9_500 slot stops counting at 9_500 + 1002 + 1.
        assert_eq!(
            v.fits_at(2, Priority::Bulk, None),
            Some(DateTime::from_millis(10_503))
        );
        assert_eq!(
            v.fits_at(7, Priority::Bulk, None),
            Some(DateTime::from_millis(10_993))
        );
        assert_eq!(
            v.fits_at(8, Priority::Bulk, None),
            None,
            "more than calls - reserved"
        );
        assert_eq!(v.fits_at(1, Priority::High, None), Some(v.now));
        // 100 ms slots: the 9_500 slot's last millisecond is 9_599.
        let v = view(
            limit(),
            100,
            10_000,
            &[(3, false, 9_500), (3, false, 9_800), (1, false, 9_990)],
            &[],
        );
        assert_eq!(
            v.fits_at(2, Priority::Bulk, None),
            Some(DateTime::from_millis(10_602))
        );
        // A call still pending (ending at 10_500, after the current slot): once settled it
        // would free its call at 10_000 + 1002 + 1 rather than 10_500 + 1003.
        let pending = view(
            limit(),
            1,
            10_000,
            &[(3, false, 9_500), (3, false, 9_800), (1, false, 10_500)],
            &[],
        );
        assert_eq!(
            pending.fits_at(7, Priority::Bulk, None),
            Some(DateTime::from_millis(11_503))
        );
        assert_eq!(
            pending.likely_fits_at(7, Priority::Bulk, None),
            Some(DateTime::from_millis(11_003))
        );
        assert_eq!(pending.usage().pending, 1);
    }
}
