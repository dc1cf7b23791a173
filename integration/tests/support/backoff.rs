//! The retry-with-backoff check each broker's consumer passes. One message, `flaky`,
//! fails retryably four times and succeeds on its fifth attempt, under
//! `backoff = "200ms..2s"`: the waits after attempts 1 to 4 must be at least half of
//! 200, 400, 800 and 1600 ms and at most those plus the broker's redelivery slack.
//! Meanwhile `steady` messages, published one every 100 ms, must each be handled
//! soon after they are published: the delayed message holds nothing else up.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::{Classify, MemoryStore, idempotent};

/// The waits' ceilings after attempts 1 to 4 under `backoff = "200ms..2s"`.
pub const CEILINGS_MS: [u64; 4] = [200, 400, 800, 1600];

/// How many steady messages are published, one every [`STEADY_EVERY`].
pub const STEADY: usize = 30;
pub const STEADY_EVERY: Duration = Duration::from_millis(100);

/// A message: its id is the broker message's body.
pub struct Job {
    pub id: String,
}

impl Job {
    pub fn of(body: &[u8]) -> Job {
        Job { id: String::from_utf8_lossy(body).into_owned() }
    }
}

#[derive(Debug, thiserror::Error, Classify)]
pub enum Flaky {
    #[error("the dependency is down")]
    #[idempotent(retryable)]
    Down,
}

/// What the handler saw, and when.
#[derive(Clone, Default)]
pub struct Log {
    store: Arc<MemoryStore>,
    inner: Arc<Mutex<Seen>>,
}

#[derive(Default)]
struct Seen {
    /// When each attempt of `flaky` started.
    flaky: Vec<Instant>,
    published: HashMap<String, Instant>,
    /// When each steady message was handled (first time).
    handled: HashMap<String, Instant>,
}

/// Fails `flaky` on its first four attempts; handles the rest at once.
#[idempotent(key = "{job.id}", namespace = "backoff", store = log.store,
             backoff = "200ms..2s", max_attempts = 5)]
pub async fn attempt(job: Job, log: &Log) -> Result<(), Flaky> {
    let mut seen = log.inner.lock().unwrap();
    if job.id == "flaky" {
        seen.flaky.push(Instant::now());
        if seen.flaky.len() < 5 {
            return Err(Flaky::Down);
        }
    } else {
        seen.handled.entry(job.id).or_insert_with(Instant::now);
    }
    Ok(())
}

impl Log {
    /// Publishes `flaky`, then the steady messages one every [`STEADY_EVERY`], with
    /// `publish`, recording when each was sent.
    pub async fn publish_all<F, Fut>(&self, mut publish: F)
    where
        F: FnMut(String) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        publish("flaky".to_owned()).await;
        for i in 0..STEADY {
            let id = format!("steady-{i}");
            self.inner.lock().unwrap().published.insert(id.clone(), Instant::now());
            publish(id).await;
            tokio::time::sleep(STEADY_EVERY).await;
        }
    }

    /// Whether `flaky` succeeded and every steady message was handled.
    pub fn finished(&self) -> bool {
        let seen = self.inner.lock().unwrap();
        seen.flaky.len() >= 5 && seen.handled.len() >= STEADY
    }

    /// Waits for [`finished`](Log::finished), at most `limit`.
    pub async fn wait(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while !self.finished() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Checks the retries' spacing against the policy, allowing `slack` for the
    /// broker to redeliver once the delay is over, and that no steady message waited
    /// longer than `latency` to be handled.
    pub fn check(&self, slack: Duration, latency: Duration) {
        let seen = self.inner.lock().unwrap();
        assert_eq!(seen.flaky.len(), 5, "the fifth attempt succeeds and is the last");
        let waits: Vec<Duration> = seen.flaky.windows(2).map(|w| w[1] - w[0]).collect();
        for (wait, ceiling) in waits.iter().zip(CEILINGS_MS) {
            let ceiling = Duration::from_millis(ceiling);
            assert!(
                *wait + Duration::from_millis(5) >= ceiling / 2 && *wait <= ceiling + slack,
                "waits {waits:?} do not follow the ceilings {CEILINGS_MS:?} ms (±jitter, slack {slack:?})"
            );
        }
        assert_eq!(seen.handled.len(), STEADY, "every steady message was handled");
        let slowest = (seen.handled.iter())
            .map(|(id, at)| at.duration_since(seen.published[id]))
            .max()
            .unwrap();
        assert!(
            slowest <= latency,
            "a steady message waited {slowest:?} while the flaky one was delayed"
        );
        let retrying = *seen.flaky.last().unwrap() - seen.flaky[0];
        eprintln!("retry waits {waits:?} over {retrying:?}; slowest steady message {slowest:?}");
    }
}
