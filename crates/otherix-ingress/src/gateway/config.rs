//! The gateway's configuration: documented fields, `Duration`s, defaults
//! that suit production, validated once when the gateway is built. The
//! timeouts and bounds it shares with the relay endpoint are its
//! [`Limits`](crate::Limits).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use otherix_core::connect::DEFAULT_MAX_HEAD;
use otherix_core::credential::{default_share, share_fits, DEFAULT_MAX_LIFETIME, REPLAY_CAPACITY};

use crate::config::{ConfigError, Limits};

/// The longest [`GatewayConfig::max_credential_lifetime`] accepted.
const MAX_CREDENTIAL_LIFETIME_LIMIT: Duration = Duration::from_secs(24 * 3600);

/// How a gateway serves. Build with [`GatewayConfig::new`] and adjust fields;
/// [`crate::Gateway::new`] validates it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct GatewayConfig {
    /// Address [`crate::Gateway::serve`] binds (`--gateway ADDR`).
    pub listen: SocketAddr,
    /// This node's name: the credential `aud` this gateway accepts.
    pub node: String,
    /// The cluster id: the credential `iss` this gateway accepts. `None`:
    /// not checked until [`crate::Gateway::set_issuer`] gives one (the agent
    /// learns it from the control plane's desired state).
    pub issuer: Option<String>,
    /// Longest credential lifetime (`exp` less the earlier of `iat` and
    /// `nbf`) accepted, even inside the credential's time window (`401
    /// lifetime_too_long` beyond). The control plane mints credentials for
    /// 5 minutes by default.
    pub max_credential_lifetime: Duration,
    /// Timeouts and bounds of a connection (the shared defaults): its
    /// `request_timeout` covers the TLS handshake and the request head.
    pub limits: Limits,
    /// Largest request head accepted, blank line included (`431` beyond).
    pub max_header_bytes: usize,
    /// TCP keepalive idle time and probe interval, on both legs, so a peer
    /// that vanished without a FIN or RST is noticed.
    pub tcp_keepalive: Duration,
    /// Most credentials remembered as used. A credential lives 300 s plus
    /// skew, so this bounds sustained new sessions to about capacity / 330
    /// per second; beyond it the gateway refuses (`503`), never forgets.
    pub replay_capacity: usize,
    /// Most sessions one principal (a credential's `sub`) may have open here;
    /// past it its new connections are refused `429`, others' are not.
    /// Default a twentieth of `limits.max_connections`; at most half of it.
    pub max_sessions_per_principal: usize,
    /// Most entries one principal may hold in the replay cache (credentials
    /// used here and not yet expired); past it `429`, so that one principal's
    /// flood cannot fill the cache for everyone. Default a twentieth of
    /// `replay_capacity`; at most half of it.
    pub replay_share_per_principal: usize,
    /// File the used credentials are appended to and reloaded from at start,
    /// so a restart does not reopen a replay window. `None`: memory only.
    pub replay_file: Option<PathBuf>,
    /// After shutdown is asked for, how long open sessions may continue
    /// before they are cut.
    pub drain_timeout: Duration,
}

impl GatewayConfig {
    /// Defaults for node `node` listening on `listen`.
    pub fn new(listen: SocketAddr, node: impl Into<String>) -> GatewayConfig {
        GatewayConfig {
            listen,
            node: node.into(),
            issuer: None,
            max_credential_lifetime: DEFAULT_MAX_LIFETIME.unsigned_abs(),
            limits: Limits::default(),
            max_header_bytes: DEFAULT_MAX_HEAD,
            tcp_keepalive: Duration::from_secs(30),
            replay_capacity: REPLAY_CAPACITY,
            max_sessions_per_principal: default_share(Limits::default().max_connections),
            replay_share_per_principal: default_share(REPLAY_CAPACITY),
            replay_file: None,
            drain_timeout: Duration::from_secs(30),
        }
    }

    /// Checks every field once; the gateway never re-checks them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field, reason: &str| Err(ConfigError::new("gateway", field, reason));
        if self.node.is_empty() {
            return bad("node", "must name this node (the credential audience)");
        }
        self.limits.validate("gateway")?;
        if self.issuer.as_deref() == Some("") {
            return bad("issuer", "must be a cluster id, or None to not check it");
        }
        if !(Duration::from_secs(1)..=MAX_CREDENTIAL_LIFETIME_LIMIT).contains(&self.max_credential_lifetime) {
            return bad("max_credential_lifetime", "must be between 1 s and 24 h");
        }
        if self.tcp_keepalive < Duration::from_secs(1) {
            return bad("tcp_keepalive", "must be at least 1 s");
        }
        if !(512..=64 * 1024).contains(&self.max_header_bytes) {
            return bad("max_header_bytes", "must be between 512 and 65536");
        }
        if self.replay_capacity == 0 {
            return bad("replay_capacity", "must be at least 1");
        }
        // A share above half would let two principals fill the gateway.
        if !share_fits(self.max_sessions_per_principal, self.limits.max_connections) {
            return bad(
                "max_sessions_per_principal",
                "must be between 1 and half of max_connections",
            );
        }
        if !share_fits(self.replay_share_per_principal, self.replay_capacity) {
            return bad(
                "replay_share_per_principal",
                "must be between 1 and half of replay_capacity",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> GatewayConfig {
        GatewayConfig::new("127.0.0.1:0".parse().unwrap(), "gw1")
    }

    #[test]
    fn defaults_are_valid() {
        config().validate().unwrap();
        assert_eq!(config().limits.request_timeout, Duration::from_secs(10));
        assert_eq!(config().limits.max_connections, 10_000);
        assert_eq!(config().max_credential_lifetime, Duration::from_secs(15 * 60));
        assert_eq!(config().issuer, None);
        // One principal gets a twentieth, not half: twenty are needed to fill it.
        assert_eq!(config().max_sessions_per_principal, 500);
        assert_eq!(config().replay_capacity, 100_000);
        assert_eq!(config().replay_share_per_principal, 5_000);
    }

    #[test]
    fn a_per_principal_share_above_half_the_capacity_is_refused() {
        let mut c = config();
        c.max_sessions_per_principal = 5_000;
        c.replay_share_per_principal = 50_000;
        c.validate().unwrap();
        c.max_sessions_per_principal = 5_001;
        assert_eq!(c.validate().unwrap_err().field, "max_sessions_per_principal");
        let mut c = config();
        c.max_sessions_per_principal = 0;
        assert_eq!(c.validate().unwrap_err().field, "max_sessions_per_principal");
        let mut c = config();
        c.replay_share_per_principal = 50_001;
        assert_eq!(c.validate().unwrap_err().field, "replay_share_per_principal");
        let mut c = config();
        c.replay_share_per_principal = 0;
        assert_eq!(c.validate().unwrap_err().field, "replay_share_per_principal");
    }

    #[test]
    fn nonsense_is_refused_naming_the_field() {
        let mut c = config();
        c.node.clear();
        assert_eq!(c.validate().unwrap_err().field, "node");
        let mut c = config();
        c.limits.idle_timeout = Duration::ZERO;
        assert_eq!(c.validate().unwrap_err().field, "idle_timeout");
        let mut c = config();
        c.max_header_bytes = 10;
        assert_eq!(c.validate().unwrap_err().field, "max_header_bytes");
        let mut c = config();
        c.limits.max_connections = 0;
        assert_eq!(c.validate().unwrap_err().field, "max_connections");
        let mut c = config();
        c.max_credential_lifetime = Duration::ZERO;
        assert_eq!(c.validate().unwrap_err().field, "max_credential_lifetime");
        let mut c = config();
        c.issuer = Some(String::new());
        assert_eq!(c.validate().unwrap_err().field, "issuer");
    }
}
