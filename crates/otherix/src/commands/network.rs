//! `otherix network ...`.

use otherix_proto::{CreateNetworkRequest, Network, NetworkType};

use super::Ctx;
use crate::cli::{Format, NetworkCommand, NetworkNodeCommand, NetworkTypeArg};
use crate::output;

pub async fn run(ctx: &Ctx, cmd: NetworkCommand) -> anyhow::Result<()> {
    let client = ctx.client()?;
    match cmd {
        NetworkCommand::Create {
            name,
            kind,
            subnet,
            nodes,
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
                    node: None,
                    nodes,
                })
                .await?;
            let detail = match net.vni {
                Some(vni) => format!("VNI {vni}"),
                None => format!("on {}", nodes_phrase(&net.nodes)),
            };
            output::done(
                ctx.format,
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
                &["NAME", "TYPE", "SUBNET", "VNI", "NODES", "VMS", "AGE"],
                row,
            )
        }
        NetworkCommand::Get { name } => {
            let net = client.get_network(&name).await?;
            match ctx.format {
                Format::Json | Format::Yaml => output::data(ctx.format, &net),
                Format::Table | Format::Wide => {
                    output::fields(&[
                        ("Name", net.name.clone()),
                        ("ID", net.id.clone()),
                        ("Type", net.kind.to_string()),
                        ("Subnet", net.subnet.to_string()),
                        ("Node address", net.node_address.to_string()),
                        (
                            "VNI",
                            net.vni.map(|v| v.to_string()).unwrap_or_else(|| "-".into()),
                        ),
                        ("Nodes", output::comma_list(&net.nodes)),
                        ("VMs", net.vms.to_string()),
                        ("Created", output::rfc3339(net.created_at)),
                    ]);
                    Ok(())
                }
            }
        }
        NetworkCommand::Delete { name } => {
            client.delete_network(&name).await?;
            output::deleted(ctx.format, "network", &name)
        }
        NetworkCommand::Node(NetworkNodeCommand::Add { network, node }) => {
            let net = client.add_network_node(&network, &node).await?;
            output::done(
                ctx.format,
                &net,
                &format!("network/{} is on {}", net.name, nodes_phrase(&net.nodes)),
            )
        }
        NetworkCommand::Node(NetworkNodeCommand::Remove { network, node }) => {
            let net = client.remove_network_node(&network, &node).await?;
            output::done(
                ctx.format,
                &net,
                &format!(
                    "network/{} left node {node}; it is on {}",
                    net.name,
                    nodes_phrase(&net.nodes)
                ),
            )
        }
    }
}

/// "node n1" or "nodes n1, n2".
fn nodes_phrase(nodes: &[String]) -> String {
    match nodes {
        [one] => format!("node {one}"),
        many => format!("nodes {}", many.join(", ")),
    }
}

fn row(n: &Network) -> Vec<String> {
    vec![
        n.name.clone(),
        n.kind.to_string(),
        n.subnet.to_string(),
        n.vni.map(|v| v.to_string()).unwrap_or_else(|| "-".into()),
        output::comma_list(&n.nodes),
        n.vms.to_string(),
        output::age(n.created_at),
    ]
}
