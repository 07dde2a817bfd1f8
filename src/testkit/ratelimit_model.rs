//! Exhaustive models of rate limiting across workers, after the PlusCal models of the rate
//! limiter's reference design (a worked TLA+ example in which a bulk caller and a few
//! high-priority callers, on separate workers, share one API's call limit): the reservation
//! protocol the limiter implements, and the naive check-then-call that the reference design shows
//! failing, because another worker may call between a worker's check and its own call.
//! [`explore`] visits every reachable state (breadth first, so a counterexample is a shortest
//! one) and checks each against the model's property.
//!
//! Time is discrete: a tick is one step of the server's clock, and every process sees the same
//! clock (the limiter's time comes from the server). A window is `window` consecutive ticks; the
//! property is that **every** window, not only aligned ones, holds at most `limit` calls.

pub use crate::testkit::explore::{explore, Explored, Model};

pub mod settle;

/// The sizes of a model: `limit` calls per `window` ticks, of which `reserved` are kept for
/// high-priority callers, one bulk process (one call at a time, any number of times) and
/// `priority` processes (one reservation of 1 or 2 calls each).
///
/// States record time relative to now (calls of the last `window` ticks, ages of reservations),
/// so the exploration covers unbounded time and ends when no new state appears.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Calls allowed in any window.
    pub limit: u8,
    /// Ticks in a window (at least 1).
    pub window: u8,
    /// Priority processes.
    pub priority: u8,
    /// Calls bulk callers leave to high-priority callers (less than `limit`).
    pub reserved: u8,
}

/// Calls in the window ending now: `calls` holds the last `window` ticks, oldest first.
fn calls_in(calls: &[u8]) -> u32 {
    calls.iter().map(|&c| u32::from(c)).sum()
}

fn every_window_holds(calls: &[u8], sizes: &Sizes) -> Result<(), String> {
    let seen = calls_in(calls);
    if seen > u32::from(sizes.limit) {
        return Err(format!(
            "{seen} calls in a window of {} ticks, limit {} (calls per tick: {calls:?})",
            sizes.window, sizes.limit
        ));
    }
    Ok(())
}

/// The clock moves one tick: the oldest tick leaves the window.
fn tick(calls: &mut Vec<u8>) {
    calls.remove(0);
    calls.push(0);
}

fn now(calls: &mut [u8]) -> &mut u8 {
    let last = calls.len() - 1;
    &mut calls[last]
}

/// A process of the reservation model.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Worker {
    /// Not holding anything (a priority process that has not reserved yet, or the bulk process
    /// between reservations).
    Idle,
    /// Holding a reservation of `n` calls granted `age` ticks ago, `made` of them made so far.
    Holding {
        /// Ticks since the grant.
        age: u8,
        /// Calls reserved.
        n: u8,
        /// Calls made.
        made: u8,
    },
    /// A priority process that settled its reservation.
    Done,
    /// Died holding a reservation of `n` calls granted `age` ticks ago: never settles.
    Dead {
        /// Ticks since the grant.
        age: u8,
        /// Calls reserved.
        n: u8,
    },
}

/// A state of the reservation model.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReservationState {
    /// Calls that reached the API in each of the last `window` ticks, oldest first.
    pub calls: Vec<u8>,
    /// Calls made under settled bulk reservations the limiter still counts, by ticks since the
    /// grant.
    pub settled: Vec<u8>,
    /// The same for high-priority reservations.
    pub settled_high: Vec<u8>,
    /// Process 0 is the bulk process, the rest are priority processes.
    pub workers: Vec<Worker>,
}

/// The reservation protocol: a reservation covers the calls its holder makes in the tick it was
/// granted (a holder that missed that tick makes none); the limiter counts every live or dead
/// reservation of the window ending now in full and every settled one as made, `bulk` and
/// `high` apart, and grants a high-priority `n` if `bulk + high + n <= limit`, a bulk `n` if
/// `bulk + max(reserved, high) + n <= limit` (the window ending now is every window that can
/// contain the new calls). Settling returns unused calls at once; a dead worker's reservation
/// counts in full until its window has passed. Any worker may die while holding.
///
/// Checked in every state: no window holds more than `limit` calls; no idle worker waits
/// forever (time alone frees room for it); and a high-priority request for no more than what is
/// left of the reserved part is grantable, whatever the bulk process holds.
#[derive(Debug, Clone, Copy)]
pub struct ReservationModel(pub Sizes);

impl ReservationModel {
    /// What the limiter counts in the window ending now: (bulk, high priority).
    fn counted(&self, state: &ReservationState) -> (u32, u32) {
        let held = |bulk: bool| -> u32 {
            state
                .workers
                .iter()
                .enumerate()
                .filter(|(i, _)| (*i == 0) == bulk)
                .map(|(_, worker)| match *worker {
                    Worker::Holding { n, .. } | Worker::Dead { n, .. } => u32::from(n),
                    _ => 0,
                })
                .sum()
        };
        let sum = |v: &[u8]| v.iter().map(|&made| u32::from(made)).sum::<u32>();
        (
            held(true) + sum(&state.settled),
            held(false) + sum(&state.settled_high),
        )
    }

    /// The admission rule, as the limiter's `$expr` has it.
    pub fn grantable(&self, state: &ReservationState, n: u8, bulk: bool) -> bool {
        let (b, h) = self.counted(state);
        let n = u32::from(n);
        let limit = u32::from(self.0.limit);
        if bulk {
            b + h.max(u32::from(self.0.reserved)) + n <= limit
        } else {
            b + h + n <= limit
        }
    }

    /// The clock moves on: reservations age, and what no window from now on can contain is
    /// forgotten (a dead worker's reservation included).
    fn advance(&self, state: &ReservationState) -> ReservationState {
        let mut s = state.clone();
        tick(&mut s.calls);
        let w = self.0.window;
        for settled in [&mut s.settled, &mut s.settled_high] {
            settled.pop();
            settled.insert(0, 0);
        }
        for worker in &mut s.workers {
            *worker = match *worker {
                Worker::Holding { age, n, made } => Worker::Holding {
                    age: (age + 1).min(w),
                    n,
                    made,
                },
                Worker::Dead { age, .. } if age + 1 >= w => Worker::Done,
                Worker::Dead { age, n } => Worker::Dead { age: age + 1, n },
                ref other => other.clone(),
            };
        }
        s
    }

    /// Whether time alone makes `n` grantable within a window: a dead worker's reservation
    /// never blocks the others for good.
    pub fn frees_up(&self, state: &ReservationState, n: u8, bulk: bool) -> bool {
        let mut later = state.clone();
        for _ in 0..=self.0.window {
            if self.grantable(&later, n, bulk) {
                return true;
            }
            later = self.advance(&later);
            // Live holders would settle; only the dead stay.
            for w in &mut later.workers {
                if let Worker::Holding { .. } = w {
                    *w = Worker::Idle;
                }
            }
        }
        false
    }
}

impl Model for ReservationModel {
    type State = ReservationState;

    fn init(&self) -> Vec<ReservationState> {
        vec![ReservationState {
            calls: vec![0; usize::from(self.0.window)],
            settled: vec![0; usize::from(self.0.window)],
            settled_high: vec![0; usize::from(self.0.window)],
            workers: vec![Worker::Idle; 1 + usize::from(self.0.priority)],
        }]
    }

    fn next(&self, state: &ReservationState) -> Vec<ReservationState> {
        let mut out = Vec::new();
        for (i, worker) in state.workers.iter().enumerate() {
            let bulk = i == 0;
            let with = |w: Worker| {
                let mut s = state.clone();
                s.workers[i] = w;
                s
            };
            match *worker {
                Worker::Idle => {
                    for n in if bulk { 1..=1 } else { 1..=2 } {
                        if self.grantable(state, n, bulk) {
                            out.push(with(Worker::Holding { age: 0, n, made: 0 }));
                        }
                    }
                }
                Worker::Holding { age, n, made } => {
                    if made < n && age == 0 {
                        let mut s = with(Worker::Holding {
                            age,
                            n,
                            made: made + 1,
                        });
                        *now(&mut s.calls) += 1;
                        out.push(s);
                    }
                    let mut s = with(if bulk { Worker::Idle } else { Worker::Done });
                    if age < self.0.window {
                        let settled = if bulk {
                            &mut s.settled
                        } else {
                            &mut s.settled_high
                        };
                        settled[usize::from(age)] += made;
                    }
                    out.push(s);
                    out.push(with(if age < self.0.window {
                        Worker::Dead { age, n }
                    } else {
                        Worker::Done
                    }));
                }
                Worker::Done | Worker::Dead { .. } => {}
            }
        }
        out.push(self.advance(state));
        out
    }

    fn check(&self, state: &ReservationState) -> Result<(), String> {
        every_window_holds(&state.calls, &self.0)?;
        let (_, high) = self.counted(state);
        let left = u32::from(self.0.reserved).saturating_sub(high);
        for (i, worker) in state.workers.iter().enumerate() {
            if *worker != Worker::Idle {
                continue;
            }
            let bulk = i == 0;
            let n = if bulk { 1 } else { 2.min(self.0.limit) };
            if !self.frees_up(state, n, bulk) {
                return Err(format!("worker {i} waits forever for {n} calls: {state:?}"));
            }
            for n in 1..=2u8 {
                if !bulk && u32::from(n) <= left && !self.grantable(state, n, false) {
                    return Err(format!(
                        "high-priority worker {i} waits for {n} calls with {left} of the reserved part left: {state:?}"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A process of the naive model.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Checker {
    /// About to look at the count.
    Idle,
    /// Saw `seen` calls in the current window and will call `n` times if that leaves room.
    Checked {
        /// The count it read.
        seen: u8,
        /// Calls it will make.
        n: u8,
    },
    /// A priority process that made its calls.
    Done,
}

/// A state of the naive model.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NaiveState {
    /// Calls that reached the API in each of the last `window` ticks, oldest first.
    pub calls: Vec<u8>,
    /// Process 0 is the bulk process, the rest are priority processes.
    pub workers: Vec<Checker>,
}

/// The check-then-call that the reference design shows failing: each worker reads the shared
/// count, then calls if it saw room, with other workers free to act in between.
#[derive(Debug, Clone, Copy)]
pub struct NaiveModel(pub Sizes);

impl Model for NaiveModel {
    type State = NaiveState;

    fn init(&self) -> Vec<NaiveState> {
        vec![NaiveState {
            calls: vec![0; usize::from(self.0.window)],
            workers: vec![Checker::Idle; 1 + usize::from(self.0.priority)],
        }]
    }

    fn next(&self, state: &NaiveState) -> Vec<NaiveState> {
        let mut out = Vec::new();
        for (i, worker) in state.workers.iter().enumerate() {
            let bulk = i == 0;
            let with = |w: Checker| {
                let mut s = state.clone();
                s.workers[i] = w;
                s
            };
            match *worker {
                Checker::Idle => {
                    let seen = u8::try_from(calls_in(&state.calls)).unwrap_or(u8::MAX);
                    for n in if bulk { 1..=1 } else { 1..=2 } {
                        out.push(with(Checker::Checked { seen, n }));
                    }
                }
                Checker::Checked { seen, n } => {
                    if u32::from(seen) + u32::from(n) <= u32::from(self.0.limit) {
                        let mut s = with(if bulk { Checker::Idle } else { Checker::Done });
                        *now(&mut s.calls) += n;
                        out.push(s);
                    } else {
                        out.push(with(Checker::Idle));
                    }
                }
                Checker::Done => {}
            }
        }
        let mut s = state.clone();
        tick(&mut s.calls);
        out.push(s);
        out
    }

    fn check(&self, state: &NaiveState) -> Result<(), String> {
        every_window_holds(&state.calls, &self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZES: Sizes = Sizes {
        limit: 3,
        window: 3,
        priority: 2,
        reserved: 1,
    };

    #[test]
    fn the_reservation_protocol_never_exceeds_the_limit_in_any_window_nor_deadlocks() {
        for sizes in [
            SIZES,
            Sizes {
                limit: 2,
                window: 2,
                priority: 3,
                reserved: 0,
            },
            Sizes {
                limit: 4,
                window: 2,
                priority: 2,
                reserved: 2,
            },
        ] {
            let explored = explore(&ReservationModel(sizes), 5_000_000);
            println!(
                "reservation model {sizes:?}: {} states explored, no violation",
                explored.states
            );
            assert!(!explored.truncated, "explored only part of it");
            if let Some((why, path)) = explored.violation {
                panic!("{why}\n{path:#?}");
            }
            assert!(explored.states > 1_000, "too small to mean anything");
        }
    }

    #[test]
    fn the_naive_check_then_call_is_caught_exceeding_the_limit() {
        let explored = explore(&NaiveModel(SIZES), 5_000_000);
        let (why, path) = explored.violation.expect("the naive model should fail");
        println!(
            "naive model: violation after {} states explored: {why}; shortest trace has {} steps",
            explored.states,
            path.len() - 1
        );
        for (i, s) in path.iter().enumerate() {
            println!("  {i}: calls {:?} workers {:?}", s.calls, s.workers);
        }
        assert!(why.contains("calls in a window"));
    }

    #[test]
    fn a_limiter_that_forgot_dead_reservations_is_caught() {
        // The same protocol, but a dead worker's reservation stops counting at once: its calls
        // may already have been made, so the model must find an overrun.
        #[derive(Debug, Clone, Copy)]
        struct Forgetful(ReservationModel);
        impl Model for Forgetful {
            type State = ReservationState;
            fn init(&self) -> Vec<ReservationState> {
                self.0.init()
            }
            fn next(&self, state: &ReservationState) -> Vec<ReservationState> {
                self.0
                    .next(state)
                    .into_iter()
                    .map(|mut s| {
                        for w in &mut s.workers {
                            if let Worker::Dead { .. } = w {
                                *w = Worker::Done;
                            }
                        }
                        s
                    })
                    .collect()
            }
            fn check(&self, state: &ReservationState) -> Result<(), String> {
                every_window_holds(&state.calls, &self.0 .0)
            }
        }
        let explored = explore(&Forgetful(ReservationModel(SIZES)), 5_000_000);
        let (why, _) = explored
            .violation
            .expect("forgetting dead reservations overruns");
        println!("forgetful limiter: {why} after {} states", explored.states);
    }

    #[test]
    fn bulk_callers_that_ignore_the_reserved_part_are_caught() {
        // Bulk admitted by `bulk + high + n <= limit`: it can take the reserved part, and a
        // high-priority caller then waits behind it.
        #[derive(Debug, Clone, Copy)]
        struct Greedy(ReservationModel);
        impl Model for Greedy {
            type State = ReservationState;
            fn init(&self) -> Vec<ReservationState> {
                self.0.init()
            }
            fn next(&self, state: &ReservationState) -> Vec<ReservationState> {
                let mut out = self.0.next(state);
                if state.workers[0] == Worker::Idle && self.0.grantable(state, 1, false) {
                    let mut s = state.clone();
                    s.workers[0] = Worker::Holding {
                        age: 0,
                        n: 1,
                        made: 0,
                    };
                    out.push(s);
                }
                out
            }
            fn check(&self, state: &ReservationState) -> Result<(), String> {
                self.0.check(state)
            }
        }
        let explored = explore(&Greedy(ReservationModel(SIZES)), 5_000_000);
        let (why, _) = explored
            .violation
            .expect("a greedy bulk caller makes high priority wait");
        println!("greedy bulk: {why} after {} states", explored.states);
        assert!(why.contains("reserved part"), "{why}");
    }
}
