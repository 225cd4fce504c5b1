//! `otherix console VM`: the terminal attached to a QEMU guest's serial
//! console, through the control plane's relay to the guest's node (admin).
//!
//! On a terminal, stdin is put in raw mode (every key goes to the guest,
//! Ctrl-C included) and restored on the way out; Ctrl-] detaches, as in
//! telnet and `virsh console`. From a pipe, what stdin holds is sent, and the
//! command ends once the guest has been quiet for a moment after it.

use std::io::IsTerminal;
use std::time::Duration;

use anyhow::Context;
use otherix_client::tunnel;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::Ctx;

/// The detach key: Ctrl-] (0x1d).
pub const DETACH: u8 = 0x1d;
/// From a pipe: how long the guest may stay quiet after stdin ended.
const QUIET: Duration = Duration::from_secs(2);

pub async fn console(ctx: &Ctx, vm: &str) -> anyhow::Result<()> {
    let client = ctx.client()?;
    let ca_pem = ctx.context()?.1.ca_pem;
    let grant = client
        .console(vm)
        .await
        .with_context(|| format!("cannot open the console of {vm}"))?;
    // The terminal may be in raw mode: each progress line returns the carriage.
    let resume =
        super::connect::resume_with(&client, &ca_pem).map(|r| r.on_event(|e| eprint!("relay: {e}\r\n")));
    let opened = match resume {
        Some(resume) => tunnel::open_brokered_resumable(&grant, client.server(), &ca_pem, &resume).await,
        None => tunnel::open_brokered(&grant, client.server(), &ca_pem).await,
    };
    let tunnel = opened.map_err(|e| anyhow::anyhow!("cannot open the console of {vm}: {e}"))?;
    let tty = std::io::stdin().is_terminal();
    if tty {
        eprintln!("Connected to the serial console of {vm}; Ctrl-] detaches. Press Enter for a prompt.");
    }
    let _raw = tty.then(RawMode::enter).transpose()?;
    let (mut rd, mut wr) = tokio::io::split(tunnel);
    let mut stdin = super::connect::stdin_chunks();
    let mut stdout = tokio::io::stdout();
    let mut buf = vec![0u8; 16 * 1024];
    let mut stdin_open = true;
    loop {
        let quiet = tokio::time::sleep(if stdin_open {
            Duration::from_secs(365 * 86400)
        } else {
            QUIET
        });
        tokio::select! {
            chunk = stdin.recv(), if stdin_open => match chunk {
                Some(chunk) => {
                    let (send, detach) = match chunk.iter().position(|&b| tty && b == DETACH) {
                        Some(at) => (&chunk[..at], true),
                        None => (&chunk[..], false),
                    };
                    wr.write_all(send).await.context("writing to the console")?;
                    wr.flush().await.context("writing to the console")?;
                    if detach {
                        break;
                    }
                }
                None => stdin_open = false,
            },
            n = rd.read(&mut buf) => {
                let n = n.context("reading from the console")?;
                if n == 0 {
                    break;
                }
                stdout.write_all(&buf[..n]).await?;
                stdout.flush().await?;
            }
            () = quiet => break,
        }
    }
    drop(_raw);
    if tty {
        eprintln!("\r\ndetached from the console of {vm}");
    }
    Ok(())
}

/// The terminal in raw mode until dropped.
struct RawMode {
    saved: nix::sys::termios::Termios,
}

impl RawMode {
    fn enter() -> anyhow::Result<RawMode> {
        use nix::sys::termios;
        let stdin = std::io::stdin();
        let saved = termios::tcgetattr(&stdin).context("reading the terminal's settings")?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(&stdin, termios::SetArg::TCSANOW, &raw)
            .context("putting the terminal in raw mode")?;
        Ok(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ =
            nix::sys::termios::tcsetattr(std::io::stdin(), nix::sys::termios::SetArg::TCSANOW, &self.saved);
    }
}
