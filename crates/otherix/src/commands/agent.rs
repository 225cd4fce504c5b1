//! `otherix agent`: runs the node agent until SIGINT or SIGTERM (see crate
//! `otherix-agent`, module `daemon`). Guests keep running when it stops.

use otherix_agent::daemon::relay::RelayListen;
use otherix_agent::daemon::{self, Agent, Config, Trust};
use otherix_proto::agent::NodeRoles;

use crate::cli::AgentArgs;
use crate::signals;

pub async fn run(args: AgentArgs) -> anyhow::Result<()> {
    daemon::check_privileges()?;
    let trust = match (args.ca_file, args.ca_fingerprint) {
        (Some(file), _) => Some(Trust::CaFile(file)),
        (None, Some(fp)) => Some(Trust::Fingerprint(fp)),
        (None, None) => None,
    };
    // Pinned only when the operator said something about roles.
    let pinned = args.hypervisor || args.gateway.is_some();
    let roles = pinned.then_some(NodeRoles {
        hypervisor: args.hypervisor,
        gateway: args.gateway,
        relay: None,
    });
    // Every gateway and relay session holds descriptors: the limit is
    // raised first, and the caps fitted to it.
    let nofile = otherix_server::raise_open_files_limit();
    let mut config = Config {
        servers: args.server,
        node: args.name,
        join_token: match args.join_token_file {
            Some(file) => read_join_token(&file, &args.data_dir)?,
            None => args.join_token,
        },
        trust,
        roles,
        data_dir: args.data_dir,
        vtep: args.vtep,
        heartbeat_interval: args.heartbeat_interval,
        max_credential_lifetime: args.max_credential_lifetime,
        max_session: args.max_session,
        gateway_max_sessions_per_principal: args.gateway_max_sessions_per_principal,
        gateway_max_connections: args.gateway_max_connections,
        gateway_max_connections_per_source: args.gateway_max_connections_per_source,
        relay_max_connections: args.relay_max_connections,
        relay_max_connections_per_source: args.relay_max_connections_per_source,
        handshake_timeout: args.handshake_timeout,
        relay_allow_from: args.relay_allow_from,
        netns_prefix: args.netns_prefix,
        workload_path: None,
        relay: args.relay_listen,
        metrics_listen: args.metrics_listen,
        qemu_accel: args.qemu_accel,
        image_cache: args.image_cache,
        qemu_binary: args.qemu_binary,
        qemu_migration_bandwidth: args.qemu_migration_bandwidth,
        qemu_migration_downtime: args.qemu_migration_downtime,
        guest_rto_min: (!args.guest_rto_min.is_zero()).then_some(args.guest_rto_min),
    };
    let fitted = config.fit_to_descriptors(nofile);
    let agent = Agent::start(config).await?;
    println!("{}", banner(&agent));
    // Said once the agent runs: a refused start stays a one-line error.
    if let Some(fitted) = fitted {
        tracing::info!("{fitted}");
    }
    agent.run(signals::shutdown()).await?;
    Ok(())
}

/// The join token in `file` (surrounding whitespace aside). Once the node
/// is enrolled the token is of no more use, so a file removed since then is
/// no error.
fn read_join_token(file: &std::path::Path, data_dir: &std::path::Path) -> anyhow::Result<Option<String>> {
    match std::fs::read_to_string(file) {
        Ok(text) if text.trim().is_empty() => {
            anyhow::bail!("--join-token-file {} is empty: write the token `otherix node join-token create` printed into it", file.display())
        }
        Ok(text) => Ok(Some(text.trim().to_string())),
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                && data_dir.join(otherix_agent::daemon::files::CERT_FILE).exists() =>
        {
            Ok(None)
        }
        Err(e) => Err(anyhow::anyhow!(
            "cannot read --join-token-file {}: {e}",
            file.display()
        )),
    }
}

/// One line: who this node is, where its control plane is, what it does.
fn banner(agent: &Agent) -> String {
    let c = agent.config();
    let mut roles = Vec::new();
    match &c.roles {
        None => roles.push("as granted by the control plane".to_string()),
        Some(pinned) => {
            roles.push("pinned to".into());
            if pinned.hypervisor {
                roles.push("hypervisor".to_string());
            }
            if let Some(gw) = &pinned.gateway {
                roles.push(format!("gateway {gw}"));
            }
        }
    }
    match c.relay {
        None => {}
        Some(RelayListen::Off) => roles.push("(relay off)".into()),
        Some(RelayListen::Vtep(port)) => roles.push(format!("(relay listens on :{port} of the VTEP)")),
        Some(RelayListen::Addr(addr)) => roles.push(format!("(relay listens on {addr})")),
    }
    format!(
        "agent for node {} ({}) with control plane {}, roles: {}",
        agent.node(),
        if agent.enrolled_now() {
            "enrolled now"
        } else {
            "identity reused"
        },
        c.servers.join(", "),
        roles.join(" ")
    )
}
