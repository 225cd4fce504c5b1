//! Fuzzes the client side of the relay's framing (`relay_tunnel`): the
//! bytes the control plane sends after the upgrade, as WebSocket frames,
//! through the tunnel's reads, then a write and a shutdown. The fuzzer's
//! bytes go through the tunnel (over a fake socket that hands them out in
//! fuzzer-chosen pieces, then ends) and through tungstenite's synchronous
//! reader with the same limits, the reference: the tunnel must yield
//! exactly the payloads of the binary frames before the end of the stream
//! (an empty frame or Close 1000), and fail (never end cleanly) on a text
//! frame, another Close, broken framing or a cut connection. A failed
//! tunnel refuses writes. Never a panic, never a hang.
#![no_main]

use std::io::{self, Cursor, Read, Write};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use otherix_proto::relay::MAX_FRAME;
use otherix_client::tunnel::relay::{over_upgraded, RelayOptions};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Message, WebSocket};

/// The relay's end of the connection: its bytes handed out `chunk` at a
/// time, then the end of the stream; whatever the tunnel writes is dropped.
struct FakeSocket {
    bytes: Cursor<Vec<u8>>,
    chunk: usize,
}

impl AsyncRead for FakeSocket {
    fn poll_read(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let n = buf.remaining().min(this.chunk);
        let mut piece = vec![0u8; n];
        let got = Read::read(&mut this.bytes, &mut piece)?;
        buf.put_slice(&piece[..got]);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for FakeSocket {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The same bytes for the synchronous reference.
struct SyncSocket(Cursor<Vec<u8>>);

impl Read for SyncSocket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        Read::read(&mut self.0, buf)
    }
}

impl Write for SyncSocket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What the tunnel must make of the relay's bytes: the data, and whether
/// the stream ended cleanly.
fn reference(bytes: &[u8]) -> (Vec<u8>, bool) {
    // The tunnel's limits (`relay_tunnel::over_upgraded`).
    let config = WebSocketConfig::default()
        .read_buffer_size(64 * 1024)
        .write_buffer_size(0)
        .max_frame_size(Some(MAX_FRAME * 2))
        .max_message_size(Some(MAX_FRAME * 2));
    let mut ws = WebSocket::from_raw_socket(SyncSocket(Cursor::new(bytes.to_vec())), Role::Client, Some(config));
    let mut data = Vec::new();
    loop {
        match ws.read() {
            Ok(Message::Binary(b)) if b.is_empty() => return (data, true),
            Ok(Message::Binary(b)) => data.extend_from_slice(&b),
            Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_)) => {}
            Ok(Message::Close(frame)) => {
                let normal = frame.is_some_and(|f| f.code == CloseCode::Normal);
                return (data, normal);
            }
            Ok(Message::Text(_)) | Err(_) => return (data, false),
        }
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime")
    })
}

fuzz_target!(|data: &[u8]| {
    // First byte: how the socket hands the bytes out, and the frame size.
    let Some((&knobs, bytes)) = data.split_first() else {
        return;
    };
    let chunk = [1, 2, 3, 7, 64, 1024, 4096, usize::MAX][usize::from(knobs & 7)];
    let max_frame = [1, 5, 4096, MAX_FRAME][usize::from(knobs >> 3 & 3)];
    let (expected, clean) = reference(bytes);
    runtime().block_on(async {
        let socket = FakeSocket {
            bytes: Cursor::new(bytes.to_vec()),
            chunk,
        };
        let options = RelayOptions {
            silence: Duration::from_secs(3600),
            max_frame,
        };
        let mut tunnel = over_upgraded(socket, options).await;
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), tunnel.read_to_end(&mut got))
            .await
            .expect("the tunnel never waits on bytes it already has");
        assert_eq!(got, expected, "the tunnel's data is the binary frames' payloads");
        assert_eq!(read.is_ok(), clean, "{read:?}");
        let wrote = tunnel.write_all(b"after").await;
        if !clean {
            assert!(wrote.is_err(), "a failed tunnel refuses writes");
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), tunnel.shutdown())
            .await
            .expect("shutdown ends: the relay's bytes have run out");
    });
});
