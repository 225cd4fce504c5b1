//! Fuzzes the client's reading of a gateway's (or the relay upgrade's)
//! response head, as `tunnel::http1::upgrade` feeds it — the bytes read so
//! far, growing in chunks the fuzzer chooses — then what a refusal is made
//! of: the status, headers, the body length to read and the reason shown to
//! the user. Never a panic; a head is complete at most once, within the
//! limit, and no byte after it is taken as part of it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use otherix_client::tunnel::http1::{parse_head, Parsed, MAX_HEAD, MAX_REFUSAL};

fuzz_target!(|data: &[u8]| {
    // The first byte picks the chunk size the bytes arrive in and a header
    // name to look up besides the ones the client asks for.
    let Some((&pick, bytes)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(pick % 64) + 1;
    let mut end = 0;
    let (head, len) = loop {
        end = (end + chunk).min(bytes.len());
        match parse_head(&bytes[..end]) {
            Parsed::Complete { head, len } => break (head, len),
            Parsed::TooLong => {
                assert!(end >= MAX_HEAD);
                return;
            }
            Parsed::Malformed(reason) => {
                assert!(!reason.is_empty());
                return;
            }
            Parsed::Incomplete if end == bytes.len() => return,
            Parsed::Incomplete => {}
        }
    };
    assert!(len <= end && len <= MAX_HEAD);
    // The same head, whatever came after it.
    assert_eq!(parse_head(&bytes[..len]), Parsed::Complete { head: head.clone(), len });
    let _ = head.status();
    assert!(!head.status_line().contains('\n'));
    for name in ["sec-websocket-accept", "content-length", "upgrade"] {
        if let Some(value) = head.header(name) {
            assert_eq!(value, value.trim());
        }
    }
    let names = ["", ":", "x", "Content-Length", "\u{fffd}"];
    let _ = head.header(names[usize::from(pick) % names.len()]);
    let length = head.refusal_length();
    assert!(length <= MAX_REFUSAL as u64);
    let rest = &bytes[len..];
    let body = &rest[..rest.len().min(length as usize)];
    let reason = head.refusal_reason(body);
    assert!(!reason.is_empty());
});
