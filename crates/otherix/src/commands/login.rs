//! `otherix login`, `otherix logout` and `otherix whoami`.

use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;

use anyhow::{bail, Context as _};
use otherix_client::Client;
use otherix_proto::Role;
use otherix_tls as tls;
use serde::Serialize;

use super::Ctx;
use crate::cli::{Format, LoginArgs};
use crate::config::{self, Context};
use crate::env;
use crate::output;

/// What `otherix login -o json` prints. The keys are in alphabetical
/// order, as they were printed before this was a type.
#[derive(Debug, Serialize)]
struct LoggedIn<'a> {
    /// `sha256:...` of the cluster CA now pinned.
    ca_fingerprint: &'a str,
    /// The client config written.
    config: &'a Path,
    /// The context the login is saved as.
    context: &'a str,
    /// Whether that context is now the current one.
    current: bool,
    /// `user:NAME` or `grant:NAME`.
    principal: &'a str,
    /// The user's role; none for a grant.
    role: Option<Role>,
    /// The control plane's URL (the one that answered).
    server: &'a str,
    /// Every control plane URL saved, when there are several.
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    servers: &'a [String],
}

pub async fn run(ctx: &Ctx, args: LoginArgs) -> anyhow::Result<()> {
    let token = match (&args.token, &args.token_file) {
        _ if ctx.grant()?.is_some() => ctx.grant()?.unwrap_or_default(),
        (Some(t), _) => t.trim().to_string(),
        (None, Some(file)) => std::fs::read_to_string(file)
            .with_context(|| format!("reading token file {}", file.display()))?
            .trim()
            .to_string(),
        (None, None) => {
            bail!(
                "no API token given\nhint: pass --token-file FILE (or set {}), or --grant-file FILE for a grant",
                env::TOKEN
            )
        }
    };
    if token.is_empty() {
        bail!("the API token is empty");
    }

    // A whole grant file names the servers and the CA: the holder's one
    // command is `otherix login --grant-file FILE`. Flags given win.
    let whole = ctx.grant_file()?.and_then(Result::ok);
    let servers = match (&args.server[..], &whole) {
        ([], Some(grant)) => grant.server.clone(),
        ([], None) => bail!(
            "--server is required\nhint: otherix login --server https://HOST:7443 --token-file FILE, or --grant-file FILE with a grant file from `otherix grant create --file`"
        ),
        (given, _) => given.to_vec(),
    };
    let ca_fingerprint = args.ca_fingerprint.clone().or_else(|| {
        whole
            .as_ref()
            .filter(|_| args.ca_file.is_none())
            .map(|g| g.ca_fingerprint.clone())
    });
    let ca_pem = match (&args.ca_file, &ca_fingerprint) {
        (Some(file), _) => {
            std::fs::read_to_string(file).with_context(|| format!("reading CA file {}", file.display()))?
        }
        (None, Some(fp)) => {
            let expected = tls::parse_fingerprint(fp).map_err(anyhow::Error::msg)?;
            let ca = Client::discover_ca(&servers, Some(expected)).await?;
            tls::cert_to_pem(ca.as_ref())
        }
        (None, None) => {
            let ca = Client::discover_ca(&servers, None).await?;
            let fp = tls::fingerprint(ca.as_ref());
            if !std::io::stdin().is_terminal() {
                bail!(
                    "the server presents cluster CA {fp}, and no fingerprint was given to check it against\nhint: pass --ca-fingerprint {fp} if that is what `otherix server` printed"
                );
            }
            eprint!("The server presents cluster CA {fp}.\nCompare it with what `otherix server` printed. Trust it? [y/N] ");
            std::io::stderr().flush().ok();
            let mut answer = String::new();
            std::io::stdin().lock().read_line(&mut answer)?;
            if !matches!(answer.trim(), "y" | "Y" | "yes") {
                bail!("not trusted; nothing saved");
            }
            tls::cert_to_pem(ca.as_ref())
        }
    };
    let ca_der = tls::cert_from_pem(&ca_pem).map_err(anyhow::Error::msg)?;
    let fingerprint = tls::fingerprint(ca_der.as_ref());

    // Prove both the pinned CA and the token work before saving anything.
    let client = Client::new(&servers, &ca_pem, Some(token.clone()))?;
    let me = client.whoami().await?;

    let path = ctx.config_path()?;
    let saved = client.servers();
    let mut file = config::load(&path)?.unwrap_or_default();
    // `--context` without `--name` updates that context for this command
    // only, as `--context` does everywhere: the current one stays current.
    let (name, keep_current) = match (&args.name, &ctx.context) {
        (Some(name), _) => (name.clone(), false),
        (None, Some(name)) => (config::parse_name(name).map_err(anyhow::Error::msg)?, true),
        (None, None) => (file.name_for(&saved), false),
    };
    file.contexts.insert(
        name.clone(),
        Context {
            server: config::Servers(saved.clone()),
            ca_fingerprint: fingerprint.clone(),
            ca_pem,
            token: Some(token),
        },
    );
    if !keep_current || file.current_context.is_none() {
        file.current_context = Some(name.clone());
    }
    let current = file.current_context.as_deref() == Some(name.as_str());
    config::save(&path, &file)?;
    match ctx.format {
        Format::Json | Format::Yaml => output::data(
            ctx.format,
            &LoggedIn {
                ca_fingerprint: &fingerprint,
                config: &path,
                context: &name,
                current,
                principal: &me.principal,
                role: me.role,
                server: client.server(),
                servers: if saved.len() > 1 { &saved } else { &[] },
            },
        ),
        Format::Table | Format::Wide => {
            match me.role {
                Some(role) => println!("Logged in to {} as {} (role {role}).", client.server(), me.name),
                None => println!(
                    "Logged in to {} with {}: it can only reach the grant's targets.",
                    client.server(),
                    me.principal
                ),
            }
            println!("Cluster CA {fingerprint} pinned in {}.", path.display());
            if current {
                println!("Context {name:?} is current.");
            } else {
                println!(
                    "Context {name:?} saved; the current context is still {:?}.",
                    file.current_context.as_deref().unwrap_or_default()
                );
            }
            Ok(())
        }
    }
}

pub async fn whoami(ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client()?;
    let me = client.whoami().await?;
    match ctx.format {
        Format::Json | Format::Yaml => output::data(ctx.format, &me),
        Format::Table | Format::Wide => {
            let mut rows = vec![
                ("Principal", me.principal),
                (
                    "Role",
                    me.role
                        .map(|r| r.to_string())
                        .unwrap_or_else(|| "- (grant)".into()),
                ),
                ("Server", client.server().to_string()),
            ];
            // What someone needs to reach this cluster too (with a token
            // of their own, or a grant file: `grant create --file`).
            if let Ok((name, context)) = ctx.context() {
                rows.push(("Context", name));
                rows.push(("Servers", context.server.urls().join(", ")));
                rows.push(("CA fingerprint", context.ca_fingerprint.clone()));
            }
            output::fields(&rows);
            Ok(())
        }
    }
}

/// Removes the token of the context (`--context`, else the current one); its
/// server and CA stay. Logging out twice is not an error.
pub fn logout(ctx: &Ctx) -> anyhow::Result<()> {
    let path = ctx.config_path()?;
    let Some(mut file) = config::load(&path)? else {
        eprintln!("not logged in: no client config at {}", path.display());
        return Ok(());
    };
    if ctx.context.is_none() && file.current_context.is_none() {
        eprintln!("not logged in: no context is current in {}", path.display());
        return Ok(());
    }
    let name = file.select(ctx.context.as_deref(), &path)?.0.to_string();
    // `select` found it: it is there.
    let context = file.contexts.get_mut(&name).expect("the selected context");
    if context.token.take().is_none() {
        eprintln!("not logged in to context {name:?}: it holds no token");
        return Ok(());
    }
    let server = context.server.clone();
    config::save(&path, &file)?;
    eprintln!(
        "logged out of {server} (context {name:?}): its token is removed from {}",
        path.display()
    );
    if std::env::var_os(env::TOKEN).is_some() {
        eprintln!("note: {} is still set in your environment", env::TOKEN);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn login_json_keeps_its_keys_and_their_order() {
        let user = LoggedIn {
            ca_fingerprint: "sha256:ab",
            config: Path::new("/home/a/.config/otherix/config.toml"),
            context: "prod",
            current: true,
            principal: "user:alice",
            role: Some(Role::User),
            server: "https://127.0.0.1:7443",
            servers: &[],
        };
        assert_eq!(
            serde_json::to_string(&user).unwrap(),
            r#"{"ca_fingerprint":"sha256:ab","config":"/home/a/.config/otherix/config.toml","context":"prod","current":true,"principal":"user:alice","role":"user","server":"https://127.0.0.1:7443"}"#
        );
        let grant = LoggedIn {
            principal: "grant:acme",
            role: None,
            ..user
        };
        assert!(serde_json::to_string(&grant).unwrap().contains(r#""role":null"#));
        let replicas = ["https://a:7443".to_string(), "https://b:7443".to_string()];
        let several = LoggedIn {
            servers: &replicas,
            ..user
        };
        assert!(serde_json::to_string(&several).unwrap().ends_with(
            r#""server":"https://127.0.0.1:7443","servers":["https://a:7443","https://b:7443"]}"#
        ));
    }
}
