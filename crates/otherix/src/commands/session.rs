//! `otherix session list`: what is open now, once or as it changes, with
//! the bytes each way so far; `otherix session end`: one of them ends.

use otherix_proto::OpenSession;

use super::Ctx;
use crate::cli::SessionCommand;
use crate::output;

pub async fn run(ctx: &Ctx, cmd: SessionCommand) -> anyhow::Result<()> {
    match cmd {
        SessionCommand::List {
            principal,
            target,
            node,
            watch,
        } => {
            let client = ctx.client()?;
            let fetch = || async {
                Ok(client
                    .sessions(principal.as_deref(), target.as_deref(), node.as_deref())
                    .await?)
            };
            if watch {
                super::watch::watch(ctx, fetch, |sessions: &Vec<OpenSession>| {
                    // Said on stdout, so a redrawn screen never keeps an old table.
                    if sessions.is_empty() && !ctx.format.is_data() {
                        println!("No open sessions.");
                        return Ok(());
                    }
                    list(ctx, sessions)
                })
                .await
            } else {
                list(ctx, &fetch().await?)
            }
        }
        SessionCommand::End { id } => {
            let ended = ctx.client()?.end_session(&id).await?;
            output::done(
                ctx.format,
                &ended,
                &format!(
                    "Session {} ({} → {}:{}) ends: only that one.",
                    ended.id, ended.principal, ended.target, ended.port
                ),
            )
        }
    }
}

fn list(ctx: &Ctx, sessions: &[OpenSession]) -> anyhow::Result<()> {
    output::list_wide(
        ctx.format,
        sessions,
        &[
            "ID",
            "PRINCIPAL",
            "TARGET",
            "TRANSPORT",
            "NODE",
            "AGE",
            "UP",
            "DOWN",
        ],
        &["SESSION", "STARTED", "REPLICA"],
        |s| {
            vec![
                // The credential's jti: its first 8 characters tell sessions apart in logs too.
                s.id.chars().take(8).collect(),
                s.principal.clone(),
                format!("{}:{}", s.target, s.port),
                // A relay session lives in the replica that carries it.
                match &s.replica {
                    Some(replica) => format!(
                        "{} via {}",
                        s.transport,
                        replica.chars().take(8).collect::<String>()
                    ),
                    None => s.transport.to_string(),
                },
                s.node.clone(),
                output::age(s.started_at),
                super::audit::bytes(s.bytes_up),
                super::audit::bytes(s.bytes_down),
                // -o wide: the whole id (what `session end` and the audit log take).
                s.id.clone(),
                output::rfc3339(s.started_at),
                output::or_dash(s.replica.as_deref()),
            ]
        },
    )
}
