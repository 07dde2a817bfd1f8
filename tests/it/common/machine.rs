//! The machine as a resource: a test that measures latency has it to itself.
//!
//! Every test runs in one process, two at a time on a two-core machine, against one shared test
//! server. A test that asserts how long something takes (the rate limiter's high-priority waits,
//! bounded at 1 % of a window at the 99th percentile) measures the machine as much as the product
//! when another test runs beside it: run next to the probe's racing checks and the property tests,
//! its p99 went from 10-12 ms alone to 45-48 ms, over its 40 ms bound, and CI failed on it.
//!
//! So a [`TestDb`](super::TestDb), and the few tests that need none but load the machine, hold a
//! [`Sharing`] turn for as long as they live, and a latency test takes [`alone`]: it waits for the
//! tests running to finish while new ones wait for it, then runs with nothing beside it. Turns are
//! counted per test (the test's thread, which libtest names after it), so a test that opens a
//! second database while a latency test waits is never the one that blocks it.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use super::FleetTurn;

struct Machine {
    /// The turns alive, by the test holding them.
    sharing: BTreeMap<String, usize>,
    /// The latency test waiting for the others to finish, or running.
    alone: Option<String>,
}

static MACHINE: (Mutex<Machine>, Condvar) = (
    Mutex::new(Machine {
        sharing: BTreeMap::new(),
        alone: None,
    }),
    Condvar::new(),
);

/// The test the calling thread runs (libtest runs each test on a thread named after it).
fn current_test() -> String {
    std::thread::current()
        .name()
        .unwrap_or("an unnamed thread")
        .to_string()
}

fn lock() -> MutexGuard<'static, Machine> {
    MACHINE.0.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A test's share of the machine; released when dropped.
pub struct Sharing(String);

/// Takes a share of the machine, waiting while a latency test has it (or waits for it) unless
/// this test already holds a share.
pub fn share() -> Sharing {
    let me = current_test();
    let mut machine = lock();
    if !machine.sharing.contains_key(&me) && machine.alone.as_ref() != Some(&me) {
        machine = MACHINE
            .1
            .wait_while(machine, |m| m.alone.is_some())
            .unwrap_or_else(PoisonError::into_inner);
    }
    *machine.sharing.entry(me.clone()).or_default() += 1;
    Sharing(me)
}

impl Drop for Sharing {
    fn drop(&mut self) {
        let mut machine = lock();
        if let Some(n) = machine.sharing.get_mut(&self.0) {
            *n -= 1;
            if *n == 0 {
                machine.sharing.remove(&self.0);
            }
        }
        MACHINE.1.notify_all();
    }
}

/// The machine to one latency test (and its fleet turn); released when dropped.
pub struct Alone {
    _fleet: FleetTurn,
}

/// Waits for the machine: first the fleet turn of `subject` (call it first thing in the test, with
/// `module_path!()`), then for every other test to finish, holding new ones back meanwhile.
pub fn alone(subject: &'static str) -> Alone {
    let fleet = super::fleet_turn(subject);
    let me = current_test();
    let mut machine = MACHINE
        .1
        .wait_while(lock(), |m| m.alone.is_some())
        .unwrap_or_else(PoisonError::into_inner);
    machine.alone = Some(me.clone());
    let machine = MACHINE
        .1
        .wait_while(machine, |m| m.sharing.keys().any(|test| *test != me))
        .unwrap_or_else(PoisonError::into_inner);
    drop(machine);
    Alone { _fleet: fleet }
}

impl Drop for Alone {
    fn drop(&mut self) {
        lock().alone = None;
        MACHINE.1.notify_all();
    }
}
