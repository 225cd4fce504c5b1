//! The resumable relay stream: what lets a relay session outlive the
//! connections that carry it (a client's dropped Wi-Fi, a control plane
//! restarted or a replica gone). No IO: the frames, their two encodings, and
//! the sequence bookkeeping both ends run.
//!
//! The two ends are the **client** and the **agent** holding the guest's TCP
//! connection; the control plane between them forwards frames and keeps no
//! byte of the stream, so any replica can carry a session after another:
//!
//! ```text
//! client ══WebSocket (binary message = one frame)══ CP ══TLS (u32 length + frame)══ agent ── guest
//!        ◀──────────── seq/ack end to end: each end keeps what the other has not acknowledged ──▶
//! ```
//!
//! A client asks for it with `Sec-WebSocket-Protocol: `[`PROTOCOL`]; a
//! control plane that answers without selecting it speaks the plain relay
//! framing (`crate::relay`). The 101 answer carries the session's id
//! ([`HEADER_SESSION`]), a resume secret ([`HEADER_SECRET`], shown once; the
//! store keeps its SHA-256) and the grace period ([`HEADER_GRACE`]).
//!
//! **Frames** ([`Frame`]): `Data` (bytes of the stream), `Ack(n)` (the
//! sender has received `n` units of the other direction), `End` (the
//! sender's direction ended: a half-close, TCP's FIN; it takes one unit of
//! the sequence space, like a FIN, so it is acknowledged and resent like
//! data), `Close(code, reason)` (the session is over for good, with the
//! reason; only the agent and the control plane send it — the control plane
//! turns one into a WebSocket Close for the client). On the WebSocket a
//! frame is one binary message: its type byte, then its body. Towards the
//! agent each is preceded by its length (`u32`, big-endian).
//!
//! **Sequence** ([`Outbox`], [`Inbox`]): each end counts the units it sent
//! and received. It keeps what it sent until the other acknowledges it, at
//! most [`DEFAULT_BUFFER`] (configurable): a sender with that much
//! unacknowledged stops reading its source (flow control; nothing is ever
//! dropped). A receiver acknowledges what reached its consumer (see
//! [`Inbox::ack_due_for`]), at least every eighth of the bound and a moment
//! after the last delivery.
//!
//! **Resume**: the client reconnects (to any replica) with its principal's
//! credentials, the session id, the secret and how much it has received
//! ([`HEADER_RECEIVED`]); the control plane checks them, asks the agent
//! (`RESUME <id> <received>`), and answers with what the agent has received
//! ([`HEADER_RECEIVED`] on the 101). Each end rewinds its [`Outbox`] to the
//! other's count and sends from there: byte-exact, nothing twice. A count
//! outside what an end still keeps (below what the other once
//! acknowledged, or beyond what was sent) cannot be served and ends the
//! session. The agent keeps a session with no connection for the grace
//! period ([`DEFAULT_GRACE`]), then ends it.

use std::collections::VecDeque;
use std::time::Duration;

use bytes::{Buf, Bytes};

/// The WebSocket subprotocol of the resumable stream.
pub const PROTOCOL: &str = "otherix.relay.resumable.v1";
/// 101 answer: the session's id.
pub const HEADER_SESSION: &str = "otherix-relay-session";
/// 101 answer: the resume secret (shown once; stored hashed).
pub const HEADER_SECRET: &str = "otherix-relay-resume-secret";
/// 101 answer: how long the session waits for a resume, in milliseconds.
pub const HEADER_GRACE: &str = "otherix-relay-grace-ms";
/// Resume request: the id of the session to resume.
pub const HEADER_RESUME: &str = "otherix-relay-resume";
/// Resume request: what the client received; its 101 answer: what the
/// agent received (units: bytes, plus one for an `End`).
pub const HEADER_RECEIVED: &str = "otherix-relay-received";
/// Resume request, optional: why the client reconnects (for the audit
/// trail; at most [`MAX_CAUSE`] bytes of printable ASCII are kept).
pub const HEADER_CAUSE: &str = "otherix-relay-resume-cause";
/// Longest resume cause kept.
pub const MAX_CAUSE: usize = 200;
/// How long a session with no connection waits for a resume, by default.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(60);
/// Longest grace period a control plane accepts (`--relay-resume-grace`).
pub const MAX_GRACE: Duration = Duration::from_secs(600);
/// What each end keeps unacknowledged, by default.
pub const DEFAULT_BUFFER: usize = 8 * 1024 * 1024;
/// Largest data frame either end sends (they accept twice that).
pub const MAX_DATA: usize = crate::relay::MAX_FRAME;
/// Close code (WebSocket and `Close` frames): connect again and resume —
/// the control plane carrying the session is going away; the session waits.
pub const CLOSE_RESUME: u16 = 4002;
/// Close code: the session was resumed on another connection; this one is
/// stale (the client, or the control plane carrying it, lost track of it).
pub const CLOSE_TAKEN_OVER: u16 = 4003;

/// A frame's type byte: data.
pub const T_DATA: u8 = 0;
/// A frame's type byte: acknowledgement.
pub const T_ACK: u8 = 1;
/// A frame's type byte: end of a direction.
pub const T_END: u8 = 2;
/// A frame's type byte: the session is over.
pub const T_CLOSE: u8 = 3;
/// A frame's type byte: a piece of the session's handover to another node
/// (agent → control plane only; an empty one ends it).
pub const T_MOVE: u8 = 4;
/// Largest handover a control plane takes (the agent's buffer bound, the
/// guest connection's queues, and room).
pub const MAX_HANDOVER: usize = 600 * 1024 * 1024;

/// One frame of the resumable stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Bytes of the stream (never empty).
    Data(Bytes),
    /// The sender has received this many units of the other direction.
    Ack(u64),
    /// The sender's direction ended (one unit of the sequence).
    End,
    /// The session is over: a WebSocket close code and a reason.
    Close { code: u16, reason: String },
    /// A piece of the session's handover to the node its guest moves to
    /// (agent → control plane; never sent to a client). Empty: the end.
    Move(Bytes),
}

/// A frame that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("empty relay frame")]
    Empty,
    #[error("unknown relay frame type {0}")]
    UnknownType(u8),
    #[error("malformed relay {0} frame")]
    Malformed(&'static str),
    #[error("relay frame of {0} bytes is over the limit")]
    TooLarge(usize),
}

impl Frame {
    /// The frame as one WebSocket binary message: type byte, body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut out);
        out
    }

    fn encoded_len(&self) -> usize {
        1 + match self {
            Frame::Data(b) => b.len(),
            Frame::Ack(_) => 8,
            Frame::End => 0,
            Frame::Close { reason, .. } => 2 + reason.len(),
            Frame::Move(b) => b.len(),
        }
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            Frame::Data(b) => {
                out.push(T_DATA);
                out.extend_from_slice(b);
            }
            Frame::Ack(n) => {
                out.push(T_ACK);
                out.extend_from_slice(&n.to_be_bytes());
            }
            Frame::End => out.push(T_END),
            Frame::Close { code, reason } => {
                out.push(T_CLOSE);
                out.extend_from_slice(&code.to_be_bytes());
                // A reason is one line of at most 123 bytes (a WebSocket
                // Close's room), cut at a character boundary.
                let mut end = reason.len().min(123);
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                out.extend_from_slice(&reason.as_bytes()[..end]);
            }
            Frame::Move(b) => {
                out.push(T_MOVE);
                out.extend_from_slice(b);
            }
        }
    }

    /// The frame with its length before it (`u32`, big-endian), as it goes
    /// between the control plane and the agent.
    pub fn encode_wire(&self, out: &mut Vec<u8>) {
        let len = self.encoded_len();
        out.reserve(4 + len);
        out.extend_from_slice(&(len as u32).to_be_bytes());
        let start = out.len();
        self.encode_into(out);
        // A Close's reason may have been cut: fix the length.
        let written = (out.len() - start) as u32;
        out[start - 4..start].copy_from_slice(&written.to_be_bytes());
    }

    /// Parses one WebSocket binary message (or a wire frame's body).
    pub fn decode(msg: Bytes) -> Result<Frame, FrameError> {
        let Some(&t) = msg.first() else {
            return Err(FrameError::Empty);
        };
        let body = msg.slice(1..);
        match t {
            T_DATA if body.is_empty() => Err(FrameError::Malformed("data")),
            T_DATA if body.len() > MAX_DATA * 2 => Err(FrameError::TooLarge(body.len())),
            T_DATA => Ok(Frame::Data(body)),
            T_ACK => {
                let n: [u8; 8] = body[..].try_into().map_err(|_| FrameError::Malformed("ack"))?;
                Ok(Frame::Ack(u64::from_be_bytes(n)))
            }
            T_END if body.is_empty() => Ok(Frame::End),
            T_END => Err(FrameError::Malformed("end")),
            T_CLOSE => {
                if body.len() < 2 || body.len() > 2 + 123 {
                    return Err(FrameError::Malformed("close"));
                }
                let code = u16::from_be_bytes([body[0], body[1]]);
                let reason = String::from_utf8_lossy(&body[2..]).into_owned();
                Ok(Frame::Close { code, reason })
            }
            T_MOVE if body.len() > MAX_DATA * 2 => Err(FrameError::TooLarge(body.len())),
            T_MOVE => Ok(Frame::Move(body)),
            other => Err(FrameError::UnknownType(other)),
        }
    }

    /// Whether this frame takes units of the sequence (data, end).
    pub fn units(&self) -> u64 {
        match self {
            Frame::Data(b) => b.len() as u64,
            Frame::End => 1,
            _ => 0,
        }
    }
}

/// Cuts wire frames (`u32` length, frame) out of the bytes read so far. No
/// IO: feed it what a read returned ([`WireReader::buffer`]), take frames.
#[derive(Debug, Default)]
pub struct WireReader {
    buf: bytes::BytesMut,
}

impl WireReader {
    /// Where the next read goes (reserve room first).
    pub fn buffer(&mut self) -> &mut bytes::BytesMut {
        if self.buf.capacity() - self.buf.len() < 16 * 1024 {
            self.buf.reserve(MAX_DATA + 64);
        }
        &mut self.buf
    }

    /// The next whole frame read, if any.
    pub fn next_frame(&mut self) -> Option<Result<Frame, FrameError>> {
        if self.buf.len() < 4 {
            return None;
        }
        let len = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > MAX_DATA * 2 + 1 {
            return Some(Err(FrameError::TooLarge(len)));
        }
        if self.buf.len() < 4 + len {
            return None;
        }
        let _ = self.buf.split_to(4);
        let body = self.buf.split_to(len).freeze();
        Some(Frame::decode(body))
    }

    /// The next whole frame read, undecoded (its type byte, then its
    /// body): what the control plane forwards as one WebSocket message.
    pub fn next_raw(&mut self) -> Option<Result<Bytes, FrameError>> {
        if self.buf.len() < 4 {
            return None;
        }
        let len = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > MAX_DATA * 2 + 1 {
            return Some(Err(FrameError::TooLarge(len)));
        }
        if len == 0 {
            return Some(Err(FrameError::Empty));
        }
        if self.buf.len() < 4 + len {
            return None;
        }
        let _ = self.buf.split_to(4);
        Some(Ok(self.buf.split_to(len).freeze()))
    }

    /// Bytes read and not yet a whole frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }
}

/// Why a stream cannot go on from where the other end asks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SeqError {
    #[error("the peer acknowledged {acked} units but only {sent} were sent")]
    AckBeyondSent { acked: u64, sent: u64 },
    #[error(
        "cannot resume from unit {from}: this end keeps only units {kept_from}..{sent} (the buffer bound passed, or the peer lost what it acknowledged)"
    )]
    NotKept { from: u64, kept_from: u64, sent: u64 },
    #[error("data after the end of the stream")]
    DataAfterEnd,
}

/// Most pieces (reads or writes of the source) an [`Outbox`] keeps.
pub const MAX_PIECES: usize = 4096;

/// What one end sent and keeps until it is acknowledged.
#[derive(Debug)]
pub struct Outbox {
    /// Unacknowledged data, oldest first; `base` is the first's offset.
    kept: VecDeque<Bytes>,
    kept_bytes: usize,
    base: u64,
    /// Units queued (the data's bytes, and 1 once ended).
    total: u64,
    /// Where the next frame to send starts (≤ `total`).
    next: u64,
    /// Offset of the end, once the source ended.
    end_at: Option<u64>,
    /// The highest count the peer acknowledged.
    acked: u64,
    bound: usize,
    /// Pieces ever dropped from the front of `kept`.
    dropped: u64,
    /// Where `next` was last found: a piece's index (counted as `dropped`
    /// is) and its offset. Sending walks on from there, not from the front.
    cursor: (u64, u64),
}

impl Outbox {
    /// An outbox keeping at most `bound` unacknowledged bytes.
    pub fn new(bound: usize) -> Outbox {
        Outbox {
            kept: VecDeque::new(),
            kept_bytes: 0,
            base: 0,
            total: 0,
            next: 0,
            end_at: None,
            acked: 0,
            bound: bound.max(MAX_DATA),
            dropped: 0,
            cursor: (0, 0),
        }
    }

    /// How many more bytes may be queued now (0: stop reading the source).
    /// Also none while [`MAX_PIECES`] pieces are kept: a source that
    /// trickles (a byte per read) stops at that many pieces, not at the
    /// bound's worth of them, each with its own bookkeeping.
    pub fn room(&self) -> usize {
        if self.end_at.is_some() || self.kept.len() >= MAX_PIECES {
            return 0;
        }
        self.bound.saturating_sub(self.kept_bytes)
    }

    /// Queues bytes read from the source (at most [`MAX_DATA`] per call is
    /// best: each becomes a frame).
    pub fn push(&mut self, data: Bytes) {
        if data.is_empty() || self.end_at.is_some() {
            return;
        }
        self.total += data.len() as u64;
        self.kept_bytes += data.len();
        self.kept.push_back(data);
    }

    /// The source ended: an `End` follows the data.
    pub fn end(&mut self) {
        if self.end_at.is_none() {
            self.end_at = Some(self.total);
            self.total += 1;
        }
    }

    /// Whether the source ended.
    pub fn ended(&self) -> bool {
        self.end_at.is_some()
    }

    /// The next frame to send, if any is due (data not yet sent, or the end).
    pub fn next_frame(&mut self) -> Option<Frame> {
        if self.next >= self.total {
            return None;
        }
        if Some(self.next) == self.end_at {
            self.next += 1;
            return Some(Frame::End);
        }
        // Find the piece holding `next`, from where the last was found
        // (from the front when that piece is gone, was cut, or is past
        // `next` after a rewind).
        let (mut index, mut at) = self.cursor;
        if index < self.dropped || at < self.base || at > self.next {
            (index, at) = (self.dropped, self.base);
        }
        while let Some(chunk) = self.kept.get((index - self.dropped) as usize) {
            let len = chunk.len() as u64;
            if self.next < at + len {
                self.cursor = (index, at);
                // At most MAX_DATA a frame, however the bytes were kept (a
                // handover keeps them in one piece).
                let from = (self.next - at) as usize;
                let piece = chunk.slice(from..chunk.len().min(from + MAX_DATA));
                self.next += piece.len() as u64;
                return Some(Frame::Data(piece));
            }
            at += len;
            index += 1;
        }
        None
    }

    /// The peer acknowledged `n` units: what is before it is dropped.
    pub fn ack(&mut self, n: u64) -> Result<(), SeqError> {
        if n > self.total {
            return Err(SeqError::AckBeyondSent {
                acked: n,
                sent: self.total,
            });
        }
        let data_acked = match self.end_at {
            Some(e) if n > e => e,
            _ => n,
        };
        while let Some(front) = self.kept.front() {
            let len = front.len() as u64;
            if self.base + len <= data_acked {
                self.base += len;
                self.kept_bytes -= front.len();
                self.kept.pop_front();
                self.dropped += 1;
            } else if self.base < data_acked {
                let cut = (data_acked - self.base) as usize;
                let rest = front.slice(cut..);
                self.kept_bytes -= cut;
                self.base = data_acked;
                self.kept[0] = rest;
                break;
            } else {
                break;
            }
        }
        if self.next < n {
            self.next = n;
        }
        self.acked = self.acked.max(n);
        Ok(())
    }

    /// The peer (reconnected) has received `from` units: send again from
    /// there. Everything before it is acknowledged by it.
    pub fn rewind(&mut self, from: u64) -> Result<(), SeqError> {
        if from < self.base || from > self.total {
            return Err(SeqError::NotKept {
                from,
                kept_from: self.base,
                sent: self.total,
            });
        }
        self.ack(from)?;
        self.next = from;
        Ok(())
    }

    /// Whether everything, the end included, is acknowledged.
    pub fn all_acked(&self) -> bool {
        self.end_at.is_some() && self.acked == self.total
    }

    /// The outbox as a handover carries it: its counters, and the bytes it
    /// keeps (from `base`).
    pub fn export(&self) -> (OutboxState, Vec<u8>) {
        let mut kept = Vec::with_capacity(self.kept_bytes);
        for chunk in &self.kept {
            kept.extend_from_slice(chunk);
        }
        (
            OutboxState {
                base: self.base,
                total: self.total,
                end_at: self.end_at,
                acked: self.acked,
                bound: self.bound,
            },
            kept,
        )
    }

    /// An outbox from a handover ([`Outbox::export`]); nothing is due to
    /// be sent until a resume says from where.
    pub fn import(state: &OutboxState, kept: Bytes) -> Result<Outbox, SeqError> {
        let data_end = state.end_at.unwrap_or(state.total);
        if state.base + kept.len() as u64 != data_end || state.acked > state.total || state.base > data_end {
            return Err(SeqError::NotKept {
                from: state.base,
                kept_from: state.base,
                sent: state.total,
            });
        }
        let mut out = Outbox::new(state.bound);
        out.base = state.base;
        out.total = state.total;
        out.end_at = state.end_at;
        out.acked = state.acked;
        out.next = state.total;
        out.kept_bytes = kept.len();
        if !kept.is_empty() {
            out.kept.push_back(kept);
        }
        Ok(out)
    }

    /// Units queued in all.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Bytes kept unacknowledged.
    pub fn kept_bytes(&self) -> usize {
        self.kept_bytes
    }
}

/// An [`Outbox`]'s counters, as a handover carries them.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OutboxState {
    pub base: u64,
    pub total: u64,
    pub end_at: Option<u64>,
    pub acked: u64,
    pub bound: usize,
}

/// What one end received, and when to say so.
#[derive(Debug, Default)]
pub struct Inbox {
    received: u64,
    ended: bool,
    acked: u64,
}

impl Inbox {
    /// A data frame of `len` bytes arrived (an error after the end).
    pub fn data(&mut self, len: usize) -> Result<(), SeqError> {
        if self.ended {
            return Err(SeqError::DataAfterEnd);
        }
        self.received += len as u64;
        Ok(())
    }

    /// The peer's `End` arrived: true the first time.
    pub fn end(&mut self) -> bool {
        if self.ended {
            return false;
        }
        self.ended = true;
        self.received += 1;
        true
    }

    /// Whether the peer's direction ended.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Units received in all (what a resume asks to go on from).
    pub fn received(&self) -> u64 {
        self.received
    }

    /// An `Ack` to send now, if `threshold` units arrived since the last
    /// one (or, with `threshold` 1, any at all); it counts as sent.
    pub fn ack_due(&mut self, threshold: u64) -> Option<Frame> {
        if self.received > self.acked && self.received - self.acked >= threshold.max(1) {
            self.acked = self.received;
            Some(Frame::Ack(self.received))
        } else {
            None
        }
    }

    /// An `Ack` of `delivered` units — what this end has passed on to its
    /// consumer (the guest, the user), never more than it received — to send
    /// now if `threshold` more were delivered since the last one. Acknowledging
    /// delivery rather than receipt bounds what waits here for the consumer
    /// by the peer's window, so an end can always read its connection: an
    /// acknowledgement never waits behind data that waits for a consumer.
    pub fn ack_due_for(&mut self, delivered: u64, threshold: u64) -> Option<Frame> {
        let delivered = delivered.min(self.received);
        if delivered > self.acked && delivered - self.acked >= threshold.max(1) {
            self.acked = delivered;
            Some(Frame::Ack(delivered))
        } else {
            None
        }
    }

    /// The last count acknowledged (or learnt by the peer at a resume).
    pub fn acked(&self) -> u64 {
        self.acked
    }

    /// An inbox from a handover: `received` units, the end among them or not.
    pub fn restore(received: u64, ended: bool) -> Inbox {
        Inbox {
            received,
            ended,
            acked: received,
        }
    }

    /// A fresh connection: the peer knows what we received from the resume
    /// handshake itself.
    pub fn resumed(&mut self) {
        self.acked = self.received;
    }
}

/// A session id as the resume protocol carries it: 1 to 64 of
/// `[A-Za-z0-9_-]` (a credential's `jti`).
pub fn valid_session_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The agent's request line to open a resumable session:
/// `RESUMABLE <vm_id> <port> <session_id> <grace_ms> <buffer>`; port 0
/// ([`crate::relay::CONSOLE_PORT`]) is the QEMU guest's serial console.
pub fn open_line(vm_id: &str, port: u16, session: &str, grace: Duration, buffer: usize) -> String {
    format!(
        "RESUMABLE {vm_id} {port} {session} {} {buffer}\n",
        grace.as_millis()
    )
}

/// A parsed `RESUMABLE` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenRequest<'a> {
    pub vm_id: &'a str,
    pub port: u16,
    pub session: &'a str,
    pub grace: Duration,
    pub buffer: usize,
}

/// Parses a `RESUMABLE` line (without its `\n`).
pub fn parse_open_line(line: &str) -> Option<OpenRequest<'_>> {
    let mut parts = line.strip_prefix("RESUMABLE ")?.split(' ');
    let vm_id = parts
        .next()
        .filter(|id| !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit()))?;
    // Port 0 is the guest's serial console (`relay::CONSOLE_PORT`).
    let port = parts.next()?.parse::<u16>().ok()?;
    let session = parts.next().filter(|s| valid_session_id(s))?;
    let grace = Duration::from_millis(parts.next()?.parse::<u64>().ok()?);
    let buffer = parts.next()?.parse::<usize>().ok()?;
    if grace.is_zero() || grace > MAX_GRACE || !(MAX_DATA..=256 * 1024 * 1024).contains(&buffer) {
        return None;
    }
    parts.next().is_none().then_some(OpenRequest {
        vm_id,
        port,
        session,
        grace,
        buffer,
    })
}

/// The control plane's request line to resume a session on its agent:
/// `RESUME <session_id> <received>`, what the client received.
pub fn resume_line(session: &str, received: u64) -> String {
    format!("RESUME {session} {received}\n")
}

/// Parses a `RESUME` line: `(session, received)`.
pub fn parse_resume_line(line: &str) -> Option<(&str, u64)> {
    let mut parts = line.strip_prefix("RESUME ")?.split(' ');
    let session = parts.next().filter(|s| valid_session_id(s))?;
    let received = parts.next()?.parse::<u64>().ok()?;
    parts.next().is_none().then_some((session, received))
}

/// The control plane's request line handing a session to the node its
/// guest moved to: `ADOPT <session_id> <len>`, then `len` bytes of the
/// handover the previous node sent.
pub fn adopt_line(session: &str, len: usize) -> String {
    format!("ADOPT {session} {len}\n")
}

/// Parses an `ADOPT` line: `(session, len)`.
pub fn parse_adopt_line(line: &str) -> Option<(&str, usize)> {
    let mut parts = line.strip_prefix("ADOPT ")?.split(' ');
    let session = parts.next().filter(|s| valid_session_id(s))?;
    let len = parts
        .next()?
        .parse::<usize>()
        .ok()
        .filter(|n| *n <= MAX_HANDOVER)?;
    parts.next().is_none().then_some((session, len))
}

/// The control plane's request line to end a parked session for good (a
/// revocation landed while it waited): `ABORT <session_id>`.
pub fn abort_line(session: &str) -> String {
    format!("ABORT {session}\n")
}

/// Parses an `ABORT` line: the session id.
pub fn parse_abort_line(line: &str) -> Option<&str> {
    line.strip_prefix("ABORT ").filter(|s| valid_session_id(s))
}

/// The agent's `OK <received>` answer to a `RESUME`: what it received.
pub fn parse_resumed(line: &str) -> Option<u64> {
    line.trim_end().strip_prefix("OK ")?.parse().ok()
}

/// A resume cause as the audit trail keeps it: printable ASCII, at most
/// [`MAX_CAUSE`] bytes.
pub fn clean_cause(cause: &str) -> String {
    cause
        .chars()
        .filter(|c| c.is_ascii_graphic() || *c == ' ')
        .take(MAX_CAUSE)
        .collect()
}

/// Pieces written one after the other as one buffer: a vectored write
/// takes them where they are (TLS copies them once, into its records),
/// so a frame's data goes out without being copied into a batch first.
#[derive(Debug, Default)]
pub struct Pieces {
    parts: VecDeque<Bytes>,
    len: usize,
}

impl Pieces {
    /// Adds `piece` (an empty one is not kept: a chunk is never empty
    /// while anything remains).
    pub fn push(&mut self, piece: Bytes) {
        if !piece.is_empty() {
            self.len += piece.len();
            self.parts.push_back(piece);
        }
    }

    /// Adds `frame` as the wire carries it (length, type, body): a `Data`
    /// frame's bytes as they are, behind a header of its own; any other
    /// frame encoded.
    pub fn push_frame(&mut self, frame: &Frame) {
        match frame {
            Frame::Data(b) if b.len() >= 1024 => {
                let mut head = [0u8; 5];
                head[..4].copy_from_slice(&((1 + b.len()) as u32).to_be_bytes());
                head[4] = T_DATA;
                self.push(Bytes::copy_from_slice(&head));
                self.push(b.clone());
            }
            _ => {
                let mut out = Vec::new();
                frame.encode_wire(&mut out);
                self.push(Bytes::from(out));
            }
        }
    }

    /// Everything not yet written, taken as one buffer.
    pub fn take_all(&mut self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len);
        for p in self.parts.drain(..) {
            out.extend_from_slice(&p);
        }
        self.len = 0;
        out
    }
}

impl Buf for Pieces {
    fn remaining(&self) -> usize {
        self.len
    }

    fn chunk(&self) -> &[u8] {
        self.parts.front().map(|p| &p[..]).unwrap_or(&[])
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [std::io::IoSlice<'a>]) -> usize {
        let mut n = 0;
        for (slot, part) in dst.iter_mut().zip(self.parts.iter()) {
            *slot = std::io::IoSlice::new(part);
            n += 1;
        }
        n
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.len, "advanced past the end");
        self.len -= cnt;
        while cnt > 0 {
            let front = self.parts.front_mut().expect("within len");
            if cnt >= front.len() {
                cnt -= front.len();
                self.parts.pop_front();
            } else {
                front.advance(cnt);
                cnt = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    #[test]
    fn frames_round_trip_in_both_encodings_and_junk_is_refused() {
        let frames = [
            Frame::Data(data("hello")),
            Frame::Ack(u64::MAX - 3),
            Frame::End,
            Frame::Close {
                code: 4001,
                reason: "vm web01 moved".into(),
            },
        ];
        let mut wire = Vec::new();
        for f in &frames {
            assert_eq!(Frame::decode(Bytes::from(f.encode())).unwrap(), *f);
            f.encode_wire(&mut wire);
        }
        // The wire form, fed a byte at a time, gives the same frames.
        let mut reader = WireReader::default();
        let mut got = vec![];
        for b in wire {
            reader.buffer().extend_from_slice(&[b]);
            while let Some(f) = reader.next_frame() {
                got.push(f.unwrap());
            }
        }
        assert_eq!(got, frames);
        assert_eq!(reader.buffered(), 0);
        for (bad, err) in [
            (&[][..], FrameError::Empty),
            (&[0][..], FrameError::Malformed("data")),
            (&[1, 0, 0][..], FrameError::Malformed("ack")),
            (&[2, 0][..], FrameError::Malformed("end")),
            (&[3, 1][..], FrameError::Malformed("close")),
            (&[9][..], FrameError::UnknownType(9)),
        ] {
            assert_eq!(
                Frame::decode(Bytes::copy_from_slice(bad)).unwrap_err(),
                err,
                "{bad:?}"
            );
        }
        let mut reader = WireReader::default();
        reader.buffer().extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(reader.next_frame(), Some(Err(FrameError::TooLarge(_)))));
        // A long reason is cut to what a WebSocket Close holds.
        let long = Frame::Close {
            code: 1011,
            reason: "é".repeat(100),
        };
        let mut wire = Vec::new();
        long.encode_wire(&mut wire);
        let mut reader = WireReader::default();
        reader.buffer().extend_from_slice(&wire);
        match reader.next_frame().unwrap().unwrap() {
            Frame::Close { reason, .. } => assert_eq!(reason, "é".repeat(61)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_outbox_sends_once_keeps_until_acked_and_resends_from_where_the_peer_is() {
        let mut out = Outbox::new(MAX_DATA);
        out.push(data("abc"));
        out.push(data("defg"));
        assert_eq!(out.next_frame(), Some(Frame::Data(data("abc"))));
        assert_eq!(out.next_frame(), Some(Frame::Data(data("defg"))));
        assert_eq!(out.next_frame(), None);
        out.ack(2).unwrap();
        assert_eq!(out.kept_bytes(), 5);
        // The connection dropped; the peer had received 5.
        out.rewind(5).unwrap();
        assert_eq!(out.next_frame(), Some(Frame::Data(data("fg"))));
        out.end();
        assert_eq!(out.room(), 0, "nothing more after the end");
        assert_eq!(out.next_frame(), Some(Frame::End));
        assert!(!out.all_acked());
        // Dropped again before the end arrived: the end is resent.
        out.rewind(7).unwrap();
        assert_eq!(out.next_frame(), Some(Frame::End));
        out.ack(8).unwrap();
        assert!(out.all_acked());
        assert_eq!(out.kept_bytes(), 0);
        assert_eq!(out.ack(9), Err(SeqError::AckBeyondSent { acked: 9, sent: 8 }));
    }

    /// Sends, acks and rewinds in a fixed pseudo-random mix: every frame
    /// carries exactly the bytes a model of the stream says it must.
    #[test]
    fn an_outbox_sends_the_right_bytes_through_any_mix_of_acks_and_rewinds() {
        let stream: Vec<u8> = (0..200_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let mut out = Outbox::new(1 << 20);
        let (mut pushed, mut peer_has) = (0usize, 0u64);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n.max(1)
        };
        for _ in 0..20_000 {
            match rnd(4) {
                0 | 1 if pushed < stream.len() => {
                    let n = (1 + rnd(3000) as usize).min(stream.len() - pushed);
                    out.push(Bytes::copy_from_slice(&stream[pushed..pushed + n]));
                    pushed += n;
                }
                2 => {
                    if let Some(Frame::Data(d)) = out.next_frame() {
                        let at = out.next as usize - d.len();
                        assert_eq!(&d[..], &stream[at..at + d.len()], "a frame from {at}");
                        // The peer takes it in order when it follows on,
                        // unless the connection lost it (it has a gap until
                        // a rewind sends it again).
                        if at as u64 == peer_has && rnd(4) != 0 {
                            peer_has += d.len() as u64;
                        }
                    }
                }
                _ => {
                    if rnd(5) == 0 {
                        // The peer reconnects having what it has.
                        out.rewind(peer_has).unwrap();
                    } else {
                        out.ack(rnd(peer_has + 1).max(out.base)).unwrap();
                    }
                }
            }
        }
        assert!(peer_has > 0);
    }

    #[test]
    fn an_outbox_of_many_small_pieces_stops_taking_more_at_its_piece_bound() {
        let mut out = Outbox::new(DEFAULT_BUFFER);
        for _ in 0..MAX_PIECES {
            assert!(out.room() > 0);
            out.push(Bytes::from_static(b"x"));
        }
        assert_eq!(out.room(), 0, "{MAX_PIECES} one-byte pieces: no more");
        while out.next_frame().is_some() {}
        out.ack(100).unwrap();
        assert!(out.room() > 0, "acknowledged pieces make room");
    }

    #[test]
    fn an_outbox_handed_over_goes_on_where_it_was() {
        let mut out = Outbox::new(MAX_DATA);
        out.push(data("abcdef"));
        while out.next_frame().is_some() {}
        out.ack(2).unwrap();
        out.end();
        let (state, kept) = out.export();
        assert_eq!(kept, b"cdef");
        let mut moved = Outbox::import(&state, Bytes::from(kept)).unwrap();
        assert_eq!(moved.next_frame(), None, "nothing until a resume says from where");
        moved.rewind(4).unwrap();
        assert_eq!(moved.next_frame(), Some(Frame::Data(data("ef"))));
        assert_eq!(moved.next_frame(), Some(Frame::End));
        // However large what it keeps, a frame stays within MAX_DATA.
        let mut big = Outbox::new(MAX_DATA * 4);
        big.push(Bytes::from(vec![7u8; MAX_DATA * 3]));
        while big.next_frame().is_some() {}
        let (state, kept) = big.export();
        let mut moved = Outbox::import(&state, Bytes::from(kept)).unwrap();
        moved.rewind(10).unwrap();
        let sizes: Vec<u64> = std::iter::from_fn(|| moved.next_frame())
            .map(|f| f.units())
            .collect();
        assert_eq!(sizes, [MAX_DATA as u64, MAX_DATA as u64, MAX_DATA as u64 - 10]);
        let bad = OutboxState { base: 1, ..state };
        assert!(Outbox::import(&bad, Bytes::from_static(b"cdef")).is_err());
    }

    #[test]
    fn a_resume_from_what_is_no_longer_kept_or_never_sent_is_refused() {
        let mut out = Outbox::new(MAX_DATA);
        out.push(Bytes::from(vec![1u8; 100]));
        while out.next_frame().is_some() {}
        out.ack(60).unwrap();
        assert_eq!(
            out.rewind(10),
            Err(SeqError::NotKept {
                from: 10,
                kept_from: 60,
                sent: 100
            })
        );
        assert!(out.rewind(101).is_err());
        out.rewind(60).unwrap();
        assert_eq!(out.next_frame().map(|f| f.units()), Some(40));
    }

    #[test]
    fn the_bound_stops_the_source_until_acks_make_room() {
        let mut out = Outbox::new(MAX_DATA * 2);
        assert_eq!(out.room(), MAX_DATA * 2);
        out.push(Bytes::from(vec![0u8; MAX_DATA]));
        out.push(Bytes::from(vec![0u8; MAX_DATA]));
        assert_eq!(out.room(), 0);
        while out.next_frame().is_some() {}
        out.ack(MAX_DATA as u64 + 10).unwrap();
        assert_eq!(out.room(), MAX_DATA + 10);
    }

    #[test]
    fn an_inbox_acks_past_its_threshold_and_counts_the_end() {
        let mut inbox = Inbox::default();
        inbox.data(10).unwrap();
        assert_eq!(inbox.ack_due(16), None);
        inbox.data(10).unwrap();
        assert_eq!(inbox.ack_due(16), Some(Frame::Ack(20)));
        assert_eq!(inbox.ack_due(1), None);
        assert!(inbox.end());
        assert!(!inbox.end());
        assert_eq!(inbox.ack_due(1), Some(Frame::Ack(21)));
        assert_eq!(inbox.data(1), Err(SeqError::DataAfterEnd));
    }

    #[test]
    fn acknowledging_delivery_waits_for_the_consumer_and_never_passes_receipt() {
        let mut inbox = Inbox::default();
        inbox.data(100).unwrap();
        assert_eq!(
            inbox.ack_due_for(30, 50),
            None,
            "30 delivered, under the threshold"
        );
        assert_eq!(inbox.ack_due_for(60, 50), Some(Frame::Ack(60)));
        assert_eq!(
            inbox.ack_due_for(500, 1),
            Some(Frame::Ack(100)),
            "never past what arrived"
        );
        assert_eq!(inbox.acked(), 100);
    }

    #[test]
    fn request_lines_round_trip_and_junk_is_refused() {
        let line = open_line("ab12", 22, "Jti_-9", Duration::from_secs(60), DEFAULT_BUFFER);
        let parsed = parse_open_line(line.trim_end()).unwrap();
        assert_eq!(
            parsed,
            OpenRequest {
                vm_id: "ab12",
                port: 22,
                session: "Jti_-9",
                grace: DEFAULT_GRACE,
                buffer: DEFAULT_BUFFER
            }
        );
        // Port 0: the serial console.
        let console = open_line(
            "ab12",
            crate::relay::CONSOLE_PORT,
            "s",
            DEFAULT_GRACE,
            DEFAULT_BUFFER,
        );
        assert_eq!(
            parse_open_line(console.trim_end()).unwrap().port,
            crate::relay::CONSOLE_PORT
        );
        for bad in [
            "RESUMABLE ab12 22 s 60000",
            "RESUMABLE ab12 -1 s 60000 4194304",
            "RESUMABLE ab12 65536 s 60000 4194304",
            "RESUMABLE ab12 22 s/x 60000 4194304",
            "RESUMABLE ab12 22 s 0 4194304",
            "RESUMABLE ab12 22 s 9999999 4194304",
            "RESUMABLE ab12 22 s 60000 12",
            "RESUMABLE zz 22 s 60000 4194304",
            "RESUMABLE ab12 22 s 60000 4194304 x",
        ] {
            assert_eq!(parse_open_line(bad), None, "{bad}");
        }
        assert_eq!(
            parse_resume_line(resume_line("s1", 42).trim_end()),
            Some(("s1", 42))
        );
        for bad in ["RESUME s1", "RESUME s1 -1", "RESUME s 1 2", "RESUME  1"] {
            assert_eq!(parse_resume_line(bad), None, "{bad}");
        }
        assert_eq!(parse_abort_line(abort_line("s1").trim_end()), Some("s1"));
        assert_eq!(parse_adopt_line(adopt_line("s1", 9).trim_end()), Some(("s1", 9)));
        assert_eq!(parse_adopt_line(&format!("ADOPT s1 {}", MAX_HANDOVER + 1)), None);
        assert_eq!(parse_abort_line("ABORT a b"), None);
        assert_eq!(parse_resumed("OK 17\n"), Some(17));
        assert_eq!(parse_resumed("OK"), None);
        assert_eq!(clean_cause("reset\r\nX-Evil: 1"), "resetX-Evil: 1");
    }

    #[test]
    fn parts_are_written_in_order_across_partial_writes() {
        let mut parts = Pieces::default();
        for piece in [&b"ab"[..], b"", b"cde", b"f"] {
            parts.push(Bytes::copy_from_slice(piece));
        }
        assert_eq!(
            (parts.remaining(), parts.parts.len()),
            (6, 3),
            "the empty one left out"
        );
        let mut slices = [std::io::IoSlice::new(&[]); 2];
        assert_eq!(parts.chunks_vectored(&mut slices), 2, "as many as fit");
        let mut out = Vec::new();
        // A writer taking three bytes at a time.
        while parts.has_remaining() {
            let take = parts.chunk().len().min(3);
            out.extend_from_slice(&parts.chunk()[..take]);
            parts.advance(take);
        }
        assert_eq!(out, b"abcdef");
        assert!(parts.parts.is_empty());
    }

    #[test]
    fn pieces_carry_frames_as_the_wire_encodes_them() {
        let frames = [
            Frame::Data(Bytes::from(vec![9u8; 70_000])),
            Frame::Ack(7),
            Frame::Data(Bytes::from_static(b"small")),
            Frame::End,
        ];
        let mut pieces = Pieces::default();
        let mut wire = Vec::new();
        for f in &frames {
            pieces.push_frame(f);
            f.encode_wire(&mut wire);
        }
        assert_eq!(pieces.remaining(), wire.len());
        assert_eq!(pieces.take_all(), wire);
        assert!(!pieces.has_remaining());
    }
}
