//! An exhaustive model of settling one reservation, message by message: the reservation's
//! clones settle it from tasks of their own (each with the calls it says it made), every sending
//! of a settlement travels a network that loses, cuts (the sender sees an error while the command
//! is still on its way), duplicates and reorders messages, the caller may call `settle` again
//! after an error, and other reservations' settlements push keys off the limiter's recent
//! settlements meanwhile. The limiter's side is the settling write of `plan::settle_update`: the
//! recent settlements (`seen`), `evicted` for a resend (`lost`), the end slot still counting
//! (`here`) and, in the fixed protocol, the sending's own interval of server time.
//!
//! (Over 700 lines on purpose: the model's state, its steps, the invariants and the tests that
//! find the old protocol's counterexamples are one specification, read together.)
//!
//! One reservation on one limiter (a reservation across limiters settles on each with a
//! settlement of its own, the same protocol), three protocols. [`Protocol::Before`] is the one
//! of a59d55a (issue 47, cases 4 and 5: a clone's
//! `settle` finding the state `SENT` took itself for a resend and wrote with its own `made`; a
//! first sending delivered after its resend and after the ring forgot the resend was applied
//! again). [`Protocol::Fixed`] is the one `ops::settle` implements now:
//!
//! - a reservation's clones share one settlement: the first `settle` owns it (`Sending`), a
//!   concurrent one is refused without a write, a later one is a resend only if it reports the
//!   same `made` after the first failed (`Sent`), and refused otherwise;
//! - every sending carries an interval of server time `(after, until]` outside which it changes
//!   nothing: `until` is the sender's clock estimate plus the send window, `after` the latest
//!   `until` of every earlier sending of the settlement. So two sendings of one settlement are
//!   never applicable at the same server time: one applied at `t` follows every earlier sending
//!   that could apply (it finds it among the recent settlements, or, being a resend, learns that
//!   one left them: `lost`), and precedes every later one (which finds it the same way).
//!
//! [`Protocol::DeadlineOnly`] is a mutation of the fix, windows without their start, which the
//! explorer must catch.
//!
//! A sending the network duplicates is one command: the server runs it once (MongoDB's retryable
//! writes on a replica set or a sharded cluster answer a retry from the first run; a standalone
//! server gets no retry, as the driver retries writes only where they are retryable). With
//! [`SettleSizes::server_dedupe`] off the server runs every copy, and the model shows what that
//! costs: a copy arriving inside its interval after its key left the ring applies again.
//!
//! Checked in every state: a settlement is applied at most once; the limiter counts the end
//! slot's other calls and, for the reservation, its calls until a settlement applies and the
//! calls that settlement reported after; a `settle` that returned `Returned` is the one whose
//! `made` the limiter counts; at most one `settle` call of the reservation is accepted (every
//! other one is refused, or failed with a retryable error).

use crate::testkit::explore::Model;

/// Which settling protocol the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// a59d55a's: an `OPEN`/`SENT`/`DONE` state shared by the clones (a `settle` that finds
    /// `SENT` resends with its own `made`), and sendings without a deadline.
    Before,
    /// The fix: one settlement per reservation, owned by the `settle` call that starts it, and
    /// sendings valid in disjoint intervals of server time.
    Fixed,
    /// The fix with sendings valid only until their deadline, not after the earlier ones' (a
    /// mutation: a deadline alone does not keep a late first sending from applying after its
    /// resend).
    DeadlineOnly,
}

/// The sizes of a settlement model.
#[derive(Debug, Clone, Copy)]
pub struct SettleSizes {
    /// Handles of the reservation settling it (1 or 2): handle 0 reports 1 call made, handle 1
    /// reports 0.
    pub clones: u8,
    /// `settle` calls each handle may make (a caller retries after an error).
    pub calls: u8,
    /// Sendings per `settle` call.
    pub tries: u8,
    /// Recent settlements the limiter remembers (32 in the product).
    pub ring: u8,
    /// Other reservations' settlements that may land meanwhile.
    pub others: u8,
    /// Whether the network loses, cuts and duplicates messages (it always reorders them).
    pub faults: bool,
    /// Duplications the network may make in all.
    pub dups: u8,
    /// Whether the server runs a duplicated command once.
    pub server_dedupe: bool,
    /// The tick of the reservation's end: no settlement applies after it.
    pub end: u8,
    /// Ticks a sending stays valid after it leaves ([`Protocol::Fixed`]).
    pub send_window: u8,
}

/// The reservation's calls.
const N: u8 = 1;
/// Calls of another reservation pending in the same end slot.
const FILLER: u8 = 1;

fn handle_id(h: usize) -> u8 {
    u8::try_from(h).unwrap_or(u8::MAX)
}

/// What a handle reports made.
fn made_of(clone: usize) -> u8 {
    u8::from(clone == 0)
}

/// The settlement state the clones share (the `Mutex` of `CallReservation`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Shared {
    /// Not settled.
    Open,
    /// A `settle` call is sending it (`Before`: `SENT`, which holds no `made`).
    Sending(Option<u8>),
    /// A `settle` call failed after sending it ([`Protocol::Fixed`] only).
    Sent(u8),
    /// Settled with this `made`.
    Done(u8),
}

/// What the sendings of the settlement so far require of the next ([`Protocol::Fixed`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Track {
    /// The latest `until` of every sending so far: the next one is valid only after it.
    pub after: Option<u8>,
    /// Sendings whose fate the sender does not know (a resend must check `lost`).
    pub unknown: u8,
}

/// How a `settle` call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// `Settled::Returned`.
    Returned,
    /// `Settled::Unconfirmed`.
    Unconfirmed,
    /// `Settled::Expired`.
    Expired,
    /// `AlreadySettled`, without a write.
    Refused,
    /// A retryable error: every try was cut, lost, or came too early or too late.
    Failed,
}

/// A `settle` call in progress.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Call {
    /// Sendings left.
    pub tries: u8,
    /// `Before`: whether the next sending is a resend.
    pub resend: bool,
    /// The sending it waits for.
    pub waiting: Option<u8>,
}

/// One handle of the reservation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Handle {
    /// `settle` calls it may still make.
    pub calls: u8,
    /// The call in progress.
    pub call: Option<Call>,
    /// How its calls ended, in order.
    pub outcomes: Vec<Outcome>,
}

/// A settling command on its way.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Msg {
    /// The sending (its copies share it).
    pub id: u8,
    /// Calls reported made.
    pub made: u8,
    /// Whether it is sent as a resend.
    pub resend: bool,
    /// Valid only after this tick.
    pub after: Option<u8>,
    /// Valid only until this tick.
    pub until: Option<u8>,
    /// The handle waiting for its reply (none for a copy, or once the sender gave up on it).
    pub awaited: Option<u8>,
}

/// A state of the settlement model.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SettleState {
    /// The server's clock.
    pub now: u8,
    /// Calls counted in the reservation's end slot (its own and the filler's).
    pub end_slot: u8,
    /// Calls made that settlements put in the slots of their settle time.
    pub made_slot: u8,
    /// Recent settlements, oldest first: 0 is the reservation, others are 1 and up.
    pub ring: Vec<u8>,
    /// A settlement made after the reservation's grant left the ring.
    pub evicted: bool,
    /// Other settlements landed.
    pub others: u8,
    /// (Ghost) the `made` of every application of the reservation's settlement.
    pub applied: Vec<u8>,
    /// The settlement state the handles share.
    pub shared: Shared,
    /// What the next sending must carry.
    pub track: Track,
    /// The handles.
    pub handles: Vec<Handle>,
    /// Commands on their way, sorted.
    pub net: Vec<Msg>,
    /// Sendings the server ran, with what it answered (a retried command is answered again).
    pub ran: Vec<(u8, Reply)>,
    /// The next sending's id.
    pub next_id: u8,
    /// Duplications left.
    pub dups: u8,
}

/// What the settling write answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reply {
    /// Applied now.
    Applied,
    /// Found among the recent settlements.
    Seen,
    /// A resend, and a settlement made since the grant left the recent ones.
    Lost,
    /// Past the reservation's end (or its slot is gone).
    Gone,
    /// Before its interval.
    Early,
    /// After its interval.
    Late,
}

/// The settlement model.
#[derive(Debug, Clone, Copy)]
pub struct SettleModel {
    /// Its sizes.
    pub sizes: SettleSizes,
    /// The protocol the clients run.
    pub protocol: Protocol,
}

impl SettleModel {
    /// The limiter's ring gains `key`; the oldest leaves it beyond the ring's size.
    fn remember(&self, s: &mut SettleState, key: u8) {
        s.ring.push(key);
        if s.ring.len() > usize::from(self.sizes.ring) {
            s.ring.remove(0);
            // Every settlement of the model was made after the reservation's grant.
            s.evicted = true;
        }
    }

    /// The settling write of `m`, run at `s.now`.
    fn run(&self, s: &mut SettleState, m: &Msg) -> Reply {
        let seen = s.ring.contains(&0);
        let lost = m.resend && s.evicted;
        let here = s.now <= self.sizes.end && s.end_slot > 0;
        let early = m.after.is_some_and(|a| s.now <= a);
        let late = m.until.is_some_and(|u| s.now > u);
        if seen {
            return Reply::Seen;
        }
        if lost {
            return Reply::Lost;
        }
        if !here {
            return Reply::Gone;
        }
        if early {
            return Reply::Early;
        }
        if late {
            return Reply::Late;
        }
        s.end_slot = s.end_slot.saturating_sub(N);
        s.made_slot += m.made;
        s.applied.push(m.made);
        self.remember(s, 0);
        Reply::Applied
    }

    /// Handle `h`'s call ends with `outcome`.
    fn finish(&self, s: &mut SettleState, h: usize, outcome: Outcome) {
        let handle = &mut s.handles[h];
        handle.call = None;
        handle.outcomes.push(outcome);
        if outcome == Outcome::Failed && self.protocol != Protocol::Before {
            s.shared = Shared::Sent(made_of(h));
        }
    }

    /// Handle `h` learns nothing of its sending (an error): it sends again or gives up.
    fn error(&self, s: &mut SettleState, h: usize) {
        let call = s.handles[h].call.as_mut().expect("a call waits");
        call.waiting = None;
        call.resend = true;
        if call.tries == 0 {
            self.finish(s, h, Outcome::Failed);
        }
    }

    /// Handle `h` gets the reply to its sending.
    fn reply(&self, s: &mut SettleState, h: usize, reply: Reply) {
        let outcome = match reply {
            Reply::Applied | Reply::Seen => Outcome::Returned,
            Reply::Lost => Outcome::Unconfirmed,
            Reply::Gone => Outcome::Expired,
            Reply::Early | Reply::Late => {
                // This sending did nothing; the others' fates are what they were.
                s.track.unknown -= 1;
                let call = s.handles[h].call.as_mut().expect("a call waits");
                call.waiting = None;
                if call.tries == 0 {
                    self.finish(s, h, Outcome::Failed);
                }
                return;
            }
        };
        if self.protocol != Protocol::Before {
            s.track.unknown -= 1;
        }
        s.shared = Shared::Done(made_of(h));
        self.finish(s, h, outcome);
    }

    /// Handle `h` calls `settle`.
    fn start(&self, s: &mut SettleState, h: usize) {
        let made = made_of(h);
        s.handles[h].calls -= 1;
        let go = |resend| Call {
            tries: self.sizes.tries,
            resend,
            waiting: None,
        };
        let started = match (self.protocol, &s.shared) {
            (Protocol::Before, Shared::Open) => Some((Shared::Sending(None), false)),
            (Protocol::Before, Shared::Sending(_)) => Some((Shared::Sending(None), true)),
            (Protocol::Before, _) => None,
            (_, Shared::Open) => Some((Shared::Sending(Some(made)), false)),
            (_, Shared::Sent(m)) if *m == made => Some((Shared::Sending(Some(made)), true)),
            _ => None,
        };
        match started {
            Some((shared, resend)) => {
                s.shared = shared;
                s.handles[h].call = Some(go(resend));
            }
            None => s.handles[h].outcomes.push(Outcome::Refused),
        }
    }

    /// Handle `h` sends its settlement.
    fn send(&self, s: &mut SettleState, h: usize) {
        let id = s.next_id;
        s.next_id += 1;
        let call = s.handles[h].call.as_mut().expect("a call");
        call.tries -= 1;
        call.waiting = Some(id);
        let m = match self.protocol {
            Protocol::Before => Msg {
                id,
                made: made_of(h),
                resend: call.resend,
                after: None,
                until: None,
                awaited: Some(handle_id(h)),
            },
            Protocol::Fixed | Protocol::DeadlineOnly => {
                // Whatever the sender's estimate of the server's clock, its window starts after
                // every earlier sending's.
                let until = s.now + self.sizes.send_window;
                let m = Msg {
                    id,
                    made: made_of(h),
                    resend: s.track.unknown > 0,
                    after: if self.protocol == Protocol::Fixed {
                        s.track.after
                    } else {
                        None
                    },
                    until: Some(until),
                    awaited: Some(handle_id(h)),
                };
                s.track.after = Some(s.track.after.map_or(until, |a| a.max(until)));
                s.track.unknown += 1;
                m
            }
        };
        s.net.push(m);
        s.net.sort();
    }
}

/// The state with what no future step can tell apart made equal: the server forgets the
/// answers of commands no copy of which is still on its way, and the sendings on their way are
/// numbered from 0 in the order they were sent.
fn normalized(mut s: SettleState) -> SettleState {
    let mut live: Vec<u8> = s.net.iter().map(|m| m.id).collect();
    live.sort_unstable();
    live.dedup();
    s.ran.retain(|(id, _)| live.contains(id));
    let renumber = |id: u8| {
        u8::try_from(live.iter().position(|&l| l == id).expect("a live sending")).unwrap_or(u8::MAX)
    };
    for m in &mut s.net {
        m.id = renumber(m.id);
    }
    for (id, _) in &mut s.ran {
        *id = renumber(*id);
    }
    for h in &mut s.handles {
        if let Some(call) = &mut h.call {
            call.waiting = call.waiting.map(renumber);
        }
    }
    s.net.sort();
    s.ran.sort_unstable();
    s.next_id = u8::try_from(live.len()).unwrap_or(u8::MAX);
    s
}

impl Model for SettleModel {
    type State = SettleState;

    fn init(&self) -> Vec<SettleState> {
        let handle = Handle {
            calls: self.sizes.calls,
            call: None,
            outcomes: Vec::new(),
        };
        vec![SettleState {
            now: 0,
            end_slot: N + FILLER,
            made_slot: 0,
            ring: Vec::new(),
            evicted: false,
            others: 0,
            applied: Vec::new(),
            shared: Shared::Open,
            track: Track::default(),
            handles: vec![handle; usize::from(self.sizes.clones)],
            net: Vec::new(),
            ran: Vec::new(),
            next_id: 0,
            dups: self.sizes.dups,
        }]
    }

    fn next(&self, state: &SettleState) -> Vec<SettleState> {
        let mut out = Vec::new();
        for h in 0..state.handles.len() {
            let handle = &state.handles[h];
            match &handle.call {
                None if handle.calls > 0 => {
                    let mut s = state.clone();
                    self.start(&mut s, h);
                    out.push(s);
                }
                Some(call) if call.waiting.is_none() && call.tries > 0 => {
                    let mut s = state.clone();
                    self.send(&mut s, h);
                    out.push(s);
                }
                _ => {}
            }
        }
        for (i, m) in state.net.iter().enumerate() {
            if i > 0 && state.net[i - 1] == *m {
                continue;
            }
            let mut taken = state.clone();
            taken.net.remove(i);
            // Delivered (in any order): the server runs it once, or every copy.
            let mut s = taken.clone();
            let first = s.ran.iter().find(|(id, _)| *id == m.id).map(|(_, r)| *r);
            let reply = match first {
                Some(reply) if self.sizes.server_dedupe => reply,
                _ => self.run(&mut s, m),
            };
            if first.is_none() {
                s.ran.push((m.id, reply));
                s.ran.sort_unstable();
            }
            {
                match m.awaited {
                    None => out.push(s),
                    Some(h) => {
                        let mut answered = s.clone();
                        self.reply(&mut answered, usize::from(h), reply);
                        out.push(answered);
                        if self.sizes.faults {
                            // Its reply lost.
                            self.error(&mut s, usize::from(h));
                            out.push(s);
                        }
                    }
                }
            }
            if !self.sizes.faults {
                continue;
            }
            // Lost on the way.
            let mut s = taken.clone();
            if let Some(h) = m.awaited {
                self.error(&mut s, usize::from(h));
            }
            out.push(s);
            // Cut: its sender sees an error, the command is still on its way.
            if let Some(h) = m.awaited {
                let mut s = taken.clone();
                s.net.push(Msg {
                    awaited: None,
                    ..m.clone()
                });
                s.net.sort();
                self.error(&mut s, usize::from(h));
                out.push(s);
            }
            if state.dups > 0 {
                let mut s = state.clone();
                s.dups -= 1;
                s.net.push(Msg {
                    awaited: None,
                    ..m.clone()
                });
                s.net.sort();
                out.push(s);
            }
        }
        if state.others < self.sizes.others {
            let mut s = state.clone();
            s.others += 1;
            let key = s.others;
            self.remember(&mut s, key);
            out.push(s);
        }
        if state.now <= self.sizes.end {
            let mut s = state.clone();
            s.now += 1;
            out.push(s);
        }
        out.into_iter().map(normalized).collect()
    }

    fn check(&self, s: &SettleState) -> Result<(), String> {
        if s.applied.len() > 1 {
            return Err(format!(
                "the settlement was applied {} times (made {:?}): {s:?}",
                s.applied.len(),
                s.applied
            ));
        }
        let counted = FILLER + s.applied.first().copied().unwrap_or(N);
        if s.end_slot + s.made_slot != counted {
            return Err(format!(
                "the limiter counts {} calls for {counted} made or pending: {s:?}",
                s.end_slot + s.made_slot
            ));
        }
        for (h, handle) in s.handles.iter().enumerate() {
            if handle.outcomes.contains(&Outcome::Returned) && s.applied != [made_of(h)] {
                return Err(format!(
                    "handle {h} was told its {} calls made were recorded, the limiter counts {:?}: {s:?}",
                    made_of(h),
                    s.applied
                ));
            }
        }
        let accepted = s
            .handles
            .iter()
            .flat_map(|h| &h.outcomes)
            .filter(|o| {
                matches!(
                    o,
                    Outcome::Returned | Outcome::Unconfirmed | Outcome::Expired
                )
            })
            .count();
        if accepted > 1 {
            return Err(format!("{accepted} settle calls were accepted: {s:?}"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::explore::explore;

    const LIMIT: usize = 30_000_000;

    fn sizes() -> SettleSizes {
        SettleSizes {
            clones: 2,
            calls: 2,
            tries: 2,
            ring: 1,
            others: 2,
            faults: true,
            dups: 1,
            server_dedupe: true,
            end: 3,
            send_window: 1,
        }
    }

    fn run(sizes: SettleSizes, protocol: Protocol) -> (usize, Option<(String, Vec<SettleState>)>) {
        let explored = explore(&SettleModel { sizes, protocol }, LIMIT);
        assert!(!explored.truncated, "explored only part of it");
        (explored.states, explored.violation)
    }

    fn shown(path: &[SettleState]) -> String {
        path.iter()
            .enumerate()
            .map(|(i, s)| format!("  {i}: {s:?}\n"))
            .collect()
    }

    #[test]
    fn case_4_the_old_protocol_accepts_two_clones_settling_at_once() {
        let clones = SettleSizes {
            faults: false,
            others: 0,
            calls: 1,
            tries: 1,
            ..sizes()
        };
        let (states, violation) = run(clones, Protocol::Before);
        let (why, path) = violation.expect("the clones' race is found");
        println!(
            "case 4, before: {why}\n after {states} states, {} steps:\n{}",
            path.len() - 1,
            shown(&path)
        );
        assert!(why.contains("was told"), "{why}");
        let (states, violation) = run(clones, Protocol::Fixed);
        assert!(violation.is_none(), "{violation:?}");
        println!("case 4, fixed: {states} states, no violation");
    }

    #[test]
    fn case_5_the_old_protocol_applies_a_late_first_sending_again() {
        let one = SettleSizes {
            clones: 1,
            ..sizes()
        };
        let (states, violation) = run(one, Protocol::Before);
        let (why, path) = violation.expect("the late first sending is found");
        println!(
            "case 5, before: {why}\n after {states} states, {} steps:\n{}",
            path.len() - 1,
            shown(&path)
        );
        assert!(why.contains("applied 2 times"), "{why}");
        let (states, violation) = run(one, Protocol::Fixed);
        assert!(violation.is_none(), "{violation:?}");
        println!("case 5, fixed: {states} states, no violation");
    }

    #[test]
    fn the_fixed_protocol_settles_once_with_clones_retries_and_every_fault() {
        for sizes in [
            SettleSizes {
                tries: 1,
                others: 1,
                end: 2,
                ..sizes()
            },
            SettleSizes {
                calls: 1,
                others: 1,
                end: 2,
                ..sizes()
            },
        ] {
            let (states, violation) = run(sizes, Protocol::Fixed);
            if let Some((why, path)) = violation {
                panic!("{sizes:?}: {why}\n{}", shown(&path));
            }
            println!("settlement model {sizes:?}: {states} states, no violation");
            assert!(states > 10_000, "too small to mean anything");
            let (states, violation) = run(sizes, Protocol::Before);
            let (why, _) = violation.expect("the old protocol fails");
            println!("  the old protocol: {why} after {states} states");
        }
    }

    /// The larger sizes, run optimised by `.ci/run` (about a minute there; an unoptimised build
    /// takes ten times as long).
    #[test]
    #[ignore = "exhaustive; run optimised by .ci/run"]
    fn the_fixed_protocol_settles_once_at_larger_sizes() {
        for sizes in [
            sizes(),
            SettleSizes {
                ring: 2,
                others: 3,
                ..sizes()
            },
            SettleSizes {
                calls: 1,
                tries: 3,
                send_window: 2,
                end: 4,
                ..sizes()
            },
        ] {
            let started = std::time::Instant::now();
            let (states, violation) = run(sizes, Protocol::Fixed);
            if let Some((why, path)) = violation {
                panic!("{sizes:?}: {why}\n{}", shown(&path));
            }
            println!(
                "settlement model {sizes:?}: {states} states in {:?}, no violation",
                started.elapsed()
            );
        }
    }

    #[test]
    fn a_deadline_without_the_earlier_sendings_window_is_caught() {
        let one = SettleSizes {
            clones: 1,
            ..sizes()
        };
        let (states, violation) = run(one, Protocol::DeadlineOnly);
        let (why, path) =
            violation.expect("a late first sending inside its deadline applies again");
        println!(
            "deadline only: {why}\n after {states} states, {} steps",
            path.len() - 1
        );
        assert!(why.contains("applied 2 times"), "{why}");
    }

    #[test]
    fn without_the_servers_dedupe_a_duplicated_sending_can_apply_twice() {
        // The protocol relies on the server running one command once (retryable writes): a
        // copy the network made arrives inside its window after its key left the ring.
        let sizes = SettleSizes {
            clones: 1,
            server_dedupe: false,
            ..sizes()
        };
        let (states, violation) = run(sizes, Protocol::Fixed);
        let (why, _) = violation.expect("a copy run twice applies twice");
        println!("without the server's dedupe: {why} after {states} states");
        assert!(why.contains("applied 2 times"), "{why}");
    }
}
