//! The client's parser of an HTTP response head: the gateway's answer to
//! `GET /v1/connect` (`101`, or a refusal with a one-line body) and the
//! control plane's answer to the relay's WebSocket upgrade. Pure over the
//! bytes read so far, and total (fuzzed: `crates/otherix-api/fuzz`,
//! target `response_head`); the reading itself is in [`crate::connect`].

/// Longest response head the client reads, its blank line included.
pub const MAX_HEAD: usize = 8 * 1024;
/// Longest refusal body the client reads (a refusal is one line).
pub const MAX_REFUSAL: usize = 8 * 1024;

/// Where reading a head stands, given every byte read so far. The client
/// reads one byte at a time: nothing after the blank line may be consumed,
/// it belongs to the tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// The bytes end with the head's blank line.
    Complete,
    /// Read one more byte.
    Incomplete,
    /// [`MAX_HEAD`] bytes and no blank line: not an answer we read.
    TooLong,
}

/// See [`Progress`].
pub fn progress(read: &[u8]) -> Progress {
    if read.ends_with(b"\r\n\r\n") {
        Progress::Complete
    } else if read.len() >= MAX_HEAD {
        Progress::TooLong
    } else {
        Progress::Incomplete
    }
}

/// A response head: the status and the header lines. Lenient, since it
/// only decides between "upgraded" and "refused, and why": the caller
/// accepts exactly `101` (and, for the relay, the right
/// `Sec-WebSocket-Accept`); anything else is a refusal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    status: u16,
    status_line: String,
    text: String,
}

impl ResponseHead {
    /// Parses a complete head (bytes not UTF-8 are replaced). A status line
    /// without a numeric status reads as status 0, which no caller accepts.
    pub fn parse(head: &[u8]) -> ResponseHead {
        let text = String::from_utf8_lossy(head).into_owned();
        let status_line = text.lines().next().unwrap_or_default().to_string();
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        ResponseHead {
            status,
            status_line,
            text,
        }
    }

    /// The status code, 0 when the status line has none.
    pub fn status(&self) -> u16 {
        self.status
    }

    /// The first line, as received.
    pub fn status_line(&self) -> &str {
        &self.status_line
    }

    /// The value of header `name` (case-insensitive), if present once or
    /// more: the first one.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.text.lines().skip(1).find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    /// How many body bytes to read for a refusal: its `Content-Length` (the
    /// CP's HTTP server may keep the connection open, so it says where the
    /// body ends; a gateway closes after a refusal), at most [`MAX_REFUSAL`].
    pub fn refusal_length(&self) -> u64 {
        self.header("content-length")
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(MAX_REFUSAL as u64, |n| n.min(MAX_REFUSAL as u64))
    }

    /// Why a refusal with this head and `body` refused: the body is one line
    /// (from a gateway), or the API's JSON error whose message says it (from
    /// the CP); the status line when the body is empty.
    pub fn refusal_reason(&self, body: &[u8]) -> String {
        let text = String::from_utf8_lossy(body).trim().to_string();
        let reason = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or(text);
        if reason.is_empty() {
            self.status_line.clone()
        } else {
            reason
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gateway_refusal_reads_as_its_status_and_one_line() {
        let head = ResponseHead::parse(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 31\r\n\r\n");
        assert_eq!(head.status(), 403);
        assert_eq!(head.status_line(), "HTTP/1.1 403 Forbidden");
        assert_eq!(head.refusal_length(), 31);
        assert_eq!(
            head.refusal_reason(b"credential is for gateway gw2\n"),
            "credential is for gateway gw2"
        );
        assert_eq!(head.refusal_reason(b""), "HTTP/1.1 403 Forbidden");
    }

    #[test]
    fn a_json_error_reads_as_its_message() {
        let head = ResponseHead::parse(b"HTTP/1.1 401 Unauthorized\r\n\r\n");
        assert_eq!(
            head.refusal_length(),
            MAX_REFUSAL as u64,
            "no length: read to the bound"
        );
        assert_eq!(
            head.refusal_reason(br#"{"error":{"code":"x","message":"ticket replayed"}}"#),
            "ticket replayed"
        );
    }

    #[test]
    fn headers_are_found_case_insensitively_and_trimmed() {
        let head = ResponseHead::parse(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nSEC-WEBSOCKET-ACCEPT:  abc= \r\n\r\n",
        );
        assert_eq!(head.status(), 101);
        assert_eq!(head.header("Sec-WebSocket-Accept"), Some("abc="));
        assert_eq!(head.header("content-length"), None);
    }

    #[test]
    fn garbage_is_status_zero_and_lengths_are_bounded() {
        for junk in [
            &b""[..],
            b"\r\n\r\n",
            b"HTTP/1.1\r\n\r\n",
            b"HTTP/1.1 99999 x\r\n\r\n",
            b"\xff\xfe x\r\n\r\n",
        ] {
            assert_eq!(ResponseHead::parse(junk).status(), 0, "{junk:?}");
        }
        let huge = ResponseHead::parse(b"HTTP/1.1 400 x\r\nContent-Length: 99999999999\r\n\r\n");
        assert_eq!(huge.refusal_length(), MAX_REFUSAL as u64);
    }

    #[test]
    fn reading_stops_at_the_blank_line_or_the_limit() {
        assert_eq!(progress(b"HTTP/1.1 101 x\r\n"), Progress::Incomplete);
        assert_eq!(progress(b"HTTP/1.1 101 x\r\n\r\n"), Progress::Complete);
        assert_eq!(progress(&vec![b'a'; MAX_HEAD]), Progress::TooLong);
        assert_eq!(progress(&vec![b'a'; MAX_HEAD - 1]), Progress::Incomplete);
    }
}
