//! `otherix node ...`: nodes and join tokens.

use otherix_proto::agent::{CreateJoinTokenRequest, Node, UpdateNodeRequest};

use super::Ctx;
use crate::cli::{Format, JoinTokenCommand, NodeCommand};
use crate::output;

pub async fn run(ctx: &Ctx, cmd: NodeCommand) -> anyhow::Result<()> {
    let client = ctx.client()?;
    match cmd {
        NodeCommand::List { watch } => {
            let show = |nodes: &Vec<_>| {
                output::list_wide(
                    ctx.format,
                    nodes,
                    &["NAME", "ROLES", "STATUS", "GATEWAY", "GUESTS", "VTEP", "AGE"],
                    &["RELAY", "OVERLAYS", "AGENT", "LAST HEARTBEAT", "REASON"],
                    row,
                )
            };
            let fetch = || async { Ok(client.list_nodes().await?) };
            if watch {
                return super::watch::watch(ctx, fetch, show).await;
            }
            show(&fetch().await?)
        }
        NodeCommand::Get { name } => show(ctx, &client.get_node(&name).await?),
        NodeCommand::Update {
            name,
            hypervisor,
            no_hypervisor,
            gateway,
            no_gateway,
            relay,
            vtep,
        } => {
            let req = UpdateNodeRequest {
                hypervisor: match (hypervisor, no_hypervisor) {
                    (true, _) => Some(true),
                    (_, true) => Some(false),
                    _ => None,
                },
                gateway: if no_gateway { Some("none".into()) } else { gateway },
                relay,
                vtep,
            };
            if req.hypervisor.is_none() && req.gateway.is_none() && req.relay.is_none() && req.vtep.is_none()
            {
                anyhow::bail!(
                    "nothing to change; give --hypervisor/--no-hypervisor, --gateway/--no-gateway, --relay or --vtep"
                );
            }
            show(ctx, &client.update_node(&name, &req).await?)
        }
        NodeCommand::Delete { name, force } => {
            client.delete_node(&name, force).await?;
            output::deleted(ctx.format, "node", &name)
        }
        NodeCommand::JoinToken(JoinTokenCommand::Create {
            name,
            hypervisor,
            gateway,
            relay,
            vtep,
            replace,
            ttl,
        }) => {
            let t = client
                .create_join_token(&CreateJoinTokenRequest {
                    node: name,
                    ttl_seconds: Some(ttl.as_secs().max(1)),
                    hypervisor,
                    gateway,
                    relay,
                    vtep,
                    replace,
                })
                .await?;
            match ctx.format {
                Format::Json | Format::Yaml => output::data(ctx.format, &t),
                Format::Table | Format::Wide => {
                    println!("{}", t.token);
                    eprintln!(
                        "join token {} {} node {} ({}), valid until {}, for one enrollment; it is shown only this once.",
                        t.id,
                        if t.replace { "replaces" } else { "enrolls" },
                        t.node,
                        roles_text(&t.roles),
                        output::rfc3339(t.expires_at)
                    );
                    Ok(())
                }
            }
        }
    }
}

/// `node get` and `node update`'s answer.
fn show(ctx: &Ctx, n: &Node) -> anyhow::Result<()> {
    match ctx.format {
        Format::Json | Format::Yaml => output::data(ctx.format, n),
        Format::Table | Format::Wide => {
            output::fields(&[
                ("Name", n.name.clone()),
                ("Roles", roles(n)),
                ("Status", n.status.to_string()),
                ("Gateway", output::or_dash(n.roles.gateway.as_deref())),
                ("Relay", output::or_dash(n.roles.relay.as_deref())),
                ("VTEP", output::or_dash(n.vtep.as_deref())),
                ("Guests", n.guests.to_string()),
                ("Overlays", output::comma_list(&n.overlays)),
                ("Draining", output::comma_list(&n.draining)),
                ("Agent", output::or_dash(n.agent_version.as_deref())),
                ("Last heartbeat", output::rfc3339_or_never(n.last_heartbeat)),
                ("Status reason", output::or_dash(n.status_reason.as_deref())),
                ("Created", output::rfc3339(n.created_at)),
            ]);
            Ok(())
        }
    }
}

fn roles(n: &Node) -> String {
    roles_text(&n.roles)
}

fn roles_text(roles: &otherix_proto::agent::NodeRoles) -> String {
    let mut r = vec![];
    if roles.hypervisor {
        r.push("hypervisor");
    }
    if roles.gateway.is_some() {
        r.push("gateway");
    }
    if roles.relay.is_some() {
        r.push("relay");
    }
    output::comma_list(&r)
}

fn row(n: &Node) -> Vec<String> {
    vec![
        n.name.clone(),
        roles(n),
        n.status.to_string(),
        output::or_dash(n.roles.gateway.as_deref()),
        n.guests.to_string(),
        output::or_dash(n.vtep.as_deref()),
        output::age(n.created_at),
        // -o wide:
        output::or_dash(n.roles.relay.as_deref()),
        output::comma_list(&n.overlays),
        output::or_dash(n.agent_version.as_deref()),
        n.last_heartbeat
            .map_or_else(|| "never".into(), |t| format!("{} ago", output::age(t))),
        output::or_dash(n.status_reason.as_deref()),
    ]
}
