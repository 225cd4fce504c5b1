//! Where strangers' TLS handshakes run (the `handshakes` feature): threads
//! of their own, at a lower scheduling priority than the ones that serve
//! requests and sessions.
//!
//! A handshake is the most expensive thing an unauthenticated client can
//! make a server do (an x25519 exchange, a signature, SHA-512 of the
//! flight), and a flood of slow clients cut at their deadlines comes back
//! for another one every few seconds. Run on the runtime that also answers
//! heartbeats and splices sessions, those handshakes put every heartbeat
//! that lands meanwhile in a queue behind them, in the CP and, on a shared
//! machine, in the gateway next to it (the soak's 3–4× heartbeat tail,
//! docs/benchmarks.md). Here they run on [`HandshakePool`]'s threads, niced
//! by [`NICE`]: when the CPU is contended the kernel runs the request
//! threads first; when it is idle the handshakes get all of it. The
//! connection's own task awaits the handshake and carries on with the
//! result on its runtime.

use std::future::Future;

/// How much lower the handshake threads' priority is (added to the nice
/// value they start with, at most 19; a weight of about 1/10 of a normal
/// thread's when both want a core).
pub const NICE: i32 = 10;

/// A small multi-threaded runtime for handshakes (one thread per core),
/// dropped without waiting for what is still running on it.
pub struct HandshakePool {
    runtime: Option<tokio::runtime::Runtime>,
}

impl HandshakePool {
    /// Starts the threads; each lowers its own priority as it starts (a
    /// failure to do so is logged once and the thread runs at normal
    /// priority).
    pub fn start() -> std::io::Result<HandshakePool> {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("otherix-handshake")
            .enable_time()
            .on_thread_start(lower_priority)
            .build()?;
        Ok(HandshakePool {
            runtime: Some(runtime),
        })
    }

    /// Runs `handshake` on the pool and waits for it; `None` if the pool
    /// is shutting down (the connection is then dropped). Sockets it uses
    /// may belong to the caller's runtime: their readiness still comes from
    /// that runtime's driver.
    pub async fn run<F>(&self, handshake: F) -> Option<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.runtime.as_ref()?.spawn(handshake).await.ok()
    }
}

impl Drop for HandshakePool {
    fn drop(&mut self) {
        // Dropping a runtime inside another one's task would block it.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

fn lower_priority() {
    let tid = rustix::thread::gettid();
    // On Linux the nice value is per thread; this one is raised (made less
    // favoured), which needs no privilege. Raised from the process's own:
    // a control plane started under `nice` keeps its handshakes below it.
    let own = rustix::process::getpriority_process(Some(tid)).unwrap_or(0);
    if let Err(e) = rustix::process::setpriority_process(Some(tid), (own + NICE).min(19)) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| tracing::warn!(error = %e, "cannot lower the TLS handshake threads' priority"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_runs_tasks_on_threads_of_lower_priority() {
        let pool = HandshakePool::start().unwrap();
        let caller = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let (nice, name) = caller
            .block_on(pool.run(async {
                let tid = rustix::thread::gettid();
                let nice = rustix::process::getpriority_process(Some(tid)).unwrap();
                (nice, std::thread::current().name().map(str::to_owned))
            }))
            .unwrap();
        let own = rustix::process::getpriority_process(Some(rustix::thread::gettid())).unwrap();
        assert_eq!(nice, (own + NICE).min(19), "the pool's threads are niced");
        assert_eq!(name.as_deref(), Some("otherix-handshake"));
    }

    #[tokio::test]
    async fn a_socket_of_the_calling_runtime_is_usable_on_the_pool_and_dropping_the_pool_inside_a_runtime_is_safe(
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let pool = HandshakePool::start().unwrap();
        let accept = tokio::spawn(async move { listener.accept().await.unwrap().0 });
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut server = accept.await.unwrap();
        let echo = pool.run(async move {
            let mut buf = [0u8; 5];
            server.read_exact(&mut buf).await.unwrap();
            server.write_all(&buf).await.unwrap();
            server
        });
        // `run` spawns when first polled: the client runs alongside it.
        let client = async {
            client.write_all(b"hello").await.unwrap();
            let mut back = [0u8; 5];
            client.read_exact(&mut back).await.unwrap();
            back
        };
        let (server, back) = tokio::join!(echo, client);
        assert_eq!(&back, b"hello");
        assert!(server.is_some());
        drop(pool);
    }
}
