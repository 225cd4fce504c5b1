//! The system programs the agent runs (`nft`): where they are, and
//! one run with a script on stdin.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

/// Where `name` is: on `PATH`, or in the sbin directories a service's
/// `PATH` may lack.
pub(crate) fn find(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Runs `program` with `args` and, when given, `stdin` written to it,
/// and waits for its output.
pub(crate) fn run(program: &PathBuf, args: &[String], stdin: Option<&str>) -> std::io::Result<Output> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // `nft` reads the whole script before it answers, so
        // writing it all first cannot deadlock on a full stdout pipe.
        pipe.write_all(text.as_bytes())?;
    }
    child.wait_with_output()
}
