//! `otherix grant ...` and `otherix audit`.

use anyhow::{anyhow, Context};
use otherix_api::{AuditRecord, CreateGrantRequest, Grant, GrantTarget};

use super::user::done;
use super::Ctx;
use crate::cli::{Format, GrantCommand};
use crate::output;

pub async fn run(ctx: &Ctx, cmd: GrantCommand) -> anyhow::Result<()> {
    let client = ctx.client()?;
    match cmd {
        GrantCommand::Create {
            name,
            targets,
            ttl,
            max_connections,
        } => {
            let targets = targets
                .iter()
                .map(|t| parse_target(t))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let created = client
                .create_grant(&CreateGrantRequest {
                    name,
                    targets,
                    ttl_seconds: ttl.as_secs().max(1),
                    max_connections,
                })
                .await?;
            match ctx.format {
                Format::Json => output::json(&created),
                Format::Table => {
                    println!("{}", created.token);
                    eprintln!(
                        "grant {} created for {} until {}; the token is shown only this once.",
                        created.grant.name,
                        targets_text(&created.grant),
                        output::rfc3339(created.grant.expires_at)
                    );
                    Ok(())
                }
            }
        }
        GrantCommand::List => {
            let grants = client.list_grants().await?;
            output::list(
                ctx.format,
                &grants,
                &[
                    "NAME",
                    "TARGETS",
                    "STATE",
                    "CONNECTIONS",
                    "CREATED",
                    "EXPIRES",
                    "LAST USED",
                ],
                |g| {
                    vec![
                        g.name.clone(),
                        targets_text(g),
                        g.state.clone(),
                        connections_text(g),
                        output::age(g.created_at),
                        output::rfc3339(g.expires_at),
                        g.last_used_at
                            .map(output::rfc3339)
                            .unwrap_or_else(|| "never".into()),
                    ]
                },
            )
        }
        GrantCommand::Get { name } => {
            let g = client.get_grant(&name).await?;
            match ctx.format {
                Format::Json => output::json(&g),
                Format::Table => {
                    output::fields(&[
                        ("Name", g.name.clone()),
                        ("ID", g.id.clone()),
                        ("State", g.state.clone()),
                        ("Targets", targets_text(&g)),
                        ("Connections", connections_text(&g)),
                        (
                            "Created",
                            format!("{} by {}", output::rfc3339(g.created_at), g.created_by),
                        ),
                        ("Expires", output::rfc3339(g.expires_at)),
                        (
                            "Last used",
                            g.last_used_at
                                .map(output::rfc3339)
                                .unwrap_or_else(|| "never".into()),
                        ),
                    ]);
                    Ok(())
                }
            }
        }
        GrantCommand::Revoke { name } => {
            let g = client.revoke_grant(&name).await?;
            done(ctx, &g, &format!("grant/{} revoked", g.name))
        }
    }
}

pub async fn audit(
    ctx: &Ctx,
    since: std::time::Duration,
    principal: Option<String>,
    target: Option<String>,
) -> anyhow::Result<()> {
    let events = ctx
        .client()?
        .audit(since.as_secs(), principal.as_deref(), target.as_deref())
        .await?;
    output::list(
        ctx.format,
        &events,
        &["TIME", "PRINCIPAL", "ACTION", "TARGET", "RESULT", "DETAIL"],
        |e| {
            let target = match (&e.target, e.port) {
                (Some(t), Some(p)) => format!("{t}:{p}"),
                (Some(t), None) => t.clone(),
                _ => "-".into(),
            };
            let detail = match (e.allowed, e.action.as_str()) {
                (false, _) => e.reason.clone().unwrap_or_default(),
                (true, "session_end") => session_end_detail(e),
                // Enrollments, replacements, grant changes: what happened.
                (true, a) if a.starts_with("node_") => e.reason.clone().unwrap_or_default(),
                (true, _) => [e.transport.as_deref(), e.node.as_deref()]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join(" via "),
            };
            vec![
                output::rfc3339(e.at),
                e.principal.clone(),
                e.action.clone(),
                target,
                if e.allowed { "allowed" } else { "refused" }.into(),
                detail,
            ]
        },
    )
}

/// `closed after 12.3s, 1.2 KiB up, 5.0 MiB down via gw1`.
fn session_end_detail(e: &AuditRecord) -> String {
    let mut out = e.reason.clone().unwrap_or_else(|| "ended".into());
    if let Some(ms) = e.duration_ms {
        out.push_str(&format!(" after {:.1}s", ms as f64 / 1000.0));
    }
    match (e.bytes_up, e.bytes_down) {
        (Some(up), Some(down)) => out.push_str(&format!(", {} up, {} down", bytes(up), bytes(down))),
        _ => out.push_str(", bytes unknown"),
    }
    if let Some(node) = &e.node {
        out.push_str(&format!(" via {node}"));
    }
    out
}

/// `512 B`, `1.2 KiB`, `5.0 MiB`, `1.1 GiB`.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// `web01:443`, `lb/web:80`.
fn parse_target(s: &str) -> anyhow::Result<GrantTarget> {
    let (target, port) = s
        .rsplit_once(':')
        .ok_or_else(|| anyhow!("invalid --target {s:?}: expected VM:PORT or lb/NAME:PORT"))?;
    let port: u16 = port
        .parse()
        .with_context(|| format!("invalid --target {s:?}: {port:?} is not a port"))?;
    Ok(GrantTarget {
        target: target.to_string(),
        port,
    })
}

fn targets_text(g: &Grant) -> String {
    g.targets
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn connections_text(g: &Grant) -> String {
    match g.max_connections {
        Some(m) => format!("{}/{m}", g.connections),
        None => g.connections.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_vm_and_lb_forms() {
        assert_eq!(parse_target("web01:443").unwrap().to_string(), "web01:443");
        assert_eq!(parse_target("lb/web:80").unwrap().target, "lb/web");
        assert!(parse_target("web01").is_err());
        assert!(parse_target("web01:http").is_err());
    }

    #[test]
    fn byte_counts_read_like_people_write_them() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(5 << 20), "5.0 MiB");
        assert_eq!(bytes(3 << 40), "3.0 TiB");
    }
}
