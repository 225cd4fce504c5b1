//! The testbed's errors, grouped by who is at fault: the host, the caller, a command.

use std::process::ExitStatus;
use std::time::Duration;

/// `Result` with the testbed's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why the testbed could not do something.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The host: worlds need root to create namespaces.
    #[error(
        "otherix-testbed needs root to create network namespaces (effective uid is {euid})\n\
         hint: run the tests as root, e.g. `sudo -E cargo test`"
    )]
    NotRoot { euid: String },

    /// The host: a tool the testbed runs is not installed.
    #[error("otherix-testbed needs `{tool}`, which could not be run: {source}\nhint: {hint}")]
    MissingTool {
        tool: &'static str,
        hint: &'static str,
        source: std::io::Error,
    },

    /// The host: no /24 of [`crate::FABRIC_RANGE`] is free.
    #[error("no free /24 in {range} for a new world: {reason}")]
    RangeUnavailable { range: &'static str, reason: String },

    /// The caller: a role name that cannot become a namespace name, or is taken.
    #[error("invalid namespace role {role:?}: {reason}")]
    InvalidRole { role: String, reason: String },

    /// The caller: a namespace name that does not belong to this world.
    #[error(
        "namespace {netns:?} does not belong to world {prefix} (names start with `{prefix}-` or `{prefix}g`)"
    )]
    ForeignNamespace { netns: String, prefix: String },

    /// A command the testbed ran failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        command: String,
        status: ExitStatus,
        stderr: String,
    },

    /// A spawned process exited while something waited for it.
    #[error("{proc} exited ({status}) before {waiting_for}; last lines of its log:\n{log_tail}")]
    Exited {
        proc: String,
        status: ExitStatus,
        waiting_for: String,
        log_tail: String,
    },

    /// Waiting for something took longer than allowed.
    #[error("timed out after {after:?} waiting for {what}{detail}")]
    Timeout {
        what: String,
        after: Duration,
        detail: String,
    },

    /// A cluster operation (a CLI call, an unknown node) failed.
    #[error("{0}")]
    Cluster(String),

    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}

impl Error {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let what = what.into();
        move |source| Error::Io { what, source }
    }
}
