//! `otherix image build`: the QEMU runtime's guest image, built from Debian
//! packages on this machine (see `otherix_agent::runtime::qemu::image`).

use std::io::IsTerminal;
use std::time::Instant;

use otherix_agent::runtime::qemu::image;

use crate::cli::{Format, ImageCommand};
use crate::output;

pub async fn run(format: Format, cmd: ImageCommand) -> anyhow::Result<()> {
    match cmd {
        ImageCommand::Build {
            name,
            rebuild,
            cache_dir,
        } => {
            let cache = cache_dir.unwrap_or_else(image::default_cache_dir);
            let started = Instant::now();
            let tty = std::io::stderr().is_terminal();
            // Apt and dpkg block: run them off the async workers.
            let built = tokio::task::spawn_blocking(move || {
                image::build(&cache, &name, rebuild, &mut |step| {
                    if tty || !format.is_data() {
                        eprintln!("{step}...");
                    }
                })
            })
            .await??;
            let summary = serde_json::json!({
                "name": built.name,
                "dir": built.dir,
                "kernel": built.kernel,
                "initrd": built.initrd,
                "kernel_release": built.kernel_release,
            });
            output::done(
                format,
                &summary,
                &format!(
                    "image/{} ready in {} (kernel {}, {:.1}s)",
                    built.name,
                    built.dir.display(),
                    built.kernel_release,
                    started.elapsed().as_secs_f64()
                ),
            )
        }
    }
}
