//! An exhaustive model of the commit protocol (the parallel commit of `committer`, the decisions
//! and fences of `repo::hold::staging`, the GC's and writers' resolutions of `repo::hold::resolve`), explored
//! state by state with [`crate::testkit::explore`].
//!
//! (Compiled for unit tests only. Over 700 lines on purpose: the model's state, its actions and
//! the invariants checked in every state are one specification, read together.)
//!
//! Two transactions, three documents: T0 changes d0 and d1; T1 changes d1 and creates d2. Both read
//! d1 at the same version, so at most one of them can commit. Each coordinator sends its record
//! and its applies at once; the network delivers every send at any later time, or never, and a
//! reply can be lost (the coordinator then reads the document, or resends the record, and a copy
//! may still arrive after that). Either coordinator can crash at any step. Each transaction's
//! deadline passes on the server's clock at any moment. A resolver (the GC, or a reader or writer
//! that meets a hold) acts at any moment, on any transaction, with no clock of its own: it may
//! fence whenever it likes, and only its aborts and its deletions of aborted records wait for the
//! server's clock.
//!
//! Checked in every reachable state:
//! - **all-or-nothing**: what readers see (a held document's pre-image unless its holder is
//!   committed, explicitly or by every participant being in place) carries a transaction's change
//!   on all of its documents or on none;
//! - **no committed write lost**: once committed, always committed, on every document;
//! - **answers are true**: a coordinator that returned committed is committed, one that returned a
//!   failure never commits; the two conflicting transactions never both commit;
//! - **no orphaned hold**: in a state where nobody can do anything more, no document is held and
//!   no record is left.

use crate::testkit::explore::Model;

/// Transactions in the model.
const TXNS: usize = 2;
/// Documents in the model.
const DOCS: usize = 3;
/// Participants per transaction.
const PARTS: usize = 2;

/// One participant of a transaction.
#[derive(Debug, Clone, Copy)]
struct Part {
    doc: usize,
    /// Created by the transaction (not there before); else changed at `expected`.
    create: bool,
    expected: u8,
}

/// T0 changes d0 and creates d2; T1 changes d0 and d1. Both read d0 at the same version, so at
/// most one of them can commit.
const PLAN: [&[Part]; TXNS] = [
    &[
        Part {
            doc: 0,
            create: false,
            expected: 0,
        },
        Part {
            doc: 2,
            create: true,
            expected: 0,
        },
    ],
    &[Part {
        doc: 0,
        create: false,
        expected: 0,
    }],
];

/// How many participants transaction `t` has.
fn parts(t: usize) -> usize {
    PLAN[t].len()
}

/// A document's stored fields, as far as the protocol cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Stored {
    exists: bool,
    version: u8,
    /// The transactions whose change is in the stored fields (a bit each).
    changes: u8,
}

/// A hold: the holder, whether it is a fence, and the undo (the fields before). `late`: a
/// created document whose stamp says the server made it after the deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Hold {
    txn: u8,
    fence: bool,
    late: bool,
    prev: Stored,
}

/// A stored document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Doc {
    now: Stored,
    hold: Option<Hold>,
}

/// A record's state (`Absent`: no record).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Rec {
    Absent,
    Staging,
    Committed,
    Aborted,
}

/// A write in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Msg {
    /// The record's upsert.
    Record(u8),
    /// Participant `.1`'s apply.
    Apply(u8, u8),
}

/// What a coordinator knows of one of its sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Reply {
    Waiting,
    /// No answer came (it may still run later).
    Lost,
    /// The record came back staging, or the apply took effect in time.
    Good,
    /// The record came back committed (a resolver found every participant in place).
    Committed,
    /// The record came back decided, or the apply was refused or ran too late.
    Bad,
    /// Read back after a lost reply: not there (yet; a copy may still arrive).
    Unknown,
}

/// Where a coordinator is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Phase {
    Idle,
    Round,
    CommitPoint,
    Finish(u8),
    End,
    Abort,
    Rollback(u8),
    EndAborted,
    Done,
    Dead,
}

/// A coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Coord {
    phase: Phase,
    record: Reply,
    resent: bool,
    /// Some send of the record went unanswered.
    record_lost: bool,
    applies: [Reply; PARTS],
}

/// The resolver's place in a multi-step resolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Res {
    Idle,
    /// Checking participant `i` of a staging transaction.
    Check {
        txn: u8,
        i: u8,
    },
    /// Deciding after the check: `fenced` when a participant was fenced.
    Decide {
        txn: u8,
        fenced: bool,
    },
}

/// The whole system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct State {
    docs: [Doc; DOCS],
    recs: [Rec; TXNS],
    /// Whether the server's clock has passed each transaction's deadline.
    past: [bool; TXNS],
    net: Vec<Msg>,
    coords: [Coord; TXNS],
    res: Res,
    /// Ghost: what each coordinator returned (`Some(true)`: committed).
    returned: [Option<bool>; TXNS],
    /// Ghost: whether each transaction has ever been committed.
    ever: [bool; TXNS],
    /// Ghost: a coordinator returned committed while it was not.
    false_commit: bool,
    /// The mutation of [`CommitModel::late_counts`], the same in every state.
    late_counts: bool,
}

/// The model; `fences` off is the protocol without fences (a resolver aborts a staging
/// transaction with a missing participant outright), which must be caught.
pub(crate) struct CommitModel {
    pub(crate) fences: bool,
    /// Which coordinators can lose replies (and so resend, and leave copies in flight). Both is
    /// far beyond what a test can explore; each one in turn covers every interleaving of one
    /// lossy coordinator with a crashing, conflicting other one.
    pub(crate) lossy: [bool; TXNS],
    /// The code before issue 46 (a mutation, which must be caught): readers, writers, the GC and
    /// the coordinator's own abort path counted a creation stamped after the deadline as in
    /// place; only the coordinator's reading of its create's reply looked at the stamp. The real
    /// protocol (`false`) has every party judge a creation by the stamp alone
    /// (`Hold::created_late`).
    pub(crate) late_counts: bool,
}

fn bit(t: usize) -> u8 {
    1 << t
}

impl State {
    fn part_doc(&self, t: usize, p: usize) -> &Doc {
        &self.docs[PLAN[t][p].doc]
    }

    /// Held by `t`'s own apply, made in time: what the coordinator makes of its create's reply
    /// (or of reading the document back), by the server's stamp.
    fn applied_by(&self, t: usize, p: usize) -> bool {
        matches!(self.part_doc(t, p).hold, Some(h) if h.txn as usize == t && !h.fence && !h.late)
    }

    /// Whether `h`, a hold of the transaction looking, counts as its apply in place for readers,
    /// writers, the GC and a coordinator deciding its own abort: by the stamp, as the coordinator
    /// judges its reply, unless the mutation [`CommitModel::late_counts`] is on.
    fn counts(&self, h: Hold) -> bool {
        !h.fence && (!h.late || self.late_counts)
    }

    /// Held by `t`'s own apply, as everyone but the coordinator reading its reply judges it.
    fn in_place(&self, t: usize, p: usize) -> bool {
        matches!(self.part_doc(t, p).hold, Some(h) if h.txn as usize == t && self.counts(h))
    }

    /// Committed: explicitly, or staging with every participant in place.
    fn committed(&self, t: usize) -> bool {
        match self.recs[t] {
            Rec::Committed => true,
            Rec::Staging => (0..parts(t)).all(|p| self.in_place(t, p)),
            _ => false,
        }
    }

    /// What readers see of document `d`.
    fn view(&self, d: usize) -> Stored {
        let doc = &self.docs[d];
        match doc.hold {
            Some(h) if h.fence => doc.now,
            Some(h) if !self.counts(h) || !self.committed(h.txn as usize) => h.prev,
            _ => doc.now,
        }
    }

    fn visible(&self, t: usize) -> usize {
        (0..parts(t))
            .filter(|&p| {
                let v = self.view(PLAN[t][p].doc);
                v.exists && v.changes & bit(t) != 0
            })
            .count()
    }

    /// Undoes whatever hold of `t` is on document `d` (its apply or its fence).
    fn undo(&mut self, t: usize, d: usize) {
        if let Some(h) = self.docs[d].hold {
            if h.txn as usize == t {
                if !h.fence {
                    self.docs[d].now = h.prev;
                }
                self.docs[d].hold = None;
            }
        }
    }

    /// Frees document `d` of `t`'s hold, keeping its change (a fence simply goes).
    fn finish(&mut self, t: usize, d: usize) {
        if matches!(self.docs[d].hold, Some(h) if h.txn as usize == t) {
            self.docs[d].hold = None;
        }
    }

    /// Runs `msg` on the server.
    fn deliver(&mut self, msg: Msg) -> Reply {
        match msg {
            Msg::Record(t) => {
                let t = t as usize;
                if self.recs[t] == Rec::Absent {
                    self.recs[t] = if self.past[t] {
                        Rec::Aborted
                    } else {
                        Rec::Staging
                    };
                }
                match self.recs[t] {
                    Rec::Staging => Reply::Good,
                    Rec::Committed => Reply::Committed,
                    _ => Reply::Bad,
                }
            }
            Msg::Apply(t, p) => {
                let (t, p) = (t as usize, p as usize);
                let part = PLAN[t][p];
                let doc = self.docs[part.doc];
                let hold = Some(Hold {
                    txn: t as u8,
                    fence: false,
                    late: part.create && self.past[t],
                    prev: doc.now,
                });
                if part.create {
                    // Not guarded by the clock: it lands, stamped with the server's time.
                    if doc.now.exists || doc.hold.is_some() {
                        return Reply::Bad;
                    }
                    self.docs[part.doc] = Doc {
                        now: Stored {
                            exists: true,
                            version: 1,
                            changes: bit(t),
                        },
                        hold,
                    };
                    if self.past[t] {
                        Reply::Bad
                    } else {
                        Reply::Good
                    }
                } else {
                    let free = doc.now.exists && doc.hold.is_none();
                    if self.past[t] || !free || doc.now.version != part.expected {
                        return Reply::Bad;
                    }
                    self.docs[part.doc] = Doc {
                        now: Stored {
                            exists: true,
                            version: doc.now.version + 1,
                            changes: doc.now.changes | bit(t),
                        },
                        hold,
                    };
                    Reply::Good
                }
            }
        }
    }

    /// Updates the ghosts after a step.
    fn observe(mut self) -> State {
        for t in 0..TXNS {
            if self.committed(t) {
                self.ever[t] = true;
            }
        }
        self
    }
}

impl CommitModel {
    fn coordinator_steps(&self, s: &State, t: usize, out: &mut Vec<State>) {
        let c = s.coords[t];
        if matches!(c.phase, Phase::Done | Phase::Dead) {
            return;
        }
        // A crash, at any step.
        let mut dead = s.clone();
        dead.coords[t].phase = Phase::Dead;
        out.push(dead);
        let mut n = s.clone();
        match c.phase {
            Phase::Idle => {
                n.net.push(Msg::Record(t as u8));
                for p in 0..parts(t) {
                    n.net.push(Msg::Apply(t as u8, p as u8));
                }
                let mut applies = [Reply::Good; PARTS];
                applies[..parts(t)].fill(Reply::Waiting);
                n.coords[t] = Coord {
                    phase: Phase::Round,
                    record: Reply::Waiting,
                    resent: false,
                    record_lost: false,
                    applies,
                };
                out.push(n);
            }
            Phase::Round => {
                // A reply that does not come: the send may still run later.
                if c.record == Reply::Waiting && self.lossy[t] {
                    let mut lost = s.clone();
                    lost.coords[t].record = Reply::Lost;
                    lost.coords[t].record_lost = true;
                    out.push(lost);
                }
                for p in 0..parts(t) {
                    if c.applies[p] == Reply::Waiting && self.lossy[t] {
                        let mut lost = s.clone();
                        lost.coords[t].applies[p] = Reply::Lost;
                        out.push(lost);
                    }
                }
                if c.record == Reply::Waiting || c.applies.contains(&Reply::Waiting) {
                    return;
                }
                if c.record == Reply::Lost && !c.resent {
                    n.net.push(Msg::Record(t as u8));
                    n.coords[t].record = Reply::Waiting;
                    n.coords[t].resent = true;
                    out.push(n);
                    return;
                }
                if let Some(p) = c.applies.iter().position(|r| *r == Reply::Lost) {
                    // Reads the document: its own apply there, in time, means it landed.
                    let landed = s.applied_by(t, p);
                    n.coords[t].applies[p] = if landed { Reply::Good } else { Reply::Unknown };
                    out.push(n);
                    return;
                }
                if c.record == Reply::Committed
                    || (c.record == Reply::Good && c.applies.iter().all(|r| *r == Reply::Good))
                {
                    n.returned[t] = Some(true);
                    if !s.ever[t] && !s.committed(t) {
                        n.false_commit = true;
                    }
                    n.coords[t].phase = Phase::CommitPoint;
                } else {
                    n.coords[t].phase = Phase::Abort;
                }
                out.push(n);
            }
            Phase::CommitPoint => {
                if n.recs[t] == Rec::Staging {
                    n.recs[t] = Rec::Committed;
                }
                n.coords[t].phase = Phase::Finish(0);
                out.push(n);
            }
            Phase::Finish(i) => {
                let i = i as usize;
                if i < parts(t) {
                    if s.applied_by(t, i) {
                        n.finish(t, PLAN[t][i].doc);
                    }
                    n.coords[t].phase = Phase::Finish(i as u8 + 1);
                } else {
                    n.coords[t].phase = Phase::End;
                }
                out.push(n);
            }
            Phase::End => {
                n.recs[t] = Rec::Absent;
                n.coords[t].phase = Phase::Done;
                out.push(n);
            }
            Phase::Abort => {
                // A refusal it was told of (or a record that came back decided) means the
                // transaction can never be in place; otherwise a missing participant is fenced
                // first, as any resolver would.
                // An aborted record is only an answer if no copy of the record can have been
                // sent after the transaction ended (which may create it anew).
                let refused =
                    (c.record == Reply::Bad && !c.record_lost) || c.applies.contains(&Reply::Bad);
                if !refused && c.record_lost && s.recs[t] != Rec::Committed {
                    // It may have committed and ended before a later copy of its record arrived:
                    // the outcome is unknown, and so reported.
                    n.coords[t].phase = Phase::Done;
                    out.push(n);
                    return;
                }
                match s.recs[t] {
                    Rec::Committed => {
                        // A resolver saw every participant in place: committed after all.
                        n.returned[t] = Some(true);
                        n.coords[t].phase = Phase::Finish(0);
                    }
                    Rec::Aborted => n.coords[t].phase = Phase::Rollback(0),
                    Rec::Absent if refused => {
                        // It can never have committed: an aborted record takes the missing
                        // one's place.
                        n.recs[t] = Rec::Aborted;
                        n.coords[t].phase = Phase::Rollback(0);
                    }
                    Rec::Absent => {
                        // Its record may have been staging, committed by a resolver, finished and
                        // deleted: the outcome is unknown, and so reported.
                        n.coords[t].phase = Phase::Done;
                    }
                    Rec::Staging if refused => {
                        n.recs[t] = Rec::Aborted;
                        n.coords[t].phase = Phase::Rollback(0);
                    }
                    Rec::Staging => {
                        let missing = (0..parts(t)).find(|&p| !s.in_place(t, p));
                        match missing {
                            None => {
                                // Every participant is in place: it committed.
                                n.returned[t] = Some(true);
                                n.coords[t].phase = Phase::CommitPoint;
                            }
                            Some(p) => {
                                let d = PLAN[t][p].doc;
                                match s.docs[d].hold {
                                    Some(h) if h.txn as usize == t => {}
                                    // Held by another after the deadline: shut out for good.
                                    Some(_) if s.past[t] => {}
                                    Some(_) => return, // held by another: wait
                                    None => {
                                        n.docs[d].hold = Some(Hold {
                                            txn: t as u8,
                                            fence: true,
                                            late: false,
                                            prev: s.docs[d].now,
                                        })
                                    }
                                }
                                n.recs[t] = Rec::Aborted;
                                n.coords[t].phase = Phase::Rollback(0);
                            }
                        }
                    }
                }
                out.push(n);
            }
            Phase::Rollback(i) => {
                let i = i as usize;
                if i < parts(t) {
                    n.undo(t, PLAN[t][i].doc);
                    n.coords[t].phase = Phase::Rollback(i as u8 + 1);
                } else {
                    n.coords[t].phase = Phase::EndAborted;
                }
                out.push(n);
            }
            Phase::EndAborted => {
                // Deleted at once when no copy of the record can still arrive; else only once
                // the server's clock has passed the deadline.
                if !c.record_lost || s.past[t] {
                    n.recs[t] = Rec::Absent;
                }
                n.returned[t] = Some(false);
                n.coords[t].phase = Phase::Done;
                out.push(n);
            }
            Phase::Done | Phase::Dead => {}
        }
    }

    fn resolver_steps(&self, s: &State, out: &mut Vec<State>) {
        match s.res {
            Res::Idle => {
                for t in 0..TXNS {
                    let mut n = s.clone();
                    let held = (0..parts(t))
                        .any(|p| matches!(s.part_doc(t, p).hold, Some(h) if h.txn as usize == t));
                    match s.recs[t] {
                        Rec::Staging => n.res = Res::Check { txn: t as u8, i: 0 },
                        // The record goes once every document is freed (the GC finishes them
                        // one by one below, then deletes it) ...
                        Rec::Committed if !held => n.recs[t] = Rec::Absent,
                        // ... or, aborted, once the server's clock has passed the deadline
                        // (holds may remain: without a record they read as not committed).
                        Rec::Aborted if s.past[t] => n.recs[t] = Rec::Absent,
                        _ => continue,
                    }
                    out.push(n);
                }
                // Single-document resolutions, as a writer or a GC sweep makes them.
                for d in 0..DOCS {
                    let Some(h) = s.docs[d].hold else { continue };
                    let t = h.txn as usize;
                    let mut n = s.clone();
                    // A fence, or a creation stamped too late, never carries a committed change:
                    // it is undone whatever the record says.
                    match (s.recs[t], !s.counts(h)) {
                        (Rec::Staging, _) => continue,
                        // A hold without a record: an aborted record takes the missing one's place.
                        (Rec::Absent, false) => n.recs[t] = Rec::Aborted,
                        (Rec::Committed, false) => n.finish(t, d),
                        (Rec::Aborted, false) | (_, true) => n.undo(t, d),
                    }
                    out.push(n);
                }
            }
            Res::Check { txn, i } => {
                let t = txn as usize;
                let mut n = s.clone();
                if s.recs[t] != Rec::Staging {
                    n.res = Res::Idle;
                    out.push(n);
                    return;
                }
                if i as usize == parts(t) {
                    n.res = Res::Decide { txn, fenced: false };
                    out.push(n);
                    return;
                }
                let part = PLAN[t][i as usize];
                let doc = s.docs[part.doc];
                match doc.hold {
                    Some(h) if h.txn == txn && s.counts(h) => n.res = Res::Check { txn, i: i + 1 },
                    // Its fence, or a creation stamped too late: it can never be in place.
                    Some(h) if h.txn == txn => n.res = Res::Decide { txn, fenced: true },
                    // Held by another once the deadline has passed: its apply never landed and
                    // never can (changes are refused after it, creations then count for nothing).
                    Some(_) if s.past[t] => n.res = Res::Decide { txn, fenced: true },
                    Some(_) => n.res = Res::Idle,
                    None => {
                        // Not in place: leave it for now, or (any time: no clock needed) fence it.
                        let mut later = s.clone();
                        later.res = Res::Idle;
                        out.push(later);
                        if self.fences {
                            n.docs[part.doc].hold = Some(Hold {
                                txn,
                                fence: true,
                                late: false,
                                prev: doc.now,
                            });
                            n.res = Res::Decide { txn, fenced: true };
                        } else {
                            n.res = Res::Decide { txn, fenced: true };
                        }
                    }
                }
                out.push(n);
            }
            Res::Decide { txn, fenced } => {
                let t = txn as usize;
                let mut n = s.clone();
                if s.recs[t] == Rec::Staging {
                    if !fenced {
                        n.recs[t] = Rec::Committed;
                    } else if s.past[t] {
                        // An abort waits for the server's clock.
                        n.recs[t] = Rec::Aborted;
                    }
                }
                n.res = Res::Idle;
                out.push(n);
            }
        }
    }
}

impl Model for CommitModel {
    type State = State;

    fn init(&self) -> Vec<State> {
        let existing = Doc {
            now: Stored {
                exists: true,
                version: 0,
                changes: 0,
            },
            hold: None,
        };
        let absent = Doc {
            now: Stored {
                exists: false,
                version: 0,
                changes: 0,
            },
            hold: None,
        };
        let idle = Coord {
            phase: Phase::Idle,
            record: Reply::Waiting,
            resent: false,
            record_lost: false,
            applies: [Reply::Waiting; PARTS],
        };
        vec![State {
            docs: [existing, existing, absent],
            recs: [Rec::Absent; TXNS],
            past: [false; TXNS],
            net: Vec::new(),
            coords: [idle; TXNS],
            res: Res::Idle,
            returned: [None; TXNS],
            ever: [false; TXNS],
            false_commit: false,
            late_counts: self.late_counts,
        }]
    }

    fn next(&self, s: &State) -> Vec<State> {
        let mut out = Vec::new();
        for t in 0..TXNS {
            if !s.past[t] {
                let mut n = s.clone();
                n.past[t] = true;
                out.push(n);
            }
        }
        for (i, msg) in s.net.iter().enumerate() {
            if s.net[..i].contains(msg) {
                continue;
            }
            // Delivered, its reply reaching a coordinator still waiting for it.
            let mut n = s.clone();
            n.net.remove(i);
            let reply = n.deliver(*msg);
            let (t, slot) = match *msg {
                Msg::Record(t) => (t as usize, None),
                Msg::Apply(t, p) => (t as usize, Some(p as usize)),
            };
            let waiting = &mut n.coords[t];
            if waiting.phase == Phase::Round {
                match slot {
                    None if waiting.record == Reply::Waiting => waiting.record = reply,
                    Some(p) if waiting.applies[p] == Reply::Waiting => waiting.applies[p] = reply,
                    _ => {}
                }
            }
            // (One never delivered is one still in flight: every state before its delivery is
            // explored, and its sender saw its reply lost.)
            out.push(n);
        }
        for t in 0..TXNS {
            self.coordinator_steps(s, t, &mut out);
        }
        self.resolver_steps(s, &mut out);
        out.into_iter()
            .map(|mut n| {
                n.net.sort();
                n.observe()
            })
            .collect()
    }

    fn check(&self, s: &State) -> Result<(), String> {
        if s.false_commit {
            return Err("a coordinator returned committed for an uncommitted transaction".into());
        }
        for t in 0..TXNS {
            let visible = s.visible(t);
            if visible != 0 && visible != parts(t) {
                return Err(format!(
                    "T{t} is visible on {visible} of its {} documents",
                    parts(t)
                ));
            }
            if s.ever[t] && visible != parts(t) {
                return Err(format!("T{t} committed, but its change was lost"));
            }
            if !s.ever[t] && visible != 0 {
                return Err(format!("T{t} is visible without having committed"));
            }
            if s.returned[t] == Some(false) && s.ever[t] {
                return Err(format!("T{t} returned a failure but committed"));
            }
        }
        if s.ever.iter().all(|e| *e) {
            return Err("both conflicting transactions committed".into());
        }
        if self.next(s).is_empty() {
            if let Some(d) = (0..DOCS).find(|&d| s.docs[d].hold.is_some()) {
                return Err(format!("nobody can act, but d{d} is still held"));
            }
            if s.recs.iter().any(|r| *r != Rec::Absent) {
                return Err("nobody can act, but a record is left".into());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::explore::explore;

    const LIMIT: usize = 20_000_000;

    fn passes(lossy: [bool; TXNS]) {
        let explored = explore(
            &CommitModel {
                fences: true,
                lossy,
                late_counts: false,
            },
            LIMIT,
        );
        println!(
            "commit protocol model (lost replies and resends for {lossy:?}): {} states explored \
             (2 transactions, 3 documents, a resolver, crashes at every step, late and duplicated \
             writes)",
            explored.states
        );
        assert!(
            !explored.truncated,
            "the state space is larger than {LIMIT}"
        );
        if let Some((why, path)) = explored.violation {
            let steps: Vec<String> = path.iter().map(|s| format!("{s:?}")).collect();
            panic!("{why}; path:\n{}", steps.join("\n"));
        }
        assert!(explored.states > 10_000, "{}", explored.states);
    }

    // Millions of states: `.ci/run` runs these with the crate optimised (`cargo test --config
    // 'profile.test.package.mongotx.opt-level=3' --lib testkit::commit_model -- --ignored`), under two
    // minutes.
    #[test]
    #[ignore = "exhaustive; run optimised by .ci/run"]
    fn the_parallel_commit_is_all_or_nothing_and_leaves_nothing_behind_in_every_state() {
        passes([true, false]);
        passes([false, true]);
    }

    #[test]
    #[ignore = "exhaustive; run optimised by .ci/run"]
    fn a_resolver_that_aborts_without_fencing_is_caught() {
        let explored = explore(
            &CommitModel {
                fences: false,
                lossy: [true, false],
                late_counts: false,
            },
            LIMIT,
        );
        let Some((why, path)) = explored.violation else {
            panic!(
                "the unfenced abort was not caught in {} states",
                explored.states
            );
        };
        println!(
            "unfenced abort caught after {} states, {} steps: {why}",
            explored.states,
            path.len()
        );
    }

    #[test]
    #[ignore = "exhaustive; run optimised by .ci/run"]
    fn counting_a_creation_stamped_too_late_as_in_place_is_caught() {
        let explored = explore(
            &CommitModel {
                fences: true,
                lossy: [false, false],
                late_counts: true,
            },
            LIMIT,
        );
        let Some((why, path)) = explored.violation else {
            panic!(
                "counting late creations was not caught in {} states",
                explored.states
            );
        };
        println!(
            "late creations counted as in place caught after {} states, {} steps: {why}",
            explored.states,
            path.len()
        );
    }
}
