//! Relay constants shared by the CP, the agents and clients (DESIGN §6).
//!
//! Client ⇄ CP: `GET /v1/relay` WebSocket (binary frames) over the CP's TLS,
//! the ticket in `Authorization: Bearer`. Nothing else in the request (path
//! suffix, query, other headers) names a target: the ticket does. A
//! non-empty binary frame carries bytes; an **empty binary frame ends that
//! direction** (half-close, TCP's FIN): a WebSocket Close cannot do that,
//! since no data may follow a received Close. The CP sends Close
//! [`CLOSE_DONE`] once both directions have ended, or earlier with
//! [`CLOSE_FAILED`] / [`CLOSE_IDLE`] / [`CLOSE_MOVED`] and a reason; a
//! client's Close aborts the session. The CP pings every 20 s; the client answers, and counts a
//! long silence as a lost control plane.
//!
//! CP ⇄ agent: mutual TLS to the agent's relay endpoint (the CP presents a
//! client certificate naming [`CP_CLIENT_NAME`], the agent a relay serving
//! certificate naming `NODE.relay.otherix` and its granted address, which
//! the CP checks against the certificates it issued to that node);
//! the CP writes one line `RELAY <vm_id> <port>\n` ([`parse_request_line`]),
//! the agent answers `OK\n` or `ERR <reason>\n` ([`parse_answer_line`]),
//! then raw bytes both ways, TLS `close_notify` ending
//! a direction. The agent resolves the VM id to the lease of a guest on a
//! bridge it hosts, from its own desired state: the CP sends no address.

/// The `aud` of relay tickets: the control plane, not a gateway node.
pub const AUDIENCE: &str = "control-plane";
/// The DNS name in the CP's client certificate for relay dials. It has a
/// dot, so no node (a DNS label) can ever carry it.
pub const CP_CLIENT_NAME: &str = "control-plane.otherix";
/// The relay endpoint's port on a hypervisor's VTEP, unless an admin granted
/// another address.
pub const DEFAULT_PORT: u16 = otherix_core::node::RELAY_DEFAULT_PORT;
/// Path of the CP's WebSocket relay endpoint.
pub const PATH: &str = "/v1/relay";
/// Longest `RELAY`/`OK`/`ERR` line.
pub const MAX_LINE: usize = 512;
/// Largest data frame either side sends (they accept twice that).
pub const MAX_FRAME: usize = 64 * 1024;
/// Close code: both directions ended.
pub const CLOSE_DONE: u16 = 1000;
/// Close code: the CP is going away or the session was idle too long.
pub const CLOSE_IDLE: u16 = 1001;
/// Close code: the node or the guest connection failed, or a peer broke the
/// framing.
pub const CLOSE_FAILED: u16 = 1011;
/// Close code (private range): the VM moved to another node, which the
/// session does not follow (v1); a new connection reaches it there.
pub const CLOSE_MOVED: u16 = 4001;

/// The port a relay ticket names for a QEMU guest's serial console
/// (`POST /v1/vms/{name}/console`): no TCP port is 0, so a ticket for one
/// never opens the other.
pub const CONSOLE_PORT: u16 = 0;

/// The CP's request line to an agent: `CONSOLE <vm_id>` for the serial
/// console ([`CONSOLE_PORT`]), `RELAY <vm_id> <port>` otherwise.
pub fn request_line(vm_id: &str, port: u16) -> String {
    if port == CONSOLE_PORT {
        format!("CONSOLE {vm_id}\n")
    } else {
        format!("RELAY {vm_id} {port}\n")
    }
}

/// Parses a console request line (without its `\n`): the VM id.
pub fn parse_console_line(line: &str) -> Option<&str> {
    line.strip_prefix("CONSOLE ")
        .filter(|id| !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Parses a request line (without its `\n`): `(vm_id, port)`.
pub fn parse_request_line(line: &str) -> Option<(&str, u16)> {
    let mut parts = line.strip_prefix("RELAY ")?.split(' ');
    let vm_id = parts
        .next()
        .filter(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_hexdigit()))?;
    let port = parts.next()?.parse::<u16>().ok().filter(|p| *p != 0)?;
    parts.next().is_none().then_some((vm_id, port))
}

/// The agent's answer to a request line, as the CP reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer<'a> {
    /// `OK`: raw bytes follow.
    Ok,
    /// Anything else refuses: the reason of `ERR <reason>`, or the whole
    /// line when it is not even that.
    Err(&'a str),
}

/// Parses the agent's answer line, with or without its `\n`.
pub fn parse_answer_line(line: &str) -> Answer<'_> {
    match line.trim_end() {
        "OK" => Answer::Ok,
        other => Answer::Err(other.strip_prefix("ERR ").unwrap_or(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_lines_are_ok_or_a_reason() {
        assert_eq!(parse_answer_line("OK\n"), Answer::Ok);
        assert_eq!(parse_answer_line("OK"), Answer::Ok);
        assert_eq!(
            parse_answer_line("ERR cannot reach 10.0.0.2:22: refused\n"),
            Answer::Err("cannot reach 10.0.0.2:22: refused")
        );
        assert_eq!(parse_answer_line("OKAY\n"), Answer::Err("OKAY"));
        assert_eq!(parse_answer_line(""), Answer::Err(""));
    }

    #[test]
    fn a_console_request_is_its_own_line_and_never_a_port() {
        let line = request_line("abc123", CONSOLE_PORT);
        assert_eq!(line, "CONSOLE abc123\n");
        assert_eq!(parse_console_line(line.trim_end()), Some("abc123"));
        assert_eq!(parse_request_line(line.trim_end()), None);
        for bad in [
            "CONSOLE ",
            "CONSOLE ab c",
            "CONSOLE ../x",
            "CONSOLE abc 22",
            "RELAY abc 0",
        ] {
            assert_eq!(parse_console_line(bad), None, "{bad}");
        }
        assert_eq!(parse_request_line("RELAY abc 0"), None, "port 0 is no relay port");
    }

    #[test]
    fn request_lines_round_trip_and_junk_is_refused() {
        let line = request_line("abc123", 22);
        assert_eq!(parse_request_line(line.trim_end()), Some(("abc123", 22)));
        for bad in [
            "",
            "RELAY",
            "RELAY abc",
            "RELAY abc 0",
            "RELAY abc 70000",
            "RELAY ab/c 22",
            "RELAY abc 22 x",
            "relay abc 22",
        ] {
            assert_eq!(parse_request_line(bad), None, "{bad}");
        }
    }
}
