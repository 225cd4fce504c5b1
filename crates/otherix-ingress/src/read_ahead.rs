//! Reads the client's TCP stream in large chunks on behalf of TLS.
//!
//! rustls asks its transport for at most 4 KiB at a time, so a 16 KiB
//! record costs four or five `recv` calls, and each one does TCP's receive
//! bookkeeping (window updates, ACKs: with client and gateway on one host
//! the ACK's delivery runs in that same call). Under rustls this adapter
//! reads up to a splice buffer's worth per call and hands it out from
//! memory. Its buffer comes from the spare list and goes back as soon as it
//! is empty: an idle connection holds none. Writes pass straight through.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::spare;

pub(crate) struct ReadAhead<S> {
    inner: S,
    size: usize,
    /// Held only while `pos < filled`.
    buf: Option<Box<[u8]>>,
    pos: usize,
    filled: usize,
}

impl<S> ReadAhead<S> {
    /// Reads `inner` up to `size` bytes at a time.
    pub(crate) fn new(inner: S, size: usize) -> ReadAhead<S> {
        ReadAhead {
            inner,
            size,
            buf: None,
            pos: 0,
            filled: 0,
        }
    }

    /// Copies what is buffered into `out`; gives the buffer back once empty.
    fn hand_out(&mut self, out: &mut ReadBuf<'_>) {
        if let Some(buf) = &self.buf {
            let n = out.remaining().min(self.filled - self.pos);
            out.put_slice(&buf[self.pos..self.pos + n]);
            self.pos += n;
        }
        if self.pos == self.filled {
            self.release();
        }
    }

    fn release(&mut self) {
        (self.pos, self.filled) = (0, 0);
        if let Some(buf) = self.buf.take() {
            spare::give(buf);
        }
    }
}

impl<S> Drop for ReadAhead<S> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            spare::give(buf);
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ReadAhead<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.pos < this.filled {
            this.hand_out(out);
            return Poll::Ready(Ok(()));
        }
        if out.remaining() >= this.size {
            // As large as ours: nothing to gain from going through it.
            return Pin::new(&mut this.inner).poll_read(cx, out);
        }
        let size = this.size;
        let buf = this.buf.get_or_insert_with(|| spare::take(size));
        let mut rb = ReadBuf::new(buf);
        match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
            Poll::Ready(Ok(())) => {
                (this.pos, this.filled) = (0, rb.filled().len());
                // Zero bytes (end of stream) hand out nothing: the same end.
                this.hand_out(out);
                Poll::Ready(Ok(()))
            }
            other => {
                this.release();
                other
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ReadAhead<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn small_reads_are_served_from_one_large_read_and_the_buffer_goes_back() {
        let (mut peer, inner) = duplex(1 << 16);
        let mut ra = ReadAhead::new(inner, 4096);
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        peer.write_all(&data).await.unwrap();
        peer.shutdown().await.unwrap();
        let mut got = Vec::new();
        let mut small = [0u8; 1000];
        loop {
            let n = ra.read(&mut small).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&small[..n]);
            if ra.pos < ra.filled {
                assert!(ra.buf.is_some(), "unread bytes keep their buffer");
            } else {
                assert!(ra.buf.is_none(), "an empty read-ahead holds no buffer");
            }
        }
        assert_eq!(got, data);
        assert!(ra.buf.is_none());
    }

    #[tokio::test]
    async fn an_idle_stream_holds_no_buffer_and_writes_pass_through() {
        let (mut peer, inner) = duplex(1024);
        let mut ra = ReadAhead::new(inner, 4096);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut small = [0u8; 16];
        let mut rb = ReadBuf::new(&mut small);
        assert!(Pin::new(&mut ra).poll_read(&mut cx, &mut rb).is_pending());
        assert!(ra.buf.is_none(), "nothing to read, yet a buffer is held");
        ra.write_all(b"hello").await.unwrap();
        let mut back = [0u8; 5];
        peer.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"hello");
    }
}
