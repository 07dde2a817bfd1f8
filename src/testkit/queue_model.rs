//! An exhaustive model of the batch queue's parallel strategy (`queue::parallel`: the claim, the
//! count, the give-backs, the adder's check), explored state by state with
//! [`crate::testkit::explore`].
//!
//! (Compiled for unit tests only. Over 700 lines on purpose, as the commit protocol's model: the
//! state, the steps and the properties are one specification, read together.)
//!
//! A few batches of one service, each declaring its keys; their adds overlap as badly as they
//! can: every stamp is drawn before any insert, and the inserts land in any order. Each batch
//! gets an adder and up to a few claimants, started at any moment on any batch (the queuer's
//! round is left out: a claimant may try any batch, which is more than a round allows), and may
//! be added again by its header once its adder died or failed. Every
//! write and every count is one step, and any process may crash between steps. A claim runs out
//! at any moment except while its claimant is sending (a submitter sends only before its
//! deadline, which comes before the expiry); a claimant whose claim ran out does not send. A
//! submission is answered accepted, answered delayed (not taken), or not answered (the message
//! reaches the ledger later, or never). The ledger settles a pending batch as committed or
//! invalid, or forgets it. A monitor records what the ledger says about a batch with a
//! submitter or at the ledger, an unknown only once its claim ran out.
//!
//! Checked in every state: of two conflicting batches the ledger took, the one it took first has
//! the older stamp and was final there (committed or invalid) before it took the other; a batch
//! that may have reached the ledger is never stamped again, nor is one whose add returned (adds
//! that do not overlap keep their order); no batch is submitted again after the ledger found it
//! invalid. (A batch the ledger took while an older conflicting batch was not yet inserted, or
//! not yet stamped again by its adder, is in order: the older one goes after it, with a new
//! stamp.)

use crate::testkit::explore::Model;

/// What the database says of a batch (`New`: nothing yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum St {
    New,
    Pending,
    Committed,
    Invalid,
    Unknown,
    Delayed,
}

impl St {
    /// The ledger is done with it.
    fn done(self) -> bool {
        matches!(self, St::Committed | St::Invalid)
    }

    /// The ledger has or had it (with `submitted`, what makes a batch have gone).
    fn at_ledger(self) -> bool {
        matches!(self, St::Pending | St::Committed | St::Invalid)
    }
}

/// What the ledger holds of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Led {
    Fresh,
    Pending,
    Committed,
    Invalid,
    Forgot,
}

/// One stored batch.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Bat {
    stamp: u8,
    inserted: bool,
    submitted: bool,
    status: St,
    /// The claim's token and whether it is live.
    claim: Option<(u8, bool)>,
    /// Marked sent (`sent` in the database): never taken back.
    flag: bool,
    /// A submission of it may have reached the ledger.
    sent: bool,
    /// Its add returned.
    returned: bool,
    /// The ledger took it at least once.
    taken: bool,
}

/// Where a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Step {
    // The adder.
    Insert,
    Check,
    Draw,
    Stamp(u8),
    // A claimant (`Claim` only when it counts first, the mutation).
    Claim,
    Count,
    Flag,
    Send,
    Accepted,
    Delayed,
    GiveBack { reset: bool, restamp: bool },
    ClaimDraw,
    ClaimStamp(u8),
}

/// One process.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Proc {
    batch: u8,
    step: Step,
    token: u8,
    /// The batch's stamp when this process read it.
    seen: u8,
    /// The batch's status when the claim found it.
    prev: St,
    /// Its claim ran out: it no longer sends.
    late: bool,
    /// A mutation's claimant: its count came before its claim, and found nothing in its way.
    counted_clear: bool,
}

/// One state of the whole system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct State {
    batches: Vec<Bat>,
    ledger: Vec<Led>,
    /// Submissions on their way to the ledger.
    wire: Vec<u8>,
    procs: Vec<Proc>,
    newest: u8,
    tokens: u8,
    /// Claimants started so far.
    claims: u8,
    /// Adds of a stored batch by its header started so far.
    readds: u8,
    bad: Option<String>,
}

/// The model: each batch's keys (reads, writes; `None`: declared nothing), how many claimants
/// each batch may have over the whole run, and the mutations.
pub(crate) struct QueueModel {
    pub keys: Vec<Option<(Vec<u8>, Vec<u8>)>>,
    pub claims: u8,
    /// Highest stamp drawn (keeps the space finite: an adder that would draw past it gives up).
    pub max_stamp: u8,
    /// Batches whose add is over before the run starts (inserted, checked, returned): only the
    /// others' adds overlap.
    pub added: Vec<bool>,
    /// Mutation: a claimant counts before it claims.
    pub count_before_claim: bool,
    /// Mutation: the adder does not look for younger batches that went.
    pub adder_skips_check: bool,
    /// Mutation: a batch with a submitter does not count as gone.
    pub submitted_not_went: bool,
    /// Mutation: no `sent` mark (a batch counts as gone only while submitted or at the ledger).
    pub no_sent_mark: bool,
    /// How many times over the run a batch may be added again by its header once its add ended
    /// without returning (it died after the insert, or failed): `Batches::add` finding it
    /// stored.
    pub readds: u8,
    /// Mutation: adding a stored batch again makes the adder's check only when the batch is
    /// new and with no submitter (the rule before 2026-11-28); otherwise the add returns.
    pub readd_only_new: bool,
}

impl QueueModel {
    /// The model with every rule in place.
    pub(crate) fn new(keys: Vec<Option<(Vec<u8>, Vec<u8>)>>) -> QueueModel {
        // Room for three stamps drawn again.
        let max_stamp = u8::try_from(keys.len() + 3).unwrap_or(u8::MAX);
        QueueModel {
            added: vec![false; keys.len()],
            keys,
            claims: 3,
            max_stamp,
            count_before_claim: false,
            adder_skips_check: false,
            submitted_not_went: false,
            no_sent_mark: false,
            readds: 0,
            readd_only_new: false,
        }
    }

    fn conflicts(&self, a: usize, b: usize) -> bool {
        match (&self.keys[a], &self.keys[b]) {
            (Some((ra, wa)), Some((rb, wb))) => {
                let meets = |w: &[u8], o: &[u8]| w.iter().any(|k| o.contains(k));
                meets(wa, wb) || meets(wa, rb) || meets(wb, ra)
            }
            _ => true,
        }
    }

    /// Younger batches conflicting with `b` that went (`surely`: only those marked sent or that
    /// the ledger has or had).
    fn younger_went(&self, s: &State, b: usize, surely: bool) -> bool {
        let me = &s.batches[b];
        (0..s.batches.len()).any(|x| {
            let o = &s.batches[x];
            x != b
                && o.inserted
                && o.stamp > me.stamp
                && self.conflicts(x, b)
                && (o.status.at_ledger()
                    || o.flag
                    || (!surely && !self.submitted_not_went && o.submitted))
        })
    }

    /// Older batches conflicting with `b` the database does not show done.
    fn older_open(&self, s: &State, b: usize) -> bool {
        let me = &s.batches[b];
        (0..s.batches.len()).any(|x| {
            let o = &s.batches[x];
            x != b && o.inserted && o.stamp < me.stamp && self.conflicts(x, b) && !o.status.done()
        })
    }

    /// The ledger takes `b` (a submission arrives), checking the rule against the batches it
    /// took before: of two conflicting batches the ledger took, the first has the older stamp
    /// and is final before the second is taken. (Stamps of batches that may have been sent never
    /// change, which `stamp` checks, so checking at each take covers every pair.)
    fn receive(&self, s: &mut State, b: usize) {
        match s.ledger[b] {
            Led::Fresh | Led::Forgot => {
                let me = s.batches[b].stamp;
                for x in 0..s.batches.len() {
                    if x == b || !s.batches[x].taken || !self.conflicts(x, b) {
                        continue;
                    }
                    let other = s.batches[x].stamp;
                    if other > me && s.bad.is_none() {
                        s.bad = Some(format!(
                            "batch {b} (stamp {me}) taken after the younger batch {x} (stamp {other}) it conflicts with"
                        ));
                    }
                    let final_there = matches!(s.ledger[x], Led::Committed | Led::Invalid);
                    if !final_there && s.bad.is_none() {
                        s.bad = Some(format!(
                            "batch {b} taken while the older batch {x} it conflicts with is {:?} there",
                            s.ledger[x]
                        ));
                    }
                }
                s.batches[b].taken = true;
                s.ledger[b] = Led::Pending;
            }
            Led::Invalid if s.bad.is_none() => {
                s.bad = Some(format!(
                    "batch {b} submitted again after it was found invalid"
                ));
            }
            _ => {}
        }
    }

    /// Stamps `b` again at `at` (dropping an unknown or delayed word) if it was never marked sent,
    /// has no live claim and is still at `seen`.
    fn stamp(s: &mut State, b: usize, seen: u8, at: u8) -> bool {
        let bat = &mut s.batches[b];
        let free = !bat.submitted
            && !bat.flag
            && !bat.status.at_ledger()
            && bat.stamp == seen
            && !bat.claim.is_some_and(|(_, live)| live);
        if free {
            if bat.sent && s.bad.is_none() {
                s.bad = Some(format!(
                    "batch {b} stamped again after it may have been sent"
                ));
            }
            if bat.returned && s.bad.is_none() {
                s.bad = Some(format!("batch {b} stamped again after its add returned"));
            }
            bat.stamp = at;
            bat.status = St::New;
        }
        free
    }

    /// Whether a claim may land on `b` now.
    fn claimable(s: &State, b: usize) -> bool {
        let bat = &s.batches[b];
        bat.inserted
            && !bat.submitted
            && !matches!(bat.status, St::Pending | St::Committed | St::Invalid)
            && !bat.claim.is_some_and(|(_, live)| live)
    }

    /// The claim-write of process `p` (its token already drawn).
    fn claim_write(s: &mut State, p: &Proc) -> bool {
        let b = p.batch as usize;
        if !Self::claimable(s, b) || s.batches[b].stamp != p.seen {
            return false;
        }
        let bat = &mut s.batches[b];
        bat.claim = Some((p.token, true));
        bat.submitted = true;
        true
    }

    /// One step of process `i`; `None` when it cannot move.
    fn step(&self, s: &State, i: usize) -> Vec<State> {
        let p = s.procs[i].clone();
        let b = p.batch as usize;
        let mut n = s.clone();
        let mut out = Vec::new();
        let done = |mut n: State| {
            n.procs.remove(i);
            n
        };
        match p.step {
            Step::Insert => {
                n.batches[b].inserted = true;
                n.procs[i].step = Step::Check;
                n.procs[i].seen = n.batches[b].stamp;
                out.push(n);
            }
            Step::Check => {
                n.procs[i].seen = n.batches[b].stamp;
                let went = !self.adder_skips_check && self.younger_went(s, b, false);
                if !went || s.batches[b].status.at_ledger() || s.batches[b].flag {
                    // Nothing went ahead of it, or it was marked sent or is at the ledger (its
                    // place is fixed): the add returns. When it is with a submitter, the adder
                    // waits and looks again (this step again).
                    n.batches[b].returned = true;
                    out.push(done(n));
                } else if !s.batches[b].submitted {
                    n.procs[i].step = Step::Draw;
                    out.push(n);
                }
            }
            Step::Draw | Step::ClaimDraw => {
                if n.newest >= self.max_stamp {
                    out.push(done(n));
                } else {
                    n.newest += 1;
                    let at = n.newest;
                    n.procs[i].step = if p.step == Step::Draw {
                        Step::Stamp(at)
                    } else {
                        Step::ClaimStamp(at)
                    };
                    out.push(n);
                }
            }
            Step::Stamp(at) => {
                Self::stamp(&mut n, b, p.seen, at);
                n.procs[i].step = Step::Check;
                out.push(n);
            }
            Step::ClaimStamp(at) => {
                Self::stamp(&mut n, b, p.seen, at);
                out.push(done(n));
            }
            Step::Claim => {
                // The mutation's claim, after its count.
                if Self::claim_write(&mut n, &p) {
                    n.procs[i].step = if p.counted_clear {
                        Step::Send
                    } else {
                        Step::GiveBack {
                            reset: false,
                            restamp: false,
                        }
                    };
                    out.push(n);
                } else {
                    out.push(done(n));
                }
            }
            Step::Count => {
                let older = self.older_open(s, b);
                let younger = self.younger_went(s, b, false);
                if self.count_before_claim {
                    n.procs[i].counted_clear = !older && !younger;
                    n.procs[i].step = Step::Claim;
                    out.push(n);
                    return out;
                }
                if !older && !younger {
                    n.procs[i].step = if self.no_sent_mark {
                        Step::Send
                    } else {
                        Step::Flag
                    };
                } else {
                    let flag = s.batches[b].flag;
                    let passed = younger && self.younger_went(s, b, true);
                    let reset =
                        (older || passed) && !flag && matches!(p.prev, St::Unknown | St::Delayed);
                    let restamp = passed && !flag;
                    n.procs[i].step = Step::GiveBack { reset, restamp };
                }
                out.push(n);
            }
            Step::Flag => {
                // Only while the claim is its own and live.
                let bat = &mut n.batches[b];
                if bat.claim == Some((p.token, true)) {
                    bat.flag = true;
                    n.procs[i].step = Step::Send;
                    out.push(n);
                } else {
                    out.push(done(n));
                }
            }
            Step::Send => {
                if p.late {
                    // Past its deadline: it does not send (the batch is left to the monitor).
                    out.push(done(n));
                    return out;
                }
                // Accepted at once.
                let mut a = n.clone();
                a.batches[b].sent = true;
                self.receive(&mut a, b);
                a.procs[i].step = Step::Accepted;
                out.push(a);
                // Answered delayed: not taken.
                let mut d = n.clone();
                d.procs[i].step = Step::Delayed;
                out.push(d);
                // No answer: on the wire, the submitter leaves it to the monitor.
                let mut w = n.clone();
                w.batches[b].sent = true;
                if !w.wire.contains(&p.batch) {
                    w.wire.push(p.batch);
                    w.wire.sort_unstable();
                }
                out.push(done(w));
            }
            Step::Accepted | Step::Delayed => {
                let bat = &mut n.batches[b];
                let ours = bat.claim.is_some_and(|(t, _)| t == p.token);
                if ours {
                    if !matches!(bat.status, St::Pending | St::Committed | St::Invalid) {
                        if p.step == Step::Accepted {
                            bat.status = St::Pending;
                        } else {
                            bat.status = St::Delayed;
                            bat.submitted = false;
                        }
                    }
                    bat.claim = None;
                }
                out.push(done(n));
            }
            Step::GiveBack { reset, restamp } => {
                let bat = &mut n.batches[b];
                if bat.claim.is_some_and(|(t, _)| t == p.token) && bat.status == p.prev {
                    bat.submitted = false;
                    bat.claim = None;
                    if reset {
                        bat.status = St::New;
                    }
                }
                if restamp {
                    n.procs[i].step = Step::ClaimDraw;
                    out.push(n);
                } else {
                    out.push(done(n));
                }
            }
        }
        out
    }
}

impl Model for QueueModel {
    type State = State;

    fn init(&self) -> Vec<State> {
        let count = self.keys.len();
        let batches = (0..count)
            .map(|b| Bat {
                stamp: u8::try_from(b + 1).unwrap_or(u8::MAX),
                inserted: self.added[b],
                submitted: false,
                status: St::New,
                claim: None,
                flag: false,
                sent: false,
                returned: self.added[b],
                taken: false,
            })
            .collect();
        let procs = (0..count)
            .filter(|b| !self.added[*b])
            .map(|b| Proc {
                batch: u8::try_from(b).unwrap_or(u8::MAX),
                step: Step::Insert,
                token: 0,
                seen: 0,
                prev: St::New,
                late: false,
                counted_clear: false,
            })
            .collect();
        vec![State {
            batches,
            ledger: vec![Led::Fresh; count],
            wire: Vec::new(),
            procs,
            newest: u8::try_from(count).unwrap_or(u8::MAX),
            tokens: 0,
            claims: 0,
            readds: 0,
            bad: None,
        }]
    }

    fn next(&self, s: &State) -> Vec<State> {
        let mut out = self.moves(s);
        // Processes are a set: one order of them stands for all.
        for n in &mut out {
            n.procs.sort();
        }
        out
    }

    fn check(&self, s: &State) -> Result<(), String> {
        self.judge(s)
    }
}

impl QueueModel {
    /// Every state one step from `s`, processes in any order.
    fn moves(&self, s: &State) -> Vec<State> {
        let mut out = Vec::new();
        if s.bad.is_some() {
            return out;
        }
        // Each process's step, or its crash.
        for i in 0..s.procs.len() {
            out.extend(self.step(s, i));
            let mut n = s.clone();
            n.procs.remove(i);
            out.push(n);
        }
        for b in 0..s.batches.len() {
            let bat = &s.batches[b];
            // The batch added again by its header after its add ended without returning (died
            // after the insert, or failed): the add finds it stored and makes the adder's check
            // (see `store::added_before`) unless it may have been sent (marked sent, or the
            // ledger has or had it): then its place is fixed, and the add returns. (Two adds of
            // one batch at once are left out: one may return while the other still stamps the
            // batch again, a limit docs/queue.md states.)
            let adding = s.procs.iter().any(|p| {
                p.batch as usize == b
                    && matches!(
                        p.step,
                        Step::Insert | Step::Check | Step::Draw | Step::Stamp(_)
                    )
            });
            if s.readds < self.readds && bat.inserted && !bat.returned && !adding {
                let mut n = s.clone();
                n.readds += 1;
                let checks = if self.readd_only_new {
                    bat.status == St::New && !bat.submitted && !bat.flag
                } else {
                    !bat.flag && !bat.status.at_ledger()
                };
                if checks {
                    n.procs.push(Proc {
                        batch: u8::try_from(b).unwrap_or(u8::MAX),
                        step: Step::Check,
                        token: 0,
                        seen: bat.stamp,
                        prev: St::New,
                        late: false,
                        counted_clear: false,
                    });
                } else {
                    n.batches[b].returned = true;
                }
                out.push(n);
            }
            // A new claimant.
            if s.claims < self.claims && Self::claimable(s, b) {
                let mut n = s.clone();
                n.claims += 1;
                n.tokens += 1;
                let p = Proc {
                    batch: u8::try_from(b).unwrap_or(u8::MAX),
                    step: Step::Count,
                    token: n.tokens,
                    seen: bat.stamp,
                    prev: bat.status,
                    late: false,
                    counted_clear: false,
                };
                if self.count_before_claim || Self::claim_write(&mut n, &p) {
                    n.procs.push(p);
                    out.push(n);
                }
            }
            // The claim runs out, unless its claimant is sending or its submission is still on
            // its way (a submitter sends only before its deadline, which comes before the
            // expiry; a submission that reaches the ledger later is the limit the serial queue
            // documents, and the model leaves it out).
            if let Some((token, true)) = bat.claim {
                let sending = s
                    .procs
                    .iter()
                    .any(|p| p.token == token && p.step == Step::Send && !p.late)
                    || s.wire.contains(&u8::try_from(b).unwrap_or(u8::MAX));
                if !sending {
                    let mut n = s.clone();
                    n.batches[b].claim = Some((token, false));
                    for p in n.procs.iter_mut().filter(|p| p.token == token) {
                        p.late = true;
                    }
                    out.push(n);
                }
            }
            // The ledger settles a pending batch.
            if s.ledger[b] == Led::Pending {
                for to in [Led::Committed, Led::Invalid, Led::Forgot] {
                    let mut n = s.clone();
                    n.ledger[b] = to;
                    out.push(n);
                }
            }
            // The monitor records what the ledger says.
            let watched = bat.status == St::Pending
                || (bat.submitted && matches!(bat.status, St::New | St::Unknown | St::Delayed));
            if watched {
                let mut n = s.clone();
                let nb = &mut n.batches[b];
                let moved = match s.ledger[b] {
                    Led::Fresh | Led::Forgot => {
                        let expired = !nb.claim.is_some_and(|(_, live)| live);
                        if nb.status == St::Pending || expired {
                            nb.status = St::Unknown;
                            nb.submitted = false;
                            nb.claim = None;
                            true
                        } else {
                            false
                        }
                    }
                    Led::Pending => {
                        if nb.status != St::Pending {
                            nb.status = St::Pending;
                            nb.claim = None;
                            true
                        } else {
                            false
                        }
                    }
                    Led::Committed | Led::Invalid => {
                        nb.status = if s.ledger[b] == Led::Committed {
                            St::Committed
                        } else {
                            St::Invalid
                        };
                        nb.claim = None;
                        true
                    }
                };
                if moved {
                    out.push(n);
                }
            }
        }
        // A submission on the wire arrives, or is lost.
        for w in 0..s.wire.len() {
            let b = s.wire[w] as usize;
            let mut n = s.clone();
            n.wire.remove(w);
            self.receive(&mut n, b);
            out.push(n);
            let mut lost = s.clone();
            lost.wire.remove(w);
            out.push(lost);
        }
        out
    }

    /// The properties checked in every state (recorded as they break, by `receive` and
    /// `stamp`).
    fn judge(&self, s: &State) -> Result<(), String> {
        match &s.bad {
            Some(why) => Err(why.clone()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::explore::explore;

    const LIMIT: usize = 20_000_000;

    /// Batches 0 and 1 write key 1; batch 2 reads key 1 (so it conflicts with both) and writes
    /// key 2.
    fn chain() -> Vec<Option<(Vec<u8>, Vec<u8>)>> {
        vec![
            Some((vec![], vec![1])),
            Some((vec![], vec![1])),
            Some((vec![1], vec![2])),
        ]
    }

    fn run(model: &QueueModel) -> crate::testkit::explore::Explored<State> {
        let found = explore(model, LIMIT);
        if let Some((_, path)) = &found.violation {
            for (i, state) in path.iter().enumerate() {
                eprintln!("step {i}: {state:?}");
            }
        }
        eprintln!(
            "{} states{}{}",
            found.states,
            if found.truncated { " (truncated)" } else { "" },
            found
                .violation
                .as_ref()
                .map(|(why, path)| format!(": {why}, in {} steps", path.len() - 1))
                .unwrap_or_default()
        );
        found
    }

    #[test]
    #[ignore = "millions of states: run with the crate optimised, see docs/queue.md"]
    fn two_conflicting_batches_and_an_independent_one_keep_the_rule_in_every_state() {
        // The independent batch was added first; the conflicting two overlap.
        let mut model = QueueModel::new(vec![
            Some((vec![], vec![9])),
            Some((vec![], vec![1])),
            Some((vec![1], vec![1])),
        ]);
        model.added[0] = true;
        // Two claimants in all: the independent batch's own sends multiply the interleavings.
        model.claims = 2;
        let found = run(&model);
        assert!(!found.truncated);
        assert!(found.violation.is_none(), "{:?}", found.violation);
    }

    #[test]
    #[ignore = "millions of states: run with the crate optimised, see docs/queue.md"]
    fn undeclared_batches_keep_the_rule_in_every_state() {
        let found = run(&QueueModel::new(vec![None, Some((vec![], vec![9]))]));
        assert!(!found.truncated);
        assert!(found.violation.is_none(), "{:?}", found.violation);
    }

    #[test]
    #[ignore = "millions of states: run with the crate optimised, see docs/queue.md"]
    fn a_chain_of_three_keeps_the_rule_in_every_state() {
        // The first was added before; the other two overlap.
        let mut model = QueueModel::new(chain());
        model.added[0] = true;
        let found = run(&model);
        assert!(!found.truncated);
        assert!(found.violation.is_none(), "{:?}", found.violation);
    }

    fn pair() -> Vec<Option<(Vec<u8>, Vec<u8>)>> {
        vec![Some((vec![], vec![1])), Some((vec![1], vec![]))]
    }

    #[test]
    #[ignore = "millions of states: run with the crate optimised, see docs/queue.md"]
    fn a_batch_added_again_keeps_the_rule_in_every_state() {
        let mut model = QueueModel::new(pair());
        model.readds = 1;
        let found = run(&model);
        assert!(!found.truncated);
        assert!(found.violation.is_none(), "{:?}", found.violation);
    }

    #[test]
    fn an_add_again_that_checks_only_new_batches_is_caught() {
        let mut model = QueueModel::new(pair());
        model.readds = 1;
        model.readd_only_new = true;
        let found = run(&model);
        let (why, _) = found.violation.expect("the mutation must be caught");
        assert!(why.contains("after its add returned"), "{why}");
    }

    #[test]
    fn a_claimant_that_counts_before_it_claims_is_caught() {
        let mut model = QueueModel::new(pair());
        model.count_before_claim = true;
        let found = run(&model);
        let (why, _) = found.violation.expect("the mutation must be caught");
        assert!(why.contains("taken"), "{why}");
    }

    #[test]
    fn an_adder_that_does_not_look_for_younger_batches_that_went_is_caught() {
        let mut model = QueueModel::new(pair());
        model.adder_skips_check = true;
        let found = run(&model);
        let (why, _) = found.violation.expect("the mutation must be caught");
        assert!(why.contains("after its add returned"), "{why}");
    }

    #[test]
    fn a_batch_that_counts_as_gone_only_while_submitted_or_at_the_ledger_is_caught() {
        let mut model = QueueModel::new(pair());
        model.no_sent_mark = true;
        let found = run(&model);
        let (why, _) = found.violation.expect("the mutation must be caught");
        assert!(
            why.contains("taken") || why.contains("stamped again"),
            "{why}"
        );
    }

    #[test]
    fn a_submitted_batch_not_counted_as_gone_is_caught() {
        let mut model = QueueModel::new(pair());
        model.submitted_not_went = true;
        let found = run(&model);
        let (why, _) = found.violation.expect("the mutation must be caught");
        assert!(why.contains("taken"), "{why}");
    }
}
