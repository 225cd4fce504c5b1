//! Contexts, as kubectl has them: every `otherix login` is a named context
//! in the client config; `otherix context` lists, switches, renames and
//! deletes them; `--context` / `OTHERIX_CONTEXT` picks one for a single
//! command; a config of the older single-login format still works. Against
//! real control planes, with the config where people have it
//! (`$XDG_CONFIG_HOME/otherix/config.toml`).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{Cp, TempDir, BIN};
use serde_json::Value;

/// The CLI of someone whose config is in `$XDG_CONFIG_HOME` (a temp dir).
struct User {
    home: TempDir,
}

impl User {
    fn new() -> User {
        User {
            home: TempDir::new("contexts"),
        }
    }

    fn config(&self) -> PathBuf {
        self.home.path().join("otherix").join("config.toml")
    }

    fn run_env(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = Command::new(BIN);
        for (k, _) in std::env::vars() {
            if k.starts_with("OTHERIX_") {
                cmd.env_remove(k);
            }
        }
        cmd.args(args)
            .env("XDG_CONFIG_HOME", self.home.path())
            .env_remove("RUST_LOG")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .expect("run otherix")
    }

    fn ok_env(&self, args: &[&str], env: &[(&str, &str)]) -> String {
        let out = self.run_env(args, env);
        assert!(
            out.status.success(),
            "otherix {args:?} failed:\nstdout: {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn ok(&self, args: &[&str]) -> String {
        self.ok_env(args, &[])
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        serde_json::from_str(&self.ok(&all)).expect("JSON on stdout")
    }

    /// Runs, expecting exit 1, nothing on stdout and one `error:` line
    /// (and at most a `hint:` line after it); returns the error line.
    fn fails(&self, args: &[&str]) -> String {
        let out = self.run_env(args, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(1), "otherix {args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "otherix {args:?} printed {:?}", out.stdout);
        let lines: Vec<&str> = stderr.lines().collect();
        assert!(lines[0].starts_with("error: "), "{stderr}");
        assert!(
            lines.len() == 1 || (lines.len() == 2 && lines[1].starts_with("hint: ")),
            "one error line, maybe a hint: {stderr}"
        );
        lines[0].to_string()
    }

    /// `otherix login` to `cp` as its admin, with more arguments (`--name`).
    fn login(&self, cp: &Cp, more: &[&str]) -> Value {
        let token = cp.admin_token_file();
        let mut args = vec![
            "login",
            "--server",
            &cp.url,
            "--token-file",
            token.to_str().unwrap(),
            "--ca-fingerprint",
            &cp.fingerprint,
        ];
        args.extend_from_slice(more);
        self.json(&args)
    }

    /// The URL of the control plane `otherix version` asks, with `args` before.
    fn server_asked(&self, args: &[&str], env: &[(&str, &str)]) -> String {
        let mut all = args.to_vec();
        all.extend(["version", "-o", "json"]);
        let v: Value = serde_json::from_str(&self.ok_env(&all, env)).unwrap();
        v["server"]["url"]
            .as_str()
            .expect("the server answered")
            .to_string()
    }

    fn current(&self) -> String {
        self.ok(&["context", "current"]).trim().to_string()
    }
}

/// The `NAME` column of `context list`'s rows, with `*` for the current one.
fn listed(table: &str) -> Vec<String> {
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["CURRENT", "NAME", "SERVER", "TOKEN"], "{table}");
    lines
        .map(|l| {
            let cells: Vec<&str> = l.split_whitespace().collect();
            match cells.as_slice() {
                ["*", name, ..] => format!("*{name}"),
                [name, ..] => name.to_string(),
                [] => panic!("an empty row: {table}"),
            }
        })
        .collect()
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn each_login_is_a_context_and_use_switches_the_server_commands_talk_to() {
    let one = Cp::start();
    let two = Cp::start();
    let user = User::new();

    // No --name: named after the host and (not the usual 7443) port.
    let first = user.login(&one, &[]);
    let port = one.url.rsplit(':').next().unwrap();
    let derived = format!("127.0.0.1:{port}");
    assert_eq!(first["context"], derived.as_str(), "{first}");
    assert_eq!(first["current"], true);
    assert_eq!(mode(&user.config()), 0o600, "it holds a token");
    user.ok(&["context", "rename", &derived, "one"]);
    assert_eq!(user.current(), "one", "the current context keeps being current");

    let second = user.login(&two, &["--name", "two"]);
    assert_eq!(second["context"], "two");
    assert_eq!(listed(&user.ok(&["context", "list"])), ["one", "*two"]);
    let list = user.json(&["context", "list"]);
    assert_eq!(list.as_array().unwrap().len(), 2, "{list}");
    assert_eq!(list[0]["name"], "one");
    assert_eq!(list[0]["current"], false);
    assert_eq!(list[0]["servers"], serde_json::json!([one.url]));
    assert_eq!(list[0]["ca_fingerprint"], one.fingerprint.as_str());
    assert_eq!(list[1]["current"], true);
    assert!(!list.to_string().contains("otx_"), "no token is printed: {list}");
    assert_eq!(user.server_asked(&[], &[]), two.url);

    let switched = user.ok(&["context", "use", "one"]);
    assert_eq!(switched.trim(), "Switched to context \"one\".");
    assert_eq!(user.server_asked(&[], &[]), one.url);
    assert_eq!(
        user.ok(&["whoami"])
            .lines()
            .find(|l| l.starts_with("Server:"))
            .unwrap()
            .split_whitespace()
            .last(),
        Some(one.url.as_str())
    );

    // For one command only: the flag, or the environment.
    assert_eq!(user.server_asked(&["--context", "two"], &[]), two.url);
    assert_eq!(user.server_asked(&[], &[("OTHERIX_CONTEXT", "two")]), two.url);
    assert_eq!(user.current(), "one", "--context changes nothing");
    // ssh runs the ProxyCommand later: it names the context it was made with.
    let stanza = user.ok(&["--context", "two", "ssh-config"]);
    assert!(stanza.contains(" --context two connect %h %p"), "{stanza}");

    // Logging in again to the same server updates its context, made current.
    user.ok(&["context", "use", "two"]);
    let again = user.login(&one, &[]);
    assert_eq!(again["context"], "one", "{again}");
    assert_eq!(listed(&user.ok(&["context", "list"])), ["*one", "two"]);
}

#[test]
fn logout_forgets_only_the_token_of_its_context() {
    let one = Cp::start();
    let two = Cp::start();
    let user = User::new();
    user.login(&one, &["--name", "one"]);
    user.login(&two, &["--name", "two"]);

    let out = user.run_env(&["logout", "--context", "one"], &[]);
    assert!(out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains(&format!("logged out of {} (context \"one\")", one.url)),
        "{said}"
    );
    let list = user.json(&["context", "list"]);
    assert_eq!(list[0]["token"], false, "{list}");
    assert_eq!(list[1]["token"], true, "{list}");
    assert_eq!(user.current(), "two");
    user.ok(&["whoami"]);

    let err = user.fails(&["--context", "one", "vm", "list"]);
    assert!(err.contains("not logged in to context \"one\""), "{err}");
    // The server is still known: `version` needs no token.
    assert_eq!(user.server_asked(&["--context", "one"], &[]), one.url);
    // Twice is fine.
    let out = user.run_env(&["logout", "--context", "one"], &[]);
    assert!(out.status.success(), "{out:?}");
    // Logging in again puts a token back in the same context.
    user.login(&one, &["--name", "one"]);
    user.ok(&["--context", "one", "vm", "list"]);
    assert_eq!(user.current(), "one");

    // `--context` on login saves there, for this command only: the current
    // context stays current.
    let token = two.admin_token_file();
    let elsewhere = user.json(&[
        "--context",
        "three",
        "login",
        "--server",
        &two.url,
        "--token-file",
        token.to_str().unwrap(),
        "--ca-fingerprint",
        &two.fingerprint,
    ]);
    assert_eq!(elsewhere["context"], "three", "{elsewhere}");
    assert_eq!(elsewhere["current"], false, "{elsewhere}");
    assert_eq!(listed(&user.ok(&["context", "list"])), ["*one", "three", "two"]);
}

#[test]
fn rename_and_delete_keep_the_current_context_straight_and_unknown_names_are_one_line_errors() {
    let cp = Cp::start();
    let user = User::new();
    user.login(&cp, &["--name", "a"]);
    user.login(&cp, &["--name", "b"]);
    assert_eq!(user.current(), "b");

    for args in [
        &["context", "use", "nope"][..],
        &["context", "rename", "nope", "c"],
        &["context", "delete", "nope"],
        &["--context", "nope", "vm", "list"],
        &["--context", "nope", "logout"],
    ] {
        let err = user.fails(args);
        assert!(
            err.starts_with("error: no context \"nope\" in ") && err.contains("config.toml"),
            "{args:?}: {err}"
        );
    }
    let err = user.fails(&["context", "rename", "a", "b"]);
    assert!(
        err.starts_with("error: there is a context \"b\" already"),
        "{err}"
    );
    let out = user.run_env(&["context", "rename", "a", "bad name"], &[]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a name that cannot be is a usage error"
    );

    let renamed = user.json(&["context", "rename", "b", "c"]);
    assert_eq!(renamed, serde_json::json!({"context": "c", "current": true}));
    assert_eq!(listed(&user.ok(&["context", "list"])), ["a", "*c"]);

    // Deleting the current context leaves none current, and says so.
    let out = user.run_env(&["context", "delete", "c"], &[]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "context/c deleted");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("no context is current now"), "{said}");
    assert_eq!(listed(&user.ok(&["context", "list"])), ["a"]);
    let err = user.fails(&["vm", "list"]);
    assert!(err.starts_with("error: no current context in "), "{err}");
    user.ok(&["--context", "a", "vm", "list"]);
    let deleted = user.json(&["context", "delete", "a"]);
    assert_eq!(
        deleted["deleted"],
        serde_json::json!({"kind": "context", "name": "a"})
    );
    assert_eq!(user.json(&["context", "list"]), serde_json::json!([]));
    let err = user.fails(&["vm", "list"]);
    assert!(err.starts_with("error: not logged in: no context in "), "{err}");
    std::fs::remove_file(user.config()).unwrap();
    assert_eq!(
        user.json(&["context", "list"]),
        serde_json::json!([]),
        "no config: no contexts"
    );
}

#[test]
fn a_single_login_config_is_read_as_the_default_context_and_migrated_by_the_next_login() {
    let cp = Cp::start();
    let user = User::new();
    let token = std::fs::read_to_string(cp.admin_token_file()).unwrap();
    std::fs::create_dir_all(user.config().parent().unwrap()).unwrap();
    // What `otherix login` wrote before there were contexts.
    let old = format!(
        "server = {:?}\nca_fingerprint = {:?}\nca_pem = {:?}\ntoken = {:?}\n",
        cp.url,
        cp.fingerprint,
        cp.ca_pem(),
        token.trim()
    );
    std::fs::write(user.config(), &old).unwrap();

    assert_eq!(user.server_asked(&[], &[]), cp.url);
    user.ok(&["whoami"]);
    assert_eq!(listed(&user.ok(&["context", "list"])), ["*default"]);
    assert_eq!(
        std::fs::read_to_string(user.config()).unwrap(),
        old,
        "reading changes nothing"
    );

    // Logging in again to that server updates `default`, in the new format.
    let again = user.login(&cp, &[]);
    assert_eq!(again["context"], "default", "{again}");
    let text = std::fs::read_to_string(user.config()).unwrap();
    assert!(text.contains("current_context = \"default\""), "{text}");
    assert!(text.contains("[contexts.default]"), "{text}");
    assert_eq!(mode(&user.config()), 0o600);
    user.ok(&["whoami"]);
}
