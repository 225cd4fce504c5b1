//! `otherix completion SHELL`: prints a completion script to stdout.

pub fn run(shell: clap_complete::Shell) -> anyhow::Result<()> {
    let mut cmd = crate::cli::command();
    clap_complete::generate(shell, &mut cmd, "otherix", &mut std::io::stdout());
    Ok(())
}
