//! Fuzzes the relay's one-line handshake between the CP and an agent: the
//! agent reading `RELAY <vm_id> <port>\n` (at most `MAX_LINE` bytes, UTF-8,
//! as its relay endpoint's `read_line` does) and parsing it, and the CP
//! parsing the agent's `OK` / `ERR <reason>` answer. Never a panic; an
//! accepted request names a hex id and a port above 0, and the line the CP
//! writes for it parses back to it. (The parser takes a few spellings the
//! CP never writes: a port with leading zeros or a `+`.)
#![no_main]

use libfuzzer_sys::fuzz_target;
use otherix_proto::relay::{parse_answer_line, parse_request_line, request_line, Answer, MAX_LINE};

/// The agent's `read_line`, over bytes already received: the line without
/// its `\n`, `None` when too long or not UTF-8; nothing when the stream
/// ended first.
fn agent_line(bytes: &[u8]) -> Option<Option<&str>> {
    let mut line_len = 0;
    for &byte in bytes {
        if byte == b'\n' {
            return Some(std::str::from_utf8(&bytes[..line_len]).ok());
        }
        if line_len >= MAX_LINE {
            return Some(None);
        }
        line_len += 1;
    }
    None
}

fuzz_target!(|data: &[u8]| {
    if let Some(Some(line)) = agent_line(data) {
        if let Some((vm_id, port)) = parse_request_line(line) {
            assert!(!vm_id.is_empty() && vm_id.bytes().all(|b| b.is_ascii_hexdigit()));
            assert_ne!(port, 0);
            let written = request_line(vm_id, port);
            assert_eq!(parse_request_line(written.trim_end_matches('\n')), Some((vm_id, port)));
        }
    }
    // The CP reads the answer with `read_line`, bounded by `MAX_LINE`: text.
    let answer = &data[..data.len().min(MAX_LINE)];
    if let Ok(line) = std::str::from_utf8(answer) {
        match parse_answer_line(line) {
            Answer::Ok => assert_eq!(line.trim_end(), "OK"),
            Answer::Err(reason) => {
                assert_ne!(line.trim_end(), "OK");
                assert!(line.contains(reason));
            }
        }
    }
});
