//! `otherix guest http|echo`: built-in guest workloads.

use crate::cli::GuestCommand;

pub async fn run(cmd: GuestCommand) -> anyhow::Result<()> {
    let _ = cmd;
    anyhow::bail!("guest workloads are being wired up")
}
