//! `otherix completion SHELL`: prints a completion script to stdout.

use clap::CommandFactory;

use crate::cli::Cli;

pub fn run(shell: clap_complete::Shell) -> anyhow::Result<()> {
    let mut cmd = Cli::command();
    clap_complete::generate(shell, &mut cmd, "otherix", &mut std::io::stdout());
    Ok(())
}
