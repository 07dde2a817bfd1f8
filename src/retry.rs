//! The crate's one retry primitive. Every loop that sends something again (a write whose reply
//! was lost, a document held by a transaction, a contended counter) paces itself with a [`Retry`]
//! under a [`LockWait`] policy: a deadline (`max_wait`), exponential pauses with jitter (so that
//! writers queued on one document do not retry in lockstep), and optionally a number of tries.
//!
//! Written here rather than taken from a crate (`backon`, `backoff`): the loops decide *whether*
//! to retry from the protocol's state (a hold that went away, a reply that may have landed), so
//! what they share is only the pacing and the deadline, which is this small type.

use std::time::{Duration, Instant};

/// The shortest pause [`LockWait::backoff`] gives.
const MIN_PAUSE: Duration = Duration::from_millis(1);

/// How writers wait for a held document, and how they back off meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockWait {
    /// Total time to wait before failing with `Locked`.
    pub max_wait: Duration,
    /// First pause between attempts.
    pub initial_backoff: Duration,
    /// Longest pause between attempts.
    pub max_backoff: Duration,
}

impl Default for LockWait {
    fn default() -> LockWait {
        LockWait {
            max_wait: Duration::from_secs(2),
            initial_backoff: Duration::from_millis(2),
            max_backoff: Duration::from_millis(100),
        }
    }
}

impl LockWait {
    /// The pause before attempt `attempt` (0-based): exponential, capped, jittered so that writers
    /// queued on one document do not retry in lockstep, and at least 1 ms (a zero
    /// backoff would send attempts back to back against the server for the whole wait).
    pub fn backoff(&self, attempt: u32) -> Duration {
        use rand::Rng;
        let ceiling = self
            .initial_backoff
            .saturating_mul(1_u32 << attempt.min(16))
            .min(self.max_backoff)
            .max(MIN_PAUSE);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rand::rng().random_range(nanos / 2..=nanos)).max(MIN_PAUSE)
    }
}

/// Pacing and deadline of one run of retries; see the module documentation.
#[derive(Debug)]
pub(crate) struct Retry {
    policy: LockWait,
    started: Instant,
    pauses: u32,
    tries: Option<u32>,
}

impl Retry {
    /// Retries until `policy.max_wait` has passed since now.
    pub(crate) fn until_deadline(policy: LockWait) -> Retry {
        Retry {
            policy,
            started: Instant::now(),
            pauses: 0,
            tries: None,
        }
    }

    /// At most `tries` tries in all (the first included), paced by `policy`'s pauses; its
    /// deadline does not apply.
    pub(crate) fn tries(policy: LockWait, tries: u32) -> Retry {
        Retry {
            policy: LockWait {
                max_wait: Duration::MAX,
                ..policy
            },
            tries: Some(tries),
            ..Retry::until_deadline(policy)
        }
    }

    /// Whether no further try may start: the deadline has passed, or every try was made.
    pub(crate) fn exhausted(&self) -> bool {
        self.started.elapsed() >= self.policy.max_wait
            || self
                .tries
                .is_some_and(|n| self.pauses.saturating_add(1) >= n)
    }

    /// Pauses before the next try and returns `true`; returns `false` at once when
    /// [`exhausted`](Retry::exhausted).
    pub(crate) async fn next(&mut self) -> bool {
        if self.exhausted() {
            return false;
        }
        self.pause().await;
        true
    }

    /// Pauses before the next try, whatever the deadline (for loops that check it themselves,
    /// at the point where they know what to report).
    pub(crate) async fn pause(&mut self) {
        tokio::time::sleep(self.policy.backoff(self.pauses)).await;
        self.pauses = self.pauses.saturating_add(1);
    }

    /// How many pauses were made, which is the number of tries after the first.
    pub(crate) fn pauses(&self) -> u32 {
        self.pauses
    }

    /// How long since the run started.
    pub(crate) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fast() -> LockWait {
        LockWait {
            max_wait: Duration::from_millis(60),
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(4),
        }
    }

    #[tokio::test]
    async fn a_deadline_ends_the_run_and_pauses_grow_until_their_cap() {
        let mut retry = Retry::until_deadline(fast());
        let mut tries = 1;
        while retry.next().await {
            tries += 1;
        }
        assert!(retry.elapsed() >= Duration::from_millis(60));
        assert!(retry.exhausted());
        assert_eq!(retry.pauses() + 1, tries);
        // 1, 2, 4, 4, ... ms (jittered down to half): some tens of tries in 60 ms, not thousands.
        assert!((10..=130).contains(&tries), "{tries} tries");
    }

    #[tokio::test]
    async fn a_count_ends_the_run_whatever_the_deadline() {
        let mut retry = Retry::tries(fast(), 3);
        let mut tries = 1;
        while retry.next().await {
            tries += 1;
        }
        assert_eq!(tries, 3);
        let mut once = Retry::tries(fast(), 1);
        assert!(!once.next().await, "one try in all: no retry");
        assert_eq!(once.pauses(), 0);
    }
}
