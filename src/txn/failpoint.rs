//! Fault injection: named points before and after every write of commit, rollback and GC.
//!
//! A test installs a [`FaultInjector`]; when it answers `true` at a point, the coordinator or GC
//! stops right there as if its process had died: no rollback, no cleanup, an error
//! [`Crashed`](crate::TxnError::Crashed). Injectors are per handle, not global, so tests that
//! inject faults can run in parallel with tests that do not.

#[cfg(feature = "testkit")]
use std::fmt;
#[cfg(feature = "testkit")]
use std::sync::{Arc, Mutex};

/// A point in the protocol: its name and, for per-document steps, the entry index in lock order.
#[cfg(feature = "testkit")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Failpoint {
    /// One of [`ALL`].
    pub name: &'static str,
    /// Entry index for per-document steps, 0 otherwise.
    pub step: usize,
}

#[cfg(feature = "testkit")]
impl fmt::Display for Failpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.name, self.step)
    }
}

/// Decides where to crash; consulted at every failpoint.
#[cfg(feature = "testkit")]
pub trait FaultInjector: Send + Sync + 'static {
    /// Whether the process "dies" at `point`.
    fn crash_at(&self, point: Failpoint) -> bool;
}

/// An injector that crashes at exactly one failpoint (the usual choice for crash tests).
#[cfg(feature = "testkit")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrashAt(pub Failpoint);

#[cfg(feature = "testkit")]
impl FaultInjector for CrashAt {
    fn crash_at(&self, point: Failpoint) -> bool {
        point == self.0
    }
}

/// Coordinator: before writing the ActiveTransaction document.
pub const BEGIN_BEFORE: &str = "begin.before";
/// Coordinator: after writing the ActiveTransaction document.
pub const BEGIN_AFTER: &str = "begin.after";
/// Coordinator: before applying an entry.
pub const APPLY_BEFORE: &str = "apply.before";
/// Coordinator: after applying an entry.
pub const APPLY_AFTER: &str = "apply.after";
/// Coordinator: before the commit point.
pub const COMMIT_BEFORE: &str = "commit.before";
/// Coordinator: after the commit point.
pub const COMMIT_AFTER: &str = "commit.after";
/// Coordinator: before finishing an entry.
pub const FINISH_BEFORE: &str = "finish.before";
/// Coordinator: after finishing an entry.
pub const FINISH_AFTER: &str = "finish.after";
/// Coordinator: before deleting the ActiveTransaction document.
pub const END_BEFORE: &str = "end.before";
/// Coordinator: after deleting the ActiveTransaction document.
pub const END_AFTER: &str = "end.after";
/// Coordinator, after an apply failed: before aborting its own transaction.
pub const ABORT_BEFORE: &str = "abort.before";
/// Coordinator: after aborting its own transaction.
pub const ABORT_AFTER: &str = "abort.after";
/// Coordinator's active rollback: before undoing an entry.
pub const ROLLBACK_BEFORE: &str = "rollback.before";
/// Coordinator's active rollback: after undoing an entry.
pub const ROLLBACK_AFTER: &str = "rollback.after";
/// Coordinator's active rollback: before deleting the ActiveTransaction document.
pub const ROLLBACK_END_BEFORE: &str = "rollback.end.before";
/// Coordinator's active rollback: after deleting the ActiveTransaction document.
pub const ROLLBACK_END_AFTER: &str = "rollback.end.after";
/// GC: before deciding an expired staging transaction (the write that commits or aborts it).
pub const GC_CLAIM_BEFORE: &str = "gc.claim.before";
/// GC: after deciding it.
pub const GC_CLAIM_AFTER: &str = "gc.claim.after";
/// GC: before fencing a participant of an expired staging transaction whose apply is missing.
pub const GC_FENCE_BEFORE: &str = "gc.fence.before";
/// GC: after fencing it.
pub const GC_FENCE_AFTER: &str = "gc.fence.after";
/// GC: before finishing an entry of a committed transaction.
pub const GC_FINISH_BEFORE: &str = "gc.finish.before";
/// GC: after finishing an entry.
pub const GC_FINISH_AFTER: &str = "gc.finish.after";
/// GC: before rolling back an entry of an aborted transaction.
pub const GC_ROLLBACK_BEFORE: &str = "gc.rollback.before";
/// GC: after rolling back an entry.
pub const GC_ROLLBACK_AFTER: &str = "gc.rollback.after";
/// GC: before deleting the ActiveTransaction document.
pub const GC_END_BEFORE: &str = "gc.end.before";
/// GC: after deleting it.
pub const GC_END_AFTER: &str = "gc.end.after";
/// GC: before resolving a held document in the sweep.
pub const GC_SWEEP_BEFORE: &str = "gc.sweep.before";
/// GC: after resolving a held document in the sweep.
pub const GC_SWEEP_AFTER: &str = "gc.sweep.after";

/// Quota: after a reservation was written, before it is returned (the reserving process "dies"
/// holding quota that only expiry and the GC give back).
pub const QUOTA_RESERVE_AFTER: &str = "quota.reserve.after";
/// Quota: after a consume was written, before it is returned.
pub const QUOTA_CONSUME_AFTER: &str = "quota.consume.after";

/// Every failpoint name of the transaction layer (the quota's are in `quota::failpoint`).
#[cfg(feature = "testkit")]
pub const ALL: &[&str] = &[
    BEGIN_BEFORE,
    BEGIN_AFTER,
    APPLY_BEFORE,
    APPLY_AFTER,
    COMMIT_BEFORE,
    COMMIT_AFTER,
    FINISH_BEFORE,
    FINISH_AFTER,
    END_BEFORE,
    END_AFTER,
    ABORT_BEFORE,
    ABORT_AFTER,
    ROLLBACK_BEFORE,
    ROLLBACK_AFTER,
    ROLLBACK_END_BEFORE,
    ROLLBACK_END_AFTER,
    GC_CLAIM_BEFORE,
    GC_CLAIM_AFTER,
    GC_FENCE_BEFORE,
    GC_FENCE_AFTER,
    GC_FINISH_BEFORE,
    GC_FINISH_AFTER,
    GC_ROLLBACK_BEFORE,
    GC_ROLLBACK_AFTER,
    GC_END_BEFORE,
    GC_END_AFTER,
    GC_SWEEP_BEFORE,
    GC_SWEEP_AFTER,
];

/// What a handle's options carry towards its [`Faults`]: the injector a test installed, if any.
/// Nothing without the `testkit` feature, where no injector can be installed.
#[cfg(feature = "testkit")]
pub(crate) type Injector = Option<Arc<dyn FaultInjector>>;
/// What a handle's options carry towards its [`Faults`]: nothing in a build without the
/// `testkit` feature, where no injector can be installed.
#[cfg(not(feature = "testkit"))]
pub(crate) type Injector = NoInjector;

/// The [`Injector`] of a build without the `testkit` feature.
#[cfg(not(feature = "testkit"))]
#[derive(Clone, Default, Debug)]
pub(crate) struct NoInjector;

/// Whether a test installed an injector (for the options' `Debug`).
pub(crate) fn installed(injector: &Injector) -> bool {
    #[cfg(feature = "testkit")]
    return injector.is_some();
    #[cfg(not(feature = "testkit"))]
    {
        let NoInjector = injector;
        false
    }
}

/// The fault hooks of a build without the `testkit` feature: none (every point passes).
#[cfg(not(feature = "testkit"))]
#[derive(Clone, Default, Debug)]
pub(crate) struct Faults;

#[cfg(not(feature = "testkit"))]
impl Faults {
    pub(crate) fn new(_: Injector) -> Faults {
        Faults
    }

    /// No injector: for a handle no test stops (the admin inspector's).
    pub(crate) fn none() -> Faults {
        Faults
    }
}

/// An optional injector, cheap to clone and to consult.
///
/// A crash is for good: once the injector has stopped one step, every later failpoint of the same
/// handle stops too, the way nothing runs in a dead process. Writes already sent (the other
/// entries of a round in flight) still land, as they would.
#[cfg(feature = "testkit")]
#[derive(Clone, Default)]
pub(crate) struct Faults(Option<(Arc<dyn FaultInjector>, Dead)>);

/// Where the handle crashed, once it has.
#[cfg(feature = "testkit")]
type Dead = Arc<Mutex<Option<Failpoint>>>;

#[cfg(feature = "testkit")]
impl Faults {
    pub(crate) fn new(injector: Option<Arc<dyn FaultInjector>>) -> Faults {
        Faults(injector.map(|i| (i, Arc::new(Mutex::new(None)))))
    }

    /// No injector: for a handle no test stops (the admin inspector's).
    pub(crate) fn none() -> Faults {
        Faults(None)
    }

    /// `Err(point)` when the injector wants a crash here (or already crashed at `point`).
    pub(crate) fn check(&self, name: &'static str, step: usize) -> Result<(), Failpoint> {
        let Some((injector, dead)) = &self.0 else {
            return Ok(());
        };
        let mut dead = dead.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(at) = *dead {
            return Err(at);
        }
        let point = Failpoint { name, step };
        if injector.crash_at(point) {
            tracing::warn!(failpoint = %point, "injected crash");
            *dead = Some(point);
            return Err(point);
        }
        Ok(())
    }
}

#[cfg(feature = "testkit")]
impl fmt::Debug for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Faults(installed)"
        } else {
            "Faults(none)"
        })
    }
}
