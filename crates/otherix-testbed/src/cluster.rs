//! A whole Otherix cluster in a [`World`]: the control plane in its own
//! namespace on the fabric, one namespace per node with its agent inside,
//! and a client config in the host namespace that reaches them all. Used by
//! the end-to-end tests and by `otherix dev`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::postgres::Postgres;
use crate::{wait_until, Error, Ns, Proc, Result, World};

/// Port the control plane listens on, on its fabric address.
pub const CP_PORT: u16 = 7443;
/// Port gateway nodes serve ingress on.
pub const GATEWAY_PORT: u16 = 8443;
/// Port control planes serve `/metrics` on, with [`ClusterSpec::metrics`].
pub const CP_METRICS_PORT: u16 = 9464;
/// Port agents serve `/metrics` on, with [`ClusterSpec::metrics`].
pub const AGENT_METRICS_PORT: u16 = 9465;

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
    /// The context the admin logs in as, made current, and the one
    /// [`Cluster::cli`] uses [default: the name `otherix login` derives].
    pub context: Option<String>,
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
    /// Control-plane replicas. One keeps the embedded SQLite store (unless
    /// `postgres`); more share a PostgreSQL server the cluster starts in
    /// its state directory, each in a namespace of its own (`cp`, `cp2`,
    /// ...) with the first one's secret key.
    pub replicas: usize,
    /// The store on PostgreSQL even with one replica [default: whether
    /// [`crate::STORE_ENV`] says `postgres`].
    pub postgres: bool,
    /// Every control plane and agent serves `/metrics`, `/healthz` and
    /// `/readyz` on its fabric address ([`CP_METRICS_PORT`],
    /// [`AGENT_METRICS_PORT`]; see [`Cluster::metrics_urls`]).
    pub metrics: bool,
}

impl ClusterSpec {
    pub fn new(bin: impl Into<PathBuf>) -> ClusterSpec {
        ClusterSpec {
            bin: bin.into(),
            hypervisors: 2,
            gateways: 1,
            config: None,
            context: None,
            state_dir: None,
            heartbeat: Duration::from_secs(1),
            node_timeout: Duration::from_secs(5),
            extra_server_args: Vec::new(),
            extra_agent_args: Vec::new(),
            replicas: 1,
            postgres: crate::store_on_postgres(),
            metrics: false,
        }
    }

    fn on_postgres(&self) -> bool {
        self.postgres || self.replicas > 1
    }
}

/// One control-plane replica: its namespace, process and data directory.
#[derive(Debug)]
pub struct ControlPlane {
    /// `cp`, `cp2`, ...: its namespace's role and its data directory's name.
    pub name: String,
    pub ns: Ns,
    pub proc: Option<Proc>,
    pub url: String,
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
    /// The control planes; the first is the one a single-replica cluster has.
    pub cps: Vec<ControlPlane>,
    /// The first control plane's URL.
    pub url: String,
    pub config: PathBuf,
    pub nodes: Vec<Node>,
    /// The store's server, when it is PostgreSQL (after the processes that
    /// use it, before the world).
    pub postgres: Option<Postgres>,
    // Last: dropped after the processes above.
    pub world: World,
}

impl Cluster {
    /// Starts the CP, logs in as admin, enrolls and starts every agent, and
    /// waits until every node is Ready.
    pub fn start(world: World, spec: ClusterSpec) -> Result<Cluster> {
        let mut cps = Vec::new();
        for i in 1..=spec.replicas.max(1) {
            let name = if i == 1 {
                "cp".to_string()
            } else {
                format!("cp{i}")
            };
            let ns = world.add_namespace(&name)?;
            let url = format!("https://{}:{CP_PORT}", ns.ip());
            cps.push(ControlPlane {
                name,
                ns,
                proc: None,
                url,
            });
        }
        let config = spec
            .config
            .clone()
            .unwrap_or_else(|| world.dir().join("admin.toml"));
        let mut cluster = Cluster {
            url: cps[0].url.clone(),
            cps,
            config,
            nodes: Vec::new(),
            postgres: None,
            spec,
            world,
        };
        if cluster.spec.on_postgres() {
            // A Unix socket in the state directory: every namespace reaches
            // it (sockets in the file system know no network namespace).
            let pg_dir = cluster.state_dir().join("postgres");
            cluster.world.log_elsewhere(pg_dir.join("log"), "postgres.log");
            let pg = Postgres::start_with_env(&pg_dir, &[(crate::WORLD_ENV, cluster.world.prefix())])?;
            pg.create_database("otherix").or_else(|e| {
                // A state directory kept from an earlier run has it already.
                if pg.query("otherix", "SELECT 1").is_ok() {
                    Ok(String::new())
                } else {
                    Err(e)
                }
            })?;
            cluster.postgres = Some(pg);
        }
        for i in 0..cluster.cps.len() {
            cluster.start_replica(i)?;
        }
        let mut login: Vec<String> = vec!["login".into()];
        for cp in &cluster.cps {
            login.extend(["--server".into(), cp.url.clone()]);
        }
        login.extend([
            "--token-file".into(),
            cluster
                .cp_dir()
                .join("admin.token")
                .to_string_lossy()
                .into_owned(),
            "--ca-file".into(),
            cluster.ca_file().to_string_lossy().into_owned(),
        ]);
        if let Some(name) = &cluster.spec.context {
            login.extend(["--name".into(), name.clone()]);
        }
        cluster.cli_ok(&login.iter().map(String::as_str).collect::<Vec<_>>())?;
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

    /// The first control plane's data directory (the admin token's).
    pub fn cp_dir(&self) -> PathBuf {
        self.state_dir().join("cp")
    }

    pub fn ca_file(&self) -> PathBuf {
        self.cp_dir().join("ca.crt")
    }

    /// The first control plane's namespace.
    pub fn cp_ns(&self) -> &Ns {
        &self.cps[0].ns
    }

    /// The first control plane's process, while it runs.
    pub fn cp(&self) -> Option<&Proc> {
        self.cps[0].proc.as_ref()
    }

    /// Every control plane's URL.
    pub fn urls(&self) -> Vec<String> {
        self.cps.iter().map(|c| c.url.clone()).collect()
    }

    /// Starts (or restarts) the first control plane.
    pub fn start_cp(&mut self) -> Result<()> {
        self.start_replica(0)
    }

    /// SIGKILLs the first control plane.
    pub fn kill_cp(&mut self) -> Result<()> {
        self.kill_replica(0)
    }

    /// Starts (or restarts) control plane `i` (0: `cp`, 1: `cp2`, ...).
    pub fn start_replica(&mut self, i: usize) -> Result<()> {
        let name = self.cps[i].name.clone();
        let dir = self.state_dir().join(&name);
        let listen = format!("{}:{CP_PORT}", self.cps[i].ns.ip());
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
        if let Some(pg) = &self.postgres {
            args.extend(["--database".into(), pg.url("otherix")]);
            // One key for all: the first replica makes it.
            args.extend([
                "--secret-key-file".into(),
                self.cp_dir().join("secret.key").to_string_lossy().into_owned(),
            ]);
        }
        if self.spec.metrics {
            args.extend([
                "--metrics-listen".into(),
                format!("{}:{CP_METRICS_PORT}", self.cps[i].ns.ip()),
            ]);
        }
        args.extend(self.spec.extra_server_args.iter().cloned());
        let proc = self.world.spawn(
            Some(&self.cps[i].ns),
            &self.spec.bin,
            &args,
            &[("RUST_LOG", "info")],
        )?;
        proc.wait_for_log("log in with", Duration::from_secs(30))?;
        self.cps[i].proc = Some(proc);
        Ok(())
    }

    /// SIGKILLs control plane `i`.
    pub fn kill_replica(&mut self, i: usize) -> Result<()> {
        if let Some(p) = self.cps[i].proc.take() {
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
        let mut args: Vec<String> = vec!["agent".into()];
        for cp in &self.cps {
            args.extend(["--server".into(), cp.url.clone()]);
        }
        args.extend([
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
        ]);
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
            // In a file, not on the command line: every user of the host
            // reads command lines (`ps`).
            let file = self.world.dir().join(format!("{name}.join-token"));
            write_private(&file, token.trim())?;
            args.push("--join-token-file".into());
            args.push(file.to_string_lossy().into_owned());
        }
        if self.spec.metrics {
            args.extend([
                "--metrics-listen".into(),
                format!("{}:{AGENT_METRICS_PORT}", ns.ip()),
            ]);
        }
        args.extend(self.spec.extra_agent_args.iter().cloned());
        args.extend(extra.iter().map(|a| a.to_string()));
        let log = agent_log_filter();
        let proc = self
            .world
            .spawn(Some(&ns), &self.spec.bin, &args, &[("RUST_LOG", log.as_str())])?;
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

    /// The daemons started and not stopped through this cluster, each with
    /// what it is (`control plane cp2`, `agent of node1`), whether or not
    /// it still runs.
    pub fn daemons(&self) -> Vec<(String, &Proc)> {
        let cps = self
            .cps
            .iter()
            .filter_map(|c| Some((format!("control plane {}", c.name), c.proc.as_ref()?)));
        let agents = self
            .nodes
            .iter()
            .filter_map(|n| Some((format!("agent of {}", n.name), n.agent.as_ref()?)));
        cps.chain(agents).collect()
    }

    /// With [`ClusterSpec::metrics`], where each control plane (`cp`,
    /// `cp2`, ...) and each node's agent serves Prometheus metrics: (name,
    /// URL), in that order. Empty without.
    pub fn metrics_urls(&self) -> Vec<(String, String)> {
        if !self.spec.metrics {
            return Vec::new();
        }
        let cps = self.cps.iter().map(|c| {
            (
                c.name.clone(),
                format!("http://{}:{CP_METRICS_PORT}/metrics", c.ns.ip()),
            )
        });
        let agents = self.nodes.iter().map(|n| {
            (
                n.name.clone(),
                format!("http://{}:{AGENT_METRICS_PORT}/metrics", n.ns.ip()),
            )
        });
        cps.chain(agents).collect()
    }

    /// Runs the CLI in the host namespace with the admin's config.
    pub fn cli(&self, args: &[&str]) -> Result<Output> {
        let mut cmd = Command::new(&self.spec.bin);
        cmd.args(args)
            .env("OTHERIX_CONFIG", &self.config)
            .env_remove("OTHERIX_TOKEN")
            .env_remove("RUST_LOG");
        // This cluster's context even if the config's current one changes
        // meanwhile (someone's `otherix context use` during `otherix dev`).
        match &self.spec.context {
            Some(name) => cmd.env("OTHERIX_CONTEXT", name),
            None => cmd.env_remove("OTHERIX_CONTEXT"),
        };
        cmd.output()
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
        self.forward_env(target, port, options, &[])
    }

    /// [`Cluster::forward_with`] with more environment, e.g. `OTHERIX_GRANT`
    /// to forward as a grant's holder.
    pub fn forward_env(
        &self,
        target: &str,
        port: u16,
        options: &[&str],
        envs: &[(&str, &str)],
    ) -> Result<(Proc, SocketAddr)> {
        let config = self.config.to_string_lossy().into_owned();
        let port = port.to_string();
        let mut args = vec!["forward", target, &port];
        args.extend_from_slice(options);
        let mut env = vec![("OTHERIX_CONFIG", config.as_str()), ("RUST_LOG", "info")];
        if let Some(name) = &self.spec.context {
            env.push(("OTHERIX_CONTEXT", name.as_str()));
        }
        env.extend_from_slice(envs);
        let p = self.world.spawn(None, &self.spec.bin, args, &env)?;
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

/// Writes `text` to `path`, readable by its owner alone.
fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let what = || format!("could not write {}", path.display());
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(Error::io(what()))?;
    // A file left by an earlier run keeps its mode through `open`.
    file.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(Error::io(what()))?;
    file.write_all(text.as_bytes()).map_err(Error::io(what()))
}

/// The agents' log filter: `info`, or what `OTHERIX_TESTBED_AGENT_LOG`
/// says (e.g. `otherix_ingress=debug,info`) when a test is being diagnosed.
fn agent_log_filter() -> String {
    std::env::var("OTHERIX_TESTBED_AGENT_LOG").unwrap_or_else(|_| "info".into())
}
