//! The one-round serial queuer, as a pure function from the batches and "now" to the queue:
//! which batches a submitter should take next. It follows the reference design, a planning
//! document for the one-round serial strategy that gives six steps and a table sorting every
//! state a batch can be in into queue now, queue later and don't queue. No I/O, so every row of
//! that table is a unit test.
//!
//! The reference design's six steps:
//!
//! 1. Leave out batches the ledger has settled (committed, valid, invalid).
//! 2. Start an empty queue.
//! 3. Queue every batch the ledger does not know (unknown).
//! 4. Queue every delayed batch whose last submission is at least the delay window ago.
//! 5. List the services that have no pending, unknown or delayed batch.
//! 6. For each of them, queue its oldest batch; among batches created at the same time, the
//!    one whose header sorts first.
//!
//! Two readings the table makes explicit and the steps leave implicit: a batch a submitter
//! has (`submitted`) is never queued, and its service gets nothing else queued meanwhile (step 6
//! would otherwise queue the service's next batch while the first is being submitted, two in
//! flight). Unknown and delayed batches are queued only when no submitter has them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use bson::DateTime;

use crate::queue::model::{self, conflicts, Batch, BatchStatus};

/// Where a batch stands for the queuer (the three categories of the reference design's table):
/// the table written out, which the unit tests hold [`one_round_serial`] to.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    /// In this round's queue.
    QueueNow,
    /// Not now, but a later round will queue it (its delay window, or an earlier batch of its
    /// service, must pass first).
    QueueLater,
    /// Never by the queuer: a submitter has it, the ledger has it, or the ledger settled it.
    DontQueue,
}

/// Whether a delayed batch's window has passed at `now`.
fn delay_passed(batch: &Batch, now: DateTime, delay: Duration) -> bool {
    let delay_ms = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
    match batch.last_submitted_at {
        // Delayed without a recorded attempt: nothing to wait for.
        None => true,
        Some(at) => at.timestamp_millis() <= now.timestamp_millis().saturating_sub(delay_ms),
    }
}

/// Oldest first, then by header: the order batches of one service must reach the ledger in.
fn by_age(a: &&Batch, b: &&Batch) -> std::cmp::Ordering {
    a.created_at
        .cmp(&b.created_at)
        .then_with(|| a.header.cmp(&b.header))
}

/// This round's queue: unknown batches, then delayed ones whose window has passed, then the
/// oldest new batch of every service that has nothing in flight, services in id order.
pub fn one_round_serial<'a>(
    batches: impl IntoIterator<Item = &'a Batch>,
    now: DateTime,
    delay: Duration,
) -> Vec<&'a Batch> {
    // Step 1.
    let list: Vec<&Batch> = batches
        .into_iter()
        .filter(|b| !b.status.is_some_and(BatchStatus::is_final))
        .collect();
    // Step 2.
    let mut queue: Vec<&Batch> = Vec::new();
    // Step 3.
    let mut unknown: Vec<&Batch> = list
        .iter()
        .copied()
        .filter(|b| b.status == Some(BatchStatus::Unknown) && !b.submitted)
        .collect();
    unknown.sort_by(by_age);
    queue.extend(unknown);
    // Step 4.
    let mut delayed: Vec<&Batch> = list
        .iter()
        .copied()
        .filter(|b| {
            b.status == Some(BatchStatus::Delayed) && !b.submitted && delay_passed(b, now, delay)
        })
        .collect();
    delayed.sort_by(by_age);
    queue.extend(delayed);
    // Step 5: services with something at the ledger, in doubt, or in a submitter's hands wait.
    let busy: BTreeSet<&str> = list
        .iter()
        .filter(|b| {
            b.submitted
                || matches!(
                    b.status,
                    Some(BatchStatus::Pending | BatchStatus::Unknown | BatchStatus::Delayed)
                )
        })
        .map(|b| b.service_id.as_str())
        .collect();
    // Step 6.
    let mut oldest: BTreeMap<&str, &Batch> = BTreeMap::new();
    for b in list
        .iter()
        .copied()
        .filter(|b| !busy.contains(b.service_id.as_str()))
    {
        let slot = oldest.entry(b.service_id.as_str()).or_insert(b);
        if by_age(&b, slot).is_lt() {
            *slot = b;
        }
    }
    queue.extend(oldest.into_values());
    queue
}

/// This round's queue over batches of services of either strategy: each service's batches by
/// its own (a service's batches all have its strategy).
pub fn one_round(batches: &[Batch], now: DateTime, delay: Duration) -> Vec<&Batch> {
    // By reference: this runs on every round of every submitter.
    let (parallel, serial): (Vec<&Batch>, Vec<&Batch>) = batches
        .iter()
        .partition(|b| b.strategy == model::Strategy::Parallel);
    let mut queue = one_round_serial(serial, now, delay);
    queue.extend(one_round_parallel(parallel, now, delay));
    queue
}

/// This round's queue for services of the parallel strategy: every batch no submitter has
/// whose older conflicting batches the ledger is done with (committed or invalid) that is new,
/// or delayed past its window; and every unknown batch, and delayed one past its window, whose
/// older conflicting batches are not all done (its claimant finds it out of order and makes it
/// new again, to wait its turn). Services in id order, each oldest first.
pub fn one_round_parallel<'a>(
    batches: impl IntoIterator<Item = &'a Batch>,
    now: DateTime,
    delay: Duration,
) -> Vec<&'a Batch> {
    let mut services: BTreeMap<&str, Vec<&Batch>> = BTreeMap::new();
    for b in batches {
        services.entry(b.service_id.as_str()).or_default().push(b);
    }
    let mut queue = Vec::new();
    for (_, mut list) in services {
        list.sort_by(by_age);
        let mut open: Vec<&Batch> = Vec::new();
        for b in list {
            if matches!(
                b.status,
                Some(BatchStatus::Committed | BatchStatus::Invalid)
            ) {
                continue;
            }
            let blocked = open
                .iter()
                .any(|o| conflicts(o.keys.as_ref(), b.keys.as_ref()));
            let ready = !b.submitted
                && match b.status {
                    None => !blocked,
                    Some(BatchStatus::Unknown) => true,
                    Some(BatchStatus::Delayed) => delay_passed(b, now, delay),
                    Some(_) => false,
                };
            if ready {
                queue.push(b);
            }
            open.push(b);
        }
    }
    queue
}

/// The category of `batch` among `batches` at `now`, consistent with [`one_round_serial`].
#[cfg(test)]
pub fn category(batch: &Batch, batches: &[Batch], now: DateTime, delay: Duration) -> Category {
    if one_round_serial(batches, now, delay)
        .iter()
        .any(|q| q.header == batch.header)
    {
        return Category::QueueNow;
    }
    let with_submitter_or_ledger = batch.submitted
        || matches!(
            batch.status,
            Some(
                BatchStatus::Pending
                    | BatchStatus::Invalid
                    | BatchStatus::Valid
                    | BatchStatus::Committed
            )
        );
    if with_submitter_or_ledger {
        Category::DontQueue
    } else {
        Category::QueueLater
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::model::DEFAULT_DELAY;

    const NOW: i64 = 1_000_000;

    fn batch(header: &str, service: &str, created: i64) -> Batch {
        Batch {
            header: header.into(),
            service_id: service.into(),
            created_at: DateTime::from_millis(created).to_chrono(),
            submitted: false,
            status: None,
            last_submitted_at: None,
            keys: None,
            strategy: model::Strategy::Serial,
        }
    }

    fn with(mut b: Batch, submitted: bool, status: Option<BatchStatus>) -> Batch {
        b.submitted = submitted;
        b.status = status;
        b
    }

    fn last_submitted(mut b: Batch, ms_ago: i64) -> Batch {
        b.last_submitted_at = Some(DateTime::from_millis(NOW - ms_ago).to_chrono());
        b
    }

    fn cat(target: &Batch, others: &[Batch]) -> Category {
        let mut all = others.to_vec();
        all.push(target.clone());
        category(target, &all, DateTime::from_millis(NOW), DEFAULT_DELAY)
    }

    fn queued(batches: &[Batch]) -> Vec<String> {
        one_round_serial(batches, DateTime::from_millis(NOW), DEFAULT_DELAY)
            .into_iter()
            .map(|b| b.header.clone())
            .collect()
    }

    // Queue now.

    #[test]
    fn queue_now_a_new_batch_of_a_service_with_nothing_pending_unknown_or_delayed() {
        let b = batch("b1", "s1", 10);
        assert_eq!(cat(&b, &[]), Category::QueueNow);
        // Other services' batches in any state do not hold it back.
        let others = [
            with(batch("x1", "s2", 1), true, Some(BatchStatus::Pending)),
            with(batch("x2", "s3", 1), false, Some(BatchStatus::Unknown)),
        ];
        assert_eq!(cat(&b, &others), Category::QueueNow);
    }

    #[test]
    fn queue_now_an_unknown_batch() {
        let b = with(batch("b1", "s1", 10), false, Some(BatchStatus::Unknown));
        assert_eq!(cat(&b, &[]), Category::QueueNow);
    }

    #[test]
    fn queue_now_a_delayed_batch_whose_window_has_passed() {
        let b = last_submitted(
            with(batch("b1", "s1", 10), false, Some(BatchStatus::Delayed)),
            15_000,
        );
        assert_eq!(cat(&b, &[]), Category::QueueNow, "exactly 15 s ago counts");
        let b = last_submitted(b, 60_000);
        assert_eq!(cat(&b, &[]), Category::QueueNow);
    }

    // Queue later.

    #[test]
    fn queue_later_a_delayed_batch_inside_its_window() {
        let b = last_submitted(
            with(batch("b1", "s1", 10), false, Some(BatchStatus::Delayed)),
            14_999,
        );
        assert_eq!(cat(&b, &[]), Category::QueueLater);
    }

    #[test]
    fn queue_later_a_new_batch_of_a_service_with_a_pending_unknown_or_delayed_batch() {
        let b = batch("b2", "s1", 20);
        for blocker in [
            with(batch("b1", "s1", 10), true, Some(BatchStatus::Pending)),
            with(batch("b1", "s1", 10), false, Some(BatchStatus::Unknown)),
            last_submitted(
                with(batch("b1", "s1", 10), false, Some(BatchStatus::Delayed)),
                1_000,
            ),
            last_submitted(
                with(batch("b1", "s1", 10), false, Some(BatchStatus::Delayed)),
                60_000,
            ),
        ] {
            assert_eq!(
                cat(&b, std::slice::from_ref(&blocker)),
                Category::QueueLater,
                "{blocker:?}"
            );
        }
    }

    #[test]
    fn queue_later_a_new_batch_while_its_service_has_one_with_a_submitter() {
        // Beyond the reference design's six steps: the service's first batch is being submitted.
        let b = batch("b2", "s1", 20);
        let in_flight = with(batch("b1", "s1", 10), true, None);
        assert_eq!(cat(&b, &[in_flight]), Category::QueueLater);
    }

    #[test]
    fn queue_later_a_newer_batch_of_a_service_behind_its_oldest() {
        let b = batch("b2", "s1", 20);
        assert_eq!(cat(&b, &[batch("b1", "s1", 10)]), Category::QueueLater);
    }

    // Don't queue.

    #[test]
    fn dont_queue_a_submitted_pending_batch() {
        let b = with(batch("b1", "s1", 10), true, Some(BatchStatus::Pending));
        assert_eq!(cat(&b, &[]), Category::DontQueue);
    }

    #[test]
    fn dont_queue_an_invalid_batch() {
        let b = with(batch("b1", "s1", 10), true, Some(BatchStatus::Invalid));
        assert_eq!(cat(&b, &[]), Category::DontQueue);
        assert_eq!(
            cat(&with(b, false, Some(BatchStatus::Invalid)), &[]),
            Category::DontQueue
        );
    }

    #[test]
    fn dont_queue_a_valid_batch() {
        let b = with(batch("b1", "s1", 10), true, Some(BatchStatus::Valid));
        assert_eq!(cat(&b, &[]), Category::DontQueue);
    }

    #[test]
    fn dont_queue_a_committed_batch() {
        let b = with(batch("b1", "s1", 10), true, Some(BatchStatus::Committed));
        assert_eq!(cat(&b, &[]), Category::DontQueue);
    }

    #[test]
    fn dont_queue_a_batch_being_submitted() {
        let b = with(batch("b1", "s1", 10), true, None);
        assert_eq!(cat(&b, &[]), Category::DontQueue);
        // Nor an unknown or delayed one a submitter has taken again.
        for status in [BatchStatus::Unknown, BatchStatus::Delayed] {
            let b = with(batch("b1", "s1", 10), true, Some(status));
            assert_eq!(cat(&b, &[]), Category::DontQueue, "{status}");
        }
    }

    // The steps.

    #[test]
    fn step_1_leaves_out_committed_valid_and_invalid_batches() {
        let settled = [
            with(batch("c", "s1", 1), false, Some(BatchStatus::Committed)),
            with(batch("v", "s1", 2), false, Some(BatchStatus::Valid)),
            with(batch("i", "s1", 3), false, Some(BatchStatus::Invalid)),
        ];
        let mut all = settled.to_vec();
        all.push(batch("n", "s1", 4));
        assert_eq!(
            queued(&all),
            vec!["n"],
            "settled batches neither queue nor block"
        );
    }

    #[test]
    fn steps_3_and_4_queue_unknown_then_due_delayed_before_new_batches() {
        let all = [
            batch("new-s3", "s3", 1),
            last_submitted(
                with(batch("d-due", "s2", 5), false, Some(BatchStatus::Delayed)),
                20_000,
            ),
            last_submitted(
                with(batch("d-early", "s4", 5), false, Some(BatchStatus::Delayed)),
                1_000,
            ),
            with(batch("u", "s1", 9), false, Some(BatchStatus::Unknown)),
        ];
        assert_eq!(queued(&all), vec!["u", "d-due", "new-s3"]);
    }

    #[test]
    fn step_5_skips_services_with_a_pending_unknown_or_delayed_batch() {
        let all = [
            with(batch("p", "s1", 1), true, Some(BatchStatus::Pending)),
            batch("s1-next", "s1", 2),
            batch("s2-first", "s2", 3),
        ];
        assert_eq!(queued(&all), vec!["s2-first"]);
    }

    #[test]
    fn step_6_queues_the_oldest_batch_of_each_service() {
        let all = [
            batch("b3", "s1", 30),
            batch("b1", "s1", 10),
            batch("b2", "s1", 20),
            batch("c2", "s2", 5),
            batch("c1", "s2", 4),
        ];
        assert_eq!(queued(&all), vec!["b1", "c1"]);
    }

    #[test]
    fn step_6_breaks_a_creation_time_tie_by_the_first_header_in_sort_order() {
        let all = [
            batch("zeta", "s1", 10),
            batch("alpha", "s1", 10),
            batch("mid", "s1", 10),
        ];
        assert_eq!(queued(&all), vec!["alpha"]);
        let mut reversed = all.to_vec();
        reversed.reverse();
        assert_eq!(queued(&reversed), vec!["alpha"], "whatever the input order");
    }

    #[test]
    fn the_delay_window_is_configurable() {
        let b = last_submitted(
            with(batch("b1", "s1", 10), false, Some(BatchStatus::Delayed)),
            5_000,
        );
        let all = [b.clone()];
        let now = DateTime::from_millis(NOW);
        assert_eq!(
            category(&b, &all, now, Duration::from_secs(5)),
            Category::QueueNow
        );
        assert_eq!(category(&b, &all, now, DEFAULT_DELAY), Category::QueueLater);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        const STATUSES: [Option<BatchStatus>; 7] = [
            None,
            Some(BatchStatus::Pending),
            Some(BatchStatus::Invalid),
            Some(BatchStatus::Valid),
            Some(BatchStatus::Committed),
            Some(BatchStatus::Unknown),
            Some(BatchStatus::Delayed),
        ];

        /// Up to 24 batches of up to four services, created within a few milliseconds of each
        /// other (so that ties on the creation time happen), in every status, some with a
        /// submitter, some last submitted inside the delay window and some before it.
        fn batches() -> impl Strategy<Value = Vec<Batch>> {
            prop::collection::vec(
                (
                    0..4_u8,
                    0..6_i64,
                    any::<bool>(),
                    0..7_usize,
                    prop::option::of(0..3_i64),
                ),
                0..24,
            )
            .prop_map(|rows| {
                rows.into_iter()
                    .enumerate()
                    .map(|(i, (service, created, submitted, status, last))| Batch {
                        header: format!("h{:02}", (i * 7) % 24 + i / 24 * 24),
                        service_id: format!("s{service}"),
                        created_at: DateTime::from_millis(NOW - 100 + created).to_chrono(),
                        submitted,
                        status: STATUSES[status],
                        // 0: long ago; 1: just outside the window; 2: inside it.
                        last_submitted_at: last.map(|l| {
                            let window = DEFAULT_DELAY.as_millis() as i64;
                            DateTime::from_millis(match l {
                                0 => NOW - 10 * window,
                                1 => NOW - window,
                                _ => NOW - window + 1,
                            })
                            .to_chrono()
                        }),
                        keys: None,
                        strategy: model::Strategy::Serial,
                    })
                    .collect()
            })
        }

        fn key(b: &Batch) -> (chrono::DateTime<chrono::Utc>, &str) {
            (b.created_at, b.header.as_str())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            /// The queue holds no settled batch, none a submitter has and none twice; it holds
            /// every unknown batch and every delayed one whose window passed; of the new
            /// batches, at most one per service, only for a service with nothing at the ledger,
            /// in doubt or with a submitter, and then its oldest (header breaking ties).
            #[test]
            fn the_queue_keeps_each_services_order_and_one_batch_in_flight(batches in batches()) {
                let now = DateTime::from_millis(NOW);
                let queue = one_round_serial(&batches, now, DEFAULT_DELAY);
                let headers: BTreeSet<&str> = queue.iter().map(|b| b.header.as_str()).collect();
                prop_assert_eq!(headers.len(), queue.len(), "a batch queued twice");
                for b in &queue {
                    prop_assert!(!b.submitted && !b.status.is_some_and(BatchStatus::is_final));
                    prop_assert!(b.status != Some(BatchStatus::Pending));
                }
                for b in batches.iter().filter(|b| !b.submitted) {
                    let queued = headers.contains(b.header.as_str());
                    match b.status {
                        Some(BatchStatus::Unknown) => prop_assert!(queued, "{:?}", b),
                        Some(BatchStatus::Delayed) => prop_assert_eq!(
                            queued,
                            delay_passed(b, now, DEFAULT_DELAY),
                            "{:?}",
                            b
                        ),
                        _ => {}
                    }
                }
                let services: BTreeSet<&str> =
                    batches.iter().map(|b| b.service_id.as_str()).collect();
                for service in services {
                    let of: Vec<&Batch> =
                        batches.iter().filter(|b| b.service_id == service).collect();
                    let new_queued: Vec<&&Batch> = queue
                        .iter()
                        .filter(|b| b.service_id == service && b.status.is_none())
                        .collect();
                    prop_assert!(new_queued.len() <= 1, "{} new batches of {}", new_queued.len(), service);
                    if let Some(first) = new_queued.first() {
                        // Settled batches are out of the picture (step 1), a mark left on one
                        // included.
                        let busy = of.iter().filter(|b| !b.status.is_some_and(BatchStatus::is_final)).any(|b| {
                            b.submitted
                                || matches!(
                                    b.status,
                                    Some(BatchStatus::Pending | BatchStatus::Unknown | BatchStatus::Delayed)
                                )
                        });
                        prop_assert!(!busy, "{} has a batch in flight, yet {} was queued", service, first.header);
                        let oldest = of
                            .iter()
                            .filter(|b| !b.status.is_some_and(BatchStatus::is_final))
                            .map(|b| key(b))
                            .min();
                        prop_assert_eq!(Some(key(first)), oldest);
                    }
                }
            }

            /// Every batch falls in exactly the category the queue and its state say: queued
            /// now, never (a submitter or the ledger has it, or the ledger settled it), or later.
            #[test]
            fn every_batch_is_in_the_category_its_state_gives(batches in batches()) {
                let now = DateTime::from_millis(NOW);
                let queue = one_round_serial(&batches, now, DEFAULT_DELAY);
                for b in &batches {
                    let queued = queue.iter().any(|q| q.header == b.header);
                    let expected = if queued {
                        Category::QueueNow
                    } else if b.submitted
                        || matches!(
                            b.status,
                            Some(BatchStatus::Pending | BatchStatus::Invalid | BatchStatus::Valid | BatchStatus::Committed)
                        )
                    {
                        Category::DontQueue
                    } else {
                        Category::QueueLater
                    };
                    prop_assert_eq!(category(b, &batches, now, DEFAULT_DELAY), expected, "{:?}", b);
                }
            }
        }
    }

    // The parallel round.

    fn par(header: &str, created: i64, reads: &[&str], writes: &[&str]) -> Batch {
        let mut b = batch(header, "p", created);
        b.strategy = model::Strategy::Parallel;
        b.keys = Some(crate::queue::model::Keys::new(
            reads.to_vec(),
            writes.to_vec(),
        ));
        b
    }

    fn queued_parallel(batches: &[Batch]) -> Vec<String> {
        one_round(batches, DateTime::from_millis(NOW), DEFAULT_DELAY)
            .into_iter()
            .map(|b| b.header.clone())
            .collect()
    }

    #[test]
    fn the_parallel_round_queues_every_batch_whose_older_conflicting_batches_are_done() {
        let a = par("a", 1, &[], &["x"]);
        let b = par("b", 2, &[], &["y"]);
        let c = par("c", 3, &["x"], &[]);
        let d = par("d", 4, &["y"], &["x"]);
        let mut e = par("e", 5, &[], &[]);
        e.keys = None;
        assert_eq!(
            queued_parallel(&[a.clone(), b.clone(), c.clone(), d.clone(), e.clone()]),
            ["a", "b"]
        );
        // a committed, b valid (not final): c goes, d waits for b (and c's read of x).
        let a_done = with(a.clone(), false, Some(BatchStatus::Committed));
        let b_valid = with(b.clone(), true, Some(BatchStatus::Valid));
        assert_eq!(
            queued_parallel(&[a_done.clone(), b_valid, c.clone(), d.clone(), e.clone()]),
            ["c"]
        );
        // A batch with a submitter is not queued, and keeps its chain waiting.
        let c_taken = with(c.clone(), true, None);
        let b_done = with(b.clone(), false, Some(BatchStatus::Invalid));
        assert_eq!(
            queued_parallel(&[a_done.clone(), b_done.clone(), c_taken, d.clone()]),
            Vec::<String>::new()
        );
        let c_done = with(c, false, Some(BatchStatus::Committed));
        assert_eq!(queued_parallel(&[a_done, b_done, c_done, d, e]), ["d"]);
    }

    #[test]
    fn the_parallel_round_queues_unknown_at_once_and_delayed_after_their_window() {
        let a = with(par("a", 1, &[], &["x"]), false, Some(BatchStatus::Unknown));
        let b = last_submitted(
            with(par("b", 2, &[], &["y"]), false, Some(BatchStatus::Delayed)),
            1_000,
        );
        let c = par("c", 3, &["x", "y"], &[]);
        let d = par("d", 4, &[], &["z"]);
        assert_eq!(
            queued_parallel(&[a.clone(), b.clone(), c.clone(), d.clone()]),
            ["a", "d"],
            "b waits out its window, c its chain"
        );
        let b_old = last_submitted(b, 20_000);
        assert_eq!(queued_parallel(&[a, b_old, c, d]), ["a", "b", "d"]);
    }

    #[test]
    fn a_round_over_both_strategies_sends_each_service_by_its_own() {
        let s1 = batch("s1", "s", 1);
        let s2 = batch("s2", "s", 2);
        let p1 = par("p1", 1, &[], &["x"]);
        let p2 = par("p2", 2, &[], &["y"]);
        assert_eq!(queued_parallel(&[s1, s2, p1, p2]), ["s1", "p1", "p2"]);
    }
}
