//! Copies bytes both ways between the client's stream and the guest's, in
//! one task, with large buffers, half-close and an idle timeout.
//!
//! Buffers: a direction holds its buffer only while bytes are in flight. It
//! takes one from a small per-thread spare list when it reads and gives it
//! back as soon as the reader has nothing more, so an idle session holds no
//! buffer at all (two 64 KiB buffers per session made memory grow with idle
//! sessions, not with traffic), and a busy one keeps reusing a warm buffer
//! instead of allocating and zeroing one per read.
//!
//! Half-close: when one side ends its stream (TLS `close_notify` or TCP FIN),
//! the other side's write half is shut down and the opposite direction keeps
//! flowing — `ssh` and `nc -N` rely on it. The session ends when both
//! directions have ended, on the first error, or after `idle` with no byte
//! in either direction. The idle timer is not touched per read: it fires at
//! most once per `idle` and is re-armed from the time of the last byte.

use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

/// How a splice ended and what it carried.
#[derive(Debug)]
pub struct Outcome {
    /// Bytes copied from the client to the guest.
    pub to_guest: u64,
    /// Bytes copied from the guest to the client.
    pub from_guest: u64,
    /// `Ok(End)` for an orderly end, the first IO error otherwise.
    pub end: io::Result<End>,
}

/// An orderly end of a splice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Both directions ended.
    Closed,
    /// No byte either way for the idle timeout.
    Idle,
}

impl End {
    pub fn as_str(self) -> &'static str {
        match self {
            End::Closed => "closed",
            End::Idle => "idle_timeout",
        }
    }
}

/// Splices `client` and `guest` until both directions end, an error, or
/// `idle` without traffic.
pub async fn splice<C, G>(client: &mut C, guest: &mut G, buffer: usize, idle: Duration) -> Outcome
where
    C: AsyncRead + AsyncWrite + Unpin,
    G: AsyncRead + AsyncWrite + Unpin,
{
    let mut up = Direction::new(buffer);
    let mut down = Direction::new(buffer);
    let mut last_byte = Instant::now();
    let timer = tokio::time::sleep_until(last_byte + idle);
    tokio::pin!(timer);

    let end = poll_fn(|cx| -> Poll<io::Result<End>> {
        let mut active = false;
        if !up.done {
            if let Poll::Ready(r) =
                up.poll_copy(cx, Pin::new(&mut *client), Pin::new(&mut *guest), &mut active)
            {
                r?;
                up.done = true;
            }
        }
        if !down.done {
            if let Poll::Ready(r) =
                down.poll_copy(cx, Pin::new(&mut *guest), Pin::new(&mut *client), &mut active)
            {
                r?;
                down.done = true;
            }
        }
        if up.done && down.done {
            return Poll::Ready(Ok(End::Closed));
        }
        if active {
            last_byte = Instant::now();
        }
        while timer.as_mut().poll(cx).is_ready() {
            let deadline = last_byte + idle;
            if deadline <= Instant::now() {
                return Poll::Ready(Ok(End::Idle));
            }
            timer.as_mut().reset(deadline);
        }
        Poll::Pending
    })
    .await;
    Outcome {
        to_guest: up.copied,
        from_guest: down.copied,
        end,
    }
}

/// One direction: read into the buffer, write it all out, repeat; at the
/// reader's end, flush and shut the writer down.
struct Direction {
    /// Held only while `pos < filled` or a read is being tried: see the module docs.
    buf: Option<Box<[u8]>>,
    size: usize,
    pos: usize,
    filled: usize,
    copied: u64,
    read_done: bool,
    need_flush: bool,
    done: bool,
}

impl Direction {
    fn new(size: usize) -> Direction {
        Direction {
            buf: None,
            size,
            pos: 0,
            filled: 0,
            copied: 0,
            read_done: false,
            need_flush: false,
            done: false,
        }
    }

    /// Gives the buffer back; only called with nothing in flight.
    fn release(&mut self) {
        debug_assert_eq!(self.pos, self.filled, "released a buffer with bytes in flight");
        if let Some(buf) = self.buf.take() {
            spare::give(buf);
        }
    }

    fn poll_copy<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        mut reader: Pin<&mut R>,
        mut writer: Pin<&mut W>,
        active: &mut bool,
    ) -> Poll<io::Result<()>>
    where
        R: AsyncRead + ?Sized,
        W: AsyncWrite + ?Sized,
    {
        loop {
            if self.pos == self.filled && !self.read_done {
                let size = self.size;
                let buf = self.buf.get_or_insert_with(|| spare::take(size));
                let mut rb = ReadBuf::new(buf);
                match reader.as_mut().poll_read(cx, &mut rb) {
                    Poll::Ready(Ok(())) => {
                        self.pos = 0;
                        self.filled = rb.filled().len();
                        if self.filled == 0 {
                            self.read_done = true;
                            self.release();
                        } else {
                            *active = true;
                        }
                    }
                    // A TLS peer that closes TCP without `close_notify`: for a
                    // raw byte tunnel that is an end of stream like any other
                    // (the guest's protocol does its own framing).
                    Poll::Ready(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
                        self.pos = 0;
                        self.filled = 0;
                        self.read_done = true;
                        self.release();
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {
                        // Nothing in flight: an idle direction holds no buffer.
                        self.release();
                        // Nothing more to read now: push out what the writer buffers
                        // (TLS records) before waiting.
                        if self.need_flush {
                            ready!(writer.as_mut().poll_flush(cx))?;
                            self.need_flush = false;
                        }
                        return Poll::Pending;
                    }
                }
            }
            if let Some(buf) = &self.buf {
                while self.pos < self.filled {
                    let n = ready!(writer.as_mut().poll_write(cx, &buf[self.pos..self.filled]))?;
                    if n == 0 {
                        return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                    }
                    self.pos += n;
                    self.copied += n as u64;
                    self.need_flush = true;
                }
            }
            if self.read_done {
                ready!(writer.as_mut().poll_flush(cx))?;
                ready!(writer.as_mut().poll_shutdown(cx))?;
                return Poll::Ready(Ok(()));
            }
        }
    }
}

impl Drop for Direction {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            spare::give(buf);
        }
    }
}

/// Splice buffers not in use, per thread (a task's directions take and give
/// back on whichever worker polls them). Taking is a pop; a buffer of
/// another size (another gateway's configuration) is freed instead.
mod spare {
    use std::cell::RefCell;

    /// Most spare buffers a thread keeps; more are freed. Only directions
    /// blocked mid-write hold a buffer, so a few cover a busy thread.
    const KEEP: usize = 8;

    thread_local! {
        static SPARE: RefCell<Vec<Box<[u8]>>> = const { RefCell::new(Vec::new()) };
    }

    pub(super) fn take(size: usize) -> Box<[u8]> {
        SPARE
            .try_with(|spare| {
                let mut spare = spare.borrow_mut();
                std::iter::from_fn(|| spare.pop()).find(|b| b.len() == size)
            })
            .ok()
            .flatten()
            .unwrap_or_else(|| vec![0; size].into_boxed_slice())
    }

    pub(super) fn give(buf: Box<[u8]>) {
        // During thread teardown the list is gone: the buffer is just freed.
        let _ = SPARE.try_with(|spare| {
            let mut spare = spare.borrow_mut();
            if spare.len() < KEEP {
                spare.push(buf);
            }
        });
    }

    #[cfg(test)]
    pub(super) fn count() -> usize {
        SPARE.with(|spare| spare.borrow().len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn bytes_flow_both_ways_and_half_close_propagates() {
        let (mut client, mut client_end) = duplex(1024);
        let (mut guest, mut guest_end) = duplex(1024);
        let task = tokio::spawn(async move {
            splice(&mut client_end, &mut guest_end, 4096, Duration::from_secs(30)).await
        });
        client.write_all(b"hello").await.unwrap();
        client.shutdown().await.unwrap();
        // The guest sees the bytes, then the end of stream…
        let mut got = Vec::new();
        guest.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"hello");
        // …and can still answer, after which the client sees its end too.
        guest.write_all(b"world").await.unwrap();
        guest.shutdown().await.unwrap();
        let mut back = Vec::new();
        client.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"world");
        let outcome = task.await.unwrap();
        assert_eq!((outcome.to_guest, outcome.from_guest), (5, 5));
        assert_eq!(outcome.end.unwrap(), End::Closed);
    }

    #[tokio::test]
    async fn a_silent_session_ends_after_the_idle_timeout_but_a_busy_one_does_not() {
        let (mut client, mut client_end) = duplex(1024);
        let (mut guest, mut guest_end) = duplex(1024);
        let idle = Duration::from_millis(300);
        let task = tokio::spawn(async move { splice(&mut client_end, &mut guest_end, 4096, idle).await });
        // Traffic every 100 ms for 900 ms keeps it open.
        let mut buf = [0u8; 1];
        for _ in 0..9 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            client.write_all(b"x").await.unwrap();
            guest.read_exact(&mut buf).await.unwrap();
        }
        assert!(!task.is_finished());
        let outcome = tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(outcome.end.unwrap(), End::Idle);
        assert_eq!(outcome.to_guest, 9);
    }

    /// Polls `dir` once from `reader` to `writer`, as the splice task would.
    fn poll_once(
        dir: &mut Direction,
        reader: &mut tokio::io::DuplexStream,
        writer: &mut tokio::io::DuplexStream,
    ) -> Poll<io::Result<()>> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut active = false;
        dir.poll_copy(&mut cx, Pin::new(reader), Pin::new(writer), &mut active)
    }

    #[test]
    fn an_idle_direction_holds_no_buffer() {
        let (mut peer, mut reader) = duplex(1024);
        let (mut writer, mut out) = duplex(1024);
        let mut dir = Direction::new(4096);
        assert!(poll_once(&mut dir, &mut reader, &mut writer).is_pending());
        assert!(dir.buf.is_none(), "nothing to read, yet a buffer is held");

        // Bytes come, are copied, and the buffer goes back once the reader is dry.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(Pin::new(&mut peer).poll_write(&mut cx, b"abc").is_ready());
        assert!(poll_once(&mut dir, &mut reader, &mut writer).is_pending());
        assert!(dir.buf.is_none(), "idle again, yet a buffer is held");
        assert!(spare::count() >= 1, "the buffer went back to the spare list");
        let mut got = [0u8; 3];
        let mut rb = ReadBuf::new(&mut got);
        assert!(Pin::new(&mut out).poll_read(&mut cx, &mut rb).is_ready());
        assert_eq!(rb.filled(), b"abc");
        assert_eq!(dir.copied, 3);
    }

    #[test]
    fn a_direction_blocked_mid_write_keeps_its_bytes_until_they_are_written() {
        let (mut peer, mut reader) = duplex(1024);
        // The writer takes 4 bytes at a time.
        let (mut writer, mut out) = duplex(4);
        let mut dir = Direction::new(4096);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(Pin::new(&mut peer).poll_write(&mut cx, b"0123456789").is_ready());
        let mut received = Vec::new();
        for _ in 0..10 {
            let _ = poll_once(&mut dir, &mut reader, &mut writer);
            let mut chunk = [0u8; 16];
            let mut rb = ReadBuf::new(&mut chunk);
            if Pin::new(&mut out).poll_read(&mut cx, &mut rb).is_ready() {
                received.extend_from_slice(rb.filled());
            }
            if dir.pos < dir.filled {
                assert!(dir.buf.is_some(), "bytes in flight need their buffer");
            }
        }
        assert_eq!(received, b"0123456789");
        assert!(dir.buf.is_none());
    }

    #[test]
    fn spare_buffers_are_reused_and_other_sizes_are_not() {
        spare::give(vec![7u8; 4096].into_boxed_slice());
        let again = spare::take(4096);
        assert_eq!(
            (again.len(), again[0]),
            (4096, 7),
            "the spare buffer is handed out again"
        );
        spare::give(again);
        let other = spare::take(8192);
        assert_eq!(
            (other.len(), other[0]),
            (8192, 0),
            "a buffer of another size is fresh"
        );
    }
}
