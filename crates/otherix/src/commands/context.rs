//! `otherix context list | use | current | rename | delete`: the clusters
//! logged in to, kept in the client config as named contexts.

use serde::Serialize;

use super::Ctx;
use crate::cli::ContextCommand;
use crate::config;
use crate::output;

/// One context as `otherix context list -o json` prints it (never its token).
#[derive(Debug, Serialize)]
struct Listed<'a> {
    name: &'a str,
    /// Whether commands use it without `--context`.
    current: bool,
    /// Its control plane's URLs (replicas).
    servers: &'a [String],
    /// `sha256:...` of the cluster CA it pins.
    ca_fingerprint: &'a str,
    /// Whether it holds a token (none after `otherix logout`).
    token: bool,
}

/// What `-o json` prints for `use` and `rename`: the context now current or
/// renamed.
#[derive(Debug, Serialize)]
struct Changed<'a> {
    context: &'a str,
    current: bool,
}

pub fn run(ctx: &Ctx, cmd: ContextCommand) -> anyhow::Result<()> {
    let path = ctx.config_path()?;
    match cmd {
        // No config yet is no context yet, as kubectl lists none without a kubeconfig.
        ContextCommand::List => list(ctx, &config::load(&path)?.unwrap_or_default(), &path),
        cmd => change(ctx, cmd, config::load_existing(&path)?, &path),
    }
}

/// `context list`: a table with the current context marked, or JSON.
fn list(ctx: &Ctx, file: &config::Config, path: &std::path::Path) -> anyhow::Result<()> {
    let listed: Vec<Listed> = file
        .contexts
        .iter()
        .map(|(name, c)| Listed {
            name,
            current: file.current_context.as_ref() == Some(name),
            servers: c.server.urls(),
            ca_fingerprint: &c.ca_fingerprint,
            token: c.token.is_some(),
        })
        .collect();
    if listed.is_empty() && !ctx.format.is_data() {
        eprintln!("No contexts in {}: log in with `otherix login`.", path.display());
        return Ok(());
    }
    output::list(
        ctx.format,
        &listed,
        &["CURRENT", "NAME", "SERVER", "TOKEN"],
        |c| {
            vec![
                if c.current { "*" } else { "" }.to_string(),
                c.name.to_string(),
                c.servers.join(","),
                if c.token { "saved" } else { "-" }.to_string(),
            ]
        },
    )?;
    if !ctx.format.is_data() && file.current_context.is_none() {
        eprintln!("note: no context is current; choose one with `otherix context use NAME`");
    }
    Ok(())
}

/// The verbs that read or change one context.
fn change(
    ctx: &Ctx,
    cmd: ContextCommand,
    mut file: config::Config,
    path: &std::path::Path,
) -> anyhow::Result<()> {
    match cmd {
        ContextCommand::List => list(ctx, &file, path),
        ContextCommand::Use { name } => {
            let name = file.get(&name, path)?.0.to_string();
            file.current_context = Some(name.clone());
            config::save(path, &file)?;
            let value = Changed {
                context: &name,
                current: true,
            };
            output::done(ctx.format, &value, &format!("Switched to context {name:?}."))
        }
        ContextCommand::Current => {
            let (name, _) = file.select(None, path)?;
            output::done(
                ctx.format,
                &Changed {
                    context: name,
                    current: true,
                },
                name,
            )
        }
        ContextCommand::Rename { old, new } => {
            file.get(&old, path)?;
            if old == new {
                return output::done(
                    ctx.format,
                    &Changed {
                        context: &new,
                        current: file.current_context.as_ref() == Some(&new),
                    },
                    &format!("Context {new:?} already has that name."),
                );
            }
            if file.contexts.contains_key(&new) {
                anyhow::bail!(
                    "there is a context {new:?} already in {}\nhint: delete it first with `otherix context delete {new}`, or choose another name",
                    path.display()
                );
            }
            // `get` found it: it is there.
            let context = file.contexts.remove(&old).expect("the context to rename");
            file.contexts.insert(new.clone(), context);
            let current = file.current_context.as_ref() == Some(&old);
            if current {
                file.current_context = Some(new.clone());
            }
            config::save(path, &file)?;
            output::done(
                ctx.format,
                &Changed {
                    context: &new,
                    current,
                },
                &format!("Context {old:?} renamed to {new:?}."),
            )
        }
        ContextCommand::Delete { name } => {
            let name = file.get(&name, path)?.0.to_string();
            file.contexts.remove(&name);
            let was_current = file.current_context.as_ref() == Some(&name);
            if was_current {
                file.current_context = None;
            }
            config::save(path, &file)?;
            output::deleted(ctx.format, "context", &name)?;
            if was_current {
                eprintln!(
                    "note: {name:?} was the current context; no context is current now: choose one with `otherix context use NAME`"
                );
            }
            Ok(())
        }
    }
}
