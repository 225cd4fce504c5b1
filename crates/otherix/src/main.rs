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

/// mimalloc, not glibc's malloc: the control plane's requests allocate and
/// free many small blocks on whichever tokio worker runs them, and glibc's
/// allocator spent 12 % of the broker's samples in its arenas (`_int_malloc`,
/// `malloc_consolidate`, `unlink_chunk`); mimalloc's thread-local free lists
/// do not consolidate on that path (docs/benchmarks.md, issue #30).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let parsed = match service_config::parse(std::env::args_os().collect()) {
        Ok(parsed) => parsed,
        Err(e) => {
            error::report(&e);
            return ExitCode::FAILURE;
        }
    };
    if let Some(effective) = parsed.print {
        quiet_when_the_reader_left();
        // Built from strings and plain structs: serializing cannot fail.
        output::json(&effective).expect("plain JSON");
        return ExitCode::SUCCESS;
    }
    let cli = parsed.cli;
    if prints_only(&cli.command) {
        quiet_when_the_reader_left();
    }
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

/// Does `command` only print (lists, gets, scripts)? Then a reader that
/// goes away (`| head`) ends it quietly. The others carry bytes or run
/// daemons: a closed pipe or socket is an error of their own there.
fn prints_only(command: &cli::Command) -> bool {
    use cli::Command as C;
    !matches!(
        command,
        C::Server(_)
            | C::Agent(_)
            | C::Connect { .. }
            | C::Console { .. }
            | C::Forward { .. }
            | C::Ssh { .. }
            | C::Guest(_)
    ) && !is_dev(command)
}

#[cfg(feature = "dev")]
fn is_dev(command: &cli::Command) -> bool {
    matches!(command, cli::Command::Dev(_))
}

#[cfg(not(feature = "dev"))]
fn is_dev(_: &cli::Command) -> bool {
    false
}

/// Writing to a stdout whose reader has gone (`otherix completion bash |
/// head`) panics in `println!` (the Rust runtime ignores SIGPIPE, and
/// resetting it takes unsafe code): such a panic ends the command quietly
/// with success, as `| head` expects; any other panic is reported as before.
fn quiet_when_the_reader_left() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if payload.contains("Broken pipe") || payload.contains("BrokenPipe") {
            std::process::exit(0);
        }
        report(info);
    }));
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
