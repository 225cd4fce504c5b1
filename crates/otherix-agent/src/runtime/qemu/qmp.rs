//! A small QMP (QEMU Machine Protocol) client: one JSON object per line over
//! the guest's Unix socket. The agent uses it to ask a guest's state, to stop
//! it cleanly and (for migration) to drive QEMU's migration commands.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
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
        let (r, w) = stream.into_split();
        let mut qmp = Self {
            reader: BufReader::new(r),
            writer: w,
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

    async fn read_message(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        let n = tokio::time::timeout(
            QMP_TIMEOUT,
            (&mut self.reader).take(MAX_LINE as u64).read_line(&mut line),
        )
        .await
        .map_err(|_| QmpError::Timeout(QMP_TIMEOUT))??;
        if n == 0 {
            return Err(QmpError::Protocol("QEMU closed the socket".into()));
        }
        serde_json::from_str(&line).map_err(|e| QmpError::Protocol(format!("not JSON ({e})")))
    }
}
