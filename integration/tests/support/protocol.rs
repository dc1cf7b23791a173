//! The record protocol as a reference: what every store must answer, written as plain
//! data and a step function per operation. The model checker (`protocol_model.rs`)
//! explores consumers running on it; the property tests (`protocol_stores.rs`) replay
//! random operations on it and on each real store, and any answer that differs fails.
//!
//! Time is in ticks; a record is never old enough to expire (the tests keep the
//! dedupe window far beyond their run), so attempts only ever grow.
//!
//! [`Fences`] can switch off a store's checks one at a time: the mutation check shows
//! that the checker and the property tests notice.
#![allow(dead_code)]

use std::collections::BTreeMap;

/// A model claim token: claims are numbered from 1 in the order they are won.
pub type ModelToken = u32;

/// A record's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    /// Claimed under `token` until `lease_until` (exclusive).
    InProgress { token: ModelToken, lease_until: u32 },
    /// Given back by the claim `by`; the next claim takes it.
    Released { by: ModelToken },
    /// Done by the claim `by`, with the handler's cached result if it had one.
    Done { cached: Option<u8>, by: ModelToken },
    /// Failed for good by the claim `by`.
    Failed { by: ModelToken },
}

/// One key's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Record {
    pub state: State,
    pub attempts: u32,
    pub fingerprint: Option<u8>,
}

/// The answer to a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Answer {
    Won { token: ModelToken, attempt: u32 },
    Done,
    Cached(u8),
    Mismatch,
    InProgress,
    Failed { attempts: u32 },
}

/// The answer to a token-checked transition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    Applied,
    LeaseLost,
    /// Applied before by the same call: nothing changes, and either answer is right.
    Either,
}

/// The checks a store makes, each of which can be switched off to show that breaking
/// it is caught.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fences {
    /// A claim on a record in progress under a live lease is refused.
    pub claim_checks_lease: bool,
    /// complete, release, fail and renew apply only under the record's own token.
    pub transitions_check_token: bool,
    /// A claim takes over a record whose lease lapsed (off: a dead consumer's claim
    /// holds its key for ever, which only liveness can notice).
    pub lapsed_claims_taken_over: bool,
}

impl Fences {
    pub const ALL: Fences = Fences {
        claim_checks_lease: true,
        transitions_check_token: true,
        lapsed_claims_taken_over: true,
    };
}

/// The reference store: records by key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RefStore<K: Ord> {
    pub records: BTreeMap<K, Record>,
    pub tokens_issued: ModelToken,
    pub fences: Fences,
}

impl<K: Ord + Clone> RefStore<K> {
    pub fn new(fences: Fences) -> RefStore<K> {
        RefStore { records: BTreeMap::new(), tokens_issued: 0, fences }
    }

    /// `Store::claim` at `now`, for a lease of `lease` ticks.
    pub fn claim(&mut self, key: &K, now: u32, lease: u32, fingerprint: Option<u8>) -> Answer {
        let token = self.tokens_issued + 1;
        let lease_until = now + lease;
        let Some(record) = self.records.get_mut(key) else {
            self.tokens_issued = token;
            let state = State::InProgress { token, lease_until };
            self.records.insert(key.clone(), Record { state, attempts: 1, fingerprint });
            return Answer::Won { token, attempt: 1 };
        };
        if let (Some(held), Some(given)) = (record.fingerprint, fingerprint)
            && held != given
        {
            return Answer::Mismatch;
        }
        match record.state {
            State::Done { cached: None, .. } => Answer::Done,
            State::Done { cached: Some(result), .. } => Answer::Cached(result),
            State::Failed { .. } => Answer::Failed { attempts: record.attempts },
            State::InProgress { lease_until, .. }
                if lease_until > now && self.fences.claim_checks_lease
                    || !self.fences.lapsed_claims_taken_over =>
            {
                Answer::InProgress
            }
            State::InProgress { .. } | State::Released { .. } => {
                self.tokens_issued = token;
                record.attempts += 1;
                record.state = State::InProgress { token, lease_until: now + lease };
                record.fingerprint = record.fingerprint.or(fingerprint);
                Answer::Won { token, attempt: record.attempts }
            }
        }
    }

    /// Whether `token` may change `key`'s record (its own claim, or no fence).
    pub fn holds(&self, key: &K, token: ModelToken) -> bool {
        match self.records.get(key) {
            Some(Record { state: State::InProgress { token: held, .. }, .. }) => {
                *held == token || !self.fences.transitions_check_token
            }
            // Without the fence, a transition lands on whatever record is there.
            Some(_) => !self.fences.transitions_check_token,
            None => false,
        }
    }

    fn transition(&mut self, key: &K, token: ModelToken, to: State) -> bool {
        if !self.holds(key, token) {
            return false;
        }
        self.records.get_mut(key).expect("held").state = to;
        true
    }

    /// `Store::complete`.
    pub fn complete(&mut self, key: &K, token: ModelToken, cached: Option<u8>) -> Verdict {
        self.finish(key, token, State::Done { cached, by: token })
    }

    /// `Store::release`.
    pub fn release(&mut self, key: &K, token: ModelToken) -> Verdict {
        self.finish(key, token, State::Released { by: token })
    }

    /// `Store::fail`.
    pub fn fail(&mut self, key: &K, token: ModelToken) -> Verdict {
        self.finish(key, token, State::Failed { by: token })
    }

    /// Completes, fails or releases. The same call again, once it applied, changes
    /// nothing and may answer either way: a store may recognise its own resend (Redis
    /// keeps the token for this) or not.
    fn finish(&mut self, key: &K, token: ModelToken, to: State) -> Verdict {
        let again = match (self.state(key), to) {
            (Some(State::Done { by, .. }), State::Done { .. })
            | (Some(State::Failed { by }), State::Failed { .. })
            | (Some(State::Released { by }), State::Released { .. }) => by == token,
            _ => false,
        };
        if again && self.fences.transitions_check_token {
            Verdict::Either
        } else if self.transition(key, token, to) {
            Verdict::Applied
        } else {
            Verdict::LeaseLost
        }
    }

    /// `Store::renew` at `now`; true when applied. A lapsed lease that nobody took
    /// over is renewed: the claim is still the record's.
    pub fn renew(&mut self, key: &K, token: ModelToken, now: u32, lease: u32) -> bool {
        let lease_until = now + lease;
        self.transition(key, token, State::InProgress { token, lease_until })
    }

    /// The state of `key`'s record, if any.
    pub fn state(&self, key: &K) -> Option<State> {
        self.records.get(key).map(|r| r.state)
    }

    /// `key`'s attempt count (0 without a record).
    pub fn attempts(&self, key: &K) -> u32 {
        self.records.get(key).map_or(0, |r| r.attempts)
    }
}
