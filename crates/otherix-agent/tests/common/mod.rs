//! Test worlds: network namespaces made for one test, removed on drop (also after a
//! panic), plus a two-node VXLAN overlay with one guest per node, and TCP helpers.
//!
//! Every namespace of a world is named `oxa<pid>t<testno>-...`, so tests run in
//! parallel without clashing, and a world left behind by a killed run (its pid is
//! gone) is swept by the next run. Nothing is created in the host namespace: node
//! namespaces are joined by a veth pair ("the fabric"), and traffic only goes to
//! addresses inside these namespaces (10.213.0.0/16 fabric, 10.214.0.0/16 overlay).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use otherix_agent::net::{netns, FdbEntry, IfAddr, NeighborEntry, Netlink, Netns, OverlaySpec};
use otherix_agent::runtime::{GuestRuntime, GuestSpec, NetnsRuntime};

/// Namespaces (and a scratch directory) of one test.
pub struct World {
    pub prefix: String,
    pub tmp: PathBuf,
}

impl World {
    pub fn new(testno: u32) -> Self {
        assert!(
            // /proc/self is owned by the effective uid.
            std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap()) == 0,
            "these tests create network namespaces and need root"
        );
        sweep_dead_worlds();
        let prefix = format!("oxa{}t{testno}-", std::process::id());
        sweep(&prefix);
        let tmp = std::env::temp_dir().join(format!("{prefix}tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).unwrap();
        World { prefix, tmp }
    }

    /// The world-unique name for `suffix`.
    pub fn name(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.prefix)
    }

    /// Creates the namespace `<prefix><suffix>` with `lo` up; returns its name.
    pub fn create_ns(&self, suffix: &str) -> String {
        let name = self.name(suffix);
        assert!(netns::create(&name).unwrap(), "{name} already existed");
        sh(&format!("ip -n {name} link set lo up"));
        name
    }
}

impl Drop for World {
    fn drop(&mut self) {
        sweep(&self.prefix);
        let _ = std::fs::remove_dir_all(&self.tmp);
    }
}

/// Kills everything in, and deletes, every namespace starting with `prefix`.
fn sweep(prefix: &str) {
    for name in netns::list(prefix).unwrap_or_default() {
        for pid in netns::pids(&name).unwrap_or_default() {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
        let _ = netns::delete(&name);
    }
}

/// Removes worlds of test runs whose process no longer exists.
fn sweep_dead_worlds() {
    for name in netns::list("oxa").unwrap_or_default() {
        let pid = name
            .strip_prefix("oxa")
            .and_then(|rest| rest.split('t').next())
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                sweep(&format!("oxa{pid}t"));
            }
        }
    }
}

/// Runs a shell command, panicking with its output if it fails; returns stdout.
pub fn sh(cmd: &str) -> String {
    let out = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    assert!(
        out.status.success(),
        "`{cmd}` failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn mac(t: u32, last: u8) -> [u8; 6] {
    [0x02, 0x00, 0x0a, 0xd6, t as u8, last]
}

/// One node of a two-node world: a namespace with an overlay and one guest.
pub struct Node {
    pub netns: String,
    pub nl: Netlink,
    pub vtep: Ipv4Addr,
    pub addr: Ipv4Addr,
    pub mac: [u8; 6],
    pub runtime: NetnsRuntime,
    pub guest: GuestSpec,
}

/// Two node namespaces on a veth fabric, each with bridge `br0` + `vx0` (VNI 100)
/// reconciled from [`OverlaySpec`]s, and one netns guest each.
pub struct TwoNodes {
    pub a: Node,
    pub b: Node,
    pub t: u32,
    /// Last, so namespaces go after the handles into them.
    pub world: World,
}

pub const VNI: u32 = 100;
pub const OVERLAY_MTU: u32 = 1450;

impl TwoNodes {
    pub async fn new(testno: u32) -> Self {
        let world = World::new(testno);
        let t = testno;
        let na = world.create_ns("na");
        let nb = world.create_ns("nb");
        // The fabric: one veth pair straight between the two node namespaces.
        sh(&format!(
            "ip -n {na} link add fab0 type veth peer name fab0 netns {nb}"
        ));
        for (ns, host) in [(&na, 1), (&nb, 2)] {
            sh(&format!("ip -n {ns} addr add 10.213.{t}.{host}/24 dev fab0"));
            sh(&format!("ip -n {ns} link set fab0 up"));
        }
        let node = |netns: String, host: u8, guest_host: u8, suffix: &str| {
            let nl = Netlink::connect_in(&Netns::open(&netns).unwrap()).unwrap();
            let runtime = NetnsRuntime::new(nl.clone(), world.name(&format!("g{suffix}"))).unwrap();
            let addr = Ipv4Addr::new(10, 214, t as u8, host);
            let guest = GuestSpec {
                id: format!("guest-{suffix}"),
                netns: world.name(&format!("g{suffix}1")),
                host_veth: format!("hv{suffix}"),
                bridge: "br0".into(),
                mac: mac(t, guest_host),
                ip: Ipv4Addr::new(10, 214, t as u8, guest_host),
                prefix: 24,
                gateway: addr,
                mtu: OVERLAY_MTU,
                command: None,
                qemu: None,
            };
            Node {
                netns,
                nl,
                vtep: Ipv4Addr::new(10, 213, t as u8, host),
                addr,
                mac: mac(t, host),
                runtime,
                guest,
            }
        };
        let a = node(na, 1, 10, "a");
        let b = node(nb, 2, 11, "b");
        let two = TwoNodes { a, b, t, world };
        for n in [&two.a, &two.b] {
            let changes = n.nl.reconcile_overlay(&two.overlay(n)).await.unwrap();
            assert!(!changes.is_empty());
            n.runtime.ensure(&n.guest).await.unwrap();
        }
        two
    }

    /// The overlay as the control plane would describe it to node `n`: every member
    /// and guest MAC with its VTEP, every IP with its MAC.
    pub fn overlay(&self, n: &Node) -> OverlaySpec {
        let (a, b) = (&self.a, &self.b);
        let other = if n.netns == a.netns { b } else { a };
        OverlaySpec {
            bridge: "br0".into(),
            vxlan: "vx0".into(),
            vni: VNI,
            local_vtep: n.vtep,
            underlay: "fab0".into(),
            mtu: OVERLAY_MTU,
            address: Some(IfAddr::new(n.addr, 24)),
            mac: Some(n.mac),
            fdb: vec![
                FdbEntry::new(a.mac, a.vtep),
                FdbEntry::new(b.mac, b.vtep),
                FdbEntry::new(a.guest.mac, a.vtep),
                FdbEntry::new(b.guest.mac, b.vtep),
            ],
            neighbors: vec![
                NeighborEntry::new(a.guest.ip, a.guest.mac),
                NeighborEntry::new(b.guest.ip, b.guest.mac),
                NeighborEntry::new(other.addr, other.mac),
            ],
        }
    }
}

/// A TCP listener bound inside namespace `ns`.
pub fn listen_in(ns: &str, addr: SocketAddr) -> TcpListener {
    Netns::open(ns)
        .unwrap()
        .run(move || TcpListener::bind(addr))
        .unwrap()
        .unwrap_or_else(|e| panic!("bind {addr} in {ns}: {e}"))
}

/// A TCP connection made from inside namespace `ns`, with IO timeouts so a broken
/// overlay fails the test instead of hanging it.
pub fn connect_from(ns: &str, addr: SocketAddr) -> TcpStream {
    let s = Netns::open(ns)
        .unwrap()
        .run(move || TcpStream::connect_timeout(&addr, Duration::from_secs(10)))
        .unwrap()
        .unwrap_or_else(|e| panic!("connect {addr} from {ns}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    s
}

/// FNV-1a, to compare what was sent with what arrived.
pub fn fnv(hash: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(hash, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}
pub const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// Serves one connection: reads to EOF, answers with (length, hash) of what it read.
pub fn serve_one(listener: TcpListener) -> std::thread::JoinHandle<(u64, u64)> {
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let (mut len, mut hash) = (0u64, FNV_START);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            len += n as u64;
            hash = fnv(hash, &buf[..n]);
        }
        let mut reply = [0u8; 16];
        reply[..8].copy_from_slice(&len.to_be_bytes());
        reply[8..].copy_from_slice(&hash.to_be_bytes());
        s.write_all(&reply).unwrap();
        (len, hash)
    })
}

/// Deterministic test payload of `len` bytes.
pub fn payload(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(31) ^ (i >> 8)) as u8).collect()
}

/// Sends `data` over a fresh connection from `from_ns` to a [`serve_one`] server at
/// `to`, and checks that the server saw exactly those bytes.
pub fn transfer(from_ns: &str, to_ns: &str, to: SocketAddr, data: &[u8]) {
    let server = serve_one(listen_in(to_ns, to));
    let mut s = connect_from(from_ns, to);
    s.write_all(data).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut reply = [0u8; 16];
    s.read_exact(&mut reply).unwrap();
    let (len, hash) = (
        u64::from_be_bytes(reply[..8].try_into().unwrap()),
        u64::from_be_bytes(reply[8..].try_into().unwrap()),
    );
    assert_eq!(len, data.len() as u64, "{from_ns} -> {to}: length");
    assert_eq!(hash, fnv(FNV_START, data), "{from_ns} -> {to}: content");
    assert_eq!(server.join().unwrap(), (len, hash));
}

pub fn sock(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::from((ip, port))
}
