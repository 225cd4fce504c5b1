//! `--watch`: ask again every second and print again when the answer changed.
//!
//! What changed is the data, not its rendering: an AGE column ticking does
//! not redraw. Tables are cleared and redrawn on a terminal; elsewhere each
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
                let now = serde_json::to_value(&value)?;
                if last.as_ref() != Some(&now) {
                    match ctx.format {
                        Format::Json => {
                            if !output::line(&serde_json::to_string(&value)?)? {
                                return Ok(());
                            }
                        }
                        Format::Table if redraw => {
                            // Home, clear the screen: the new version replaces the old.
                            print!("\x1b[H\x1b[2J");
                            show(&value)?;
                        }
                        Format::Table => {
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
