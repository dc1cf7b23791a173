//! What the load benchmarks share: a fixed amount of work spread over concurrent
//! workers, timed. Each benchmark uses part of it.

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Runs `total` messages with `concurrency` workers; returns messages per second.
pub async fn throughput<F, Fut>(concurrency: usize, total: u64, work: F) -> f64
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let work = Arc::new(work);
    let counter = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (work, counter) = (work.clone(), counter.clone());
            tokio::spawn(async move {
                loop {
                    let i = counter.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    work(i).await;
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

/// Per-call latencies of `op`, run by `concurrency` workers; returns the p99.
pub async fn p99<F, Fut>(concurrency: usize, per_worker: usize, op: F) -> Duration
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut times = Vec::with_capacity(per_worker);
                for _ in 0..per_worker {
                    let start = Instant::now();
                    op().await;
                    times.push(start.elapsed());
                }
                times
            })
        })
        .collect();
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    all.sort();
    all[all.len() * 99 / 100]
}

pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
