//! `otherix login`, `otherix logout` and `otherix whoami`.

use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;

use anyhow::{bail, Context};
use otherix_client::Client;
use otherix_proto::Role;
use otherix_tls as tls;
use serde::Serialize;

use super::Ctx;
use crate::cli::{Format, LoginArgs};
use crate::config::{self, ClientConfig};
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

    let ca_pem = match (&args.ca_file, &args.ca_fingerprint) {
        (Some(file), _) => {
            std::fs::read_to_string(file).with_context(|| format!("reading CA file {}", file.display()))?
        }
        (None, Some(fp)) => {
            let expected = tls::parse_fingerprint(fp).map_err(anyhow::Error::msg)?;
            let ca = Client::discover_ca(&args.server, Some(expected)).await?;
            tls::cert_to_pem(ca.as_ref())
        }
        (None, None) => {
            let ca = Client::discover_ca(&args.server, None).await?;
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
    let client = Client::new(&args.server, &ca_pem, Some(token.clone()))?;
    let me = client.whoami().await?;

    let path = ctx.config_path()?;
    let saved = client.servers();
    config::save(
        &path,
        &ClientConfig {
            server: config::Servers(saved.clone()),
            ca_fingerprint: fingerprint.clone(),
            ca_pem,
            token: Some(token),
        },
    )?;
    match ctx.format {
        Format::Json => output::json(&LoggedIn {
            ca_fingerprint: &fingerprint,
            config: &path,
            principal: &me.principal,
            role: me.role,
            server: client.server(),
            servers: if saved.len() > 1 { &saved } else { &[] },
        }),
        Format::Table => {
            match me.role {
                Some(role) => println!("Logged in to {} as {} (role {role}).", client.server(), me.name),
                None => println!(
                    "Logged in to {} with {}: it can only reach the grant's targets.",
                    client.server(),
                    me.principal
                ),
            }
            println!("Cluster CA {fingerprint} pinned in {}.", path.display());
            Ok(())
        }
    }
}

pub async fn whoami(ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client()?;
    let me = client.whoami().await?;
    match ctx.format {
        Format::Json => output::json(&me),
        Format::Table => {
            output::fields(&[
                ("Principal", me.principal),
                (
                    "Role",
                    me.role
                        .map(|r| r.to_string())
                        .unwrap_or_else(|| "- (grant)".into()),
                ),
                ("Server", client.server().to_string()),
            ]);
            Ok(())
        }
    }
}

/// Removes the client config: the server, the pinned CA and the token.
/// Logging out twice is not an error.
pub fn logout(ctx: &Ctx) -> anyhow::Result<()> {
    let path = ctx.config_path()?;
    // Which server, for the message; a config that does not parse is removed all the same.
    let server = config::load(&path).ok().map(|c| c.server);
    match std::fs::remove_file(&path) {
        Ok(()) => {
            match server {
                Some(s) => eprintln!("logged out of {s}: removed {}", path.display()),
                None => eprintln!("logged out: removed {}", path.display()),
            }
            if std::env::var_os(env::TOKEN).is_some() {
                eprintln!("note: {} is still set in your environment", env::TOKEN);
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("not logged in: no client config at {}", path.display());
            Ok(())
        }
        Err(e) => Err(e).with_context(|| format!("removing {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn login_json_keeps_its_keys_and_their_order() {
        let user = LoggedIn {
            ca_fingerprint: "sha256:ab",
            config: Path::new("/home/a/.config/otherix/config.toml"),
            principal: "user:alice",
            role: Some(Role::User),
            server: "https://127.0.0.1:7443",
            servers: &[],
        };
        assert_eq!(
            serde_json::to_string(&user).unwrap(),
            r#"{"ca_fingerprint":"sha256:ab","config":"/home/a/.config/otherix/config.toml","principal":"user:alice","role":"user","server":"https://127.0.0.1:7443"}"#
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
