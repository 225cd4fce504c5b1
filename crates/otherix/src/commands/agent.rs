//! `otherix agent`: the node agent daemon (see crate `otherix-agent`).

use crate::cli::AgentArgs;

pub async fn run(args: AgentArgs) -> anyhow::Result<()> {
    let _ = args;
    anyhow::bail!("the node agent is being wired up")
}
