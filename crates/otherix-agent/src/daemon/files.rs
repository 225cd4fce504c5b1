//! The agent's data directory: atomic writes, and the last desired state.
//!
//! ```text
//! DATA_DIR/            0700
//!   node.key           0600  the node's private key (never leaves the node)
//!   node.crt                 its certificate, signed by the cluster CA at enrollment
//!   ca.crt                   the cluster CA
//!   desired.json             the last desired state the control plane sent
//!   gateway.key        0600  the gateway's serving key (gateway role only)
//!   gateway.crt              its serving certificate (SANs: node name, --gateway IP)
//!   session-keys.json        the session public keys the gateway trusts
//!   gateway-replay.log 0600  credentials the gateway has seen used (`<exp> <jti>`)
//!   guests/{vm_id}.log       each workload's stdout and stderr
//!   guests/{vm_id}.exec      the command a workload was last started with
//! ```
//!
//! Every file is written under a temporary name, synced, then renamed: a crash leaves
//! the old file or the new one, never half of one.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use otherix_proto::agent::DesiredState;

use super::DaemonError;

pub const KEY_FILE: &str = "node.key";
pub const CERT_FILE: &str = "node.crt";
pub const CA_FILE: &str = "ca.crt";
pub const DESIRED_FILE: &str = "desired.json";
pub const GUESTS_DIR: &str = "guests";
pub const GATEWAY_KEY_FILE: &str = "gateway.key";
pub const GATEWAY_CERT_FILE: &str = "gateway.crt";
pub const SESSION_KEYS_FILE: &str = "session-keys.json";
pub const REPLAY_FILE: &str = "gateway-replay.log";

/// Creates `dir` (mode 0700) and its parents if missing.
pub fn ensure_dir(dir: &Path) -> Result<(), DaemonError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| DaemonError::io("create directory", dir, e))
}

/// Writes `bytes` to `path` atomically, with `mode` (applied at creation, so a secret
/// is never readable by others, not even for a moment).
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), DaemonError> {
    let tmp = tmp_path(path);
    let write = || -> io::Result<()> {
        let _ = fs::remove_file(&tmp);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        // Make the rename itself durable.
        if let Some(dir) = path.parent() {
            if let Ok(d) = fs::File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&tmp);
        DaemonError::io("write", path, e)
    })
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Reads a file that may be absent.
pub fn read_optional(path: &Path) -> Result<Option<String>, DaemonError> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(DaemonError::io("read", path, e)),
    }
}

/// The last desired state saved in `dir`, if any. A corrupt file is reported and
/// ignored (the next heartbeat brings a fresh one); it is never fatal.
pub fn load_desired(dir: &Path) -> Option<DesiredState> {
    let path = dir.join(DESIRED_FILE);
    match read_optional(&path) {
        Ok(Some(text)) => match serde_json::from_str(&text) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "ignoring unreadable saved desired state");
                None
            }
        },
        Ok(None) => None,
        Err(e) => {
            tracing::warn!(error = %e, "ignoring unreadable saved desired state");
            None
        }
    }
}

pub fn save_desired(dir: &Path, desired: &DesiredState) -> Result<(), DaemonError> {
    let bytes = serde_json::to_vec_pretty(desired).map_err(|e| DaemonError::io("encode", dir, e.into()))?;
    write_atomic(&dir.join(DESIRED_FILE), &bytes, 0o600)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("otherix-agent-files-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        ensure_dir(&dir).unwrap();
        dir
    }

    #[test]
    fn atomic_write_replaces_content_and_sets_the_mode_without_leftovers() {
        let dir = scratch("atomic");
        let path = dir.join("node.key");
        write_atomic(&path, b"one", 0o600).unwrap();
        write_atomic(&path, b"two", 0o600).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["node.key"]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn desired_state_round_trips_and_a_corrupt_file_is_ignored() {
        let dir = scratch("desired");
        assert_eq!(load_desired(&dir), None);
        let d = DesiredState {
            version: 42,
            node: "n1".into(),
            mtu: 1450,
            ..Default::default()
        };
        save_desired(&dir, &d).unwrap();
        assert_eq!(load_desired(&dir), Some(d));
        fs::write(dir.join(DESIRED_FILE), "{not json").unwrap();
        assert_eq!(load_desired(&dir), None);
        fs::remove_dir_all(&dir).unwrap();
    }
}
