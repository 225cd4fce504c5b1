//! How both ingress servers take connections: the accept loop (one task per
//! connection, a pause after a failed accept, stop on shutdown), the
//! connection limit, and — for the agent that runs them — a listener bound
//! again after every heartbeat attempt until it runs where it should.
//!
//! ```text
//! agent, after every heartbeat attempt ──▶ Rebinding::ensure(addr, serve)
//!     running on addr? nothing │ else bind (warn once, then quietly retry) ──▶ spawn serve
//! serve ──▶ accept_until(listener, shutdown) ──▶ Connections::try_open ──▶ the server's task
//! ```

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

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

// --------------------------------------------------------- connection limit

/// Connections open now, in any stage, and the most allowed.
#[derive(Debug)]
pub(crate) struct Connections {
    open: AtomicUsize,
    max: usize,
}

impl Connections {
    pub(crate) fn new(max: usize) -> Arc<Connections> {
        Arc::new(Connections {
            open: AtomicUsize::new(0),
            max,
        })
    }

    /// Takes a slot if fewer than the most are open; the slot is given back
    /// when it drops.
    pub(crate) fn try_open(self: &Arc<Self>) -> Option<ConnectionSlot> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| ConnectionSlot(Arc::clone(self)))
    }

    /// How many are open now.
    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// The most allowed at once.
    pub(crate) fn max(&self) -> usize {
        self.max
    }
}

/// One open connection's place under the limit, given back on drop.
#[derive(Debug)]
pub(crate) struct ConnectionSlot(Arc<Connections>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
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

    #[test]
    fn connection_slots_stop_at_the_limit() {
        let c = Connections::new(2);
        let a = c.try_open().unwrap();
        let _b = c.try_open().unwrap();
        assert!(c.try_open().is_none());
        assert_eq!(c.open(), 2);
        drop(a);
        assert!(c.try_open().is_some());
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
