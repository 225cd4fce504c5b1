//! `otherix`: one binary for every role — the control plane, the node agent,
//! the client CLI and, with the `dev` feature (on by default), a local dev
//! cluster. This file only reads the command line, sets up logging and hands
//! errors to `error.rs`.

mod cli;
mod commands;
mod config;
mod env;
mod error;
mod output;
mod service_config;
mod signals;

use std::process::ExitCode;

fn main() -> ExitCode {
    let parsed = match service_config::parse(std::env::args_os().collect()) {
        Ok(parsed) => parsed,
        Err(e) => {
            error::report(&e);
            return ExitCode::FAILURE;
        }
    };
    if let Some(effective) = parsed.print {
        // Built from strings and plain structs: serializing cannot fail.
        output::json(&effective).expect("plain JSON");
        return ExitCode::SUCCESS;
    }
    let cli = parsed.cli;
    let daemon = matches!(cli.command, cli::Command::Server(_) | cli::Command::Agent(_));
    init_logging(cli.verbose, daemon, cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(commands::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error::report(&e);
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr: warnings only for the CLI, info for the daemons,
/// more with `-v`, or what `RUST_LOG` says; text or JSON lines.
fn init_logging(verbose: u8, daemon: bool, format: cli::LogFormat) {
    use tracing_subscriber::EnvFilter;
    let default = match (verbose, daemon) {
        (0, false) => "warn",
        (0, true) | (1, _) => "info",
        (2, _) => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_env(env::RUST_LOG).unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    match format {
        cli::LogFormat::Json => builder.json().with_current_span(true).init(),
        cli::LogFormat::Text => {
            // Colour only for a person at a terminal (and never with NO_COLOR).
            let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os(env::NO_COLOR).is_none();
            builder.with_ansi(ansi).init()
        }
    }
}
