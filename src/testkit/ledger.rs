//! A stand-in for the external ledger, for tests, the benchmark and the torture run. It accepts
//! batches and commits them after a delay, and can be told (by chance, or for one batch) to find a batch invalid, to
//! forget it (the ledger then reports it unknown), to answer "delayed" (the submission did not go
//! through), or to lose a submission while answering that it was accepted. It records the order
//! in which each service's batches were committed, and every breach of the rules a submitter
//! must keep: a second batch of a service accepted while another is in flight, a batch submitted
//! again after it was found invalid, and one batch header submitted with two contents. Batches of
//! parallel services that the test [declares](Ledger::declare) are held to the parallel rule
//! instead: a batch sent while an older batch it conflicts with is not final here (committed or
//! invalid), or after a younger one it conflicts with was taken, is a breach. It also
//! records each submission of a batch it already had (pending or committed): harmless to it, as
//! to any ledger that deduplicates by header, but a sign that two submitters had one batch.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::queue::{conflicts, Batch, Keys, LedgerApi, Strategy};
pub use crate::queue::{Answer, LedgerStatus};

/// What the ledger does with a submission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Commit it after the delay.
    Commit,
    /// Find it invalid.
    Invalid,
    /// Accept it, then forget it: it reports unknown.
    Forget,
    /// Answer delayed.
    Delay,
    /// Answer accepted but never record it: it reports unknown.
    Lose,
}

/// How often each fate is chosen at random (the rest commit).
#[derive(Debug, Clone, Copy)]
pub struct Faults {
    /// Fraction found invalid.
    pub invalid: f64,
    /// Fraction forgotten (unknown).
    pub unknown: f64,
    /// Fraction answered delayed.
    pub delayed: f64,
    /// Fraction lost after answering accepted.
    pub lost: f64,
}

impl Faults {
    /// No faults.
    pub const NONE: Faults = Faults {
        invalid: 0.0,
        unknown: 0.0,
        delayed: 0.0,
        lost: 0.0,
    };
}

#[derive(Debug)]
struct Entry {
    service: String,
    content: String,
    status: LedgerStatus,
    accepted_at: Instant,
}

/// A batch of a parallel service as the test declared it: its place in its service's order
/// and its keys.
#[derive(Debug)]
struct Declared {
    service: String,
    place: (i64, String),
    keys: Option<Keys>,
}

#[derive(Debug)]
struct State {
    declared: HashMap<String, Declared>,
    rng: StdRng,
    entries: HashMap<String, Entry>,
    /// Fates chosen for one batch's next submission.
    forced: HashMap<String, Fate>,
    committed: BTreeMap<String, Vec<String>>,
    breaches: Vec<String>,
    repeats: Vec<String>,
    submissions: u64,
}

/// The ledger simulator; cheap to clone (clones share the ledger).
#[derive(Debug, Clone)]
pub struct Ledger {
    commit_after: Duration,
    faults: Faults,
    state: Arc<Mutex<State>>,
}

impl Ledger {
    /// A ledger that commits a valid batch `commit_after` after taking it, with random `faults`
    /// drawn from `seed`.
    pub fn new(commit_after: Duration, faults: Faults, seed: u64) -> Ledger {
        Ledger {
            commit_after,
            faults,
            state: Arc::new(Mutex::new(State {
                rng: StdRng::seed_from_u64(seed),
                declared: HashMap::new(),
                entries: HashMap::new(),
                forced: HashMap::new(),
                committed: BTreeMap::new(),
                breaches: Vec::new(),
                repeats: Vec::new(),
                submissions: 0,
            })),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Decides what happens to `header`'s next submission.
    pub fn force(&self, header: &str, fate: Fate) {
        self.state().forced.insert(header.to_string(), fate);
    }

    /// Tells the ledger a batch of a parallel service (as `add` returned it): its submissions
    /// are then checked against the parallel rule. A batch of a serial service is left to the
    /// serial check.
    pub fn declare(&self, batch: &Batch) {
        if batch.strategy != Strategy::Parallel {
            return;
        }
        self.state().declared.insert(
            batch.header.clone(),
            Declared {
                service: batch.service_id.clone(),
                place: (batch.created_at.timestamp_millis(), batch.header.clone()),
                keys: batch.keys.clone(),
            },
        );
    }

    /// The parallel rule at the sending of declared batch `header`: every older batch of its
    /// service that it conflicts with is final here, and no younger one is taken.
    fn check_parallel(state: &mut State, header: &str) {
        let Some(sent) = state.declared.get(header) else {
            return;
        };
        let mut breaches = Vec::new();
        for (other, d) in &state.declared {
            if other == header
                || d.service != sent.service
                || !conflicts(d.keys.as_ref(), sent.keys.as_ref())
            {
                continue;
            }
            let status = state.entries.get(other).map(|e| e.status);
            let final_here = matches!(
                status,
                Some(LedgerStatus::Committed | LedgerStatus::Invalid)
            );
            if d.place < sent.place && !final_here {
                breaches.push(format!(
                    "{header} of {} sent while the older {other} it conflicts with is {status:?}",
                    sent.service
                ));
            } else if d.place > sent.place && status.is_some_and(|s| s != LedgerStatus::Unknown) {
                breaches.push(format!(
                    "{header} of {} sent after the younger {other} it conflicts with was taken ({status:?})",
                    sent.service
                ));
            }
        }
        state.breaches.extend(breaches);
    }

    /// Brings pending batches whose time has come to their end.
    fn settle(&self, state: &mut State) {
        let now = Instant::now();
        let mut done: Vec<(String, String)> = Vec::new();
        for (header, entry) in &mut state.entries {
            if entry.status == LedgerStatus::Pending
                && now.duration_since(entry.accepted_at) >= self.commit_after
            {
                entry.status = LedgerStatus::Committed;
                done.push((entry.service.clone(), header.clone()));
            }
        }
        // Commit order within one settling pass: by acceptance time.
        done.sort_by_key(|(_, h)| state.entries.get(h).map(|e| e.accepted_at));
        for (service, header) in done {
            state.committed.entry(service).or_default().push(header);
        }
    }

    /// Submits a batch.
    pub fn submit(&self, service: &str, header: &str, content: &str) -> Answer {
        let mut state = self.state();
        self.settle(&mut state);
        state.submissions += 1;
        let parallel = state.declared.contains_key(header);
        if parallel {
            Self::check_parallel(&mut state, header);
        }
        let known = state
            .entries
            .get(header)
            .map(|e| (e.content.clone(), e.status));
        if let Some((known_content, status)) = known {
            if known_content != content {
                state
                    .breaches
                    .push(format!("{header} submitted with another content"));
            }
            match status {
                LedgerStatus::Invalid => {
                    state.breaches.push(format!(
                        "{header} submitted again after it was found invalid"
                    ));
                    return Answer::Accepted;
                }
                // Already taken: a repeat changes nothing.
                LedgerStatus::Pending | LedgerStatus::Committed => {
                    state
                        .repeats
                        .push(format!("{header} submitted again while {status:?}"));
                    return Answer::Accepted;
                }
                LedgerStatus::Unknown => {}
            }
        }
        let fate = match state.forced.remove(header) {
            Some(fate) => fate,
            None => {
                let x: f64 = state.rng.random();
                let f = self.faults;
                if x < f.invalid {
                    Fate::Invalid
                } else if x < f.invalid + f.unknown {
                    Fate::Forget
                } else if x < f.invalid + f.unknown + f.delayed {
                    Fate::Delay
                } else if x < f.invalid + f.unknown + f.delayed + f.lost {
                    Fate::Lose
                } else {
                    Fate::Commit
                }
            }
        };
        let status = match fate {
            Fate::Delay => return Answer::Delayed,
            Fate::Lose => return Answer::Accepted,
            Fate::Commit => LedgerStatus::Pending,
            Fate::Invalid => LedgerStatus::Invalid,
            Fate::Forget => LedgerStatus::Unknown,
        };
        if status == LedgerStatus::Pending && !parallel {
            let in_flight = state.entries.iter().find(|(h, e)| {
                e.service == service && e.status == LedgerStatus::Pending && h.as_str() != header
            });
            if let Some((other, _)) = in_flight {
                let breach = format!("{header} of {service} taken while {other} is in flight");
                state.breaches.push(breach);
            }
        }
        state.entries.insert(
            header.to_string(),
            Entry {
                service: service.to_string(),
                content: content.to_string(),
                status,
                accepted_at: Instant::now(),
            },
        );
        Answer::Accepted
    }

    /// The ledger's status of a batch.
    pub fn status(&self, header: &str) -> LedgerStatus {
        let mut state = self.state();
        self.settle(&mut state);
        state
            .entries
            .get(header)
            .map_or(LedgerStatus::Unknown, |e| e.status)
    }

    /// Each service's batches in the order the ledger committed them.
    pub fn committed(&self) -> BTreeMap<String, Vec<String>> {
        let mut state = self.state();
        self.settle(&mut state);
        state.committed.clone()
    }

    /// Every breach of the submitters' rules seen so far.
    pub fn breaches(&self) -> Vec<String> {
        self.state().breaches.clone()
    }

    /// Every submission of a batch the ledger already had (pending or committed), in order.
    pub fn repeats(&self) -> Vec<String> {
        self.state().repeats.clone()
    }

    /// Submissions received.
    pub fn submissions(&self) -> u64 {
        self.state().submissions
    }
}

impl LedgerApi for Ledger {
    async fn submit(&self, service: &str, header: &str, content: &str) -> Result<Answer, String> {
        Ok(Ledger::submit(self, service, header, content))
    }

    async fn status(&self, header: &str) -> Result<LedgerStatus, String> {
        Ok(Ledger::status(self, header))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_commits_after_the_delay_in_order_per_service() {
        let ledger = Ledger::new(Duration::ZERO, Faults::NONE, 1);
        assert_eq!(ledger.submit("s1", "a", "x"), Answer::Accepted);
        assert_eq!(ledger.status("a"), LedgerStatus::Committed);
        ledger.submit("s1", "b", "y");
        ledger.submit("s2", "c", "z");
        let committed = ledger.committed();
        assert_eq!(committed["s1"], vec!["a", "b"]);
        assert_eq!(committed["s2"], vec!["c"]);
        assert!(ledger.breaches().is_empty());
    }

    #[test]
    fn forced_fates_and_breaches_are_reported() {
        let ledger = Ledger::new(Duration::from_secs(3600), Faults::NONE, 1);
        ledger.force("a", Fate::Delay);
        assert_eq!(ledger.submit("s1", "a", "x"), Answer::Delayed);
        assert_eq!(ledger.status("a"), LedgerStatus::Unknown);
        ledger.force("a", Fate::Lose);
        assert_eq!(ledger.submit("s1", "a", "x"), Answer::Accepted);
        assert_eq!(ledger.status("a"), LedgerStatus::Unknown, "lost");
        ledger.force("a", Fate::Forget);
        ledger.submit("s1", "a", "x");
        assert_eq!(ledger.status("a"), LedgerStatus::Unknown, "forgotten");
        ledger.submit("s1", "a", "x");
        assert_eq!(ledger.status("a"), LedgerStatus::Pending);
        assert!(ledger.breaches().is_empty());
        assert!(ledger.repeats().is_empty());
        ledger.submit("s1", "a", "x");
        assert_eq!(ledger.repeats(), vec!["a submitted again while Pending"]);
        ledger.submit("s1", "b", "y");
        ledger.force("c", Fate::Invalid);
        ledger.submit("s2", "c", "z");
        ledger.submit("s2", "c", "z2");
        let breaches = ledger.breaches();
        assert_eq!(breaches.len(), 3, "{breaches:?}");
        assert!(breaches[0].contains("in flight"));
        assert!(breaches.iter().any(|b| b.contains("another content")));
        assert!(breaches
            .iter()
            .any(|b| b.contains("after it was found invalid")));
    }

    #[test]
    fn random_faults_follow_their_fractions() {
        let faults = Faults {
            invalid: 0.05,
            unknown: 0.05,
            delayed: 0.05,
            lost: 0.0,
        };
        let ledger = Ledger::new(Duration::ZERO, faults, 7);
        let mut delayed = 0;
        for i in 0..2_000 {
            if ledger.submit(&format!("s{i}"), &format!("b{i}"), "x") == Answer::Delayed {
                delayed += 1;
            }
        }
        let invalid = (0..2_000)
            .filter(|i| ledger.status(&format!("b{i}")) == LedgerStatus::Invalid)
            .count();
        assert!((60..=140).contains(&delayed), "{delayed} delayed of 2,000");
        assert!((60..=140).contains(&invalid), "{invalid} invalid of 2,000");
    }
}
