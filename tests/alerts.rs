//! Terminal failures reach the process-wide alert sink, or the handler's own
//! `on_terminal` hook instead; `classify` and `key_fn` replace their defaults.

use std::sync::{LazyLock, Mutex};

use idempotent::{Error, ErrorClass, MemoryStore, Outcome, TerminalEvent, idempotent};

static STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);
static SINK: Mutex<Vec<TerminalEvent>> = Mutex::new(Vec::new());
static HOOK: Mutex<Vec<TerminalEvent>> = Mutex::new(Vec::new());

struct Shipment {
    parcel: String,
    weight_grams: u32,
}

#[derive(Debug, thiserror::Error)]
#[error("parcel too heavy: {0} g")]
struct TooHeavy(u32);

/// No `Classify` impl on `TooHeavy`: the `classify` argument decides.
fn by_weight(e: &TooHeavy) -> ErrorClass {
    if e.0 > 30_000 { ErrorClass::Terminal } else { ErrorClass::Retryable }
}

fn parcel_key(msg: &Shipment) -> String {
    msg.parcel.to_uppercase()
}

#[idempotent(key_fn = parcel_key, classify = by_weight, store = STORE, namespace = "ship")]
async fn ship(msg: Shipment) -> Result<(), TooHeavy> {
    if msg.weight_grams > 20_000 { Err(TooHeavy(msg.weight_grams)) } else { Ok(()) }
}

async fn page_someone(event: TerminalEvent) {
    HOOK.lock().unwrap().push(event);
}

#[idempotent(key_fn = parcel_key, classify = by_weight, store = STORE, on_terminal = page_someone)]
async fn ship_with_hook(msg: Shipment) -> Result<(), TooHeavy> {
    Err(TooHeavy(msg.weight_grams))
}

fn shipment(parcel: &str, weight_grams: u32) -> Shipment {
    Shipment { parcel: parcel.into(), weight_grams }
}

#[tokio::test]
async fn alerts_key_fn_and_classify() {
    idempotent::set_alert_sink(|e: &TerminalEvent| SINK.lock().unwrap().push(e.clone())).unwrap();
    assert!(idempotent::set_alert_sink(|_: &TerminalEvent| {}).is_err(), "set once");

    // key_fn: "p-1" and "P-1" are one parcel.
    assert_eq!(ship(shipment("p-1", 10)).await.unwrap(), Outcome::Processed(()));
    assert_eq!(ship(shipment("P-1", 10)).await.unwrap(), Outcome::Duplicate);

    // classify: 25 kg is retryable, so no alert; 40 kg is terminal, so an alert.
    let err = ship(shipment("p-2", 25_000)).await.unwrap_err();
    assert!(matches!(err, Error::Retryable { .. }), "{err}");
    assert!(SINK.lock().unwrap().is_empty());
    let err = ship(shipment("p-3", 40_000)).await.unwrap_err();
    assert!(matches!(err, Error::Terminal { exhausted: false, .. }), "{err}");
    let sink = SINK.lock().unwrap().clone();
    assert_eq!(sink.len(), 1);
    assert_eq!((sink[0].namespace.as_str(), sink[0].key.as_str()), ("ship", "P-3"));
    assert_eq!((sink[0].attempt, sink[0].error.as_str()), (1, "parcel too heavy: 40000 g"));

    // on_terminal replaces the process-wide sink for its handler.
    let err = ship_with_hook(shipment("p-4", 50_000)).await.unwrap_err();
    assert!(err.is_terminal());
    assert_eq!(HOOK.lock().unwrap().len(), 1);
    assert_eq!(HOOK.lock().unwrap()[0].namespace, "ship_with_hook");
    assert_eq!(SINK.lock().unwrap().len(), 1, "the sink is not called twice");
}

async fn hang(event: TerminalEvent) {
    let _ = event;
    std::future::pending::<()>().await;
}

#[idempotent(key_fn = parcel_key, classify = by_weight, store = STORE, namespace = "hung", on_terminal = hang)]
async fn ship_with_hung_hook(msg: Shipment) -> Result<(), TooHeavy> {
    Err(TooHeavy(msg.weight_grams))
}

/// A hook that never finishes does not hold the answer: after `HOOK_TIMEOUT` the call
/// returns its terminal error, so the consumer can dead-letter and move on.
#[tokio::test(start_paused = true)]
async fn a_hung_hook_does_not_hold_the_answer() {
    let msg = Shipment { parcel: "p-hung".into(), weight_grams: 50_000 };
    let started = tokio::time::Instant::now();
    let call = tokio::time::timeout(std::time::Duration::from_secs(60), ship_with_hung_hook(msg));
    let err = call.await.expect("the hung hook held the answer").unwrap_err();
    assert!(matches!(err, Error::Terminal { .. }), "{err:?}");
    assert_eq!(started.elapsed(), idempotent::alert::HOOK_TIMEOUT);
}
