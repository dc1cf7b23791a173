//! NATS JetStream, end to end: 2,000 published messages of which 20% are redelivered
//! duplicates, two consumers on one durable pull consumer, one hung mid-handler and
//! killed with its connection, then restarted; retryable and terminal handler errors.
//! Every unique message must take effect exactly once, nothing may be lost, terminal
//! ones must reach the dead-letter subject, and no message may be acked before its
//! record is written: at the default concurrency and one message at a time.

mod orders;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use idempotent::consume::nats::{NatsConsumer, NatsMessage};
use idempotent::testing::{self, block_on};
use idempotent::{MemoryStore, idempotent};
use orders::{Fault, World, order_id};

#[idempotent(key = "{/id}", store = store, namespace = "nats", max_attempts = 3, lease = 2)]
async fn handle(
    msg: NatsMessage,
    store: &MemoryStore,
    world: &World,
    doomed: bool,
) -> Result<(), Fault> {
    world.process(order_id(&msg.payload), doomed).await
}

async fn connect() -> Option<async_nats::Client> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    match async_nats::connect(&url).await {
        Ok(c) => Some(c),
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "CI needs NATS at {url}: {e}");
            eprintln!("skipped: no NATS at {url} ({e})");
            None
        }
    }
}

#[test]
fn two_consumers_one_killed_every_message_once() {
    scenario(None);
}

#[test]
fn one_message_at_a_time_every_message_once() {
    scenario(Some(1));
}

/// The scenario, with the consumers' default concurrency or the one given.
fn scenario(concurrency: Option<usize>) {
    block_on(async {
        let Some(client) = connect().await else { return };
        let js = jetstream::new(client);
        let name = testing::fresh_key("orders").namespace().to_owned();
        let (subject, dead_subject) = (format!("{name}.orders"), format!("{name}.dead"));
        let orders = js
            .get_or_create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![subject.clone()],
                ..Default::default()
            })
            .await
            .unwrap();
        let mut dead = js
            .get_or_create_stream(stream::Config {
                name: format!("{name}-dead"),
                subjects: vec![dead_subject.clone()],
                ..Default::default()
            })
            .await
            .unwrap();
        let mut durable = orders
            .get_or_create_consumer(
                "billing",
                pull::Config {
                    durable_name: Some("billing".into()),
                    ack_wait: Duration::from_secs(2),
                    ..Default::default()
                },
            )
            .await
            .unwrap();

        for id in orders::published() {
            let body = orders::body(id);
            js.publish(subject.clone(), body.into()).await.unwrap().await.unwrap();
        }

        let store = Arc::new(MemoryStore::new());
        let world = Arc::new(World::default());
        let acked = Arc::new(Mutex::new(0usize));
        let consumer = |doomed: bool| {
            let (store, world, acked) = (store.clone(), world.clone(), acked.clone());
            let (stream_name, dead_subject) = (name.clone(), dead_subject.clone());
            tokio::spawn(async move {
                // Its own connection: killing the task drops it.
                let js = jetstream::new(connect().await.unwrap());
                let durable: jetstream::consumer::PullConsumer =
                    js.get_consumer_from_stream("billing", &stream_name).await.unwrap();
                let consumer = NatsConsumer::new(&durable, js.clone(), dead_subject)
                    .await
                    .unwrap()
                    .retry_delay(Duration::from_millis(200));
                let consumer = match concurrency {
                    Some(n) => consumer.concurrency(n),
                    None => consumer,
                };
                let handled = consumer.run(|m| {
                    let (store, world, acked) = (store.clone(), world.clone(), acked.clone());
                    async move {
                        let id = order_id(&m.payload);
                        let result = handle(m, &store, &world, doomed).await;
                        orders::check_recorded_before_ack(&*store, "nats", id, &result, &acked)
                            .await;
                        result
                    }
                });
                handled.await.expect("settling");
            })
        };
        let hung = world.hung.notified();
        let steady = consumer(false);
        let doomed = consumer(true);
        // Kill the doomed consumer mid-handler, with its connection, without acking
        // what it holds: the server redelivers after ack_wait. Then start it again.
        // Other calls of the doomed consumer in flight at that moment finish first (a
        // kill between an effect and its DONE record runs that effect again, at any
        // concurrency).
        hung.await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        doomed.abort();
        let _ = doomed.await;
        let restarted = consumer(false);

        let expected = World::expected();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let done = world.effects.lock().unwrap().len();
            let info = durable.info().await.unwrap();
            if done == expected && info.num_pending == 0 && info.num_ack_pending == 0 {
                break;
            }
            let stuck = format!(
                "stuck: {done}/{expected} done, {} pending, {} unacked",
                info.num_pending, info.num_ack_pending
            );
            assert!(Instant::now() < deadline, "{stuck}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        steady.abort();
        restarted.abort();

        world.assert_exactly_once();

        let dead_count = dead.info().await.unwrap().state.messages;
        let mut dead_ids = HashSet::new();
        for sequence in 1..=dead_count {
            dead_ids.insert(order_id(&dead.get_raw_message(sequence).await.unwrap().payload));
        }
        let want = World::rejected_orders();
        assert_eq!(dead_ids, want, "exactly the rejected orders are dead-lettered");
        assert!(*acked.lock().unwrap() >= 1_900);
        js.delete_stream(&name).await.unwrap();
        js.delete_stream(format!("{name}-dead")).await.unwrap();
    });
}
