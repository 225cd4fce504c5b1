//! How a failure reads: one `error:` line on stderr saying what failed and
//! why, then a `hint:` line where one helps. Command code puts a hint in its
//! error as a line of its own starting `hint: ` (`bail!("...\nhint: ...")`);
//! errors of the API client get theirs here.

use otherix_client::ClientError;

/// Where a hint starts in an error's text.
const HINT: &str = "\nhint: ";

/// Prints `err` as its `error:` line, and a `hint:` line if it carries one or
/// [`hint_for`] knows one.
pub fn report(err: &anyhow::Error) {
    let (message, hint) = split(err);
    eprintln!("error: {message}");
    if let Some(hint) = hint.or_else(|| hint_for(err)) {
        eprintln!("hint: {hint}");
    }
}

/// What failed and why, on one line, without the hint.
pub fn message(err: &anyhow::Error) -> String {
    split(err).0
}

/// The message on one line (the whole chain of causes), and the hint the
/// error carries, if any.
fn split(err: &anyhow::Error) -> (String, Option<String>) {
    // The chain of causes, each said once: an I/O error wrapped by one that
    // repeats its text ("Connection refused (os error 111): Connection
    // refused (os error 111)") reads as one.
    let mut said: Vec<String> = Vec::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if said.last().is_some_and(|last| last.ends_with(&text)) {
            continue;
        }
        said.push(text);
    }
    let text = said.join(": ");
    let (message, hint) = match text.split_once(HINT) {
        Some((m, h)) => (m, Some(h.to_string())),
        None => (text.as_str(), None),
    };
    (message.replace('\n', " "), hint)
}

/// A hint for the API client's errors a person can do something about.
fn hint_for(err: &anyhow::Error) -> Option<String> {
    let client = err.chain().find_map(|e| e.downcast_ref::<ClientError>())?;
    match client {
        ClientError::Connect { server, .. } => Some(format!("is the control plane running at {server}?")),
        ClientError::Unreachable { .. } => Some(
            "is any of the control plane's replicas running? (`otherix login --server` lists them)".into(),
        ),
        ClientError::Api { code, .. } if code == "unauthenticated" => {
            Some("the token may be revoked or mistyped; log in again with `otherix login`".into())
        }
        ClientError::Api { code, .. } => hint_for_code(code).map(str::to_string),
        _ => None,
    }
}

/// The hint for a refusal's stable code: each has its own remedy.
fn hint_for_code(code: &str) -> Option<&'static str> {
    match code {
        "forbidden" => Some("check your role with `otherix whoami`"),
        "no_access_rule" => Some(
            "an admin can allow it: `otherix user allow USER --selector KEY=VALUE --ports PORT` \
             (`otherix user get USER` lists your rules)",
        ),
        "not_in_grant" => {
            Some("your grant names its targets (`otherix whoami`); ask its issuer for one that includes this")
        }
        "grant_expired" => Some("the grant's time is over; ask its issuer for a new one"),
        "grant_exhausted" => {
            Some("the grant's --max-connections are all used; ask its issuer for a new grant")
        }
        "grant_revoked" => Some("the grant was revoked; ask its issuer whether you should have a new one"),
        "token_expired" => Some(
            "an admin makes a new one (`otherix user token create USER --ttl 30d`) and you log in with it",
        ),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hint_is_cut_from_the_message_which_stays_one_line() {
        let err = anyhow::anyhow!("not logged in\nhint: run `otherix login`").context("listing VMs");
        assert_eq!(
            split(&err),
            (
                "listing VMs: not logged in".to_string(),
                Some("run `otherix login`".to_string())
            )
        );
        let err = anyhow::anyhow!("two\nlines");
        assert_eq!(split(&err), ("two lines".to_string(), None));
    }

    #[test]
    fn a_cause_that_repeats_the_text_above_it_is_said_once() {
        let io = std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "Connection refused (os error 111)",
        );
        #[derive(Debug)]
        struct Wrapped(std::io::Error);
        impl std::fmt::Display for Wrapped {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.fmt(f)
            }
        }
        impl std::error::Error for Wrapped {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let err = anyhow::Error::new(Wrapped(io)).context("cannot reach 10.0.0.1:7443");
        assert_eq!(
            split(&err).0,
            "cannot reach 10.0.0.1:7443: Connection refused (os error 111)"
        );
    }

    #[test]
    fn each_refusal_has_its_own_hint() {
        let codes = [
            "forbidden",
            "no_access_rule",
            "not_in_grant",
            "grant_expired",
            "grant_exhausted",
            "grant_revoked",
            "token_expired",
        ];
        let hints: std::collections::BTreeSet<_> = codes.iter().filter_map(|c| hint_for_code(c)).collect();
        assert_eq!(hints.len(), codes.len(), "{hints:#?}");
        assert!(hint_for_code("grant_expired").unwrap().contains("new one"));
        assert!(hint_for_code("no_access_rule")
            .unwrap()
            .contains("otherix user allow"));
        assert_eq!(hint_for_code("not_found"), None);
    }
}
