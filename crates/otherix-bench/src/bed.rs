//! The testbed every row is measured on, built once per run: a control plane,
//! one hypervisor (`node1`) and one gateway node (`gw1`) in network
//! namespaces; one guest on an overlay running an echo server (port 7) and,
//! started by the bench inside the guest's namespace, `iperf3 -s` (port
//! 5201); and the three ways in:
//!
//! - direct: from `gw1`'s namespace straight to the guest over the overlay;
//! - otherix: the host namespace → `otherix forward` (or the client library)
//!   → TLS to the gateway agent on `gw1` → the guest;
//! - nginx: the host namespace → `socat` (TLS client) → nginx's stream module
//!   on `gw1` terminating TLS with the gateway's own certificate → the guest.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, Context};
use otherix_api::Client;
use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, Ns, Proc, World};

use crate::nginx::Nginx;
use crate::progress;

/// The guest's echo port (setup-time and idle-session figures).
pub const ECHO_PORT: u16 = 7;
/// The guest's iperf3 port (throughput figures).
pub const IPERF_PORT: u16 = 5201;
/// The one VM every path reaches.
pub const VM: &str = "bench";
const WAIT: Duration = Duration::from_secs(90);

#[derive(Debug)]
pub struct Bed {
    pub ca_pem: String,
    /// The admin's API client.
    pub client: Client,
    pub guest_ip: Ipv4Addr,
    /// The gateway node's namespace.
    pub gw: Ns,
    /// The gateway agent's pid.
    pub agent_pid: u32,
    /// The control plane's pid.
    pub cp_pid: u32,
    pub nginx: Nginx,
    /// `otherix forward bench 5201` in the host namespace, and its local address.
    pub forward: (Proc, SocketAddr),
    /// `socat` (TLS client to nginx's iperf3 port) in the host namespace, and its local address.
    pub socat: (Proc, SocketAddr),
    _iperf_server: Proc,
    /// Last: dropped (and its world torn down) after the processes above.
    pub cluster: Cluster,
}

impl Bed {
    pub fn start(bin: &Path) -> anyhow::Result<Bed> {
        progress("building the testbed (control plane, node1, gw1)");
        let world = World::new("otherix-bench").context("cannot make a testbed world (run as root)")?;
        let mut spec = ClusterSpec::new(bin);
        spec.hypervisors = 1;
        spec.gateways = 1;
        // Production cadence: fewer heartbeats in the gateway's CPU figures.
        spec.heartbeat = Duration::from_secs(2);
        spec.node_timeout = Duration::from_secs(10);
        let cluster = Cluster::start(world, spec).context("cannot start the cluster")?;

        cluster.cli_ok(&[
            "network",
            "create",
            "bench-net",
            "--type",
            "overlay",
            "--subnet",
            "10.140.0.0/24",
        ])?;
        let echo = format!("otherix guest echo --port {ECHO_PORT}");
        cluster.cli_ok(&[
            "vm",
            "create",
            VM,
            "--network",
            "bench-net",
            "--node",
            "node1",
            "--exec",
            &echo,
        ])?;
        let vm = cluster.wait_vm_running(VM, WAIT)?;
        let field = |name: &str| {
            vm[name]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| anyhow!("vm {VM} has no {name}: {vm}"))
        };
        let guest_ip: Ipv4Addr = field("ip")?.parse()?;
        let vm_id = field("id")?;
        let guest_netns = format!(
            "{}{}",
            cluster.world.guest_netns_prefix(),
            &vm_id[..vm_id.len().min(12)]
        );

        let gw_node = cluster.node("gw1")?;
        let gw = gw_node.ns.clone();
        let agent = gw_node.agent.as_ref().context("gw1 has no agent")?;
        agent.wait_for_log("gateway listening", WAIT)?;
        let agent_pid = agent.pid();
        let cp_pid = cluster.cp.as_ref().context("no control plane")?.pid();

        let ca_pem = std::fs::read_to_string(cluster.ca_file())?;
        let token = std::fs::read_to_string(cluster.cp_dir().join("admin.token"))?;
        let client = Client::new(&cluster.url, &ca_pem, Some(token.trim().to_string()))?;

        // iperf3's server inside the guest's namespace.
        let iperf_server = cluster.world.spawn(
            None,
            "ip",
            [
                "netns",
                "exec",
                &guest_netns,
                "iperf3",
                "--forceflush",
                "-s",
                "-p",
                &IPERF_PORT.to_string(),
            ],
            &[],
        )?;
        iperf_server.wait_for_log("Server listening", WAIT)?;

        progress("waiting until the guest is reachable through the gateway");
        wait_reachable(&client, &ca_pem)?;

        let gw_dir = cluster.node("gw1")?.data_dir.clone();
        let nginx = Nginx::start(&cluster, &gw, &gw_dir, guest_ip)?;

        let config = cluster.config.to_string_lossy().into_owned();
        let forward_proc = cluster.world.spawn(
            None,
            bin,
            ["forward", VM, &IPERF_PORT.to_string()],
            &[("OTHERIX_CONFIG", &config), ("RUST_LOG", "warn")],
        )?;
        forward_proc.wait_for_log("Forwarding", WAIT)?;
        let forward_addr = forward_proc
            .log()
            .lines()
            .find_map(|l| l.trim().parse::<SocketAddr>().ok())
            .context("otherix forward printed no local address")?;

        let socat = start_socat(&cluster, nginx.iperf_addr(), &cluster.ca_file())?;
        Ok(Bed {
            ca_pem,
            client,
            guest_ip,
            gw,
            agent_pid,
            cp_pid,
            nginx,
            forward: (forward_proc, forward_addr),
            socat,
            _iperf_server: iperf_server,
            cluster,
        })
    }

    /// The guest's echo server, as dialed from inside `gw1`.
    pub fn guest_echo(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.guest_ip, ECHO_PORT))
    }

    pub fn world(&self) -> &World {
        &self.cluster.world
    }
}

/// Brokers and connects until the echo port answers: the gateway may not
/// have programmed the guest's neighbor entry yet when the VM is running.
fn wait_reachable(client: &Client, ca_pem: &str) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    wait_until("the guest to be reachable through the gateway", WAIT, || {
        rt.block_on(async {
            let grant = crate::broker::broker_once(client, ECHO_PORT).await.ok()?;
            otherix_api::connect::open(&grant.endpoint, ca_pem, &grant.credential)
                .await
                .ok()
                .map(drop)
        })
    })?;
    Ok(())
}

/// `socat` listening on loopback, each connection a TLS client to nginx
/// (verifying its certificate against the cluster CA), forked per connection.
/// `-b 65536`: the same copy buffer as the gateway's splice, so socat's
/// default 8 KiB does not hold nginx back.
fn start_socat(cluster: &Cluster, nginx: SocketAddr, ca: &Path) -> anyhow::Result<(Proc, SocketAddr)> {
    let local = free_local_port()?;
    let listen = format!(
        "TCP-LISTEN:{},bind=127.0.0.1,reuseaddr,fork,nodelay",
        local.port()
    );
    let connect = format!(
        "OPENSSL:{}:{},cafile={},nodelay",
        nginx.ip(),
        nginx.port(),
        ca.display()
    );
    // `-d -d` only to learn when it listens (a probe connection would reach
    // iperf3's server, which takes any connection for a test).
    let proc = cluster
        .world
        .spawn(None, "socat", ["-d", "-d", "-b", "65536", &listen, &connect], &[])?;
    proc.wait_for_log("listening on", WAIT)?;
    Ok((proc, local))
}

/// A loopback port that was free a moment ago.
fn free_local_port() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}
