//! `--watch`: ask again every second and print again when the answer changed.
//!
//! What changed is the data, not its rendering: an AGE column ticking does
//! not redraw, and neither do the times that move with every heartbeat or
//! probe ([`TICKING`]: a node's last heartbeat, a backend's last probe). Tables are cleared and redrawn on a terminal; elsewhere each
//! new version follows the last after a blank line. `-o json` prints one
//! compact document a line per version.

use std::future::Future;
use std::io::IsTerminal;
use std::time::Duration;

use otherix_client::ClientError;
use serde::Serialize;

use super::Ctx;
use crate::cli::Format;
use crate::output;

/// How often `--watch` and `--follow` ask the control plane.
pub const POLL: Duration = Duration::from_secs(1);

/// Fields that change with every heartbeat or probe while nothing else
/// does: left out when telling whether an answer changed.
pub const TICKING: &[&str] = &["last_heartbeat", "last_probe"];

/// `value` without the [`TICKING`] fields, at any depth.
fn settled(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .filter(|(k, _)| !TICKING.contains(&k.as_str()))
                .map(|(k, v)| (k, settled(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(settled).collect()),
        other => other,
    }
}

/// Polls `fetch` until Ctrl-C (or an error the next poll cannot mend),
/// printing with `show` whenever the answer differs from the last printed.
pub async fn watch<T, F, Fut>(
    ctx: &Ctx,
    mut fetch: F,
    show: impl Fn(&T) -> anyhow::Result<()>,
) -> anyhow::Result<()>
where
    T: Serialize,
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let redraw = std::io::stdout().is_terminal();
    let mut last: Option<serde_json::Value> = None;
    let mut unreachable = false;
    loop {
        match fetch().await {
            Ok(value) => {
                unreachable = false;
                let now = settled(serde_json::to_value(&value)?);
                if last.as_ref() != Some(&now) {
                    match ctx.format {
                        Format::Json => {
                            if !output::line(&serde_json::to_string(&value)?)? {
                                return Ok(());
                            }
                        }
                        // A document per version, as kubectl get -w -o yaml.
                        Format::Yaml => {
                            let doc = output::to_yaml(&serde_json::to_value(&value)?);
                            if !output::line(&format!("---\n{}", doc.trim_end()))? {
                                return Ok(());
                            }
                        }
                        Format::Table | Format::Wide if redraw => {
                            // Home, clear the screen: the new version replaces the old.
                            print!("\x1b[H\x1b[2J");
                            show(&value)?;
                        }
                        Format::Table | Format::Wide => {
                            if last.is_some() && !output::line("")? {
                                return Ok(());
                            }
                            show(&value)?;
                        }
                    }
                    last = Some(now);
                }
            }
            // The first answer must come; after it, a control plane that is
            // briefly away (a restart) is waited for, said once.
            Err(e) if last.is_some() && transient(&e) => {
                if !unreachable {
                    eprintln!("warning: {e:#}; still trying");
                    unreachable = true;
                }
            }
            Err(e) => return Err(e),
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Could asking again help: the control plane did not answer (rather than
/// refused).
pub fn transient(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<ClientError>(),
            Some(ClientError::Connect { .. } | ClientError::Timeout { .. } | ClientError::Unreachable { .. })
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticking_times_are_no_change_and_everything_else_is() {
        let at = |t: &str, health: &str| {
            serde_json::json!({
                "name": "web-lb",
                "backends": [{"vm": "web01", "health": health, "last_probe": t}],
                "nodes": [{"name": "n1", "last_heartbeat": t}],
            })
        };
        assert_eq!(
            settled(at("10:00:01", "healthy")),
            settled(at("10:00:02", "healthy"))
        );
        assert_ne!(
            settled(at("10:00:01", "healthy")),
            settled(at("10:00:02", "unhealthy"))
        );
        assert_eq!(settled(serde_json::json!([1, "x"])), serde_json::json!([1, "x"]));
    }
}
