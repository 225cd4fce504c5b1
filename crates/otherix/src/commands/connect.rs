//! `otherix connect`, `forward`, `ssh` and `ssh-config`: broker a
//! connection, then tunnel bytes through the endpoint the CP names — a
//! gateway, or for VMs on a bridge network the CP's relay (reached at the
//! configured CP URL). Both transports are the same byte stream here.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, Context};
use otherix_client::tunnel::{self, AnyTunnel, ConnectError, Ready, Resume};
use otherix_client::Client;
use otherix_proto::{BrokerRequest, BrokerResponse, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::Ctx;
use crate::{output, signals};

/// `web01.otherix` (from an ssh-config stanza) names VM `web01`.
const SSH_SUFFIX: &str = ".otherix";

fn target_name(target: &str) -> &str {
    target.strip_suffix(SSH_SUFFIX).unwrap_or(target)
}

/// Brokers and opens one tunnel, through a gateway or the relay as the
/// broker says. Refusals are reported with their cause. For a load
/// balancer, a backend that could not be dialed is excluded and the
/// connection brokered once more.
pub async fn dial(
    client: &Client,
    ca_pem: &str,
    target: &str,
    port: u16,
) -> anyhow::Result<(BrokerResponse, AnyTunnel)> {
    let mut exclude = vec![];
    loop {
        let grant = client
            .broker(&BrokerRequest {
                target: target.to_string(),
                port: u32::from(port),
                exclude: exclude.clone(),
            })
            .await
            .with_context(|| format!("cannot broker {target}:{port}"))?;
        let opened = match resume_with(client, ca_pem) {
            Some(resume) => tunnel::open_brokered_resumable(&grant, client.server(), ca_pem, &resume).await,
            None => tunnel::open_brokered(&grant, client.server(), ca_pem).await,
        };
        match opened {
            Ok(tunnel) => return Ok((grant, tunnel)),
            Err(e) if target.starts_with("lb/") && exclude.is_empty() && e.retryable() => {
                tracing::info!(vm = %grant.vm, error = %e, "backend unreachable; brokering again without it");
                exclude.push(grant.vm.clone());
            }
            Err(e) => return Err(describe(e, &grant)),
        }
    }
}

/// How this client's relay sessions resume (#31): through any of its
/// control planes, with its own bearer; the progress goes to stderr. None
/// for a client without a bearer (it could not resume): the plain relay.
/// `OTHERIX_RELAY_RESUME=off` asks for plain relay sessions, which end with
/// their connection (scripts that should fail fast; benchmarks comparing both).
pub(crate) fn resume_with(client: &Client, ca_pem: &str) -> Option<Resume> {
    if std::env::var("OTHERIX_RELAY_RESUME").is_ok_and(|v| matches!(v.as_str(), "off" | "0" | "false" | "no"))
    {
        return None;
    }
    let bearer = client.bearer()?;
    Some(Resume::new(client.servers(), ca_pem, bearer).on_event(|e| eprintln!("relay: {e}")))
}

fn describe(e: ConnectError, grant: &BrokerResponse) -> anyhow::Error {
    match e {
        ConnectError::Refused { status, reason } if grant.transport == Transport::Relay => {
            anyhow!(
                "the relay refused the connection to {}:{} ({status}): {reason}",
                grant.vm,
                grant.port
            )
        }
        ConnectError::Refused { status, reason } => {
            anyhow!(
                "gateway {} refused the connection to {}:{} ({status}): {reason}",
                grant.endpoint,
                grant.vm,
                grant.port
            )
        }
        other => anyhow!(other),
    }
}

pub async fn connect(ctx: &Ctx, target: &str, port: u16) -> anyhow::Result<()> {
    let (client, ca_pem) = client_and_ca(ctx)?;
    let (grant, tunnel) = dial(&client, &ca_pem, target_name(target), port).await?;
    tracing::info!(vm = %grant.vm, port, endpoint = %grant.endpoint, "tunnel open");
    let finished = tunnel.finished();
    let (mut rd, mut wr) = tokio::io::split(tunnel);
    // stdin -> guest on its own task: ssh keeps stdin open after the session,
    // so the end of the session is decided by the guest side alone. stdin is
    // read on a plain thread: tokio's stdin read cannot be cancelled and
    // would hold the process at exit (after a failed tunnel, say) until the
    // next line arrived.
    let stdin = stdin_chunks();
    let upstream = tokio::spawn(async move {
        let mut stdin = stdin;
        while let Some(chunk) = stdin.recv().await {
            wr.write_all(&chunk).await?;
            wr.flush().await?;
        }
        // stdin done: half-close toward the guest, keep reading its answer.
        wr.shutdown().await
    });
    let mut stdout = tokio::io::stdout();
    let mut buf = vec![0u8; 64 * 1024];
    let result = async {
        loop {
            let n = rd.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            stdout.write_all(&buf[..n]).await?;
            stdout.flush().await?;
        }
        Ok::<_, std::io::Error>(())
    }
    .await;
    upstream.abort();
    // A resumable relay session: the tunnel dropped, its Close goes out
    // before the process exits (else the control plane keeps the session
    // for a resume until its grace period passes).
    let _ = upstream.await;
    drop(rd);
    if let Some(finished) = finished {
        let _ = tokio::time::timeout(Duration::from_secs(2), finished).await;
    }
    match result {
        // The relay's errors say what ended the session ("relay session
        // ended: vm web01 moved to another node (node2); connect again").
        Err(e) if grant.transport == Transport::Relay => Err(e.into()),
        other => other.context("reading from the tunnel"),
    }
}

/// stdin in chunks, read on a thread of its own that the process does not
/// wait for; the channel ends at end of file (or a read error).
pub(crate) fn stdin_chunks() -> tokio::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match std::io::Read::read(&mut stdin, &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            }
        }
    });
    rx
}

/// How `forward` keeps connections ready (`otherix forward --help`).
#[derive(Debug, Clone, Copy)]
pub struct Readiness {
    /// Ready connections kept while connections arrive; 0: none.
    pub most: usize,
    /// How long one is kept unused.
    pub keep: Duration,
}

/// A gateway closes a connection whose request has not come within 10 s
/// (its default request timeout): a ready one is used or dropped before.
const MAX_READY_KEEP: Duration = Duration::from_secs(9);

impl Readiness {
    pub fn new(target: &str, most: Option<u16>, keep: Option<Duration>) -> anyhow::Result<Readiness> {
        let lb = target_name(target).starts_with("lb/");
        // An LB's backend is chosen when a credential is minted: ready ones
        // only when asked for (`forward --help`).
        let most = most.unwrap_or(if lb { 0 } else { 4 });
        let default = if lb {
            // The backend is chosen when the credential is minted: keep it
            // short so that the choice follows health.
            Duration::from_secs(2)
        } else {
            Duration::from_secs(8)
        };
        let keep = keep.unwrap_or(default);
        if keep > MAX_READY_KEEP {
            anyhow::bail!(
                "--ready-keep is at most 9s: a gateway closes a connection that sends nothing for 10s"
            );
        }
        if keep.is_zero() && most > 0 {
            anyhow::bail!("--ready-keep must be positive; --ready 0 turns ready connections off");
        }
        Ok(Readiness {
            most: usize::from(most),
            keep,
        })
    }
}

/// The connections `forward` keeps ready, and those being made.
struct ReadyPool {
    readiness: Readiness,
    client: Client,
    ca_pem: String,
    target: String,
    port: u16,
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    ready: VecDeque<Ready>,
    making: usize,
    budget: Budget,
}

/// Whether the principal's connections are counted against a budget (a
/// grant's `--max-connections`). The broker counts a grant's connection
/// when it mints the credential, so a credential kept ready would spend one
/// that no connection made: for a budgeted principal none is kept ready,
/// and until `forward` knows, none is either.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Budget {
    #[default]
    Unknown,
    /// No budget: connections may be made ready.
    Unbudgeted,
    /// Every credential is a connection of the budget: broker only for a
    /// connection being made.
    Budgeted,
}

impl Budget {
    /// What one more answer (`budgeted`: whoami's `max_connections`, or a
    /// broker answer's `budgeted`) says. A budget, once seen, stays.
    fn learn(self, budgeted: bool) -> Budget {
        match (self, budgeted) {
            (_, true) | (Budget::Budgeted, false) => Budget::Budgeted,
            (_, false) => Budget::Unbudgeted,
        }
    }
}

impl ReadyPool {
    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The oldest ready connection still usable (within its keep, its
    /// credential well before expiry), if any. Taken out: each is used by
    /// one connection only.
    fn take(&self) -> Option<Ready> {
        let keep = self.readiness.keep;
        let mut state = self.lock();
        while let Some(ready) = state.ready.pop_front() {
            if ready.is_usable(keep) {
                return Some(ready);
            }
        }
        None
    }

    /// Has ready connections made until `want` (at most `--ready`) are
    /// ready or being made.
    fn fill(self: &Arc<Self>, want: usize) {
        let want = want.min(self.readiness.most);
        let missing = {
            let mut state = self.lock();
            if state.budget != Budget::Unbudgeted {
                return;
            }
            let keep = self.readiness.keep;
            state.ready.retain(|r| r.is_usable(keep));
            let missing = want.saturating_sub(state.ready.len() + state.making);
            state.making += missing;
            missing
        };
        for _ in 0..missing {
            let pool = Arc::clone(self);
            tokio::spawn(async move {
                let made = pool.make().await;
                pool.keep_ready(made, true).await;
            });
        }
    }

    /// Puts `made` among the ready connections (`counted`: it was counted
    /// as being made) and drops it if still unused once its keep is over.
    async fn keep_ready(&self, made: Option<Ready>, counted: bool) {
        let keep = self.readiness.keep;
        let usable_for = made.as_ref().map(|r| r.usable_for(keep));
        {
            let mut state = self.lock();
            if counted {
                state.making -= 1;
            }
            state.ready.extend(made);
        }
        if let Some(usable_for) = usable_for {
            // Dropped unused once its keep is over (before the gateway's
            // own timeout would close it with a 408), or sooner when its
            // credential expires sooner (a grant about to end).
            tokio::time::sleep(usable_for).await;
            let dropped = {
                let mut state = self.lock();
                let before = state.ready.len();
                state.ready.retain(|r| r.is_usable(keep));
                before - state.ready.len()
            };
            if dropped > 0 {
                tracing::info!(dropped, "ready connection dropped unused");
            }
        }
    }

    /// Brokers and connects one; a failure is left to the connection that
    /// would have used it (it brokers anew and reports what it gets).
    async fn make(&self) -> Option<Ready> {
        let grant = match self.client.broker(&self.request()).await {
            Ok(grant) => {
                self.learn(grant.budgeted);
                grant
            }
            Err(e) => {
                tracing::debug!(target = %self.target, error = %e, "no ready connection: the broker refused");
                return None;
            }
        };
        match Ready::prepare(grant, self.client.server(), &self.ca_pem).await {
            Ok(ready) => {
                tracing::info!(vm = %ready.grant.vm, endpoint = %ready.grant.endpoint, "connection made ready");
                Some(ready)
            }
            Err(e) => {
                tracing::debug!(target = %self.target, error = %e, "no ready connection: cannot reach the gateway or the control plane");
                None
            }
        }
    }

    /// A tunnel for one connection: through a ready one if there is one
    /// (brokering anew if it is refused), else brokered now. Says which.
    async fn open(self: &Arc<Self>) -> anyhow::Result<(BrokerResponse, AnyTunnel, bool)> {
        let ready = self.take();
        // The next connections find theirs ready.
        self.fill(self.readiness.most);
        if let Some(ready) = ready {
            let grant = ready.grant.clone();
            let opened = match resume_with(&self.client, &self.ca_pem) {
                Some(resume) => ready.open_resumable(&resume).await,
                None => ready.open().await,
            };
            match opened {
                Ok(tunnel) => return Ok((grant, tunnel, true)),
                Err(e) => {
                    tracing::info!(vm = %grant.vm, error = %e, "a ready connection was refused; brokering anew")
                }
            }
        }
        let (grant, tunnel) = dial(&self.client, &self.ca_pem, &self.target, self.port).await?;
        if self.learn(grant.budgeted) {
            // Not budgeted after all: the next connections find theirs ready.
            self.fill(self.readiness.most);
        }
        Ok((grant, tunnel, false))
    }

    /// Takes in whether the principal is budgeted; whether that made ready
    /// connections allowed.
    fn learn(&self, budgeted: bool) -> bool {
        let mut state = self.lock();
        let before = state.budget;
        state.budget = before.learn(budgeted);
        before != Budget::Unbudgeted && state.budget == Budget::Unbudgeted
    }

    fn request(&self) -> BrokerRequest {
        BrokerRequest {
            target: self.target.clone(),
            port: u32::from(self.port),
            exclude: vec![],
        }
    }

    /// At start, before anything listens: asks the control plane whether
    /// the principal has a connection budget, then brokers one credential
    /// so that an unknown target, a missing rule or a VM not running fails
    /// at once with the broker's answer. The credential is kept as the
    /// first ready connection when ready ones are on (otherix forward
    /// --ready 0 drops it unused: it lets nobody in). A budgeted principal
    /// is not checked: the credential would spend one of its connections.
    async fn check(self: &Arc<Self>) -> anyhow::Result<()> {
        match self.client.whoami().await {
            Ok(me) if me.max_connections.is_some() => {
                self.learn(true);
                eprintln!(
                    "{} may make {} connections: {}:{} is not checked at start and none is made ready \
                     ahead (each credential brokered counts as one).",
                    me.principal,
                    me.max_connections.unwrap_or_default(),
                    self.target,
                    self.port
                );
                return Ok(());
            }
            Ok(_) => {
                self.learn(false);
            }
            // The broker call below says what is wrong, if anything is.
            Err(e) => tracing::debug!(error = %e, "cannot tell whether connections are budgeted"),
        }
        let grant = self
            .client
            .broker(&self.request())
            .await
            .with_context(|| format!("cannot forward to {}:{}", self.target, self.port))?;
        self.learn(grant.budgeted);
        if self.readiness.most == 0 || grant.budgeted {
            return Ok(());
        }
        match Ready::prepare(grant, self.client.server(), &self.ca_pem).await {
            Ok(ready) => {
                tracing::info!(vm = %ready.grant.vm, endpoint = %ready.grant.endpoint, "connection made ready");
                let pool = Arc::clone(self);
                tokio::spawn(async move { pool.keep_ready(Some(ready), false).await });
            }
            // Brokered, so reachable by name and rule; the connection that
            // would have used it brokers anew and reports what it gets.
            Err(e) => {
                tracing::info!(target = %self.target, error = %e, "the first ready connection could not be made")
            }
        }
        Ok(())
    }
}

/// One `forward` port: REMOTE, or LOCAL:REMOTE as kubectl port-forward
/// takes it (no LOCAL, or LOCAL 0: a free local port).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortSpec {
    pub local: Option<u16>,
    pub remote: u16,
}

impl PortSpec {
    pub fn parse(s: &str) -> Result<PortSpec, String> {
        let usage = || format!("{s:?} is not a port: give REMOTE or LOCAL:REMOTE, as in 80 or 8080:80");
        let port = |p: &str| p.parse::<u16>().map_err(|_| usage());
        let (local, remote) = match s.split_once(':') {
            Some(("", remote)) => (None, port(remote)?),
            Some((local, remote)) => (Some(port(local)?).filter(|p| *p != 0), port(remote)?),
            None => (None, port(s)?),
        };
        if remote == 0 {
            return Err(format!("{s:?}: the remote port must be 1-65535"));
        }
        Ok(PortSpec { local, remote })
    }
}

/// Where each of `ports` listens: `address` and its LOCAL port (0: a free
/// one), or `--local` for a single REMOTE.
pub fn listen_addrs(
    ports: &[PortSpec],
    address: std::net::IpAddr,
    local: Option<SocketAddr>,
) -> anyhow::Result<Vec<(SocketAddr, u16)>> {
    match (local, ports) {
        (None, _) => Ok(ports
            .iter()
            .map(|p| (SocketAddr::new(address, p.local.unwrap_or(0)), p.remote))
            .collect()),
        (Some(local), [PortSpec { local: None, remote }]) => Ok(vec![(local, *remote)]),
        (Some(_), _) => anyhow::bail!(
            "--local takes one REMOTE port; for several use LOCAL:REMOTE (and --address for the IP)"
        ),
    }
}

pub async fn forward(
    ctx: &Ctx,
    target: &str,
    listen: &[(SocketAddr, u16)],
    readiness: Readiness,
) -> anyhow::Result<()> {
    let (client, ca_pem) = client_and_ca(ctx)?;
    let target = target_name(target).to_string();
    // Every port checked before anything listens: a wrong name or rule is
    // said at once, not on the first connection.
    let mut pools = Vec::with_capacity(listen.len());
    for &(_, port) in listen {
        let pool = Arc::new(ReadyPool {
            readiness,
            client: client.clone(),
            ca_pem: ca_pem.clone(),
            target: target.clone(),
            port,
            state: Mutex::default(),
        });
        pool.check().await?;
        pools.push(pool);
    }
    let mut listeners = Vec::with_capacity(listen.len());
    for &(addr, _) in listen {
        let listener = TcpListener::bind(addr).await.map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => {
                anyhow!("cannot listen on {addr}: the address is already in use")
            }
            _ => anyhow!("cannot listen on {addr}: {e}"),
        })?;
        listeners.push(listener);
    }
    let ahead = if readiness.most == 0 {
        String::new()
    } else {
        format!(
            ", up to {} ahead (kept {})",
            readiness.most,
            humantime::format_duration(readiness.keep)
        )
    };
    let mut loops = tokio::task::JoinSet::new();
    for (listener, pool) in listeners.into_iter().zip(pools) {
        let bound = listener.local_addr()?;
        println!("{bound}");
        eprintln!(
            "Forwarding {bound} -> {target}:{}; every connection is brokered anew{ahead}.",
            pool.port
        );
        // The first is made ready by the check; the next ones as connections come.
        loops.spawn(serve_forward(listener, pool));
    }
    eprintln!("Ctrl-C to stop.");
    let shutdown = signals::shutdown();
    tokio::select! {
        _ = shutdown => Ok(()),
        Some(ended) = loops.join_next() => match ended {
            Ok(()) => Ok(()),
            Err(e) => Err(anyhow!("a forward stopped: {e}")),
        },
    }
}

/// Accepts on `listener` and forwards each connection through `pool`.
async fn serve_forward(listener: TcpListener, pool: Arc<ReadyPool>) {
    let port = pool.port;
    loop {
        let (mut conn, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = conn.set_nodelay(true);
        let pool = Arc::clone(&pool);
        tokio::spawn(async move {
            match pool.open().await {
                Ok((grant, tunnel, ready)) => {
                    tracing::info!(%peer, vm = %grant.vm, port, endpoint = %grant.endpoint, ready, "connection forwarded");
                    let carried = match tunnel {
                        // On a thread of its own, as socat would: a round
                        // trip then wakes one thread, not tokio's driver and
                        // a worker (`tunnel::splice`).
                        AnyTunnel::Gateway(t) => otherix_client::tunnel::splice::splice(conn, t).await,
                        // Read into and written from the session's own messages.
                        AnyTunnel::Resumable(mut t) => {
                            let (rd, wr) = conn.split();
                            t.pump(rd, wr).await
                        }
                        // 64 KiB buffers: a relay write is one frame, keep them large.
                        mut tunnel @ AnyTunnel::Relay(_) => {
                            tokio::io::copy_bidirectional_with_sizes(
                                &mut conn,
                                &mut tunnel,
                                64 << 10,
                                64 << 10,
                            )
                            .await
                        }
                    };
                    match carried {
                        Ok((up, down)) => {
                            tracing::info!(%peer, vm = %grant.vm, up, down, "connection closed")
                        }
                        // The relay says why it ended a session (the VM moved,
                        // the node was lost): the user needs to see that.
                        Err(e) if grant.transport == Transport::Relay => {
                            eprintln!("error: connection from {peer} to {}: {e}", grant.vm)
                        }
                        Err(e) => tracing::info!(%peer, vm = %grant.vm, error = %e, "connection ended"),
                    }
                }
                Err(e) => eprintln!("error: connection from {peer}: {e:#}"),
            }
        });
    }
}

pub fn ssh(ctx: &Ctx, destination: &str, port: u16, ssh_args: &[String]) -> anyhow::Result<()> {
    let (user, vm) = match destination.split_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, destination),
    };
    let vm = target_name(vm);
    let mut cmd = std::process::Command::new("ssh");
    cmd.arg("-o")
        .arg(format!("ProxyCommand={} connect %h %p", proxy_command(ctx)?));
    // Host keys are remembered per VM name, whatever address it has.
    cmd.arg("-o").arg(format!("HostKeyAlias={vm}.otherix"));
    cmd.arg("-p").arg(port.to_string());
    cmd.arg(match user {
        Some(u) => format!("{u}@{vm}"),
        None => vm.to_string(),
    });
    cmd.args(ssh_args);
    let status = cmd
        .status()
        .context("cannot run ssh; is OpenSSH's client installed?")?;
    if !status.success() {
        // ssh already said why on stderr.
        std::process::exit(status.code().unwrap_or(255));
    }
    Ok(())
}

pub fn ssh_config(ctx: &Ctx) -> anyhow::Result<()> {
    println!("# Otherix: `ssh USER@VM.otherix` goes through the broker and a gateway.");
    println!("Host *{SSH_SUFFIX}");
    // No HostKeyAlias: ssh does not expand `%h` in it, and the host name is already
    // the VM's, so keys are remembered as `VM.otherix` (as `otherix ssh` does).
    println!("    ProxyCommand {} connect %h %p", proxy_command(ctx)?);
    Ok(())
}

/// This binary, with the config and context it uses, as a command line for
/// ssh (which runs it later, maybe from another shell: it is spelled out).
fn proxy_command(ctx: &Ctx) -> anyhow::Result<String> {
    let exe = std::env::current_exe().context("locating the otherix binary")?;
    let mut command = output::shell_word(&exe.to_string_lossy());
    if let Some(p) = &ctx.config_path {
        command.push_str(&format!(" --config {}", output::shell_word(&p.to_string_lossy())));
    }
    if let Some(name) = &ctx.context {
        command.push_str(&format!(" --context {}", output::shell_word(name)));
    }
    Ok(command)
}

fn client_and_ca(ctx: &Ctx) -> anyhow::Result<(Client, String)> {
    let client = ctx.client()?;
    let (_, context) = ctx.context()?;
    Ok((client, context.ca_pem))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_specs_are_remote_or_local_colon_remote() {
        let spec = |local, remote| PortSpec { local, remote };
        assert_eq!(PortSpec::parse("80"), Ok(spec(None, 80)));
        assert_eq!(PortSpec::parse("8080:80"), Ok(spec(Some(8080), 80)));
        assert_eq!(PortSpec::parse(":80"), Ok(spec(None, 80)));
        assert_eq!(PortSpec::parse("0:80"), Ok(spec(None, 80)));
        for bad in ["", "x", "8080:", "80:x", "1:2:3", "70000", "-1"] {
            let err = PortSpec::parse(bad).unwrap_err();
            assert!(err.contains("give REMOTE or LOCAL:REMOTE"), "{bad}: {err}");
        }
        assert!(PortSpec::parse("8080:0").unwrap_err().contains("1-65535"));
    }

    #[test]
    fn listen_addresses_follow_the_specs_or_local() {
        let ip: std::net::IpAddr = "0.0.0.0".parse().unwrap();
        let specs = [
            PortSpec::parse("5432").unwrap(),
            PortSpec::parse("8080:80").unwrap(),
        ];
        let addrs = listen_addrs(&specs, ip, None).unwrap();
        assert_eq!(
            addrs,
            vec![
                ("0.0.0.0:0".parse().unwrap(), 5432),
                ("0.0.0.0:8080".parse().unwrap(), 80)
            ]
        );
        let local: SocketAddr = "127.0.0.1:15432".parse().unwrap();
        assert_eq!(
            listen_addrs(&specs[..1], ip, Some(local)).unwrap(),
            vec![(local, 5432)]
        );
        assert!(listen_addrs(&specs, ip, Some(local)).is_err());
        assert!(listen_addrs(&specs[1..], ip, Some(local)).is_err());
    }

    #[test]
    fn ssh_suffix_names_the_vm() {
        assert_eq!(target_name("web01.otherix"), "web01");
        assert_eq!(target_name("web01"), "web01");
        assert_eq!(target_name("lb/web"), "lb/web");
    }

    #[test]
    fn connections_are_made_ready_only_once_the_principal_is_known_to_have_no_budget() {
        assert_eq!(Budget::default(), Budget::Unknown);
        assert_eq!(Budget::Unknown.learn(false), Budget::Unbudgeted);
        assert_eq!(Budget::Unknown.learn(true), Budget::Budgeted);
        assert_eq!(Budget::Unbudgeted.learn(true), Budget::Budgeted);
        // A budget once seen stays: an answer without the flag (an older
        // control plane behind a balancer, say) does not undo it.
        assert_eq!(Budget::Budgeted.learn(false), Budget::Budgeted);
    }
}
