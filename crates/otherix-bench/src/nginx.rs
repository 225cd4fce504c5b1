//! The comparison a user would build by hand: nginx's stream module on the
//! gateway node, terminating TLS with the very certificate and key the
//! gateway serves (same key type, same chain, same trust on the client), and
//! proxying to the guest. Stock settings otherwise (`worker_processes auto`,
//! default buffers); the only tuning is enough connections and files.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use otherix_testbed::cluster::Cluster;
use otherix_testbed::{wait_until, Ns, Proc};

use crate::bed::{ECHO_PORT, IPERF_PORT};
use crate::pgbench::PG_PORT;
use crate::procfs;
use crate::tools::STREAM_MODULE;

/// nginx's TLS port in front of the guest's echo server.
const ECHO_TLS_PORT: u16 = 9443;
/// nginx's TLS port in front of the guest's iperf3 server.
const IPERF_TLS_PORT: u16 = 9444;
/// nginx's TLS port in front of the guest's PostgreSQL (`pgbench`).
const PG_TLS_PORT: u16 = 9445;

#[derive(Debug)]
pub struct Nginx {
    proc: Proc,
    ip: Ipv4Addr,
}

impl Nginx {
    /// Writes the configuration into the world's directory and starts nginx
    /// (in the foreground) in the gateway node's namespace.
    pub fn start(cluster: &Cluster, gw: &Ns, gw_dir: &Path, guest: Ipv4Addr) -> anyhow::Result<Nginx> {
        let dir = cluster.world_dir().join("nginx");
        std::fs::create_dir_all(&dir)?;
        // Leaf + cluster CA, as the gateway serves it.
        let chain = format!(
            "{}{}",
            std::fs::read_to_string(gw_dir.join("gateway.crt")).context("gw1 has no gateway.crt")?,
            std::fs::read_to_string(cluster.ca_file())?
        );
        let chain_path = dir.join("chain.pem");
        std::fs::write(&chain_path, chain)?;
        let conf = config(&dir, &chain_path, &gw_dir.join("gateway.key"), gw.ip(), guest);
        let conf_path = dir.join("nginx.conf");
        std::fs::write(&conf_path, conf)?;
        let proc = cluster.world.spawn(
            Some(gw),
            "nginx",
            [
                "-p",
                &dir.to_string_lossy(),
                "-c",
                &conf_path.to_string_lossy(),
                "-g",
                "daemon off;",
            ],
            &[],
        )?;
        let addr = SocketAddr::V4(SocketAddrV4::new(gw.ip(), ECHO_TLS_PORT));
        wait_until("nginx to listen", Duration::from_secs(30), || {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200))
                .ok()
                .map(drop)
        })
        .with_context(|| format!("nginx did not start; its log:\n{}", proc.log()))?;
        Ok(Nginx { proc, ip: gw.ip() })
    }

    /// TLS in front of the guest's echo port.
    pub fn echo_addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.ip, ECHO_TLS_PORT))
    }

    /// TLS in front of the guest's iperf3 port.
    pub fn iperf_addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.ip, IPERF_TLS_PORT))
    }

    /// TLS in front of the guest's PostgreSQL port.
    pub fn pg_addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.ip, PG_TLS_PORT))
    }

    /// CPU seconds of the master and its workers.
    pub fn cpu_seconds(&self) -> f64 {
        let master = self.proc.pid();
        std::iter::once(master)
            .chain(procfs::children(master))
            .filter_map(|pid| procfs::cpu_seconds(pid, false).ok())
            .sum()
    }
}

fn config(dir: &Path, chain: &Path, key: &Path, listen: Ipv4Addr, guest: Ipv4Addr) -> String {
    format!(
        "load_module {STREAM_MODULE};
worker_processes auto;
worker_rlimit_nofile 65536;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 16384; }}
stream {{
    ssl_certificate {chain};
    ssl_certificate_key {key};
    server {{ listen {listen}:{ECHO_TLS_PORT} ssl; proxy_pass {guest}:{ECHO_PORT}; }}
    server {{ listen {listen}:{IPERF_TLS_PORT} ssl; proxy_pass {guest}:{IPERF_PORT}; }}
    server {{ listen {listen}:{PG_TLS_PORT} ssl; proxy_pass {guest}:{PG_PORT}; }}
}}
",
        dir = dir.display(),
        chain = chain.display(),
        key = key.display(),
    )
}
