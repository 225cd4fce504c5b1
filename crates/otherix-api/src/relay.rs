//! Relay constants shared by the CP, the agents and clients (DESIGN §6).
//!
//! Client ⇄ CP: `GET /v1/relay` WebSocket (binary frames) over the CP's TLS,
//! the ticket in `Authorization: Bearer`. CP ⇄ agent: mutual TLS to the
//! agent's relay endpoint; the CP writes one line `RELAY <vm_id> <port>\n`,
//! the agent answers `OK\n` or `ERR <reason>\n`, then raw bytes both ways.

/// The `aud` of relay tickets: the control plane, not a gateway node.
pub const AUDIENCE: &str = "control-plane";
/// The DNS name in the CP's client certificate for relay dials. It has a
/// dot, so no node (a DNS label) can ever carry it.
pub const CP_CLIENT_NAME: &str = "control-plane.otherix";
/// Path of the CP's WebSocket relay endpoint.
pub const PATH: &str = "/v1/relay";
/// Longest `RELAY`/`OK`/`ERR` line.
pub const MAX_LINE: usize = 512;

/// The CP's request line to an agent.
pub fn request_line(vm_id: &str, port: u16) -> String {
    format!("RELAY {vm_id} {port}\n")
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

#[cfg(test)]
mod tests {
    use super::*;

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
