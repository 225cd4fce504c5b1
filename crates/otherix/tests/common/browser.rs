//! A headless Chromium for the web console's browser tests
//! (`web_console_e2e`, `web_terminal_e2e`): Debian's Chromium driven by
//! Playwright for Python (`tests/web_console/driver.py`, in the venv
//! `.ci/web-console-venv` makes under `target/`), in a network namespace
//! of the test's world of its own, without IPv6: in the host's, the
//! interfaces other tests' worlds add and remove make it abort what it is
//! loading (`ERR_NETWORK_CHANGED`), and so would a link-local address
//! settling in its own.
//!
//! `OTHERIX_CONSOLE_SHOTS=DIR` saves a screenshot of each page there (the
//! ones in `docs/console/` were taken so).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use otherix_testbed::{wait_until, World};
use serde_json::{json, Value};

/// How long the browser waits for a page to show something.
pub const SHOW_MS: u64 = 30_000;
pub const CHROMIUM: &str = "/usr/bin/chromium";

/// The driver process and its headless Chromium; killed on drop.
pub struct Browser {
    child: Child,
    /// Closed first on drop: the driver then closes Chromium itself.
    stdin: Option<ChildStdin>,
    out: std::io::Lines<BufReader<ChildStdout>>,
    /// The namespace it runs in: where its connections can be cut.
    pub ns: otherix_testbed::Ns,
}

impl Browser {
    /// The browser, in a namespace `browser` of `world` (see the top).
    pub fn start(world: &World) -> Browser {
        let ns = world
            .add_namespace("browser")
            .expect("a namespace for the browser");
        // No IPv6 there: a link-local address leaving its duplicate check
        // a moment after the link came up is a change too.
        for conf in ["all", "default", "lo"] {
            world
                .exec_ok(
                    &ns,
                    &[
                        "sysctl",
                        "-q",
                        "-w",
                        &format!("net.ipv6.conf.{conf}.disable_ipv6=1"),
                    ],
                )
                .expect("IPv6 off in the browser's namespace");
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
        let python = target.join("web-console/venv/bin/python");
        assert!(
            python.exists() && Path::new(CHROMIUM).exists(),
            "the browser tests need Chromium ({CHROMIUM}: apt-get install chromium) and Playwright \
             ({}: run .ci/web-console-venv)",
            python.display()
        );
        let driver = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/web_console/driver.py");
        let mut child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", ns.name()))
            .arg("--")
            .arg(python)
            .arg(driver)
            .arg(CHROMIUM)
            // Marked as the world's: its teardown ends whatever is left.
            .env(otherix_testbed::WORLD_ENV, world.prefix())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the browser driver starts");
        let stdin = child.stdin.take();
        let out = BufReader::new(child.stdout.take().unwrap()).lines();
        Browser {
            child,
            stdin,
            out,
            ns,
        }
    }

    pub fn call(&mut self, cmd: Value) -> Result<Value, String> {
        let stdin = self.stdin.as_mut().ok_or("the browser driver is closed")?;
        writeln!(stdin, "{cmd}").map_err(|e| format!("the browser driver is gone: {e}"))?;
        let line = self
            .out
            .next()
            .ok_or("the browser driver exited")?
            .map_err(|e| e.to_string())?;
        let answer: Value = serde_json::from_str(&line).map_err(|e| format!("{e}: {line}"))?;
        if answer["ok"] == true {
            Ok(answer["result"].clone())
        } else {
            Err(answer["error"].as_str().unwrap_or("?").to_string())
        }
    }

    /// `cmd` on `page`, which must succeed; a failure says what the page logged.
    pub fn ok(&mut self, page: &str, mut cmd: Value) -> Value {
        cmd["page"] = json!(page);
        match self.call(cmd.clone()) {
            Ok(v) => v,
            Err(e) => {
                let said = self.call(json!({"op": "messages", "page": page}));
                panic!("browser: {cmd} failed: {e}\npage console: {said:?}")
            }
        }
    }

    pub fn open(&mut self, page: &str) {
        self.ok(page, json!({"op": "open", "timeout_ms": SHOW_MS}));
    }

    pub fn goto(&mut self, page: &str, url: &str) -> Value {
        self.ok(page, json!({"op": "goto", "url": url}))
    }

    pub fn fill(&mut self, page: &str, selector: &str, value: &str) {
        self.ok(page, json!({"op": "fill", "selector": selector, "value": value}));
    }

    pub fn click(&mut self, page: &str, selector: &str) {
        self.ok(page, json!({"op": "click", "selector": selector}));
    }

    /// Waits until `selector` holding `text` shows (the page updating itself).
    pub fn shows(&mut self, page: &str, selector: &str, text: &str) {
        self.ok(
            page,
            json!({"op": "wait", "selector": selector, "text": text, "timeout_ms": SHOW_MS}),
        );
    }

    pub fn gone(&mut self, page: &str, selector: &str, text: &str) {
        self.ok(
            page,
            json!({"op": "wait_gone", "selector": selector, "text": text, "timeout_ms": SHOW_MS}),
        );
    }

    pub fn texts(&mut self, page: &str, selector: &str) -> Vec<String> {
        serde_json::from_value(self.ok(page, json!({"op": "texts", "selector": selector}))).unwrap()
    }

    pub fn count(&mut self, page: &str, selector: &str) -> u64 {
        self.ok(page, json!({"op": "count", "selector": selector}))
            .as_u64()
            .unwrap()
    }

    pub fn eval(&mut self, page: &str, js: &str, arg: Value) -> Value {
        self.ok(page, json!({"op": "eval", "js": js, "arg": arg}))
    }

    /// A screenshot of `page` as `docs/console/NAME.png`, when asked for.
    pub fn shot(&mut self, page: &str, name: &str) {
        if let Some(dir) = std::env::var_os("OTHERIX_CONSOLE_SHOTS") {
            let path = PathBuf::from(dir).join(format!("{name}.png"));
            self.ok(page, json!({"op": "screenshot", "path": path}));
        }
    }

    /// Opens `page` on the console and signs in with `token`.
    pub fn sign_in(&mut self, page: &str, url: &str, token: &str) {
        self.open(page);
        self.goto(page, &format!("{url}/ui/"));
        self.shows(page, "#sign-in h1", "Sign in");
        self.fill(page, "#token", token);
        self.click(page, "#sign-in-form button");
        self.shows(page, "body[data-live=on] #who", "(");
    }

    /// Goes to the console page `hash` (`#/vms`) and waits until it shows
    /// its heading and has its data.
    pub fn page(&mut self, page: &str, hash: &str, heading: &str) {
        self.eval(page, "(h) => { location.hash = h; }", json!(hash));
        self.shows(page, "#page h1", heading);
        let name = hash.trim_start_matches("#/");
        self.ok(
            page,
            json!({"op": "wait", "selector": format!("body[data-loaded={name}]"), "timeout_ms": SHOW_MS}),
        );
    }
}

impl Drop for Browser {
    /// The driver closes Chromium (and its helper processes) when its
    /// input ends; one that does not within the wait is killed.
    fn drop(&mut self) {
        drop(self.stdin.take());
        let exited = wait_until("the browser driver to exit", Duration::from_secs(20), || {
            self.child.try_wait().ok().flatten()
        });
        if exited.is_err() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
