//! `otherix session list`: what is open now.

use super::Ctx;
use crate::cli::SessionCommand;
use crate::output;

pub async fn run(ctx: &Ctx, cmd: SessionCommand) -> anyhow::Result<()> {
    match cmd {
        SessionCommand::List {
            principal,
            target,
            node,
        } => {
            let sessions = ctx
                .client()?
                .sessions(principal.as_deref(), target.as_deref(), node.as_deref())
                .await?;
            output::list(
                ctx.format,
                &sessions,
                &["ID", "PRINCIPAL", "TARGET", "TRANSPORT", "NODE", "AGE"],
                |s| {
                    vec![
                        // The credential's jti: its first 8 characters tell sessions apart in logs too.
                        s.id.chars().take(8).collect(),
                        s.principal.clone(),
                        format!("{}:{}", s.target, s.port),
                        s.transport.clone(),
                        s.node.clone(),
                        output::age(s.started_at),
                    ]
                },
            )
        }
    }
}
