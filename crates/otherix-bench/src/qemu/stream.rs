//! A paced echo stream through the gateway to a guest's port 7, kept open
//! across every migration: how much went out and came back, the SHA-256 of
//! each, and every silence between two arrivals (the client-visible gaps).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use otherix_client::tunnel::AnyTunnel;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use super::figures::Silence;

/// Bytes written per step, and the time between steps: about 100 KB/s,
/// well inside what a TCG guest echoes (about 5 MB/s per core).
const CHUNK: usize = 512;
const PACE: Duration = Duration::from_millis(5);
/// The stream is broken when nothing has come back for this long while
/// bytes are outstanding.
const IDLE: Duration = Duration::from_secs(30);
/// How often the reader looks up from a quiet read to see whether it is done.
const LOOK_UP: Duration = Duration::from_millis(200);

/// What the stream carried, once finished.
#[derive(Debug, Clone)]
pub struct Tally {
    pub sent: u64,
    pub sent_sha256: [u8; 32],
    pub received: u64,
    pub received_sha256: [u8; 32],
    /// Every time between two arrivals, in order.
    pub silences: Vec<Silence>,
    /// Why it ended before everything came back, if it did.
    pub broke: Option<String>,
    /// When the last byte came back before it broke.
    pub broke_after: Option<Instant>,
}

impl Tally {
    /// Everything sent came back, in order.
    pub fn exact(&self) -> bool {
        self.broke.is_none() && self.sent == self.received && self.sent_sha256 == self.received_sha256
    }

    /// Bytes sent that never came back.
    pub fn lost(&self) -> u64 {
        self.sent.saturating_sub(self.received)
    }
}

/// A running stream; [`EchoStream::finish`] stops it.
pub struct EchoStream {
    stop: Arc<AtomicBool>,
    task: JoinHandle<Tally>,
}

impl EchoStream {
    /// Starts writing into `tunnel` (connected to an echo server) and reading
    /// back, on `rt`.
    pub fn start(rt: &Runtime, tunnel: AnyTunnel) -> EchoStream {
        let stop = Arc::new(AtomicBool::new(false));
        let task = rt.spawn(run(tunnel, stop.clone()));
        EchoStream { stop, task }
    }

    /// Stops writing and waits until everything written came back (or the
    /// stream is found broken).
    pub fn finish(self, rt: &Runtime) -> anyhow::Result<Tally> {
        self.stop.store(true, Ordering::Relaxed);
        Ok(rt.block_on(self.task)?)
    }
}

async fn run(tunnel: AnyTunnel, stop: Arc<AtomicBool>) -> Tally {
    let (mut r, mut w) = tokio::io::split(tunnel);
    let sent = Arc::new(AtomicU64::new(0));
    let writer_done = Arc::new(AtomicBool::new(false));
    let broke: Arc<Mutex<Option<String>>> = Arc::default();

    let writer = {
        let (sent, done, broke) = (sent.clone(), writer_done.clone(), broke.clone());
        async move {
            let mut hash = Sha256::new();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) && !is_broken(&broke) {
                let chunk: Vec<u8> = (0..CHUNK as u64).map(|j| ((i * 31 + j) % 251) as u8).collect();
                match tokio::time::timeout(IDLE, w.write_all(&chunk)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        note(&broke, format!("writing: {e}"));
                        break;
                    }
                    Err(_) => {
                        note(&broke, format!("writing blocked for {}s", IDLE.as_secs()));
                        break;
                    }
                }
                hash.update(&chunk);
                sent.fetch_add(CHUNK as u64, Ordering::Relaxed);
                i += 1;
                tokio::time::sleep(PACE).await;
            }
            done.store(true, Ordering::Relaxed);
            (<[u8; 32]>::from(hash.finalize()), w)
        }
    };
    let reader = {
        let (sent, writer_done, broke) = (sent.clone(), writer_done.clone(), broke.clone());
        async move {
            let (mut got, mut hash) = (0u64, Sha256::new());
            let mut silences = Vec::new();
            let mut last = Instant::now();
            let mut buf = vec![0u8; 65536];
            loop {
                match tokio::time::timeout(LOOK_UP, r.read(&mut buf)).await {
                    Ok(Ok(0)) => {
                        note(&broke, "the far end closed the stream".into());
                        break;
                    }
                    Ok(Ok(n)) => {
                        let now = Instant::now();
                        silences.push(Silence {
                            after: last,
                            long: now - last,
                        });
                        last = now;
                        hash.update(&buf[..n]);
                        got += n as u64;
                    }
                    Ok(Err(e)) => {
                        note(&broke, format!("reading: {e}"));
                        break;
                    }
                    Err(_) => {}
                }
                let finished = writer_done.load(Ordering::Relaxed);
                if finished && got >= sent.load(Ordering::Relaxed) {
                    break;
                }
                if last.elapsed() > IDLE {
                    note(&broke, format!("nothing came back for {}s", IDLE.as_secs()));
                    silences.push(Silence {
                        after: last,
                        long: last.elapsed(),
                    });
                    break;
                }
                if finished && is_broken(&broke) {
                    break;
                }
            }
            (got, <[u8; 32]>::from(hash.finalize()), silences, last)
        }
    };
    let ((sent_sha256, _w), (received, received_sha256, silences, last)) = tokio::join!(writer, reader);
    let broke = broke.lock().unwrap_or_else(|p| p.into_inner()).take();
    let broke_after = broke.is_some().then_some(last);
    Tally {
        sent: sent.load(Ordering::Relaxed),
        sent_sha256,
        received,
        received_sha256,
        silences,
        broke,
        broke_after,
    }
}

fn is_broken(broke: &Mutex<Option<String>>) -> bool {
    broke.lock().unwrap_or_else(|p| p.into_inner()).is_some()
}

/// Keeps the first reason the stream broke.
fn note(broke: &Mutex<Option<String>>, why: String) {
    broke.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(why);
}
