//! Copies bytes both ways between the client's stream and the guest's, in
//! one task, with large buffers, half-close and an idle timeout.
//!
//! Buffers. A direction holds a buffer only while bytes are in flight: it
//! takes one from the per-thread spare list (`spare`) when it reads and
//! gives it back as soon as the reader has nothing more, so an idle session
//! holds no splice buffer at all (two 64 KiB buffers per session made memory
//! grow with idle sessions rather than with traffic).
//!
//! Writes are gathered: a direction reads everything its reader has now (a
//! TLS stream hands out one record, at most 16 KiB, per read), up to the
//! buffer's size, and writes it with one call. Every write to the guest
//! sends segments through the whole kernel path to it (veth, bridge, VXLAN,
//! the guest's TCP), and that path costs per write more than per byte.
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

use crate::spare;

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
    /// The session reached its maximum lifetime, busy or not.
    MaxLifetime,
    /// The `stop` future completed: the access was revoked.
    Revoked,
    /// The `stop` future completed: an admin ended this session.
    EndedByAdmin,
    /// The `stop` future completed: the grant the credential was brokered
    /// for expired.
    GrantExpired,
}

impl End {
    pub fn as_str(self) -> &'static str {
        match self {
            End::Closed => "closed",
            End::Idle => "idle_timeout",
            End::MaxLifetime => "max_lifetime",
            End::Revoked => "revoked",
            End::EndedByAdmin => "ended_by_an_admin",
            End::GrantExpired => "grant_expired",
        }
    }
}

/// Splices `client` and `guest` until both directions end, an error,
/// `idle` without traffic, `max_lifetime` from the start whatever the
/// traffic, or `stop` completing with the end it names (a revocation, the
/// grant's expiry; `std::future::pending()` for none). `buffer` is the most
/// one direction gathers into one write.
pub async fn splice<C, G>(
    client: &mut C,
    guest: &mut G,
    buffer: usize,
    idle: Duration,
    max_lifetime: Duration,
    stop: impl Future<Output = End>,
) -> Outcome
where
    C: AsyncRead + AsyncWrite + Unpin,
    G: AsyncRead + AsyncWrite + Unpin,
{
    tokio::pin!(stop);
    let mut up = Direction::new(buffer);
    let mut down = Direction::new(buffer);
    let mut last_byte = Instant::now();
    let timer = tokio::time::sleep_until(last_byte + idle);
    tokio::pin!(timer);
    let lifetime = tokio::time::sleep_until(last_byte + max_lifetime);
    tokio::pin!(lifetime);

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
        if lifetime.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Ok(End::MaxLifetime));
        }
        if let Poll::Ready(end) = stop.as_mut().poll(cx) {
            return Poll::Ready(Ok(end));
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

/// One direction: read what there is, write it all out, repeat; at the
/// reader's end, flush and shut the writer down.
struct Direction {
    /// Held only while `pos < filled` or a read is being tried: see the
    /// module docs. Bytes in flight are `buf[pos..filled]`.
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
            // Gather what the reader has now, up to the buffer's size.
            let mut dry = false;
            while !self.read_done && self.filled < self.size {
                let size = self.size;
                let buf = self.buf.get_or_insert_with(|| spare::take(size));
                let mut rb = ReadBuf::new(&mut buf[self.filled..]);
                match reader.as_mut().poll_read(cx, &mut rb) {
                    Poll::Ready(Ok(())) if rb.filled().is_empty() => self.read_done = true,
                    Poll::Ready(Ok(())) => {
                        self.filled += rb.filled().len();
                        *active = true;
                    }
                    // A TLS peer that closes TCP without `close_notify`: for a
                    // raw byte tunnel that is an end of stream like any other
                    // (the guest's protocol does its own framing).
                    Poll::Ready(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => self.read_done = true,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {
                        dry = true;
                        break;
                    }
                }
            }
            // Write it out with as few calls as the writer allows.
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
            (self.pos, self.filled) = (0, 0);
            if self.read_done {
                self.release();
                ready!(writer.as_mut().poll_flush(cx))?;
                ready!(writer.as_mut().poll_shutdown(cx))?;
                return Poll::Ready(Ok(()));
            }
            if dry {
                // Nothing in flight: an idle direction holds no buffer.
                self.release();
                // Push out what the writer buffers (TLS records) before waiting.
                if self.need_flush {
                    ready!(writer.as_mut().poll_flush(cx))?;
                    self.need_flush = false;
                }
                return Poll::Pending;
            }
            // The buffer was full and is written out: read on.
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn bytes_flow_both_ways_and_half_close_propagates() {
        let (mut client, mut client_end) = duplex(1024);
        let (mut guest, mut guest_end) = duplex(1024);
        let task = tokio::spawn(async move {
            splice(
                &mut client_end,
                &mut guest_end,
                4096,
                Duration::from_secs(30),
                Duration::from_secs(3600),
                std::future::pending(),
            )
            .await
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
        let task = tokio::spawn(async move {
            splice(
                &mut client_end,
                &mut guest_end,
                4096,
                idle,
                Duration::from_secs(3600),
                std::future::pending(),
            )
            .await
        });
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

    #[tokio::test]
    async fn a_busy_session_ends_at_its_maximum_lifetime() {
        let (mut client, mut client_end) = duplex(1024);
        let (mut guest, mut guest_end) = duplex(1024);
        let max = Duration::from_millis(400);
        let task = tokio::spawn(async move {
            splice(
                &mut client_end,
                &mut guest_end,
                4096,
                Duration::from_secs(60),
                max,
                std::future::pending(),
            )
            .await
        });
        let mut buf = [0u8; 1];
        let started = std::time::Instant::now();
        while !task.is_finished() && started.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if client.write_all(b"x").await.is_ok() {
                let _ = tokio::time::timeout(Duration::from_millis(100), guest.read_exact(&mut buf)).await;
            }
        }
        let outcome = task.await.unwrap();
        assert_eq!(outcome.end.unwrap(), End::MaxLifetime);
        assert!(started.elapsed() >= max && started.elapsed() < Duration::from_secs(3));
    }

    #[tokio::test]
    async fn a_session_ends_when_told_to_stop_with_its_bytes_counted() {
        let (mut client, mut client_end) = duplex(1024);
        let (mut guest, mut guest_end) = duplex(1024);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            splice(
                &mut client_end,
                &mut guest_end,
                4096,
                Duration::from_secs(60),
                Duration::from_secs(3600),
                async {
                    let _ = stopped.await;
                    End::Revoked
                },
            )
            .await
        });
        client.write_all(b"abc").await.unwrap();
        let mut buf = [0u8; 3];
        guest.read_exact(&mut buf).await.unwrap();
        stop.send(()).unwrap();
        let outcome = tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(outcome.end.unwrap(), End::Revoked);
        assert_eq!(outcome.to_guest, 3);
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

    /// Hands out (at most) one queued chunk per read, as TLS hands out one
    /// record, then is dry (pending).
    struct Chunks(std::collections::VecDeque<&'static [u8]>);

    impl AsyncRead for Chunks {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            out: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let queue = &mut self.get_mut().0;
            match queue.pop_front() {
                Some(chunk) => {
                    let n = chunk.len().min(out.remaining());
                    out.put_slice(&chunk[..n]);
                    if n < chunk.len() {
                        queue.push_front(&chunk[n..]);
                    }
                    Poll::Ready(Ok(()))
                }
                None => Poll::Pending,
            }
        }
    }

    /// Records every write it gets.
    #[derive(Default)]
    struct Writes(Vec<Vec<u8>>);

    impl AsyncWrite for Writes {
        fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            self.get_mut().0.push(buf.to_vec());
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[test]
    fn what_the_reader_has_goes_out_in_one_write_up_to_the_buffer_size() {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut reader = Chunks([&b"ab"[..], b"cd", b"ef"].into());
        let mut writer = Writes::default();
        let mut dir = Direction::new(4096);
        let mut active = false;
        let polled = dir.poll_copy(&mut cx, Pin::new(&mut reader), Pin::new(&mut writer), &mut active);
        assert!(polled.is_pending());
        assert_eq!(writer.0, vec![b"abcdef".to_vec()]);
        assert!(dir.buf.is_none(), "dry again, yet a buffer is held");

        // A full buffer is written out before reading on.
        let mut reader = Chunks([&[1u8; 3000][..], &[2u8; 3000][..]].into());
        let mut writer = Writes::default();
        let mut dir = Direction::new(4096);
        let _ = dir.poll_copy(&mut cx, Pin::new(&mut reader), Pin::new(&mut writer), &mut active);
        let sizes: Vec<usize> = writer.0.iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![4096, 1904]);
        assert_eq!(dir.copied, 6000);
    }
}
