//! `otherix audit`: the audit trail a page at a time, or followed as it grows.

use std::collections::BTreeSet;
use std::time::Duration;

use otherix_proto::{AuditAction, AuditCursor, AuditRecord, Transport};

use otherix_client::{AuditQuery, Client};

use super::watch::{transient, POLL};
use super::Ctx;
use crate::cli::{AuditArgs, Format};
use crate::output;

impl AuditArgs {
    /// The request for the page after `after` (else `--after`); `extra`
    /// widens the window to cover the time since following began.
    fn query<'a>(&'a self, after: Option<&'a str>, extra: Duration) -> AuditQuery<'a> {
        AuditQuery {
            since_seconds: (self.since + extra).as_secs_f64().ceil() as u64,
            principal: self.principal.as_deref(),
            target: self.target.as_deref(),
            limit: self.limit,
            after: after.or(self.after.as_deref()),
        }
    }

    /// The command that prints the page after `next`.
    fn next_page(&self, next: &str) -> String {
        let mut cmd = format!("otherix audit --after {next}");
        if self.since != Duration::from_secs(86_400) {
            cmd.push_str(&format!(" --since {}", humantime::format_duration(self.since)));
        }
        for (flag, v) in [("--principal", &self.principal), ("--target", &self.target)] {
            if let Some(v) = v {
                cmd.push_str(&format!(" {flag} {}", output::shell_word(v)));
            }
        }
        if let Some(n) = self.limit {
            cmd.push_str(&format!(" --limit {n}"));
        }
        cmd
    }
}

pub async fn run(ctx: &Ctx, args: AuditArgs) -> anyhow::Result<()> {
    let client = ctx.client()?;
    if args.follow {
        return follow(ctx, &client, &args).await;
    }
    let page = client.audit(&args.query(None, Duration::ZERO)).await?;
    output::list(ctx.format, &page.events, &HEADERS, row)?;
    if let Some(next) = &page.next {
        eprintln!(
            "{} events shown; more with `{}`",
            page.events.len(),
            args.next_page(next)
        );
    }
    Ok(())
}

const HEADERS: [&str; 6] = ["TIME", "PRINCIPAL", "ACTION", "TARGET", "RESULT", "DETAIL"];

/// Prints what matches now, then what is recorded later, until Ctrl-C.
async fn follow(ctx: &Ctx, client: &Client, args: &AuditArgs) -> anyhow::Result<()> {
    if !ctx.format.is_data() && !output::line(&fixed_width(&HEADERS.map(String::from)))? {
        return Ok(());
    }
    let mut tail = Tail::default();
    let mut after = args.after.clone();
    // `--since` counts back from when following began, not from each poll:
    // until something is printed, a poll has no cursor to start from.
    let began = std::time::Instant::now();
    let mut unreachable = false;
    loop {
        let page = match client.audit(&args.query(after.as_deref(), began.elapsed())).await {
            Ok(page) => {
                unreachable = false;
                page
            }
            Err(e) => {
                let e = anyhow::Error::from(e);
                if !transient(&e) {
                    return Err(e);
                }
                if !unreachable {
                    eprintln!("warning: {e:#}; still trying");
                    unreachable = true;
                }
                tokio::time::sleep(POLL).await;
                continue;
            }
        };
        for e in page.events.iter().filter(|e| tail.admit(e)) {
            let text = match ctx.format {
                // One event a line, as a log is read (YAML: a document each).
                Format::Json => serde_json::to_string(e)?,
                Format::Yaml => format!("---\n{}", output::to_yaml(&serde_json::to_value(e)?).trim_end()),
                Format::Table | Format::Wide => fixed_width(&row(e)),
            };
            if !output::line(&text)? {
                return Ok(());
            }
        }
        if let Some(next) = page.next {
            after = Some(next);
            continue;
        }
        tokio::time::sleep(POLL).await;
        after = tail
            .resume()
            .map(|c| c.to_string())
            .or_else(|| args.after.clone());
    }
}

/// Records reported up to this long after they happened (a gateway's
/// session reports come with its next heartbeat) are still followed.
const LATE: Duration = Duration::from_secs(10);

/// What `--follow` has printed lately. Each poll reads again from [`LATE`]
/// before the newest record printed, so a record written after newer ones
/// is not skipped, and prints only what it has not printed yet.
#[derive(Debug, Default)]
struct Tail {
    printed: BTreeSet<AuditCursor>,
}

impl Tail {
    /// Whether `e` is new; it counts as printed from now on.
    fn admit(&mut self, e: &AuditRecord) -> bool {
        let key = AuditCursor::after(e);
        let newest = self.printed.last().copied();
        if newest.is_some_and(|n| key.at_ms < n.at_ms - LATE.as_millis() as i64) {
            // Older than anything the next poll reads again: it was read before.
            return false;
        }
        let new = self.printed.insert(key);
        // Forget what no later poll reads again.
        if let Some(n) = self.printed.last() {
            let oldest = AuditCursor {
                at_ms: n.at_ms - LATE.as_millis() as i64,
                id: 0,
            };
            self.printed = self.printed.split_off(&oldest);
        }
        new
    }

    /// Where the next poll starts: [`LATE`] before the newest printed.
    fn resume(&self) -> Option<AuditCursor> {
        self.printed.last().map(|n| AuditCursor {
            at_ms: n.at_ms - LATE.as_millis() as i64,
            id: 0,
        })
    }
}

fn row(e: &AuditRecord) -> Vec<String> {
    let target = match (&e.target, e.port) {
        (Some(t), Some(p)) => format!("{t}:{p}"),
        (Some(t), None) => t.clone(),
        _ => "-".into(),
    };
    let detail = match (e.allowed, e.action) {
        (false, _) => e.reason.clone().unwrap_or_default(),
        (true, AuditAction::SessionEnd) => session_end_detail(e),
        // Enrollments, replacements, node changes, rotations: what happened.
        (
            true,
            AuditAction::NodeEnroll
            | AuditAction::NodeReplace
            | AuditAction::NodeJoinToken
            | AuditAction::NodeUpdate
            | AuditAction::NodeDelete
            | AuditAction::KeyRotate,
        ) => e.reason.clone().unwrap_or_default(),
        (true, _) => [e.transport.map(Transport::as_str), e.node.as_deref()]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(" via "),
    };
    vec![
        output::rfc3339(e.at),
        e.principal.clone(),
        e.action.to_string(),
        target,
        if e.allowed { "allowed" } else { "refused" }.into(),
        detail,
    ]
}

/// A followed row: columns of fixed width, since later rows cannot widen
/// the ones already printed.
fn fixed_width(cells: &[String]) -> String {
    const WIDTHS: [usize; 5] = [24, 20, 14, 22, 8];
    let mut out = String::new();
    for (i, cell) in cells.iter().enumerate() {
        match WIDTHS.get(i) {
            Some(w) => out.push_str(&format!("{cell:<w$}  ")),
            None => out.push_str(cell),
        }
    }
    out.trim_end().to_string()
}

/// `closed after 12.3s, 1.2 KiB up, 5.0 MiB down via gw1`.
fn session_end_detail(e: &AuditRecord) -> String {
    let mut out = e.reason.clone().unwrap_or_else(|| "ended".into());
    if let Some(ms) = e.duration_ms {
        out.push_str(&format!(" after {:.1}s", ms as f64 / 1000.0));
    }
    match (e.bytes_up, e.bytes_down) {
        (Some(up), Some(down)) => out.push_str(&format!(", {} up, {} down", bytes(up), bytes(down))),
        _ => out.push_str(", bytes unknown"),
    }
    if let Some(node) = &e.node {
        out.push_str(&format!(" via {node}"));
    }
    out
}

/// `512 B`, `1.2 KiB`, `5.0 MiB`, `1.1 GiB`.
pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::OffsetDateTime;

    fn at(ms: i64, id: u64) -> AuditRecord {
        AuditRecord {
            id,
            at: OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000).unwrap(),
            principal: "user:a".into(),
            action: AuditAction::Broker,
            target: None,
            port: None,
            transport: None,
            node: None,
            allowed: true,
            reason: None,
            bytes_up: None,
            bytes_down: None,
            duration_ms: None,
            session: None,
        }
    }

    #[test]
    fn a_followed_record_reported_late_is_printed_once_and_nothing_twice() {
        let mut tail = Tail::default();
        assert_eq!(tail.resume(), None);
        assert!(tail.admit(&at(1_000_000, 1)));
        assert!(tail.admit(&at(1_002_000, 2)));
        // The next poll starts LATE before the newest: it reads both again.
        assert_eq!(tail.resume().unwrap().at_ms, 1_002_000 - 10_000);
        assert!(!tail.admit(&at(1_000_000, 1)));
        assert!(!tail.admit(&at(1_002_000, 2)));
        // A gateway's report of a session that started before id 2.
        assert!(tail.admit(&at(1_001_000, 3)));
        assert!(!tail.admit(&at(1_001_000, 3)));
        // Far newer: the old ones are forgotten, and not printed again.
        assert!(tail.admit(&at(1_100_000, 4)));
        assert_eq!(tail.printed.len(), 1);
        assert!(!tail.admit(&at(1_000_000, 1)));
    }

    #[test]
    fn the_next_page_hint_repeats_the_filters() {
        let args = AuditArgs {
            since: Duration::from_secs(3600),
            principal: Some("grant:acme".into()),
            target: Some("it's".into()),
            limit: Some(7),
            after: None,
            follow: false,
        };
        assert_eq!(
            args.next_page("17.3"),
            "otherix audit --after 17.3 --since 1h --principal grant:acme --target 'it'\\''s' --limit 7"
        );
    }

    #[test]
    fn byte_counts_read_like_people_write_them() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(5 << 20), "5.0 MiB");
        assert_eq!(bytes(3 << 40), "3.0 TiB");
    }
}
