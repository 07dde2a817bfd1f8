//! The admission rule, twice: as the server evaluates it inside the granting write (`$expr`
//! over the limiter document and `$$NOW`), and as a worker evaluates it over a document it read,
//! to say when a refused request will fit; and the writes themselves, as update pipelines so
//! every time they store is the server's `$$NOW`.
//!
//! The rule. A log entry (one reservation) has `n` calls, a priority, and an end `e`: the
//! server time by which its calls have reached the API (grant + hold + grace while pending, the
//! settle time once settled). It counts while `e >= now - span`, where `span` is the window
//! plus [`SLACK`] for the clock's millisecond rounding. With `bulk` and `high` the calls
//! counted for each kind of caller, `ahead` the calls of bulk callers queued before this one:
//!
//! - high-priority: `bulk + high + n <= calls`;
//! - bulk: `bulk + max(reserved, high) + ahead + n <= calls`.
//!
//! So bulk callers leave `reserved - high` free whenever high-priority callers hold less than
//! `reserved`, and a high-priority request of that size always fits.

use bson::{doc, Bson, DateTime, Document};

use crate::ratelimit::limit::{Limit, Priority, SLACK};

/// A bulk caller's place in the queue: its ticket and the server time it first queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ticket {
    pub key: String,
    pub since: DateTime,
    /// When the queue forgets it unless it comes back.
    pub exp: DateTime,
}

/// Milliseconds an entry keeps counting after its end.
pub(crate) fn span_ms(limit: &Limit) -> i64 {
    ms(limit.window) + ms(SLACK)
}

fn ms(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

/// How long after it stops counting an entry is removed (or a queued caller after its expiry):
/// late enough that no reader still computing with it is surprised.
const PRUNE_AFTER_MS: i64 = 100;

fn entries(field: &str) -> Bson {
    Bson::Document(doc! { "$objectToArray": { "$ifNull": [format!("${field}"), {}] } })
}

/// Calls counted now for one kind of caller (`None`: for both).
fn live_expr(high: Option<bool>) -> Bson {
    let cutoff = doc! { "$subtract": ["$$NOW", { "$add": ["$window_ms", ms(SLACK)] }] };
    let counts = doc! { "$gte": ["$$x.v.e", cutoff] };
    let cond = match high {
        None => counts,
        Some(high) => doc! { "$and": [counts, { "$eq": ["$$x.v.p", high] }] },
    };
    Bson::Document(doc! { "$sum": { "$map": {
        "input": { "$filter": {
            "input": entries("log"),
            "as": "x",
            "cond": cond,
        } },
        "as": "x",
        "in": "$$x.v.n",
    } } })
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

/// The server-side admission test for `n` calls.
pub(crate) fn fits_expr(n: u32, priority: Priority, ticket: Option<&Ticket>) -> Document {
    let n = i64::from(n);
    match priority {
        // One pass over the log: this is the request that must be fast.
        Priority::High => doc! { "$lte": [ { "$add": [live_expr(None), n] }, "$calls" ] },
        Priority::Bulk => doc! { "$lte": [
            { "$add": [
                live_expr(Some(false)),
                { "$max": ["$reserved", live_expr(Some(true))] },
                ahead_expr(ticket),
                n,
            ] },
            "$calls"
        ] },
    }
}

/// `field` (an object of entries) without the entries `keep` refuses.
fn filtered(field: &str, keep: Document) -> Bson {
    Bson::Document(doc! { "$arrayToObject": [ { "$filter": {
        "input": entries(field),
        "as": "x",
        "cond": keep,
    } } ] })
}

/// The log without entries that stopped counting over a second ago (an entry's end only ever
/// moves earlier, so one that stopped counting never counts again).
fn pruned_log() -> Bson {
    filtered(
        "log",
        doc! { "$gte": ["$$x.v.e", { "$subtract": ["$$NOW", { "$add": ["$window_ms", ms(SLACK) + PRUNE_AFTER_MS] }] }] },
    )
}

/// The queue without callers gone for over a second, and without `leaving`.
fn pruned_wait(leaving: Option<&str>) -> Bson {
    let live = doc! { "$gte": ["$$x.v.exp", { "$subtract": ["$$NOW", PRUNE_AFTER_MS] }] };
    filtered(
        "wait",
        match leaving {
            None => live,
            Some(key) => doc! { "$and": [live, { "$ne": ["$$x.k", key] }] },
        },
    )
}

/// An update pipeline that replaces `fields` of the document, whole.
fn replace_fields(fields: Document) -> Vec<Document> {
    vec![doc! { "$replaceRoot": { "newRoot": { "$mergeObjects": ["$$ROOT", fields] } } }]
}

/// The sweeping write: the log and the queue pruned, nothing added. A limiter nobody writes to
/// keeps its stale entries until a write like this one comes.
pub(crate) fn prune_update() -> Vec<Document> {
    replace_fields(doc! {
        "log": pruned_log(),
        "wait": pruned_wait(None),
    })
}

/// The granting write: a log entry `key` ending at `$$NOW` + hold + grace, the log and the queue
/// pruned, and the caller out of the queue.
pub(crate) fn grant_update(
    key: &str,
    n: u32,
    priority: Priority,
    limit: &Limit,
    leaving: Option<&str>,
) -> Vec<Document> {
    let entry = doc! {
        "n": i64::from(n),
        "p": priority == Priority::High,
        "e": { "$add": ["$$NOW", ms(limit.hold) + ms(limit.grace)] },
    };
    replace_fields(doc! {
        "log": { "$mergeObjects": [pruned_log(), { key: entry }] },
        "wait": pruned_wait(leaving),
    })
}

/// The settling write: entry `key` now counts `made` calls ending at `$$NOW`.
pub(crate) fn settle_update(key: &str, made: u32, priority: Priority) -> Vec<Document> {
    let entry = doc! {
        "n": i64::from(made),
        "p": priority == Priority::High,
        "e": "$$NOW",
        "s": true,
    };
    replace_fields(doc! { "log": { "$mergeObjects": [entries_object("log"), { key: entry }] } })
}

fn entries_object(field: &str) -> Bson {
    Bson::Document(doc! { "$ifNull": [format!("${field}"), {}] })
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

/// One reservation in a limiter's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub key: String,
    pub n: u32,
    pub high: bool,
    pub end: DateTime,
    pub settled: bool,
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
    pub now: DateTime,
    pub log: Vec<Entry>,
    pub wait: Vec<Waiter>,
}

impl View {
    /// Parses a limiter document; `now` is the server's time it was read at.
    pub fn parse(doc: &Document, now: DateTime) -> Result<View, String> {
        let limit =
            Limit::from_fields(doc).ok_or("its limit fields are missing or out of range")?;
        let int = |d: &Document, k: &str| {
            d.get_i64(k)
                .ok()
                .or_else(|| d.get_i32(k).ok().map(i64::from))
                .and_then(|v| u32::try_from(v).ok())
        };
        let mut log = Vec::new();
        if let Ok(entries) = doc.get_document("log") {
            for (key, value) in entries {
                let e = value
                    .as_document()
                    .ok_or_else(|| format!("log entry {key} is not a document"))?;
                log.push(Entry {
                    key: key.clone(),
                    n: int(e, "n").ok_or_else(|| format!("log entry {key} has no count"))?,
                    high: e.get_bool("p").unwrap_or(false),
                    end: e
                        .get_datetime("e")
                        .map_err(|_| format!("log entry {key} has no end"))?
                        .to_owned(),
                    settled: e.get_bool("s").unwrap_or(false),
                });
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
            now,
            log,
            wait,
        })
    }

    fn counts_at(&self, entry: &Entry, at: DateTime) -> bool {
        entry.end.timestamp_millis() >= at.timestamp_millis() - span_ms(&self.limit)
    }

    /// Calls counted at `at` for bulk and for high-priority callers.
    pub fn counted(&self, at: DateTime) -> (u32, u32) {
        let (mut bulk, mut high) = (0u32, 0u32);
        for e in self.log.iter().filter(|e| self.counts_at(e, at)) {
            if e.high {
                high = high.saturating_add(e.n);
            } else {
                bulk = bulk.saturating_add(e.n);
            }
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
    pub fn fits(&self, n: u32, priority: Priority, ticket: Option<&Ticket>) -> bool {
        self.fits_with(n, priority, self.ahead_of(priority, ticket), self.now)
    }

    /// The earliest server time at which `n` calls fit as entries age out, the queue ahead
    /// staying as it is; `None` if they never fit that way (the queue must move first).
    pub fn fits_at(&self, n: u32, priority: Priority, ticket: Option<&Ticket>) -> Option<DateTime> {
        let ahead = self.ahead_of(priority, ticket);
        if self.fits_with(n, priority, ahead, self.now) {
            return Some(self.now);
        }
        let span = span_ms(&self.limit);
        let mut leaving: Vec<i64> = self
            .log
            .iter()
            .filter(|e| self.counts_at(e, self.now))
            .map(|e| e.end.timestamp_millis() + span + 1)
            .collect();
        leaving.sort_unstable();
        leaving.dedup();
        leaving
            .into_iter()
            .map(DateTime::from_millis)
            .find(|&at| self.fits_with(n, priority, ahead, at))
    }

    /// [`fits_at`](View::fits_at) if the pending reservations are settled now with every call
    /// made, the usual case: the earliest a waiter can hope for (it is never later).
    pub fn likely_fits_at(
        &self,
        n: u32,
        priority: Priority,
        ticket: Option<&Ticket>,
    ) -> Option<DateTime> {
        let mut settled_now = self.clone();
        for e in &mut settled_now.log {
            if !e.settled && e.end > self.now {
                e.end = self.now;
            }
        }
        settled_now.fits_at(n, priority, ticket)
    }

    /// The usage summary of the reading.
    pub fn usage(&self) -> crate::ratelimit::limit::Usage {
        let (bulk, high) = self.counted(self.now);
        crate::ratelimit::limit::Usage {
            limit: self.limit,
            now: self.now,
            bulk,
            high,
            pending: self
                .log
                .iter()
                .filter(|e| !e.settled && e.end >= self.now)
                .count(),
            waiting: self.wait.iter().filter(|w| w.exp >= self.now).count(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn view(
        limit: Limit,
        now: i64,
        log: &[(u32, bool, i64)],
        wait: &[(&str, u32, i64, i64)],
    ) -> View {
        View {
            limit,
            now: DateTime::from_millis(now),
            log: log
                .iter()
                .enumerate()
                .map(|(i, &(n, high, end))| Entry {
                    key: format!("r{i}"),
                    n,
                    high,
                    end: DateTime::from_millis(end),
                    settled: false,
                })
                .collect(),
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

    #[test]
    fn an_entry_counts_for_one_widened_window_after_its_end() {
        let v = view(
            limit(),
            10_000,
            &[(4, false, 8_998), (2, false, 8_997)],
            &[],
        );
        assert_eq!(
            v.counted(v.now),
            (4, 0),
            "end + 1002 ms >= now counts, older does not"
        );
    }

    #[test]
    fn bulk_leaves_the_reserved_part_to_high_priority() {
        let v = view(limit(), 10_000, &[(6, false, 10_000)], &[]);
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
        let v = view(limit(), 10_000, &[(2, false, 10_000)], &wait);
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
        let v = view(limit(), 10_000, &[], &tie);
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
    fn fits_at_is_when_enough_entries_age_out() {
        let v = view(
            limit(),
            10_000,
            &[(3, false, 9_500), (3, false, 9_800), (1, false, 9_990)],
            &[],
        );
        assert!(!v.fits(2, Priority::Bulk, None), "7 + 3 + 2 > 10");
        // The 9_500 entry stops counting at 9_500 + 1002 + 1.
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
        // The 9_990 entry still pending (ending at 10_500): once settled it would free its
        // call at 10_000 + 1002 + 1 rather than 10_500 + 1003.
        let mut pending = view(
            limit(),
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
        pending.log[2].settled = true;
        assert_eq!(
            pending.likely_fits_at(7, Priority::Bulk, None),
            Some(DateTime::from_millis(11_503))
        );
    }
}
