//! `otherix vm ...`.

use std::collections::BTreeMap;

use anyhow::Context;
use otherix_api::{CreateVmRequest, LabelVmRequest, Vm};
use otherix_core::labels::{parse_label, parse_label_change, LabelChange};

use super::user::{deleted, done};
use super::Ctx;
use crate::cli::{Format, VmCommand};
use crate::output;

pub async fn run(ctx: &Ctx, cmd: VmCommand) -> anyhow::Result<()> {
    match cmd {
        VmCommand::Create {
            name,
            network,
            labels,
            node,
            exec,
        } => {
            // Parse locally first: a typo is reported without a round trip.
            let mut map = BTreeMap::new();
            for l in &labels {
                let (k, v) = parse_label(l).with_context(|| format!("invalid --label {l:?}"))?;
                map.insert(k, v);
            }
            let client = ctx.client()?;
            let vm = client
                .create_vm(&CreateVmRequest {
                    name,
                    network,
                    labels: map,
                    node,
                    exec,
                })
                .await?;
            done(
                ctx,
                &vm,
                &format!("vm/{} created ({} on {}, {})", vm.name, vm.ip, vm.network, vm.mac),
            )
        }
        VmCommand::List { selector } => {
            let client = ctx.client()?;
            let vms = client.list_vms(selector.as_deref()).await?;
            output::list(
                ctx.format,
                &vms,
                &["NAME", "STATE", "NETWORK", "IP", "NODE", "LABELS", "AGE"],
                row,
            )
        }
        VmCommand::Get { name } => {
            let vm = ctx.client()?.get_vm(&name).await?;
            match ctx.format {
                Format::Json => output::json(&vm),
                Format::Table => {
                    output::fields(&[
                        ("Name", vm.name.clone()),
                        ("ID", vm.id.clone()),
                        ("State", vm.state.to_string()),
                        ("Reason", output::or_dash(vm.reason.as_deref())),
                        ("Network", vm.network.clone()),
                        ("IP", vm.ip.clone()),
                        ("MAC", vm.mac.clone()),
                        ("Node", output::or_dash(vm.node.as_deref())),
                        ("Labels", labels_text(&vm.labels)),
                        ("Exec", output::or_dash(vm.exec.as_deref())),
                        ("Created", output::rfc3339(vm.created_at)),
                    ]);
                    Ok(())
                }
            }
        }
        VmCommand::Delete { name } => {
            ctx.client()?.delete_vm(&name).await?;
            deleted(ctx, "vm", &name)
        }
        VmCommand::Migrate { name, to, no_wait } => {
            let client = ctx.client()?;
            let started = std::time::Instant::now();
            let mut vm = client.migrate_vm(&name, &to).await?;
            if !no_wait {
                eprintln!("migrating {name} to {to}...");
                let deadline = started + std::time::Duration::from_secs(120);
                while vm.state == otherix_api::VmState::Migrating {
                    if std::time::Instant::now() > deadline {
                        anyhow::bail!(
                            "vm {name} is still migrating after 120 s; see `otherix vm get {name}`"
                        );
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    vm = client.get_vm(&name).await?;
                }
                if vm.node.as_deref() != Some(to.as_str()) {
                    anyhow::bail!(
                        "migration of {name} to {to} did not complete: {}",
                        vm.reason.as_deref().unwrap_or("rolled back")
                    );
                }
            }
            done(
                ctx,
                &vm,
                &format!(
                    "vm/{} {} {to} ({} ms)",
                    vm.name,
                    if no_wait { "migrating to" } else { "migrated to" },
                    started.elapsed().as_millis()
                ),
            )
        }
        VmCommand::Label { name, changes } => {
            let mut req = LabelVmRequest::default();
            for c in &changes {
                match parse_label_change(c).with_context(|| format!("invalid label change {c:?}"))? {
                    LabelChange::Set(k, v) => {
                        req.set.insert(k, v);
                    }
                    LabelChange::Remove(k) => req.remove.push(k),
                }
            }
            let vm = ctx.client()?.label_vm(&name, &req).await?;
            done(
                ctx,
                &vm,
                &format!("vm/{} labeled ({})", vm.name, labels_text(&vm.labels)),
            )
        }
    }
}

fn row(vm: &Vm) -> Vec<String> {
    vec![
        vm.name.clone(),
        vm.state.to_string(),
        vm.network.clone(),
        vm.ip.clone(),
        output::or_dash(vm.node.as_deref()),
        labels_text(&vm.labels),
        output::age(vm.created_at),
    ]
}

fn labels_text(labels: &BTreeMap<String, String>) -> String {
    if labels.is_empty() {
        return "-".into();
    }
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}
