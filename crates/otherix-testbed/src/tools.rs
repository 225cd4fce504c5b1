//! The programs nobody here wrote that the end-to-end tests drive (OpenSSH,
//! curl, python3): found, or a test fails at once naming the package that
//! brings them — not a minute later with a timeout.

use std::path::PathBuf;

/// Where `cmd` is: on `PATH`, or in the sbin directories a non-login
/// shell's `PATH` may lack (`sshd`).
pub fn find(cmd: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(cmd))
        .find(|p| p.is_file())
}

/// Panics at once, naming the Debian package, unless every `(command,
/// package)` is installed.
pub fn require(tools: &[(&str, &str)]) {
    let missing: Vec<String> = tools
        .iter()
        .filter(|(cmd, _)| find(cmd).is_none())
        .map(|(cmd, pkg)| format!("`{cmd}` (Debian package {pkg})"))
        .collect();
    if !missing.is_empty() {
        let packages: Vec<&str> = tools
            .iter()
            .filter(|(cmd, _)| find(cmd).is_none())
            .map(|(_, pkg)| *pkg)
            .collect();
        panic!(
            "this test needs {} which is not installed: apt-get install {}, or run the suite with \
             `sudo .ci/run`, which installs what the tests need",
            missing.join(", "),
            packages.join(" ")
        );
    }
}

/// The Debian package of each program the tests drive.
const PACKAGES: &[(&str, &str)] = &[
    ("curl", "curl"),
    ("python3", "python3"),
    ("ssh", "openssh-client"),
    ("scp", "openssh-client"),
    ("ssh-keygen", "openssh-client"),
    ("sshd", "openssh-server"),
    ("ip", "iproute2"),
    ("bridge", "iproute2"),
    ("nsenter", "util-linux"),
    ("prlimit", "util-linux"),
    ("sha256sum", "coreutils"),
    ("nft", "nftables"),
];

/// Like [`require`] for programs of the table above, by name.
pub fn require_programs(programs: &[&str]) {
    let tools: Vec<(&str, &str)> = programs
        .iter()
        .map(|p| {
            let pkg = PACKAGES.iter().find(|(c, _)| c == p).map_or(*p, |(_, pkg)| *pkg);
            (*p, pkg)
        })
        .collect();
    require(&tools);
}

/// Host and client keys and an `sshd_config` for `sshd -D` in a guest,
/// written to a directory of the test's.
#[derive(Debug, Clone)]
pub struct SshFiles {
    /// The client's private key (`ssh -i`), authorized by the guest's sshd.
    pub client_key: PathBuf,
    pub sshd_config: PathBuf,
    sshd: PathBuf,
}

impl SshFiles {
    /// Makes the keys and the config in `dir`. Panics (naming the package)
    /// without OpenSSH.
    pub fn new(dir: &std::path::Path) -> SshFiles {
        require(&[
            ("ssh", "openssh-client"),
            ("ssh-keygen", "openssh-client"),
            ("sshd", "openssh-server"),
        ]);
        let keygen = |path: &std::path::Path| {
            let out = std::process::Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-C", "otherix-test", "-f"])
                .arg(path)
                .output()
                .expect("ssh-keygen runs");
            assert!(out.status.success(), "ssh-keygen: {out:?}");
        };
        let host_key = dir.join("ssh_host_ed25519_key");
        let client_key = dir.join("client_key");
        keygen(&host_key);
        keygen(&client_key);
        let authorized = dir.join("authorized_keys");
        std::fs::copy(dir.join("client_key.pub"), &authorized).expect("copy the client's public key");
        let sshd_config = dir.join("sshd_config");
        std::fs::write(
            &sshd_config,
            format!(
                "Port 22\n\
                 ListenAddress 0.0.0.0\n\
                 HostKey {}\n\
                 AuthorizedKeysFile {}\n\
                 PermitRootLogin yes\n\
                 PubkeyAuthentication yes\n\
                 PasswordAuthentication no\n\
                 KbdInteractiveAuthentication no\n\
                 UsePAM no\n\
                 StrictModes no\n\
                 PidFile none\n\
                 Subsystem sftp internal-sftp\n",
                host_key.display(),
                authorized.display()
            ),
        )
        .expect("write sshd_config");
        // sshd's privilege separation directory (guests share the host's filesystem).
        std::fs::create_dir_all("/run/sshd").expect("create /run/sshd");
        SshFiles {
            client_key,
            sshd_config,
            sshd: find("sshd").expect("checked above"),
        }
    }

    /// The guest workload: sshd in the foreground, logging to stderr.
    pub fn sshd_exec(&self) -> String {
        format!("{} -D -e -f {}", self.sshd.display(), self.sshd_config.display())
    }
}

/// Every QEMU process running VM `vm_id`: the agent names each
/// `-name ID,process=...`, which `/proc/PID/cmdline` shows.
pub fn qemu_pids(vm_id: &str) -> Vec<u32> {
    let want = format!("{vm_id},process=");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            cmdline
                .split(|&b| b == 0)
                .any(|a| a.starts_with(want.as_bytes()))
                .then_some(pid)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(
        expected = "`otherix-no-such-tool` (Debian package no-such-package) which is not installed: apt-get install no-such-package"
    )]
    fn a_missing_program_fails_at_once_naming_its_package() {
        require(&[("sh", "dash"), ("otherix-no-such-tool", "no-such-package")]);
    }

    #[test]
    fn programs_are_found_in_sbin_too() {
        assert!(find("sh").is_some());
        require_programs(&["sh"]);
    }
}
