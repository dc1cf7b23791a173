//! What a call shows through `tracing`: one `idempotent` span per call, a child of the
//! caller's, with its namespace, key, attempt, outcome and disposition; the alert
//! inside it; the claim and record steps as debug events; keys hashed on
//! request. And `idempotent::current()` inside a handler body.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, LazyLock, Mutex};

use idempotent::trace::{KeyLogging, set_key_logging};
use idempotent::{MemoryStore, Outcome, current, idempotent};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Instrument as _, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{Layer, Registry};

static STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);
/// Key logging is process-wide: the tests that depend on it take turns.
static KEY_LOGGING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Debug, thiserror::Error, idempotent::Classify)]
enum Fault {
    #[error("card declined")]
    #[idempotent(terminal)]
    Declined,
}

struct Payment {
    account: String,
    amount: u64,
}

#[idempotent(key = "{account}", store = STORE, namespace = "pay")]
async fn pay(msg: Payment) -> Result<u64, Fault> {
    tracing::info!(amount = msg.amount, "charging");
    if msg.amount == 0 { Err(Fault::Declined) } else { Ok(msg.amount) }
}

fn payment(account: &str, amount: u64) -> Payment {
    Payment { account: account.into(), amount }
}

/// A closed span: its name, the names of its ancestors (nearest first) and fields.
#[derive(Debug, Clone)]
struct SpanSeen {
    name: &'static str,
    ancestors: Vec<&'static str>,
    fields: BTreeMap<String, String>,
}

/// An event: its target, the names of its spans (nearest first) and fields.
#[derive(Debug, Clone)]
struct EventSeen {
    target: String,
    spans: Vec<&'static str>,
    fields: BTreeMap<String, String>,
}

#[derive(Clone, Default)]
struct Capture {
    spans: Arc<Mutex<Vec<SpanSeen>>>,
    events: Arc<Mutex<Vec<EventSeen>>>,
}

#[derive(Default)]
struct Fields(BTreeMap<String, String>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        ctx.span(id).expect("a new span").extensions_mut().insert(fields);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).expect("a recorded span");
        let mut extensions = span.extensions_mut();
        let fields = extensions.get_mut::<Fields>().expect("fields kept at creation");
        values.record(fields);
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let spans = ctx
            .event_scope(event)
            .map(|scope| scope.map(|span| span.name()).collect())
            .unwrap_or_default();
        let target = event.metadata().target().to_owned();
        self.events.lock().unwrap().push(EventSeen { target, spans, fields: fields.0 });
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let span = ctx.span(&id).expect("a closed span");
        let fields = span.extensions().get::<Fields>().map(|f| f.0.clone()).unwrap_or_default();
        let ancestors = span.scope().skip(1).map(|s| s.name()).collect();
        self.spans.lock().unwrap().push(SpanSeen { name: span.name(), ancestors, fields });
    }
}

impl Capture {
    fn calls(&self) -> Vec<SpanSeen> {
        self.spans.lock().unwrap().iter().filter(|s| s.name == "idempotent").cloned().collect()
    }
}

fn capture() -> (Capture, tracing::subscriber::DefaultGuard) {
    let capture = Capture::default();
    let subscriber = Registry::default().with(capture.clone());
    (capture.clone(), tracing::subscriber::set_default(subscriber))
}

fn field<'a>(fields: &'a BTreeMap<String, String>, name: &str) -> Option<&'a str> {
    fields.get(name).map(String::as_str)
}

#[tokio::test]
async fn one_span_per_call_a_child_of_the_callers_with_the_outcome() {
    let _turn = KEY_LOGGING.lock().await;
    let (capture, _guard) = capture();
    let account = "acct-1".to_owned();
    async {
        assert_eq!(pay(payment(&account, 5)).await.unwrap(), Outcome::Processed(5));
        assert_eq!(pay(payment(&account, 5)).await.unwrap(), Outcome::Duplicate);
    }
    .instrument(tracing::info_span!("consumer"))
    .await;

    let calls = capture.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    let (first, second) = (&calls[0].fields, &calls[1].fields);
    assert_eq!(field(first, "namespace"), Some("pay"));
    assert_eq!(field(first, "key"), Some(format!("pay:{account}").as_str()));
    assert_eq!(field(first, "attempt"), Some("1"));
    assert_eq!(field(first, "outcome"), Some("processed"));
    assert_eq!(field(first, "disposition"), Some("ack"));
    assert_eq!(field(second, "outcome"), Some("duplicate"));
    assert_eq!(field(second, "attempt"), None, "a duplicate claims nothing");
    assert!(calls.iter().all(|c| c.ancestors == ["consumer"]), "{calls:?}");

    // The steps, at debug level, and the body's own events, inside the call's span.
    let events = capture.events.lock().unwrap().clone();
    let inside = |message: &str| {
        let event = events.iter().find(|e| field(&e.fields, "message") == Some(message));
        event.map(|e| (e.spans.clone(), e.fields.clone()))
    };
    let (spans, fields) = inside("claimed; running the handler").expect("the claim step");
    assert_eq!((spans, field(&fields, "attempt")), (vec!["idempotent", "consumer"], Some("1")));
    let (spans, fields) = inside("recording").expect("the record step");
    assert_eq!((spans, field(&fields, "state")), (vec!["idempotent", "consumer"], Some("done")));
    assert_eq!(inside("charging").unwrap().0, ["idempotent", "consumer"]);
}

#[tokio::test]
async fn a_terminal_failure_alerts_inside_its_span() {
    let _turn = KEY_LOGGING.lock().await;
    let (capture, _guard) = capture();
    let account = "acct-2".to_owned();
    assert!(pay(payment(&account, 0)).await.is_err());

    let calls = capture.calls();
    assert_eq!(field(&calls[0].fields, "outcome"), Some("terminal_error"));
    assert_eq!(field(&calls[0].fields, "disposition"), Some("dead_letter"));
    let events = capture.events.lock().unwrap().clone();
    let alert = events.iter().find(|e| e.target == "idempotent::alert").expect("an alert");
    assert_eq!(alert.spans, ["idempotent"]);
    assert_eq!(field(&alert.fields, "key"), Some(format!("pay:{account}").as_str()));
}

#[tokio::test]
async fn hashed_keys_keep_the_id_out_of_every_span_and_event() {
    let _turn = KEY_LOGGING.lock().await;
    let (capture, _guard) = capture();
    let account = "ada@example.com".to_owned();
    set_key_logging(KeyLogging::Hashed);
    let declined = pay(payment(&account, 0)).await;
    set_key_logging(KeyLogging::Plain);
    assert!(declined.is_err());

    let calls = capture.calls();
    let key_field = field(&calls[0].fields, "key").unwrap().to_owned();
    let expected_len = "pay:sha256:".len() + 16;
    assert!(key_field.starts_with("pay:sha256:") && key_field.len() == expected_len, "{key_field}");
    let everything =
        format!("{:?}{:?}", capture.spans.lock().unwrap(), capture.events.lock().unwrap());
    assert!(!everything.contains(&account), "the id leaked: {everything}");
    let events = capture.events.lock().unwrap().clone();
    let alert =
        events.iter().find(|e| e.target == "idempotent::alert").expect("the alert is there");
    assert_eq!(field(&alert.fields, "key"), Some(key_field.as_str()));

    // With a secret, the hash is another one, which only the secret's holders can check.
    let key = idempotent::Key::new("pay", &account).unwrap();
    set_key_logging(KeyLogging::HashedWithSecret(b"rotate me".to_vec()));
    let with_secret = key.logged().to_string();
    set_key_logging(KeyLogging::Plain);
    assert!(with_secret.starts_with("pay:sha256:") && with_secret != key_field, "{with_secret}");
    assert!(!with_secret.contains(&account));
}

#[tokio::test]
async fn current_answers_inside_a_handler_body_only() {
    #[idempotent(key = "{account}", store = STORE, namespace = "seen")]
    async fn seen(msg: Payment) -> Result<(Option<idempotent::Current>, bool), Fault> {
        let inside = current();
        let in_spawned_task = tokio::spawn(async { current().is_some() }).await.unwrap();
        let _ = msg.amount;
        Ok((inside, in_spawned_task))
    }

    let account = "acct-3".to_owned();
    let (inside, in_spawned_task) = seen(payment(&account, 1)).await.unwrap().into_value().unwrap();
    let inside = inside.expect("set in the body");
    assert_eq!(inside.key.to_string(), format!("seen:{account}"));
    assert_eq!(inside.attempt, 1);
    assert!(!in_spawned_task, "task-local: not inherited by spawned tasks");
    assert!(current().is_none());
}

#[tokio::test]
async fn hostile_ids_cannot_forge_log_lines() {
    let _turn = KEY_LOGGING.lock().await;
    let (capture, _guard) = capture();
    let account = "x\n INFO forged line\u{1b}[31m".to_owned();
    assert_eq!(pay(payment(&account, 5)).await.unwrap(), Outcome::Processed(5));
    let calls = capture.calls();
    let key = field(&calls[0].fields, "key").unwrap();
    assert!(!key.contains('\n') && !key.contains('\u{1b}'), "{key:?}");
    assert_eq!(key, "pay:x\\n INFO forged line\\x1b[31m");
}

#[tokio::test]
async fn a_dropped_call_says_cancelled() {
    #[idempotent(key = "{account}", store = STORE, namespace = "slow")]
    async fn slow(msg: Payment) -> Result<(), Fault> {
        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
        let _ = msg.amount;
        Ok(())
    }

    let _turn = KEY_LOGGING.lock().await;
    let (capture, _guard) = capture();
    let cut =
        tokio::time::timeout(std::time::Duration::from_millis(50), slow(payment("acct-4", 1)));
    assert!(cut.await.is_err());
    let calls = capture.calls();
    assert_eq!(field(&calls[0].fields, "outcome"), Some("cancelled"), "{calls:?}");
    assert_eq!(field(&calls[0].fields, "attempt"), Some("1"));
}

#[tokio::test]
async fn a_filtered_out_call_span_leaves_the_callers_fields_alone() {
    let _turn = KEY_LOGGING.lock().await;
    let capture = Capture::default();
    let only_consumer = tracing_subscriber::filter::filter_fn(|m| m.name() != "idempotent");
    let subscriber = Registry::default().with(capture.clone().with_filter(only_consumer));
    let _guard = tracing::subscriber::set_default(subscriber);
    let consumer = tracing::info_span!("consumer", attempt = 7);
    let paid = pay(payment("acct-5", 5)).instrument(consumer).await;
    assert_eq!(paid.unwrap(), Outcome::Processed(5));
    let spans = capture.spans.lock().unwrap().clone();
    let consumer = spans.iter().find(|s| s.name == "consumer").expect("the caller's span");
    assert_eq!(field(&consumer.fields, "attempt"), Some("7"));
}
