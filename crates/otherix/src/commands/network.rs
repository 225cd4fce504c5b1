//! `otherix network ...`.

use otherix_api::{CreateNetworkRequest, Network, NetworkType};

use super::user::{deleted, done};
use super::Ctx;
use crate::cli::{Format, NetworkCommand, NetworkTypeArg};
use crate::output;

pub async fn run(ctx: &Ctx, cmd: NetworkCommand) -> anyhow::Result<()> {
    let client = ctx.client()?;
    match cmd {
        NetworkCommand::Create {
            name,
            kind,
            subnet,
            node,
        } => {
            let kind = match kind {
                NetworkTypeArg::Overlay => NetworkType::Overlay,
                NetworkTypeArg::Bridge => NetworkType::Bridge,
            };
            let net = client
                .create_network(&CreateNetworkRequest {
                    name,
                    kind,
                    subnet,
                    node,
                })
                .await?;
            let detail = match (net.vni, &net.node) {
                (Some(vni), _) => format!("VNI {vni}"),
                (_, Some(node)) => format!("on node {node}"),
                _ => String::new(),
            };
            done(
                ctx,
                &net,
                &format!(
                    "network/{} created ({} {}, {detail})",
                    net.name, net.kind, net.subnet
                ),
            )
        }
        NetworkCommand::List => {
            let nets = client.list_networks().await?;
            output::list(
                ctx.format,
                &nets,
                &["NAME", "TYPE", "SUBNET", "VNI", "NODE", "VMS", "AGE"],
                row,
            )
        }
        NetworkCommand::Get { name } => {
            let net = client.get_network(&name).await?;
            match ctx.format {
                Format::Json => output::json(&net),
                Format::Table => {
                    output::fields(&[
                        ("Name", net.name.clone()),
                        ("ID", net.id.clone()),
                        ("Type", net.kind.to_string()),
                        ("Subnet", net.subnet.clone()),
                        ("Node address", net.node_address.clone()),
                        (
                            "VNI",
                            net.vni.map(|v| v.to_string()).unwrap_or_else(|| "-".into()),
                        ),
                        ("Node", output::or_dash(net.node.as_deref())),
                        ("VMs", net.vms.to_string()),
                        ("Created", output::rfc3339(net.created_at)),
                    ]);
                    Ok(())
                }
            }
        }
        NetworkCommand::Delete { name } => {
            client.delete_network(&name).await?;
            deleted(ctx, "network", &name)
        }
    }
}

fn row(n: &Network) -> Vec<String> {
    vec![
        n.name.clone(),
        n.kind.to_string(),
        n.subnet.clone(),
        n.vni.map(|v| v.to_string()).unwrap_or_else(|| "-".into()),
        output::or_dash(n.node.as_deref()),
        n.vms.to_string(),
        output::age(n.created_at),
    ]
}
