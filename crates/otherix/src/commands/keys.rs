//! `otherix keys list|rotate`: the session signing keys credentials are
//! signed with, and rotating them now.

use otherix_proto::SessionKeyInfo;

use super::Ctx;
use crate::cli::{Format, KeysCommand};
use crate::output;

pub async fn run(ctx: &Ctx, cmd: KeysCommand) -> anyhow::Result<()> {
    let client = ctx.client()?;
    match cmd {
        KeysCommand::List => {
            let keys = client.keys().await?;
            output::list(
                ctx.format,
                &keys,
                &["KID", "STATE", "CREATED", "SIGNS FROM", "EXPIRES"],
                row,
            )
        }
        KeysCommand::Rotate => {
            let rotation = client.rotate_keys().await?;
            match ctx.format {
                Format::Json | Format::Yaml => output::data(ctx.format, &rotation),
                Format::Table | Format::Wide => {
                    println!("{}", rotation.key.kid);
                    eprintln!(
                        "session key {} signs credentials from {}.",
                        rotation.key.kid,
                        output::rfc3339(rotation.key.signs_from)
                    );
                    for k in &rotation.retiring {
                        eprintln!(
                            "key {} signs no more; gateways trust what it signed until {}.",
                            k.kid,
                            expires(k)
                        );
                    }
                    Ok(())
                }
            }
        }
    }
}

fn row(k: &SessionKeyInfo) -> Vec<String> {
    vec![
        k.kid.clone(),
        k.state.to_string(),
        output::rfc3339(k.created_at),
        output::rfc3339(k.signs_from),
        expires(k),
    ]
}

/// A key with no expiry yet is the newest: it expires a credential life
/// after the next one takes over.
fn expires(k: &SessionKeyInfo) -> String {
    k.expires_at.map(output::rfc3339).unwrap_or_else(|| "-".into())
}
