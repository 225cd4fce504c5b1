//! Checkpoint and restore of real connections: on loopback, and moved between
//! network namespaces as a migrating guest's connection is. Need root.

use super::*;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// A reproducible byte stream, different per seed.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A connection on `listener`: (the accepted end, the dialing end). The
/// dialing end plays the agent, whose socket moves.
fn pair(listener: &TcpListener) -> (TcpStream, TcpStream) {
    pair_with_mss(listener, None)
}

/// [`pair`], the dialer's segments at most `mss` bytes if given.
fn pair_with_mss(listener: &TcpListener, mss: Option<i32>) -> (TcpStream, TcpStream) {
    // The dialer's address is one of its own in 127/8, not 127.0.0.1: a
    // test restores it after closing the frozen socket, and meanwhile any
    // other connection on this machine (a whole suite runs beside) may take
    // a freed ephemeral port of 127.0.0.1 — it did, once (EADDRINUSE).
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let salt = std::process::id();
    let own = Ipv4Addr::new(
        127,
        100 + (salt % 100) as u8,
        (salt >> 8) as u8,
        1 + (n % 250) as u8,
    );
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.bind(&std::net::SocketAddr::from((own, 0)).into()).unwrap();
    if let Some(mss) = mss {
        sys::setsockopt_int(socket.as_raw_fd(), libc::SOL_TCP, libc::TCP_MAXSEG, mss).unwrap();
    }
    socket.connect(&listener.local_addr().unwrap().into()).unwrap();
    let dialer: TcpStream = socket.into();
    let (accepted, _) = listener.accept().unwrap();
    (accepted, dialer)
}

/// Fills `stream`'s send queue until the peer's receive buffer and its own
/// send buffer are full (so part of it was never sent); returns what it wrote.
fn write_until_full(stream: &TcpStream, seed: u64) -> Vec<u8> {
    let chunk = pattern(seed, 64 * 1024);
    let mut written = Vec::new();
    stream.set_nonblocking(true).unwrap();
    let mut s = stream;
    let mut idle = 0;
    // Autotuning grows the send buffer as it fills: stop after a few tries in
    // a row that find no room.
    while idle < 5 {
        match s.write(&chunk) {
            Ok(n) => {
                written.extend_from_slice(&chunk[..n]);
                idle = 0;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                idle += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("write: {e}"),
        }
    }
    stream.set_nonblocking(false).unwrap();
    written
}

fn tcp_state(stream: &TcpStream) -> u8 {
    sys::tcp_info(stream.as_raw_fd()).unwrap().tcpi_state
}

/// Checks the restored connection end to end: `b` (restored) first reads
/// `b_pending` and `a` reads `a_pending`, then `extra` more bytes go each way
/// at once; everything byte-exact.
fn exchange(a: TcpStream, b: TcpStream, a_pending: &[u8], b_pending: &[u8], extra: usize) {
    let a_extra = pattern(11, extra);
    let b_extra = pattern(12, extra);
    let a_expect = [a_pending, &b_extra].concat();
    let b_expect = [b_pending, &a_extra].concat();
    for s in [&a, &b] {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    }
    std::thread::scope(|scope| {
        let mut aw = a.try_clone().unwrap();
        let mut bw = b.try_clone().unwrap();
        let a_extra = &a_extra;
        let b_extra = &b_extra;
        scope.spawn(move || aw.write_all(a_extra).unwrap());
        scope.spawn(move || bw.write_all(b_extra).unwrap());
        let a_got = scope.spawn(|| read_exact_len(&a, a_expect.len()));
        let b_got = read_exact_len(&b, b_expect.len());
        let a_got = a_got.join().unwrap();
        assert!(
            b_got == b_expect,
            "restored end read other bytes than were sent to it"
        );
        assert!(
            a_got == a_expect,
            "peer read other bytes than the restored end sent"
        );
    });
    a.shutdown(std::net::Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    (&b).read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "{} bytes too many", rest.len());
}

fn read_exact_len(s: &TcpStream, len: usize) -> Vec<u8> {
    let mut buf = vec![0; len];
    let mut s = s;
    s.read_exact(&mut buf).unwrap();
    buf
}

#[test]
fn a_lower_retransmission_floor_holds_for_that_socket_only() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let (accepted, dialer) = pair(&listener);
    match set_rto_min(&dialer, Duration::from_millis(10)) {
        // A kernel before 6.15 has no such option: nothing to hold.
        Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => return,
        r => r.unwrap(),
    }
    // Whole kernel ticks: 10 ms is 12 ms at 250 Hz.
    let floor = rto_min(&dialer).unwrap();
    assert!(
        (Duration::from_millis(10)..Duration::from_millis(20)).contains(&floor),
        "{floor:?}"
    );
    assert_eq!(rto_min(&accepted).unwrap(), Duration::from_millis(200));
    // Under two ticks (or above the kernel's 200 ms) is refused, unchanged.
    let err = set_rto_min(&dialer, Duration::from_micros(1)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    assert_eq!(rto_min(&dialer).unwrap(), floor);
}

#[test]
fn available_as_root() {
    available().unwrap();
}

#[test]
fn without_cap_net_admin_repair_is_unavailable_and_the_socket_untouched() {
    if std::env::var_os("OXREP_WITHOUT_NET_ADMIN").is_some() {
        // This process was started without CAP_NET_ADMIN (below).
        let err = available().unwrap_err();
        assert_eq!(
            err.to_string(),
            "TCP repair unavailable: setsockopt(TCP_REPAIR): Operation not permitted (os error 1)"
        );
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let (a, b) = pair(&listener);
        let err = checkpoint(&b).unwrap_err();
        assert!(matches!(err, RepairError::Unavailable { .. }), "{err:?}");
        exchange(a, b, &[], &[], 1024);
        return;
    }
    let out = Command::new("setpriv")
        .args(["--bounding-set", "-net_admin", "--inh-caps", "-net_admin", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "tests::without_cap_net_admin_repair_is_unavailable_and_the_socket_untouched",
            "--test-threads=1",
        ])
        .env("OXREP_WITHOUT_NET_ADMIN", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn debug_shows_queue_lengths_not_their_bytes() {
    let state = TcpState {
        send_queue: b"secret".to_vec(),
        ..restorable_state()
    };
    let debug = format!("{state:?}");
    assert!(debug.contains("send_queue: <6 bytes>"), "{debug}");
    assert!(!debug.contains('['), "a byte list in {debug}");
}

#[test]
fn half_closed_connection_is_refused_and_left_alone() {
    // A peer's FIN makes the connection CLOSE_WAIT: refused before freezing;
    // the socket still reads the FIN as usual.
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let (a, b) = pair(&listener);
    a.shutdown(std::net::Shutdown::Write).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let err = checkpoint(&b).unwrap_err();
    assert_eq!(
        err.to_string(),
        "cannot checkpoint this socket: not an established connection (TCP state CLOSE_WAIT)"
    );
    assert_eq!(
        sys::getsockopt_int(b.as_raw_fd(), libc::SOL_TCP, libc::TCP_REPAIR).unwrap(),
        0
    );
    assert_eq!((&b).read(&mut [0; 4]).unwrap(), 0);
}

#[test]
fn loopback_connection_survives_checkpoint_and_restore() {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let (mut a, b) = pair(&listener);
    drop(listener);
    // The peer's bytes the agent has not read yet, and the agent's bytes the
    // peer has not read (filling both buffers, so part was never sent).
    let to_b = pattern(1, 1000);
    a.write_all(&to_b).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let to_a = write_until_full(&b, 2);

    let state = checkpoint(&b).unwrap();
    assert_eq!(state.recv_queue, to_b);
    assert!(!state.send_queue.is_empty());
    assert!(
        state.unsent > 0,
        "expected unsent bytes, state {:?}",
        summary(&state)
    );
    assert!(to_a.ends_with(&state.send_queue));
    assert_eq!(state.local, sockaddr_v4(b.local_addr().unwrap()));
    assert_eq!(state.remote, sockaddr_v4(b.peer_addr().unwrap()));
    drop(b);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        tcp_state(&a),
        sys::TCP_ESTABLISHED,
        "the peer saw the frozen socket close"
    );

    let b2 = restore(&state).unwrap();
    assert_eq!(sockaddr_v4(b2.local_addr().unwrap()), state.local);
    exchange(a, b2, &to_a, &to_b, 4 << 20);
}

#[test]
fn state_restores_after_a_trip_through_json() {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let (mut a, b) = pair(&listener);
    a.write_all(b"unread").unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let state = checkpoint(&b).unwrap();
    drop(b);
    let json = serde_json::to_string(&state).unwrap();
    let back: TcpState = serde_json::from_str(&json).unwrap();
    assert_eq!(back, state);
    exchange(a, restore(&back).unwrap(), &[], b"unread", 64 * 1024);
}

#[test]
fn frozen_socket_closes_without_a_trace() {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let (a, b) = pair(&listener);
    let state = checkpoint(&b).unwrap();
    assert!(state.send_queue.is_empty() && state.recv_queue.is_empty());
    drop(b);
    std::thread::sleep(Duration::from_millis(100));
    a.set_nonblocking(true).unwrap();
    let err = (&a).read(&mut [0; 16]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::WouldBlock, "the peer saw a FIN or RST");
    a.set_nonblocking(false).unwrap();

    let b2 = restore(&state).unwrap();
    exchange(a, b2, &[], &[], 64 * 1024);
}

#[test]
fn twice_in_a_row() {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let (mut a, b) = pair(&listener);
    a.write_all(b"hello").unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let state = checkpoint(&b).unwrap();
    drop(b);
    let b2 = restore(&state).unwrap();
    let state2 = checkpoint(&b2).unwrap();
    assert_eq!(state2.recv_queue, b"hello");
    assert_eq!(state2.recv_seq, state.recv_seq);
    drop(b2);
    let b3 = restore(&state2).unwrap();
    exchange(a, b3, &[], b"hello", 256 * 1024);
}

#[test]
fn listening_socket_is_refused_and_left_alone() {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let err = checkpoint(&listener).unwrap_err();
    assert!(matches!(err, RepairError::Unsupported(_)), "{err:?}");
    assert_eq!(
        err.to_string(),
        "cannot checkpoint this socket: not an established connection (TCP state LISTEN)"
    );
    // Still listening, not frozen.
    let (_a, _b) = pair(&listener);
}

#[test]
fn udp_socket_is_refused() {
    let udp = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let err = checkpoint(&udp).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("cannot checkpoint this socket: not a TCP socket"),
        "{err}"
    );
}

#[test]
fn inconsistent_state_is_refused() {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let (_a, b) = pair(&listener);
    let mut state = checkpoint(&b).unwrap();
    state.unsent = 10;
    let err = restore(&state).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid TCP state: 10 unsent bytes in a send queue of 0"
    );
}

#[test]
fn restore_onto_a_taken_four_tuple_says_which_step() {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let (_a, b) = pair(&listener);
    let state = checkpoint(&b).unwrap();
    // `b` still holds the four-tuple in this namespace.
    let err = restore(&state).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!("TCP restore failed: connect({}): ", state.remote)),
        "{msg}"
    );
}

fn sockaddr_v4(addr: SocketAddr) -> SocketAddrV4 {
    match addr {
        SocketAddr::V4(a) => a,
        SocketAddr::V6(a) => panic!("IPv6 {a}"),
    }
}

fn summary(s: &TcpState) -> String {
    format!(
        "send {} (unsent {}), receive {}, mss {}, wscale {}/{}, window {:?}",
        s.send_queue.len(),
        s.unsent,
        s.recv_queue.len(),
        s.mss,
        s.snd_wscale,
        s.rcv_wscale,
        s.window
    )
}

// --- Across network namespaces: the real case. --------------------------------

/// Network namespaces made for one test, deleted when dropped (also when the
/// test fails).
struct Netns {
    names: Vec<String>,
}

impl Netns {
    fn new(tag: &str, roles: &[&str]) -> Netns {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut ns = Netns { names: Vec::new() };
        for role in roles {
            let name = format!("oxrep-{}-{tag}{n}-{role}", std::process::id());
            ip(&["netns", "add", &name]);
            ns.names.push(name.clone());
            ip(&["-n", &name, "link", "set", "lo", "up"]);
        }
        ns
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `f` on a thread that entered network namespace `name`; sockets made
/// there stay in it whichever thread uses them later.
fn in_netns<T: Send>(name: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            let ns = std::fs::File::open(format!("/run/netns/{name}")).unwrap();
            sys::enter_netns(&ns).unwrap();
            f()
        })
        .join()
        .unwrap()
    })
}

/// guest (10.231.0.2, listening on port 7000) <-veth-> node1 (10.231.0.1),
/// and an empty node2 the node's end of the veth can move to, as a migrated
/// guest's bridge port does: same address, same MAC, another namespace.
struct Migration {
    ns: Netns,
    dev: String,
}

impl Migration {
    fn new(tag: &str) -> Migration {
        let ns = Netns::new(tag, &["guest", "node1", "node2"]);
        let dev = format!("oxr{}{tag}", std::process::id() % 100_000);
        let (guest, node1) = (&ns.names[0], &ns.names[1]);
        ip(&[
            "link", "add", &dev, "netns", node1, "type", "veth", "peer", "name", "eth0", "netns", guest,
        ]);
        ip(&["-n", guest, "addr", "add", "10.231.0.2/24", "dev", "eth0"]);
        ip(&["-n", guest, "link", "set", "eth0", "up"]);
        ip(&["-n", node1, "addr", "add", "10.231.0.1/24", "dev", &dev]);
        ip(&["-n", node1, "link", "set", &dev, "up"]);
        Migration { ns, dev }
    }

    fn guest(&self) -> &str {
        &self.ns.names[0]
    }

    /// The guest's end of a connection node1 dialed, and node1's end.
    fn connect(&self) -> (TcpStream, TcpStream) {
        let listener = in_netns(self.guest(), || TcpListener::bind("10.231.0.2:7000").unwrap());
        let b = in_netns(&self.ns.names[1], || {
            available().unwrap();
            TcpStream::connect("10.231.0.2:7000").unwrap()
        });
        let (a, _) = listener.accept().unwrap();
        (a, b)
    }

    /// Moves node1's end, with its address, to node2.
    fn move_to_node2(&self) {
        let (node1, node2) = (&self.ns.names[1], &self.ns.names[2]);
        ip(&["-n", node1, "link", "set", &self.dev, "netns", node2]);
        ip(&["-n", node2, "addr", "add", "10.231.0.1/24", "dev", &self.dev]);
        ip(&["-n", node2, "link", "set", &self.dev, "up"]);
    }

    fn restore_on_node2(&self, state: &TcpState) -> TcpStream {
        in_netns(&self.ns.names[2], || restore(state).unwrap())
    }
}

#[test]
fn connection_moves_to_another_namespace_with_its_address() {
    let m = Migration::new("mv");
    let (mut a, b) = m.connect();
    let to_b = pattern(3, 5000);
    a.write_all(&to_b).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let to_a = write_until_full(&b, 4);

    let state = checkpoint(&b).unwrap();
    assert_eq!(state.recv_queue, to_b);
    assert_eq!(state.local.ip(), &Ipv4Addr::new(10, 231, 0, 1));
    drop(b);
    m.move_to_node2();
    assert_eq!(
        tcp_state(&a),
        sys::TCP_ESTABLISHED,
        "the guest saw the frozen socket close"
    );

    let b2 = m.restore_on_node2(&state);
    exchange(a, b2, &to_a, &to_b, 4 << 20);
}

#[test]
fn segments_lost_during_the_move_are_retransmitted_both_ways() {
    // The guest loses its address before the move: what node1 sends reaches
    // it but is dropped, never acknowledged (the sent part of the send queue,
    // which the restored socket must retransmit), and what the guest sends
    // meanwhile never leaves it (it retransmits that to the restored socket).
    let m = Migration::new("ls");
    let (mut a, b) = m.connect();
    let to_b = pattern(5, 1000);
    a.write_all(&to_b).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    ip(&["-n", m.guest(), "addr", "del", "10.231.0.2/24", "dev", "eth0"]);
    let lost_to_b = pattern(6, 3000);
    a.write_all(&lost_to_b).unwrap();
    let to_a = write_until_full(&b, 7);

    let state = checkpoint(&b).unwrap();
    assert_eq!(state.send_queue, to_a, "nothing was acknowledged");
    assert!(
        (state.unsent as usize) < to_a.len(),
        "some was sent: {}",
        summary(&state)
    );
    assert_eq!(state.recv_queue, to_b);
    drop(b);
    m.move_to_node2();
    ip(&["-n", m.guest(), "addr", "add", "10.231.0.2/24", "dev", "eth0"]);

    let b2 = m.restore_on_node2(&state);
    exchange(a, b2, &to_a, &[to_b, lost_to_b].concat(), 1 << 20);
}

#[test]
fn restore_where_the_local_address_is_missing_says_so() {
    // A route to the peer, but not the address to send from.
    let ns = Netns::new("nr", &["empty"]);
    let n = &ns.names[0];
    ip(&["-n", n, "link", "add", "v0", "type", "veth", "peer", "name", "v1"]);
    ip(&["-n", n, "link", "set", "v0", "up"]);
    ip(&["-n", n, "link", "set", "v1", "up"]);
    ip(&["-n", n, "route", "add", "10.233.0.0/24", "dev", "v0"]);
    let state = TcpState {
        remote: "10.233.0.2:7000".parse().unwrap(),
        ..restorable_state()
    };
    let err = in_netns(&ns.names[0], || restore(&state).unwrap_err());
    assert_eq!(
        err.to_string(),
        "TCP restore failed: connect(10.233.0.2:7000): Network is unreachable (os error 101)"
    );
}

#[test]
fn made_up_state_restores_and_checkpoints_back() {
    let ns = Netns::new("fb", &["node"]);
    let n = &ns.names[0];
    ip(&["-n", n, "link", "add", "v0", "type", "veth", "peer", "name", "v1"]);
    ip(&["-n", n, "link", "set", "v0", "up"]);
    ip(&["-n", n, "link", "set", "v1", "up"]);
    ip(&["-n", n, "addr", "add", "10.232.0.1/24", "dev", "v0"]);
    let state = restorable_state();
    let restored = in_netns(&ns.names[0], || restore(&state).unwrap());
    let again = checkpoint(&restored).unwrap();
    assert_eq!(again.recv_queue, state.recv_queue);
    assert_eq!(again.send_queue, state.send_queue);
    assert_eq!((again.send_seq, again.recv_seq), (state.send_seq, state.recv_seq));
    assert_eq!((again.snd_wscale, again.rcv_wscale, again.sack), (7, 7, true));
}

/// A state made up, not checkpointed: 10.232.0.1 -> 10.232.0.2.
fn restorable_state() -> TcpState {
    TcpState {
        local: "10.232.0.1:40000".parse().unwrap(),
        remote: "10.232.0.2:7000".parse().unwrap(),
        send_seq: 1000,
        recv_seq: 5000,
        send_queue: b"queued".to_vec(),
        unsent: 0,
        recv_queue: b"unread".to_vec(),
        mss: 1460,
        snd_wscale: 7,
        rcv_wscale: 7,
        timestamp: 12345,
        sack: true,
        tstamp_ok: true,
        wscale_ok: true,
        window: None,
    }
}

#[test]
fn frozen_socket_still_receives_so_a_later_checkpoint_supersedes() {
    // Why the caller must keep the peer quiet between its last checkpoint and
    // dropping the socket: the kernel still receives (and acknowledges) on a
    // frozen socket. Checkpointing it again picks those bytes up.
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let (mut a, b) = pair(&listener);
    let first = checkpoint(&b).unwrap();
    a.write_all(b"late").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        sys::ioctl_int(a.as_raw_fd(), sys::SIOCOUTQ).unwrap(),
        0,
        "acknowledged"
    );
    let second = checkpoint(&b).unwrap();
    assert!(first.recv_queue.is_empty());
    assert_eq!(second.recv_queue, b"late");
    assert_eq!(second.recv_seq, first.recv_seq.wrapping_add(4));
    drop(b);
    let b2 = restore(&second).unwrap();
    exchange(a, b2, &[], b"late", 1024);
}

#[test]
fn a_frozen_deaf_socket_sends_no_new_data_of_its_own() {
    // One migration in ten or so stalled both ways: the deaf, frozen socket
    // heard no acknowledgement, so its loss probe forced a segment of new
    // data out — bytes the peer then had that the state called unsent. The
    // restored socket was behind the peer, which acknowledged data "from
    // the future": each such segment dropped (a challenge ACK), both ways.
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    // Small segments: the first flight (ten of them) leaves most unsent.
    let (mut a, b) = pair_with_mss(&listener, Some(536));
    deafen(&b).unwrap();
    let data = pattern(21, 256 * 1024);
    b.set_nonblocking(true).unwrap();
    let written = (&b).write(&data).unwrap();
    b.set_nonblocking(false).unwrap();
    let state = checkpoint(&b).unwrap();
    assert!(state.unsent > 0, "part of the write was never sent: {state:?}");
    let sent = state.send_queue.len() - state.unsent as usize;
    // Past the loss probe: it comes before the first retransmission
    // timeout, and is a retransmission itself when it sends nothing new.
    let mut waited = Duration::ZERO;
    while sys::tcp_info(b.as_raw_fd()).unwrap().tcpi_total_retrans == 0 {
        assert!(
            waited < Duration::from_secs(20),
            "no retransmission from the frozen socket"
        );
        std::thread::sleep(Duration::from_millis(10));
        waited += Duration::from_millis(10);
    }
    // The peer has at most what the state calls sent (its first part).
    a.set_nonblocking(true).unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match a.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
    }
    a.set_nonblocking(false).unwrap();
    assert!(
        got.len() <= sent,
        "{} bytes reached the peer, {sent} were sent at the checkpoint",
        got.len()
    );
    assert_eq!(got, data[..got.len()]);
    // The send window the state carries is the one before it was closed.
    assert!(state.window.unwrap().snd_wnd > 0, "{state:?}");
    // And the restored socket goes on from there, byte-exact.
    drop(b);
    let b2 = restore(&state).unwrap();
    exchange(a, b2, &data[got.len()..written], &[], 64 * 1024);
}

#[test]
fn a_deafened_socket_takes_nothing_in_so_the_peer_sends_it_again_to_the_restored_one() {
    // What the agent does when a guest's connection moves: deafen, then
    // freeze. What the peer sends meanwhile is neither received nor
    // acknowledged, and reaches the restored socket as a retransmission.
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let (mut a, b) = pair(&listener);
    deafen(&b).unwrap();
    let state = checkpoint(&b).unwrap();
    a.write_all(b"late").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        sys::ioctl_int(a.as_raw_fd(), sys::SIOCOUTQ).unwrap(),
        4,
        "not acknowledged by the deaf socket"
    );
    assert!(checkpoint(&b).unwrap().recv_queue.is_empty(), "nor taken in");
    drop(b);
    let b2 = restore(&state).unwrap();
    exchange(a, b2, &[], b"late", 1024);
}

#[test]
fn a_connection_trackers_entry_is_forgotten_so_a_connection_coming_back_is_not_invalid() {
    // A namespace whose firewall tracks connections (as a node's host rules
    // do): a loopback connection gets an entry; forgetting it removes it,
    // and a second time finds none.
    let ns = Netns::new("ct", &["node"]);
    let rules = "add table inet oxrepct; add chain inet oxrepct input { type filter hook input priority filter; policy accept; }; add rule inet oxrepct input ct state established accept";
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.names[0], "nft", rules])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "nft: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    in_netns(&ns.names[0], || {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let (mut a, b) = pair(&listener);
        a.write_all(b"x").unwrap();
        let _ = read_exact_len(&b, 1);
        let local = sockaddr_v4(b.local_addr().unwrap());
        let remote = sockaddr_v4(b.peer_addr().unwrap());
        assert!(forget_conntrack(local, remote).unwrap(), "the entry was there");
        assert!(!forget_conntrack(local, remote).unwrap(), "and is gone");
    });
}

#[test]
fn a_nudged_connection_probes_its_peer_and_goes_on() {
    // A live connection probed (repair on and off) loses nothing: the
    // probe is an acknowledgement the peer answers, nothing more.
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let (a, b) = pair(&listener);
    let before = sys::tcp_info(b.as_raw_fd()).unwrap().tcpi_segs_out;
    nudge(&b).unwrap();
    let after = sys::tcp_info(b.as_raw_fd()).unwrap().tcpi_segs_out;
    assert!(after > before, "a probe went out ({before} -> {after} segments)");
    exchange(a, b, &[], &[], 64 * 1024);
}
