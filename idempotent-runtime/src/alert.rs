//! Where terminal failures are reported.
//!
//! A handler marked `on_terminal = path` calls its own async hook. Every other
//! handler reports to the process-wide [`AlertSink`], which by default emits a
//! `tracing` event at `ERROR` level (target `idempotent::alert`) with the namespace,
//! key, attempt and error.

use std::sync::OnceLock;
use std::time::Duration;

use crate::AlreadySet;

/// How long an `on_terminal` hook may run. The record is already FAILED when it runs;
/// a hook that takes longer is dropped (and logged), so that a slow or hung alert
/// channel does not hold up the consumer's dead-lettering. Hand slow work to a task.
pub const HOOK_TIMEOUT: Duration = Duration::from_secs(5);

/// A message that failed for good: its key is recorded as FAILED. Handed to the
/// process-wide sink ([`set_alert_sink`], which has an example) or to a handler's
/// `on_terminal` hook.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TerminalEvent {
    /// The handler's namespace.
    pub namespace: String,
    /// The key's id, with unprintable bytes escaped.
    pub key: String,
    /// The attempt that failed, from 1.
    pub attempt: u32,
    /// `true` when the failure is attempts running out rather than a terminal error.
    pub exhausted: bool,
    /// The error, rendered with `Display`.
    pub error: String,
    /// The key as the library's logs show it ([`Key::logged`](crate::Key::logged)).
    pub(crate) logged_key: String,
}

/// Receives every terminal failure of handlers without their own `on_terminal` hook;
/// install one with [`set_alert_sink`] (see its example).
///
/// Called on the consumer's task: hand the event off (a channel, a non-blocking
/// client) rather than block. Closures `Fn(&TerminalEvent)` are sinks.
pub trait AlertSink: Send + Sync + 'static {
    /// Reports one terminal failure.
    fn alert(&self, event: &TerminalEvent);
}

impl<F: Fn(&TerminalEvent) + Send + Sync + 'static> AlertSink for F {
    fn alert(&self, event: &TerminalEvent) {
        self(event)
    }
}

static SINK: OnceLock<Box<dyn AlertSink>> = OnceLock::new();

/// Replaces the default `tracing` alert for the whole process. Once per process.
///
/// ```
/// idempotent_runtime::set_alert_sink(|event: &idempotent_runtime::TerminalEvent| {
///     // page someone, count it, push it to a channel...
///     let _ = event;
/// })
/// .unwrap();
/// ```
pub fn set_alert_sink(sink: impl AlertSink) -> Result<(), AlreadySet> {
    SINK.set(Box::new(sink)).map_err(|_| AlreadySet)
}

/// Sends `event` to the process-wide sink: the default `on_terminal` hook.
pub async fn process_sink(event: TerminalEvent) {
    match SINK.get() {
        Some(sink) => sink.alert(&event),
        None => tracing::error!(
            target: "idempotent::alert",
            namespace = %event.namespace,
            key = %event.logged_key,
            attempt = event.attempt,
            exhausted = event.exhausted,
            error = %event.error,
            "message failed for good; its key is kept as failed"
        ),
    }
}
