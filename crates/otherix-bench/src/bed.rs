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
//!
//! and a second guest (`bench-relay`, the same two servers) on a bridge
//! network of `node1`, which only the control plane's relay reaches, with
//! the ways in to it:
//!
//! - direct (bridge): from `node1`'s namespace to that guest on the bridge;
//! - otherix relay: the host namespace → `otherix forward` (or the client
//!   library) → WebSocket over TLS to the CP → mutual TLS to `node1`'s agent
//!   → the guest;
//! - websocat and websockify: see [`crate::tunnels`].
//!
//! For the soak ([`Purpose::Soak`]) only the cluster and the two guests are
//! built, and the control plane keeps its default limits.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, Context};
use otherix_client::Client;
use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, Ns, Proc, World};

use crate::nginx::Nginx;
use crate::progress;
use crate::tunnels::Tunnels;

/// The guest's echo port (setup-time and idle-session figures).
pub const ECHO_PORT: u16 = 7;
/// The guest's iperf3 port (throughput figures).
pub const IPERF_PORT: u16 = 5201;
/// The VM the gateway paths reach (on an overlay).
pub const VM: &str = "bench";
/// The VM the relay paths reach (on a bridge of `node1`).
pub const RELAY_VM: &str = "bench-relay";
/// [`RELAY_VM`]'s label, the selector of the soak's relay-filling principal.
pub const RELAY_VM_LABEL: &str = "bench=relay";
/// Where the control plane and the agents serve `/metrics` (in their own
/// namespaces) when the bed is built for [`Purpose::Soak`].
pub const METRICS_PORT: u16 = 9090;

/// Generous: other builds share this machine, and under their load a VM
/// has taken more than 90 s to come up.
const WAIT: Duration = Duration::from_secs(180);

#[derive(Debug)]
pub struct Bed {
    pub ca_pem: String,
    /// The admin's API client.
    pub client: Client,
    pub guest_ip: Ipv4Addr,
    /// The overlay guest's own network namespace (PostgreSQL runs there for
    /// `pgbench`).
    pub guest_netns: String,
    /// The gateway node's namespace.
    pub gw: Ns,
    /// The gateway agent's pid.
    pub agent_pid: u32,
    /// The control plane's pid.
    pub cp_pid: u32,
    /// The bridge guest's address.
    pub relay_guest_ip: Ipv4Addr,
    /// The hypervisor's namespace (owner of the bridge).
    pub node: Ns,
    /// The hypervisor agent's pid (the relay's node side).
    pub node_agent_pid: u32,
    /// The other ways in and the iperf3 servers ([`Purpose::Speed`] only).
    others: Option<Others>,
    /// Last: dropped (and its world torn down) after the processes above.
    pub cluster: Cluster,
}

/// What the speed comparison needs besides the cluster.
#[derive(Debug)]
pub struct Others {
    pub nginx: Nginx,
    /// `otherix forward bench 5201` in the host namespace, and its local address.
    pub forward: (Proc, SocketAddr),
    /// `socat` (TLS client to nginx's iperf3 port) in the host namespace, and its local address.
    pub socat: (Proc, SocketAddr),
    /// The same in front of nginx's echo port: what `otherix forward`'s
    /// round trip is compared with (one process and a loopback hop each).
    pub echo_socat: (Proc, SocketAddr),
    /// `otherix forward bench-relay 5201` in the host namespace, and its local address.
    pub relay_forward: (Proc, SocketAddr),
    /// `otherix forward bench 7` (the echo port), as it runs by default:
    /// connections kept ready.
    pub echo_forward: (Proc, SocketAddr),
    /// The same with `--ready 0`: every connection brokers and connects
    /// when it arrives.
    pub echo_forward_cold: (Proc, SocketAddr),
    /// `otherix forward bench-relay 7`: the same for the relay, as it runs
    /// by default (tickets and TLS to the control plane kept ready)...
    pub relay_echo_forward: (Proc, SocketAddr),
    /// ...and with `--ready 0`.
    pub relay_echo_forward_cold: (Proc, SocketAddr),
    /// websocat and websockify in front of the bridge guest.
    pub tunnels: Tunnels,
    _iperf_servers: Vec<Proc>,
}

/// What the testbed is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// The speed comparison (broker, setup, throughput, memory): the other
    /// ways in (nginx, websocat, websockify, `otherix forward`) and iperf3
    /// in the guests; the CP's connection caps and the broker's rate limit
    /// lifted, so that one client (the bench) can measure rates and hold
    /// many sessions.
    Speed,
    /// The soak: the cluster and its guests only, the CP's limits at their
    /// defaults, as an operator gets them; the CP and the agents also serve
    /// metrics on [`METRICS_PORT`].
    Soak,
}

impl Bed {
    /// Builds the testbed; `websocat` is needed for [`Purpose::Speed`].
    pub fn start(bin: &Path, websocat: Option<&Path>, purpose: Purpose) -> anyhow::Result<Bed> {
        progress("building the testbed (control plane, node1, gw1)");
        let world = World::new("otherix-bench").context("cannot make a testbed world (run as root)")?;
        let mut spec = ClusterSpec::new(bin);
        spec.hypervisors = 1;
        spec.gateways = 1;
        // Production cadence: fewer heartbeats in the gateway's CPU figures.
        spec.heartbeat = Duration::from_secs(2);
        spec.node_timeout = Duration::from_secs(10);
        match purpose {
            // One principal measures how many credentials the CP can mint: no
            // per-principal rate limit in the way; its 1,000 idle relay
            // sessions come from one address; and its 10,000 idle gateway
            // sessions are one principal's (no per-principal session cap).
            Purpose::Speed => {
                spec.extra_server_args = vec![
                    "--broker-rate".into(),
                    "0".into(),
                    "--max-connections-per-ip".into(),
                    "100000".into(),
                    "--max-connections".into(),
                    "100000".into(),
                    "--max-sessions-per-principal".into(),
                    "0".into(),
                ];
                // The most a gateway allows one principal: half its slots.
                spec.extra_agent_args = vec!["--gateway-max-sessions-per-principal".into(), "5000".into()];
            }
            // What an operator gets; and the metrics the soak reads.
            Purpose::Soak => {
                let metrics = vec!["--metrics-listen".into(), format!("0.0.0.0:{METRICS_PORT}")];
                spec.extra_server_args = metrics.clone();
                spec.extra_agent_args = metrics;
            }
        }
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
        let iperf = purpose == Purpose::Speed;
        let (guest_ip, guest_netns, iperf_server) = guest(&cluster, VM, "bench-net", "bench=gateway", iperf)?;
        cluster.cli_ok(&[
            "network",
            "create",
            "bench-lab",
            "--type",
            "bridge",
            "--subnet",
            "10.141.0.0/24",
            "--node",
            "node1",
        ])?;
        let (relay_guest_ip, _, relay_iperf_server) =
            guest(&cluster, RELAY_VM, "bench-lab", RELAY_VM_LABEL, iperf)?;

        let gw_node = cluster.node("gw1")?;
        let gw = gw_node.ns.clone();
        let agent = gw_node.agent.as_ref().context("gw1 has no agent")?;
        agent.wait_for_log("gateway listening", WAIT)?;
        let agent_pid = agent.pid();
        let cp_pid = cluster.cp().context("no control plane")?.pid();

        let ca_pem = std::fs::read_to_string(cluster.ca_file())?;
        let token = std::fs::read_to_string(cluster.cp_dir().join("admin.token"))?;
        let client = Client::new(&cluster.url, &ca_pem, Some(token.trim().to_string()))?;

        let node = cluster.node("node1")?;
        let node_agent_pid = node.agent.as_ref().context("node1 has no agent")?.pid();
        let node = node.ns.clone();

        progress("waiting until the guests are reachable through the gateway and the relay");
        wait_reachable(&client, &cluster.url, &ca_pem)?;

        let others = match (purpose, websocat) {
            (Purpose::Soak, _) => None,
            (Purpose::Speed, None) => anyhow::bail!("the speed comparison needs websocat"),
            (Purpose::Speed, Some(websocat)) => {
                let gw_dir = cluster.node("gw1")?.data_dir.clone();
                let nginx = Nginx::start(&cluster, &gw, &gw_dir, guest_ip)?;
                let gateway_forward = forward(&cluster, bin, VM, IPERF_PORT, &[])?;
                let relay_forward = forward(&cluster, bin, RELAY_VM, IPERF_PORT, &[])?;
                let echo_forward = forward(&cluster, bin, VM, ECHO_PORT, &[])?;
                let echo_forward_cold = forward(&cluster, bin, VM, ECHO_PORT, &["--ready", "0"])?;
                let relay_echo_forward = forward(&cluster, bin, RELAY_VM, ECHO_PORT, &[])?;
                let relay_echo_forward_cold = forward(&cluster, bin, RELAY_VM, ECHO_PORT, &["--ready", "0"])?;
                let socat = start_socat(&cluster, nginx.iperf_addr(), &cluster.ca_file())?;
                let echo_socat = start_socat(&cluster, nginx.echo_addr(), &cluster.ca_file())?;
                progress("starting websocat and websockify in front of the bridge guest");
                let tunnels = Tunnels::start(&cluster, &node, relay_guest_ip, websocat)?;
                Some(Others {
                    nginx,
                    forward: gateway_forward,
                    socat,
                    echo_socat,
                    relay_forward,
                    echo_forward,
                    echo_forward_cold,
                    relay_echo_forward,
                    relay_echo_forward_cold,
                    tunnels,
                    _iperf_servers: iperf_server.into_iter().chain(relay_iperf_server).collect(),
                })
            }
        };
        Ok(Bed {
            ca_pem,
            client,
            guest_ip,
            guest_netns,
            gw,
            agent_pid,
            cp_pid,
            relay_guest_ip,
            node,
            node_agent_pid,
            others,
            cluster,
        })
    }

    /// The other ways in, for the speed comparison.
    pub fn others(&self) -> anyhow::Result<&Others> {
        self.others
            .as_ref()
            .context("this testbed was built for the soak, without the other ways in")
    }

    /// The guest's echo server, as dialed from inside `gw1`.
    pub fn guest_echo(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.guest_ip, ECHO_PORT))
    }

    /// The bridge guest's echo server, as dialed from inside `node1`.
    pub fn relay_guest_echo(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.relay_guest_ip, ECHO_PORT))
    }

    pub fn world(&self) -> &World {
        &self.cluster.world
    }
}

/// Creates VM `name` on `network` with `label` running the echo server,
/// waits until it runs, and with `iperf`, starts `iperf3 -s` inside its namespace. Its
/// address, its namespace and iperf3.
pub(crate) fn guest(
    cluster: &Cluster,
    name: &str,
    network: &str,
    label: &str,
    iperf: bool,
) -> anyhow::Result<(Ipv4Addr, String, Option<Proc>)> {
    let echo = format!("otherix guest echo --port {ECHO_PORT}");
    cluster.cli_ok(&[
        "vm",
        "create",
        name,
        "--network",
        network,
        "--node",
        "node1",
        "--label",
        label,
        "--exec",
        &echo,
    ])?;
    let vm = cluster.wait_vm_running(name, WAIT)?;
    let field = |field: &str| {
        vm[field]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow!("vm {name} has no {field}: {vm}"))
    };
    let ip: Ipv4Addr = field("ip")?.parse()?;
    let vm_id = field("id")?;
    let guest_netns = format!(
        "{}{}",
        cluster.world.guest_netns_prefix(),
        &vm_id[..vm_id.len().min(12)]
    );
    if !iperf {
        return Ok((ip, guest_netns, None));
    }
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
    Ok((ip, guest_netns, Some(iperf_server)))
}

/// `otherix forward VM PORT OPTIONS` in the host namespace, and its local address.
pub(crate) fn forward(
    cluster: &Cluster,
    bin: &Path,
    vm: &str,
    port: u16,
    options: &[&str],
) -> anyhow::Result<(Proc, SocketAddr)> {
    let config = cluster.config.to_string_lossy().into_owned();
    let port = port.to_string();
    let mut args = vec!["forward", vm, &port];
    args.extend_from_slice(options);
    let proc = cluster.world.spawn(
        None,
        bin,
        args,
        &[("OTHERIX_CONFIG", &config), ("RUST_LOG", "warn")],
    )?;
    proc.wait_for_log("Forwarding", WAIT)?;
    let addr = proc
        .log()
        .lines()
        .find_map(|l| l.trim().parse::<SocketAddr>().ok())
        .with_context(|| format!("otherix forward {vm} printed no local address"))?;
    Ok((proc, addr))
}

/// Brokers and connects until both echo ports answer: the gateway may not
/// have programmed the guest's neighbor entry yet when the VM is running,
/// and the node reports its relay endpoint a heartbeat later.
fn wait_reachable(client: &Client, cp_url: &str, ca_pem: &str) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    for vm in [VM, RELAY_VM] {
        wait_until(&format!("{vm} to be reachable"), WAIT, || {
            rt.block_on(async {
                let grant = crate::broker::broker_for(client, vm, ECHO_PORT).await.ok()?;
                otherix_client::tunnel::open_brokered(&grant, cp_url, ca_pem)
                    .await
                    .ok()
                    .map(drop)
            })
        })?;
    }
    Ok(())
}

/// `socat` listening on loopback, each connection a TLS client to nginx
/// (verifying its certificate against the cluster CA), forked per connection.
/// `-b 65536`: the same copy buffer as the gateway's splice, so socat's
/// default 8 KiB does not hold nginx back.
pub(crate) fn start_socat(
    cluster: &Cluster,
    nginx: SocketAddr,
    ca: &Path,
) -> anyhow::Result<(Proc, SocketAddr)> {
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
pub fn free_local_port() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}
