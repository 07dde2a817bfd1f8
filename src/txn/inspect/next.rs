//! What happens next to a transaction, and when: the rules the resolvers follow (readers and
//! writers in `repo::hold::resolve`, the decision in `repo::hold::staging`, the GC's record pass
//! in `txn::expired` and its sweep in `txn::gc`), restated from the record and the documents as
//! they stand, so that an explanation says what the code will do. No I/O.
//!
//! The rules, by the record:
//!
//! - **committed**, or **staging with every participant carrying its change** (an implicit
//!   commit, which anyone who meets it writes down): readers see the new values; the GC's sweep
//!   frees such a transaction's documents at its next round whatever the deadline (a writer
//!   that meets one frees it too), and its record pass ends the transaction (finishes, deletes
//!   the record) once the deadline has passed;
//! - **staging with a participant lacking its change**: nobody but the coordinator acts before
//!   the deadline (readers see the old values, writers wait and fail `Locked`); after it, the
//!   first GC round or writer fences the missing participant (or finds it held by another
//!   transaction: shut out) and aborts, then rolls back; one that finds every change in place by
//!   then commits instead;
//! - **aborted**: the GC's sweep undoes the holds at its next round; the record stays until the
//!   deadline (no late copy of it may arrive as staging), and the first round after deletes it;
//! - **no record**: not committed; the GC's sweep writes an aborted record in the missing one's
//!   place and undoes the holds at its next round, without waiting for the deadline; a writer
//!   waits 250 ms of its own time first (`resolve::ABSENT_GRACE`).
//!
//! A runner's claim on an expired record keeps every other runner off the record and its holds
//! until it runs out (`txn::claims`), so it is part of the answer.

use bson::DateTime;
use serde::Serialize;

use crate::repo::error::show_id;
use crate::repo::hold::record::TxnState;
use crate::repo::hold::resolve::ABSENT_GRACE;
use crate::server::clock::{relative, span};
use crate::txn::inspect::model::{DocState, DocumentState, RecordInfo};

/// What happens next to a transaction, and when.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Next {
    /// What will be done to it.
    pub action: Action,
    /// Whose values readers get meanwhile.
    pub readers_see: Readers,
    /// From when the GC settles the whole transaction (server time): its deadline, or `None`
    /// when its next round may (a claim aside).
    #[serde(serialize_with = "crate::txn::inspect::model::ser::opt_time")]
    pub gc_from: Option<DateTime>,
    /// The whole answer in a few sentences, times included.
    pub says: String,
}

/// What will be done to a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Action {
    /// It committed: its documents are freed with the new values and its record deleted.
    Finish,
    /// It is undecided and within its deadline: its coordinator may still complete it; after the
    /// deadline it is rolled back unless every participant carries its change by then.
    Decide,
    /// It did not commit (aborted, or expired undecided): its changes are undone.
    RollBack,
    /// Holds without a record: not committed; they are undone.
    UndoOrphan,
}

/// Whose values readers get.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Readers {
    /// The transaction's: it committed.
    NewValues,
    /// Those from before the transaction: it has not committed (yet, or ever).
    OldValues,
}

/// What happens next to the transaction whose record is `record` (`None`: it has none) and
/// whose documents stand as `docs` (the worklist's, or the holds found without a record), at
/// server time `now`.
pub(crate) fn next(now: DateTime, record: Option<&RecordInfo>, docs: &[DocumentState]) -> Next {
    let Some(record) = record else {
        let grace = span(ABSENT_GRACE);
        return Next {
            action: Action::UndoOrphan,
            readers_see: Readers::OldValues,
            gc_from: None,
            says: format!(
                "no record: not committed, readers see the old values. The next GC round writes an \
                 aborted record in the missing one's place (so that none can still arrive as \
                 staging) and undoes the holds; a writer that meets one does the same after \
                 waiting up to {grace} for a record still on its way."
            ),
        };
    };
    let deadline = relative(record.deadline, now);
    let claim = record.claim.as_ref().map_or(String::new(), |c| {
        format!(
            " Claimed by GC runner {} until {}: other runners leave it, and its holds, to that one \
             until then.",
            c.runner,
            relative(c.until, now)
        )
    });
    let overdue = record.overdue.map(span);
    let missing = docs.iter().find(|d| !d.state.is_applied());
    let (action, readers_see, says) = match (record.state, missing) {
        (TxnState::Committed, _) | (TxnState::Staging, None) => {
            let how = if record.state == TxnState::Committed {
                "committed".to_string()
            } else {
                "committed: every participant carries its change, so it is committed though its \
                 record still says staging (its coordinator, a writer or the GC writes that down)"
                    .to_string()
            };
            let then = match &overdue {
                None => format!(
                    "Its coordinator frees the documents and deletes the record; whatever it \
                     leaves, the next GC round frees (as does a writer that meets a document), \
                     and the first GC round after the deadline, {deadline}, ends the \
                     transaction."
                ),
                Some(ago) => format!(
                    "Its deadline passed {ago} ago: the next GC round finishes it (frees every \
                     document, deletes the record).{claim}"
                ),
            };
            (
                Action::Finish,
                Readers::NewValues,
                format!("{how}; readers see the new values. {then}"),
            )
        }
        (TxnState::Staging, Some(missing)) => {
            let which = lacking(missing);
            let says = match &overdue {
                None => format!(
                    "staging, live until {deadline}: readers see the old values, and writers \
                     wait for it, then fail Locked. {which}. If its coordinator has not \
                     completed it by then, the first GC round (or writer) after the deadline \
                     rolls it back, {} (it commits it instead if every participant carries its \
                     change by then).",
                    stop(&missing.state)
                ),
                Some(ago) => format!(
                    "staging, expired {ago} ago without every participant's change: readers see \
                     the old values. {which}. The next GC round (or a writer that meets it) \
                     rolls it back, {}.{claim}",
                    stop(&missing.state)
                ),
            };
            let action = if overdue.is_some() {
                Action::RollBack
            } else {
                Action::Decide
            };
            (action, Readers::OldValues, says)
        }
        (TxnState::Aborted, _) => {
            let says = match &overdue {
                None => format!(
                    "aborted: readers see the old values. Its coordinator undoes its changes; \
                     whatever it leaves, the next GC round undoes (as does a writer that meets a \
                     document). The record stays until its deadline, {deadline}, so that no late \
                     copy of it can arrive as staging; the first GC round after that deletes it."
                ),
                Some(ago) => format!(
                    "aborted, its deadline passed {ago} ago: readers see the old values; the next \
                     GC round undoes what is left and deletes the record.{claim}"
                ),
            };
            (Action::RollBack, Readers::OldValues, says)
        }
    };
    Next {
        action,
        readers_see,
        gc_from: record.overdue.is_none().then_some(record.deadline),
        says,
    }
}

/// Which participant keeps a staging transaction from having committed, and why.
fn lacking(doc: &DocumentState) -> String {
    let name = format!("{}/{}", doc.collection, show_id(&doc.id));
    match doc.state {
        DocState::HeldByOther { txn } => {
            format!("{name} lacks its change: transaction {txn} holds it")
        }
        DocState::Fenced => format!("{name} is fenced: its change can no longer land"),
        DocState::CreatedLate => {
            format!("{name} was created after the deadline: its creation never counts")
        }
        _ => format!("{name} lacks its change"),
    }
}

/// How a resolver stops a staging transaction from committing, given its first participant
/// lacking its change.
fn stop(doc: &DocState) -> &'static str {
    match doc {
        DocState::HeldByOther { .. } => {
            "since the change cannot land on a document another transaction holds past the deadline"
        }
        DocState::Fenced | DocState::CreatedLate => "since it can no longer commit",
        _ => "fencing that document first so that its change can no longer land",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::server::clock::plus;
    use crate::txn::inspect::model::GcClaim;
    use bson::{oid::ObjectId, Bson};

    fn record(state: TxnState, now: DateTime, deadline_in: i64) -> RecordInfo {
        let deadline = DateTime::from_millis(now.timestamp_millis() + deadline_in);
        RecordInfo {
            state,
            created: DateTime::from_millis(now.timestamp_millis() - 1_000),
            deadline,
            left: (deadline_in > 0).then(|| Duration::from_millis(deadline_in as u64)),
            overdue: (deadline_in <= 0).then(|| Duration::from_millis((-deadline_in) as u64)),
            claim: None,
        }
    }

    fn doc(id: &str, state: DocState) -> DocumentState {
        DocumentState {
            collection: "accounts".into(),
            id: Bson::from(id),
            op: "adjust",
            expected: Some(1),
            applied: Some(2),
            state,
        }
    }

    #[test]
    fn each_state_gets_what_the_resolvers_do() {
        let now = DateTime::from_millis(1_795_000_000_000);
        let held = doc("a", DocState::Held { version: 2 });
        let open = doc("b", DocState::AsRead { version: 1 });
        let complete = [held.clone(), held.clone()];
        let incomplete = [held.clone(), open.clone()];

        let n = next(
            now,
            Some(&record(TxnState::Committed, now, 5_000)),
            &complete,
        );
        assert_eq!(
            (n.action, n.readers_see),
            (Action::Finish, Readers::NewValues)
        );
        assert_eq!(n.gc_from, Some(plus(now, Duration::from_secs(5))));
        assert!(n.says.contains("(in 5.0s)"), "{}", n.says);

        let n = next(now, Some(&record(TxnState::Staging, now, 5_000)), &complete);
        assert_eq!(n.action, Action::Finish);
        assert!(n.says.contains("still says staging"), "{}", n.says);

        let n = next(
            now,
            Some(&record(TxnState::Staging, now, 5_000)),
            &incomplete,
        );
        assert_eq!(
            (n.action, n.readers_see),
            (Action::Decide, Readers::OldValues)
        );
        assert!(
            n.says.contains("accounts/\"b\" lacks its change"),
            "{}",
            n.says
        );
        assert!(n.says.contains("fencing that document"), "{}", n.says);

        let mut expired = record(TxnState::Staging, now, -12_000);
        expired.claim = Some(GcClaim {
            runner: ObjectId::new(),
            until: plus(now, Duration::from_secs(30)),
            left: Duration::from_secs(30),
        });
        let n = next(now, Some(&expired), &incomplete);
        assert_eq!((n.action, n.gc_from), (Action::RollBack, None));
        assert!(n.says.contains("expired 12s ago"), "{}", n.says);
        assert!(n.says.contains("Claimed by GC runner"), "{}", n.says);

        let shut = [
            held.clone(),
            doc(
                "b",
                DocState::HeldByOther {
                    txn: ObjectId::new(),
                },
            ),
        ];
        let n = next(now, Some(&expired), &shut);
        assert!(n.says.contains("another transaction holds"), "{}", n.says);

        let n = next(
            now,
            Some(&record(TxnState::Aborted, now, 5_000)),
            &incomplete,
        );
        assert_eq!(n.action, Action::RollBack);
        assert!(
            n.says.contains("The record stays until its deadline"),
            "{}",
            n.says
        );

        let n = next(now, None, &[held]);
        assert_eq!((n.action, n.gc_from), (Action::UndoOrphan, None));
        assert!(n.says.contains("250ms"), "{}", n.says);
    }
}
