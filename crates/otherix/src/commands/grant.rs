//! `otherix grant ...`.

use anyhow::{anyhow, Context};
use otherix_proto::{CreateGrantRequest, Grant, GrantTarget};

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
            file,
        } => {
            let targets = targets
                .iter()
                .map(|t| parse_target(t))
                .collect::<anyhow::Result<Vec<_>>>()?;
            // Said before the grant is made: after, its token would be lost.
            if let Some(path) = file.as_ref().filter(|p| p.exists()) {
                anyhow::bail!("{} exists already; no grant made", path.display());
            }
            let created = client
                .create_grant(&CreateGrantRequest {
                    name,
                    targets,
                    ttl_seconds: ttl.as_secs().max(1),
                    max_connections,
                })
                .await?;
            if let Some(path) = &file {
                let (_, context) = ctx.context()?;
                let grant = crate::config::GrantFile {
                    server: context.server.urls().clone(),
                    ca_fingerprint: context.ca_fingerprint.clone(),
                    token: created.token.clone(),
                };
                write_new_secret(path, &grant.to_text()?)?;
                eprintln!(
                    "grant {} created for {} until {}, written to {}; its holder runs: otherix login --grant-file {}",
                    created.grant.name,
                    targets_text(&created.grant, usize::MAX),
                    output::rfc3339(created.grant.expires_at),
                    path.display(),
                    output::shell_word(&path.display().to_string())
                );
                // The token is in the file: -o json says what was made, not the secret.
                return match ctx.format {
                    Format::Table | Format::Wide => Ok(()),
                    _ => output::data(ctx.format, &created.grant),
                };
            }
            match ctx.format {
                Format::Json | Format::Yaml => output::data(ctx.format, &created),
                Format::Table | Format::Wide => {
                    println!("{}", created.token);
                    eprintln!(
                        "grant {} created for {} until {}; the token is shown only this once.",
                        created.grant.name,
                        targets_text(&created.grant, usize::MAX),
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
                        targets_text(g, 12),
                        g.state.to_string(),
                        connections_text(g),
                        output::age(g.created_at),
                        output::rfc3339(g.expires_at),
                        output::rfc3339_or_never(g.last_used_at),
                    ]
                },
            )
        }
        GrantCommand::Get { name } => {
            let g = client.get_grant(&name).await?;
            match ctx.format {
                Format::Json | Format::Yaml => output::data(ctx.format, &g),
                Format::Table | Format::Wide => {
                    output::fields(&[
                        ("Name", g.name.clone()),
                        ("ID", g.id.clone()),
                        ("State", g.state.to_string()),
                        ("Targets", targets_text(&g, usize::MAX)),
                        ("Connections", connections_text(&g)),
                        (
                            "Created",
                            format!("{} by {}", output::rfc3339(g.created_at), g.created_by),
                        ),
                        ("Expires", output::rfc3339(g.expires_at)),
                        ("Last used", output::rfc3339_or_never(g.last_used_at)),
                    ]);
                    Ok(())
                }
            }
        }
        GrantCommand::Revoke { name } => {
            let g = client.revoke_grant(&name).await?;
            output::done(ctx.format, &g, &format!("grant/{} revoked", g.name))
        }
    }
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
        vm_id: None,
    })
}

/// `web01:443 (vm 1f2e3d4c5b6a)`, `lb/web:80`: each VM target with the id
/// of the VM it is bound to, cut to `id_chars` (`vm get` shows the whole).
fn targets_text(g: &Grant, id_chars: usize) -> String {
    g.targets
        .iter()
        .map(|t| match &t.vm_id {
            Some(id) => format!("{t} (vm {})", id.get(..id_chars).unwrap_or(id)),
            // A VM target made before grants were bound, whose VM was gone
            // then: it reaches nothing.
            None if !t.target.starts_with("lb/") => format!("{t} (vm unknown)"),
            None => t.to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn connections_text(g: &Grant) -> String {
    match g.max_connections {
        Some(m) => format!("{}/{m}", g.connections),
        None => g.connections.to_string(),
    }
}

/// Writes `text` to a new file `path`, readable by its owner only; an
/// existing file is left alone (and said so).
fn write_new_secret(path: &std::path::Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => {
                anyhow::anyhow!(
                    "{} exists already; the grant was made, its token is not written",
                    path.display()
                )
            }
            _ => anyhow::anyhow!("cannot write {}: {e}", path.display()),
        })?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
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
    fn targets_show_the_vm_they_are_bound_to() {
        let target = |t: &str, vm_id: Option<&str>| GrantTarget {
            vm_id: vm_id.map(str::to_string),
            ..parse_target(t).unwrap()
        };
        let g: Grant = serde_json::from_value(serde_json::json!({
            "name": "acme", "id": "g1", "targets": [], "created_by": "user:admin",
            "created_at": "2026-01-01T00:00:00Z", "expires_at": "2026-01-02T00:00:00Z",
            "last_used_at": null, "max_connections": null, "connections": 0, "state": "active"
        }))
        .unwrap();
        let g = Grant {
            targets: vec![
                target("web01:443", Some("0123456789abcdef0123456789abcdef")),
                target("old01:22", None),
                target("lb/web:80", None),
            ],
            ..g
        };
        assert_eq!(
            targets_text(&g, 12),
            "web01:443 (vm 0123456789ab), old01:22 (vm unknown), lb/web:80"
        );
        assert!(targets_text(&g, usize::MAX).contains("(vm 0123456789abcdef0123456789abcdef)"));
    }
}
