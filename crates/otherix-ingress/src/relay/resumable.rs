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

use bytes::Bytes;
use otherix_proto::resume::{Frame, Inbox, OpenRequest, Outbox, WireReader, CLOSE_TAKEN_OVER};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tracing::{debug, info};

/// The control plane's connection carrying a session.
pub(crate) trait Link: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Link for T {}
type BoxLink = Box<dyn Link>;

/// Most bytes waiting to be written to the guest before the connection is
/// read no further.
const TO_GUEST_MAX: usize = 1024 * 1024;
/// Most bytes of frames waiting to be written to the connection.
const TO_LINK_MAX: usize = 256 * 1024;
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

/// The resumable sessions of this node, by id, and the reasons of the ones
/// that ended lately.
#[derive(Default)]
pub(crate) struct Sessions {
    open: Mutex<HashMap<String, mpsc::Sender<Control>>>,
    ended: Mutex<VecDeque<(String, String, Instant)>>,
}

impl Sessions {
    fn lock_open(&self) -> std::sync::MutexGuard<'_, HashMap<String, mpsc::Sender<Control>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sessions held now.
    pub(crate) fn len(&self) -> usize {
        self.lock_open().len()
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
            Some(tx) => tx
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
            Some(tx) => tx.send(Control::Abort).await.is_ok(),
            None => false,
        }
    }

    /// Registers a new session; false when one with that id exists.
    fn register(&self, id: &str) -> Option<mpsc::Receiver<Control>> {
        let mut open = self.lock_open();
        if open.contains_key(id) || self.ended_reason(id).is_some() {
            return None;
        }
        let (tx, rx) = mpsc::channel(4);
        open.insert(id.to_owned(), tx);
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
        }
    }
}

/// The reading half of the connection carrying the session, with what was
/// read from it and is not yet a frame.
struct LinkRd {
    rd: ReadHalf<BoxLink>,
    reader: WireReader,
}

/// The writing half, with frames waiting to be written.
struct LinkWr {
    wr: WriteHalf<BoxLink>,
    out: Vec<u8>,
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
            out: Vec::with_capacity(TO_LINK_MAX),
        },
    )
}

/// Runs a new resumable session of `req` over `guest`, first carried by
/// `link` (which has been answered `OK`), until it ends; `gone` resolves
/// when the guest is no longer a target here. Returns at once (the answer
/// is the caller's) when the id is taken.
pub(crate) async fn run(
    sessions: Arc<Sessions>,
    req: OpenRequest<'_>,
    guest: TcpStream,
    link: BoxLink,
    gone: impl std::future::Future<Output = ()>,
    max_session: Duration,
) {
    let id = req.session.to_owned();
    let Some(mut control) = sessions.register(&id) else {
        info!(session = %id, "relay session id already used here; refused");
        return;
    };
    let end = pump(&mut control, req, guest, link, gone, max_session).await;
    match &end {
        End::Done => info!(session = %id, "relay session closed"),
        other => info!(session = %id, reason = %other, "relay session ended"),
    }
    sessions.bury(&id, &end.to_string());
}

async fn pump(
    control: &mut mpsc::Receiver<Control>,
    req: OpenRequest<'_>,
    guest: TcpStream,
    link: BoxLink,
    gone: impl std::future::Future<Output = ()>,
    max_session: Duration,
) -> End {
    let grace = req.grace;
    let ack_every = (req.buffer / 4) as u64;
    let (mut guest_rd, mut guest_wr) = guest.into_split();
    let mut outbox = Outbox::new(req.buffer);
    let mut inbox = Inbox::default();
    let mut to_guest: VecDeque<Bytes> = VecDeque::new();
    let mut to_guest_bytes = 0usize;
    let mut guest_shut = false;
    let (rd, wr) = carry(link);
    let (mut link_rd, mut link_wr) = (Some(rd), Some(wr));
    let mut parked_since: Option<tokio::time::Instant> = None;
    let mut ack_at: Option<tokio::time::Instant> = None;
    let lifetime = tokio::time::sleep(max_session);
    tokio::pin!(lifetime, gone);
    let mut buf = vec![0u8; otherix_proto::resume::MAX_DATA];

    loop {
        // Frames due on the connection: acks, then data.
        if let Some(c) = link_wr.as_mut() {
            if let Some(ack) = inbox.ack_due(ack_every) {
                ack.encode_wire(&mut c.out);
                ack_at = None;
            }
            while c.out.len() < TO_LINK_MAX {
                match outbox.next_frame() {
                    Some(f) => f.encode_wire(&mut c.out),
                    None => break,
                }
            }
        }
        // Everything the client sent has reached the guest, and everything
        // the guest sent (and its end) has reached the client.
        if inbox.ended() && to_guest.is_empty() && guest_shut && outbox.all_acked() {
            if let Some(mut c) = link_wr.take() {
                Frame::Close {
                    code: otherix_proto::relay::CLOSE_DONE,
                    reason: "both directions ended".into(),
                }
                .encode_wire(&mut c.out);
                let _ = tokio::time::timeout(Duration::from_secs(5), async {
                    c.wr.write_all(&c.out).await?;
                    c.wr.shutdown().await
                })
                .await;
            }
            return End::Done;
        }
        let guest_readable = !outbox.ended() && outbox.room() > 0;
        let can_read_link = to_guest_bytes < TO_GUEST_MAX;
        let parked_deadline = parked_since.map(|t| t + grace);
        tokio::select! {
            n = guest_rd.read(&mut buf), if guest_readable => match n {
                Ok(0) => outbox.end(),
                Ok(n) => outbox.push(Bytes::copy_from_slice(&buf[..n])),
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
            }, if link_rd.is_some() && can_read_link => match r {
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
                                ack_at.get_or_insert_with(|| tokio::time::Instant::now() + ACK_DELAY);
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
                                ack_at.get_or_insert_with(|| tokio::time::Instant::now() + ACK_DELAY);
                            }
                            Ok(Frame::Close { code, reason }) => return End::ControlPlaneClosed(code, reason),
                            Err(e) => return fail(link_wr, End::Protocol(e.to_string())).await,
                        }
                    }
                }
            },
            w = async {
                let c = link_wr.as_mut().expect("guarded");
                c.wr.write(&c.out).await
            }, if link_wr.as_ref().is_some_and(|c| !c.out.is_empty()) => match w {
                Ok(n) => {
                    let c = link_wr.as_mut().expect("guarded");
                    c.out.drain(..n);
                    if c.out.is_empty() {
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
                if let (Some(ack), Some(c)) = (inbox.ack_due(1), link_wr.as_mut()) {
                    ack.encode_wire(&mut c.out);
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
                            let mut out = std::mem::take(&mut old.out);
                            Frame::Close { code: CLOSE_TAKEN_OVER, reason: "resumed on another connection".into() }
                                .encode_wire(&mut out);
                            let _ = tokio::time::timeout(Duration::from_secs(2), old.wr.write_all(&out)).await;
                        });
                    }
                    inbox.resumed();
                    fresh_wr.out.extend_from_slice(format!("OK {}\n", inbox.received()).as_bytes());
                    info!(from, received = inbox.received(), parked_ms = parked_since.map(|t| t.elapsed().as_millis() as u64), "relay session resumed");
                    (link_rd, link_wr) = (Some(fresh_rd), Some(fresh_wr));
                    parked_since = None;
                }
                Some(Control::Abort) | None => return fail(link_wr, End::Aborted).await,
            },
            () = async { tokio::time::sleep_until(parked_deadline.expect("guarded")).await }, if parked_deadline.is_some() => {
                return End::Abandoned(grace);
            },
            () = &mut gone => return End::GuestLeft,
            () = &mut lifetime => return fail(link_wr, End::MaxLifetime).await,
        }
    }
}

/// Ends the session with `end`, telling the connection carrying it (if
/// any) why in a `Close`.
async fn fail(link: Option<LinkWr>, end: End) -> End {
    if let Some(mut c) = link {
        let code = match end {
            End::MaxLifetime => otherix_proto::relay::CLOSE_IDLE,
            _ => otherix_proto::relay::CLOSE_FAILED,
        };
        let mut out = std::mem::take(&mut c.out);
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
            request(Duration::from_secs(30)),
            guest,
            link,
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

    #[tokio::test]
    async fn a_session_nobody_resumes_ends_at_its_grace_and_a_late_resume_hears_why() {
        let sessions = Arc::new(Sessions::default());
        let (cp, link) = Cp::pair();
        let task = tokio::spawn(run(
            sessions.clone(),
            request(Duration::from_millis(200)),
            echo_guest().await,
            link,
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
            request(Duration::from_secs(30)),
            echo_guest().await,
            link,
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
            request(Duration::from_secs(60)),
            echo_guest().await,
            link,
            std::future::pending(),
            Duration::from_secs(3600),
        ));
        drop(cp);
        while sessions.len() == 0 {
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
