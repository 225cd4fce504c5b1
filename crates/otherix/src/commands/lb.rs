//! `otherix lb ...`.

use otherix_proto::{CreateLbRequest, LoadBalancer, ProbeKind, UpdateLbRequest};

use super::Ctx;
use crate::cli::{LbCommand, LbHealthArgs};
use crate::output;

fn millis(d: Option<std::time::Duration>) -> Option<u64> {
    d.map(|d| d.as_millis() as u64)
}

pub async fn run(ctx: &Ctx, cmd: LbCommand) -> anyhow::Result<()> {
    let client = ctx.client()?;
    match cmd {
        LbCommand::Create {
            name,
            port,
            selector,
            health,
        } => {
            let LbHealthArgs {
                health_port,
                health,
                interval,
                timeout,
                rise,
                fall,
            } = health;
            let lb = client
                .create_lb(&CreateLbRequest {
                    name,
                    port,
                    selector,
                    health,
                    health_port,
                    interval_ms: millis(interval),
                    timeout_ms: millis(timeout),
                    rise,
                    fall,
                })
                .await?;
            output::done(
                ctx.format,
                &lb,
                &format!(
                    "lb/{} created (port {}, selector {}, {} backend(s))",
                    lb.name, lb.port, lb.selector, lb.total
                ),
            )
        }
        LbCommand::List => {
            let lbs = client.list_lbs().await?;
            output::list_wide(
                ctx.format,
                &lbs,
                &["NAME", "PORT", "SELECTOR", "STATUS", "TARGETS", "AGE"],
                &["HEALTH CHECK", "INTERVAL", "RISE/FALL"],
                |lb| {
                    vec![
                        lb.name.clone(),
                        lb.port.to_string(),
                        lb.selector.clone(),
                        lb.status.as_str().to_string(),
                        format!("{}/{}", lb.healthy, lb.total),
                        output::age(lb.created_at),
                        // -o wide:
                        check_text(lb),
                        format!("{}ms", lb.health_check.interval_ms),
                        format!("{}/{}", lb.health_check.rise, lb.health_check.fall),
                    ]
                },
            )
        }
        LbCommand::Get { name, watch: false } => {
            let lb = client.get_lb(&name).await?;
            show(ctx, &lb)
        }
        LbCommand::Get { name, watch: true } => {
            super::watch::watch(
                ctx,
                || async { Ok(client.get_lb(&name).await?) },
                |lb| show(ctx, lb),
            )
            .await
        }
        LbCommand::Update {
            name,
            port,
            selector,
            health,
        } => {
            let lb = client
                .update_lb(
                    &name,
                    &UpdateLbRequest {
                        port,
                        selector,
                        health: health.health,
                        health_port: health.health_port,
                        interval_ms: millis(health.interval),
                        timeout_ms: millis(health.timeout),
                        rise: health.rise,
                        fall: health.fall,
                    },
                )
                .await?;
            output::done(ctx.format, &lb, &format!("lb/{} updated", lb.name))
        }
        LbCommand::Delete { name } => {
            client.delete_lb(&name).await?;
            output::deleted(ctx.format, "lb", &name)
        }
    }
}

fn show(ctx: &Ctx, lb: &LoadBalancer) -> anyhow::Result<()> {
    if ctx.format.is_data() {
        return output::data(ctx.format, lb);
    }
    let h = &lb.health_check;
    output::fields(&[
        ("Name", lb.name.clone()),
        ("Port", lb.port.to_string()),
        ("Selector", lb.selector.clone()),
        ("Status", lb.status.as_str().to_string()),
        ("Targets", format!("{}/{} healthy", lb.healthy, lb.total)),
        (
            "Health check",
            format!(
                "{} every {}ms, timeout {}ms, rise {}, fall {}",
                check_text(lb),
                h.interval_ms,
                h.timeout_ms,
                h.rise,
                h.fall
            ),
        ),
    ]);
    println!();
    if lb.backends.is_empty() {
        println!("Backends: none (the selector matches no VM)");
        return Ok(());
    }
    output::table(
        &[
            "VM",
            "NODE",
            "IP",
            "HEALTH",
            "LAST PROBE",
            "LAST CHANGE",
            "OK/FAIL",
            "REASON",
        ],
        lb.backends
            .iter()
            .map(|b| {
                vec![
                    b.vm.clone(),
                    output::or_dash(b.node.as_deref()),
                    b.ip.to_string(),
                    // Served only when no backend on a Ready node is eligible.
                    if b.node_ready {
                        b.health.to_string()
                    } else {
                        format!("{} (node NotReady)", b.health)
                    },
                    output::rfc3339_or_never(b.last_probe),
                    b.last_change.map(output::rfc3339).unwrap_or_else(|| "-".into()),
                    format!("{}/{}", b.successes, b.failures),
                    output::or_dash(b.reason.as_deref()),
                ]
            })
            .collect(),
    );
    Ok(())
}

/// `http GET /healthz on port 8080`, `tcp on port 80`.
fn check_text(lb: &LoadBalancer) -> String {
    let h = &lb.health_check;
    let check = match (h.kind, &h.path) {
        (ProbeKind::Http, Some(p)) => format!("http GET {p}"),
        (k, _) => k.to_string(),
    };
    format!("{check} on port {}", h.port.unwrap_or(lb.port))
}
