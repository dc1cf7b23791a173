//! What `#[idempotent]` costs on the in-memory store.
//!
//! * `memory_store/claim_complete`: one claim plus one complete, fresh key each time.
//! * `handler/*`: a no-op handler called directly, through `#[idempotent]` with a
//!   fresh key (claim, run, complete), and through `#[idempotent]` with a key that is
//!   already done (the duplicate path); on one thread, and with two threads
//!   contending on one store.
//! * `key/*`: a key with two `{/json/pointer}` placeholders read from a 300-byte broker
//!   body, and from the same body as a parsed `serde_json::Value`.
//!
//! * `metrics/*` (with `--features metrics`): the fresh-key handler with the
//!   Prometheus exporter's recorder set for the thread, and its duplicate path.
//!
//! `cargo bench -p idempotent-integration --bench overhead` measures a build without
//! metrics; `--features metrics` one with them (the `handler/*` cases then run with no
//! recorder installed: the facade's no-op recorder).

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use idempotent::{Claim, Document, Key, KeyBuilder, MemoryStore, Store, idempotent};
use tokio::runtime::Runtime;

struct Msg {
    id: u64,
}

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[error("never")]
#[idempotent(retryable)]
struct Never;

/// Records expire quickly so the store's size stays bounded over millions of calls.
static STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);
static NEXT: AtomicU64 = AtomicU64::new(0);

async fn direct(msg: Msg) -> Result<u64, Never> {
    Ok(black_box(msg.id))
}

#[idempotent(key = "msg:{id}", ttl = "50ms", store = STORE)]
async fn wrapped(msg: Msg) -> Result<u64, Never> {
    Ok(black_box(msg.id))
}

fn fresh() -> Msg {
    Msg { id: NEXT.fetch_add(1, Ordering::Relaxed) }
}

fn store(c: &mut Criterion) {
    let rt = current_thread();
    let store = MemoryStore::new();
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_millis(50));
    c.bench_function("memory_store/claim_complete", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let keys: Vec<Key> = (0..iters)
                .map(|_| {
                    Key::new("bench", NEXT.fetch_add(1, Ordering::Relaxed).to_string()).unwrap()
                })
                .collect();
            let store = &store;
            async move {
                let start = Instant::now();
                for key in &keys {
                    let Ok(Claim::Won { token, .. }) = store.claim(key, lease, ttl, None).await
                    else {
                        panic!("fresh key")
                    };
                    let _ = black_box(store.complete(key, token, ttl, None).await.unwrap());
                }
                start.elapsed()
            }
        })
    });
}

fn handler(c: &mut Criterion) {
    let rt = current_thread();
    let mut group = c.benchmark_group("handler");
    group.bench_function("direct", |b| b.to_async(&rt).iter(|| direct(fresh())));
    group.bench_function("idempotent_fresh_key", |b| b.to_async(&rt).iter(|| wrapped(fresh())));
    let done = Msg { id: u64::MAX };
    rt.block_on(async {
        let _ = wrapped(Msg { id: done.id }).await;
    });
    group.bench_function("idempotent_duplicate", |b| {
        b.to_async(&rt).iter(|| async {
            // Re-mark it done whenever its 50 ms window lapses.
            black_box(wrapped(Msg { id: done.id }).await.unwrap())
        })
    });

    let rt2 = Arc::new(
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap(),
    );
    for (name, wrapped_call) in
        [("direct_2_threads", false), ("idempotent_fresh_key_2_threads", true)]
    {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                rt2.block_on(async {
                    let tasks: Vec<_> = (0..2)
                        .map(|_| {
                            tokio::spawn(async move {
                                // Ids of its own: a shared counter would make the two
                                // threads contend on its cache line in every call.
                                let first = NEXT.fetch_add(iters / 2, Ordering::Relaxed);
                                for id in first..first + iters / 2 {
                                    if wrapped_call {
                                        let _ = black_box(wrapped(Msg { id }).await.unwrap());
                                    } else {
                                        black_box(direct(Msg { id }).await.unwrap());
                                    }
                                }
                            })
                        })
                        .collect();
                    for t in tasks {
                        t.await.unwrap();
                    }
                });
                start.elapsed()
            })
        });
    }
    group.finish();
}

/// A broker body of the usual shape: ids, amounts, a nested customer, a list of lines.
const BODY: &str = r#"{"event":"order.paid","order":{"id":1234567890123,"tenant":"acme-eu"},"amount":{"cents":129900,"currency":"EUR"},"customer":{"id":"c_8f14e45fceea167a","email":"someone@example.com"},"lines":[{"sku":"A-100","qty":2},{"sku":"B-200","qty":1}],"sent_at":"2026-11-30T10:00:00Z"}"#;

fn key(c: &mut Criterion) {
    let value: idempotent::serde_json::Value = idempotent::serde_json::from_str(BODY).unwrap();
    let render = |document: &Document<'_>| {
        let mut key = KeyBuilder::new("payments");
        key.pointer("/order/tenant", document);
        key.text("/");
        key.pointer("/order/id", document);
        key.finish()
    };
    let mut group = c.benchmark_group("key");
    group.bench_function("pointers_on_bytes", |b| {
        b.iter(|| render(&Document::of(black_box(BODY.as_bytes()))))
    });
    group.bench_function("pointers_on_value", |b| {
        b.iter(|| render(&Document::of(black_box(&value))))
    });
    group.finish();
}

/// The handler calls again, with the Prometheus exporter's recorder (no HTTP
/// listener: rendering is the application's business) set for this thread.
#[cfg(feature = "metrics")]
fn metrics(c: &mut Criterion) {
    // Histograms as buckets, as most Prometheus setups have them (the exporter's
    // default, summaries, keeps a sketch per histogram and costs more per value).
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets(&[0.000_01, 0.000_1, 0.001, 0.01, 0.1, 1.0])
        .unwrap()
        .build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let rt = current_thread();
    let mut group = c.benchmark_group("metrics");
    group.bench_function("idempotent_fresh_key_prometheus", |b| {
        b.to_async(&rt).iter(|| wrapped(fresh()))
    });
    let done = Msg { id: u64::MAX - 1 };
    rt.block_on(async {
        let _ = wrapped(Msg { id: done.id }).await;
    });
    group.bench_function("idempotent_duplicate_prometheus", |b| {
        b.to_async(&rt).iter(|| async { black_box(wrapped(Msg { id: done.id }).await.unwrap()) })
    });
    group.finish();
    let rendered = handle.render();
    assert!(rendered.contains("idempotent_calls_total"), "nothing recorded:\n{rendered}");
    if std::env::var_os("SHOW_METRICS").is_some() {
        eprintln!("{rendered}");
    }
}

#[cfg(not(feature = "metrics"))]
fn metrics(_: &mut Criterion) {}

fn current_thread() -> Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

criterion_group!(benches, store, handler, key, metrics);
criterion_main!(benches);
