//! What the QEMU tests share: whether QEMU is here, and the guest image.

use std::process::Command;

use super::BIN;

/// Whether `qemu-system-x86_64` runs here (a test without it is skipped,
/// saying so).
pub fn qemu_installed() -> bool {
    let found = Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("skipped: qemu-system-x86_64 is not installed (Debian: apt-get install qemu-system-x86)");
    }
    found
}

/// The guest image in the shared cache, built on the host if missing.
pub fn guest_image() {
    let out = Command::new(BIN)
        .args(["image", "build", "-o", "json"])
        .output()
        .expect("otherix image build runs");
    assert!(
        out.status.success(),
        "otherix image build: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
