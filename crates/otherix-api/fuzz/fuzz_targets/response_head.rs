//! Fuzzes the client's reading of a gateway's (or the relay upgrade's)
//! response head, byte by byte as `connect::send_and_read_head` feeds it,
//! then what a refusal is made of: the status, headers, the body length to
//! read and the reason shown to the user. Never a panic; a complete head
//! ends at its blank line within the limit; the body read is bounded.
#![no_main]

use libfuzzer_sys::fuzz_target;
use otherix_api::response_head::{progress, Progress, ResponseHead, MAX_HEAD, MAX_REFUSAL};

fuzz_target!(|data: &[u8]| {
    // The first byte picks a header name to look up, besides the ones the
    // client asks for.
    let Some((&pick, bytes)) = data.split_first() else {
        return;
    };
    // Byte by byte, as the client reads.
    let mut head_len = None;
    for n in 0..=bytes.len() {
        match progress(&bytes[..n]) {
            Progress::Incomplete => {}
            Progress::Complete => {
                head_len = Some(n);
                break;
            }
            Progress::TooLong => {
                assert!(n >= MAX_HEAD);
                return;
            }
        }
    }
    // The connection ended before the head did.
    let Some(head_len) = head_len else {
        return;
    };
    assert!(head_len <= MAX_HEAD && bytes[..head_len].ends_with(b"\r\n\r\n"));
    let head = ResponseHead::parse(&bytes[..head_len]);
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
    let rest = &bytes[head_len..];
    let body = &rest[..rest.len().min(length as usize)];
    let reason = head.refusal_reason(body);
    assert!(!reason.is_empty() || head.status_line().is_empty());
});
