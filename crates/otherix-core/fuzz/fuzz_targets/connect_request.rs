//! Fuzzes the gateway's request-head parser: it must never panic, and a
//! complete head must lie within the bytes given and the limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use otherix_core::connect::{parse_request, Parsed, DEFAULT_MAX_HEAD};

fuzz_target!(|data: &[u8]| {
    // The first byte picks a limit, so small limits are explored too.
    let (limit, bytes) = match data.split_first() {
        Some((&b, rest)) => (usize::from(b) * 64 + 1, rest),
        None => (DEFAULT_MAX_HEAD, data),
    };
    if let Ok(Parsed::Complete { head_len, .. }) = parse_request(bytes, limit) {
        assert!(head_len <= bytes.len() && head_len <= limit);
        assert!(bytes[..head_len].ends_with(b"\r\n\r\n"));
    }
});
