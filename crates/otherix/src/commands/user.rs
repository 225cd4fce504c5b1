//! `otherix user ...`: users, API tokens, access rules.

use otherix_proto::{AllowRequest, CreateUserRequest, Role, User};

use super::Ctx;
use crate::cli::{Format, RoleArg, TokenCommand, UserCommand};
use crate::output;

pub async fn run(ctx: &Ctx, cmd: UserCommand) -> anyhow::Result<()> {
    let client = ctx.client()?;
    match cmd {
        UserCommand::Create { name, role } => {
            let role = match role {
                RoleArg::Admin => Role::Admin,
                RoleArg::User => Role::User,
                RoleArg::Viewer => Role::Viewer,
            };
            let user = client.create_user(&CreateUserRequest { name, role }).await?;
            output::done(
                ctx.format,
                &user,
                &format!("user/{} created (role {})", user.name, user.role),
            )
        }
        UserCommand::List => {
            let users = client.list_users().await?;
            output::list(
                ctx.format,
                &users,
                &["NAME", "ROLE", "RULES", "TOKENS", "AGE"],
                |u| {
                    vec![
                        u.name.clone(),
                        u.role.to_string(),
                        u.rules.len().to_string(),
                        u.tokens.len().to_string(),
                        output::age(u.created_at),
                    ]
                },
            )
        }
        UserCommand::Get { name } => {
            let user = client.get_user(&name).await?;
            show(ctx, &user)
        }
        UserCommand::Delete { name } => {
            client.delete_user(&name).await?;
            output::deleted(ctx.format, "user", &name)
        }
        UserCommand::Token(TokenCommand::Create { user, ttl }) => {
            let created = client.create_token(&user, ttl.map(|t| t.as_secs())).await?;
            match ctx.format {
                Format::Json | Format::Yaml => output::data(ctx.format, &created),
                Format::Table | Format::Wide => {
                    // The secret alone on stdout so `> file` captures just it.
                    println!("{}", created.token);
                    let until = created
                        .expires_at
                        .map(|t| format!(", works until {}", output::rfc3339(t)))
                        .unwrap_or_default();
                    eprintln!(
                        "token {} created for user {}{until}; it is shown only this once.",
                        created.id, created.user
                    );
                    Ok(())
                }
            }
        }
        UserCommand::Token(TokenCommand::List { user }) => {
            let user = client.get_user(&user).await?;
            output::list(ctx.format, &user.tokens, &TOKEN_HEADERS, token_row)
        }
        UserCommand::Token(TokenCommand::Revoke { user, id }) => {
            client.revoke_token(&user, &id).await?;
            output::deleted(ctx.format, "token", &id)
        }
        UserCommand::Allow {
            name,
            selector,
            ports,
        } => {
            let user = client.allow(&name, &AllowRequest { selector, ports }).await?;
            let rule = user
                .rules
                .last()
                .map(|r| format!("rule {}: {} on ports {}", r.id, r.selector, ports_text(&r.ports)));
            output::done(
                ctx.format,
                &user,
                &format!(
                    "user/{} may now broker to {}",
                    user.name,
                    rule.unwrap_or_default()
                ),
            )
        }
        UserCommand::Disallow { name, rule } => {
            client.disallow(&name, rule).await?;
            output::deleted(ctx.format, "rule", &rule.to_string())
        }
    }
}

const TOKEN_HEADERS: [&str; 4] = ["ID", "CREATED", "EXPIRES", "LAST USED"];

/// A token as a row: when it expires says `expired` once past.
fn token_row(t: &otherix_proto::TokenInfo) -> Vec<String> {
    let expires = match t.expires_at {
        None => "never".to_string(),
        Some(at) if at <= time::OffsetDateTime::now_utc() => format!("{} (expired)", output::rfc3339(at)),
        Some(at) => output::rfc3339(at),
    };
    vec![
        t.id.clone(),
        output::rfc3339(t.created_at),
        expires,
        output::rfc3339_or_never(t.last_used_at),
    ]
}

fn show(ctx: &Ctx, user: &User) -> anyhow::Result<()> {
    if ctx.format.is_data() {
        return output::data(ctx.format, user);
    }
    output::fields(&[
        ("Name", user.name.clone()),
        ("Role", user.role.to_string()),
        ("Created", output::rfc3339(user.created_at)),
    ]);
    println!();
    if user.rules.is_empty() {
        println!("Access rules: none");
    } else {
        println!("Access rules:");
        output::table(
            &["ID", "SELECTOR", "PORTS", "STATUS"],
            user.rules
                .iter()
                .map(|r| {
                    vec![
                        r.id.to_string(),
                        r.selector.clone(),
                        ports_text(&r.ports),
                        // A stored rule that requires no label fails closed.
                        r.inert.clone().unwrap_or_else(|| "in force".into()),
                    ]
                })
                .collect(),
        );
    }
    println!();
    if user.tokens.is_empty() {
        println!("Tokens: none");
    } else {
        println!("Tokens:");
        output::table(&TOKEN_HEADERS, user.tokens.iter().map(token_row).collect());
    }
    Ok(())
}

fn ports_text(ports: &[u16]) -> String {
    ports
        .iter()
        .map(|p| match *p {
            otherix_proto::relay::CONSOLE_PORT => "console".to_string(),
            p => p.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}
