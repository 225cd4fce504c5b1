//! Running the `nft` tool (Debian package `nftables`) in the agent's namespace.
//!
//! The agent applies whole scripts with `nft -f -` (one kernel transaction each)
//! and reads its table back with `nft list`. A named namespace (tests, where every
//! node is one) is entered the way the netlink layer enters one: `nft` is started
//! from a thread that has `setns`-ed into it, and a child inherits the namespace of
//! the thread that forked it ([`Netns::run`]).

use std::process::Output;

use crate::net::Netns;

/// The longest piece of `nft`'s own output kept in an error: its messages quote
/// the script, which is long.
const MAX_MESSAGE: usize = 512;

/// Why `nft` did not do what was asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NftError {
    /// Host: the tool is not installed.
    #[error("the nft tool is not installed (Debian package nftables)")]
    NotInstalled,
    /// Host: the agent's namespace cannot be entered, or the tool not started.
    #[error("cannot run nft{}: {reason}", in_netns(.netns))]
    Spawn { netns: Option<String>, reason: String },
    /// The kernel or the tool refused; `message` is its output, escaped and cut.
    #[error("nft {what}{} failed: {message}", in_netns(.netns))]
    Refused {
        what: &'static str,
        netns: Option<String>,
        message: String,
    },
}

fn in_netns(netns: &Option<String>) -> String {
    netns
        .as_ref()
        .map(|n| format!(" in netns {n}"))
        .unwrap_or_default()
}

/// `nft` in one network namespace: the caller's, or a named one.
#[derive(Clone, Debug)]
pub struct Nft {
    netns: Option<String>,
}

impl Nft {
    pub fn new(netns: Option<String>) -> Nft {
        Nft { netns }
    }

    /// Applies `script` as one transaction (`nft -f -`).
    pub async fn apply(&self, what: &'static str, script: String) -> Result<(), NftError> {
        let out = self.run(vec!["-f".into(), "-".into()], Some(script)).await?;
        self.check(what, &out)?;
        Ok(())
    }

    /// What `nft args` prints, or `Ok(None)` when it says the object does not
    /// exist.
    pub async fn list(&self, what: &'static str, args: &[&str]) -> Result<Option<String>, NftError> {
        let out = self
            .run(args.iter().map(|a| (*a).to_owned()).collect(), None)
            .await?;
        if !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("No such file or directory")
        {
            return Ok(None);
        }
        self.check(what, &out)?;
        Ok(Some(String::from_utf8_lossy(&out.stdout).into_owned()))
    }

    fn check(&self, what: &'static str, out: &Output) -> Result<(), NftError> {
        if out.status.success() {
            return Ok(());
        }
        let text = String::from_utf8_lossy(&out.stderr);
        Err(NftError::Refused {
            what,
            netns: self.netns.clone(),
            message: bounded(&text),
        })
    }

    async fn run(&self, args: Vec<String>, stdin: Option<String>) -> Result<Output, NftError> {
        let program = crate::program::find("nft").ok_or(NftError::NotInstalled)?;
        let netns = self.netns.clone();
        let spawn_err = |netns: &Option<String>, reason: String| NftError::Spawn {
            netns: netns.clone(),
            reason,
        };
        tokio::task::spawn_blocking(move || {
            let run = || crate::program::run(&program, &args, stdin.as_deref());
            let out = match &netns {
                None => run(),
                Some(name) => Netns::open(name)
                    .and_then(|ns| ns.run(run))
                    .map_err(|e| std::io::Error::other(e.to_string()))
                    .and_then(|r| r),
            };
            out.map_err(|e| spawn_err(&netns, e.to_string()))
        })
        .await
        .map_err(|e| spawn_err(&self.netns, e.to_string()))?
    }
}

/// `text` on one line, control characters escaped, at most [`MAX_MESSAGE`] bytes.
fn bounded(text: &str) -> String {
    let escaped: String = text.trim().chars().flat_map(char::escape_default).collect();
    if escaped.len() <= MAX_MESSAGE {
        return escaped;
    }
    let mut end = MAX_MESSAGE;
    while !escaped.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &escaped[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nfts_messages_are_kept_on_one_escaped_bounded_line() {
        assert_eq!(bounded("Error: x\n\x1b[31mline\n"), "Error: x\\n\\u{1b}[31mline");
        let long = "é".repeat(1000);
        let b = bounded(&long);
        assert!(b.len() <= MAX_MESSAGE + 3 && b.ends_with("..."), "{}", b.len());
    }
}
