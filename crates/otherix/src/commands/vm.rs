//! `otherix vm ...`.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use otherix_core::labels::{parse_label, parse_label_change, LabelChange};
use otherix_proto::{CreateVmRequest, LabelVmRequest, Vm, VmState};

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
            runtime,
            memory,
            cpus,
            image,
            ssh_keys,
            count,
        } => {
            // Parse locally first: a typo is reported without a round trip.
            let mut map = BTreeMap::new();
            for l in &labels {
                let (k, v) = parse_label(l).with_context(|| format!("invalid --label {l:?}"))?;
                map.insert(k, v);
            }
            let mut keys = Vec::new();
            for file in &ssh_keys {
                let text = std::fs::read_to_string(file)
                    .with_context(|| format!("reading --ssh-key {}", file.display()))?;
                let found: Vec<String> = text
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(str::to_owned)
                    .collect();
                if found.is_empty() {
                    bail!("--ssh-key {}: no key in it (give the .pub file)", file.display());
                }
                if found.iter().any(|l| l.contains("PRIVATE KEY")) {
                    bail!(
                        "--ssh-key {} is a private key: give the public one ({}.pub)",
                        file.display(),
                        file.display()
                    );
                }
                keys.extend(found);
            }
            let runtime = match runtime {
                None if memory.is_some() || cpus.is_some() || image.is_some() || !keys.is_empty() => {
                    Some(otherix_proto::Runtime::Qemu)
                }
                r => r,
            };
            let client = ctx.client()?;
            let req = CreateVmRequest {
                runtime,
                ssh_keys: keys,
                cpus,
                image,
                memory_mib: memory,
                name,
                network,
                labels: map,
                node,
                exec,
            };
            let Some(count) = count else {
                let vm = client.create_vm(&req).await?;
                return output::done(
                    ctx.format,
                    &vm,
                    &format!("vm/{} created ({} on {}, {})", vm.name, vm.ip, vm.network, vm.mac),
                );
            };
            let mut vms = Vec::with_capacity(count as usize);
            for i in 1..=count {
                let name = format!("{}-{i}", req.name);
                let mut one = req.clone();
                one.name = name
                    .parse()
                    .map_err(|e| anyhow::anyhow!("--count {count}: VM name {name:?}: {e}"))?;
                vms.push(one);
            }
            let batch = client
                .create_vm_batch(&otherix_proto::CreateVmBatchRequest { vms })
                .await?;
            let (first, last) = (&batch.vms[0], &batch.vms[batch.vms.len() - 1]);
            output::done(
                ctx.format,
                &batch,
                &format!(
                    "{} VMs created, vm/{} ({}) to vm/{} ({}) on {}",
                    batch.vms.len(),
                    first.name,
                    first.ip,
                    last.name,
                    last.ip,
                    first.network
                ),
            )
        }
        VmCommand::List { selector, watch } => {
            let client = ctx.client()?;
            let show = |vms: &Vec<_>| {
                output::list_wide(
                    ctx.format,
                    vms,
                    &["NAME", "STATE", "NETWORK", "IP", "NODE", "LABELS", "AGE"],
                    &["MAC", "RUNTIME", "REASON"],
                    row,
                )
            };
            let fetch = || async { Ok(client.list_vms(selector.as_deref()).await?) };
            if watch {
                return super::watch::watch(ctx, fetch, show).await;
            }
            show(&fetch().await?)
        }
        VmCommand::Get { name } => {
            let vm = ctx.client()?.get_vm(&name).await?;
            match ctx.format {
                Format::Json | Format::Yaml => output::data(ctx.format, &vm),
                Format::Table | Format::Wide => {
                    output::fields(&[
                        ("Name", vm.name.clone()),
                        ("ID", vm.id.clone()),
                        ("State", vm.state.to_string()),
                        ("Reason", output::or_dash(vm.reason.as_deref())),
                        ("Network", vm.network.clone()),
                        ("IP", vm.ip.to_string()),
                        ("MAC", vm.mac.to_string()),
                        ("Node", output::or_dash(vm.node.as_deref())),
                        ("Runtime", runtime_text(&vm)),
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
            output::deleted(ctx.format, "vm", &name)
        }
        VmCommand::Migrate {
            name,
            to,
            no_wait,
            timeout,
        } => {
            let client = ctx.client()?;
            let started = std::time::Instant::now();
            let mut vm = client.migrate_vm(&name, &to).await?;
            if !no_wait {
                vm = wait_for_migration(&client, vm, &to, started, timeout).await?;
            }
            output::done(
                ctx.format,
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
            output::done(
                ctx.format,
                &vm,
                &format!("vm/{} labeled ({})", vm.name, labels_text(&vm.labels)),
            )
        }
    }
}

/// Polls the VM until it runs on `to`, saying each step on stderr (on a
/// terminal with a ticking clock); fails on a rollback or after `timeout`.
async fn wait_for_migration(
    client: &otherix_client::Client,
    mut vm: Vm,
    to: &str,
    started: Instant,
    timeout: Duration,
) -> anyhow::Result<Vm> {
    let name = vm.name.clone();
    let tty = std::io::stderr().is_terminal();
    let mut progress = Progress { tty, shown: None };
    loop {
        let step = migration_step(&vm, to);
        progress.show(&step, started.elapsed());
        match step {
            Step::Done => {
                progress.end();
                return Ok(vm);
            }
            Step::Failed(reason) => {
                progress.end();
                bail!("migration of {name} to {to} did not complete: {reason}");
            }
            Step::HandingOver { .. } | Step::Starting => {}
        }
        if started.elapsed() >= timeout {
            progress.end();
            bail!(
                "vm {name} is still migrating to {to} after {} ({step}); it goes on: see `otherix vm get {name}`",
                humantime::format_duration(timeout)
            );
        }
        tokio::time::sleep(Duration::from_millis(200).min(timeout.saturating_sub(started.elapsed()))).await;
        vm = client.get_vm(&name).await?;
    }
}

/// Where a migration to a node stands, as the VM shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    /// Still on the source: the target joins the network, then the source hands over.
    HandingOver {
        from: String,
    },
    /// Placed on the target, which has yet to report it running.
    Starting,
    Done,
    /// Rolled back (or otherwise not going to happen), and why.
    Failed(String),
}

fn migration_step(vm: &Vm, to: &str) -> Step {
    let on_target = vm.node.as_deref() == Some(to);
    match (vm.state, on_target) {
        (VmState::Migrating, false) => Step::HandingOver {
            from: vm.node.clone().unwrap_or_else(|| "-".into()),
        },
        (VmState::Migrating, true) => Step::Starting,
        (VmState::Running, true) => Step::Done,
        // Placed on the target but not running there yet (it reports a start).
        (_, true) if vm.reason.is_none() => Step::Starting,
        (state, _) => Step::Failed(vm.reason.clone().unwrap_or_else(|| match state {
            VmState::Running => "rolled back".into(),
            s => format!("the vm is {s}"),
        })),
    }
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Step::HandingOver { from } => write!(f, "handing over from {from}"),
            Step::Starting => f.write_str("handed over, starting on the target"),
            Step::Done => f.write_str("running on the target"),
            Step::Failed(reason) => write!(f, "failed: {reason}"),
        }
    }
}

/// A line on stderr per step; on a terminal the current line also shows
/// the time going by.
struct Progress {
    tty: bool,
    shown: Option<Step>,
}

impl Progress {
    fn show(&mut self, step: &Step, elapsed: Duration) {
        let text = format!("{:>6.1}s  {step}", elapsed.as_secs_f64());
        let changed = self.shown.as_ref() != Some(step);
        if self.tty {
            // Finish the last step's line, or write this one over it.
            eprint!(
                "{}\r\x1b[K{text}",
                if changed && self.shown.is_some() { "\n" } else { "" }
            );
        } else if changed {
            eprintln!("{text}");
        }
        self.shown = Some(step.clone());
    }

    fn end(&mut self) {
        if self.tty && self.shown.is_some() {
            eprintln!();
        }
    }
}

fn row(vm: &Vm) -> Vec<String> {
    vec![
        vm.name.clone(),
        vm.state.to_string(),
        vm.network.clone(),
        vm.ip.to_string(),
        output::or_dash(vm.node.as_deref()),
        labels_text(&vm.labels),
        output::age(vm.created_at),
        // -o wide:
        vm.mac.to_string(),
        match vm.accelerator {
            Some(a) => format!("{}/{a}", vm.runtime),
            None => vm.runtime.to_string(),
        },
        output::or_dash(vm.reason.as_deref()),
    ]
}

/// `app=web,tier=frontend`, `-` for none.
fn labels_text(labels: &BTreeMap<String, String>) -> String {
    output::comma_list(&labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>())
}

/// `netns`, or `qemu (tcg, 256 MiB, 1 CPU, image default, 1 SSH key)`.
fn runtime_text(vm: &Vm) -> String {
    let Some(m) = &vm.machine else {
        return vm.runtime.to_string();
    };
    let accel = vm
        .accelerator
        .map_or_else(|| "accelerator not known yet".to_string(), |a| a.to_string());
    let keys = match m.ssh_keys.len() {
        0 => "no SSH key".to_string(),
        1 => "1 SSH key".to_string(),
        n => format!("{n} SSH keys"),
    };
    let cpus = if m.cpus == 1 {
        "1 CPU".to_string()
    } else {
        format!("{} CPUs", m.cpus)
    };
    format!(
        "qemu ({accel}, {} MiB, {cpus}, image {}, {keys})",
        m.memory_mib, m.image
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(state: VmState, node: &str, reason: Option<&str>) -> Vm {
        Vm {
            migration_id: Default::default(),
            migration_port: Default::default(),
            accelerator: None,
            machine: None,
            runtime: Default::default(),
            name: "web01".into(),
            id: "v1".into(),
            network: "ov".into(),
            node: Some(node.into()),
            labels: BTreeMap::new(),
            mac: "02:00:00:00:00:01".parse().unwrap(),
            ip: "10.100.0.2".parse().unwrap(),
            state,
            reason: reason.map(Into::into),
            exec: None,
            migrate_to: None,
            created_at: time::OffsetDateTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn a_migration_reads_as_its_steps_then_done_or_why_not() {
        let step = |state, node, reason| migration_step(&vm(state, node, reason), "n2");
        assert_eq!(
            step(VmState::Migrating, "n1", None),
            Step::HandingOver { from: "n1".into() }
        );
        assert_eq!(step(VmState::Migrating, "n2", None), Step::Starting);
        assert_eq!(step(VmState::Running, "n2", None), Step::Done);
        assert_eq!(
            step(VmState::Running, "n1", None),
            Step::Failed("rolled back".into())
        );
        assert_eq!(
            step(VmState::Running, "n1", Some("target n2 went NotReady")),
            Step::Failed("target n2 went NotReady".into())
        );
    }
}
