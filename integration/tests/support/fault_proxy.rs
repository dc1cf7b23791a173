//! A TCP proxy of the test's own in front of a real server, to fault the network
//! between a store and its server the ways production networks fail: lose the server's
//! next reply after the command ran (the reply swallowed, the client's connection
//! closed), delay every reply, stop delivering while keeping connections open, cut
//! every connection and refuse new ones, or point new connections at another server
//! (as a virtual IP or a DNS name moved at a switchover does). Runs on the current
//! Tokio runtime.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub struct FaultProxy {
    pub port: u16,
    state: Arc<State>,
}

#[derive(Default)]
struct State {
    upstream: AtomicU16,
    lose_next: AtomicBool,
    swallowing: AtomicBool,
    refusing: AtomicBool,
    /// How long each reply is held back, in milliseconds.
    delay_ms: AtomicU64,
    /// How long each request is held back, in milliseconds.
    request_delay_ms: AtomicU64,
    lost: AtomicU32,
    /// Bumped to close every open connection.
    generation: tokio::sync::watch::Sender<u64>,
}

impl FaultProxy {
    pub async fn start(upstream: u16) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("local address").port();
        let state = Arc::new(State::default());
        state.upstream.store(upstream, Ordering::SeqCst);
        let shared = state.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                // A refused connection is closed at once, as a host that answers
                // with a reset does.
                if !shared.refusing.load(Ordering::SeqCst) {
                    tokio::spawn(pump(client, shared.clone()));
                }
            }
        });
        FaultProxy { port, state }
    }

    /// `127.0.0.1:port`, for clients that take a host list.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// New connections go to `upstream`; open ones stay where they are.
    pub fn retarget(&self, upstream: u16) {
        self.state.upstream.store(upstream, Ordering::SeqCst);
    }

    /// The next reply from the server is lost, and its connection closed.
    pub fn lose_next_reply(&self) {
        self.state.lose_next.store(true, Ordering::SeqCst);
    }

    /// How many replies were lost so far.
    pub fn lost(&self) -> u32 {
        self.state.lost.load(Ordering::SeqCst)
    }

    /// From now on, what the server sends is dropped, the connections kept open.
    pub fn swallow(&self) {
        self.state.swallowing.store(true, Ordering::SeqCst);
    }

    /// Stops swallowing, and closes the connections that lost bytes.
    pub fn release(&self) {
        self.state.swallowing.store(false, Ordering::SeqCst);
        self.close_all();
    }

    /// Every reply from now on reaches its client `delay` late (zero: on time).
    pub fn delay_replies(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.state.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Every request from now on reaches the server `delay` late (zero: on time).
    pub fn delay_requests(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.state.request_delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Closes every connection and refuses new ones until [`restore`](Self::restore).
    pub fn cut(&self) {
        self.state.refusing.store(true, Ordering::SeqCst);
        self.close_all();
    }

    pub fn restore(&self) {
        self.state.refusing.store(false, Ordering::SeqCst);
    }

    fn close_all(&self) {
        self.state.generation.send_modify(|g| *g += 1);
    }
}

async fn pump(client: TcpStream, state: Arc<State>) {
    let mut closed = state.generation.subscribe();
    let upstream = state.upstream.load(Ordering::SeqCst);
    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else { return };
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = relay(client_read, server_write, state.clone(), Direction::Requests);
    let down = relay(server_read, client_write, state, Direction::Replies);
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = closed.changed() => {}
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Direction {
    Requests,
    Replies,
}

/// Copies `from` to `to`, with the faults of `direction`: replies can be swallowed or
/// lost, both can be held back. What arrives is stamped when it arrived, so that a
/// delay is a latency each byte pays once, not a wait that bytes queued behind one
/// another add up.
async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<State>,
    direction: Direction,
) {
    let (arrived, mut to_send) = tokio::sync::mpsc::unbounded_channel();
    // Owns the sending half: when reading ends (a lost reply, the peer's close), what
    // arrived is sent on and then the connection ends.
    let read = async move {
        let delay = match direction {
            Direction::Requests => &state.request_delay_ms,
            Direction::Replies => &state.delay_ms,
        };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = from.read(&mut buf).await?;
            if n == 0 {
                return Ok::<(), std::io::Error>(());
            }
            if direction == Direction::Replies {
                if state.swallowing.load(Ordering::SeqCst) {
                    continue;
                }
                if state.lose_next.swap(false, Ordering::SeqCst) {
                    state.lost.fetch_add(1, Ordering::SeqCst);
                    return Ok(());
                }
            }
            let due =
                tokio::time::Instant::now() + Duration::from_millis(delay.load(Ordering::SeqCst));
            if arrived.send((due, buf[..n].to_vec())).is_err() {
                return Ok(());
            }
        }
    };
    let write = async {
        while let Some((due, bytes)) = to_send.recv().await {
            tokio::time::sleep_until(due).await;
            to.write_all(&bytes).await?;
        }
        Ok::<(), std::io::Error>(())
    };
    let _ = tokio::join!(read, write);
}
