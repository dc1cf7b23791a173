//! What calls and consumers count, through the [`metrics`](https://docs.rs/metrics)
//! facade (feature `metrics`), so that any exporter the application installs
//! (Prometheus, OpenTelemetry, StatsD) receives them. Without the feature nothing is
//! measured and nothing is paid.
//!
//! | Name | Kind | Labels | What |
//! |---|---|---|---|
//! | [`idempotent_calls_total`](CALLS_TOTAL) | counter | `namespace`, `outcome` | calls of `#[idempotent]` handlers, by how they ended |
//! | [`idempotent_claim_seconds`](CLAIM_SECONDS) | histogram | `namespace` | how long the claim took (for a transactional handler, with its transaction's start) |
//! | [`idempotent_handler_seconds`](HANDLER_SECONDS) | histogram | `namespace` | how long the handler body ran, for calls that ran it |
//! | [`idempotent_store_errors_total`](STORE_ERRORS_TOTAL) | counter | `namespace`, `operation` | store operations that failed, retries included |
//! | [`idempotent_consumer_in_flight`](CONSUMER_IN_FLIGHT) | gauge | `broker`, `source` | deliveries a consumer has taken and not yet settled |
//! | [`idempotent_consumer_settled_total`](CONSUMER_SETTLED_TOTAL) | counter | `broker`, `source`, `disposition` | deliveries settled, by disposition |
//!
//! * `outcome` is [`Outcome::label`](crate::Outcome::label) or
//!   [`Error::label`](crate::Error::label) (`processed`, `duplicate`, `in_progress`,
//!   `retryable_error`, `terminal_error`, `store_error`, ...), or `cancelled` for a call
//!   dropped before it ended. A call whose key could not be built has no namespace: it
//!   counts as `key_error` under `namespace=""`.
//! * `operation` is `claim`, `begin` (the transactional modes' transaction),
//!   `renew`, `complete`, `release` or `fail`.
//! * `broker` is `redis_streams`, `rabbitmq`, `nats`, `kafka` or `rocketmq`; `source`
//!   is the stream, queue, consumer or topic(s) the consumer reads; `disposition` is
//!   `ack`, `retry` or `dead_letter`.
//!
//! A call's handles are registered once per thread, namespace and recorder and then
//! reused, so a call costs a few atomic operations and two clock reads. Handles follow
//! the recorder in force where the call runs (the global one, or a thread's local one),
//! told apart by its address: install the exporter's recorder before the first call,
//! as exporters ask anyway. (A recorder dropped, and another made at the same address
//! on the same thread, as a test helper called twice may do, gets the first one's
//! handles: give such tests a thread each.)
//!
//! A call whose claim did not answer (a runtime without a timer, a call dropped
//! during it) has no claim time. A panic that unwinds out of a call itself (a store
//! implementation's, or a cached result's `Deserialize`), rather than out of the
//! handler body, which is caught, counts as `cancelled`.
//!
//! A sample, as the Prometheus exporter renders it (buckets left out):
//!
//! ```text
//! idempotent_calls_total{namespace="charge",outcome="terminal_error"} 1
//! idempotent_calls_total{namespace="charge",outcome="duplicate"} 2
//! idempotent_calls_total{namespace="charge",outcome="processed"} 2
//! idempotent_handler_seconds_sum{namespace="charge"} 0.000010725
//! idempotent_handler_seconds_count{namespace="charge"} 3
//! idempotent_claim_seconds_sum{namespace="charge"} 0.000166074
//! idempotent_claim_seconds_count{namespace="charge"} 5
//! ```

/// Calls of `#[idempotent]` handlers, by `namespace` and `outcome`.
pub const CALLS_TOTAL: &str = "idempotent_calls_total";
/// Seconds the claim took, by `namespace`.
pub const CLAIM_SECONDS: &str = "idempotent_claim_seconds";
/// Seconds the handler body ran, by `namespace`.
pub const HANDLER_SECONDS: &str = "idempotent_handler_seconds";
/// Failed store operations, by `namespace` and `operation`.
pub const STORE_ERRORS_TOTAL: &str = "idempotent_store_errors_total";
/// Deliveries taken and not yet settled, by `broker` and `source`.
pub const CONSUMER_IN_FLIGHT: &str = "idempotent_consumer_in_flight";
/// Deliveries settled, by `broker`, `source` and `disposition`.
pub const CONSUMER_SETTLED_TOTAL: &str = "idempotent_consumer_settled_total";

#[cfg(feature = "metrics")]
pub(crate) use measured::CallMeter;
#[cfg(all(
    feature = "metrics",
    any(
        feature = "redis-streams",
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka",
        feature = "rocketmq"
    )
))]
pub(crate) use measured::ConsumerMeter;
#[cfg(not(feature = "metrics"))]
pub(crate) use unmeasured::CallMeter;
#[cfg(all(
    not(feature = "metrics"),
    any(
        feature = "redis-streams",
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka",
        feature = "rocketmq"
    )
))]
pub(crate) use unmeasured::ConsumerMeter;

/// The store operation a failure is counted under.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Operation {
    Claim,
    Begin,
    Renew,
    Complete,
    Release,
    Fail,
}

impl Operation {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn label(self) -> &'static str {
        match self {
            Operation::Claim => "claim",
            Operation::Begin => "begin",
            Operation::Renew => "renew",
            Operation::Complete => "complete",
            Operation::Release => "release",
            Operation::Fail => "fail",
        }
    }
}

#[cfg(feature = "metrics")]
mod measured {
    use metrics::{Counter, Gauge, Histogram, Label, Recorder, SharedString, Unit};
    use std::cell::RefCell;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, OnceLock};
    use tokio::time::Instant;

    use super::Operation;
    use crate::{Disposition, Key};

    /// Every `outcome` label a call can end with: one lazily registered counter each.
    const OUTCOMES: [&str; 17] = [
        "processed",
        "processed_not_cached",
        "duplicate",
        "replayed",
        "in_progress",
        "retryable_error",
        "terminal_error",
        "abandoned",
        "previously_failed",
        "panicked",
        "key_error",
        "runtime_error",
        "store_error",
        "lease_lost",
        "payload_mismatch",
        "cache_error",
        "cancelled",
    ];

    /// A namespace's handles, registered with one recorder.
    struct Namespace {
        name: SharedString,
        claim: Histogram,
        handler: Histogram,
        calls: [OnceLock<Counter>; OUTCOMES.len()],
    }

    impl Namespace {
        fn register(name: &str) -> Namespace {
            describe();
            let name = SharedString::from_shared(Arc::from(name));
            let labels = || vec![Label::new("namespace", name.clone())];
            let (claim, handler) = metrics::with_recorder(|recorder| {
                let histogram = |metric| {
                    let key = metrics::Key::from_parts(metric, labels());
                    recorder.register_histogram(&key, &METADATA)
                };
                (histogram(super::CLAIM_SECONDS), histogram(super::HANDLER_SECONDS))
            });
            Namespace { name, claim, handler, calls: Default::default() }
        }

        fn call_ended(&self, outcome: &'static str) {
            let Some(index) = OUTCOMES.iter().position(|known| *known == outcome) else {
                return;
            };
            let counter = self.calls[index].get_or_init(|| {
                let labels = vec![
                    Label::new("namespace", self.name.clone()),
                    Label::from_static_parts("outcome", OUTCOMES[index]),
                ];
                let key = metrics::Key::from_parts(super::CALLS_TOTAL, labels);
                metrics::with_recorder(|recorder| recorder.register_counter(&key, &METADATA))
            });
            counter.increment(1);
        }
    }

    static METADATA: metrics::Metadata<'static> =
        metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

    /// Describes the metrics to the recorder in force (once per thread and recorder,
    /// with the namespace handles).
    fn describe() {
        metrics::describe_counter!(
            super::CALLS_TOTAL,
            "Calls of #[idempotent] handlers, by namespace and outcome"
        );
        metrics::describe_histogram!(
            super::CLAIM_SECONDS,
            Unit::Seconds,
            "How long claiming the key took"
        );
        metrics::describe_histogram!(
            super::HANDLER_SECONDS,
            Unit::Seconds,
            "How long the handler body ran"
        );
        metrics::describe_counter!(
            super::STORE_ERRORS_TOTAL,
            "Store operations that failed, by namespace and operation"
        );
    }

    /// The recorder in force here, as an address: handles registered with another one
    /// are not reused.
    fn recorder_in_force() -> usize {
        metrics::with_recorder(|recorder: &dyn Recorder| {
            std::ptr::from_ref(recorder).cast::<()>() as usize
        })
    }

    /// Per thread: the recorder the handles were registered with, and the handles by
    /// namespace, the one used last first. A thread serves a few namespaces, mostly
    /// one after another: comparing a few short strings costs less than hashing one.
    type Cache = (usize, Vec<(Box<str>, Arc<Namespace>)>);

    thread_local! {
        static CACHE: RefCell<Cache> = const { RefCell::new((0, Vec::new())) };
    }

    fn namespace(name: &str) -> Arc<Namespace> {
        let recorder = recorder_in_force();
        CACHE.with(|cache| {
            let (registered_with, handles) = &mut *cache.borrow_mut();
            if *registered_with != recorder {
                handles.clear();
                *registered_with = recorder;
            }
            match handles.iter().position(|(known, _)| **known == *name) {
                Some(0) => {}
                Some(found) => handles[..=found].rotate_right(1),
                None => handles.insert(0, (name.into(), Arc::new(Namespace::register(name)))),
            }
            Arc::clone(&handles[0].1)
        })
    }

    /// What one call records. Built before the claim; `None` for a call without a key
    /// (it counts under `namespace=""`).
    pub(crate) struct CallMeter(Option<Arc<Namespace>>);

    impl CallMeter {
        pub(crate) fn new(key: Option<&Key>) -> CallMeter {
            CallMeter(key.map(|key| namespace(key.namespace())))
        }

        /// The claim sent at `sent` has answered, and the handler will not run.
        pub(crate) fn claimed(&self, sent: Instant) {
            if let Some(namespace) = &self.0 {
                namespace.claim.record(sent.elapsed());
            }
        }

        /// The claim sent at `sent` was won and the body starts now: the claim's time
        /// runs up to here (for a transactional handler, its transaction's start
        /// included). Answers when the body started.
        pub(crate) fn started(&self, sent: Instant) -> Option<Instant> {
            let namespace = self.0.as_ref()?;
            let now = Instant::now();
            namespace.claim.record(now.saturating_duration_since(sent));
            Some(now)
        }

        /// The handler body started at `started` has stopped.
        pub(crate) fn handled(&self, started: Option<Instant>) {
            if let (Some(namespace), Some(started)) = (&self.0, started) {
                namespace.handler.record(started.elapsed());
            }
        }

        /// The call ended with `outcome` (a label of [`OUTCOMES`]).
        pub(crate) fn ended(&self, outcome: &'static str) {
            match &self.0 {
                Some(namespace) => namespace.call_ended(outcome),
                None => {
                    let labels = [("namespace", ""), ("outcome", outcome)];
                    metrics::counter!(super::CALLS_TOTAL, &labels).increment(1);
                }
            }
        }

        /// A store operation failed (rare: registered each time).
        pub(crate) fn store_failed(&self, operation: Operation) {
            let namespace = self.0.as_ref().map_or(SharedString::const_str(""), |n| n.name.clone());
            let labels = vec![
                Label::new("namespace", namespace),
                Label::from_static_parts("operation", operation.label()),
            ];
            metrics::counter!(super::STORE_ERRORS_TOTAL, labels).increment(1);
        }
    }

    /// What one consumer run records: deliveries in flight and settled. The in-flight
    /// gauge is brought back down for deliveries still held when the run ends (they go
    /// back to the broker unsettled).
    #[cfg_attr(
        not(any(
            feature = "redis-streams",
            feature = "rabbitmq",
            feature = "nats",
            feature = "kafka",
            feature = "rocketmq"
        )),
        allow(dead_code)
    )]
    pub(crate) struct ConsumerMeter {
        in_flight: Gauge,
        settled: [Counter; 3],
        held: AtomicU64,
    }

    #[cfg_attr(
        not(any(
            feature = "redis-streams",
            feature = "rabbitmq",
            feature = "nats",
            feature = "kafka",
            feature = "rocketmq"
        )),
        allow(dead_code)
    )]
    impl ConsumerMeter {
        pub(crate) fn new(broker: &'static str, source: &str) -> ConsumerMeter {
            metrics::describe_gauge!(
                super::CONSUMER_IN_FLIGHT,
                "Deliveries taken and not yet settled, by consumer"
            );
            metrics::describe_counter!(
                super::CONSUMER_SETTLED_TOTAL,
                "Deliveries settled, by consumer and disposition"
            );
            let source = SharedString::from_owned(source.to_owned());
            let in_flight = metrics::gauge!(
                super::CONSUMER_IN_FLIGHT,
                "broker" => broker,
                "source" => source.clone()
            );
            let settled = ["ack", "retry", "dead_letter"].map(|disposition| {
                metrics::counter!(
                    super::CONSUMER_SETTLED_TOTAL,
                    "broker" => broker,
                    "source" => source.clone(),
                    "disposition" => disposition
                )
            });
            ConsumerMeter { in_flight, settled, held: AtomicU64::new(0) }
        }

        /// `count` deliveries were taken.
        pub(crate) fn taken(&self, count: usize) {
            self.held.fetch_add(count as u64, Ordering::Relaxed);
            self.in_flight.increment(count as f64);
        }

        /// A delivery was settled with `disposition`.
        pub(crate) fn settled(&self, disposition: Disposition) {
            self.settled[disposition_index(disposition)].increment(1);
            self.let_go(1);
        }

        /// `count` deliveries were let go unsettled (the broker hands them out again).
        pub(crate) fn let_go(&self, count: usize) {
            let held = self.held.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                Some(held.saturating_sub(count as u64))
            });
            let held = held.unwrap_or_default();
            self.in_flight.decrement(held.min(count as u64) as f64);
        }
    }

    impl Drop for ConsumerMeter {
        fn drop(&mut self) {
            self.in_flight.decrement(*self.held.get_mut() as f64);
        }
    }

    #[cfg_attr(
        not(any(
            feature = "redis-streams",
            feature = "rabbitmq",
            feature = "nats",
            feature = "kafka",
            feature = "rocketmq"
        )),
        allow(dead_code)
    )]
    fn disposition_index(disposition: Disposition) -> usize {
        match disposition {
            Disposition::Ack => 0,
            Disposition::Retry => 1,
            Disposition::DeadLetter => 2,
        }
    }
}

#[cfg(not(feature = "metrics"))]
mod unmeasured {
    use super::Operation;
    use crate::{Disposition, Key};

    /// Records nothing (feature `metrics` off).
    pub(crate) struct CallMeter;

    impl CallMeter {
        #[inline]
        pub(crate) fn new(_: Option<&Key>) -> CallMeter {
            CallMeter
        }
        #[inline]
        pub(crate) fn claimed(&self, _: tokio::time::Instant) {}
        #[inline]
        pub(crate) fn started(&self, _: tokio::time::Instant) -> Option<tokio::time::Instant> {
            None
        }
        #[inline]
        pub(crate) fn handled(&self, _: Option<tokio::time::Instant>) {}
        #[inline]
        pub(crate) fn ended(&self, _: &'static str) {}
        #[inline]
        pub(crate) fn store_failed(&self, _: Operation) {}
    }

    /// Records nothing (feature `metrics` off).
    #[cfg_attr(
        not(any(
            feature = "redis-streams",
            feature = "rabbitmq",
            feature = "nats",
            feature = "kafka",
            feature = "rocketmq"
        )),
        allow(dead_code)
    )]
    pub(crate) struct ConsumerMeter;

    #[cfg_attr(
        not(any(
            feature = "redis-streams",
            feature = "rabbitmq",
            feature = "nats",
            feature = "kafka",
            feature = "rocketmq"
        )),
        allow(dead_code)
    )]
    impl ConsumerMeter {
        #[inline]
        pub(crate) fn new(_: &'static str, _: &str) -> ConsumerMeter {
            ConsumerMeter
        }
        #[inline]
        pub(crate) fn taken(&self, _: usize) {}
        #[inline]
        pub(crate) fn settled(&self, _: Disposition) {}
        #[inline]
        pub(crate) fn let_go(&self, _: usize) {}
    }
}
