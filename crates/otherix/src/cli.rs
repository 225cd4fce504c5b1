//! The command line, as clap types. Command code lives in `commands/`.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use otherix_proto::{GrantName, LbName, NetworkName, NodeName, UserName, VmName};

const ABOUT: &str = "Reach VMs on private networks by name: no public IPs, no NAT rules, no firewall holes.";

#[derive(Debug, Parser)]
#[command(name = "otherix", version, about = ABOUT, propagate_version = true, after_help = "\
Examples:
  otherix server --data-dir /var/lib/otherix
  otherix login --server https://127.0.0.1:7443 --token-file /var/lib/otherix/admin.token \\
      --ca-fingerprint sha256:...
  otherix network create web-net --type overlay --subnet 10.100.0.0/24
  otherix vm create web01 --network web-net --label app=web
  otherix vm list --selector app=web -o json
  otherix --context staging vm list      # another cluster, for one command")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,

    /// Output format of read commands.
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Format::Table)]
    pub output: Format,

    /// Log to stderr (-v info, -vv debug, -vvv trace). The daemons (`server`,
    /// `agent`, `dev`) log at info without it.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,

    /// Log lines as text for people or one JSON object per line for log
    /// collectors.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = crate::env::LOG_FORMAT)]
    pub log_format: LogFormat,

    /// Client configuration file [default: $XDG_CONFIG_HOME/otherix/config.toml].
    #[arg(long, global = true, env = crate::env::CONFIG, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Use this context (a cluster you logged in to, see `otherix context
    /// list`) instead of the current one, for this command only.
    #[arg(long, global = true, env = crate::env::CONTEXT, value_name = "NAME")]
    pub context: Option<String>,

    /// Use this grant token (from `otherix grant create`) instead of an API
    /// token; OTHERIX_GRANT holds one too.
    #[arg(long, global = true, value_name = "FILE")]
    pub grant_file: Option<PathBuf>,
}

/// Global options that apply only to some commands, by the commands they
/// do not apply to: the daemons take no client options, `dev` keeps its own
/// context, `completion` and the built-in guest workloads read no config.
const NOT_FOR: &[(&str, &[&str])] = &[
    ("server", &["output", "context", "grant_file"]),
    ("agent", &["output", "context", "grant_file"]),
    ("dev", &["output", "context", "grant_file"]),
    ("guest", &["output", "config", "context", "grant_file"]),
    ("completion", &["output", "config", "context", "grant_file"]),
    ("image", &["config", "context", "grant_file"]),
    ("context", &["context", "grant_file"]),
];

/// The command line as it is parsed, shown and completed: [`Cli`] with each
/// global option hidden where it does not apply ([`NOT_FOR`]).
pub fn command() -> clap::Command {
    shape(<Cli as clap::CommandFactory>::command())
}

/// `cmd` (the whole command line) with [`NOT_FOR`] applied: each of those
/// commands gets a hidden copy of the option, which clap's propagation of
/// global options leaves in place (and hands down to its subcommands).
pub fn shape(mut cmd: clap::Command) -> clap::Command {
    for (name, ids) in NOT_FOR {
        let hidden: Vec<clap::Arg> = ids
            .iter()
            .filter_map(|id| cmd.get_arguments().find(|a| a.get_id() == id))
            .map(|a| a.clone().hide(true))
            .collect();
        cmd = cmd.mut_subcommand(*name, |sub| {
            let fresh: Vec<clap::Arg> = hidden
                .iter()
                .filter(|a| sub.get_arguments().all(|b| b.get_id() != a.get_id()))
                .cloned()
                .collect();
            sub.args(fresh)
        });
    }
    cmd
}

/// A global option given on the command line to a command it does not
/// apply to: `Some("--context does not apply to `otherix server`")`.
pub fn misplaced(matches: &clap::ArgMatches) -> Option<String> {
    let (name, _) = matches.subcommand()?;
    let (_, ids) = NOT_FOR.iter().find(|(n, _)| *n == name)?;
    let id = ids
        .iter()
        .find(|id| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine))?;
    let flag = match *id {
        "output" => "-o/--output".to_string(),
        other => format!("--{}", other.replace('_', "-")),
    };
    Some(format!("{flag} does not apply to `otherix {name}`"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Tables for people.
    Table,
    /// JSON for programs.
    Json,
    /// YAML: the same fields as JSON, for people who read data.
    Yaml,
    /// Tables with more columns (a VM's MAC and runtime, a node's agent
    /// version and last heartbeat, a session's full id...).
    Wide,
}

impl Format {
    /// JSON or YAML: data rather than a table.
    pub fn is_data(self) -> bool {
        matches!(self, Format::Json | Format::Yaml)
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the control plane (API, broker, PKI, embedded store).
    #[command(after_help = "\
On first start this creates the cluster CA, the database and a first admin
token (written to DATA_DIR/admin.token, mode 0600), and prints the CA
fingerprint clients pin with `otherix login`.

With --database (PostgreSQL) several control planes may serve one cluster:
the first makes the cluster CA and a secret key (DATA_DIR/secret.key) that
seals it in the database; copy that file to every other replica. Point
agents and clients at every replica (`--server` repeated): they use the
next one when the one they use stops answering.

Examples:
  otherix server
  otherix server --data-dir /var/lib/otherix --listen 0.0.0.0:7443 --san cp.example.internal
  otherix server --database postgres://otherix@db.internal/otherix \
      --secret-key-file /etc/otherix/secret.key --listen 0.0.0.0:7443")]
    Server(ServerArgs),

    /// Save the control plane's address and your token as a context, pinning
    /// the cluster CA, and make it current.
    #[command(after_help = "\
The CA fingerprint is printed by `otherix server` at start. Without
--ca-fingerprint or --ca-file you are shown the fingerprint the server
presents and asked to confirm it (on a terminal only).

Each login is a context in the client config: log in to several clusters and
switch with `otherix context use NAME`, or pick one for a single command
with `--context NAME`. Without --name, logging in again to the same servers
updates their context; other servers get a context named after the host
(`cp.example` for https://cp.example:7443, `127.0.0.1:9000` for another port).
With --context (or OTHERIX_CONTEXT) and no --name, that context is updated
and the current one stays current.

Examples:
  otherix login --server https://127.0.0.1:7443 --token-file admin.token \\
      --ca-fingerprint sha256:3b1f...
  otherix login --name prod --server https://cp1:7443 --server https://cp2:7443 \\
      --token-file prod.token --ca-file prod-ca.crt
  OTHERIX_TOKEN=otx_... otherix login --server https://cp:7443 --ca-file ca.crt")]
    Login(LoginArgs),

    /// Show who you are logged in as.
    Whoami,

    /// Forget the token of the current context (or --context's).
    #[command(after_help = "\
Removes the token from the context in the client config (--config,
OTHERIX_CONFIG or the usual path); its server and CA stay, so `otherix
login --name NAME` logs in there again, and `otherix context delete NAME`
forgets it entirely. The token itself stays valid until an admin revokes
it. Doing it twice is fine.

Examples:
  otherix logout
  otherix logout --context staging
  OTHERIX_CONFIG=/tmp/dev.toml otherix logout")]
    Logout,

    /// The clusters you logged in to (contexts): list, switch, rename, delete.
    #[command(subcommand)]
    Context(ContextCommand),

    /// Print the client's version and the control plane's.
    #[command(after_help = "\
The server's version comes from GET /v1/info of the server you logged in to;
when it cannot be asked, only the client's is printed (and why, on stderr).

Examples:
  otherix version
  otherix version -o json")]
    Version,

    /// Manage users, their API tokens and access rules (admin).
    #[command(subcommand)]
    User(UserCommand),

    /// Manage networks: VXLAN overlays and host-local bridges.
    #[command(subcommand)]
    Network(NetworkCommand),

    /// Manage VMs: create, list by label selector, label, delete.
    #[command(subcommand)]
    Vm(VmCommand),

    /// Guest images of the QEMU runtime (kept on each node).
    #[command(subcommand)]
    Image(ImageCommand),

    /// Run a node agent: enroll with a join token, then keep the node's
    /// networks and guests as the control plane wants them, and serve the
    /// roles it was granted (gateway, relay).
    #[command(after_help = "\
The node's name and roles come from its join token (`otherix node join-token
create --name N --hypervisor | --gateway IP:PORT`) and change with `otherix
node update`; the agent follows within a heartbeat.

Examples:
  otherix agent --server https://10.0.0.1:7443 --ca-fingerprint sha256:... \\
      --join-token-file /etc/otherix/join-token --name node1
  OTHERIX_AGENT_JOIN_TOKEN=otxj_... otherix agent --server https://10.0.0.1:7443 \\
      --ca-fingerprint sha256:... --name node1
  otherix agent --server https://10.0.0.1:7443 --ca-file ca.crt --join-token otxj_... \\
      --name gw1 --gateway 10.0.0.5:8443      # pinned: refuses to run as anything else")]
    Agent(AgentArgs),

    /// Open a tunnel to VM:PORT on stdin/stdout (an SSH ProxyCommand).
    #[command(after_help = "\
Brokers one connection, connects to the endpoint the control plane names
(a gateway or the relay) with the single-use credential, and copies bytes
between it and stdin/stdout until both sides are done.

Examples:
  ssh -o ProxyCommand='otherix connect %h %p' root@web01
  printf 'GET / HTTP/1.0\\r\\n\\r\\n' | otherix connect web01 80")]
    Connect {
        /// VM name (a trailing `.otherix` is ignored), or `lb/NAME`.
        target: String,
        port: u16,
    },

    /// Attach the terminal to a QEMU guest's serial console (an admin, or a
    /// user whose access rule for the VM lists `console`).
    #[command(after_help = "\
Through the control plane's relay to the guest's node, on any network, like
a connection: a single-use ticket, audited with its start, end and bytes.
On a terminal every key goes to the guest; Ctrl-] detaches (the guest keeps
running). From a pipe, stdin is sent and the command ends once the guest has
been quiet for 2 s after it.

Examples:
  otherix console web01
  echo 'uname -a' | otherix console web01")]
    Console {
        /// The VM (a QEMU guest).
        vm: String,
    },

    /// Forward local ports to a VM's ports; every connection is brokered anew.
    #[command(after_help = "\
Each PORT is REMOTE (a free local port is picked and printed) or
LOCAL:REMOTE, as kubectl port-forward takes them; several in one process.
One line per forward is printed on stdout: the local address, in the order
given. At start the target is checked once, by brokering one credential
(kept as the first ready connection): an unknown VM, a missing access rule
or a VM not running fails at once with the control plane's answer, before
anything listens. (A grant with --max-connections is not checked ahead:
each credential brokered would spend one of them.)

Every connection gets its own single-use credential. So that a new
connection does not wait for the broker and a TLS handshake, forward keeps a
few of them ready: brokered ahead, each with its TLS connection open to the
gateway (for a relay VM, to the control plane). One is made at start;
each connection uses one and has the next ones made, up to --ready; one
unused for --ready-keep is dropped (its credential is never presented, so it
lets nobody in), and so is one whose credential expires within 2s (a grant
about to end); an idle forward keeps none. If a ready one is refused (the
VM moved, the gateway or the control plane restarted), the connection is
brokered anew.
--ready 0 turns this off: each connection brokers when it arrives.

A connection through the control plane's relay (a VM on a bridge network)
resumes when its connection to the control plane drops, the control plane
restarts or a replica dies, and follows the VM when it migrates: stderr says
`relay: connection lost (...), resuming (attempt N)...` and `relay: resumed`.
OTHERIX_RELAY_RESUME=off asks for plain relay sessions instead, which end
with their connection.

For `lb/NAME` it is off unless --ready is given: a ready credential has its
backend chosen already, up to --ready-keep (2s there) ahead, so a backend
relabeled out of the pool or found unhealthy could still get the
connections made ready just before; without them every connection follows
the pool as it is when the connection arrives.

Examples:
  otherix forward db01 15432:5432 &  psql -h 127.0.0.1 -p 15432
  otherix forward web01 80          # prints the local address it picked
  otherix forward web01 8080:80 2222:22 --address 0.0.0.0
  otherix forward lb/web-lb 80 --ready 0   # broker only when a connection arrives")]
    Forward {
        /// VM name, or `lb/NAME`.
        target: String,
        /// REMOTE or LOCAL:REMOTE, one or more (REMOTE alone: a free local
        /// port).
        #[arg(required = true, value_name = "PORT", value_parser = crate::commands::connect::PortSpec::parse)]
        ports: Vec<crate::commands::connect::PortSpec>,
        /// Local IP address to listen on.
        #[arg(
            long,
            value_name = "IP",
            default_value = "127.0.0.1",
            conflicts_with = "local"
        )]
        address: std::net::IpAddr,
        /// Local address and port to listen on, for a single REMOTE port
        /// (the same as --address IP with LOCAL:REMOTE).
        #[arg(long, value_name = "ADDR:PORT")]
        local: Option<std::net::SocketAddr>,
        /// Connections kept ready (brokered, TLS open) while connections
        /// arrive; 0: none [default: 4; 0 for `lb/NAME`].
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(0..=64))]
        ready: Option<u16>,
        /// How long a ready connection is kept unused [default: 8s; 2s for
        /// `lb/NAME`; at most 9s, as gateways close a connection that sends
        /// nothing for 10s].
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        ready_keep: Option<std::time::Duration>,
    },

    /// SSH to a VM with the system `ssh`, through Otherix.
    #[command(after_help = "\
Runs `ssh -o ProxyCommand='otherix connect %h %p' ...`, so your keys, agent
and ssh options work as usual.

Examples:
  otherix ssh root@web01
  otherix ssh web01 -- -L 8080:localhost:80 uptime
  otherix ssh web01 -- -o BatchMode=yes true   # ssh's options after --
                                               # (-o before it is otherix's output flag)")]
    Ssh {
        /// [USER@]VM
        destination: String,
        /// SSH port on the VM.
        #[arg(short, long, default_value_t = 22)]
        port: u16,
        /// Arguments passed to ssh after the destination (a command, options).
        #[arg(last = true)]
        ssh_args: Vec<String>,
    },

    /// Print a ~/.ssh/config stanza so plain `ssh VM.otherix` works.
    #[command(
        name = "ssh-config",
        after_help = "Examples:\n  otherix ssh-config >> ~/.ssh/config && ssh root@web01.otherix"
    )]
    SshConfig,

    /// Run a whole local cluster in network namespaces (needs root).
    #[cfg(feature = "dev")]
    #[command(after_help = "\
Builds, in network namespaces on this machine: the control plane with its
embedded store, two hypervisor nodes, one standalone gateway node, an overlay
and a bridge network, and demo VMs (web01..web03 with label app=web running
`otherix guest http`, lab01 on the bridge running `otherix guest echo`).
It logs you in as the context `dev` and makes it current (config at
$OTHERIX_CONFIG or the usual path), prints what to try, and removes
everything on Ctrl-C or SIGTERM: the `dev` context too, and the context that
was current before is current again (a `dev` context of your own is put back).

With --replicas N the control plane runs N times, each replica in a
namespace of its own (cp, cp2, ...), on a PostgreSQL server it starts from
the Debian package's binaries in its state directory (apt-get install
postgresql); agents and your config know every replica. PostgreSQL runs as
the user `postgres`: a --state-dir it cannot enter is refused at once.

A daemon of the cluster that exits while it runs (a replica you `kill -9`)
is said on stderr once. Each daemon's log is in the directory printed at
start, removed on teardown unless --keep-logs. Agents get their join tokens
in files, never on a command line.

Examples:
  sudo otherix dev
  sudo otherix dev --replicas 3
  sudo otherix dev --metrics     # then: curl http://10.213.N.2:9464/metrics (printed)
  sudo otherix dev --keep-logs   # the logs outlive the cluster (where: printed)
  sudo OTHERIX_CONFIG=/tmp/dev.toml otherix dev --state-dir /tmp/otherix-dev")]
    Dev(DevArgs),

    /// Manage nodes and the join tokens they enroll with.
    #[command(subcommand)]
    Node(NodeCommand),

    /// Built-in guest workloads (need no packages in the guest).
    #[command(subcommand)]
    Guest(GuestCommand),

    /// Load balancers: a port in front of the VMs a label selector matches.
    #[command(subcommand)]
    Lb(LbCommand),

    /// External grants: one token for exactly some targets, until it expires.
    #[command(subcommand)]
    Grant(GrantCommand),

    /// Show the audit trail: every broker decision, allowed or refused, and
    /// every session's start and end (bytes each way, duration, end reason).
    #[command(
        after_help = "Sessions through a gateway are reported with the gateway node's next heartbeat\n(about a second), relay sessions as they start and end. Events come oldest\nfirst, a page at a time: stderr says how to get the next page.\n\nExamples:\n  otherix audit --since 1h\n  otherix audit --limit 100 --after 1764444327410.42\n  otherix audit --follow --principal grant:acme\n  otherix audit --follow -o json | jq -c 'select(.allowed | not)'\n  otherix audit --principal grant:acme -o json\n  otherix audit --target web01 -o json | jq '.[] | select(.action == \"session_end\")'"
    )]
    Audit(AuditArgs),

    /// Sessions open now, through gateways and the relay.
    #[command(subcommand)]
    Session(SessionCommand),

    /// Session signing keys: which signs credentials, which gateways still
    /// trust, and rotating now.
    #[command(subcommand)]
    Keys(KeysCommand),

    /// Print a shell completion script.
    #[command(after_help = "\
Examples:
  otherix completion bash > /etc/bash_completion.d/otherix
  otherix completion zsh > \"${fpath[1]}/_otherix\"
  otherix completion fish > ~/.config/fish/completions/otherix.fish")]
    Completion {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, Subcommand)]
pub enum ContextCommand {
    /// List the contexts; `*` marks the current one.
    #[command(
        after_help = "Examples:\n  otherix context list\n  otherix context list -o json | jq -r '.[] | select(.current) | .name'"
    )]
    List,
    /// Make NAME the current context: commands use it from now on.
    #[command(
        name = "use",
        after_help = "Examples:\n  otherix context use prod\n  otherix --context staging vm list   # one command elsewhere, prod stays current"
    )]
    Use { name: String },
    /// Print the current context's name.
    #[command(after_help = "Examples:\n  otherix context current")]
    Current,
    /// Rename a context (the current one stays current under its new name).
    #[command(after_help = "Examples:\n  otherix context rename 127.0.0.1:9000 lab")]
    Rename {
        old: String,
        #[arg(value_parser = crate::config::parse_name)]
        new: String,
    },
    /// Delete a context: its server, CA and token. If it was current, no
    /// context is current until `otherix context use` or `otherix login`.
    #[command(after_help = "Examples:\n  otherix context delete lab")]
    Delete { name: String },
}

/// What `otherix audit` is asked for.
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// How far back.
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
    pub since: std::time::Duration,
    /// Only this principal (`user:NAME`, `grant:NAME`).
    #[arg(long)]
    pub principal: Option<String>,
    /// Only this target (VM name or `lb/NAME`).
    #[arg(long)]
    pub target: Option<String>,
    /// Print at most N events (1-5000); with --follow, N a request.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=5000))]
    pub limit: Option<u32>,
    /// Start after this cursor (from a previous page's hint).
    #[arg(long, value_name = "CURSOR")]
    pub after: Option<String>,
    /// Then keep printing new events as they are recorded, until Ctrl-C
    /// (`-o json`: one object a line).
    #[arg(short, long)]
    pub follow: bool,
}

#[derive(Debug, Args)]
pub struct ServerArgs {
    /// Where the database, the cluster CA and the first admin token live.
    #[arg(long, default_value = "/var/lib/otherix", value_name = "DIR")]
    pub data_dir: PathBuf,
    /// Keep the store in this PostgreSQL database instead of the embedded
    /// SQLite file in --data-dir: postgres://USER@HOST/DB, or
    /// postgres:///DB?host=/run/postgresql over a Unix socket. A password
    /// is better given in PGPASSWORD or ~/.pgpass than in the URL. Several
    /// control planes (replicas) may share one database; each needs the
    /// same --secret-key-file. --print-config shows it as <hidden>.
    #[arg(long, value_name = "URL", hide_env_values = true)]
    pub database: Option<String>,
    /// Key that seals the cluster CA's key and the session keys' seeds in
    /// the store (64 hex digits, mode 0600) [default with --database:
    /// DATA_DIR/secret.key]. The first control plane makes it; give every
    /// other replica a copy. On SQLite it is optional: without it the CA
    /// key stays in DATA_DIR/ca.key.
    #[arg(long, value_name = "FILE")]
    pub secret_key_file: Option<PathBuf>,
    /// Address the API listens on.
    #[arg(long, default_value = "127.0.0.1:7443", value_name = "ADDR")]
    pub listen: SocketAddr,
    /// Extra DNS name or IP the serving certificate covers (repeatable).
    #[arg(long = "san", value_name = "NAME")]
    pub sans: Vec<String>,
    /// A node without a heartbeat for this long is NotReady.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub node_timeout: std::time::Duration,
    /// MTU of guest and overlay interfaces (underlay MTU minus VXLAN's 50 bytes).
    #[arg(long, default_value_t = 1450, value_parser = clap::value_parser!(u32).range(576..=9000))]
    pub overlay_mtu: u32,
    /// Session signing keys rotate this often.
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    pub key_rotation: std::time::Duration,
    /// Lifetime of the single-use credentials the broker mints. Gateways
    /// refuse credentials living longer than their --max-credential-lifetime
    /// (15m by default).
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub credential_ttl: std::time::Duration,
    /// Lifetime of the API tokens `otherix user token create` makes without
    /// --ttl (at most 10 years). The first admin's token, from the first
    /// start, does not expire: revoke it once other admins have theirs.
    #[arg(long, default_value = "90d", value_parser = humantime::parse_duration)]
    pub token_ttl: std::time::Duration,
    /// How long audit events are kept.
    #[arg(long, default_value = "90d", value_parser = humantime::parse_duration)]
    pub audit_retention: std::time::Duration,
    /// Lifetime of node, gateway and relay certificates (at most 30 days);
    /// agents renew them after two thirds of it.
    #[arg(long, default_value = "30d", value_parser = parse_cert_validity)]
    pub node_cert_validity: std::time::Duration,
    /// Serve Prometheus `/metrics`, `/healthz` and `/readyz` on this address
    /// (plain HTTP: a management address, not the public one). The public
    /// port serves `/healthz` and `/readyz` too.
    #[arg(long, value_name = "IP:PORT")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Most connections open to the API at once; past it new ones are
    /// closed at once.
    #[arg(long, default_value_t = 10_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_connections: usize,
    /// Most connections open at once from one source address (a flood from
    /// one client cannot starve nodes and other clients).
    #[arg(long, default_value_t = 1_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_connections_per_ip: usize,
    /// Connections kept for nodes past --max-connections: one must present
    /// a node's client certificate within 2 s or it is closed (at most 8 per
    /// source address), so a flood that fills the public slots leaves
    /// heartbeats answered. 0: no reserve.
    #[arg(long, default_value_t = 1_000)]
    pub reserved_node_connections: usize,
    /// Broker calls per second each principal (user, grant) may make; 0
    /// turns the limit off. Past it the broker answers 429 with Retry-After.
    #[arg(long, default_value_t = 500.0, value_name = "PER_SECOND")]
    pub broker_rate: f64,
    /// Relay sessions end this long after they opened, busy or not (audited
    /// with reason `max_lifetime`); agents have their own for the gateway.
    #[arg(long, default_value = "12h", value_parser = humantime::parse_duration)]
    pub max_session: std::time::Duration,
    /// Broker calls a principal may make at once above its rate.
    #[arg(long, default_value_t = 1000.0, value_name = "CALLS")]
    pub broker_burst: f64,
    /// Most sessions one principal (user, grant) may have open through
    /// gateways and the relay; past it the broker and the relay answer 429.
    /// 0 turns the limit off.
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub max_sessions_per_principal: usize,
    /// After a relay session to a node, keep one mutual-TLS connection to
    /// that node's relay endpoint ready this long for its next session (so
    /// that one skips the handshake). At most 9s (agents close a connection
    /// without a request after 10s); 0s turns it off.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub relay_ready_keep: std::time::Duration,
    /// How long a relay session whose client connection dropped (or whose
    /// control plane went away) waits for the client to resume it, through
    /// any replica, byte-exact. At most 10m; 0s: relay sessions end with
    /// their connection, as before.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub relay_resume_grace: std::time::Duration,
    /// Most bytes each end of a resumable relay session keeps until the
    /// other acknowledges them (a sender with that much unacknowledged waits).
    /// From 64KiB to 256MiB.
    #[arg(long, default_value = "8MiB", value_parser = parse_bytes, value_name = "BYTES")]
    pub relay_resume_buffer: usize,
    /// Longest a gateway keeps an overlay it no longer needs while its open
    /// sessions there drain.
    #[arg(long, default_value = "12h", value_parser = humantime::parse_duration)]
    pub max_drain: std::time::Duration,
    #[command(flatten)]
    pub file: RoleConfigArgs,
}

/// The config file of `server` and `agent` (see `service_config.rs`); every
/// other flag of theirs is also a file key and an environment variable.
#[derive(Debug, Args)]
pub struct RoleConfigArgs {
    /// TOML file whose keys are this command's flags, `-` written `_`
    /// [default: /etc/otherix/server.toml or agent.toml, when it exists;
    /// OTHERIX_SERVER_CONFIG or OTHERIX_AGENT_CONFIG name another]. Every
    /// flag is also read from OTHERIX_SERVER_<FLAG> or OTHERIX_AGENT_<FLAG>.
    /// Flags win over the environment, which wins over the file.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the effective settings as JSON, with where each came from (flag,
    /// env, file, default), and exit.
    #[arg(long)]
    pub print_config: bool,
}

/// A certificate lifetime: at least a few seconds (renewal happens at two
/// thirds), at most 30 days.
/// `--guest-rto-min`: 0 (the kernel's floor) or 1 ms to 200 ms, what the
/// kernel takes.
fn parse_rto_floor(s: &str) -> anyhow::Result<std::time::Duration> {
    let d = humantime::parse_duration(s)?;
    if !d.is_zero()
        && !(std::time::Duration::from_millis(1)..=std::time::Duration::from_millis(200)).contains(&d)
    {
        anyhow::bail!("expected 0 (the kernel's floor) or between 1ms and 200ms");
    }
    Ok(d)
}

fn parse_migration_downtime(s: &str) -> anyhow::Result<std::time::Duration> {
    let d = humantime::parse_duration(s)?;
    if !(std::time::Duration::from_millis(1)..=std::time::Duration::from_secs(10)).contains(&d) {
        anyhow::bail!("expected between 1ms and 10s");
    }
    Ok(d)
}

fn parse_cert_validity(s: &str) -> anyhow::Result<std::time::Duration> {
    let d = humantime::parse_duration(s)?;
    if d < std::time::Duration::from_secs(10) || d > std::time::Duration::from_secs(30 * 86_400) {
        anyhow::bail!("expected between 10s and 30d");
    }
    Ok(d)
}

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// Control plane URL. Repeat it for the replicas of a cluster (or give
    /// a name that resolves to each): when the one in use stops answering,
    /// the agent heartbeats to the next.
    #[arg(long, required = true)]
    pub server: Vec<String>,
    /// Join token (first start only; later starts reuse the node's identity).
    /// On a command line it shows in `ps` to every user of the host: prefer
    /// --join-token-file or the environment.
    #[arg(long, hide_env_values = true)]
    pub join_token: Option<String>,
    /// Read the join token from this file (keep it 0600; first start only:
    /// once the node is enrolled the file may go).
    #[arg(long, value_name = "FILE", conflicts_with = "join_token")]
    pub join_token_file: Option<PathBuf>,
    /// This node's name (a DNS label).
    #[arg(long)]
    pub name: NodeName,
    /// Pin the roles: refuse to run unless granted exactly these (the
    /// hypervisor role, and the gateway at this address or none). Without
    /// --hypervisor or --gateway the agent runs whatever its join token and
    /// `otherix node update` granted.
    #[arg(long)]
    pub hypervisor: bool,
    /// Pin the gateway role at this advertised IP:PORT (see --hypervisor).
    #[arg(long, value_name = "IP:PORT")]
    pub gateway: Option<String>,
    /// Where the node's key, certificate and last desired state live.
    #[arg(long, default_value = "/var/lib/otherix-agent", value_name = "DIR")]
    pub data_dir: PathBuf,
    /// Expected cluster CA fingerprint (sha256:...).
    #[arg(long, value_name = "sha256:HEX", conflicts_with = "ca_file")]
    pub ca_fingerprint: Option<String>,
    /// Trust this cluster CA certificate (PEM).
    #[arg(long, value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
    /// Underlay address used as the VXLAN tunnel endpoint [default: the
    /// local address of the connection to the control plane].
    #[arg(long, value_name = "IP")]
    pub vtep: Option<std::net::Ipv4Addr>,
    /// How often to heartbeat.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub heartbeat_interval: std::time::Duration,
    /// With --gateway: refuse credentials living longer than this (`exp`
    /// less the earlier of `iat` and `nbf`). Keep it above the control
    /// plane's --credential-ttl.
    #[arg(long, default_value = "15m", value_parser = humantime::parse_duration)]
    pub max_credential_lifetime: std::time::Duration,
    /// Gateway and relay sessions end this long after they opened, busy or
    /// not (audited with reason `max_lifetime`).
    #[arg(long, default_value = "12h", value_parser = humantime::parse_duration)]
    pub max_session: std::time::Duration,
    /// With the gateway role: most sessions one principal may have open
    /// through this gateway (past it 429; others still get in), and most
    /// credentials of one principal its replay cache holds (ten times
    /// this). A twentieth of the gateway's 10000 connections by default, at
    /// most half; a principal that needs more should use several identities
    /// or a gateway of its own.
    #[arg(long, default_value_t = 500, value_name = "N", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub gateway_max_sessions_per_principal: usize,
    /// With the gateway role: most connections it holds at once, in any
    /// stage (a TLS handshake under way included); past it new ones are
    /// answered 503.
    #[arg(long, default_value_t = otherix_ingress::DEFAULT_MAX_CONNECTIONS, value_name = "N", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub gateway_max_connections: usize,
    /// With the gateway role: most connections from one source address, in
    /// any stage; past it a new one is closed at once, so one host holding
    /// half-open handshakes cannot fill the gateway.
    #[arg(long, default_value_t = otherix_ingress::DEFAULT_MAX_CONNECTIONS_PER_SOURCE, value_name = "N", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub gateway_max_connections_per_source: usize,
    /// Most connections the relay endpoint holds at once.
    #[arg(long, default_value_t = otherix_ingress::DEFAULT_MAX_CONNECTIONS, value_name = "N", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub relay_max_connections: usize,
    /// Most relay connections from one source address (one control-plane
    /// replica): half of them by default, so any one leaves room for the others.
    #[arg(long, default_value_t = otherix_ingress::DEFAULT_MAX_CONNECTIONS / 2, value_name = "N", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub relay_max_connections_per_source: usize,
    /// The gateway's and the relay endpoint's TLS handshakes must be done
    /// within this of the accept; slower ones are cut.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub handshake_timeout: std::time::Duration,
    /// Addresses or networks (IP or IP/PREFIX, repeatable) the relay
    /// endpoint accepts connections from besides the control planes'
    /// (--server, resolved): for a control plane whose dials leave from
    /// another address (NAT, a second interface). Any other source is
    /// closed before its TLS handshake.
    #[arg(long, value_name = "IP[/PREFIX]")]
    pub relay_allow_from: Vec<otherix_ingress::relay::SourceNet>,
    /// Name prefix of guest network namespaces.
    #[arg(long, default_value = "oxg")]
    pub netns_prefix: String,
    /// Where the relay endpoint listens, when granted: IP:PORT, :PORT (on
    /// the VTEP address) or `off` [default: the granted relay address].
    #[arg(long, value_name = "IP:PORT|:PORT|off")]
    pub relay_listen: Option<otherix_agent::daemon::relay::RelayListen>,
    /// Serve Prometheus `/metrics`, `/healthz` and `/readyz` (ready: enrolled
    /// and a heartbeat answered recently) on this address (plain HTTP: a
    /// management address).
    #[arg(long, value_name = "IP:PORT")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Accelerator of QEMU guests: `auto` takes KVM where /dev/kvm can run a
    /// stock guest kernel and TCG otherwise (a PVM host's /dev/kvm cannot).
    #[arg(long, value_name = "auto|kvm|tcg", default_value = "auto")]
    pub qemu_accel: otherix_agent::runtime::qemu::AccelChoice,
    /// Where QEMU guest images are kept, and built on first use
    /// [default: /var/cache/otherix/images, or $OTHERIX_IMAGE_CACHE].
    #[arg(long, value_name = "DIR")]
    pub image_cache: Option<std::path::PathBuf>,
    /// The QEMU binary QEMU guests run under.
    #[arg(long, value_name = "PATH", default_value = "qemu-system-x86_64")]
    pub qemu_binary: std::path::PathBuf,
    /// Most bytes a second a QEMU guest's live migration sends from this
    /// node, e.g. 100M [default: QEMU's own].
    #[arg(long, value_name = "BYTES", value_parser = parse_bandwidth)]
    pub qemu_migration_bandwidth: Option<u64>,
    /// Longest a QEMU guest may stand still when its live migration from
    /// this node switches over (QEMU's downtime limit): QEMU copies memory
    /// until what is left fits in it. A migration starts at 10ms (this, if
    /// lower) and is allowed more, doubling each pass over the guest's
    /// memory after the third, up to this, only when the guest writes
    /// memory faster than that lets it finish. 1ms to 10s.
    #[arg(long, default_value = "50ms", value_name = "DURATION", value_parser = parse_migration_downtime)]
    pub qemu_migration_downtime: std::time::Duration,
    /// Floor of the retransmission timeout of the gateway's and the relay
    /// endpoint's own connections to guests, in place of Linux's 200 ms
    /// (Linux 6.15 on; the kernel rounds it up to whole ticks): what a
    /// guest's live migration loses in flight is sent again after about
    /// this. 1ms to 200ms, or 0 for the kernel's floor. Guests' own sockets
    /// are never changed.
    #[arg(long, default_value = "10ms", value_name = "DURATION", value_parser = parse_rto_floor)]
    pub guest_rto_min: std::time::Duration,
    #[command(flatten)]
    pub file: RoleConfigArgs,
}

#[cfg(feature = "dev")]
#[derive(Debug, Args)]
pub struct DevArgs {
    /// Where the control plane's and agents' data live [default: a temporary directory].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Control-plane replicas; more than one share a PostgreSQL server the
    /// dev cluster starts.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=5))]
    pub replicas: u8,
    /// The demo VMs' runtime: `netns` (namespaces, instant) or `qemu` (real
    /// Linux VMs; needs qemu-system-x86; the guest image is built on first
    /// use; your ~/.ssh/id_*.pub, if any, is their root's key).
    #[arg(long, value_name = "netns|qemu", default_value = "netns")]
    pub runtime: otherix_proto::Runtime,
    /// Every control plane and agent serves Prometheus `/metrics` (and
    /// `/healthz`, `/readyz`) on its address in the cluster, port 9464 for
    /// control planes and 9465 for agents; the URLs are printed.
    #[arg(long)]
    pub metrics: bool,
    /// On teardown, keep the daemons' logs (copied out of the temporary
    /// directory before it goes: to --state-dir/logs/TIME, or
    /// $TMPDIR/otherix-dev-logs-TIME without one).
    #[arg(long)]
    pub keep_logs: bool,
}

/// Health-check settings shared by `lb create` and `lb update`.
#[derive(Debug, Args)]
pub struct LbHealthArgs {
    /// Probe another port than the LB's.
    #[arg(long, value_name = "PORT")]
    pub health_port: Option<u16>,
    /// `tcp` (connect) or `http:/path` (GET, expecting 2xx) [create default: tcp].
    #[arg(long, value_name = "tcp|http:/PATH")]
    pub health: Option<String>,
    /// How often each backend is probed [create default: 5s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub interval: Option<std::time::Duration>,
    /// Probe timeout, below the interval [create default: 2s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub timeout: Option<std::time::Duration>,
    /// Consecutive successes that make an unhealthy backend healthy [create default: 2].
    #[arg(long)]
    pub rise: Option<u32>,
    /// Consecutive failures that make a backend unhealthy [create default: 3].
    #[arg(long)]
    pub fall: Option<u32>,
}

#[derive(Debug, Subcommand)]
pub enum LbCommand {
    /// Create a load balancer over the VMs a selector matches.
    #[command(after_help = "\
The pool is computed: VMs that match the selector now (labels changed with
`vm label`, new VMs) join or leave at once. Each connection picks a healthy
backend; one with no verdict yet is served.

Examples:
  otherix lb create web-lb --port 80 --selector app=web
  otherix lb create api --port 8080 --selector 'app=api,tier!=canary' --health http:/healthz --interval 2s")]
    Create {
        name: LbName,
        /// The backends' port.
        #[arg(long)]
        port: u16,
        /// Label selector of the pool (Kubernetes syntax: k=v, k!=v,
        /// k in (a,b), k notin (a,b), k, !k), e.g. `app=web,tier!=canary`.
        #[arg(long)]
        selector: String,
        #[command(flatten)]
        health: LbHealthArgs,
    },
    /// List load balancers: status and healthy/total targets.
    List,
    /// Show a load balancer and each backend's health.
    #[command(
        after_help = "Examples:\n  otherix lb get web-lb\n  otherix lb get web-lb --watch          # redraws as backends change\n  otherix lb get web-lb -w -o json       # one document a change"
    )]
    Get {
        name: String,
        /// Print again whenever it changes, until Ctrl-C.
        #[arg(short, long)]
        watch: bool,
    },
    /// Change a load balancer's port, selector or health check.
    Update {
        name: String,
        #[arg(long)]
        port: Option<u16>,
        #[arg(long)]
        selector: Option<String>,
        #[command(flatten)]
        health: LbHealthArgs,
    },
    /// Delete a load balancer (open connections are not cut).
    Delete { name: String },
}

#[derive(Debug, Subcommand)]
pub enum GrantCommand {
    /// Create a grant; its token is printed once, to stdout.
    #[command(after_help = "\
With --file, the grant is written ready to send: the control plane's URLs
and CA fingerprint (this context's) with the token, mode 0600. Its holder
runs one command:
  otherix login --grant-file acme.grant
A token alone (stdout) needs the URL and fingerprint beside it:
  otherix login --server URL --ca-fingerprint sha256:... --grant-file acme.token

Examples:
  otherix grant create acme --target web01:443 --target db01:5432 --ttl 24h --file acme.grant
  otherix grant create ci --target web01:22 --ttl 1h --max-connections 3 > ci.token")]
    Create {
        name: GrantName,
        /// A `VM:PORT` or `lb/NAME:PORT` the grant allows (repeatable). A VM
        /// target is bound to the VM that has the name now: one deleted and
        /// re-created under it later is not reached. An `lb/NAME` target
        /// reaches whatever the load balancer's selector matches at each
        /// connection.
        #[arg(long = "target", required = true, value_name = "TARGET:PORT")]
        targets: Vec<String>,
        /// How long the grant is valid.
        #[arg(long, value_parser = humantime::parse_duration)]
        ttl: std::time::Duration,
        /// Refuse connections after this many.
        #[arg(long)]
        max_connections: Option<u32>,
        /// Write a grant file for its holder (URLs, CA fingerprint, token;
        /// mode 0600) instead of printing the token. An existing file is
        /// not overwritten.
        #[arg(long, value_name = "FILE")]
        file: Option<PathBuf>,
    },
    /// List grants: targets, expiry, use, state.
    List,
    /// Show a grant.
    Get { name: String },
    /// Revoke a grant: new connections are refused at once, and its open
    /// sessions end (audited with reason `revoked`) within a heartbeat.
    Revoke { name: String },
}

#[derive(Debug, Subcommand)]
pub enum SessionCommand {
    /// List open sessions: who, to what, through which node, since when,
    /// and the bytes each way so far. Admins and viewers see all; a user
    /// sees their own.
    #[command(
        visible_alias = "ls",
        after_help = "Byte counts are as last reported: a gateway's with its heartbeats, the relay's\nevery 3 seconds (`--watch` shows them grow).\n\nExamples:\n  otherix session list\n  otherix session list --principal grant:acme\n  otherix session list --target web01 -o json\n  otherix session list --watch"
    )]
    List {
        /// Only this principal (`user:NAME`, `grant:NAME`).
        #[arg(long)]
        principal: Option<String>,
        /// Only sessions to this VM.
        #[arg(long)]
        target: Option<String>,
        /// Only sessions through this node (gateway, or the relay's node).
        #[arg(long)]
        node: Option<String>,
        /// Print again whenever the list changes, until Ctrl-C.
        #[arg(short, long)]
        watch: bool,
    },
    /// End one open session (admins): only that session, reason `ended by
    /// an admin`, audited. The principal's other sessions, to the same VM
    /// and port too, go on, and it may connect again at once.
    #[command(
        after_help = "A gateway ends it within a heartbeat, the relay at once (also a resumable\nsession waiting for a resume). ID is the whole id: `session list -o wide`.\n\nExamples:\n  otherix session end 6f1c2d0e-...\n  otherix session end \"$(otherix session list --principal grant:acme -o json | jq -r '.[0].id')\""
    )]
    End {
        /// The session's whole id (`session list -o wide`).
        id: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// List session signing keys: kid, created, state (next, current,
    /// previous, retired), when each signs from and when it expires.
    /// Admins and viewers.
    #[command(
        visible_alias = "ls",
        after_help = "A previous key is trusted by gateways until it expires: when the key after it\ntook over, plus the longest credential life and the clock skew.\n\nExamples:\n  otherix keys list\n  otherix keys list -o json | jq -r '.[] | select(.state == \"current\") | .kid'"
    )]
    List,
    /// Rotate the session signing key now (admin): a new key is published to
    /// every gateway at once and signs within seconds (the command returns
    /// when it does); the previous key stays trusted until every credential
    /// it signed has expired, so no session and no credential already
    /// handed out is cut.
    #[command(after_help = "Examples:\n  otherix keys rotate\n  otherix keys rotate -o json")]
    Rotate,
}

#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// List nodes: roles, Ready/NotReady, gateway endpoint, guests.
    #[command(
        after_help = "Examples:\n  otherix node list\n  otherix node list --watch      # redraws when a node changes\n  otherix node list -w -o json   # one document a change"
    )]
    List {
        /// Ask again every second; print again when the answer changed.
        #[arg(long, short = 'w')]
        watch: bool,
    },
    /// Show a node.
    Get { name: String },
    /// Delete a node (refused while it hosts guests, unless --force). Its
    /// certificates are revoked at once.
    Delete {
        name: String,
        /// Delete anyway; its overlay guests are rescheduled.
        #[arg(long)]
        force: bool,
    },
    /// Change what a node may be: its roles and addresses are granted here,
    /// never taken from the node. A running agent follows within a heartbeat.
    #[command(after_help = "Examples:
  otherix node update node1 --gateway 10.0.0.11:8443     # node1 also serves ingress
  otherix node update gw1 --no-gateway                    # withdraw the gateway role
  otherix node update node2 --relay 192.0.2.7:7444        # the CP dials its relay there
  otherix node update node3 --vtep 198.51.100.4           # behind NAT: its VXLAN endpoint")]
    Update {
        name: String,
        /// Host guests on it.
        #[arg(long, conflicts_with = "no_hypervisor")]
        hypervisor: bool,
        /// Stop placing guests on it.
        #[arg(long)]
        no_hypervisor: bool,
        /// Serve ingress at this advertised address.
        #[arg(long, value_name = "IP:PORT", conflicts_with = "no_gateway")]
        gateway: Option<String>,
        /// Withdraw the gateway role.
        #[arg(long)]
        no_gateway: bool,
        /// Where the CP dials its relay endpoint: IP:PORT, `off`, or `auto`
        /// (port 7444 on a hypervisor's VTEP).
        #[arg(long, value_name = "IP:PORT|off|auto")]
        relay: Option<String>,
        /// Its VXLAN endpoint when it is not the address its connections
        /// come from (NAT); `auto` for that address.
        #[arg(long, value_name = "IP|auto")]
        vtep: Option<String>,
    },
    /// Manage join tokens.
    #[command(subcommand, name = "join-token")]
    JoinToken(JoinTokenCommand),
}

#[derive(Debug, Subcommand)]
pub enum JoinTokenCommand {
    /// Create a single-use join token that enrolls one node, under one name,
    /// with the roles given here; printed once, to stdout.
    #[command(
        after_help = "A node is what its token granted, never what it asserts: it cannot take \
another node's name, and roles change only with `otherix node update`.

Examples:
  otherix node join-token create --name node1 --hypervisor
  otherix node join-token create --name gw1 --gateway 10.0.0.10:8443 --ttl 30m
  otherix node join-token create --name node1 --hypervisor --replace   # re-enroll node1 (new disk, new key)"
    )]
    Create {
        /// The node it enrolls (a DNS label).
        #[arg(long, value_name = "NAME")]
        name: NodeName,
        /// The node hosts guests.
        #[arg(long)]
        hypervisor: bool,
        /// The node serves ingress at this advertised address.
        #[arg(long, value_name = "IP:PORT")]
        gateway: Option<String>,
        /// Where the CP dials its relay endpoint: IP:PORT or `off` [default:
        /// port 7444 on a hypervisor's VTEP].
        #[arg(long, value_name = "IP:PORT|off")]
        relay: Option<String>,
        /// Its VXLAN endpoint, when not the address its connections come from.
        #[arg(long, value_name = "IP")]
        vtep: Option<String>,
        /// Replace the enrolled node of this name: its certificates are
        /// revoked when the token is used.
        #[arg(long)]
        replace: bool,
        /// How long it stays valid.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        ttl: std::time::Duration,
    },
}

#[derive(Debug, Subcommand)]
pub enum GuestCommand {
    /// HTTP server answering every request with the VM's name.
    Http {
        #[arg(long, default_value_t = 80)]
        port: u16,
        /// Name to answer with [default: $OTHERIX_VM_NAME, set by the agent].
        #[arg(long, env = crate::env::VM_NAME)]
        name: Option<String>,
    },
    /// TCP echo server.
    #[command(
        after_help = "Examples:\n  otherix guest echo --port 7\n  otherix guest echo --port 25 --banner '220 mail ready'   # speaks first, like SMTP or SSH"
    )]
    Echo {
        #[arg(long, default_value_t = 7)]
        port: u16,
        /// A line sent to each client as soon as it connects, before
        /// anything is read from it (a server that speaks first).
        #[arg(long, value_name = "TEXT")]
        banner: Option<String>,
    },
}

#[derive(Debug, Args)]
pub struct LoginArgs {
    /// Control plane URL, e.g. https://127.0.0.1:7443. Repeat it for the
    /// replicas of a cluster: commands use the next one when one does not
    /// answer. Required, unless --grant-file is a whole grant file (from
    /// `otherix grant create --file`), which names them.
    #[arg(long)]
    pub server: Vec<String>,
    /// API token (prefer --token-file or OTHERIX_TOKEN: arguments are visible in `ps`).
    #[arg(
        long,
        env = crate::env::TOKEN,
        hide_env_values = true,
        conflicts_with = "token_file"
    )]
    pub token: Option<String>,
    /// Read the API token from a file.
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Expected cluster CA fingerprint (sha256:...), as printed by `otherix server`.
    #[arg(long, value_name = "sha256:HEX", conflicts_with = "ca_file")]
    pub ca_fingerprint: Option<String>,
    /// Trust this cluster CA certificate (PEM), e.g. DATA_DIR/ca.crt.
    #[arg(long, value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
    /// The context to save the login as [default: the context of these
    /// servers, else their host's name].
    #[arg(long, value_name = "NAME", value_parser = crate::config::parse_name)]
    pub name: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum UserCommand {
    /// Create a user.
    #[command(
        after_help = "Examples:\n  otherix user create alice --role user\n  otherix user create ci --role viewer"
    )]
    Create {
        name: UserName,
        #[arg(long, value_enum)]
        role: RoleArg,
    },
    /// List users.
    List,
    /// Show a user with its access rules and tokens.
    Get { name: String },
    /// Delete a user and its tokens (the last admin cannot be deleted); its
    /// open sessions end (reason `revoked`).
    Delete { name: String },
    /// Manage a user's API tokens.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Let a user (role `user`) broker to VMs matching a selector, on some ports.
    #[command(
        after_help = "Examples:\n  otherix user allow alice --selector app=web --ports 22,80\n  otherix user allow bob --selector 'env in (dev,staging)' --ports 5432\n  otherix user allow ops --selector team=ops --ports 22,console   # and their serial consoles"
    )]
    Allow {
        name: String,
        /// Label selector, e.g. `app=web,tier!=canary`. It must require at
        /// least one label (`k=v`, `k in (...)` or `k`): one made only of
        /// `!=`, `notin` and `!k` would admit any VM created without labels,
        /// and is refused.
        #[arg(long)]
        selector: String,
        /// Comma-separated ports; `console` allows the VMs' serial console
        /// (`otherix console`: a root shell on a QEMU guest).
        #[arg(long, value_delimiter = ',', required = true, value_parser = parse_rule_port)]
        ports: Vec<u16>,
    },
    /// Remove one of a user's access rules (see `user get` for rule ids);
    /// sessions only it allowed end (reason `revoked`).
    Disallow {
        name: String,
        #[arg(long)]
        rule: i64,
    },
}

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Create an API token; it is printed once, to stdout. It expires after
    /// --ttl, or the server's --token-ttl (90 days unless set).
    #[command(
        after_help = "Examples:\n  otherix user token create alice > alice.token\n  otherix user token create ci --ttl 30d > ci.token"
    )]
    Create {
        user: String,
        /// How long it works (e.g. 12h, 30d; at most 10 years) [default:
        /// the server's --token-ttl].
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        ttl: Option<std::time::Duration>,
    },
    /// List a user's API tokens: created, expires, last used.
    #[command(visible_alias = "ls")]
    List { user: String },
    /// Revoke an API token by id (see `user token list`); sessions brokered
    /// with it end (reason `revoked`).
    Revoke { user: String, id: String },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum RoleArg {
    Admin,
    User,
    Viewer,
}

#[derive(Debug, Subcommand)]
pub enum NetworkCommand {
    /// Create a network.
    #[command(
        after_help = "Examples:\n  otherix network create web-net --type overlay --subnet 10.100.0.0/24\n  otherix network create lab --type bridge --subnet 10.101.0.0/24 --node node1\n  otherix network create lan --type bridge --subnet 10.102.0.0/24 --node node1 --node node2"
    )]
    Create {
        name: NetworkName,
        #[arg(long = "type", value_enum)]
        kind: NetworkTypeArg,
        /// IPv4 CIDR; the first address is the node side, the rest are leased.
        #[arg(long)]
        subnet: String,
        /// A node a bridge network exists on (repeatable): each gets a bridge
        /// of its own, and the network's VMs can migrate between them.
        #[arg(long = "node", value_name = "NODE")]
        nodes: Vec<NodeName>,
    },
    /// List networks.
    List,
    /// Show a network.
    Get { name: String },
    /// Delete a network (refused while VMs use it).
    Delete { name: String },
    /// Add a node to a bridge network, or remove one.
    #[command(subcommand)]
    Node(NetworkNodeCommand),
}

#[derive(Debug, Subcommand)]
pub enum NetworkNodeCommand {
    /// The bridge network also exists on NODE from now on (a bridge of its
    /// own, the same subnet and node-side address); its VMs may run or
    /// migrate there.
    #[command(after_help = "Examples:\n  otherix network node add lan node2")]
    Add { network: String, node: NodeName },
    /// The bridge network no longer exists on NODE (refused while NODE hosts
    /// VMs of it: migrate or delete them first).
    #[command(after_help = "Examples:\n  otherix network node remove lan node1")]
    Remove { network: String, node: String },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum NetworkTypeArg {
    /// Cross-node L2 over VXLAN.
    Overlay,
    /// A host-local Linux bridge on each of its nodes (--node).
    Bridge,
}

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Build a guest image from Debian packages on this machine: the Debian
    /// cloud kernel and a busybox initramfs with dropbear.
    #[command(after_help = "\
Downloads the packages with `apt-get download` (nothing is installed, nothing
comes from anywhere but the machine's apt sources), unpacks them and writes
vmlinuz and initrd.cpio into the image cache. An agent builds the image it
needs on first use too; building ahead saves that wait.

Examples:
  otherix image build
  otherix image build --rebuild
  otherix image build --cache-dir /var/cache/otherix/images")]
    Build {
        /// The image's name.
        #[arg(default_value = "default")]
        name: String,
        /// Build again even if the image is there.
        #[arg(long)]
        rebuild: bool,
        /// The image cache [default: /var/cache/otherix/images for root,
        /// else $XDG_CACHE_HOME/otherix/images; $OTHERIX_IMAGE_CACHE].
        #[arg(long, value_name = "DIR")]
        cache_dir: Option<std::path::PathBuf>,
    },
}

/// A rule's port: 1 to 65535, or `console` (0 on the wire).
fn parse_rule_port(s: &str) -> Result<u16, String> {
    match s.trim() {
        "console" => Ok(otherix_proto::relay::CONSOLE_PORT),
        p => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("{s:?}: a port is 1 to 65535, or `console`")),
    }
}

/// `100M`, `1G`, `500K`, `12345` (bytes) as bytes a second.
fn parse_bandwidth(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        None => (t, 1u64),
        Some((i, _)) => {
            let mult = match t[i..].to_ascii_lowercase().as_str() {
                "k" | "kb" | "kib" => 1 << 10,
                "m" | "mb" | "mib" => 1 << 20,
                "g" | "gb" | "gib" => 1 << 30,
                _ => return Err(format!("{s:?}: give bytes a second like 100M")),
            };
            (&t[..i], mult)
        }
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: give bytes a second like 100M"))?;
    match n.checked_mul(mult) {
        Some(0) | None => Err(format!("{s:?}: give at least one byte a second")),
        Some(b) => Ok(b),
    }
}

/// `256M`, `1G`, `512` (MiB) as MiB.
fn parse_memory_mib(s: &str) -> Result<u32, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        None => (t, 1u64),
        Some((i, _)) => {
            let unit = t[i..].to_ascii_lowercase();
            let mult = match unit.as_str() {
                "m" | "mb" | "mi" | "mib" => 1,
                "g" | "gb" | "gi" | "gib" => 1024,
                _ => return Err(format!("{s:?}: give a size like 256M or 1G")),
            };
            (&t[..i], mult)
        }
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: give a size like 256M or 1G"))?;
    u32::try_from(n * mult).map_err(|_| format!("{s:?} is too large"))
}

#[derive(Debug, Subcommand)]
pub enum VmCommand {
    /// Create a VM; the control plane allocates its MAC and IP.
    #[command(
        after_help = "A netns guest (the default runtime) is a network namespace running --exec.\n\
A QEMU guest (--runtime qemu) is a Linux VM booted from a guest image on its node\n\
(built there on first use, or ahead with `otherix image build`): it serves HTTP on 80,\n\
echo on 7 and SSH on 22, and --ssh-key puts your public key in root's authorized keys.\n\n\
With --count N, N VMs NAME-1 ... NAME-N are created in one transaction, all or none:\n\
if one name is taken or the network has fewer free addresses than N, none is created.\n\n\
Examples:\n  otherix vm create web01 --network web-net --label app=web --label tier=frontend\n  otherix vm create web --count 50 --network web-net --label app=web   # web-1 ... web-50\n  otherix vm create db01 --network web-net --node node2 --exec 'postgres -D /data'\n  otherix vm create vm1 --network web-net --runtime qemu --memory 512M --ssh-key ~/.ssh/id_ed25519.pub\n  otherix ssh vm1 -- -l root"
    )]
    Create {
        name: VmName,
        #[arg(long)]
        network: NetworkName,
        /// A label `key=value` (repeatable).
        #[arg(long = "label", short = 'l', value_name = "KEY=VALUE")]
        labels: Vec<String>,
        /// Run on this node.
        #[arg(long)]
        node: Option<NodeName>,
        /// The workload command run inside the guest (netns runtime).
        #[arg(long, value_name = "CMD")]
        exec: Option<String>,
        /// `netns` (a namespace running --exec) or `qemu` (a Linux VM).
        #[arg(long, value_name = "netns|qemu")]
        runtime: Option<otherix_proto::Runtime>,
        /// QEMU guest memory, e.g. 256M or 1G [default: 256M].
        #[arg(long, value_name = "SIZE", value_parser = parse_memory_mib)]
        memory: Option<u32>,
        /// QEMU guest virtual CPUs [default: 1].
        #[arg(long, value_name = "N")]
        cpus: Option<u32>,
        /// QEMU guest image in the nodes' image cache [default: default].
        #[arg(long, value_name = "IMAGE")]
        image: Option<String>,
        /// A public key file (e.g. ~/.ssh/id_ed25519.pub) for root in a QEMU
        /// guest (repeatable; every key line of the file is taken).
        #[arg(long = "ssh-key", value_name = "FILE")]
        ssh_keys: Vec<std::path::PathBuf>,
        /// Create N VMs, NAME-1 to NAME-N (1 to 1000), all or none.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
        count: Option<u32>,
    },
    /// List VMs, optionally filtered by a label selector.
    #[command(
        after_help = "Examples:\n  otherix vm list\n  otherix vm list --selector 'app=web,tier!=canary'\n  otherix vm list -l 'env in (prod,staging)' -o json\n  otherix vm list --watch        # redraws when a VM changes (not when AGE ticks)"
    )]
    List {
        /// Label selector (Kubernetes syntax: k=v, k!=v, k in (a,b), k notin (a,b), k, !k).
        #[arg(long, short = 'l')]
        selector: Option<String>,
        /// Ask again every second; print again when the answer changed.
        #[arg(long, short = 'w')]
        watch: bool,
    },
    /// Show a VM.
    Get { name: String },
    /// Delete a VM and free its address.
    Delete { name: String },
    /// Live-migrate a VM to another hypervisor node (admin); it keeps its
    /// MAC, IP and labels, and open connections carry over.
    #[command(
        after_help = "Shows each step on stderr while it waits.\n\nExamples:\n  otherix vm migrate web01 --to node2\n  otherix vm migrate web01 --to node2 --timeout 5m\n  otherix vm migrate web01 --to node1 --no-wait"
    )]
    Migrate {
        name: String,
        /// The target node.
        #[arg(long)]
        to: NodeName,
        /// Return once the migration started instead of waiting for it.
        #[arg(long)]
        no_wait: bool,
        /// Give up waiting after this long (the migration goes on).
        #[arg(long, default_value = "2m", value_parser = humantime::parse_duration, conflicts_with = "no_wait")]
        timeout: std::time::Duration,
    },
    /// Set (`k=v`) or remove (`k-`) labels.
    #[command(
        after_help = "Examples:\n  otherix vm label web01 tier=canary\n  otherix vm label web01 app=api tier-"
    )]
    Label {
        name: String,
        #[arg(required = true, value_name = "KEY=VALUE|KEY-")]
        changes: Vec<String>,
    },
}

/// `4MiB`, `64KiB`, `1048576` (bytes) as bytes.
fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        None => (t, 1usize),
        Some((i, _)) => {
            let mult = match t[i..].to_ascii_lowercase().as_str() {
                "k" | "kb" | "ki" | "kib" => 1024,
                "m" | "mb" | "mi" | "mib" => 1024 * 1024,
                _ => return Err(format!("{s:?}: give a size like 4MiB or 64KiB")),
            };
            (&t[..i], mult)
        }
    };
    let n: usize = num
        .parse()
        .map_err(|_| format!("{s:?}: give a size like 4MiB or 64KiB"))?;
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))
}
