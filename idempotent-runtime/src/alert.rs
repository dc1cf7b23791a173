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

/// An `on_terminal` hook: an `async fn(TerminalEvent)`, or a closure returning a
/// future of `()`. Asked as this one bound, so that a hook of another shape is one
/// error, at the hook's path.
#[diagnostic::on_unimplemented(
    message = "`on_terminal = ..` must name an `async fn(TerminalEvent)`: `{Self}` isn't one",
    label = "not an `async fn(idempotent::TerminalEvent)`",
    note = "write the hook as `async fn alert(event: idempotent::TerminalEvent) {{ .. }}`; it runs when a message is dead-lettered"
)]
pub trait TerminalHook {
    /// The hook's future.
    type Sent: Future<Output = ()>;
    /// Calls the hook.
    fn send(self, event: TerminalEvent) -> Self::Sent;
}

#[diagnostic::do_not_recommend]
impl<H, F> TerminalHook for H
where
    H: FnOnce(TerminalEvent) -> F,
    F: Future<Output = ()>,
{
    type Sent = F;
    fn send(self, event: TerminalEvent) -> F {
        self(event)
    }
}

/// `on_terminal = path` in the expansion: `require_hook(&path)` asks for a
/// [`TerminalHook`] once, at the path, and `Hook(path).hook()` hands `run` the hook
/// itself ([`CheckedHook`]) or, when it is none, one auto-reference further, a hook
/// that always is one ([`UncheckedHook`]), so that `run`'s own bound reports nothing
/// more. The second is never part of a program that compiles; should it ever run, it
/// sends to the process-wide sink.
#[doc(hidden)]
pub struct Hook<H>(pub H);

#[doc(hidden)]
pub trait CheckedHook {
    type Hook: TerminalHook;
    fn hook(self) -> Self::Hook;
}

impl<H: TerminalHook> CheckedHook for Hook<H> {
    type Hook = H;
    fn hook(self) -> H {
        self.0
    }
}

#[doc(hidden)]
pub trait UncheckedHook {
    fn hook(self) -> fn(TerminalEvent) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;
}

impl<H> UncheckedHook for &Hook<H> {
    fn hook(self) -> fn(TerminalEvent) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
        |event| Box::pin(process_sink(event))
    }
}

#[doc(hidden)]
pub fn require_hook<H: TerminalHook>(_: &H) {}

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
