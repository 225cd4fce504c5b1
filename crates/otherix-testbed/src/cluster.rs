//! A whole Otherix cluster in a [`World`]: the control plane in its own
//! namespace on the fabric, one namespace per node with its agent inside,
//! and a client config in the host namespace that reaches them all. Used by
//! the end-to-end tests and by `otherix dev`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::{wait_until, Error, Ns, Proc, Result, World};

/// Port the control plane listens on, on its fabric address.
pub const CP_PORT: u16 = 7443;
/// Port gateway nodes serve ingress on.
pub const GATEWAY_PORT: u16 = 8443;

/// What to build.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// The `otherix` binary.
    pub bin: PathBuf,
    /// Hypervisor nodes, named `node1`, `node2`, ...
    pub hypervisors: usize,
    /// Standalone gateway nodes, named `gw1`, ...
    pub gateways: usize,
    /// Where the admin's client config goes [default: `{world dir}/admin.toml`].
    pub config: Option<PathBuf>,
    /// Where the CP's and agents' data directories go [default: the world dir].
    pub state_dir: Option<PathBuf>,
    /// Agents' heartbeat interval.
    pub heartbeat: Duration,
    /// The CP marks a node NotReady after this long without a heartbeat.
    pub node_timeout: Duration,
    /// More arguments for `otherix server` (e.g. `--key-rotation 20s`).
    pub extra_server_args: Vec<String>,
    /// More arguments for every `otherix agent` (e.g. `--metrics-listen ...`).
    pub extra_agent_args: Vec<String>,
}

impl ClusterSpec {
    pub fn new(bin: impl Into<PathBuf>) -> ClusterSpec {
        ClusterSpec {
            bin: bin.into(),
            hypervisors: 2,
            gateways: 1,
            config: None,
            state_dir: None,
            heartbeat: Duration::from_secs(1),
            node_timeout: Duration::from_secs(5),
            extra_server_args: Vec::new(),
            extra_agent_args: Vec::new(),
        }
    }
}

/// One node: its namespace and its agent.
#[derive(Debug)]
pub struct Node {
    pub name: String,
    pub ns: Ns,
    pub gateway: bool,
    pub data_dir: PathBuf,
    pub agent: Option<Proc>,
}

/// A running cluster. Dropping it stops every process and tears the world down.
#[derive(Debug)]
pub struct Cluster {
    pub spec: ClusterSpec,
    pub cp_ns: Ns,
    pub cp: Option<Proc>,
    pub url: String,
    pub config: PathBuf,
    pub nodes: Vec<Node>,
    // Last: dropped after the processes above.
    pub world: World,
}

impl Cluster {
    /// Starts the CP, logs in as admin, enrolls and starts every agent, and
    /// waits until every node is Ready.
    pub fn start(world: World, spec: ClusterSpec) -> Result<Cluster> {
        let cp_ns = world.add_namespace("cp")?;
        let url = format!("https://{}:{CP_PORT}", cp_ns.ip());
        let config = spec
            .config
            .clone()
            .unwrap_or_else(|| world.dir().join("admin.toml"));
        let mut cluster = Cluster {
            cp_ns,
            cp: None,
            url,
            config,
            nodes: Vec::new(),
            spec,
            world,
        };
        cluster.start_cp()?;
        cluster.cli_ok(&[
            "login",
            "--server",
            &cluster.url,
            "--token-file",
            &cluster.cp_dir().join("admin.token").to_string_lossy(),
            "--ca-file",
            &cluster.ca_file().to_string_lossy(),
        ])?;
        let names: Vec<(String, bool)> = (1..=cluster.spec.hypervisors)
            .map(|i| (format!("node{i}"), false))
            .chain((1..=cluster.spec.gateways).map(|i| (format!("gw{i}"), true)))
            .collect();
        for (name, gateway) in names {
            let ns = cluster.world.add_namespace(&name)?;
            cluster.nodes.push(Node {
                data_dir: cluster.state_dir().join(&name),
                name,
                ns,
                gateway,
                agent: None,
            });
        }
        for i in 0..cluster.nodes.len() {
            let name = cluster.nodes[i].name.clone();
            cluster.start_agent(&name)?;
        }
        cluster.wait_ready(Duration::from_secs(60))?;
        Ok(cluster)
    }

    /// Base of the CP's and agents' data directories.
    pub fn state_dir(&self) -> PathBuf {
        self.spec
            .state_dir
            .clone()
            .unwrap_or_else(|| self.world.dir().to_path_buf())
    }

    pub fn cp_dir(&self) -> PathBuf {
        self.state_dir().join("cp")
    }

    pub fn ca_file(&self) -> PathBuf {
        self.cp_dir().join("ca.crt")
    }

    /// Starts (or restarts) the control plane process.
    pub fn start_cp(&mut self) -> Result<()> {
        let dir = self.cp_dir();
        let listen = format!("{}:{CP_PORT}", self.cp_ns.ip());
        let timeout = format!("{}ms", self.spec.node_timeout.as_millis());
        let mut args: Vec<String> = vec![
            "server".into(),
            "--data-dir".into(),
            dir.to_string_lossy().into_owned(),
            "--listen".into(),
            listen,
            "--node-timeout".into(),
            timeout,
        ];
        args.extend(self.spec.extra_server_args.iter().cloned());
        let proc = self
            .world
            .spawn(Some(&self.cp_ns), &self.spec.bin, &args, &[("RUST_LOG", "info")])?;
        proc.wait_for_log("log in with", Duration::from_secs(30))?;
        self.cp = Some(proc);
        Ok(())
    }

    /// SIGKILLs the control plane.
    pub fn kill_cp(&mut self) -> Result<()> {
        if let Some(p) = self.cp.take() {
            p.kill()?;
        }
        Ok(())
    }

    pub fn node(&self, name: &str) -> Result<&Node> {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .ok_or_else(|| Error::Cluster(format!("no node {name:?} in this cluster")))
    }

    fn node_mut(&mut self, name: &str) -> Result<&mut Node> {
        self.nodes
            .iter_mut()
            .find(|n| n.name == name)
            .ok_or_else(|| Error::Cluster(format!("no node {name:?} in this cluster")))
    }

    /// Starts a node's agent; the first start enrolls with a fresh join token.
    pub fn start_agent(&mut self, name: &str) -> Result<()> {
        self.start_agent_with(name, &[])
    }

    /// [`Cluster::start_agent`] with more arguments for `otherix agent`
    /// (e.g. `--relay-listen ...`).
    pub fn start_agent_with(&mut self, name: &str, extra: &[&str]) -> Result<()> {
        let (ns, gateway, data_dir) = {
            let n = self.node(name)?;
            (n.ns.clone(), n.gateway, n.data_dir.clone())
        };
        let mut args: Vec<String> = vec![
            "agent".into(),
            "--server".into(),
            self.url.clone(),
            "--ca-file".into(),
            self.ca_file().to_string_lossy().into_owned(),
            "--name".into(),
            name.into(),
            "--data-dir".into(),
            data_dir.to_string_lossy().into_owned(),
            "--netns-prefix".into(),
            self.world.guest_netns_prefix(),
            "--heartbeat-interval".into(),
            format!("{}ms", self.spec.heartbeat.as_millis()),
        ];
        // The token grants the roles; the agent runs what was granted.
        if !data_dir.join("node.crt").exists() {
            let gateway_addr = format!("{}:{GATEWAY_PORT}", ns.ip());
            let mut create = vec!["node", "join-token", "create", "--name", name, "--ttl", "10m"];
            if gateway {
                create.extend(["--gateway", gateway_addr.as_str()]);
            } else {
                create.push("--hypervisor");
            }
            let token = self.cli_ok(&create)?;
            args.push("--join-token".into());
            args.push(token.trim().to_string());
        }
        args.extend(self.spec.extra_agent_args.iter().cloned());
        args.extend(extra.iter().map(|a| a.to_string()));
        let proc = self
            .world
            .spawn(Some(&ns), &self.spec.bin, &args, &[("RUST_LOG", "info")])?;
        self.node_mut(name)?.agent = Some(proc);
        Ok(())
    }

    /// SIGKILLs a node's agent (its guests keep running).
    pub fn kill_agent(&mut self, name: &str) -> Result<()> {
        if let Some(p) = self.node_mut(name)?.agent.take() {
            p.kill()?;
        }
        Ok(())
    }

    /// Runs the CLI in the host namespace with the admin's config.
    pub fn cli(&self, args: &[&str]) -> Result<Output> {
        Command::new(&self.spec.bin)
            .args(args)
            .env("OTHERIX_CONFIG", &self.config)
            .env_remove("OTHERIX_TOKEN")
            .env_remove("RUST_LOG")
            .output()
            .map_err(|e| Error::Cluster(format!("cannot run {}: {e}", self.spec.bin.display())))
    }

    /// Runs the CLI and returns stdout, or an error with stderr.
    pub fn cli_ok(&self, args: &[&str]) -> Result<String> {
        let out = self.cli(args)?;
        if !out.status.success() {
            return Err(Error::Cluster(format!(
                "otherix {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `otherix forward TARGET PORT` in the host namespace with the admin's
    /// config (logging at info): the process and the local address it
    /// printed, once it listens.
    pub fn forward(&self, target: &str, port: u16) -> Result<(Proc, SocketAddr)> {
        self.forward_with(target, port, &[])
    }

    /// [`Cluster::forward`] with more options (`--ready 0`, ...).
    pub fn forward_with(&self, target: &str, port: u16, options: &[&str]) -> Result<(Proc, SocketAddr)> {
        let config = self.config.to_string_lossy().into_owned();
        let port = port.to_string();
        let mut args = vec!["forward", target, &port];
        args.extend_from_slice(options);
        let p = self.world.spawn(
            None,
            &self.spec.bin,
            args,
            &[("OTHERIX_CONFIG", &config), ("RUST_LOG", "info")],
        )?;
        p.wait_for_log("Forwarding", Duration::from_secs(60))?;
        let addr = p
            .log()
            .lines()
            .find_map(|l| l.trim().parse::<SocketAddr>().ok())
            .ok_or_else(|| {
                Error::Cluster(format!(
                    "otherix forward {target} {port} printed no local address"
                ))
            })?;
        Ok((p, addr))
    }

    /// `-o json` output, parsed.
    pub fn cli_json(&self, args: &[&str]) -> Result<serde_json::Value> {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let text = self.cli_ok(&all)?;
        serde_json::from_str(&text)
            .map_err(|e| Error::Cluster(format!("otherix {}: invalid JSON: {e}", args.join(" "))))
    }

    /// Waits until every node of the cluster is Ready.
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let names: Vec<String> = self.nodes.iter().map(|n| n.name.clone()).collect();
        wait_until("every node to be Ready", timeout, || {
            let nodes = self.cli_json(&["node", "list"]).ok()?;
            let ready = names.iter().all(|name| {
                nodes.as_array().is_some_and(|a| {
                    a.iter()
                        .any(|n| n["name"] == name.as_str() && n["status"] == "Ready")
                })
            });
            ready.then_some(())
        })
    }

    /// Waits until `vm` is `running` and returns its JSON.
    pub fn wait_vm_running(&self, vm: &str, timeout: Duration) -> Result<serde_json::Value> {
        wait_until(&format!("vm {vm} to be running"), timeout, || {
            let v = self.cli_json(&["vm", "get", vm]).ok()?;
            (v["state"] == "running").then_some(v)
        })
    }

    /// Runs `argv` inside node `name`'s namespace.
    pub fn exec_on(&self, name: &str, argv: &[&str]) -> Result<Output> {
        self.world.exec(&self.node(name)?.ns, argv)
    }

    pub fn world_dir(&self) -> &Path {
        self.world.dir()
    }
}
