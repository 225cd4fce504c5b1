//! A small QMP (QEMU Machine Protocol) client: one JSON object per line over
//! the guest's Unix socket. The agent uses it to ask a guest's state, to stop
//! it cleanly and (for migration) to drive QEMU's migration commands.

use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Duration;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::UnixStream;

/// Longest a QMP exchange may take before the guest is taken as unresponsive.
const QMP_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest line accepted from QEMU (its answers are small).
const MAX_LINE: usize = 1 << 20;

/// Why a QMP exchange failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QmpError {
    #[error("QMP socket {path}: {source}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("QMP: {0}")]
    Io(#[from] std::io::Error),
    /// QEMU answered with an error.
    #[error("QEMU refused {command}: {desc}")]
    Refused { command: String, desc: String },
    /// QEMU said something that is not QMP.
    #[error("QMP: {0}")]
    Protocol(String),
    #[error("QMP: no answer within {0:?}")]
    Timeout(Duration),
}

/// A QMP session in command mode.
pub struct Qmp {
    reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    writer: tokio::net::unix::OwnedWriteHalf,
    /// The line being read.
    line: Vec<u8>,
}

impl Qmp {
    /// Connects, reads the greeting and enters command mode.
    pub async fn connect(path: &Path) -> Result<Self, QmpError> {
        let stream = tokio::time::timeout(QMP_TIMEOUT, UnixStream::connect(path))
            .await
            .map_err(|_| QmpError::Timeout(QMP_TIMEOUT))?
            .map_err(|source| QmpError::Connect {
                path: path.display().to_string(),
                source,
            })?;
        Self::start(stream).await
    }

    /// Reads the greeting on a connected stream and enters command mode.
    pub(crate) async fn start(stream: UnixStream) -> Result<Self, QmpError> {
        let (r, w) = stream.into_split();
        let mut qmp = Self {
            reader: BufReader::new(r),
            writer: w,
            line: Vec::new(),
        };
        let greeting = qmp.read_message().await?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!("expected a greeting, got {greeting}")));
        }
        qmp.execute("qmp_capabilities", None).await?;
        Ok(qmp)
    }

    /// Runs one command and returns its `return` value (events in between are skipped).
    pub async fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        let mut msg = json!({ "execute": command });
        if let Some(args) = arguments {
            msg["arguments"] = args;
        }
        let mut line = serde_json::to_vec(&msg).map_err(|e| QmpError::Protocol(e.to_string()))?;
        line.push(b'\n');
        tokio::time::timeout(QMP_TIMEOUT, self.writer.write_all(&line))
            .await
            .map_err(|_| QmpError::Timeout(QMP_TIMEOUT))??;
        self.answer(command).await
    }

    /// Hands QEMU a copy of `fd` under `name` (`getfd`: the descriptor goes
    /// with the command's first byte, as `SCM_RIGHTS`), for a command that
    /// names it (`fd:NAME`). A name QEMU already holds is replaced.
    pub async fn send_fd(&mut self, name: &str, fd: &impl AsRawFd) -> Result<(), QmpError> {
        let msg = json!({ "execute": "getfd", "arguments": { "fdname": name } });
        let mut line = serde_json::to_vec(&msg).map_err(|e| QmpError::Protocol(e.to_string()))?;
        line.push(b'\n');
        let stream: &UnixStream = self.writer.as_ref();
        let fds = [fd.as_raw_fd()];
        let sent = tokio::time::timeout(QMP_TIMEOUT, async {
            loop {
                stream.writable().await?;
                match stream.try_io(Interest::WRITABLE, || {
                    let cmsg = [ControlMessage::ScmRights(&fds)];
                    sendmsg::<()>(
                        stream.as_raw_fd(),
                        &[IoSlice::new(&line)],
                        &cmsg,
                        MsgFlags::MSG_NOSIGNAL,
                        None,
                    )
                    .map_err(std::io::Error::from)
                }) {
                    Ok(n) => return Ok::<usize, std::io::Error>(n),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Err(e),
                }
            }
        })
        .await
        .map_err(|_| QmpError::Timeout(QMP_TIMEOUT))??;
        // The descriptor went with the first byte; the rest is plain.
        tokio::time::timeout(QMP_TIMEOUT, self.writer.write_all(&line[sent..]))
            .await
            .map_err(|_| QmpError::Timeout(QMP_TIMEOUT))??;
        self.answer("getfd").await.map(|_| ())
    }

    /// Reads up to the answer to `command` (events in between are skipped).
    async fn answer(&mut self, command: &str) -> Result<Value, QmpError> {
        loop {
            let answer = self.read_message().await?;
            if answer.get("event").is_some() {
                continue;
            }
            if let Some(ret) = answer.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = answer.get("error") {
                return Err(QmpError::Refused {
                    command: command.to_owned(),
                    desc: err["desc"].as_str().unwrap_or("unknown error").to_owned(),
                });
            }
            return Err(QmpError::Protocol(format!("unexpected answer {answer}")));
        }
    }

    /// The guest's run state (`running`, `paused`, `inmigrate`, `postmigrate`...).
    pub async fn status(&mut self) -> Result<String, QmpError> {
        let s = self.execute("query-status", None).await?;
        s["status"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| QmpError::Protocol(format!("query-status without a status: {s}")))
    }

    /// Waits up to `wait` for QEMU's next event (`{"event": NAME, "data": …}`);
    /// `None` when none came in that time. Only for a session that sends no
    /// command meanwhile: an answer read here is a protocol error.
    pub async fn next_event(&mut self, wait: Duration) -> Result<Option<Value>, QmpError> {
        match self.read_message_within(wait).await {
            Ok(msg) if msg.get("event").is_some() => Ok(Some(msg)),
            Ok(msg) => Err(QmpError::Protocol(format!("expected an event, got {msg}"))),
            Err(QmpError::Timeout(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn read_message(&mut self) -> Result<Value, QmpError> {
        self.read_message_within(QMP_TIMEOUT).await
    }

    /// One line. What a wait that ran out had read of a line stays in
    /// `self.line` for the next call (`read_until` keeps what it read).
    async fn read_message_within(&mut self, wait: Duration) -> Result<Value, QmpError> {
        let room = (MAX_LINE as u64).saturating_sub(self.line.len() as u64);
        tokio::time::timeout(
            wait,
            (&mut self.reader).take(room).read_until(b'\n', &mut self.line),
        )
        .await
        .map_err(|_| QmpError::Timeout(wait))??;
        if self.line.last() != Some(&b'\n') {
            // Short of the limit, the read ended at the end of the stream.
            let why = if self.line.len() < MAX_LINE {
                "QEMU closed the socket".to_owned()
            } else {
                format!("a line longer than {MAX_LINE} bytes")
            };
            return Err(QmpError::Protocol(why));
        }
        let msg =
            serde_json::from_slice(&self.line).map_err(|e| QmpError::Protocol(format!("not JSON ({e})")));
        self.line.clear();
        msg
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A QMP peer at the other end of a socket pair: greets, acknowledges
    /// `qmp_capabilities`, and hands its end back.
    async fn peer() -> (Qmp, UnixStream) {
        let (ours, mut s) = UnixStream::pair().unwrap();
        let server = tokio::spawn(async move {
            s.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
                .await
                .unwrap();
            let mut buf = [0u8; 256];
            let n = s.read(&mut buf).await.unwrap();
            assert!(String::from_utf8_lossy(&buf[..n]).contains("qmp_capabilities"));
            s.write_all(b"{\"return\": {}}\n").await.unwrap();
            s
        });
        let qmp = Qmp::start(ours).await.unwrap();
        (qmp, server.await.unwrap())
    }

    #[tokio::test]
    async fn an_event_cut_by_a_wait_that_ran_out_is_read_whole_by_the_next() {
        let (mut qmp, mut s) = peer().await;
        assert!(qmp.next_event(Duration::from_millis(20)).await.unwrap().is_none());
        // Half an event, then the wait runs out: what was read stays.
        s.write_all(b"{\"event\": \"MIGRATION\", \"data\": {\"sta")
            .await
            .unwrap();
        assert!(qmp.next_event(Duration::from_millis(50)).await.unwrap().is_none());
        s.write_all(b"tus\": \"pre-switchover\"}}\n{\"event\": \"STOP\"}\n")
            .await
            .unwrap();
        let event = qmp.next_event(Duration::from_secs(5)).await.unwrap().unwrap();
        assert_eq!(event["data"]["status"], "pre-switchover");
        let event = qmp.next_event(Duration::from_secs(5)).await.unwrap().unwrap();
        assert_eq!(event["event"], "STOP");
    }

    #[tokio::test]
    async fn an_answer_where_an_event_was_awaited_and_a_closed_socket_are_errors() {
        let (mut qmp, mut s) = peer().await;
        s.write_all(b"{\"return\": {}}\n").await.unwrap();
        let err = qmp.next_event(Duration::from_secs(5)).await.unwrap_err();
        assert!(err.to_string().contains("expected an event"), "{err}");
        s.write_all(b"{\"event\": \"ST").await.unwrap();
        drop(s);
        let err = qmp.next_event(Duration::from_secs(5)).await.unwrap_err();
        assert!(err.to_string().contains("QEMU closed the socket"), "{err}");
    }

    /// The peer reads `getfd` as QEMU does: the descriptor arrives with the
    /// command's bytes, a copy of the same open file.
    #[tokio::test]
    async fn a_descriptor_goes_to_qemu_with_getfd() {
        use nix::sys::socket::{recvmsg, ControlMessageOwned};
        use std::io::{IoSliceMut, Read, Write};

        let (mut qmp, s) = peer().await;
        let (read_end, write_end) = nix::unistd::pipe().unwrap();
        let server = tokio::task::spawn_blocking(move || {
            let s = s.into_std().unwrap();
            s.set_nonblocking(false).unwrap();
            let mut buf = [0u8; 256];
            let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
            let (n, fds) = {
                let mut iov = [IoSliceMut::new(&mut buf)];
                let msg =
                    recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::empty()).unwrap();
                let fds: Vec<_> = msg
                    .cmsgs()
                    .unwrap()
                    .filter_map(|c| match c {
                        ControlMessageOwned::ScmRights(fds) => Some(fds),
                        _ => None,
                    })
                    .flatten()
                    .collect();
                (msg.bytes, fds)
            };
            let mut text = String::from_utf8_lossy(&buf[..n]).into_owned();
            let mut s = s;
            while !text.ends_with('\n') {
                let mut more = [0u8; 256];
                let m = s.read(&mut more).unwrap();
                assert!(m > 0, "the command ended early: {text}");
                text.push_str(&String::from_utf8_lossy(&more[..m]));
            }
            s.write_all(b"{\"return\": {}}\n").unwrap();
            (text, fds)
        });
        qmp.send_fd("migout-sock", &write_end).await.unwrap();
        let (text, fds) = server.await.unwrap();
        let cmd: Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(
            cmd,
            json!({ "execute": "getfd", "arguments": { "fdname": "migout-sock" } })
        );
        assert_eq!(fds.len(), 1, "no descriptor came with getfd");
        let link = |fd: std::os::fd::RawFd| std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap();
        assert_eq!(
            link(fds[0]),
            link(write_end.as_raw_fd()),
            "another file came with getfd"
        );
        assert_ne!(fds[0], write_end.as_raw_fd(), "a copy, not the same number");
        let _ = nix::unistd::close(fds[0]);
        drop((read_end, write_end));
    }

    #[tokio::test]
    async fn a_line_longer_than_the_limit_is_refused() {
        let (mut qmp, mut s) = peer().await;
        let writer = tokio::spawn(async move {
            let long = vec![b'x'; MAX_LINE + 10];
            let _ = s.write_all(&long).await;
            s
        });
        let err = qmp.next_event(Duration::from_secs(10)).await.unwrap_err();
        assert!(err.to_string().contains("longer than"), "{err}");
        drop(writer);
    }
}
