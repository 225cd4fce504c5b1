//! What both ingress servers are configured with: the timeouts and bounds of
//! a connection ([`Limits`], the same defaults for the gateway and the relay
//! endpoint), and the one error a configuration is refused with
//! ([`ConfigError`]). Each server's own fields live beside it
//! (`gateway::GatewayConfig`); every field is validated once, when the server
//! is built.

use std::time::Duration;

/// Sessions end this long after they opened, by default.
pub const DEFAULT_MAX_SESSION: Duration = Duration::from_secs(12 * 3600);

/// Most connections a server holds at once, by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Most of them from one source address, by default (the control plane's
/// own per-address cap).
pub const DEFAULT_MAX_CONNECTIONS_PER_SOURCE: usize = 1_000;
/// A TLS handshake must be done this soon after the accept, by default: a
/// real client's takes a few round trips.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// The floor of the retransmission timeout of a connection to a guest, by
/// default (see [`Limits::guest_rto_min`]).
pub const DEFAULT_GUEST_RTO_MIN: Duration = Duration::from_millis(10);

/// The timeouts and bounds of one connection, from accept to the end of its
/// session. Both servers enforce the same ones with the same defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Time from TCP accept until the TLS handshake is done; a peer that
    /// holds a handshake open longer is cut (counted `handshake_timeout`).
    /// A half-open handshake holds a slot of its source's share for at most
    /// this long (or `request_timeout`, if that is shorter).
    pub handshake_timeout: Duration,
    /// Time from TCP accept until the whole request has arrived — the
    /// gateway's request head, the relay's request line — TLS handshake
    /// included. Slower clients are cut off (the gateway answers `408`).
    pub request_timeout: Duration,
    /// Time allowed to connect to the guest (the gateway answers `502`
    /// beyond, the relay `ERR cannot reach`).
    pub dial_timeout: Duration,
    /// A session with no bytes in either direction for this long is closed.
    pub idle_timeout: Duration,
    /// A session is closed this long after it opened, busy or not (reason
    /// `max_lifetime`): access taken away ends within this bound.
    pub max_session: Duration,
    /// Most connections open at once, in any stage. Beyond it the gateway
    /// answers new connections `503`; the relay closes them.
    pub max_connections: usize,
    /// Most connections open at once from one source address, in any stage
    /// (a TLS handshake under way included), so that one host cannot take
    /// every slot. One past it is closed at once (counted
    /// `max_connections_per_source`).
    pub max_connections_per_source: usize,
    /// Most bytes a splice direction gathers into one write (fewer, larger
    /// writes cost the kernel less). A direction holds such a buffer only
    /// while bytes are in flight: an idle session holds none.
    pub splice_buffer: usize,
    /// Floor of the retransmission timeout of the server's own connections
    /// to guests (`TCP_RTO_MIN_US`, Linux 6.15 on; the kernel rounds it up
    /// to whole ticks and, under two ticks, to the least it takes), in place
    /// of Linux's 200 ms. Such a connection
    /// crosses one overlay of the cluster, a round trip well under a
    /// millisecond; what a guest's live migration loses in flight is sent
    /// again after about this instead of 200 ms (see `docs/architecture.md`,
    /// Live migration). `None`: the kernel's floor. An older kernel keeps its
    /// own (logged once per server).
    pub guest_rto_min: Option<Duration>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            request_timeout: Duration::from_secs(10),
            dial_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(3600),
            max_session: DEFAULT_MAX_SESSION,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_source: DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
            splice_buffer: 64 * 1024,
            guest_rto_min: Some(DEFAULT_GUEST_RTO_MIN),
        }
    }
}

impl Limits {
    /// Checks every field once; `server` (`gateway`, `relay`) names whose
    /// configuration it is in the error.
    pub fn validate(&self, server: &'static str) -> Result<(), ConfigError> {
        let bad = |field, reason: &str| Err(ConfigError::new(server, field, reason));
        for (field, d) in [
            ("handshake_timeout", self.handshake_timeout),
            ("request_timeout", self.request_timeout),
            ("dial_timeout", self.dial_timeout),
            ("idle_timeout", self.idle_timeout),
            ("max_session", self.max_session),
        ] {
            if d.is_zero() {
                return bad(field, "must be longer than zero");
            }
        }
        if self.max_connections == 0 {
            return bad("max_connections", "must be at least 1");
        }
        // One above `max_connections` is `max_connections`: no share.
        if self.max_connections_per_source == 0 {
            return bad("max_connections_per_source", "must be at least 1");
        }
        if !(4096..=16 * 1024 * 1024).contains(&self.splice_buffer) {
            return bad("splice_buffer", "must be between 4 KiB and 16 MiB");
        }
        // At most the kernel's own 200 ms; a floor under two of its ticks
        // (8 ms at 250 Hz) is raised at the dial (`dial::lower_rto_min`).
        if let Some(floor) = self.guest_rto_min {
            if !(Duration::from_millis(1)..=Duration::from_millis(200)).contains(&floor) {
                return bad("guest_rto_min", "must be between 1 ms and 200 ms, or None");
            }
        }
        Ok(())
    }
}

/// A configuration field is unusable (the caller's fault).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {server} configuration: {field} {reason}")]
pub struct ConfigError {
    /// Whose configuration: `gateway` or `relay`.
    pub server: &'static str,
    /// The field at fault.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl ConfigError {
    pub(crate) fn new(server: &'static str, field: &'static str, reason: &str) -> ConfigError {
        ConfigError {
            server,
            field,
            reason: reason.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_limits_are_valid_and_name_the_server_when_not() {
        Limits::default().validate("relay").unwrap();
        let limits = Limits {
            dial_timeout: Duration::ZERO,
            ..Limits::default()
        };
        let err = limits.validate("relay").unwrap_err();
        assert_eq!(err.field, "dial_timeout");
        assert_eq!(
            err.to_string(),
            "invalid relay configuration: dial_timeout must be longer than zero"
        );
        let limits = Limits {
            splice_buffer: 10,
            ..Limits::default()
        };
        assert_eq!(limits.validate("gateway").unwrap_err().field, "splice_buffer");
        let limits = Limits {
            max_connections_per_source: 0,
            ..Limits::default()
        };
        assert_eq!(
            limits.validate("gateway").unwrap_err().field,
            "max_connections_per_source"
        );
        let limits = Limits {
            handshake_timeout: Duration::ZERO,
            ..Limits::default()
        };
        assert_eq!(limits.validate("relay").unwrap_err().field, "handshake_timeout");
    }

    #[test]
    fn a_guest_retransmission_floor_is_a_few_ms_to_the_kernels_own_or_none() {
        for (floor, ok) in [
            (None, true),
            (Some(Duration::from_millis(10)), true),
            (Some(Duration::from_millis(200)), true),
            (Some(Duration::ZERO), false),
            (Some(Duration::from_millis(201)), false),
        ] {
            let limits = Limits {
                guest_rto_min: floor,
                ..Limits::default()
            };
            let checked = limits.validate("gateway");
            assert_eq!(checked.is_ok(), ok, "{floor:?}");
            if !ok {
                assert_eq!(checked.unwrap_err().field, "guest_rto_min");
            }
        }
    }
}
