//! `otherix dev`: a whole local cluster in network namespaces — the CP, two
//! hypervisors, a gateway, an overlay and a bridge network, demo VMs — torn
//! down on Ctrl-C or SIGTERM. The admin is logged in as the context `dev`
//! while it runs; teardown gives the client config back as it found it.
//! A daemon of the cluster that exits meanwhile is said once and reaped.

use otherix_proto::Runtime;
use std::collections::HashSet;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::World;

use super::Ctx;
use crate::cli::DevArgs;
use crate::{config, env, signals};

/// The context the dev cluster's admin is logged in as.
const CONTEXT: &str = "dev";

/// Only one dev cluster at a time: it takes this lock for its lifetime.
const LOCK_PATH: &str = "/run/otherix-dev.lock";

/// Demo VMs: (name, network, labels, workload).
const DEMO_VMS: &[(&str, &str, &[&str], &str)] = &[
    ("web01", "demo-overlay", &["app=web"], "otherix guest http"),
    ("web02", "demo-overlay", &["app=web"], "otherix guest http"),
    ("web03", "demo-overlay", &["app=web"], "otherix guest http"),
    ("lab01", "demo-bridge", &["app=lab"], "otherix guest echo"),
];

pub async fn run(ctx: &Ctx, args: DevArgs) -> anyhow::Result<()> {
    if !is_root() {
        bail!("otherix dev needs root (it creates network namespaces, bridges and VXLAN devices); run it with sudo");
    }
    let replicas = usize::from(args.replicas);
    if replicas > 1 {
        // Said now, in one line, rather than after the world is built.
        otherix_testbed::postgres::server_binaries().map_err(|_| {
            anyhow::anyhow!(
                "--replicas needs PostgreSQL's server (/usr/lib/postgresql/*/bin/postgres): apt-get install postgresql"
            )
        })?;
    }
    if let Some(dir) = &args.state_dir {
        check_state_dir(dir, replicas > 1)?;
    }
    let _lock = take_lock()?;
    let config = ctx.config_path()?;
    // What `dev` replaces in the config (the current context, a `dev` of the
    // user's own), put back however this ends.
    let lent = config::load(&config)?.unwrap_or_default().lend(CONTEXT);
    let outcome = serve(args, config.clone()).await;
    let given_back = give_back(&config, lent);
    outcome.and(given_back)
}

/// Builds the cluster, waits for Ctrl-C or SIGTERM, tears it down.
async fn serve(args: DevArgs, config: std::path::PathBuf) -> anyhow::Result<()> {
    let replicas = usize::from(args.replicas);
    let bin = std::env::current_exe().context("locating the otherix binary")?;
    let state_dir = args.state_dir.clone();
    let runtime = args.runtime;
    let metrics = args.metrics;
    let keep_logs = args.keep_logs.then(|| kept_logs_dir(args.state_dir.as_deref()));
    if runtime == Runtime::Qemu
        && std::process::Command::new("qemu-system-x86_64")
            .arg("--version")
            .output()
            .is_err()
    {
        bail!("--runtime qemu needs QEMU: apt-get install qemu-system-x86");
    }

    // Ctrl-C while the cluster is being built must still tear it down: the
    // signal is awaited below, the build runs on a blocking thread.
    let wants = Wants {
        state_dir,
        replicas,
        runtime,
        metrics,
        keep_logs: keep_logs.clone(),
    };
    let mut build = tokio::task::spawn_blocking(move || build(bin, config, wants));
    let signal = signals::shutdown();
    tokio::pin!(signal);
    let cluster = tokio::select! {
        built = &mut build => match built? {
            Ok(cluster) => cluster,
            Err(e) => {
                say_kept(keep_logs.as_deref());
                return Err(e);
            }
        },
        _ = &mut signal => {
            eprintln!("interrupted: tearing down as soon as the current step finishes...");
            if let Ok(Ok(cluster)) = build.await {
                tokio::task::spawn_blocking(move || drop(cluster)).await?;
            }
            say_kept(keep_logs.as_deref());
            return Ok(());
        }
    };
    // The printed commands find this cluster through the config, so name it
    // unless it is where every command looks anyway.
    let export_config = crate::config::path(None).ok().as_deref() != Some(cluster.config.as_path());
    print_next_steps(&cluster, export_config, keep_logs.as_deref());
    watch(&cluster, signal).await;
    eprintln!("tearing down the dev cluster...");
    let prefix = cluster.world.prefix().to_string();
    tokio::task::spawn_blocking(move || drop(cluster)).await?;
    say_kept(keep_logs.as_deref());
    let left = World::leftovers(&prefix);
    if !left.is_empty() {
        bail!(
            "some of the dev cluster could not be removed: {}",
            left.join(", ")
        );
    }
    eprintln!("done: no namespace, interface or process left behind.");
    Ok(())
}

/// Until `stop` resolves, says each daemon of the cluster that exits (once)
/// and reaps it: a replica killed to try failover is no silent zombie.
async fn watch(cluster: &Cluster, stop: impl std::future::Future<Output = ()>) {
    use tokio::signal::unix::{signal, SignalKind};
    tokio::pin!(stop);
    let mut reported = HashSet::new();
    let Ok(mut exits) = signal(SignalKind::child()) else {
        return stop.await;
    };
    // One may have gone before the handler was in place.
    report_exits(cluster, &mut reported);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = exits.recv() => report_exits(cluster, &mut reported),
        }
    }
}

/// Says, once per process, each daemon that has exited (which reaps it).
fn report_exits(cluster: &Cluster, reported: &mut HashSet<u32>) {
    for (what, proc) in cluster.daemons() {
        if reported.contains(&proc.pid()) {
            continue;
        }
        if let Some(status) = proc.exit_status() {
            reported.insert(proc.pid());
            eprintln!(
                "dev: {what} (pid {}) exited ({}); its log: {}",
                proc.pid(),
                how_it_ended(status),
                proc.log_path().display()
            );
        }
    }
}

/// `killed by signal 9`, `exit status 1`.
fn how_it_ended(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => status.to_string(),
    }
}

/// Where `--keep-logs` puts the logs: beside the state it names, else in
/// the temporary directory; one directory per run.
fn kept_logs_dir(state_dir: Option<&Path>) -> PathBuf {
    let now = time::OffsetDateTime::now_utc();
    let stamp = format!(
        "{:04}{:02}{:02}-{:02}{:02}{:02}",
        now.year(),
        u8::from(now.month()),
        now.day(),
        now.hour(),
        now.minute(),
        now.second()
    );
    match state_dir {
        Some(dir) => dir.join("logs").join(stamp),
        None => std::env::temp_dir().join(format!("otherix-dev-logs-{stamp}")),
    }
}

/// The one line that says where `--keep-logs` kept them.
fn say_kept(dest: Option<&Path>) {
    if let Some(dest) = dest.filter(|d| d.is_dir()) {
        eprintln!("logs kept in {}", dest.display());
    }
}

/// Refuses, before anything starts, a --state-dir the cluster could not
/// use: not a directory, not writable, or (with replicas) where
/// PostgreSQL's user cannot reach its data.
fn check_state_dir(dir: &Path, postgres: bool) -> anyhow::Result<()> {
    const ELSE: &str = "or leave --state-dir out for a temporary one";
    if dir.exists() && !dir.is_dir() {
        bail!(
            "--state-dir {} is not a directory\nhint: name a directory (it is made if missing), {ELSE}",
            dir.display()
        );
    }
    if postgres {
        if let Err(blocked) = otherix_testbed::postgres::check_reachable(dir) {
            bail!(
                "--state-dir {}: PostgreSQL runs as the user `postgres`, which cannot enter {}\nhint: `chmod o+x {}`, or name a --state-dir it can reach (e.g. /var/tmp/otherix-dev), {ELSE}",
                dir.display(),
                blocked.display(),
                blocked.display()
            );
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| {
        anyhow!(
            "--state-dir {} cannot be made: {e}\nhint: name a directory you can write to, {ELSE}",
            dir.display()
        )
    })?;
    // Root writes through modes, not through a read-only mount: try it.
    let probe = dir.join(format!(".otherix-dev-probe-{}", std::process::id()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
        }
        Err(e) => bail!(
            "--state-dir {} is not writable: {e}\nhint: name a directory on a writable file system, {ELSE}",
            dir.display()
        ),
    }
    Ok(())
}

/// Puts back in the config what the `dev` context replaced, and says which
/// context is current now.
fn give_back(path: &std::path::Path, lent: config::Lent) -> anyhow::Result<()> {
    let Some(mut file) = config::load(path)? else {
        return Ok(());
    };
    let previous = lent.previous().map(str::to_string);
    file.give_back(lent);
    config::save(path, &file).context("restoring the client config")?;
    match (&file.current_context, previous) {
        (Some(now), Some(before)) if *now == before => {
            eprintln!("context {now:?} is current again (the `{CONTEXT}` context is gone)")
        }
        (Some(now), _) => eprintln!("context {now:?} is current (the `{CONTEXT}` context is gone)"),
        (None, _) => eprintln!("the `{CONTEXT}` context is gone; no context is current"),
    }
    Ok(())
}

/// What the cluster is asked to be, from the command line.
struct Wants {
    state_dir: Option<PathBuf>,
    replicas: usize,
    runtime: Runtime,
    metrics: bool,
    /// Where the logs go on teardown, with --keep-logs.
    keep_logs: Option<PathBuf>,
}

fn build(bin: PathBuf, config: PathBuf, wants: Wants) -> anyhow::Result<Cluster> {
    let Wants {
        state_dir,
        replicas,
        runtime,
        metrics,
        keep_logs,
    } = wants;
    if runtime == Runtime::Qemu {
        // Here, on the host: the agents run in namespaces with no route to
        // the Debian mirror. Found built, this is instant.
        step("the QEMU guest image (built from Debian packages on first use, about 30 MB)");
        let cache = otherix_agent::runtime::qemu::image::default_cache_dir();
        otherix_agent::runtime::qemu::image::ensure(
            &cache,
            otherix_agent::runtime::qemu::image::DEFAULT_IMAGE,
            &mut |s| eprintln!("    {s}"),
        )
        .context("cannot build the QEMU guest image (otherix image build says more)")?;
    }
    step("creating the world (fabric bridge, namespaces)");
    let world = World::new("dev")?;
    if let Some(dest) = keep_logs {
        // Set first: a start that fails is when the logs matter most.
        world.keep_logs_in(dest);
    }
    let mut spec = ClusterSpec::new(bin);
    spec.metrics = metrics;
    spec.config = Some(config);
    spec.context = Some(CONTEXT.to_string());
    spec.state_dir = state_dir;
    spec.heartbeat = Duration::from_secs(2);
    spec.node_timeout = Duration::from_secs(10);
    spec.replicas = replicas;
    if replicas > 1 {
        step(&format!(
            "starting PostgreSQL, {replicas} control-plane replicas on it and 3 agents (node1, node2 hypervisors; gw1 gateway)"
        ));
    } else {
        step("starting the control plane and 3 agents (node1, node2 hypervisors; gw1 gateway)");
    }
    let cluster = Cluster::start(world, spec)?;
    step("creating networks demo-overlay (10.100.0.0/24) and demo-bridge (10.101.0.0/24 on node1 and node2)");
    cluster.cli_ok(&[
        "network",
        "create",
        "demo-overlay",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ])?;
    cluster.cli_ok(&[
        "network",
        "create",
        "demo-bridge",
        "--type",
        "bridge",
        "--subnet",
        "10.101.0.0/24",
        "--node",
        "node1",
        "--node",
        "node2",
    ])?;
    // A QEMU guest serves HTTP on 80 and echo on 7 itself, as the demo's
    // netns workloads do; the user's own public key lets `otherix ssh` in.
    let keys = user_public_keys();
    for (name, net, labels, exec) in DEMO_VMS {
        let mut argv = vec!["vm", "create", name, "--network", net];
        match runtime {
            Runtime::Netns => argv.extend(["--exec", exec]),
            Runtime::Qemu => {
                argv.extend(["--runtime", "qemu"]);
                for key in &keys {
                    argv.extend(["--ssh-key", key.as_str()]);
                }
            }
        }
        for l in *labels {
            argv.extend(["--label", l]);
        }
        cluster.cli_ok(&argv)?;
    }
    // A TCG guest boots in seconds; its image was built above.
    let patience = match runtime {
        Runtime::Netns => Duration::from_secs(60),
        Runtime::Qemu => Duration::from_secs(300),
    };
    for (name, ..) in DEMO_VMS {
        step(&format!("waiting for {name} to run"));
        cluster
            .wait_vm_running(name, patience)
            .with_context(|| format!("{name} did not start"))?;
    }
    step("creating load balancer web-lb (port 80, selector app=web)");
    cluster.cli_ok(&[
        "lb",
        "create",
        "web-lb",
        "--port",
        "80",
        "--selector",
        "app=web",
        "--health",
        "http:/",
        "--interval",
        "2s",
        "--timeout",
        "1s",
    ])?;
    Ok(cluster)
}

/// The SSH public keys of whoever runs this (`HOME`) and, under sudo, of
/// the sudoer, for the QEMU demo guests: `sudo otherix ssh` uses root's
/// keys, a plain `otherix ssh` the user's.
fn user_public_keys() -> Vec<String> {
    let sudoer_home = std::env::var_os("SUDO_USER").and_then(|u| {
        std::fs::read_to_string("/etc/passwd").ok().and_then(|p| {
            p.lines()
                .find(|l| l.split(':').next() == u.to_str())
                .and_then(|l| l.split(':').nth(5).map(std::path::PathBuf::from))
        })
    });
    let homes = [
        std::env::var_os("HOME").map(std::path::PathBuf::from),
        sudoer_home,
    ];
    let mut keys: Vec<String> = homes
        .into_iter()
        .flatten()
        .filter_map(|home| {
            ["id_ed25519.pub", "id_ecdsa.pub", "id_rsa.pub"]
                .iter()
                .map(|f| home.join(".ssh").join(f))
                .find(|p| p.is_file())
                .map(|p| p.display().to_string())
        })
        .collect();
    keys.dedup();
    keys
}

fn step(what: &str) {
    eprintln!("==> {what}");
}

fn print_next_steps(c: &Cluster, export_config: bool, keep_logs: Option<&Path>) {
    let gw = c
        .nodes
        .iter()
        .find(|n| n.gateway)
        .map(|n| n.ns.name().to_string())
        .unwrap_or_default();
    println!();
    if c.cps.len() > 1 {
        println!(
            "Otherix dev cluster is up: {} control-plane replicas on PostgreSQL: {}",
            c.cps.len(),
            c.urls().join(" ")
        );
    } else {
        println!("Otherix dev cluster is up: control plane {}", c.url);
    }
    println!(
        "Client config: {} (context `{CONTEXT}`, current until this stops)",
        c.config.display()
    );
    println!(
        "Web console: {}/ui/ (sign in with the admin token: {}; the browser asks to accept the cluster CA's certificate)",
        c.url,
        c.cp_dir().join("admin.token").display()
    );
    println!();
    println!("Try:");
    if export_config {
        println!("  export {}={}", env::CONFIG, c.config.display());
    }
    println!("  otherix node list");
    println!("  otherix vm list --selector app=web");
    println!("  otherix vm get web01 -o json");
    println!();
    println!("Reach a VM by name through the gateway (each connection is brokered anew):");
    for (cmd, what) in [
        (
            "otherix forward web01 80 --local 127.0.0.1:8080 &",
            "127.0.0.1:8080 -> web01:80",
        ),
        ("curl -s http://127.0.0.1:8080/", "answers web01"),
        (
            r"printf 'GET / HTTP/1.0\r\n\r\n' | otherix connect web02 80",
            "one connection, stdin/stdout",
        ),
        ("kill %1", "stops the forward"),
        ("otherix lb list", "web-lb over web01..web03, health-checked"),
        (
            "otherix forward lb/web-lb 80 --local 127.0.0.1:8081 &",
            "each connection picks a healthy backend",
        ),
        (
            "for i in 1 2 3 4; do curl -s http://127.0.0.1:8081/; done",
            "answers vary",
        ),
        (
            "echo hello | otherix connect lab01 7",
            "lab01 is on a bridge: through the CP's relay",
        ),
        ("otherix session list", "sessions open now"),
        (
            "otherix audit --since 10m",
            "each decision and session, bytes each way",
        ),
    ] {
        println!("  {cmd:<60} # {what}");
    }
    let web01 = c.cli_json(&["vm", "get", "web01"]).ok();
    let field = |f: &str| web01.as_ref().and_then(|v| v[f].as_str().map(str::to_string));
    let ip = field("ip").unwrap_or_else(|| "WEB01_IP".into());
    let to = if field("node").as_deref() == Some("node1") {
        "node2"
    } else {
        "node1"
    };
    if web01.as_ref().is_some_and(|v| v["runtime"] == "qemu") {
        println!();
        println!("The VMs are QEMU guests (real Linux, HTTP on 80, echo on 7, SSH on 22):");
        println!(
            "  {:<60} # with the key vm create was given",
            "otherix ssh root@web01"
        );
    }
    println!();
    println!("Live migration: the guest keeps its MAC, IP and open connections:");
    println!(
        "  {:<60} # a forward to web01 keeps streaming",
        format!("otherix vm migrate web01 --to {to}")
    );
    if let (Some(second), Some(pid)) = (c.cps.get(1), c.cp().map(|p| p.pid())) {
        println!();
        println!("Failover: stop the first replica; agents and the CLI go on through the others:");
        println!(
            "  {:<60} # replica {} stops",
            format!("kill -9 {pid}"),
            c.cps[0].name
        );
        println!(
            "  {:<60} # answered by {} (or another)",
            "otherix version", second.url
        );
    }
    println!();
    println!("Under the hood, from the gateway node over the overlay:");
    println!("  ip netns exec {gw} curl -s http://{ip}/");
    let metrics = c.metrics_urls();
    if !metrics.is_empty() {
        println!();
        println!("Prometheus metrics (and /healthz, /readyz beside them):");
        for (name, url) in metrics {
            println!("  {name:<8} {url}");
        }
    }
    println!();
    match keep_logs {
        Some(dest) => println!(
            "Logs: {} (kept in {} on teardown)",
            c.world_dir().display(),
            dest.display()
        ),
        None => println!("Logs: {}", c.world_dir().display()),
    }
    println!("Press Ctrl-C to tear everything down.");
    let _ = std::io::stdout().flush();
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|euid| euid == "0"))
        })
        .unwrap_or(false)
}

/// Takes the single-instance lock, or says who holds it.
fn take_lock() -> anyhow::Result<File> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(LOCK_PATH)
        .with_context(|| format!("opening {LOCK_PATH}"))?;
    match file.try_lock() {
        Ok(()) => {
            file.set_len(0)?;
            (&file).write_all(format!("{}\n", std::process::id()).as_bytes())?;
            Ok(file)
        }
        Err(std::fs::TryLockError::WouldBlock) => {
            let pid = std::fs::read_to_string(LOCK_PATH).unwrap_or_default();
            bail!(
                "another `otherix dev` is already running (pid {}); stop it (Ctrl-C) before starting a new one",
                pid.trim()
            )
        }
        Err(std::fs::TryLockError::Error(e)) => Err(e).with_context(|| format!("locking {LOCK_PATH}")),
    }
}
