//! The WebSocket tunnels a user could pick instead of the relay, on the same
//! path: a WebSocket-over-TLS server in the control plane's namespace, a TLS
//! leg from there to the node that owns the bridge, and a plain TCP hop from
//! that node to the bridge guest — the relay's three legs — with a WebSocket
//! client (`websocat`) in the host namespace, where `otherix forward` runs.
//!
//! - the node end, shared by both: `socat` in `node1`'s namespace
//!   (`OPENSSL-LISTEN`, requiring a client certificate from the cluster CA,
//!   as the agent's relay endpoint does) dialing the guest;
//! - websocat: `websocat -b wss-l:` (TLS with a certificate for the CP's
//!   address from the cluster CA) → `ssl-connect:tcp:` to the node's socat,
//!   presenting the client certificate (`--client-pkcs12-der`) and checking
//!   the node's — in one process, as the relay does;
//! - websockify: `websockify --ssl-only --cert --key` → a `socat` TLS client
//!   on loopback in the CP's namespace (presenting that certificate,
//!   checking the node's) → the node's socat: websockify cannot speak TLS
//!   to its target, so its path has one more local hop and process.
//!
//! The client side of both is `websocat -b tcp-l:127.0.0.1:PORT wss://...`,
//! trusting only the cluster CA (`SSL_CERT_FILE`). One set of listeners for
//! the guest's echo port (setup times) and one for its iperf3 port.
//! Certificates are minted with `openssl` from the cluster CA's key (ECDSA
//! P-256, like the cluster's own) into the world's directory.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use otherix_testbed::cluster::Cluster;
use otherix_testbed::{wait_until, Ns, Proc};

use crate::bed::{ECHO_PORT, IPERF_PORT};
use crate::procfs;

const WAIT: Duration = Duration::from_secs(30);
/// `-b 65536`: the relay's frame size, and what the nginx row's socat uses.
const SOCAT_BUFFER: &str = "65536";

/// The guest ports each tunnel carries, with the listening ports on the
/// node (TLS), in the CP's namespace (socat on loopback, websocat,
/// websockify) for each.
const LEGS: [(u16, Ports); 2] = [
    (
        ECHO_PORT,
        Ports {
            node: 9507,
            cp_local: 9517,
            websocat: 9601,
            websockify: 9611,
        },
    ),
    (
        IPERF_PORT,
        Ports {
            node: 9508,
            cp_local: 9518,
            websocat: 9602,
            websockify: 9612,
        },
    ),
];

#[derive(Debug, Clone, Copy)]
struct Ports {
    node: u16,
    cp_local: u16,
    websocat: u16,
    websockify: u16,
}

/// Which WebSocket server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Websocat,
    Websockify,
}

/// One WebSocket server (both guest ports) and its client in the host namespace.
#[derive(Debug)]
pub struct WsPath {
    servers: Vec<Proc>,
    clients: Vec<Proc>,
    /// The client's local listener for the guest's echo port.
    pub echo: SocketAddr,
    /// The client's local listener for the guest's iperf3 port.
    pub iperf: SocketAddr,
}

impl WsPath {
    /// CPU seconds of the WebSocket server processes (and the per-connection
    /// children websockify forks, reaped or alive).
    pub fn server_cpu(&self) -> f64 {
        self.servers.iter().map(|p| tree_cpu(p.pid())).sum()
    }

    pub fn client_cpu(&self) -> f64 {
        self.clients.iter().map(|p| tree_cpu(p.pid())).sum()
    }
}

#[derive(Debug)]
pub struct Tunnels {
    node_leg: Vec<Proc>,
    cp_leg: Vec<Proc>,
    pub websocat: WsPath,
    pub websockify: WsPath,
}

impl Tunnels {
    /// Starts the node leg, the CP-side TLS clients, both WebSocket servers
    /// and their clients, for the bridge guest at `guest`.
    pub fn start(cluster: &Cluster, node: &Ns, guest: Ipv4Addr, websocat: &Path) -> anyhow::Result<Tunnels> {
        let dir = cluster.world_dir().join("tunnels");
        std::fs::create_dir_all(&dir)?;
        let certs = Certs::mint(&dir, &cluster.cp_dir(), cluster.cp_ns().ip(), node.ip())?;
        let cp = &cluster.cp_ns();

        let mut node_leg = Vec::new();
        let mut cp_leg = Vec::new();
        for (guest_port, ports) in LEGS {
            let listen = format!(
                "OPENSSL-LISTEN:{},bind={},reuseaddr,fork,nodelay,cert={},key={},cafile={},verify=1",
                ports.node,
                node.ip(),
                certs.node_crt.display(),
                certs.node_key.display(),
                certs.ca.display()
            );
            let dial = format!("TCP:{guest}:{guest_port},nodelay");
            node_leg.push(socat(cluster, node, &listen, &dial)?);

            let listen = format!(
                "TCP-LISTEN:{},bind=127.0.0.1,reuseaddr,fork,nodelay",
                ports.cp_local
            );
            let dial = format!(
                "OPENSSL:{}:{},cert={},key={},cafile={},nodelay",
                node.ip(),
                ports.node,
                certs.client_crt.display(),
                certs.client_key.display(),
                certs.ca.display()
            );
            cp_leg.push(socat(cluster, cp, &listen, &dial)?);
        }

        let websocat_path = ws_path(cluster, node, Kind::Websocat, websocat, &certs)?;
        let websockify_path = ws_path(cluster, node, Kind::Websockify, websocat, &certs)?;
        Ok(Tunnels {
            node_leg,
            cp_leg,
            websocat: websocat_path,
            websockify: websockify_path,
        })
    }

    pub fn path(&self, kind: Kind) -> &WsPath {
        match kind {
            Kind::Websocat => &self.websocat,
            Kind::Websockify => &self.websockify,
        }
    }

    /// CPU seconds of the node's socat, with the per-connection children it forked.
    pub fn node_leg_cpu(&self) -> f64 {
        self.node_leg.iter().map(|p| tree_cpu(p.pid())).sum()
    }

    /// CPU seconds of the CP-side socat (websockify's path), with its children.
    pub fn cp_leg_cpu(&self) -> f64 {
        self.cp_leg.iter().map(|p| tree_cpu(p.pid())).sum()
    }
}

/// Starts the servers of `kind` in the CP's namespace and a websocat client
/// for each in the host namespace.
fn ws_path(
    cluster: &Cluster,
    node: &Ns,
    kind: Kind,
    websocat: &Path,
    certs: &Certs,
) -> anyhow::Result<WsPath> {
    let cp = &cluster.cp_ns();
    let ca = certs.ca.to_string_lossy().into_owned();
    let mut servers = Vec::new();
    let mut clients = Vec::new();
    let mut locals = Vec::new();
    for (_, ports) in LEGS {
        let backend = format!("127.0.0.1:{}", ports.cp_local);
        let (port, proc) = match kind {
            Kind::Websocat => {
                let listen = format!("wss-l:{}:{}", cp.ip(), ports.websocat);
                let args = vec![
                    "-b".to_string(),
                    "--pkcs12-der".into(),
                    s(&certs.server_p12),
                    "--pkcs12-passwd".into(),
                    Certs::P12_PASSWORD.into(),
                    "--client-pkcs12-der".into(),
                    s(&certs.client_p12),
                    "--client-pkcs12-passwd".into(),
                    Certs::P12_PASSWORD.into(),
                    "--tls-domain".into(),
                    node.ip().to_string(),
                    listen,
                    format!("ssl-connect:tcp:{}:{}", node.ip(), ports.node),
                ];
                // The node's certificate is checked against the cluster CA only.
                let env = [("SSL_CERT_FILE", ca.as_str())];
                (
                    ports.websocat,
                    cluster.world.spawn(Some(cp), websocat, &args, &env)?,
                )
            }
            Kind::Websockify => {
                let args = vec![
                    "--ssl-only".to_string(),
                    "--cert".into(),
                    certs.server_crt.to_string_lossy().into_owned(),
                    "--key".into(),
                    certs.server_key.to_string_lossy().into_owned(),
                    format!("{}:{}", cp.ip(), ports.websockify),
                    backend,
                ];
                (
                    ports.websockify,
                    cluster.world.spawn(Some(cp), "websockify", &args, &[])?,
                )
            }
        };
        // A bare TCP connection is harmless here: the servers dial their
        // backend only after a WebSocket handshake.
        let addr = SocketAddr::V4(SocketAddrV4::new(cp.ip(), port));
        wait_until(&format!("{kind:?} to listen on {addr}"), WAIT, || {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200))
                .ok()
                .map(drop)
        })
        .with_context(|| format!("{kind:?} did not start; its log:\n{}", proc.log()))?;
        servers.push(proc);

        let local = crate::bed::free_local_port()?;
        let client = cluster.world.spawn(
            None,
            websocat,
            [
                "-b".to_string(),
                format!("tcp-l:{local}"),
                format!("wss://{addr}/"),
            ],
            &[("SSL_CERT_FILE", &ca)],
        )?;
        // Not a probe connection: on the iperf3 port it would reach iperf3's
        // server, which takes any connection for a test.
        wait_until(&format!("websocat to listen on {local}"), WAIT, || {
            listening(&std::fs::read_to_string("/proc/net/tcp").ok()?, local.port()).then_some(())
        })
        .with_context(|| format!("websocat did not listen; its log:\n{}", client.log()))?;
        clients.push(client);
        locals.push(local);
    }
    Ok(WsPath {
        servers,
        clients,
        echo: locals[0],
        iperf: locals[1],
    })
}

fn socat(cluster: &Cluster, ns: &Ns, listen: &str, dial: &str) -> anyhow::Result<Proc> {
    // `-d -d` only to learn when it listens.
    let proc = cluster.world.spawn(
        Some(ns),
        "socat",
        ["-d", "-d", "-b", SOCAT_BUFFER, listen, dial],
        &[],
    )?;
    proc.wait_for_log("listening on", WAIT)?;
    Ok(proc)
}

/// CPU seconds of `pid`, its reaped children and its live children.
fn tree_cpu(pid: u32) -> f64 {
    procfs::cpu_seconds(pid, true).unwrap_or(0.0)
        + procfs::children(pid)
            .into_iter()
            .filter_map(|c| procfs::cpu_seconds(c, true).ok())
            .sum::<f64>()
}

/// Whether `/proc/net/tcp` (as `text`) holds a socket listening on `port`.
fn listening(text: &str, port: u16) -> bool {
    text.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(local), Some(state)) = (fields.get(1), fields.get(3)) else {
            return false;
        };
        // `0A` is TCP_LISTEN; the local address is `HEXIP:HEXPORT`.
        *state == "0A"
            && local
                .rsplit_once(':')
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
                == Some(port)
    })
}

/// Certificates from the cluster CA for the tunnels' TLS: the WebSocket
/// servers' (the CP's address), the node leg's server (the node's address)
/// and the CP side's client certificate.
struct Certs {
    ca: PathBuf,
    server_crt: PathBuf,
    server_key: PathBuf,
    server_p12: PathBuf,
    node_crt: PathBuf,
    client_p12: PathBuf,
    node_key: PathBuf,
    client_crt: PathBuf,
    client_key: PathBuf,
}

impl Certs {
    const P12_PASSWORD: &'static str = "bench";

    fn mint(dir: &Path, cp_dir: &Path, cp_ip: Ipv4Addr, node_ip: Ipv4Addr) -> anyhow::Result<Certs> {
        let ca = cp_dir.join("ca.crt");
        let ca_key = cp_dir.join("ca.key");
        let leaf = |name: &str, ext: &str| -> anyhow::Result<(PathBuf, PathBuf)> {
            let key = dir.join(format!("{name}.key"));
            let csr = dir.join(format!("{name}.csr"));
            let crt = dir.join(format!("{name}.crt"));
            let ext_file = dir.join(format!("{name}.ext"));
            std::fs::write(&ext_file, ext)?;
            openssl(&[
                "req",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
                &s(&key),
                "-out",
                &s(&csr),
            ])?;
            openssl(&[
                "x509",
                "-req",
                "-in",
                &s(&csr),
                "-CA",
                &s(&ca),
                "-CAkey",
                &s(&ca_key),
                "-CAcreateserial",
                "-days",
                "1",
                "-sha256",
                "-extfile",
                &s(&ext_file),
                "-out",
                &s(&crt),
            ])?;
            // Leaf and CA, as the cluster's servers present them.
            let chain = std::fs::read_to_string(&crt)? + &std::fs::read_to_string(&ca)?;
            std::fs::write(&crt, chain)?;
            Ok((crt, key))
        };
        let (server_crt, server_key) = leaf(
            "ws-server",
            &format!("subjectAltName=IP:{cp_ip}\nextendedKeyUsage=serverAuth\n"),
        )?;
        let (node_crt, node_key) = leaf(
            "node-leg",
            &format!("subjectAltName=IP:{node_ip}\nextendedKeyUsage=serverAuth\n"),
        )?;
        let (client_crt, client_key) = leaf(
            "cp-leg",
            "subjectAltName=DNS:control-plane.otherix\nextendedKeyUsage=clientAuth\n",
        )?;
        let server_p12 = dir.join("ws-server.p12");
        openssl(&[
            "pkcs12",
            "-export",
            "-inkey",
            &s(&server_key),
            "-in",
            &s(&server_crt),
            "-out",
            &s(&server_p12),
            "-passout",
            &format!("pass:{}", Self::P12_PASSWORD),
        ])?;
        let client_p12 = dir.join("cp-leg.p12");
        openssl(&[
            "pkcs12",
            "-export",
            "-inkey",
            &s(&client_key),
            "-in",
            &s(&client_crt),
            "-out",
            &s(&client_p12),
            "-passout",
            &format!("pass:{}", Self::P12_PASSWORD),
        ])?;
        Ok(Certs {
            ca,
            server_crt,
            server_key,
            server_p12,
            client_p12,
            node_crt,
            node_key,
            client_crt,
            client_key,
        })
    }
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn openssl(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .context("cannot run openssl")?;
    if !out.status.success() {
        bail!(
            "openssl {} failed: {}",
            args.first().copied().unwrap_or_default(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_socket_is_found_by_port_and_state() {
        let text =
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9C41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D2B4 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0 20 4 30 10 -1
";
        assert!(listening(text, 0x9C41));
        // Port 8080 appears only on an established connection.
        assert!(!listening(text, 8080));
        assert!(!listening("garbage", 80));
    }
}
