//! A node speaking the agent protocol directly (enroll, heartbeat), for
//! control-plane tests that need nodes but not their kernel state.

use otherix_client::{Client, ClientError};
use otherix_proto::agent::{DesiredState, Heartbeat, NodeRoles};
use otherix_testbed::fake_node;

use super::Cp;

/// A heartbeat with nothing to report; a test fills in what it needs:
/// `Heartbeat { node, roles, vtep, ..empty_heartbeat() }`.
pub fn empty_heartbeat() -> Heartbeat {
    fake_node::empty_heartbeat("", "")
}

/// A node identity made the way an agent makes one.
pub use otherix_testbed::fake_node::NodeKey as FakeNodeKey;

pub fn node_key(name: &str) -> FakeNodeKey {
    fake_node::node_key(name).unwrap()
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A join token that enrolls `name` as a hypervisor.
pub fn join_token(cp: &Cp, name: &str, ttl: &str) -> String {
    join_token_for(cp, name, ttl, &["--hypervisor"])
}

/// A join token that enrolls `name` with `grant` (`--hypervisor`,
/// `--gateway IP:PORT`, `--vtep IP`, `--replace`, ...).
pub fn join_token_for(cp: &Cp, name: &str, ttl: &str, grant: &[&str]) -> String {
    let mut args = vec!["node", "join-token", "create", "--name", name, "--ttl", ttl];
    args.extend_from_slice(grant);
    cp.admin().ok(&args).trim().to_string()
}

/// Enrolls `name` as a fake node at `vtep`: a gateway at `VTEP:8443` when
/// `gateway`, else a hypervisor. Its connections come from loopback, so the
/// token grants the VTEP (as an admin does for a node behind NAT).
pub fn enroll_as(cp: &Cp, name: &str, vtep: &str, gateway: bool) -> Client {
    let gw = format!("{vtep}:8443");
    let mut grant = vec!["--vtep", vtep];
    if gateway {
        grant.extend(["--gateway", gw.as_str()]);
    } else {
        grant.push("--hypervisor");
    }
    enroll(cp, &join_token_for(cp, name, "1h", &grant), name).unwrap()
}

pub fn enroll(cp: &Cp, token: &str, name: &str) -> Result<Client, ClientError> {
    enroll_raw(cp, token, name).map(|n| n.client(cp))
}

/// An enrolled fake node's identity: its certificate and key.
pub struct Enrolled {
    pub cert_pem: String,
    pub key_pem: String,
}

impl Enrolled {
    /// A client of `cp` presenting this identity (mutual TLS).
    pub fn client(&self, cp: &Cp) -> Client {
        Client::with_identity(&cp.url, &cp.ca_pem(), &self.cert_pem, &self.key_pem).unwrap()
    }
}

/// Enrolls `name` with `token`, keeping the certificate and key.
pub fn enroll_raw(cp: &Cp, token: &str, name: &str) -> Result<Enrolled, ClientError> {
    let anon = Client::new(&cp.url, &cp.ca_pem(), None).unwrap();
    let id = rt().block_on(fake_node::enroll(&anon, token, name, node_key(name)))?;
    assert_eq!(id.ca_pem.trim(), cp.ca_pem().trim());
    Ok(Enrolled {
        cert_pem: id.cert_pem,
        key_pem: id.key_pem,
    })
}

pub fn beat(
    client: &Client,
    name: &str,
    vtep: &str,
    hypervisor: bool,
    gateway: Option<&str>,
) -> Result<DesiredState, ClientError> {
    rt().block_on(client.heartbeat(&Heartbeat {
        node: name.to_string(),
        roles: Some(NodeRoles {
            hypervisor,
            gateway: gateway.map(Into::into),
            relay: None,
        }),
        vtep: vtep.to_string(),
        ..empty_heartbeat()
    }))
}

/// Heartbeats reporting every given VM id as running.
pub fn beat_running(client: &Client, name: &str, vtep: &str, vm_ids: &[String]) -> DesiredState {
    rt().block_on(client.heartbeat(&Heartbeat {
        node: name.to_string(),
        roles: Some(NodeRoles {
            hypervisor: true,
            gateway: None,
            relay: None,
        }),
        vtep: vtep.to_string(),
        guests: otherix_testbed::fake_node::running(vm_ids),
        ..empty_heartbeat()
    }))
    .unwrap()
}

/// Overlay `ov` (10.100.0.0/24) and hypervisor `hv` (VTEP 10.213.1.11)
/// running the VMs `vms` (name, `-l` label or "" for none), each reported
/// running: what a broker test needs behind a gateway. Returns `hv`.
#[allow(dead_code)]
pub fn running_on_overlay(cp: &Cp, admin: &super::Cli, vms: &[(&str, &str)]) -> Client {
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ]);
    let hv = enroll_as(cp, "hv", "10.213.1.11", false);
    beat_running(&hv, "hv", "10.213.1.11", &[]);
    let mut ids = Vec::new();
    for (vm, label) in vms {
        let mut args = vec!["vm", "create", vm, "--network", "ov", "--node", "hv"];
        if !label.is_empty() {
            args.extend(["--label", label]);
        }
        admin.ok(&args);
        ids.push(admin.json(&["vm", "get", vm])["id"].as_str().unwrap().to_string());
    }
    beat_running(&hv, "hv", "10.213.1.11", &ids);
    hv
}
