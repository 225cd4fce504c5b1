//! The gateway's request head (DESIGN §6): a pure, sans-IO parser of
//! `GET /v1/connect HTTP/1.1` with `Upgrade: otherix-tcp`, `Connection:
//! upgrade` and `Authorization: Bearer <credential>`.
//!
//! The parser returns only the bearer credential. Nothing else a client
//! sends — `Host`, the path, a query, any other header — is returned, so
//! nothing else can influence where the gateway dials: the target comes from
//! the verified credential alone. The path must be exactly `/v1/connect`
//! (no query, no absolute form), and every line must be well-formed HTTP/1.1,
//! so a request that some other HTTP component would read differently is
//! refused rather than guessed at.
//!
//! The caller feeds the bytes read so far; the answer is [`Parsed::Incomplete`]
//! until the blank line that ends the head, and [`Parsed::Complete`] carries
//! how many bytes the head used: what follows is already the tunnel's payload
//! (a client may pipeline its first bytes) and must be forwarded, not dropped.

use std::fmt;

/// The only path the gateway serves.
pub const CONNECT_PATH: &str = "/v1/connect";
/// The upgrade token of the raw TCP tunnel.
pub const UPGRADE_TOKEN: &str = "otherix-tcp";
/// Default limit on the size of a request head, terminator included.
pub const DEFAULT_MAX_HEAD: usize = 8 * 1024;

const TERMINATOR: &[u8] = b"\r\n\r\n";

/// What the gateway takes from a well-formed connect request.
#[derive(Clone, PartialEq, Eq)]
pub struct ConnectRequest {
    /// The credential presented after `Authorization: Bearer`. Secret: it is
    /// redacted from `Debug` and must never be logged.
    pub bearer: String,
}

impl fmt::Debug for ConnectRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectRequest")
            .field("bearer", &format_args!("<{} bytes, redacted>", self.bearer.len()))
            .finish()
    }
}

/// The outcome of feeding the bytes read so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// The head has not ended yet (and is still within the limit): read more.
    Incomplete,
    /// A complete, valid head of `head_len` bytes; `buf[head_len..]` is the
    /// start of the tunnel's payload.
    Complete {
        /// The request.
        request: ConnectRequest,
        /// Bytes of `buf` the head used, the blank line included.
        head_len: usize,
    },
}

/// Why a request head is refused. Every variant is the client's fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// The head did not end within the limit.
    #[error("request head is larger than {limit} bytes")]
    TooLarge {
        /// The limit in force.
        limit: usize,
    },
    /// The request line is not `METHOD SP TARGET SP VERSION` of valid bytes.
    #[error("malformed request line")]
    BadRequestLine,
    /// The method is not `GET`.
    #[error("method not allowed: the connect request is a GET")]
    NotGet,
    /// The request target is anything but exactly `/v1/connect`.
    #[error("unknown path: the connect request is GET {CONNECT_PATH}, without a query")]
    WrongPath,
    /// The version is not `HTTP/1.1`.
    #[error("unsupported HTTP version: the connect request is HTTP/1.1")]
    WrongVersion,
    /// A header line is malformed or holds bytes HTTP does not allow
    /// (control characters, bare CR or LF, folded lines, a bad name).
    #[error("malformed header line {line}")]
    InvalidHeader {
        /// 1-based index of the header line (the request line is line 0).
        line: usize,
    },
    /// No `Upgrade` header names `otherix-tcp`.
    #[error("missing Upgrade: {UPGRADE_TOKEN}")]
    MissingUpgrade,
    /// No `Connection` header carries the `upgrade` option.
    #[error("missing Connection: upgrade")]
    MissingConnectionUpgrade,
    /// No `Authorization` header.
    #[error("missing Authorization: Bearer <credential>")]
    MissingAuthorization,
    /// `Authorization` is not `Bearer <token68>`.
    #[error("Authorization is not a Bearer credential")]
    MalformedAuthorization,
    /// More than one `Authorization` header.
    #[error("more than one Authorization header")]
    DuplicateAuthorization,
}

impl RequestError {
    /// Stable code for logs and metrics labels.
    pub fn code(&self) -> &'static str {
        match self {
            RequestError::TooLarge { .. } => "head_too_large",
            RequestError::BadRequestLine => "bad_request_line",
            RequestError::NotGet => "not_get",
            RequestError::WrongPath => "wrong_path",
            RequestError::WrongVersion => "wrong_version",
            RequestError::InvalidHeader { .. } => "invalid_header",
            RequestError::MissingUpgrade => "missing_upgrade",
            RequestError::MissingConnectionUpgrade => "missing_connection_upgrade",
            RequestError::MissingAuthorization => "missing_authorization",
            RequestError::MalformedAuthorization => "malformed_authorization",
            RequestError::DuplicateAuthorization => "duplicate_authorization",
        }
    }

    /// Which part of the request is wrong.
    pub fn part(&self) -> Part {
        match self {
            RequestError::TooLarge { .. } => Part::Size,
            RequestError::NotGet => Part::Method,
            RequestError::WrongPath => Part::Target,
            RequestError::WrongVersion => Part::Version,
            RequestError::MissingAuthorization | RequestError::MalformedAuthorization => Part::Credential,
            RequestError::BadRequestLine
            | RequestError::InvalidHeader { .. }
            | RequestError::MissingUpgrade
            | RequestError::MissingConnectionUpgrade
            | RequestError::DuplicateAuthorization => Part::Syntax,
        }
    }
}

/// The part of a connect request a [`RequestError`] is about; the gateway
/// maps each to its HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Part {
    /// The head is larger than the limit.
    Size,
    /// Not `GET`.
    Method,
    /// Not `/v1/connect`.
    Target,
    /// Not HTTP/1.1.
    Version,
    /// No usable `Authorization: Bearer` credential.
    Credential,
    /// Anything else malformed: the request line, a header field, the
    /// upgrade headers, a repeated `Authorization`.
    Syntax,
}

/// Parses the request head at the start of `buf`, which holds every byte
/// read so far. `max_head` bounds the head, terminator included: a head that
/// has not ended within it is refused, whatever follows.
///
/// Total: never panics, whatever the bytes.
pub fn parse_request(buf: &[u8], max_head: usize) -> Result<Parsed, RequestError> {
    let window = &buf[..buf.len().min(max_head)];
    let Some(end) = find(window, TERMINATOR) else {
        if buf.len() >= max_head {
            return Err(RequestError::TooLarge { limit: max_head });
        }
        return Ok(Parsed::Incomplete);
    };
    let head_len = end + TERMINATOR.len();
    let request = parse_head(&buf[..end])?;
    Ok(Parsed::Complete { request, head_len })
}

/// [`parse_request`] for a buffer that grows as bytes arrive: each call
/// looks for the end of the head only in what arrived since the last one
/// (and the three bytes before, where a terminator may have begun), so a
/// head sent a byte at a time costs work linear in its size, not quadratic.
/// The head is parsed once, when its end has arrived.
#[derive(Debug, Default, Clone)]
pub struct HeadScanner {
    /// Bytes of the buffer already searched for the terminator.
    scanned: usize,
    /// Bytes examined in all (for tests of the bound).
    examined: usize,
}

impl HeadScanner {
    pub fn new() -> HeadScanner {
        HeadScanner::default()
    }

    /// `buf` holds every byte read so far (the previous call's and more).
    pub fn feed(&mut self, buf: &[u8], max_head: usize) -> Result<Parsed, RequestError> {
        let window = &buf[..buf.len().min(max_head)];
        let from = self
            .scanned
            .saturating_sub(TERMINATOR.len() - 1)
            .min(window.len());
        self.examined += window.len() - from;
        let Some(at) = find(&window[from..], TERMINATOR) else {
            self.scanned = window.len();
            if buf.len() >= max_head {
                return Err(RequestError::TooLarge { limit: max_head });
            }
            return Ok(Parsed::Incomplete);
        };
        let end = from + at;
        self.scanned = end;
        let request = parse_head(&buf[..end])?;
        Ok(Parsed::Complete {
            request,
            head_len: end + TERMINATOR.len(),
        })
    }

    /// Bytes examined so far, over every call.
    pub fn examined(&self) -> usize {
        self.examined
    }
}

/// Parses the head without its final `\r\n\r\n`.
fn parse_head(head: &[u8]) -> Result<ConnectRequest, RequestError> {
    let mut lines = split_crlf(head);
    // `split_crlf` yields at least one (possibly empty) line.
    let request_line = lines.next().unwrap_or_default();
    parse_request_line(request_line)?;

    let mut upgrade = false;
    let mut connection_upgrade = false;
    let mut authorization: Option<&[u8]> = None;
    for (index, line) in lines.enumerate() {
        let number = index + 1;
        let (name, value) = parse_header_line(line).ok_or(RequestError::InvalidHeader { line: number })?;
        if name.eq_ignore_ascii_case(b"upgrade") {
            upgrade |= list_contains(value, UPGRADE_TOKEN.as_bytes());
        } else if name.eq_ignore_ascii_case(b"connection") {
            connection_upgrade |= list_contains(value, b"upgrade");
        } else if name.eq_ignore_ascii_case(b"authorization") && authorization.replace(value).is_some() {
            return Err(RequestError::DuplicateAuthorization);
        }
        // Every other header is ignored: nothing else may steer the gateway.
    }
    if !upgrade {
        return Err(RequestError::MissingUpgrade);
    }
    if !connection_upgrade {
        return Err(RequestError::MissingConnectionUpgrade);
    }
    let authorization = authorization.ok_or(RequestError::MissingAuthorization)?;
    let bearer = parse_bearer(authorization).ok_or(RequestError::MalformedAuthorization)?;
    Ok(ConnectRequest { bearer })
}

/// `GET SP /v1/connect SP HTTP/1.1`, single spaces, as RFC 9112 §3 writes it.
fn parse_request_line(line: &[u8]) -> Result<(), RequestError> {
    let mut parts = line.split(|&b| b == b' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(RequestError::BadRequestLine);
    };
    if method.is_empty()
        || !method.iter().all(|&b| is_tchar(b))
        || target.is_empty()
        || !target.iter().all(|&b| b.is_ascii_graphic())
        || version.is_empty()
        || !version.iter().all(|&b| b.is_ascii_graphic())
    {
        return Err(RequestError::BadRequestLine);
    }
    // Methods and the version are case-sensitive (RFC 9110 §9.1, RFC 9112 §2.3).
    if method != b"GET" {
        return Err(RequestError::NotGet);
    }
    if target != CONNECT_PATH.as_bytes() {
        return Err(RequestError::WrongPath);
    }
    if version != b"HTTP/1.1" {
        return Err(RequestError::WrongVersion);
    }
    Ok(())
}

/// `name ":" OWS value OWS`, or `None` if the line is not a valid field line.
/// Whitespace before the colon and obsolete line folding are refused
/// (RFC 9112 §5.1, §5.2), as are control characters in the value.
fn parse_header_line(line: &[u8]) -> Option<(&[u8], &[u8])> {
    let colon = line.iter().position(|&b| b == b':')?;
    let (name, rest) = (&line[..colon], &line[colon + 1..]);
    if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
        return None;
    }
    if !rest.iter().all(|&b| is_field_byte(b)) {
        return None;
    }
    Some((name, trim_ows(rest)))
}

/// `Bearer 1*SP token68`, scheme case-insensitive (RFC 9110 §11.1, RFC 6750 §2.1).
fn parse_bearer(value: &[u8]) -> Option<String> {
    let space = value.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = (&value[..space], &value[space..]);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = trim_ows(rest);
    if !is_token68(token) {
        return None;
    }
    // token68 is ASCII, so this cannot fail; map it anyway rather than unwrap.
    String::from_utf8(token.to_vec()).ok()
}

/// `token68 = 1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"="`
fn is_token68(token: &[u8]) -> bool {
    let body_len = token
        .iter()
        .position(|&b| !(b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'+' | b'/')))
        .unwrap_or(token.len());
    body_len > 0 && token[body_len..].iter().all(|&b| b == b'=')
}

/// Whether a comma-separated header list holds `want` (case-insensitive).
fn list_contains(value: &[u8], want: &[u8]) -> bool {
    value
        .split(|&b| b == b',')
        .any(|item| trim_ows(item).eq_ignore_ascii_case(want))
}

/// RFC 9110 §5.6.2 `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'!' | b'#'
                | b'$'
                | b'%'
                | b'&'
                | b'\''
                | b'*'
                | b'+'
                | b'-'
                | b'.'
                | b'^'
                | b'_'
                | b'`'
                | b'|'
                | b'~'
        )
}

/// Bytes allowed in a field value: VCHAR, obs-text, SP and HTAB.
fn is_field_byte(b: u8) -> bool {
    b == b' ' || b == b'\t' || (0x21..=0x7e).contains(&b) || b >= 0x80
}

fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// Splits on `\r\n`. A bare CR or LF stays inside a line, where the byte
/// checks refuse it.
fn split_crlf(head: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(head);
    std::iter::from_fn(move || {
        let s = rest?;
        match find(s, b"\r\n") {
            Some(i) => {
                rest = Some(&s[i + 2..]);
                Some(&s[..i])
            }
            None => {
                rest = None;
                Some(s)
            }
        }
    })
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TOKEN: &str = "v4.public.eyJpc3MiOiJjbHVzdGVyMSJ9abc-_.eyJraWQiOiJrMSJ9";

    fn valid_head() -> String {
        format!(
            "GET /v1/connect HTTP/1.1\r\nHost: gw1:8443\r\nAuthorization: Bearer {TOKEN}\r\nConnection: Upgrade\r\nUpgrade: otherix-tcp\r\n\r\n"
        )
    }

    fn parse(head: &str) -> Result<Parsed, RequestError> {
        parse_request(head.as_bytes(), DEFAULT_MAX_HEAD)
    }

    fn bearer_of(head: &str) -> String {
        match parse(head) {
            Ok(Parsed::Complete { request, .. }) => request.bearer,
            other => panic!("expected a complete request, got {other:?}"),
        }
    }

    /// The valid head with one header line replaced (or removed when `with` is empty).
    fn with_header(name: &str, with: &str) -> String {
        let mut out = String::new();
        for line in valid_head().trim_end_matches("\r\n\r\n").split("\r\n") {
            if line
                .split(':')
                .next()
                .is_some_and(|n| n.eq_ignore_ascii_case(name))
            {
                if !with.is_empty() {
                    out.push_str(with);
                    out.push_str("\r\n");
                }
            } else {
                out.push_str(line);
                out.push_str("\r\n");
            }
        }
        out.push_str("\r\n");
        out
    }

    #[test]
    fn valid_head_yields_the_bearer_and_its_length() {
        let head = valid_head();
        assert_eq!(
            parse(&head),
            Ok(Parsed::Complete {
                request: ConnectRequest { bearer: TOKEN.into() },
                head_len: head.len()
            })
        );
    }

    #[test]
    fn pipelined_payload_after_the_head_is_not_consumed() {
        let mut bytes = valid_head().into_bytes();
        let head_len = bytes.len();
        bytes.extend_from_slice(b"SSH-2.0-OpenSSH_9.6\r\n\r\n\r\nmore");
        match parse_request(&bytes, DEFAULT_MAX_HEAD) {
            Ok(Parsed::Complete { head_len: n, .. }) => assert_eq!(n, head_len),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn head_is_incomplete_until_the_blank_line() {
        let head = valid_head();
        assert_eq!(parse(&head[..head.len() - 1]), Ok(Parsed::Incomplete));
        assert_eq!(parse(""), Ok(Parsed::Incomplete));
        assert_eq!(parse("GET /v1/connect HTTP/1.1\r\n"), Ok(Parsed::Incomplete));
    }

    #[test]
    fn oversized_head_is_refused_even_without_its_end() {
        let huge = format!(
            "GET /v1/connect HTTP/1.1\r\nX-Pad: {}",
            "a".repeat(DEFAULT_MAX_HEAD)
        );
        assert_eq!(
            parse(&huge),
            Err(RequestError::TooLarge {
                limit: DEFAULT_MAX_HEAD
            })
        );
        // A complete head that ends past the limit is refused too.
        let long_done = format!("{}\r\n\r\n", &huge[..DEFAULT_MAX_HEAD + 10]);
        assert_eq!(
            parse(&long_done),
            Err(RequestError::TooLarge {
                limit: DEFAULT_MAX_HEAD
            })
        );
        // A head exactly at the limit is fine.
        let head = valid_head();
        assert!(matches!(
            parse_request(head.as_bytes(), head.len()),
            Ok(Parsed::Complete { .. })
        ));
        assert_eq!(
            parse_request(head.as_bytes(), head.len() - 1),
            Err(RequestError::TooLarge {
                limit: head.len() - 1
            })
        );
    }

    #[test]
    fn only_get_is_allowed() {
        for method in ["POST", "get", "CONNECT", "PUT"] {
            let head = valid_head().replacen("GET", method, 1);
            assert_eq!(parse(&head), Err(RequestError::NotGet), "{method}");
        }
    }

    #[test]
    fn path_must_be_exactly_v1_connect() {
        for target in [
            "/v1/connect?target=10.0.0.9:22",
            "/v1/connect?",
            "/v1/connect/",
            "/v1/Connect",
            "/v1//connect",
            "/v1/connect#x",
            "//v1/connect",
            "https://10.0.0.9:22/v1/connect",
            "10.0.0.9:22",
            "*",
            "/",
        ] {
            let head = valid_head().replacen("/v1/connect", target, 1);
            assert_eq!(parse(&head), Err(RequestError::WrongPath), "{target}");
        }
    }

    #[test]
    fn only_http_1_1_is_spoken() {
        for version in ["HTTP/1.0", "HTTP/2.0", "http/1.1", "HTTP/1.10"] {
            let head = valid_head().replacen("HTTP/1.1", version, 1);
            assert_eq!(parse(&head), Err(RequestError::WrongVersion), "{version}");
        }
    }

    #[test]
    fn malformed_request_lines_are_refused() {
        for line in [
            "GET  /v1/connect HTTP/1.1",
            "GET /v1/connect  HTTP/1.1",
            "GET /v1/connect",
            "GET /v1/connect HTTP/1.1 extra",
            " GET /v1/connect HTTP/1.1",
            "GET\t/v1/connect\tHTTP/1.1",
            "GET /v1/conn\u{7f}ect HTTP/1.1",
            "",
        ] {
            let head = valid_head().replacen("GET /v1/connect HTTP/1.1", line, 1);
            assert_eq!(parse(&head), Err(RequestError::BadRequestLine), "{line:?}");
        }
    }

    #[test]
    fn upgrade_must_name_otherix_tcp() {
        assert_eq!(
            parse(&with_header("upgrade", "")),
            Err(RequestError::MissingUpgrade)
        );
        for value in ["websocket", "otherix-tcp/2", "otherix-tcpx", "otherix", ""] {
            let head = with_header("upgrade", &format!("Upgrade: {value}"));
            assert_eq!(parse(&head), Err(RequestError::MissingUpgrade), "{value}");
        }
        for value in [
            "OTHERIX-TCP",
            "websocket, otherix-tcp",
            " otherix-tcp ",
            ",otherix-tcp,",
        ] {
            let head = with_header("upgrade", &format!("Upgrade: {value}"));
            assert_eq!(bearer_of(&head), TOKEN, "{value}");
        }
    }

    #[test]
    fn connection_must_carry_upgrade() {
        assert_eq!(
            parse(&with_header("connection", "")),
            Err(RequestError::MissingConnectionUpgrade)
        );
        for value in ["close", "keep-alive", "upgrades"] {
            let head = with_header("connection", &format!("Connection: {value}"));
            assert_eq!(
                parse(&head),
                Err(RequestError::MissingConnectionUpgrade),
                "{value}"
            );
        }
        for value in ["upgrade", "keep-alive, Upgrade", "UPGRADE"] {
            let head = with_header("connection", &format!("Connection: {value}"));
            assert_eq!(bearer_of(&head), TOKEN, "{value}");
        }
    }

    #[test]
    fn authorization_must_be_one_bearer_token() {
        assert_eq!(
            parse(&with_header("authorization", "")),
            Err(RequestError::MissingAuthorization)
        );
        for value in [
            "Basic dXNlcjpwYXNz",
            "Bearer",
            "Bearer ",
            "Bearer two tokens",
            "Bearer tok\"en",
            "Bearer =abc",
            "Bearer abc=def",
            "Bearertoken",
            "",
        ] {
            let head = with_header("authorization", &format!("Authorization: {value}"));
            assert_eq!(
                parse(&head),
                Err(RequestError::MalformedAuthorization),
                "{value:?}"
            );
        }
        for (value, want) in [
            ("bearer abc", "abc"),
            ("BEARER   abc==", "abc=="),
            ("Bearer a+b/c~d", "a+b/c~d"),
        ] {
            let head = with_header("authorization", &format!("Authorization: {value}"));
            assert_eq!(bearer_of(&head), want, "{value}");
        }
        let twice = valid_head().replacen("\r\n\r\n", "\r\nauthorization: Bearer other\r\n\r\n", 1);
        assert_eq!(parse(&twice), Err(RequestError::DuplicateAuthorization));
    }

    #[test]
    fn invalid_header_bytes_are_refused() {
        for line in [
            "X-Bad: a\0b",
            "X-Bad: a\rb",
            "X-Bad: a\nb",
            "X-Bad : value",
            "X Bad: value",
            ": no name",
            "no colon",
            " folded: line",
            "\tfolded",
            "X-Ctl: \u{1b}[31m",
        ] {
            let head = valid_head().replacen("Host: gw1:8443", line, 1);
            assert_eq!(
                parse(&head),
                Err(RequestError::InvalidHeader { line: 1 }),
                "{line:?}"
            );
        }
        // obs-text in values of ignored headers is allowed.
        let head = valid_head().replacen("Host: gw1:8443", "X-Note: caf\u{e9}", 1);
        assert_eq!(bearer_of(&head), TOKEN);
    }

    #[test]
    fn nothing_but_the_bearer_is_returned_whatever_else_is_sent() {
        let head = valid_head().replacen(
            "Host: gw1:8443",
            "Host: 127.0.0.1:9999\r\nX-Target: 10.0.0.9:22\r\nX-Forwarded-For: 1.2.3.4\r\nForwarded: for=1.2.3.4",
            1,
        );
        assert_eq!(bearer_of(&head), TOKEN);
        // No Host at all is fine: it is not used.
        assert_eq!(bearer_of(&with_header("host", "")), TOKEN);
    }

    #[test]
    fn debug_output_never_shows_the_credential() {
        let request = ConnectRequest { bearer: TOKEN.into() };
        let shown = format!("{request:?}");
        assert!(!shown.contains("v4.public"), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }

    #[test]
    fn every_error_has_a_distinct_code_and_one_line() {
        let all = [
            RequestError::TooLarge { limit: 1 },
            RequestError::BadRequestLine,
            RequestError::NotGet,
            RequestError::WrongPath,
            RequestError::WrongVersion,
            RequestError::InvalidHeader { line: 1 },
            RequestError::MissingUpgrade,
            RequestError::MissingConnectionUpgrade,
            RequestError::MissingAuthorization,
            RequestError::MalformedAuthorization,
            RequestError::DuplicateAuthorization,
        ];
        let codes: std::collections::BTreeSet<_> = all.iter().map(RequestError::code).collect();
        assert_eq!(codes.len(), all.len(), "codes are distinct");
        for e in &all {
            let _ = e.part();
            assert!(!e.to_string().contains('\n'), "one line: {e}");
        }
    }

    /// A valid head from parts: header names in any case, in any order,
    /// with unrelated headers among them.
    fn arb_valid_head() -> impl Strategy<Value = (String, String)> {
        let token = "[A-Za-z0-9._~+/-]{1,64}={0,2}";
        let extra = proptest::collection::vec(("X-[A-Za-z0-9-]{1,12}", "[ -~]{0,40}"), 0..5);
        (
            token,
            extra,
            any::<u64>(),
            proptest::collection::vec(any::<bool>(), 64),
        )
            .prop_map(|(token, extra, seed, flips)| {
                let mut flips = flips.into_iter().cycle();
                let mut case = |s: &str| -> String {
                    s.chars()
                        .map(|c| {
                            if flips.next().unwrap_or(false) {
                                c.to_ascii_uppercase()
                            } else {
                                c.to_ascii_lowercase()
                            }
                        })
                        .collect()
                };
                let mut headers = vec![
                    format!("{}: {} {token}", case("authorization"), case("bearer")),
                    format!("{}: {}", case("connection"), case("upgrade")),
                    format!("{}: {}", case("upgrade"), case("otherix-tcp")),
                    format!("{}: gw1", case("host")),
                ];
                headers.extend(extra.into_iter().map(|(n, v)| format!("{n}: {}", v.trim())));
                // A deterministic shuffle driven by the seed.
                let mut s = seed;
                for i in (1..headers.len()).rev() {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    headers.swap(i, (s >> 33) as usize % (i + 1));
                }
                let head = format!("GET /v1/connect HTTP/1.1\r\n{}\r\n\r\n", headers.join("\r\n"));
                (head, token)
            })
    }

    proptest! {
        #[test]
        fn never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..2048), max in 0usize..4096) {
            let _ = parse_request(&bytes, max);
        }

        #[test]
        fn never_panics_on_a_valid_head_with_noise(
            (head, _) in arb_valid_head(),
            at in any::<prop::sample::Index>(),
            noise in proptest::collection::vec(any::<u8>(), 0..16),
        ) {
            let mut bytes = head.into_bytes();
            let i = at.index(bytes.len());
            bytes.splice(i..i, noise);
            let _ = parse_request(&bytes, DEFAULT_MAX_HEAD);
        }

        #[test]
        fn any_prefix_of_a_valid_head_is_incomplete((head, _) in arb_valid_head(), cut in any::<prop::sample::Index>()) {
            let n = cut.index(head.len());
            prop_assert_eq!(parse_request(&head.as_bytes()[..n], DEFAULT_MAX_HEAD), Ok(Parsed::Incomplete));
        }

        #[test]
        fn header_order_and_case_do_not_matter(
            (head, token) in arb_valid_head(),
            tail in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut bytes = head.clone().into_bytes();
            bytes.extend_from_slice(&tail);
            prop_assert_eq!(
                parse_request(&bytes, DEFAULT_MAX_HEAD),
                Ok(Parsed::Complete { request: ConnectRequest { bearer: token }, head_len: head.len() })
            );
        }

        #[test]
        fn a_scanner_fed_in_any_chunks_answers_as_parse_request_on_the_whole(
            bytes in proptest::collection::vec(any::<u8>(), 0..1024),
            (head, _) in arb_valid_head(),
            use_head in any::<bool>(),
            cuts in proptest::collection::vec(1usize..64, 1..64),
            max in 8usize..4096,
        ) {
            let bytes = if use_head { head.into_bytes() } else { bytes };
            let whole = parse_request(&bytes, max);
            let mut scanner = HeadScanner::new();
            let mut n = 0;
            let mut answer = Ok(Parsed::Incomplete);
            for cut in cuts.iter().cycle() {
                n = (n + cut).min(bytes.len());
                answer = scanner.feed(&bytes[..n], max);
                if !matches!(answer, Ok(Parsed::Incomplete)) || n == bytes.len() {
                    break;
                }
            }
            prop_assert_eq!(answer, whole);
        }
    }

    #[test]
    fn a_head_fed_a_byte_at_a_time_is_scanned_once_and_parsed_as_whole() {
        let head = format!(
            "GET /v1/connect HTTP/1.1\r\nHost: gw\r\nX-Pad: {}\r\nUpgrade: otherix-tcp\r\nConnection: Upgrade\r\nAuthorization: Bearer abc.def\r\n\r\nearly",
            "p".repeat(6000)
        );
        let bytes = head.as_bytes();
        let mut scanner = HeadScanner::new();
        let mut got = None;
        for n in 1..=bytes.len() {
            match scanner.feed(&bytes[..n], DEFAULT_MAX_HEAD).unwrap() {
                Parsed::Incomplete => {}
                done @ Parsed::Complete { .. } => {
                    got = Some(done);
                    break;
                }
            }
        }
        assert_eq!(got.unwrap(), parse_request(bytes, DEFAULT_MAX_HEAD).unwrap());
        // Each byte looked at a few times at most, not once per read.
        assert!(
            scanner.examined() <= 4 * bytes.len(),
            "{} bytes examined for a {}-byte head",
            scanner.examined(),
            bytes.len()
        );
    }

    #[test]
    fn a_scanner_refuses_an_endless_head_at_the_limit() {
        let mut scanner = HeadScanner::new();
        let junk = vec![b'a'; 100];
        assert_eq!(scanner.feed(&junk[..50], 100), Ok(Parsed::Incomplete));
        assert_eq!(
            scanner.feed(&junk, 100),
            Err(RequestError::TooLarge { limit: 100 })
        );
    }
}
