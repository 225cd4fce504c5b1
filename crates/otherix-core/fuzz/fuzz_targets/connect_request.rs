//! Fuzzes the gateway's request-head parser: it must never panic, a
//! complete head must lie within the bytes given and the limit, and the
//! scanner the gateway feeds read by read (in chunks of the second byte's
//! size) must answer as the parser does on the whole.
#![no_main]

use libfuzzer_sys::fuzz_target;
use otherix_core::connect::{parse_request, HeadScanner, Parsed, DEFAULT_MAX_HEAD};

fuzz_target!(|data: &[u8]| {
    // The first byte picks a limit, so small limits are explored too.
    let (limit, bytes) = match data.split_first() {
        Some((&b, rest)) => (usize::from(b) * 64 + 1, rest),
        None => (DEFAULT_MAX_HEAD, data),
    };
    let whole = parse_request(bytes, limit);
    if let Ok(Parsed::Complete { head_len, .. }) = &whole {
        assert!(*head_len <= bytes.len() && *head_len <= limit);
        assert!(bytes[..*head_len].ends_with(b"\r\n\r\n"));
    }
    let chunk = usize::from(bytes.first().copied().unwrap_or(1).max(1));
    let mut scanner = HeadScanner::new();
    let mut n = 0;
    let fed = loop {
        n = (n + chunk).min(bytes.len());
        let answer = scanner.feed(&bytes[..n], limit);
        if !matches!(answer, Ok(Parsed::Incomplete)) || n == bytes.len() {
            break answer;
        }
    };
    assert_eq!(fed, whole);
});
