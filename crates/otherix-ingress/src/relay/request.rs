//! The agent's side of the relay's line protocol (`otherix_proto::relay`):
//! reading the control plane's `RELAY <vm_id> <port>` line without
//! consuming a byte after it, and the `ERR <reason>` answer.

use std::net::SocketAddrV4;

use otherix_proto::relay;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::info;

use crate::dial::DialError;

/// Why a request gets `ERR`: the reason line the CP passes on.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refusal {
    /// The control plane's fault: the line is not `RELAY <hex id> <port>`.
    #[error("malformed request")]
    Malformed,
    /// The id names no guest on a bridge of this node (now).
    #[error("vm {0} is not a guest on a bridge of this node")]
    UnknownVm(String),
    /// The guest's fault (or its network's): the dial failed.
    #[error("cannot reach {0}: {1}")]
    Unreachable(SocketAddrV4, DialError),
    /// A resume of a session this node does not hold (ended, or never here).
    #[error("{0}")]
    NotResumable(String),
    /// The id names no QEMU guest running on this node (a console request).
    #[error("vm {0} has no serial console on this node")]
    NoConsole(String),
    /// The guest's console socket did not take the connection (QEMU ended,
    /// or another console session holds it).
    #[error("the console of vm {0} is not available: {1}")]
    ConsoleBusy(String, std::io::ErrorKind),
}

/// Reads the request line (without its `\n`), one byte at a time so that
/// nothing after it is consumed; `None` when it is too long or not UTF-8.
pub(crate) async fn read_line<S: AsyncRead + Unpin>(mut stream: S) -> std::io::Result<(S, Option<String>)> {
    let mut line = Vec::with_capacity(64);
    let mut byte = [0u8; 1];
    loop {
        if stream.read(&mut byte).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if byte[0] == b'\n' {
            return Ok((stream, String::from_utf8(line).ok()));
        }
        if line.len() >= relay::MAX_LINE {
            return Ok((stream, None));
        }
        line.push(byte[0]);
    }
}

/// Logs `refusal`, answers `ERR <reason>` and closes.
pub(crate) async fn answer_err<S: AsyncWrite + Unpin>(stream: &mut S, refusal: Refusal) {
    info!(reason = %refusal, "relay request refused");
    let line = format!("ERR {refusal}\n");
    let _ = stream.write_all(line.as_bytes()).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_line_is_read_up_to_its_newline_and_no_further() {
        let (stream, line) = read_line(&b"RELAY ab 22\npayload"[..]).await.unwrap();
        assert_eq!(line.as_deref(), Some("RELAY ab 22"));
        assert_eq!(stream, b"payload", "the tunnel's first bytes are left unread");
        let long = format!("RELAY {}\n", "9".repeat(relay::MAX_LINE));
        assert_eq!(read_line(long.as_bytes()).await.unwrap().1, None);
        assert!(
            read_line(&b"RELAY ab"[..]).await.is_err(),
            "ended before its newline"
        );
    }
}
