//! Effects counted per message by a handler that is not idempotent itself, as the
//! graceful-stop tests of every consumer count them: a message run twice shows up as
//! a count of 2, and a call cut off halfway as one begun but never ended.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

#[derive(Default)]
pub struct Effects {
    counts: Mutex<HashMap<String, u32>>,
    calls: Mutex<(u32, u32)>,
}

impl Effects {
    /// One call's effect on `message`: begun, `pause`, counted, ended.
    pub async fn take(&self, message: String, pause: Duration) {
        self.calls.lock().unwrap().0 += 1;
        tokio::time::sleep(pause).await;
        *self.counts.lock().unwrap().entry(message).or_default() += 1;
        self.calls.lock().unwrap().1 += 1;
    }

    /// Resolves once `n` calls have ended: a shutdown signal mid-stream.
    pub async fn ended(&self, n: u32) {
        while self.calls.lock().unwrap().1 < n {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Resolves once `n` messages have had their effect, and `settle` more has passed
    /// (time for a redelivery to show up twice).
    pub async fn all(&self, n: usize, settle: Duration) {
        while self.counts.lock().unwrap().len() < n {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(settle).await;
    }

    /// The calls that ended so far, after checking that every call begun ended.
    pub fn every_call_finished(&self) -> u32 {
        let (begun, ended) = *self.calls.lock().unwrap();
        assert_eq!(begun, ended, "calls were cut off halfway");
        ended
    }

    pub fn messages(&self) -> usize {
        self.counts.lock().unwrap().len()
    }

    /// The messages whose effect happened more than once.
    pub fn doubled(&self) -> Vec<String> {
        let counts = self.counts.lock().unwrap();
        counts.iter().filter(|(_, n)| **n > 1).map(|(m, _)| m.clone()).collect()
    }
}
