//! `otherix server` and `otherix agent` read their settings from flags, the
//! environment and a TOML config file, in that order of precedence, and refuse a
//! file with an unknown key. Checked with `--print-config`, which starts nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_otherix");

/// `otherix ARGS` with no OTHERIX_* variable but those given.
fn otherix(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    for (k, _) in std::env::vars() {
        if k.starts_with("OTHERIX_") {
            cmd.env_remove(k);
        }
    }
    // The machine's own /etc/otherix files must not leak in: name an empty file.
    cmd.env("OTHERIX_SERVER_CONFIG", "/dev/null")
        .env("OTHERIX_AGENT_CONFIG", "/dev/null");
    cmd.args(args).envs(env.iter().copied()).output().unwrap()
}

/// The settings `--print-config` reports: key → (value, source).
fn effective(args: &[&str], env: &[(&str, &str)]) -> BTreeMap<String, (Value, String)> {
    let out = otherix(args, env);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    json["settings"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                (v["value"].clone(), v["source"].as_str().unwrap().to_owned()),
            )
        })
        .collect()
}

fn setting(s: &BTreeMap<String, (Value, String)>, key: &str) -> (String, String) {
    let (value, source) = &s[key];
    (
        value.as_str().map_or(value.to_string(), str::to_owned),
        source.clone(),
    )
}

struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("otherix-config-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    fn file(&self, name: &str, text: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn flags_beat_environment_beats_file_beats_defaults() {
    let dir = Scratch::new("precedence");
    let file = dir.file(
        "server.toml",
        "listen = \"0.0.0.0:7001\"\nnode_timeout = \"20s\"\noverlay_mtu = 1400\nsan = [\"a.example\", \"b.example\"]\n",
    );
    let s = effective(
        &[
            "server",
            "--config",
            &file,
            "--print-config",
            "--overlay-mtu",
            "1300",
        ],
        &[("OTHERIX_SERVER_NODE_TIMEOUT", "30s")],
    );
    assert_eq!(
        setting(&s, "overlay_mtu"),
        ("1300".into(), "flag".into()),
        "flag over env and file"
    );
    assert_eq!(
        setting(&s, "node_timeout"),
        ("30s".into(), "env".into()),
        "env over file"
    );
    assert_eq!(
        setting(&s, "listen"),
        ("0.0.0.0:7001".into(), "file".into()),
        "file over default"
    );
    assert_eq!(setting(&s, "key_rotation"), ("1h".into(), "default".into()));
    assert_eq!(s["san"].0, serde_json::json!(["a.example", "b.example"]));

    // The file may also be named by the environment; a repeatable flag takes a
    // comma-separated list there.
    let s = effective(
        &["server", "--print-config"],
        &[
            ("OTHERIX_SERVER_CONFIG", &file),
            ("OTHERIX_SERVER_SAN", "c.example,d.example"),
        ],
    );
    assert_eq!(setting(&s, "listen"), ("0.0.0.0:7001".into(), "file".into()));
    assert_eq!(
        s["san"],
        (serde_json::json!(["c.example", "d.example"]), "env".into())
    );
}

#[test]
fn required_agent_settings_may_come_from_the_file_and_the_token_is_not_printed() {
    let dir = Scratch::new("agent");
    let file = dir.file(
        "agent.toml",
        "server = \"https://10.0.0.1:7443\"\nname = \"node1\"\nhypervisor = true\njoin_token = \"otxj_secret\"\n",
    );
    let out = otherix(&["agent", "--config", &file, "--print-config"], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("otxj_secret"), "{text}");
    let s = effective(
        &["agent", "--config", &file, "--print-config", "--name", "node2"],
        &[],
    );
    assert_eq!(setting(&s, "name"), ("node2".into(), "flag".into()));
    // Repeatable (a control plane's replicas): a list, one URL in it.
    assert_eq!(
        s["server"],
        (serde_json::json!(["https://10.0.0.1:7443"]), "file".into())
    );
    assert_eq!(s["hypervisor"], (Value::Bool(true), "file".into()));
    assert_eq!(setting(&s, "join_token"), ("<hidden>".into(), "file".into()));
}

#[test]
fn unknown_key_is_refused_naming_the_key_and_the_file() {
    let dir = Scratch::new("unknown");
    let file = dir.file(
        "server.toml",
        "listen = \"127.0.0.1:7443\"\nlisten_addr = \"0.0.0.0:7443\"\n",
    );
    let out = otherix(&["server", "--config", &file], &[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let first = stderr.lines().next().unwrap();
    assert_eq!(first, format!("error: unknown key `listen_addr` in {file}"));
}

#[test]
fn bad_values_in_the_file_are_refused_naming_the_key_and_the_file() {
    let dir = Scratch::new("bad");
    for (text, key) in [
        ("listen = \"nowhere\"\n", "listen"),
        ("node_cert_validity = \"90d\"\n", "node_cert_validity"),
        ("overlay_mtu = \"big\"\n", "overlay_mtu"),
    ] {
        let file = dir.file("server.toml", text);
        let out = otherix(&["server", "--config", &file, "--print-config"], &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{text}");
        assert!(
            stderr.starts_with(&format!("error: key `{key}` in {file}: ")),
            "{stderr}"
        );
    }
    let file = dir.file("agent.toml", "hypervisor = \"yes\"\n");
    let out = otherix(
        &[
            "agent",
            "--config",
            &file,
            "--server",
            "https://x:1",
            "--name",
            "n",
        ],
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!(
            "error: key `hypervisor` in {file}: expected true or false"
        )),
        "{stderr}"
    );
}

#[test]
fn a_named_config_file_must_exist_but_the_clients_variable_is_not_read() {
    let out = otherix(
        &["server", "--config", "/nonexistent/server.toml", "--print-config"],
        &[],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/server.toml"));
    // OTHERIX_CONFIG names the client's file; the global --config flag shares
    // the server's name, but not its variable.
    let dir = Scratch::new("client");
    let client = dir.file("client.toml", "server = \"https://x\"\n");
    let s = effective(&["server", "--print-config"], &[("OTHERIX_CONFIG", &client)]);
    assert_eq!(setting(&s, "listen").1, "default");
}

/// The shipped config files document every key, and the values they show are
/// the built-in defaults (or, for keys without one, valid examples).
#[test]
fn shipped_config_files_document_every_key_with_its_default() {
    let packaging = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/config");
    let dir = Scratch::new("shipped");
    for role in ["server", "agent"] {
        let shipped = std::fs::read_to_string(packaging.join(format!("{role}.toml"))).unwrap();
        // Commented out as shipped: nothing differs from the defaults.
        let plain = effective(
            &[
                role,
                "--config",
                packaging.join(format!("{role}.toml")).to_str().unwrap(),
                "--print-config",
            ],
            &required(role),
        );
        let documented: String = shipped
            .lines()
            .filter_map(|l| l.strip_prefix("# "))
            .filter(|l| {
                l.split_once(" = ")
                    .is_some_and(|(k, _)| k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            })
            .map(|l| format!("{l}\n"))
            .collect();
        let file = dir.file(&format!("{role}.toml"), &documented);
        let uncommented = effective(&[role, "--config", &file, "--print-config"], &[]);
        assert_eq!(
            plain.keys().collect::<Vec<_>>(),
            uncommented
                .iter()
                .filter(|(_, (_, src))| src == "file")
                .map(|(k, _)| k)
                .collect::<Vec<_>>(),
            "{role}.toml documents exactly the keys"
        );
        for (key, (value, source)) in &plain {
            if source == "default" {
                assert_eq!(
                    &uncommented[key].0, value,
                    "{role}.toml: `{key}` is not shown with its default"
                );
            }
        }
    }
}

/// What the agent cannot start without, so that `--print-config` runs.
fn required(role: &str) -> Vec<(&'static str, &'static str)> {
    match role {
        "agent" => vec![
            ("OTHERIX_AGENT_SERVER", "https://x:1"),
            ("OTHERIX_AGENT_NAME", "n"),
        ],
        _ => vec![],
    }
}
