//! The record protocol, model-checked: consumers running the steps `execute::run`
//! takes (claim; run the handler, renewing the lease; then complete, release or fail)
//! against the reference store of `support/protocol.rs`, with every interleaving of
//! their steps, the clock, and faults: a consumer killed at any step, a store answer
//! lost after the store applied it, a DONE write that fails, a consumer paused past
//! its lease. The checker ([stateright](https://docs.rs/stateright)) visits every
//! reachable state and checks these properties in each:
//!
//! * at most one consumer holds an unexpired claim on a key;
//! * no transition under a stale token changes a record;
//! * a key becomes DONE at most once;
//! * attempt counts never decrease, and a handler starts at most `max_attempts` times;
//! * with the store outside the effect, an effect happens more than once only after a
//!   fault that allows it (a kill between the effect and the DONE write, a DONE write
//!   that failed, a claim taken over from a consumer still working under it, paused
//!   past its lease), one extra effect per such fault; in transactional mode an
//!   effect is committed exactly when the record is DONE, so never twice;
//! * every message ends acked, its record DONE or FAILED (or dead-lettered when its
//!   FAILED write failed: a call counts a store error there as recorded), once the
//!   faults stop
//!   (liveness: checked on every path to a state where nothing more can happen, or
//!   to the clock's bound, a lease and a retry per attempt and fault past the free
//!   ticks;
//!   every step moves the clock, spends a fault or moves a record on, so the model
//!   has no cycles, and redeliveries wait for the `retry_after` a consumer gives, as
//!   the consumer loops do).
//!
//! Left out: record expiry (the dedupe window outlasts every run), fingerprints and
//! cached results (the property tests cover them), a store error on a claim or a
//! renewal (the call then retries or stops), a claim taken inside the handler's
//! transaction (`TransactionalClaim::InTransaction`), and a call dropped mid-way
//! (that is a kill, as far as the record goes).
//!
//! Each "sometimes" property shows that a run reaches the situations the others
//! guard (a takeover, a doubled effect under faults, a poison message failed), so
//! the checks cannot pass by never getting there. The mutation tests switch one
//! fence of the reference store off and expect the checker to find a violation.

#[path = "support/protocol.rs"]
mod protocol;

use protocol::{Answer, Fences, ModelToken, RefStore, State, Verdict};
use stateright::{Checker, HasDiscoveries, Model, Property};

/// A lease, in ticks.
const LEASE: u32 = 2;

/// What a handler's body returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Body {
    Ok,
    Retryable,
    Terminal,
}

/// Where one consumer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Phase {
    Idle,
    /// The claim was won; the body runs (and renews the lease).
    Running {
        msg: u8,
        token: ModelToken,
        attempt: u32,
        lease_until: u32,
    },
    /// The body returned `Ok`; with the store outside the effect, the effect is done.
    /// The DONE write (or, transactional, the commit) is next.
    Finishing {
        msg: u8,
        token: ModelToken,
        lease_until: u32,
    },
    /// The body failed retryably: the release is next.
    Releasing {
        msg: u8,
        token: ModelToken,
    },
    /// The body failed for good, or the attempts ran out: the FAILED write is next.
    Failing {
        msg: u8,
        token: ModelToken,
    },
}

/// One step of the system.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Action {
    /// A delivery of `msg` to consumer `c`, which claims its key; `lost` when the
    /// claim is applied but its answer never arrives.
    Deliver {
        c: u8,
        msg: u8,
        lost: bool,
    },
    /// The body returns.
    Return {
        c: u8,
        body: Body,
    },
    /// A lease renewal from the running body.
    Renew {
        c: u8,
    },
    /// The DONE write (transactional: the commit of effect and DONE). `fault`: its
    /// answer is lost after it applied, or it fails without applying.
    Finish {
        c: u8,
        fault: Option<StoreFault>,
    },
    Release {
        c: u8,
    },
    /// The FAILED write. `fault`: its answer is lost after it applied, or it fails
    /// without applying; either way the call ends terminal and the message is
    /// dead-lettered (a record left in progress lapses).
    Fail {
        c: u8,
        fault: Option<StoreFault>,
    },
    /// The consumer dies (kill -9); the broker redelivers what it held.
    Crash {
        c: u8,
    },
    /// The clock advances one tick.
    Tick,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum StoreFault {
    AnswerLost,
    NotApplied,
}

/// Everything that changes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct World {
    now: u32,
    store: RefStore<u8>,
    consumers: Vec<Phase>,
    acked: Vec<bool>,
    /// A message is not redelivered before this tick (a consumer's `retry_after`).
    not_before: Vec<u32>,
    /// Effects applied, by message.
    effects: Vec<u8>,
    /// Faults that allow one more effect, by message.
    allowances: Vec<u8>,
    /// Handler starts, by message.
    starts: Vec<u8>,
    /// Writes that made the record DONE, by message.
    done_writes: Vec<u8>,
    crashes_left: u8,
    store_faults_left: u8,
    /// Set when a transition applied to a record that its token did not hold.
    stale_applied: bool,
    /// Set when a record's attempt count went down.
    attempts_fell: bool,
    /// Set when a claim took a key over from a lapsed lease.
    took_over: bool,
    /// Set when a transition under a stale token was refused.
    stale_refused: bool,
    /// Set when a claim past `max_attempts` gave the message up.
    abandoned: bool,
    /// Dead-lettered while its FAILED write failed, by message.
    dead_lettered_unrecorded: Vec<bool>,
}

/// The system: consumers, messages (one key each) and the fault budget.
#[derive(Clone, Debug)]
struct Protocol {
    consumers: u8,
    messages: u8,
    max_attempts: u32,
    /// What a body may return.
    bodies: &'static [Body],
    transactional: bool,
    crashes: u8,
    store_faults: u8,
    /// Free ticks; past it, the clock advances only when nothing else can happen.
    horizon: u32,
    fences: Fences,
}

impl Protocol {
    fn new(consumers: u8, messages: u8) -> Protocol {
        Protocol {
            consumers,
            messages,
            max_attempts: 2,
            bodies: &[Body::Ok, Body::Retryable, Body::Terminal],
            transactional: false,
            crashes: 1,
            store_faults: 1,
            horizon: 4,
            fences: Fences::ALL,
        }
    }

    /// The actions other than ticks.
    fn steps(&self, w: &World, out: &mut Vec<Action>) {
        for (c, phase) in w.consumers.iter().enumerate() {
            let c = c as u8;
            match *phase {
                Phase::Idle => {
                    for msg in 0..self.messages {
                        let m = msg as usize;
                        if !w.acked[m] && w.now >= w.not_before[m] {
                            out.push(Action::Deliver { c, msg, lost: false });
                            if w.store_faults_left > 0 {
                                out.push(Action::Deliver { c, msg, lost: true });
                            }
                        }
                    }
                }
                Phase::Running { lease_until, .. } => {
                    for &body in self.bodies {
                        out.push(Action::Return { c, body });
                    }
                    if lease_until < w.now + LEASE {
                        out.push(Action::Renew { c });
                    }
                }
                Phase::Finishing { .. } => {
                    out.push(Action::Finish { c, fault: None });
                    if w.store_faults_left > 0 {
                        out.push(Action::Finish { c, fault: Some(StoreFault::AnswerLost) });
                        out.push(Action::Finish { c, fault: Some(StoreFault::NotApplied) });
                    }
                }
                Phase::Releasing { .. } => out.push(Action::Release { c }),
                Phase::Failing { .. } => {
                    out.push(Action::Fail { c, fault: None });
                    if w.store_faults_left > 0 {
                        out.push(Action::Fail { c, fault: Some(StoreFault::AnswerLost) });
                        out.push(Action::Fail { c, fault: Some(StoreFault::NotApplied) });
                    }
                }
            }
            if *phase != Phase::Idle && w.crashes_left > 0 {
                out.push(Action::Crash { c });
            }
        }
    }

    /// A token-checked transition by `token` on `msg`'s record, noting a stale one.
    fn fenced(
        w: &mut World,
        msg: u8,
        token: ModelToken,
        apply: impl FnOnce(&mut RefStore<u8>) -> bool,
    ) -> bool {
        let own =
            matches!(w.store.state(&msg), Some(State::InProgress { token: t, .. }) if t == token);
        let applied = apply(&mut w.store);
        w.stale_applied |= applied && !own;
        w.stale_refused |= !applied && !own;
        applied
    }

    fn ack(w: &mut World, msg: u8) {
        w.acked[msg as usize] = true;
    }
}

impl Model for Protocol {
    type State = World;
    type Action = Action;

    fn init_states(&self) -> Vec<World> {
        let m = self.messages as usize;
        vec![World {
            now: 0,
            store: RefStore::new(self.fences),
            consumers: vec![Phase::Idle; self.consumers as usize],
            acked: vec![false; m],
            not_before: vec![0; m],
            effects: vec![0; m],
            allowances: vec![0; m],
            starts: vec![0; m],
            done_writes: vec![0; m],
            crashes_left: self.crashes,
            store_faults_left: self.store_faults,
            stale_applied: false,
            attempts_fell: false,
            took_over: false,
            stale_refused: false,
            abandoned: false,
            dead_lettered_unrecorded: vec![false; m],
        }]
    }

    fn actions(&self, w: &World, out: &mut Vec<Action>) {
        self.steps(w, out);
        if w.now < self.horizon || out.is_empty() && w.acked.iter().any(|a| !a) {
            out.push(Action::Tick);
        }
    }

    fn next_state(&self, last: &World, action: Action) -> Option<World> {
        let mut w = last.clone();
        let attempts_before: Vec<u32> = (0..self.messages).map(|m| w.store.attempts(&m)).collect();
        match action {
            Action::Deliver { c, msg, lost } => {
                let lapsed = matches!(
                    w.store.state(&msg),
                    Some(State::InProgress { lease_until, .. }) if lease_until <= w.now
                );
                let answer = w.store.claim(&msg, w.now, LEASE, None);
                if lost {
                    w.store_faults_left -= 1;
                    // Nacked; redelivered after a backoff.
                    return Some(w);
                }
                let m = msg as usize;
                w.consumers[c as usize] = match answer {
                    Answer::Won { token, attempt } => {
                        w.took_over |= lapsed;
                        if lapsed && !self.transactional {
                            // Each consumer still working on the key under the lapsed
                            // claim (paused past its lease) may yet apply its effect.
                            for phase in &w.consumers {
                                if let Phase::Running { msg: m2, .. }
                                | Phase::Finishing { msg: m2, .. } = *phase
                                {
                                    w.allowances[m] += u8::from(m2 == msg);
                                }
                            }
                        }
                        if attempt > self.max_attempts {
                            w.abandoned = true;
                            Phase::Failing { msg, token }
                        } else {
                            w.starts[m] += 1;
                            Phase::Running { msg, token, attempt, lease_until: w.now + LEASE }
                        }
                    }
                    Answer::Done | Answer::Cached(_) | Answer::Failed { .. } => {
                        Self::ack(&mut w, msg);
                        Phase::Idle
                    }
                    Answer::InProgress => {
                        // Redelivered after the `retry_after` the consumer gives: the
                        // lease's end, and never at once.
                        let lease_until = match w.store.state(&msg) {
                            Some(State::InProgress { lease_until, .. }) => lease_until,
                            _ => 0,
                        };
                        w.not_before[m] = lease_until.max(w.now + 1);
                        Phase::Idle
                    }
                    Answer::Mismatch => unreachable!("no fingerprints here"),
                };
            }
            Action::Return { c, body } => {
                let Phase::Running { msg, token, attempt, lease_until } = w.consumers[c as usize]
                else {
                    unreachable!()
                };
                w.consumers[c as usize] = match body {
                    Body::Ok => {
                        if !self.transactional {
                            w.effects[msg as usize] += 1;
                        }
                        Phase::Finishing { msg, token, lease_until }
                    }
                    Body::Retryable if attempt < self.max_attempts => {
                        Phase::Releasing { msg, token }
                    }
                    Body::Retryable | Body::Terminal => Phase::Failing { msg, token },
                };
            }
            Action::Renew { c } => {
                let Phase::Running { msg, token, attempt, .. } = w.consumers[c as usize] else {
                    unreachable!()
                };
                let now = w.now;
                let renewed =
                    Self::fenced(&mut w, msg, token, |s| s.renew(&msg, token, now, LEASE));
                w.consumers[c as usize] = if renewed {
                    Phase::Running { msg, token, attempt, lease_until: now + LEASE }
                } else {
                    // The lease is lost: the body is stopped, the message nacked.
                    Phase::Idle
                };
            }
            Action::Finish { c, fault } => {
                let Phase::Finishing { msg, token, .. } = w.consumers[c as usize] else {
                    unreachable!()
                };
                let m = msg as usize;
                w.consumers[c as usize] = Phase::Idle;
                if fault.is_some() {
                    w.store_faults_left -= 1;
                }
                if fault == Some(StoreFault::NotApplied) {
                    if self.transactional {
                        // Rolled back, effect and all; the key is released.
                        w.consumers[c as usize] = Phase::Releasing { msg, token };
                    } else {
                        // The effect stays; the redelivery will run it again.
                        w.allowances[m] += 1;
                    }
                    return Some(w);
                }
                let done = Self::fenced(&mut w, msg, token, |s| {
                    s.complete(&msg, token, None) == Verdict::Applied
                });
                if done {
                    w.done_writes[m] += 1;
                    if self.transactional {
                        w.effects[m] += 1;
                    }
                }
                if done && fault.is_none() {
                    Self::ack(&mut w, msg);
                }
            }
            Action::Release { c } => {
                let Phase::Releasing { msg, token } = w.consumers[c as usize] else {
                    unreachable!()
                };
                Self::fenced(&mut w, msg, token, |s| s.release(&msg, token) == Verdict::Applied);
                w.consumers[c as usize] = Phase::Idle;
            }
            Action::Fail { c, fault } => {
                let Phase::Failing { msg, token } = w.consumers[c as usize] else { unreachable!() };
                w.consumers[c as usize] = Phase::Idle;
                if fault.is_some() {
                    w.store_faults_left -= 1;
                }
                let failed = fault != Some(StoreFault::NotApplied)
                    && Self::fenced(&mut w, msg, token, |s| {
                        s.fail(&msg, token) == Verdict::Applied
                    });
                if failed || fault.is_some() {
                    // Dead-lettered: a store error counts as recorded, whatever the
                    // store did (a record not FAILED lapses, or another claim has it).
                    Self::ack(&mut w, msg);
                    w.dead_lettered_unrecorded[msg as usize] |= !failed;
                }
                // Refused: the claim was lost, and the message goes back.
            }
            Action::Crash { c } => {
                if let Phase::Finishing { msg, .. } = w.consumers[c as usize]
                    && !self.transactional
                {
                    // Killed between the effect and the DONE write.
                    w.allowances[msg as usize] += 1;
                }
                w.crashes_left -= 1;
                w.consumers[c as usize] = Phase::Idle;
            }
            Action::Tick => w.now += 1,
        }
        for (m, before) in attempts_before.into_iter().enumerate() {
            w.attempts_fell |= w.store.attempts(&(m as u8)) < before;
        }
        Some(w)
    }

    /// Past the free ticks, a lease and a retry for each attempt and fault are enough
    /// for every message to end: a path that gets here has one stuck, which liveness
    /// reports.
    fn within_boundary(&self, w: &World) -> bool {
        let rounds = self.max_attempts + u32::from(self.crashes + self.store_faults) + 2;
        w.now <= self.horizon + (LEASE + 1) * rounds
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "at most one unexpired claim per key",
                |model: &Protocol, w: &World| {
                    (0..model.messages).all(|msg| {
                        let live = w.consumers.iter().filter(|&&p| match p {
                            Phase::Running { msg: m, lease_until, .. }
                            | Phase::Finishing { msg: m, lease_until, .. } => {
                                m == msg && lease_until > w.now
                            }
                            _ => false,
                        });
                        live.count() <= 1
                    })
                },
            ),
            Property::always("no stale token changes a record", |_: &Protocol, w: &World| {
                !w.stale_applied
            }),
            Property::always("DONE at most once", |_: &Protocol, w: &World| {
                w.done_writes.iter().all(|&n| n <= 1)
            }),
            Property::always("attempts never decrease", |_: &Protocol, w: &World| !w.attempts_fell),
            Property::always("at most max_attempts starts", |model: &Protocol, w: &World| {
                w.starts.iter().all(|&n| u32::from(n) <= model.max_attempts)
            }),
            Property::always(
                "an extra effect only after a fault that allows it",
                |_: &Protocol, w: &World| {
                    w.effects.iter().zip(&w.allowances).all(|(&e, &a)| e <= 1 + a)
                },
            ),
            Property::always(
                "transactional: effect committed exactly when DONE",
                |model: &Protocol, w: &World| {
                    !model.transactional
                        || (0..model.messages).all(|msg| {
                            let done = matches!(w.store.state(&msg), Some(State::Done { .. }));
                            w.effects[msg as usize] == u8::from(done)
                        })
                },
            ),
            Property::eventually(
                "every message ends acked, DONE or FAILED",
                |model: &Protocol, w: &World| {
                    (0..model.messages).all(|msg| {
                        let m = msg as usize;
                        let recorded = matches!(
                            w.store.state(&msg),
                            Some(State::Done { .. } | State::Failed { .. })
                        );
                        w.acked[m] && (recorded || w.dead_lettered_unrecorded[m])
                    })
                },
            ),
            Property::sometimes("a lapsed claim is taken over", |_: &Protocol, w: &World| {
                w.took_over
            }),
            Property::sometimes("a message ends FAILED", |model: &Protocol, w: &World| {
                (0..model.messages)
                    .any(|msg| matches!(w.store.state(&msg), Some(State::Failed { .. })))
            }),
            Property::sometimes("an effect happens twice", |_: &Protocol, w: &World| {
                w.effects.iter().any(|&e| e > 1)
            }),
            Property::sometimes("a stale transition is refused", |_: &Protocol, w: &World| {
                w.stale_refused
            }),
            Property::sometimes(
                "a claim past max_attempts is abandoned",
                |_: &Protocol, w: &World| w.abandoned,
            ),
        ]
    }
}

/// Checks every reachable state, and returns the checker for further looks.
fn check(model: Protocol) -> impl Checker<Protocol> {
    explore(model, HasDiscoveries::All)
}

/// Explores until `finish` (or every reachable state).
fn explore(model: Protocol, finish: HasDiscoveries) -> impl Checker<Protocol> {
    let checker = model.checker().threads(2).finish_when(finish).spawn_bfs().join();
    eprintln!(
        "{} states ({} unique), max depth {}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth()
    );
    checker
}

const SAFETY_AND_LIVENESS: [&str; 8] = [
    "at most one unexpired claim per key",
    "no stale token changes a record",
    "DONE at most once",
    "attempts never decrease",
    "at most max_attempts starts",
    "an extra effect only after a fault that allows it",
    "transactional: effect committed exactly when DONE",
    "every message ends acked, DONE or FAILED",
];

fn assert_holds(checker: &impl Checker<Protocol>) {
    for property in SAFETY_AND_LIVENESS {
        checker.assert_no_discovery(property);
    }
}

#[test]
fn two_consumers_one_key() {
    let checker = check(Protocol::new(2, 1));
    assert_holds(&checker);
    checker.assert_any_discovery("a lapsed claim is taken over");
    checker.assert_any_discovery("a message ends FAILED");
    checker.assert_any_discovery("an effect happens twice");
    checker.assert_any_discovery("a stale transition is refused");
    checker.assert_any_discovery("a claim past max_attempts is abandoned");
}

#[test]
fn three_consumers_one_key() {
    let checker = check(Protocol { crashes: 1, store_faults: 0, ..Protocol::new(3, 1) });
    assert_holds(&checker);
    checker.assert_any_discovery("a lapsed claim is taken over");
}

#[test]
fn two_consumers_two_keys() {
    // Keys do not meet in the protocol: fewer behaviours, so that the product of two
    // keys' states stays small enough to check in seconds.
    let model =
        Protocol { bodies: &[Body::Ok], store_faults: 0, horizon: 3, ..Protocol::new(2, 2) };
    let checker = check(model);
    assert_holds(&checker);
    checker.assert_any_discovery("a lapsed claim is taken over");
}

#[test]
fn transactional_never_doubles() {
    let checker = check(Protocol { transactional: true, ..Protocol::new(2, 1) });
    assert_holds(&checker);
    checker.assert_any_discovery("a lapsed claim is taken over");
    // The same faults that double a plain handler's effect.
    checker.assert_no_discovery("an effect happens twice");
}

#[test]
fn poison_message_ends_failed_within_max_attempts() {
    let model =
        Protocol { max_attempts: 3, bodies: &[Body::Retryable], crashes: 2, ..Protocol::new(2, 1) };
    let checker = check(model);
    assert_holds(&checker);
    checker.assert_any_discovery("a message ends FAILED");
    checker.assert_any_discovery("a claim past max_attempts is abandoned");
}

#[test]
fn a_claim_that_ignores_a_live_lease_is_caught() {
    let fences = Fences { claim_checks_lease: false, ..Fences::ALL };
    let expected = [
        "at most one unexpired claim per key",
        "an extra effect only after a fault that allows it",
    ];
    let finish = HasDiscoveries::AllOf(expected.into_iter().collect());
    let checker = explore(Protocol { fences, ..Protocol::new(2, 1) }, finish);
    let path = checker.assert_any_discovery("at most one unexpired claim per key");
    eprintln!("{:?}", path.into_actions());
    checker.assert_any_discovery("an extra effect only after a fault that allows it");
}

#[test]
fn a_transition_without_its_token_check_is_caught() {
    let fences = Fences { transitions_check_token: false, ..Fences::ALL };
    for transactional in [false, true] {
        let expected = ["no stale token changes a record", "DONE at most once"];
        let finish = HasDiscoveries::AllOf(expected.into_iter().collect());
        let checker = explore(Protocol { fences, transactional, ..Protocol::new(2, 1) }, finish);
        checker.assert_any_discovery("no stale token changes a record");
        let path = checker.assert_any_discovery("DONE at most once");
        eprintln!("{:?}", path.into_actions());
    }
}

#[test]
fn a_claim_that_never_takes_over_a_lapsed_lease_is_caught() {
    // Safe, but a consumer killed mid-handler leaves its message unfinished for ever.
    let fences = Fences { lapsed_claims_taken_over: false, ..Fences::ALL };
    let property = "every message ends acked, DONE or FAILED";
    let finish = HasDiscoveries::AllOf([property].into_iter().collect());
    let checker = explore(Protocol { fences, ..Protocol::new(2, 1) }, finish);
    let path = checker.assert_any_discovery(property);
    eprintln!("{:?}", path.into_actions());
}
