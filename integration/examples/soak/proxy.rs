//! A TCP forwarder between the consumers and their store, which can cut the network:
//! every open connection is dropped and new ones are refused for a while.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A forwarder listening on a loopback port of its own, in front of `upstream`.
pub struct Proxy {
    /// The port consumers connect to instead of the store's.
    pub port: u16,
    /// Until when new connections are refused (`None`: not cut).
    cut_until: Arc<Mutex<Option<Instant>>>,
    /// Bumped at each cut: every pump watching it drops its connection.
    generation: watch::Sender<u64>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Starts forwarding to `upstream` on the current Tokio runtime.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let cut_until = Arc::new(Mutex::new(None::<Instant>));
        let (generation, _) = watch::channel(0u64);
        let (cut, cuts) = (cut_until.clone(), generation.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let refused = cut.lock().unwrap().is_some_and(|until| Instant::now() < until);
                if refused {
                    drop(client);
                    continue;
                }
                tokio::spawn(pump(client, upstream, cuts.subscribe()));
            }
        });
        Ok(Proxy { port, cut_until, generation, accept })
    }

    /// Drops every open connection and refuses new ones for `span`.
    pub fn cut(&self, span: Duration) {
        *self.cut_until.lock().unwrap() = Some(Instant::now() + span);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Accepts connections again at once.
    pub fn heal(&self) {
        *self.cut_until.lock().unwrap() = None;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.generation.send_modify(|g| *g += 1);
    }
}

/// Forwards one connection both ways until either side closes or the network is cut.
async fn pump(mut client: TcpStream, upstream: SocketAddr, mut cuts: watch::Receiver<u64>) {
    let connect = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(upstream));
    let Ok(Ok(mut server)) = connect.await else { return };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    cuts.mark_unchanged();
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        _ = cuts.changed() => {}
    }
}
