//! How both ingress servers take connections: the accept loop (one task per
//! connection, a pause after a failed accept, stop on shutdown), the
//! connection caps (`otherix_core::conns`: in all and per source address,
//! the control plane's too) and the refusals they and the handshake deadline
//! make, counted by reason ([`CONNECTION_REFUSALS`]), and — for the agent that runs them — a listener bound
//! again after every heartbeat attempt until it runs where it should.
//!
//! ```text
//! agent, after every heartbeat attempt ──▶ Rebinding::ensure(addr, serve)
//!     running on addr? nothing │ else bind (warn once, then quietly retry) ──▶ spawn serve
//! serve ──▶ accept_until(listener, shutdown) ──▶ ConnectionCaps::try_open (per source, in all)
//!       ──▶ the server's task ──▶ handshake_within(Limits::handshake_timeout)
//! ```

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use otherix_core::conns::{Cut, Throttle};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, warn};

// ------------------------------------------------------------- accept loop

/// Accepts from `listener` until `shutdown` completes, handing each
/// connection to `accepted` (which spawns its task into the set it is
/// given); a failed accept (such as EMFILE) goes to `failed` and is retried
/// after `backoff`. Finished tasks are reaped as it goes (a panic is
/// logged). Returns the connection tasks still running, the listener closed.
pub(crate) async fn accept_until(
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
    backoff: Duration,
    mut accepted: impl FnMut(TcpStream, SocketAddr, &mut JoinSet<()>),
    failed: impl Fn(&io::Error),
) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            Some(joined) = tasks.join_next(), if !tasks.is_empty() => log_join(joined),
            result = listener.accept() => match result {
                Ok((tcp, peer)) => accepted(tcp, peer, &mut tasks),
                Err(e) => {
                    failed(&e);
                    tokio::time::sleep(backoff).await;
                }
            },
        }
    }
    tasks
}

/// Logs a connection task that panicked.
pub(crate) fn log_join(joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined {
        if e.is_panic() {
            tracing::error!(error = %e, "a connection task panicked");
        }
    }
}

// --------------------------------------------------------- connection caps

/// Why a connection was closed before any protocol answer could be given,
/// as counted in `otherix_ingress_connections_refused_total{server,reason}`.
pub const CONNECTION_REFUSALS: &[&str] = &[
    // Every slot taken (the relay; the gateway answers `503` instead).
    "max_connections",
    // The source address holds its share of the slots.
    "max_connections_per_source",
    // The TLS handshake was not done within `Limits::handshake_timeout`.
    "handshake_timeout",
    // The handshake was cut to make room for a newcomer: the handshakes
    // were at their budget and this one was the busiest source's oldest
    // (`otherix_core::conns`).
    "handshake_cut",
    // The relay endpoint: the source is not one of the control plane's.
    "not_control_plane",
];

/// The connections a server closed before its protocol began, by reason
/// ([`CONNECTION_REFUSALS`]): counted (its own counters, and the process's
/// `metrics` recorder), and logged at most once a second under a flood.
#[derive(Debug)]
pub(crate) struct Refusals {
    /// `gateway` or `relay`: the metric's `server` label and the log's.
    server: &'static str,
    counts: Vec<AtomicU64>,
    logged: Throttle,
}

impl Refusals {
    pub(crate) fn new(server: &'static str) -> Refusals {
        Refusals {
            server,
            counts: CONNECTION_REFUSALS.iter().map(|_| AtomicU64::new(0)).collect(),
            logged: Throttle::new(Duration::from_secs(1)),
        }
    }

    /// Counts a connection from `peer` closed for `reason` (one of
    /// [`CONNECTION_REFUSALS`]) and logs it unless one was logged less than
    /// a second ago.
    pub(crate) fn refused(&self, reason: &'static str, peer: SocketAddr) {
        debug_assert!(CONNECTION_REFUSALS.contains(&reason), "{reason}");
        if let Some(i) = CONNECTION_REFUSALS.iter().position(|r| *r == reason) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        let server = self.server;
        metrics::counter!("otherix_ingress_connections_refused_total", "server" => server, "reason" => reason)
            .increment(1);
        if let Some(refused) = self.logged.event(std::time::Instant::now()) {
            warn!(%peer, reason, refused, "{server} connection refused before its handshake was done");
        }
    }

    /// Connections closed for `reason` so far (0 for an unknown reason).
    pub(crate) fn count(&self, reason: &str) -> u64 {
        CONNECTION_REFUSALS
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.counts[i].load(Ordering::Relaxed))
    }

    /// Every reason with its count.
    pub(crate) fn snapshot(&self) -> std::collections::BTreeMap<&'static str, u64> {
        CONNECTION_REFUSALS
            .iter()
            .zip(&self.counts)
            .map(|(r, n)| (*r, n.load(Ordering::Relaxed)))
            .collect()
    }
}

/// Runs `handshake` (a TLS accept) for at most `timeout` or until `cut`
/// (the slot's handshake cut for a newcomer); `None` when it took longer or
/// was cut, counted as `handshake_timeout` or `handshake_cut` for `peer`.
pub(crate) async fn handshake_within<T>(
    timeout: Duration,
    cut: Cut,
    refusals: &Refusals,
    peer: SocketAddr,
    handshake: impl Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        done = tokio::time::timeout(timeout, handshake) => match done {
            Ok(done) => Some(done),
            Err(_) => {
                refusals.refused("handshake_timeout", peer);
                None
            }
        },
        () = cut => {
            refusals.refused("handshake_cut", peer);
            None
        }
    }
}

// --------------------------------------------------------------- rebinding

/// Completes when the server given it is to stop: asked by
/// [`Rebinding::stop`] or a rebind elsewhere, or the [`Rebinding`] dropped
/// (the agent going away).
#[derive(Debug)]
pub struct Shutdown(oneshot::Receiver<()>);

impl Future for Shutdown {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        // A message or a dropped sender: both mean stop.
        Pin::new(&mut self.0).poll(cx).map(|_| ())
    }
}

/// The server task on its listener.
#[derive(Debug)]
struct Running {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// A server's listener as the agent keeps it: (re)bound by [`ensure`]
/// after every heartbeat attempt, answered or not, so a listener that could
/// not bind (the address not there yet) or whose server stopped comes back,
/// and one whose address moved follows it. A failure to bind is logged at
/// warn once, then quietly until it clears.
///
/// [`ensure`]: Rebinding::ensure
#[derive(Debug)]
pub struct Rebinding {
    /// Which server, for the log lines: `gateway`, `relay`.
    server: &'static str,
    running: Option<Running>,
    /// A failure to bind was logged at warn; quieter until it clears.
    trouble: bool,
}

impl Rebinding {
    /// Nothing bound yet for `server` (`gateway`, `relay`: the log lines
    /// name it).
    pub fn new(server: &'static str) -> Rebinding {
        Rebinding {
            server,
            running: None,
            trouble: false,
        }
    }

    /// Makes sure `serve` runs on a listener bound to `addr`: nothing to do
    /// when the server runs there already; otherwise the old one (if any) is
    /// told to stop, `addr` is bound and `serve(listener, shutdown)` spawned.
    /// Returns whether it bound now.
    pub async fn ensure<F, Fut>(&mut self, addr: SocketAddr, serve: F) -> bool
    where
        F: FnOnce(TcpListener, Shutdown) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        if self
            .running
            .as_ref()
            .is_some_and(|r| r.addr == addr && !r.task.is_finished())
        {
            return false;
        }
        if let Some(old) = self.running.take() {
            let _ = old.stop.send(());
        }
        let server = self.server;
        let listener = match TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) if !self.trouble => {
                self.trouble = true;
                warn!(%addr, error = %e, "cannot listen for {server} connections; retrying after each heartbeat");
                return false;
            }
            Err(e) => {
                debug!(%addr, error = %e, "still cannot listen for {server} connections");
                return false;
            }
        };
        self.trouble = false;
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(serve(listener, Shutdown(stopped)));
        self.running = Some(Running { addr, stop, task });
        true
    }

    /// Tells the server to stop and waits until its task has ended (for the
    /// gateway, once its sessions drained).
    pub async fn stop(&mut self) {
        if let Some(r) = self.running.take() {
            let _ = r.stop.send(());
            if let Err(e) = r.task.await {
                warn!(error = %e, "the {} task failed", self.server);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    #[test]
    fn refusals_are_counted_by_reason() {
        let r = Refusals::new("test");
        let peer = "127.0.0.2:1".parse().unwrap();
        r.refused("not_control_plane", peer);
        r.refused("not_control_plane", peer);
        r.refused("handshake_timeout", peer);
        assert_eq!(r.count("not_control_plane"), 2);
        assert_eq!(r.count("handshake_timeout"), 1);
        assert_eq!(r.count("max_connections"), 0);
        assert_eq!(r.snapshot().len(), CONNECTION_REFUSALS.len());
    }

    /// A server that counts the connections it accepts until shut down.
    async fn counting(listener: TcpListener, shutdown: Shutdown, seen: Arc<AtomicUsize>) {
        let tasks = accept_until(
            listener,
            shutdown,
            Duration::from_millis(10),
            |_, _, _| {
                seen.fetch_add(1, Ordering::SeqCst);
            },
            |_| {},
        )
        .await;
        assert!(tasks.is_empty());
    }

    #[tokio::test]
    async fn a_listener_is_bound_once_and_again_when_its_address_moves() {
        let seen = Arc::new(AtomicUsize::new(0));
        let mut rebinding = Rebinding::new("test");
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = probe.local_addr().unwrap();
        drop(probe);
        let s = seen.clone();
        assert!(rebinding.ensure(addr, |l, stop| counting(l, stop, s)).await);
        let s = seen.clone();
        assert!(
            !rebinding.ensure(addr, |l, stop| counting(l, stop, s)).await,
            "already serving there"
        );
        TcpStream::connect(addr).await.unwrap();
        for _ in 0..100 {
            if seen.load(Ordering::SeqCst) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let moved = "127.0.0.1:0".parse().unwrap();
        let s = seen.clone();
        assert!(rebinding.ensure(moved, |l, stop| counting(l, stop, s)).await);
        rebinding.stop().await;
        assert_eq!(seen.load(Ordering::SeqCst), 1);
        // The first listener was closed when the address moved.
        for _ in 0..100 {
            if TcpStream::connect(addr).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the old listener still accepts");
    }

    #[tokio::test]
    async fn a_failed_bind_is_retried_at_the_next_call() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let seen = Arc::new(AtomicUsize::new(0));
        let mut rebinding = Rebinding::new("test");
        let s = seen.clone();
        assert!(!rebinding.ensure(addr, |l, stop| counting(l, stop, s)).await);
        assert!(rebinding.trouble);
        drop(taken);
        let s = seen.clone();
        assert!(rebinding.ensure(addr, |l, stop| counting(l, stop, s)).await);
        assert!(!rebinding.trouble);
        rebinding.stop().await;
    }
}
