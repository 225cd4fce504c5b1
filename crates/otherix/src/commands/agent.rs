//! `otherix agent`: runs the node agent until SIGINT or SIGTERM (see crate
//! `otherix-agent`, module `daemon`). Guests keep running when it stops.

use otherix_agent::daemon::relay::{self, RelayListen};
use otherix_agent::daemon::{self, Agent, Config, Trust};
use otherix_api::agent::NodeRoles;

use super::server::shutdown_signal;
use crate::cli::AgentArgs;

pub async fn run(args: AgentArgs) -> anyhow::Result<()> {
    daemon::check_privileges()?;
    let trust = match (args.ca_file, args.ca_fingerprint) {
        (Some(file), _) => Some(Trust::CaFile(file)),
        (None, Some(fp)) => Some(Trust::Fingerprint(fp)),
        (None, None) => None,
    };
    // Every node that can host bridge guests relays to them unless told otherwise.
    let relay = args.relay_listen.unwrap_or(if args.hypervisor {
        RelayListen::Vtep(relay::DEFAULT_PORT)
    } else {
        RelayListen::Off
    });
    let roles = NodeRoles {
        hypervisor: args.hypervisor,
        gateway: args.gateway,
        // Filled in per heartbeat: the address depends on the VTEP.
        relay: None,
    };
    let config = Config {
        server: args.server,
        node: args.name,
        join_token: args.join_token,
        trust,
        roles,
        data_dir: args.data_dir,
        vtep: args.vtep,
        heartbeat_interval: args.heartbeat_interval,
        max_credential_lifetime: args.max_credential_lifetime,
        netns_prefix: args.netns_prefix,
        workload_path: None,
        relay,
    };
    let agent = Agent::start(config).await?;
    println!("{}", banner(&agent));
    agent.run(shutdown_signal()).await?;
    Ok(())
}

/// One line: who this node is, where its control plane is, what it does.
fn banner(agent: &Agent) -> String {
    let c = agent.config();
    let mut roles = Vec::new();
    if c.roles.hypervisor {
        roles.push("hypervisor".to_string());
    }
    if let Some(gw) = &c.roles.gateway {
        roles.push(format!("gateway {gw}"));
    }
    match c.relay {
        RelayListen::Off => {}
        RelayListen::Vtep(port) => roles.push(format!("relay :{port} (VTEP address)")),
        RelayListen::Addr(addr) => roles.push(format!("relay {addr}")),
    }
    if roles.is_empty() {
        roles.push("none".into());
    }
    format!(
        "agent for node {} ({}) with control plane {}, roles: {}",
        agent.node(),
        if agent.enrolled_now() {
            "enrolled now"
        } else {
            "identity reused"
        },
        c.server,
        roles.join(", ")
    )
}
