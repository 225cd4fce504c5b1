//! The agent's end of resumable relay sessions (`otherix_proto::resume`):
//! the guest's TCP connection and what was sent on it outlive the control
//! plane's connection that carries the session. A session with no
//! connection waits for a `RESUME` (from any control plane) for its grace
//! period, then ends; what it ended with is kept a while so a late resume
//! hears why.
//!
//! One task per session runs both directions without ever waiting on one
//! while the other could move (a guest that answers only once it has sent
//! is no deadlock): it reads the guest while its [`Outbox`] has room, writes
//! the guest what arrived, reads frames from the connection while fewer than
//! [`TO_GUEST_MAX`] bytes wait for the guest, and writes frames to it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use otherix_proto::resume::{Frame, Inbox, OpenRequest, Outbox, Pieces, WireReader, CLOSE_TAKEN_OVER};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tracing::{debug, info};

/// The control plane's connection carrying a session.
pub(crate) trait Link: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Link for T {}
type BoxLink = Box<dyn Link>;

/// Most bytes of frames waiting to be written to the connection.
const TO_LINK_MAX: usize = 256 * 1024;
/// When a restored connection probes its guest once the guest is on this
/// node: at once, and again in case the first went before the guest's
/// neighbour entry did.
const NUDGES: [Duration; 3] = [Duration::ZERO, Duration::from_millis(200), Duration::from_secs(1)];

/// A guest connection frozen and deaf (both halves: dropping them closes it,
/// without a trace on the wire).
type Frozen = (tokio::net::tcp::OwnedReadHalf, tokio::net::tcp::OwnedWriteHalf);

/// What a session carries at the guest's end: a TCP connection (which can
/// follow the guest to another node, with TCP repair), or a QEMU guest's
/// serial console socket (which cannot: it is QEMU's, on this node).
pub(crate) enum Guest {
    Tcp(TcpStream),
    Console(tokio::net::UnixStream),
}

impl From<TcpStream> for Guest {
    fn from(s: TcpStream) -> Guest {
        Guest::Tcp(s)
    }
}

impl Guest {
    fn into_split(self) -> (GuestRd, GuestWr) {
        match self {
            Guest::Tcp(s) => {
                let (r, w) = s.into_split();
                (GuestRd::Tcp(r), GuestWr::Tcp(w))
            }
            Guest::Console(s) => {
                let (r, w) = s.into_split();
                (GuestRd::Console(r), GuestWr::Console(w))
            }
        }
    }
}

/// The reading half of a [`Guest`].
enum GuestRd {
    Tcp(tokio::net::tcp::OwnedReadHalf),
    Console(tokio::net::unix::OwnedReadHalf),
}

/// The writing half of a [`Guest`].
enum GuestWr {
    Tcp(tokio::net::tcp::OwnedWriteHalf),
    Console(tokio::net::unix::OwnedWriteHalf),
}

impl AsyncRead for GuestRd {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            GuestRd::Tcp(r) => std::pin::Pin::new(r).poll_read(cx, buf),
            GuestRd::Console(r) => std::pin::Pin::new(r).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for GuestWr {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            GuestWr::Tcp(w) => std::pin::Pin::new(w).poll_write(cx, buf),
            GuestWr::Console(w) => std::pin::Pin::new(w).poll_write(cx, buf),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            GuestWr::Tcp(w) => std::pin::Pin::new(w).poll_flush(cx),
            GuestWr::Console(w) => std::pin::Pin::new(w).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            GuestWr::Tcp(w) => std::pin::Pin::new(w).poll_shutdown(cx),
            GuestWr::Console(w) => std::pin::Pin::new(w).poll_shutdown(cx),
        }
    }
}

/// Why a console session ends when its guest moves: the socket is QEMU's
/// on the node the guest leaves, and the guest's console on the next node
/// is another stream (what was on its way would be lost unsaid).
const CONSOLE_STAYS: &str =
    "a serial console session does not follow its guest to another node; open the console again";

/// How long the connection of a session handed over stays open, frozen and
/// deaf, on the node its guest leaves: until the guest has surely moved.
const FROZEN_LINGER: Duration = Duration::from_secs(30);
/// A read from the guest goes into what is left of the current block
/// while this much is; a new block is taken below it.
const READ_MIN: usize = 8 * 1024;
/// An `Ack` goes out this long after the last data at the latest.
const ACK_DELAY: Duration = Duration::from_millis(100);
/// How long an ended session's reason is kept for a late resume, and how
/// many are.
const TOMBSTONE_KEEP: Duration = Duration::from_secs(600);
const TOMBSTONES_MAX: usize = 4096;

/// What a session's task is told by the connections that come for it.
enum Control {
    /// A control plane resumes it on `link`; the client received `from`.
    Attach { link: BoxLink, from: u64 },
    /// End it for good (a revocation landed while it waited).
    Abort,
}

/// The resumable relay sessions of this node, by id (with their VM), the
/// reasons of the ones that ended lately, and the guests being handed over
/// to another node. Shared by the relay endpoint and the agent's
/// reconciler, which moves a guest only once its sessions went ahead of it.
pub struct Sessions {
    open: Mutex<HashMap<String, (String, mpsc::Sender<Control>)>>,
    /// Guest connections of sessions handed over, frozen and deaf, kept
    /// until their guest has surely left ([`FROZEN_LINGER`]) — or until the
    /// session comes back here (its guest migrating back), which needs the
    /// same four-tuple.
    frozen: Mutex<HashMap<String, (u64, Frozen)>>,
    frozen_seq: std::sync::atomic::AtomicU64,
    ended: Mutex<VecDeque<(String, String, Instant)>>,
    handovers: tokio::sync::watch::Sender<Handovers>,
    changed: tokio::sync::Notify,
}

impl Default for Sessions {
    fn default() -> Self {
        Sessions {
            open: Mutex::default(),
            frozen: Mutex::default(),
            frozen_seq: std::sync::atomic::AtomicU64::new(0),
            ended: Mutex::default(),
            handovers: tokio::sync::watch::Sender::new(Handovers::new()),
            changed: tokio::sync::Notify::new(),
        }
    }
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("open", &self.len())
            .finish_non_exhaustive()
    }
}

impl Sessions {
    fn lock_open(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, mpsc::Sender<Control>)>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sessions held now.
    pub fn len(&self) -> usize {
        self.lock_open().len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The guests being handed over to another node now (from the desired
    /// state, before the reconciler moves them): their sessions go ahead.
    pub fn set_handovers(&self, handovers: Handovers) {
        self.handovers.send_if_modified(|current| {
            if *current == handovers {
                return false;
            }
            *current = handovers;
            true
        });
    }

    /// Keeps session `id`'s frozen guest connection open a while (see
    /// [`FROZEN_LINGER`]).
    fn linger(self: &Arc<Self>, id: &str, conn: Frozen) {
        let seq = self.frozen_seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.lock_frozen().insert(id.to_owned(), (seq, conn));
        let (sessions, id) = (Arc::downgrade(self), id.to_owned());
        tokio::spawn(async move {
            tokio::time::sleep(FROZEN_LINGER).await;
            if let Some(sessions) = sessions.upgrade() {
                let mut frozen = sessions.lock_frozen();
                if frozen.get(&id).is_some_and(|(s, _)| *s == seq) {
                    frozen.remove(&id);
                }
            }
        });
    }

    /// Closes session `id`'s frozen guest connection, if one lingers here:
    /// the session comes back, and its restored connection needs the same
    /// addresses and ports.
    fn thaw_out(&self, id: &str) {
        self.lock_frozen().remove(id);
        // And its record of having ended here (handed over) goes: it is back.
        self.ended
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(s, ..)| s != id);
    }

    fn lock_frozen(&self) -> std::sync::MutexGuard<'_, HashMap<String, (u64, Frozen)>> {
        self.frozen.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn watch_handovers(&self) -> tokio::sync::watch::Receiver<Handovers> {
        self.handovers.subscribe()
    }

    /// Waits (at most `within`) until no session of VM `vm_id` is held here
    /// any more — each handed over to the guest's next node, or ended — and
    /// says how many still are: the reconciler moves the guest after this.
    pub async fn settle(&self, vm_id: &str, within: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.changed.notified();
            let held = self.lock_open().values().filter(|(vm, _)| vm == vm_id).count();
            if held == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return held;
            }
        }
    }

    fn ended_reason(&self, id: &str) -> Option<String> {
        let ended = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        ended
            .iter()
            .rev()
            .find(|(s, ..)| s == id)
            .map(|(_, r, _)| r.clone())
    }

    fn bury(&self, id: &str, reason: &str) {
        self.lock_open().remove(id);
        self.changed.notify_waiters();
        let mut ended = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        while ended
            .front()
            .is_some_and(|(_, _, at)| now.duration_since(*at) > TOMBSTONE_KEEP)
            || ended.len() >= TOMBSTONES_MAX
        {
            ended.pop_front();
        }
        ended.push_back((id.to_owned(), reason.to_owned(), now));
    }

    /// Why session `id` cannot be resumed here, for an `ERR` line.
    pub(crate) fn why_not(&self, id: &str) -> String {
        match self.ended_reason(id) {
            Some(reason) => reason,
            None => format!("no relay session {id} on this node"),
        }
    }

    /// Hands `link` to session `id`, whose client received `from`: the
    /// session answers on it. `Err` (the link back) when there is no such
    /// session here.
    pub(crate) async fn attach(&self, id: &str, link: BoxLink, from: u64) -> Result<(), BoxLink> {
        let tx = self.lock_open().get(id).cloned();
        match tx {
            Some((_, tx)) => tx
                .send(Control::Attach { link, from })
                .await
                .map_err(|e| match e.0 {
                    Control::Attach { link, .. } => link,
                    Control::Abort => unreachable!("an attach was sent"),
                }),
            None => Err(link),
        }
    }

    /// Ends session `id` for good; whether it was held here.
    pub(crate) async fn abort(&self, id: &str) -> bool {
        let tx = self.lock_open().get(id).cloned();
        match tx {
            Some((_, tx)) => tx.send(Control::Abort).await.is_ok(),
            None => false,
        }
    }

    /// Registers a new session of VM `vm_id`; none when one with that id
    /// exists or ended here.
    fn register(&self, id: &str, vm_id: &str) -> Option<mpsc::Receiver<Control>> {
        let mut open = self.lock_open();
        if open.contains_key(id) || self.ended_reason(id).is_some() {
            return None;
        }
        let (tx, rx) = mpsc::channel(4);
        open.insert(id.to_owned(), (vm_id.to_owned(), tx));
        Some(rx)
    }
}

/// How one session ended, for the log and a late resume.
#[derive(Debug)]
enum End {
    Done,
    GuestFailed(String),
    ControlPlaneClosed(u16, String),
    Abandoned(Duration),
    Aborted,
    GuestLeft,
    Unresumable(String),
    MaxLifetime,
    Protocol(String),
    /// Handed over to the node its guest moved to.
    HandedOver,
    /// The guest moved and the session could not follow (why).
    CannotFollow(String),
}

impl std::fmt::Display for End {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            End::Done => f.write_str("both directions ended"),
            End::GuestFailed(e) => write!(f, "the connection to the guest failed: {e}"),
            End::ControlPlaneClosed(code, reason) => {
                write!(f, "ended by the control plane ({code}: {reason})")
            }
            End::Abandoned(grace) => write!(f, "not resumed within the grace period ({}s)", grace.as_secs()),
            End::Aborted => f.write_str("access revoked while it waited for a resume"),
            End::GuestLeft => f.write_str("the guest left this node"),
            End::Unresumable(e) => write!(f, "{e}"),
            End::MaxLifetime => f.write_str("the session reached its maximum lifetime"),
            End::Protocol(e) => write!(f, "protocol error: {e}"),
            End::HandedOver => f.write_str("handed over to the node its guest moved to"),
            End::CannotFollow(e) => write!(
                f,
                "the guest moved to another node and the session cannot follow it: {e}"
            ),
        }
    }
}

/// The reading half of the connection carrying the session, with what was
/// read from it and is not yet a frame.
struct LinkRd {
    rd: ReadHalf<BoxLink>,
    reader: WireReader,
}

/// The writing half, with frames waiting to be written: a data frame's
/// bytes as the outbox keeps them, written with the others in one
/// vectored write (TLS copies them once, into its records; they were
/// copied into a batch first, one copy more per byte downloaded).
struct LinkWr {
    wr: WriteHalf<BoxLink>,
    out: Pieces,
}

impl LinkWr {
    /// Bytes of frames not yet written.
    fn waiting(&self) -> usize {
        self.out.remaining()
    }

    /// What is not yet written, taken (to go out before a last frame).
    fn take_waiting(&mut self) -> Vec<u8> {
        self.out.take_all()
    }

    /// Writes what waits, as much as the connection takes without waiting
    /// once something was written (a vectored write of TLS returns after
    /// one buffer's worth, 64 KiB: back through the session's whole loop
    /// for each, downloading was slower than with one contiguous write).
    async fn write_some(&mut self) -> std::io::Result<()> {
        let LinkWr { wr, out } = self;
        std::future::poll_fn(|cx| {
            let mut wrote_any = false;
            while out.has_remaining() {
                let polled = {
                    let mut slices = [std::io::IoSlice::new(&[]); 64];
                    let n = out.chunks_vectored(&mut slices);
                    std::pin::Pin::new(&mut *wr).poll_write_vectored(cx, &slices[..n])
                };
                match polled {
                    std::task::Poll::Ready(Ok(0)) => {
                        return std::task::Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()))
                    }
                    std::task::Poll::Ready(Ok(k)) => {
                        out.advance(k);
                        wrote_any = true;
                    }
                    std::task::Poll::Ready(Err(e)) => return std::task::Poll::Ready(Err(e)),
                    std::task::Poll::Pending if wrote_any => break,
                    std::task::Poll::Pending => return std::task::Poll::Pending,
                }
            }
            std::task::Poll::Ready(Ok(()))
        })
        .await
    }
}

fn carry(link: BoxLink) -> (LinkRd, LinkWr) {
    let (rd, wr) = tokio::io::split(link);
    (
        LinkRd {
            rd,
            reader: WireReader::default(),
        },
        LinkWr {
            wr,
            out: Pieces::default(),
        },
    )
}

/// What a session is about, whichever node holds it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct Params {
    pub vm_id: String,
    pub port: u16,
    pub session: String,
    pub grace: Duration,
    pub buffer: usize,
}

impl Params {
    pub(crate) fn of(req: &OpenRequest<'_>) -> Params {
        Params {
            vm_id: req.vm_id.to_owned(),
            port: req.port,
            session: req.session.to_owned(),
            grace: req.grace,
            buffer: req.buffer,
        }
    }
}

/// Where a session's pump starts: a new session (empty boxes, carried by
/// the connection that opened it), or one handed over from another node
/// (its boxes as they were there, no connection until a resume).
pub(crate) struct Start {
    params: Params,
    guest: Guest,
    outbox: Outbox,
    inbox: Inbox,
    to_guest: VecDeque<Bytes>,
    guest_shut: bool,
    link: Option<BoxLink>,
    /// A restored connection's: resolves once its guest is on this node
    /// (then the session probes it, [`NUDGES`]).
    arrival: Option<Arrival>,
}

type Arrival = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

impl Start {
    /// A new session of `req` over `guest`, carried by `link` (answered `OK`).
    pub(crate) fn new(req: &OpenRequest<'_>, guest: impl Into<Guest>, link: BoxLink) -> Start {
        Start {
            params: Params::of(req),
            guest: guest.into(),
            outbox: Outbox::new(req.buffer),
            inbox: Inbox::default(),
            to_guest: VecDeque::new(),
            guest_shut: false,
            link: Some(link),
            arrival: None,
        }
    }
}

/// VM ids of the guests being handed over to another node (their desired
/// state says where): a session whose guest leaves for one of those follows
/// it; one whose guest is just gone ends.
pub type Handovers = std::collections::BTreeSet<String>;

/// Runs a resumable session from `start` until it ends; `gone` resolves
/// when the guest is no longer a target here. Returns at once when the id
/// is taken.
pub(crate) async fn run(
    sessions: Arc<Sessions>,
    start: Start,
    gone: impl std::future::Future<Output = ()>,
    max_session: Duration,
) {
    let handovers = sessions.watch_handovers();
    let id = start.params.session.clone();
    let Some(control) = sessions.register(&id, &start.params.vm_id) else {
        info!(session = %id, "relay session id already used here; refused");
        return;
    };
    run_registered(sessions, control, start, gone, handovers, max_session).await;
}

/// [`run`] of a session already registered (its control channel).
async fn run_registered(
    sessions: Arc<Sessions>,
    mut control: mpsc::Receiver<Control>,
    start: Start,
    gone: impl std::future::Future<Output = ()>,
    handovers: tokio::sync::watch::Receiver<Handovers>,
    max_session: Duration,
) {
    let id = start.params.session.clone();
    let end = pump(&sessions, &mut control, start, gone, handovers, max_session).await;
    match &end {
        End::Done => info!(session = %id, "relay session closed"),
        other => info!(session = %id, reason = %other, "relay session ended"),
    }
    sessions.bury(&id, &end.to_string());
}

/// Takes in a session handed over from the node its guest left (the
/// `ADOPT` of the control plane that carried it): its guest connection
/// restored here with TCP repair, its boxes as they were. It waits for a
/// resume like a session whose connection dropped. `gone` as for [`run`].
pub(crate) fn adopt(
    sessions: Arc<Sessions>,
    handover: Bytes,
    arrived: impl std::future::Future<Output = ()> + Send + 'static,
    gone: impl std::future::Future<Output = ()> + Send + 'static,
    max_session: Duration,
    rto_min: Option<Duration>,
) -> Result<String, String> {
    let handovers = sessions.watch_handovers();
    // Its guest connection may linger here, frozen, from when the guest
    // left this node: the restored one needs its addresses and ports.
    if let Some(id) = handover_session(&handover) {
        sessions.thaw_out(&id);
    }
    let (params, mut start) = decode_handover(handover, rto_min)?;
    // Restored before the guest could reach this node, the connection told
    // it nothing it heard: once the guest is here, a few window probes —
    // made by the session's own task, between its reads and writes (a probe
    // turns repair on for a moment, and a read or write meanwhile fails
    // with EINVAL: it ended a session in a migration now and then when
    // another task probed).
    start.arrival = Some(Box::pin(arrived));
    let Some(control) = sessions.register(&params.session, &params.vm_id) else {
        return Err(format!("relay session {} is already held here", params.session));
    };
    start.params = params.clone();
    info!(session = %params.session, vm_id = %params.vm_id, "relay session adopted from the node its guest left");
    tokio::spawn(run_registered(
        sessions,
        control,
        start,
        gone,
        handovers,
        max_session,
    ));
    Ok(params.session)
}

/// The VM id a handover is for (read from its head), if it parses.
pub(crate) fn handover_vm(blob: &[u8]) -> Option<String> {
    handover_head(blob).map(|h| h.params.vm_id)
}

/// The session a handover is of, if it parses.
fn handover_session(blob: &[u8]) -> Option<String> {
    handover_head(blob).map(|h| h.params.session)
}

fn handover_head(blob: &[u8]) -> Option<HandoverHead> {
    let head_len = u32::from_be_bytes(blob.get(..4)?.try_into().ok()?) as usize;
    serde_json::from_slice(blob.get(4..4 + head_len)?).ok()
}

/// The head of a handover; the bytes follow it in this order.
#[derive(serde::Serialize, serde::Deserialize)]
struct HandoverHead {
    params: Params,
    outbox: otherix_proto::resume::OutboxState,
    outbox_len: usize,
    received: u64,
    ended: bool,
    to_guest_len: usize,
    guest_shut: bool,
    tcp: otherix_repair::TcpState,
    send_queue_len: usize,
    recv_queue_len: usize,
}

/// A session as it goes to the node its guest moved to: `u32` length, the
/// head (JSON), then the outbox's bytes, what waits for the guest, and the
/// guest connection's send and receive queues.
fn encode_handover(
    params: &Params,
    outbox: &Outbox,
    inbox: &Inbox,
    to_guest: &VecDeque<Bytes>,
    guest_shut: bool,
    mut tcp: otherix_repair::TcpState,
) -> Vec<u8> {
    let (state, kept) = outbox.export();
    let send_queue = std::mem::take(&mut tcp.send_queue);
    let recv_queue = std::mem::take(&mut tcp.recv_queue);
    let pending: usize = to_guest.iter().map(|b| b.len()).sum();
    let head = HandoverHead {
        params: params.clone(),
        outbox: state,
        outbox_len: kept.len(),
        received: inbox.received(),
        ended: inbox.ended(),
        to_guest_len: pending,
        guest_shut,
        tcp,
        send_queue_len: send_queue.len(),
        recv_queue_len: recv_queue.len(),
    };
    let head = serde_json::to_vec(&head).unwrap_or_default();
    let mut out =
        Vec::with_capacity(4 + head.len() + kept.len() + pending + send_queue.len() + recv_queue.len());
    out.extend_from_slice(&(head.len() as u32).to_be_bytes());
    out.extend_from_slice(&head);
    out.extend_from_slice(&kept);
    for b in to_guest {
        out.extend_from_slice(b);
    }
    out.extend_from_slice(&send_queue);
    out.extend_from_slice(&recv_queue);
    out
}

/// [`encode_handover`]'s inverse, the guest connection restored here.
/// `rto_min`: the retransmission floor the relay's dials give connections
/// to guests ([`Limits::guest_rto_min`](crate::Limits::guest_rto_min)).
fn decode_handover(mut blob: Bytes, rto_min: Option<Duration>) -> Result<(Params, Start), String> {
    let bad = || "malformed handover".to_string();
    if blob.len() < 4 {
        return Err(bad());
    }
    let head_len = u32::from_be_bytes([blob[0], blob[1], blob[2], blob[3]]) as usize;
    let _ = blob.split_to(4);
    if blob.len() < head_len {
        return Err(bad());
    }
    let head: HandoverHead =
        serde_json::from_slice(&blob.split_to(head_len)).map_err(|e| format!("malformed handover: {e}"))?;
    let need = head.outbox_len + head.to_guest_len + head.send_queue_len + head.recv_queue_len;
    if blob.len() != need {
        return Err(bad());
    }
    let kept = blob.split_to(head.outbox_len);
    let pending = blob.split_to(head.to_guest_len);
    let mut tcp = head.tcp;
    tcp.send_queue = blob.split_to(head.send_queue_len).to_vec();
    tcp.recv_queue = blob.to_vec();
    let outbox = Outbox::import(&head.outbox, kept).map_err(|e| format!("malformed handover: {e}"))?;
    // Coming back to a node it once left, the connection would meet its old
    // connection-tracker entry (a sequence window long past) and the host
    // rules would drop it as invalid.
    if let Err(e) = otherix_repair::forget_conntrack(tcp.local, tcp.remote) {
        tracing::warn!(error = %e, "cannot clear the connection tracker's old entry for a restored connection");
    }
    let socket = otherix_repair::restore(&tcp).map_err(|e| e.to_string())?;
    socket
        .set_nonblocking(true)
        .map_err(|e| format!("cannot use the restored guest connection: {e}"))?;
    let guest =
        TcpStream::from_std(socket).map_err(|e| format!("cannot use the restored guest connection: {e}"))?;
    // Socket options do not move with a repaired connection: set again as
    // the relay's dial sets them (the next migration's lost segments wait
    // for the floor, not for the kernel's 200 ms).
    let _ = guest.set_nodelay(true);
    if let Some(floor) = rto_min {
        crate::dial::lower_rto_min(&guest, floor);
    }
    let mut to_guest = VecDeque::new();
    if !pending.is_empty() {
        to_guest.push_back(pending);
    }
    Ok((
        head.params.clone(),
        Start {
            params: head.params,
            guest: Guest::Tcp(guest),
            outbox,
            inbox: Inbox::restore(head.received, head.ended),
            to_guest,
            guest_shut: head.guest_shut,
            link: None,
            arrival: None,
        },
    ))
}

async fn pump(
    sessions: &Arc<Sessions>,
    control: &mut mpsc::Receiver<Control>,
    start: Start,
    gone: impl std::future::Future<Output = ()>,
    mut handovers: tokio::sync::watch::Receiver<Handovers>,
    max_session: Duration,
) -> End {
    let Start {
        params,
        guest,
        mut outbox,
        mut inbox,
        mut to_guest,
        mut guest_shut,
        link,
        mut arrival,
    } = start;
    // The probes still due once the guest arrived, and when the next is.
    let mut nudges = NUDGES.iter();
    let mut nudge_at: Option<tokio::time::Instant> = None;
    let grace = params.grace;
    let ack_every = (params.buffer / 8) as u64;
    // The most that may wait for the guest: the client's window (after a
    // resume, which acknowledges all it received, up to twice it), and a frame.
    let to_guest_max =
        2 * params.buffer.max(otherix_proto::resume::DEFAULT_BUFFER) + 2 * otherix_proto::resume::MAX_DATA;
    let (mut guest_rd, mut guest_wr) = guest.into_split();
    let mut to_guest_bytes: usize = to_guest.iter().map(|b| b.len()).sum();
    let (mut link_rd, mut link_wr) = match link.map(carry) {
        Some((rd, wr)) => (Some(rd), Some(wr)),
        None => (None, None),
    };
    // A session handed over waits for its resume from the start.
    let mut parked_since: Option<tokio::time::Instant> = link_rd.is_none().then(tokio::time::Instant::now);
    let mut ack_at: Option<tokio::time::Instant> = None;
    let lifetime = tokio::time::sleep(max_session);
    tokio::pin!(lifetime, gone);
    let mut rbuf = bytes::BytesMut::with_capacity(otherix_proto::resume::MAX_DATA);

    loop {
        // What reached the guest: what an `Ack` says (see
        // `Inbox::ack_due_for`); the end counts once the guest's side is shut.
        let delivered = inbox.received() - to_guest_bytes as u64 - u64::from(inbox.ended() && !guest_shut);
        // Frames due on the connection: acks, then data.
        if let Some(c) = link_wr.as_mut() {
            if let Some(ack) = inbox.ack_due_for(delivered, ack_every) {
                c.out.push_frame(&ack);
                ack_at = None;
            } else if delivered > inbox.acked() && ack_at.is_none() {
                ack_at = Some(tokio::time::Instant::now() + ACK_DELAY);
            }
            while c.waiting() < TO_LINK_MAX {
                match outbox.next_frame() {
                    Some(f) => c.out.push_frame(&f),
                    None => break,
                }
            }
        }
        // Everything the client sent has reached the guest, and everything
        // the guest sent (and its end) has reached the client.
        if inbox.ended() && to_guest.is_empty() && guest_shut && outbox.all_acked() {
            if let Some(mut c) = link_wr.take() {
                c.out.push_frame(&Frame::Close {
                    code: otherix_proto::relay::CLOSE_DONE,
                    reason: "both directions ended".into(),
                });
                let out = c.take_waiting();
                let _ = tokio::time::timeout(Duration::from_secs(5), async {
                    c.wr.write_all(&out).await?;
                    c.wr.shutdown().await
                })
                .await;
            }
            return End::Done;
        }
        let guest_readable = !outbox.ended() && outbox.room() > 0;
        // The connection is always read (acknowledgements must never wait
        // behind data): the client sends at most its window unacknowledged,
        // and acknowledgements count only what reached the guest.
        if to_guest_bytes > to_guest_max {
            return fail(link_wr, End::Protocol("the client sent past its window".into())).await;
        }
        let parked_deadline = parked_since.map(|t| t + grace);
        tokio::select! {
            n = guest_rd.read_buf(&mut rbuf), if guest_readable => match n {
                Ok(0) => outbox.end(),
                Ok(_) => {
                    // Read straight into the piece the outbox keeps: no copy.
                    // The next read goes into the rest of the same block
                    // while `READ_MIN` is left of it: a block holds many
                    // small reads (a guest writing a byte at a time must
                    // not pin a block per byte while the client is away).
                    outbox.push(rbuf.split().freeze());
                    if rbuf.capacity() < READ_MIN {
                        rbuf.reserve(otherix_proto::resume::MAX_DATA);
                    }
                }
                Err(e) => return fail(link_wr, End::GuestFailed(e.to_string())).await,
            },
            w = guest_wr.write(to_guest.front().map(|b| &b[..]).unwrap_or(&[])), if !to_guest.is_empty() => match w {
                Ok(n) => {
                    to_guest_bytes -= n;
                    let front = to_guest.front_mut().expect("not empty");
                    if n >= front.len() {
                        to_guest.pop_front();
                    } else {
                        *front = front.slice(n..);
                    }
                    if to_guest.is_empty() && inbox.ended() && !guest_shut {
                        let _ = guest_wr.shutdown().await;
                        guest_shut = true;
                    }
                }
                Err(e) => return fail(link_wr, End::GuestFailed(e.to_string())).await,
            },
            r = async {
                let c = link_rd.as_mut().expect("guarded");
                c.rd.read_buf(c.reader.buffer()).await
            }, if link_rd.is_some() => match r {
                Ok(0) | Err(_) => {
                    debug!("relay session's connection lost; waiting for a resume");
                    (link_rd, link_wr) = (None, None);
                    parked_since = Some(tokio::time::Instant::now());
                }
                Ok(_) => {
                    let c = link_rd.as_mut().expect("guarded");
                    while let Some(frame) = c.reader.next_frame() {
                        match frame {
                            Ok(Frame::Data(b)) => {
                                if let Err(e) = inbox.data(b.len()) {
                                    return fail(link_wr, End::Protocol(e.to_string())).await;
                                }
                                to_guest_bytes += b.len();
                                to_guest.push_back(b);
                            }
                            Ok(Frame::Ack(n)) => {
                                if let Err(e) = outbox.ack(n) {
                                    return fail(link_wr, End::Protocol(e.to_string())).await;
                                }
                            }
                            Ok(Frame::End) => {
                                if inbox.end() && to_guest.is_empty() && !guest_shut {
                                    let _ = guest_wr.shutdown().await;
                                    guest_shut = true;
                                }
                            }
                            Ok(Frame::Close { code, reason }) => return End::ControlPlaneClosed(code, reason),
                            Ok(Frame::Move(_)) => {
                                return fail(link_wr, End::Protocol("a handover from the control plane's side".into())).await
                            }
                            Err(e) => return fail(link_wr, End::Protocol(e.to_string())).await,
                        }
                    }
                }
            },
            w = async {
                link_wr.as_mut().expect("guarded").write_some().await
            }, if link_wr.as_ref().is_some_and(|c| c.waiting() > 0) => match w {
                Ok(()) => {
                    let c = link_wr.as_mut().expect("guarded");
                    if c.waiting() == 0 {
                        let _ = c.wr.flush().await;
                    }
                }
                Err(_) => {
                    debug!("relay session's connection lost; waiting for a resume");
                    (link_rd, link_wr) = (None, None);
                    parked_since = Some(tokio::time::Instant::now());
                }
            },
            () = async { tokio::time::sleep_until(ack_at.expect("guarded")).await }, if ack_at.is_some() && link_wr.is_some() => {
                ack_at = None;
                if let (Some(ack), Some(c)) = (inbox.ack_due_for(delivered, 1), link_wr.as_mut()) {
                    c.out.push_frame(&ack);
                }
            },
            msg = control.recv() => match msg {
                Some(Control::Attach { link, from }) => {
                    let (fresh_rd, mut fresh_wr) = carry(link);
                    if let Err(e) = outbox.rewind(from) {
                        let line = format!("ERR {e}\n");
                        let _ = fresh_wr.wr.write_all(line.as_bytes()).await;
                        let _ = fresh_wr.wr.shutdown().await;
                        return fail(link_wr, End::Unresumable(e.to_string())).await;
                    }
                    if let Some(mut old) = link_wr.take() {
                        // The control plane still carrying it learns it is stale.
                        tokio::spawn(async move {
                            let mut out = old.take_waiting();
                            Frame::Close { code: CLOSE_TAKEN_OVER, reason: "resumed on another connection".into() }
                                .encode_wire(&mut out);
                            let _ = tokio::time::timeout(Duration::from_secs(2), old.wr.write_all(&out)).await;
                        });
                    }
                    inbox.resumed();
                    fresh_wr.out.push(Bytes::from(format!("OK {}\n", inbox.received())));
                    info!(from, received = inbox.received(), parked_ms = parked_since.map(|t| t.elapsed().as_millis() as u64), "relay session resumed");
                    (link_rd, link_wr) = (Some(fresh_rd), Some(fresh_wr));
                    parked_since = None;
                }
                Some(Control::Abort) | None => return fail(link_wr, End::Aborted).await,
            },
            () = async { tokio::time::sleep_until(parked_deadline.expect("guarded")).await }, if parked_deadline.is_some() => {
                return End::Abandoned(grace);
            },
            // The guest is about to move to another node (the reconciler
            // waits for this session to go ahead of it).
            () = async {
                if handovers.wait_for(|h| h.contains(&params.vm_id)).await.is_err() {
                    std::future::pending::<()>().await;
                }
            } => {
                let (GuestRd::Tcp(guest_rd), GuestWr::Tcp(guest_wr)) = (guest_rd, guest_wr) else {
                    return fail(link_wr, End::CannotFollow(CONSOLE_STAYS.into())).await;
                };
                let end = hand_over(link_rd, link_wr, guest_rd.as_ref(), &params, &outbox, &inbox, &to_guest, guest_shut).await;
                if matches!(end, End::HandedOver) {
                    // Frozen and deaf, the connection stays open here until
                    // the guest has surely left: closed now, the kernel would
                    // answer the guest's next segment with a reset while it is
                    // still on this node's bridge (the reconciler moves it a
                    // moment after this).
                    sessions.linger(&params.session, (guest_rd, guest_wr));
                }
                return end;
            }
            // A restored connection's guest is on this node now: probe it.
            () = async { arrival.as_mut().expect("guarded").await }, if arrival.is_some() => {
                arrival = None;
                debug!("the guest is on this node: probing its restored connection");
                nudge_at = nudges.next().map(|d| tokio::time::Instant::now() + *d);
            },
            () = async { tokio::time::sleep_until(nudge_at.expect("guarded")).await }, if nudge_at.is_some() => {
                let probed = match &guest_rd {
                    GuestRd::Tcp(r) => otherix_repair::nudge(r.as_ref()),
                    GuestRd::Console(_) => Ok(()),
                };
                nudge_at = match probed {
                    Ok(()) => {
                        debug!("probed the restored guest connection");
                        nudges.next().map(|d| tokio::time::Instant::now() + *d)
                    }
                    Err(e) => {
                        debug!(error = %e, "cannot probe a restored guest connection");
                        None
                    }
                };
            },
            // Gone otherwise (deleted): dropped without a Close, the control
            // plane finds out which and says so.
            () = &mut gone => return End::GuestLeft,
            () = &mut lifetime => return fail(link_wr, End::MaxLifetime).await,
        }
    }
}

/// The guest is moving to another node: its connection frozen and read
/// with TCP repair, the session sent, in `Move` frames, on the connection
/// carrying it for the control plane to hand to the target (`ADOPT`). A
/// session nobody carries now cannot follow (there is no one to hand it
/// to); nor one whose connection cannot be repaired here.
#[allow(clippy::too_many_arguments)]
async fn hand_over(
    link_rd: Option<LinkRd>,
    link: Option<LinkWr>,
    guest: &TcpStream,
    params: &Params,
    outbox: &Outbox,
    inbox: &Inbox,
    to_guest: &VecDeque<Bytes>,
    guest_shut: bool,
) -> End {
    let (Some(mut rd), Some(mut c)) = (link_rd, link) else {
        return End::CannotFollow("it was waiting for a resume when the guest moved".into());
    };
    // Deaf first: what the guest sends from now on is neither taken in nor
    // acknowledged here; it sends it again to the restored connection.
    if let Err(e) = otherix_repair::deafen(guest) {
        return fail(Some(c), End::CannotFollow(e.to_string())).await;
    }
    let tcp = match otherix_repair::checkpoint(guest) {
        Ok(tcp) => tcp,
        Err(e) => return fail(Some(c), End::CannotFollow(e.to_string())).await,
    };
    let blob = encode_handover(params, outbox, inbox, to_guest, guest_shut, tcp);
    info!(bytes = blob.len(), "relay session handed over: the guest moves");
    // Whatever is half written goes first: frames stay whole.
    let mut out = c.take_waiting();
    for chunk in blob.chunks(otherix_proto::resume::MAX_DATA) {
        Frame::Move(Bytes::copy_from_slice(chunk)).encode_wire(&mut out);
    }
    Frame::Move(Bytes::new()).encode_wire(&mut out);
    let sent = tokio::time::timeout(Duration::from_secs(10), async {
        c.wr.write_all(&out).await?;
        c.wr.flush().await
    })
    .await;
    match sent {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return End::CannotFollow(format!("the control plane's connection failed: {e}")),
        Err(_) => return End::CannotFollow("the control plane did not take the handover in time".into()),
    }
    // The guest moves once this session has gone ahead: only once the next
    // node holds the connection (else the guest's packets meet no socket
    // there, and a reset). The control plane says so with a Close 4003;
    // what the client sent meanwhile it sends again to the next node.
    let confirmed = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            while let Some(frame) = rd.reader.next_frame() {
                match frame {
                    Ok(Frame::Close { code, .. }) if code == CLOSE_TAKEN_OVER => return Ok(()),
                    Ok(Frame::Close { reason, .. }) => return Err(reason),
                    Ok(_) => {}
                    Err(e) => return Err(e.to_string()),
                }
            }
            match rd.rd.read_buf(rd.reader.buffer()).await {
                Ok(0) | Err(_) => return Err("the control plane's connection ended".to_string()),
                Ok(_) => {}
            }
        }
    })
    .await;
    match confirmed {
        Ok(Ok(())) => End::HandedOver,
        Ok(Err(reason)) => End::CannotFollow(reason),
        Err(_) => End::CannotFollow("the next node did not take the session in time".into()),
    }
}

/// Ends the session with `end`, telling the connection carrying it (if
/// any) why in a `Close`.
async fn fail(link: Option<LinkWr>, end: End) -> End {
    if let Some(mut c) = link {
        let code = match end {
            End::MaxLifetime => otherix_proto::relay::CLOSE_IDLE,
            End::CannotFollow(_) => otherix_proto::relay::CLOSE_MOVED,
            _ => otherix_proto::relay::CLOSE_FAILED,
        };
        let mut out = c.take_waiting();
        Frame::Close {
            code,
            reason: end.to_string(),
        }
        .encode_wire(&mut out);
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            c.wr.write_all(&out).await?;
            c.wr.shutdown().await
        })
        .await;
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;
    use otherix_proto::resume::DEFAULT_BUFFER;
    use tokio::io::{duplex, DuplexStream};
    use tokio::net::TcpListener;

    /// An echo guest on loopback; the agent's connection to it.
    async fn echo_guest() -> TcpStream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let (mut r, mut w) = s.split();
            let _ = tokio::io::copy(&mut r, &mut w).await;
            let _ = w.shutdown().await;
        });
        TcpStream::connect(addr).await.unwrap()
    }

    /// The control plane's end of a link.
    struct Cp {
        io: DuplexStream,
        reader: WireReader,
    }

    impl Cp {
        fn pair() -> (Cp, BoxLink) {
            let (a, b) = duplex(1 << 20);
            (
                Cp {
                    io: a,
                    reader: WireReader::default(),
                },
                Box::new(b),
            )
        }

        async fn send(&mut self, f: Frame) {
            let mut out = Vec::new();
            f.encode_wire(&mut out);
            self.io.write_all(&out).await.unwrap();
        }

        async fn line(&mut self) -> String {
            let mut line = Vec::new();
            let mut b = [0u8; 1];
            while self.io.read(&mut b).await.unwrap() == 1 && b[0] != b'\n' {
                line.push(b[0]);
            }
            String::from_utf8(line).unwrap()
        }

        /// The next frame that is not an ack.
        async fn frame(&mut self) -> Option<Frame> {
            loop {
                while let Some(f) = self.reader.next_frame() {
                    match f.unwrap() {
                        Frame::Ack(_) => {}
                        other => return Some(other),
                    }
                }
                let n = tokio::time::timeout(Duration::from_secs(5), self.io.read_buf(self.reader.buffer()))
                    .await
                    .expect("a frame within 5 s")
                    .unwrap();
                if n == 0 {
                    return None;
                }
            }
        }

        async fn data(&mut self, n: usize) -> Vec<u8> {
            let mut got = Vec::new();
            while got.len() < n {
                match self.frame().await {
                    Some(Frame::Data(d)) => got.extend_from_slice(&d),
                    other => panic!("{other:?}"),
                }
            }
            got
        }
    }

    fn request(grace: Duration) -> OpenRequest<'static> {
        OpenRequest {
            vm_id: "ab",
            port: 7,
            session: "s1",
            grace,
            buffer: DEFAULT_BUFFER,
        }
    }

    #[tokio::test]
    async fn a_session_goes_on_over_a_new_connection_from_where_the_client_was() {
        let sessions = Arc::new(Sessions::default());
        let (mut cp, link) = Cp::pair();
        let guest = echo_guest().await;
        let task = tokio::spawn(run(
            sessions.clone(),
            Start::new(&request(Duration::from_secs(30)), guest, link),
            std::future::pending(),
            Duration::from_secs(3600),
        ));
        cp.send(Frame::Data(Bytes::from_static(b"abc"))).await;
        assert_eq!(cp.data(3).await, b"abc");
        cp.send(Frame::Data(Bytes::from_static(b"def"))).await;
        assert_eq!(cp.data(3).await, b"def");
        // The connection drops before the client read "def": it says it
        // received 3, so "def" comes again.
        drop(cp);
        let (mut cp, link) = Cp::pair();
        sessions.attach("s1", link, 3).await.map_err(|_| ()).unwrap();
        assert_eq!(cp.line().await, "OK 6", "the agent received abc and def");
        assert_eq!(cp.data(3).await, b"def");
        // Both ends end: the agent closes with 1000 once it is acknowledged.
        cp.send(Frame::End).await;
        assert_eq!(cp.frame().await, Some(Frame::End));
        cp.send(Frame::Ack(7)).await;
        assert!(
            matches!(cp.frame().await, Some(Frame::Close { code: 1000, .. })),
            "a clean end"
        );
        task.await.unwrap();
        assert_eq!(sessions.len(), 0);
        assert_eq!(sessions.why_not("s1"), "both directions ended");
    }

    /// A serial console: an echo on one end of a socket pair.
    fn echo_console() -> Guest {
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        tokio::spawn(async move {
            let (mut r, mut w) = tokio::io::split(theirs);
            let _ = tokio::io::copy(&mut r, &mut w).await;
        });
        Guest::Console(ours)
    }

    #[tokio::test]
    async fn a_console_session_resumes_and_ends_with_its_reason_when_its_guest_moves() {
        let sessions = Arc::new(Sessions::default());
        let (mut cp, link) = Cp::pair();
        let req = OpenRequest {
            port: otherix_proto::relay::CONSOLE_PORT,
            ..request(Duration::from_secs(30))
        };
        let task = tokio::spawn(run(
            sessions.clone(),
            Start::new(&req, echo_console(), link),
            std::future::pending(),
            Duration::from_secs(3600),
        ));
        cp.send(Frame::Data(Bytes::from_static(b"ls\r"))).await;
        assert_eq!(cp.data(3).await, b"ls\r");
        drop(cp);
        let (mut cp, link) = Cp::pair();
        sessions.attach("s1", link, 3).await.map_err(|_| ()).unwrap();
        assert_eq!(cp.line().await, "OK 3");
        cp.send(Frame::Data(Bytes::from_static(b"id\r"))).await;
        assert_eq!(cp.data(3).await, b"id\r", "the same console, on");
        // The guest is handed over: a console is QEMU's, on this node; the
        // session ends and says why (no TCP repair is tried).
        sessions.set_handovers(["ab".to_string()].into());
        match cp.frame().await {
            Some(Frame::Close { code, reason }) => {
                assert_eq!(code, otherix_proto::relay::CLOSE_MOVED);
                assert!(
                    reason.contains("serial console session does not follow"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
        task.await.unwrap();
        assert_eq!(sessions.len(), 0, "nothing left for the reconciler to wait for");
    }

    #[tokio::test]
    async fn a_session_nobody_resumes_ends_at_its_grace_and_a_late_resume_hears_why() {
        let sessions = Arc::new(Sessions::default());
        let (cp, link) = Cp::pair();
        let task = tokio::spawn(run(
            sessions.clone(),
            Start::new(&request(Duration::from_millis(200)), echo_guest().await, link),
            std::future::pending(),
            Duration::from_secs(3600),
        ));
        drop(cp);
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("ended at its grace")
            .unwrap();
        let (_cp, link) = Cp::pair();
        assert!(sessions.attach("s1", link, 0).await.is_err());
        assert_eq!(sessions.why_not("s1"), "not resumed within the grace period (0s)");
        assert_eq!(sessions.why_not("s2"), "no relay session s2 on this node");
    }

    #[tokio::test]
    async fn a_resume_from_what_is_no_longer_kept_ends_the_session_and_says_why() {
        let sessions = Arc::new(Sessions::default());
        let (mut cp, link) = Cp::pair();
        let task = tokio::spawn(run(
            sessions.clone(),
            Start::new(&request(Duration::from_secs(30)), echo_guest().await, link),
            std::future::pending(),
            Duration::from_secs(3600),
        ));
        cp.send(Frame::Data(Bytes::from_static(b"abcdef"))).await;
        assert_eq!(cp.data(6).await, b"abcdef");
        cp.send(Frame::Ack(6)).await;
        // Frames are taken in order: once "g" is echoed, the ack has landed.
        cp.send(Frame::Data(Bytes::from_static(b"g"))).await;
        assert_eq!(cp.data(1).await, b"g");
        drop(cp);
        let (mut cp, link) = Cp::pair();
        sessions.attach("s1", link, 2).await.map_err(|_| ()).unwrap();
        let line = cp.line().await;
        assert!(line.starts_with("ERR cannot resume from unit 2"), "{line}");
        task.await.unwrap();
        assert!(sessions.why_not("s1").starts_with("cannot resume from unit 2"));
    }

    #[tokio::test]
    async fn an_abort_ends_a_waiting_session_at_once_and_the_guest_goes_with_it() {
        let sessions = Arc::new(Sessions::default());
        let (cp, link) = Cp::pair();
        let task = tokio::spawn(run(
            sessions.clone(),
            Start::new(&request(Duration::from_secs(60)), echo_guest().await, link),
            std::future::pending(),
            Duration::from_secs(3600),
        ));
        drop(cp);
        while sessions.is_empty() {
            tokio::task::yield_now().await;
        }
        assert!(sessions.abort("s1").await);
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("ended at once")
            .unwrap();
        assert_eq!(
            sessions.why_not("s1"),
            "access revoked while it waited for a resume"
        );
        assert!(!sessions.abort("s1").await);
    }
}
