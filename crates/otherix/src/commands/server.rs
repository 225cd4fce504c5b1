//! `otherix server`: runs the control plane until SIGINT or SIGTERM.

use otherix_server::ServerConfig;

use crate::cli::ServerArgs;
use crate::signals;

pub async fn run(args: ServerArgs) -> anyhow::Result<()> {
    if args.relay_ready_keep > otherix_server::relay_ready::MAX_KEEP {
        anyhow::bail!(
            "--relay-ready-keep is at most 9s: an agent closes a relay connection that sends no request for 10s"
        );
    }
    if args.relay_resume_grace > otherix_proto::resume::MAX_GRACE {
        anyhow::bail!("--relay-resume-grace is at most 10m");
    }
    if !(otherix_proto::resume::MAX_DATA..=256 * 1024 * 1024).contains(&args.relay_resume_buffer) {
        anyhow::bail!("--relay-resume-buffer must be between 64KiB and 256MiB");
    }
    let config = ServerConfig {
        data_dir: args.data_dir,
        database: args.database,
        secret_key_file: args.secret_key_file,
        listen: args.listen,
        sans: args.sans,
        metrics_listen: args.metrics_listen,
        limits: otherix_server::serve::ConnLimits {
            max: args.max_connections,
            per_ip: args.max_connections_per_ip,
            node_reserve: args.reserved_node_connections,
        },
        settings: otherix_server::state::Settings {
            node_timeout: time::Duration::try_from(args.node_timeout)?,
            mtu: args.overlay_mtu,
            key_rotation: time::Duration::try_from(args.key_rotation)?,
            credential_ttl: time::Duration::try_from(args.credential_ttl)?,
            token_ttl: time::Duration::try_from(args.token_ttl)?
                .clamp(time::Duration::SECOND, otherix_server::state::MAX_TOKEN_TTL),
            audit_retention: time::Duration::try_from(args.audit_retention)?,
            node_cert_validity: time::Duration::try_from(args.node_cert_validity)?,
            max_drain: time::Duration::try_from(args.max_drain)?,
            broker_rate: args.broker_rate.max(0.0),
            broker_burst: args.broker_burst.max(1.0),
            max_session: args.max_session,
            max_sessions_per_principal: args.max_sessions_per_principal,
            relay_ready_keep: args.relay_ready_keep,
            relay_resume_grace: args.relay_resume_grace,
            relay_resume_buffer: args.relay_resume_buffer,
        },
    };
    otherix_server::run(config, signals::shutdown()).await
}
