//! An idempotent Redis Streams consumer: publishes orders (every fifth twice), consumes
//! them acking only after the outcome is recorded, prints entries/s. `--plain`: the
//! same loop without `#[idempotent]`. Needs Redis at `REDIS_URL` (default local).
//! `cargo run --release -p idempotent-integration --example redis_streams [-- --plain]`

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use idempotent::consume::redis_streams::{StreamConsumer, StreamMessage};
use idempotent::{Error, Outcome, RedisStore, idempotent};

const ORDERS: usize = 20_000;
static CHARGED: AtomicU64 = AtomicU64::new(0);

#[idempotent(key = "order:{/order_id}", store = store, ttl = "1h")]
async fn charge(msg: StreamMessage, store: &RedisStore) {
    let _ = msg; // charge the customer here
    CHARGED.fetch_add(1, Ordering::Relaxed);
}

async fn charge_plain(msg: StreamMessage) -> Result<Outcome<()>, Error<std::convert::Infallible>> {
    let _ = msg;
    CHARGED.fetch_add(1, Ordering::Relaxed);
    Ok(Outcome::Processed(()))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let plain = std::env::args().any(|a| a == "--plain");
    let run = idempotent::Token::random().to_string();
    let store =
        RedisStore::options().prefix(format!("example-{run}")).connect(url.as_str()).await?;
    let mut conn = store.connection_manager().expect("standalone Redis").clone();
    let stream = format!("example-{run}:orders");

    let published = ORDERS + ORDERS / 5;
    for i in 0..published {
        let body = format!(r#"{{"order_id":{},"amount_cents":500}}"#, i % ORDERS);
        let mut xadd = redis::cmd("XADD");
        let _: String =
            xadd.arg(&stream).arg("*").arg("payload").arg(body).query_async(&mut conn).await?;
    }

    let client = redis::Client::open(url.as_str())?;
    let consumer = StreamConsumer::new(&client, &stream, "billing", "billing-1").await?;
    let (mut acked, mut retried, mut dead) = (0, 0, 0);
    let start = Instant::now();
    while acked + dead < published {
        let polled = if plain {
            consumer.poll(charge_plain).await?
        } else {
            consumer.poll(|msg| charge(msg, &store)).await?
        };
        (acked, retried, dead) = (
            acked + polled.acked.len(),
            retried + polled.retried.len(),
            dead + polled.dead_lettered.len(),
        );
    }
    let rate = published as f64 / start.elapsed().as_secs_f64();
    let mode = if plain { "plain handler" } else { "#[idempotent]" };
    println!("{mode}: {published} entries, {acked} acked, {retried} retried, {dead} dead-lettered");
    println!(
        "charged {} times for {ORDERS} orders; {rate:.0} entries/s",
        CHARGED.load(Ordering::Relaxed)
    );
    let _: () = redis::cmd("DEL").arg(&stream).query_async(&mut conn).await?;
    Ok(())
}
