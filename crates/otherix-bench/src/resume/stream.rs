//! A steady echo stream through `otherix forward`: a 64-byte message every
//! millisecond, each stamped with its number, read back on its own thread,
//! every time between two arrivals kept (the client-visible silences) and
//! every byte checked against what was sent (a lost, repeated or reordered
//! message shows as a mismatch).

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::qemu::figures::{longest_silence, Silence};

/// One message: its number (8 bytes, little-endian), then a pattern of it.
pub const MESSAGE: usize = 64;
/// The time between two messages.
const PACE: Duration = Duration::from_millis(1);
/// How often the reader looks up from a quiet read.
const LOOK_UP: Duration = Duration::from_millis(200);

/// Byte `offset` of the stream.
pub fn expected(offset: u64) -> u8 {
    let (n, i) = (offset / MESSAGE as u64, (offset % MESSAGE as u64) as usize);
    if i < 8 {
        n.to_le_bytes()[i]
    } else {
        ((n.wrapping_mul(31) + i as u64) % 251) as u8
    }
}

fn message(n: u64) -> [u8; MESSAGE] {
    let mut m = [0u8; MESSAGE];
    for (i, b) in m.iter_mut().enumerate() {
        *b = expected(n * MESSAGE as u64 + i as u64);
    }
    m
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    sent: AtomicU64,
    received: AtomicU64,
    /// The first byte that differed from what was sent, if one did.
    mismatch: Mutex<Option<u64>>,
    silences: Mutex<Vec<Silence>>,
    broke: Mutex<Option<String>>,
}

/// A running stream; dropping it stops it.
pub struct EchoStream {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl EchoStream {
    /// Connects to the echo at `addr` (a forward's local address) and starts.
    pub fn start(addr: SocketAddr) -> anyhow::Result<EchoStream> {
        let conn = TcpStream::connect(addr).with_context(|| format!("cannot connect to {addr}"))?;
        conn.set_nodelay(true)?;
        conn.set_read_timeout(Some(LOOK_UP))?;
        let mut w = conn.try_clone()?;
        let mut r = conn;
        let shared = Arc::new(Shared::default());
        let writer = {
            let s = shared.clone();
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !s.stop.load(Ordering::Relaxed) {
                    if let Err(e) = w.write_all(&message(n)) {
                        note(&s.broke, format!("writing: {e}"));
                        break;
                    }
                    s.sent.fetch_add(MESSAGE as u64, Ordering::Relaxed);
                    n += 1;
                    std::thread::sleep(PACE);
                }
            })
        };
        let reader = {
            let s = shared.clone();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                let mut last = Instant::now();
                let mut got = 0u64;
                loop {
                    match r.read(&mut buf) {
                        Ok(0) => {
                            note(&s.broke, "the forward closed the stream".into());
                            break;
                        }
                        Ok(n) => {
                            let now = Instant::now();
                            lock(&s.silences).push(Silence {
                                after: last,
                                long: now - last,
                            });
                            last = now;
                            if let Some(at) = (0..n).find(|&i| buf[i] != expected(got + i as u64)) {
                                lock(&s.mismatch).get_or_insert(got + at as u64);
                            }
                            got += n as u64;
                            s.received.store(got, Ordering::Relaxed);
                        }
                        // A read timeout, or a signal (SIGCHLD when the bench kills
                        // a replica it started) during a read with a timeout,
                        // which the kernel does not restart.
                        Err(e)
                            if matches!(
                                e.kind(),
                                ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                            ) => {}
                        Err(e) => {
                            note(&s.broke, format!("reading: {e}"));
                            break;
                        }
                    }
                    if s.stop.load(Ordering::Relaxed) && got >= s.sent.load(Ordering::Relaxed) {
                        break;
                    }
                    if s.stop.load(Ordering::Relaxed) && last.elapsed() > Duration::from_secs(30) {
                        note(&s.broke, "nothing came back for 30 s".into());
                        break;
                    }
                }
            })
        };
        Ok(EchoStream {
            shared,
            threads: vec![writer, reader],
        })
    }

    pub fn sent(&self) -> u64 {
        self.shared.sent.load(Ordering::Relaxed)
    }

    pub fn received(&self) -> u64 {
        self.shared.received.load(Ordering::Relaxed)
    }

    /// Why it broke, if it did.
    pub fn broke(&self) -> Option<String> {
        lock(&self.shared.broke).clone()
    }

    /// Whether every byte that came back is the one sent there.
    pub fn exact(&self) -> bool {
        lock(&self.shared.mismatch).is_none()
    }

    /// Waits until everything sent so far has come back: an error when the
    /// stream broke or `timeout` passed first.
    pub fn drain(&self, timeout: Duration) -> anyhow::Result<()> {
        let mark = self.sent();
        let deadline = Instant::now() + timeout;
        while self.received() < mark {
            if let Some(why) = self.broke() {
                anyhow::bail!("the stream broke: {why}");
            }
            if Instant::now() > deadline {
                anyhow::bail!("{} of {mark} bytes came back within {timeout:?}", self.received());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// The longest silence overlapping `[from, to)`; forgets the silences
    /// kept so far (the next window starts later).
    pub fn take_gap(&self, from: Instant, to: Instant) -> Duration {
        let mut s = lock(&self.shared.silences);
        let gap = longest_silence(&s, from, to);
        s.clear();
        gap
    }
}

impl Drop for EchoStream {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        // Bounded: the reader gives up 30 s after the last arrival.
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Keeps the first reason the stream broke.
fn note(broke: &Mutex<Option<String>>, why: String) {
    lock(broke).get_or_insert(why);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_message_carries_its_number_and_differs_from_its_neighbours() {
        assert_eq!(&message(258)[..8], &258u64.to_le_bytes());
        assert_ne!(message(1), message(2));
        assert_eq!(message(7)[MESSAGE - 1], expected(8 * MESSAGE as u64 - 1));
    }

    #[test]
    fn a_stream_through_a_loopback_echo_comes_back_exact_and_drains() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let mut w = c.try_clone().unwrap();
            let _ = std::io::copy(&mut c, &mut w);
        });
        let s = EchoStream::start(addr).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let from = Instant::now();
        s.drain(Duration::from_secs(5)).unwrap();
        assert!(s.received() > 0 && s.exact());
        assert!(s.take_gap(from, Instant::now()) < Duration::from_secs(1));
    }
}
