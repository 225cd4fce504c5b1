//! Every environment variable the binary reads, in one place: the client's,
//! the daemons' (`otherix server`, `otherix agent`), the guest workloads' and
//! the standard ones it honours.

// --- the client ---

/// Path of the client config file (`--config`).
pub const CONFIG: &str = "OTHERIX_CONFIG";
/// The context to use instead of the current one (`--context`).
pub const CONTEXT: &str = "OTHERIX_CONTEXT";
/// An API token that overrides the one in the client config.
pub const TOKEN: &str = "OTHERIX_TOKEN";
/// A grant token (from `otherix grant create`); overrides any API token.
pub const GRANT: &str = "OTHERIX_GRANT";
/// `text` or `json`: the format of log lines on stderr (`--log-format`).
pub const LOG_FORMAT: &str = "OTHERIX_LOG_FORMAT";

// --- the daemons ---

/// The config file of `otherix server` (default `/etc/otherix/server.toml`).
pub const SERVER_CONFIG: &str = "OTHERIX_SERVER_CONFIG";
/// The config file of `otherix agent` (default `/etc/otherix/agent.toml`).
pub const AGENT_CONFIG: &str = "OTHERIX_AGENT_CONFIG";
/// Prefix of the variables that set `otherix server`'s flags (see [`flag`]).
pub const SERVER_FLAG_PREFIX: &str = "OTHERIX_SERVER_";
/// Prefix of the variables that set `otherix agent`'s flags (see [`flag`]).
pub const AGENT_FLAG_PREFIX: &str = "OTHERIX_AGENT_";

/// The variable that sets a daemon's flag: its prefix
/// ([`SERVER_FLAG_PREFIX`], [`AGENT_FLAG_PREFIX`]) and the flag's long name
/// in capitals, `-` written `_` (`--node-timeout` of the server:
/// `OTHERIX_SERVER_NODE_TIMEOUT`).
pub fn flag(prefix: &str, long: &str) -> String {
    format!("{prefix}{}", long.replace('-', "_").to_ascii_uppercase())
}

// --- guest workloads ---

/// The VM's name, set by the agent for its workloads; `otherix guest http`
/// answers with it.
pub const VM_NAME: &str = "OTHERIX_VM_NAME";

// --- standard ---

/// Where the client config lives by default (`$XDG_CONFIG_HOME/otherix/config.toml`).
pub const XDG_CONFIG_HOME: &str = "XDG_CONFIG_HOME";
/// Without `XDG_CONFIG_HOME`: `$HOME/.config`.
pub const HOME: &str = "HOME";
/// Set (to anything): no colour in log lines.
pub const NO_COLOR: &str = "NO_COLOR";
/// A `tracing` filter (`info`, `otherix_agent=debug`) that overrides `-v`.
pub const RUST_LOG: &str = "RUST_LOG";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_variables_follow_the_long_flag() {
        assert_eq!(
            flag(SERVER_FLAG_PREFIX, "node-timeout"),
            "OTHERIX_SERVER_NODE_TIMEOUT"
        );
        assert_eq!(flag(AGENT_FLAG_PREFIX, "server"), "OTHERIX_AGENT_SERVER");
        assert_eq!(flag(AGENT_FLAG_PREFIX, "join-token"), "OTHERIX_AGENT_JOIN_TOKEN");
    }
}
