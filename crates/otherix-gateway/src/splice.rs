//! Copies bytes both ways between the client's stream and the guest's, in
//! one task, with large buffers, half-close and an idle timeout.
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
    buf: Box<[u8]>,
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
            buf: vec![0; size].into_boxed_slice(),
            pos: 0,
            filled: 0,
            copied: 0,
            read_done: false,
            need_flush: false,
            done: false,
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
                let mut rb = ReadBuf::new(&mut self.buf);
                match reader.as_mut().poll_read(cx, &mut rb) {
                    Poll::Ready(Ok(())) => {
                        self.pos = 0;
                        self.filled = rb.filled().len();
                        if self.filled == 0 {
                            self.read_done = true;
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
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {
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
            while self.pos < self.filled {
                let n = ready!(writer.as_mut().poll_write(cx, &self.buf[self.pos..self.filled]))?;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                self.pos += n;
                self.copied += n as u64;
                self.need_flush = true;
            }
            if self.read_done {
                ready!(writer.as_mut().poll_flush(cx))?;
                ready!(writer.as_mut().poll_shutdown(cx))?;
                return Poll::Ready(Ok(()));
            }
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
}
