//! The one table, every row measured in the same run, the goals under it
//! (met or missed, and by how much), and the machine it ran on.

use std::fmt::Write;
use std::time::Duration;

use crate::broker::BrokerRate;
use crate::latency::{Latency, Path};
use crate::memory::Memory;
use crate::options::{Attack, Options};
use crate::prom::Histogram;
use crate::qemu::figures::Spread;
use crate::qemu::{Comparison, Figures};
use crate::scale::plan::thousands;
use crate::scale::{RowResult, Scale};
use crate::setup::{Latencies, Setup};
use crate::soak::{Phase, SetupKind, Soak};
use crate::throughput::{PathThroughput, Throughput};

/// Setup may add at most this over a direct dial, at p50.
const GOAL_SETUP_ADDED: Duration = Duration::from_millis(2);
/// One stream through the gateway at least this many times nginx's.
const GOAL_THROUGHPUT_RATIO: f64 = 1.3;
/// One stream through the relay at least this many times websocat's...
const GOAL_RELAY_VS_WEBSOCAT: f64 = 2.0;
/// ... and at least this share of a direct dial's.
const GOAL_RELAY_VS_DIRECT: f64 = 0.3;
const GOAL_CREDENTIALS_PER_SECOND: f64 = 20_000.0;
const GOAL_BYTES_PER_SESSION: f64 = 32.0 * 1024.0;
/// With the slow clients, heartbeat and setup p99 at most this many times
/// what they are without.
const GOAL_SOAK_RATIO: f64 = 2.0;
/// A round trip through the gateway path adds at most this over direct (and
/// no more than nginx stream+TLS adds).
const GOAL_ROUND_TRIP_ADDED: Duration = Duration::from_micros(150);
/// `pgbench -S` through `otherix forward`, as a share of direct: with
/// persistent connections, and with a new connection per transaction.
const GOAL_PGBENCH_PERSISTENT: f64 = 0.7;
const GOAL_PGBENCH_RECONNECT: f64 = 0.8;

const DASH: &str = "-";

#[derive(Debug)]
pub struct Report {
    command_line: String,
    pub broker: Option<BrokerRate>,
    pub setup: Option<Setup>,
    pub throughput: Option<Throughput>,
    pub memory: Option<Memory>,
    pub relay_memory: Option<Memory>,
    pub latency: Option<Latency>,
    pub soak: Option<Soak>,
    pub scale: Option<Scale>,
    pub qemu: Option<Comparison>,
    pub resume: Option<crate::resume::Figures>,
}

/// The table's rows, in order: the overlay guest's paths, then the bridge guest's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Row {
    Direct,
    Gateway,
    Nginx,
    DirectBridge,
    Relay,
    Websocat,
    Websockify,
}

impl Row {
    const ALL: [Row; 7] = [
        Row::Direct,
        Row::Gateway,
        Row::Nginx,
        Row::DirectBridge,
        Row::Relay,
        Row::Websocat,
        Row::Websockify,
    ];

    fn name(self) -> &'static str {
        match self {
            Row::Direct => "direct",
            Row::Gateway => "otherix gateway",
            Row::Nginx => "nginx stream+TLS",
            Row::DirectBridge => "direct (bridge)",
            Row::Relay => "otherix relay",
            Row::Websocat => "websocat (wss)",
            Row::Websockify => "websockify (wss)",
        }
    }

    fn is_direct(self) -> bool {
        matches!(self, Row::Direct | Row::DirectBridge)
    }

    fn setup(self, s: &Setup) -> &Latencies {
        match self {
            Row::Direct => &s.direct,
            Row::Gateway => &s.otherix,
            Row::Nginx => &s.nginx,
            Row::DirectBridge => &s.direct_bridge,
            Row::Relay => &s.relay,
            Row::Websocat => &s.websocat,
            Row::Websockify => &s.websockify,
        }
    }

    fn throughput(self, t: &Throughput) -> &PathThroughput {
        match self {
            Row::Direct => &t.direct,
            Row::Gateway => &t.otherix,
            Row::Nginx => &t.nginx,
            Row::DirectBridge => &t.direct_bridge,
            Row::Relay => &t.relay,
            Row::Websocat => &t.websocat,
            Row::Websockify => &t.websockify,
        }
    }
}

impl Report {
    pub fn new(opts: &Options) -> Report {
        Report {
            command_line: opts.command_line.clone(),
            broker: None,
            setup: None,
            throughput: None,
            memory: None,
            relay_memory: None,
            latency: None,
            soak: None,
            scale: None,
            qemu: None,
            resume: None,
        }
    }

    pub fn render(&self) -> String {
        if let Some(scale) = &self.scale {
            let mut out = render_scale(scale);
            let _ = writeln!(out, "  command: {}", self.command_line);
            let _ = writeln!(out, "  machine: {}", machine());
            return out;
        }
        if let Some(resume) = &self.resume {
            let mut out = render_resume(resume);
            let _ = writeln!(out, "  command: {}", self.command_line);
            let _ = writeln!(out, "  machine: {}", machine());
            return out;
        }
        if let Some(qemu) = &self.qemu {
            let mut out = render_qemu(qemu);
            let _ = writeln!(out, "  command: {}", self.command_line);
            let _ = writeln!(out, "  machine: {}", machine());
            return out;
        }
        if let Some(soak) = &self.soak {
            let mut out = render_soak(soak);
            let _ = writeln!(out, "  command: {}", self.command_line);
            let _ = writeln!(out, "  machine: {}", machine());
            return out;
        }
        let header = [
            "path",
            "credentials/s",
            "setup p50 / p99",
            "setup incl. broker p50 / p99",
            "1 stream",
            "8 streams",
            "server CPU/GB",
            "client CPU/GB",
            "RSS per idle session",
        ];
        let rows: Vec<Vec<String>> = Row::ALL.iter().map(|r| self.row(*r)).collect();
        let mut out = table(&header, &rows);
        out.push('\n');
        out.push_str(&self.goals());
        out.push('\n');
        out.push_str(&self.notes());
        if let Some(l) = &self.latency {
            out.push('\n');
            out.push_str(&render_latency(l));
        }
        out
    }

    fn row(&self, row: Row) -> Vec<String> {
        let creds = match (&self.broker, row) {
            (Some(b), Row::Gateway) => format!("{:.0}", b.per_second()),
            _ => DASH.into(),
        };
        let setup_cell = self
            .setup
            .as_ref()
            .map(|s| pair(row.setup(s)))
            .unwrap_or_else(|| DASH.into());
        let broker_cell = match (&self.setup, row) {
            (Some(s), Row::Gateway) => pair(&s.otherix_with_broker),
            (Some(s), Row::Relay) => pair(&s.relay_with_broker),
            _ => DASH.into(),
        };
        let (one, eight, server, client) = match &self.throughput {
            Some(t) => {
                let p = row.throughput(t);
                let (server, client) = p.cpu_per_gb();
                let cpu = |v: f64| {
                    if row.is_direct() {
                        DASH.into()
                    } else {
                        format!("{v:.2} s")
                    }
                };
                (
                    gbits(p.one.bits_per_second),
                    gbits(p.eight.bits_per_second),
                    cpu(server),
                    cpu(client),
                )
            }
            None => (DASH.into(), DASH.into(), DASH.into(), DASH.into()),
        };
        let memory = match (row, &self.memory, &self.relay_memory) {
            (Row::Gateway, Some(m), _) | (Row::Relay, _, Some(m)) => {
                format!("{:.1} KiB", m.per_session() / 1024.0)
            }
            _ => DASH.into(),
        };
        vec![
            row.name().into(),
            creds,
            setup_cell,
            broker_cell,
            one,
            eight,
            server,
            client,
            memory,
        ]
    }

    fn goals(&self) -> String {
        let mut out = String::from("goals:\n");
        let mut line = |goal: &str, value: String, verdict: String| {
            let _ = writeln!(out, "  {goal:<52} {value:<26} {verdict}");
        };
        if let Some(s) = &self.setup {
            let direct = s.direct.p50();
            for (what, lat) in [
                ("setup adds < 2 ms at p50 over a direct dial", &s.otherix),
                ("  ... counting the broker call too", &s.otherix_with_broker),
                (
                    "new connection through forward (ready) < 2 ms over direct",
                    &s.forward_ready,
                ),
                ("  ... forward --ready 0", &s.forward_cold),
            ] {
                let added = lat.p50().saturating_sub(direct);
                line(
                    what,
                    format!("+{}", ms(added)),
                    verdict_max(added.as_secs_f64(), GOAL_SETUP_ADDED.as_secs_f64(), |d| {
                        ms(Duration::from_secs_f64(d))
                    }),
                );
            }
        }
        if let Some(t) = &self.throughput {
            let vs_nginx = ratio(t.otherix.one.bits_per_second, t.nginx.one.bits_per_second);
            line(
                "1 stream >= 1.3x nginx stream+TLS",
                format!("{vs_nginx:.2}x"),
                verdict_min(vs_nginx, GOAL_THROUGHPUT_RATIO, |d| format!("{d:.2}x")),
            );
            let relay = t.relay.one.bits_per_second;
            for (what, other, goal) in [
                (
                    "relay 1 stream >= 2x websocat",
                    t.websocat.one.bits_per_second,
                    GOAL_RELAY_VS_WEBSOCAT,
                ),
                (
                    "relay 1 stream >= 0.3x direct (bridge)",
                    t.direct_bridge.one.bits_per_second,
                    GOAL_RELAY_VS_DIRECT,
                ),
            ] {
                let r = ratio(relay, other);
                line(
                    what,
                    format!("{r:.2}x"),
                    verdict_min(r, goal, |d| format!("{d:.2}x")),
                );
            }
            let overlay = ratio(relay, t.direct.one.bits_per_second);
            line(
                "  ... against direct (overlay) instead",
                format!("{overlay:.2}x"),
                verdict_min(overlay, GOAL_RELAY_VS_DIRECT, |d| format!("{d:.2}x")),
            );
        }
        if let Some(b) = &self.broker {
            let rate = b.per_second();
            line(
                ">= 20,000 credentials/s",
                format!("{rate:.0}/s"),
                verdict_min(rate, GOAL_CREDENTIALS_PER_SECOND, |d| format!("{d:.0}/s")),
            );
        }
        if let Some(m) = &self.memory {
            let per = m.per_session();
            line(
                "<= 32 KiB per idle session",
                format!("{:.1} KiB", per / 1024.0),
                verdict_max(per, GOAL_BYTES_PER_SESSION, |d| format!("{:.1} KiB", d / 1024.0)),
            );
        }
        out
    }

    fn notes(&self) -> String {
        let mut out = String::from("notes:\n");
        let mut note = |s: String| {
            let _ = writeln!(out, "  {s}");
        };
        if let Some(s) = &self.setup {
            note(format!(
                "setup: until one byte has been echoed by the guest; {} / {} / {} / {} samples (direct / otherix / otherix+broker / nginx), {} / {} / {} / {} / {} (direct bridge / relay / relay+broker / websocat / websockify), one at a time",
                s.direct.len(),
                s.otherix.len(),
                s.otherix_with_broker.len(),
                s.nginx.len(),
                s.direct_bridge.len(),
                s.relay.len(),
                s.relay_with_broker.len(),
                s.websocat.len(),
                s.websockify.len(),
            ));
            for (to, ready, cold, direct, direct_name) in [
                (
                    "the gateway VM",
                    &s.forward_ready,
                    &s.forward_cold,
                    &s.direct,
                    "direct",
                ),
                (
                    "the relay VM",
                    &s.relay_forward_ready,
                    &s.relay_forward_cold,
                    &s.direct_bridge,
                    "direct (bridge)",
                ),
            ] {
                note(format!(
                    "new connections through otherix forward to {to} (connect to its local port, one byte echoed): ready (default) p50 {} / p99 {}, --ready 0 p50 {} / p99 {}; {direct_name} p50 {} / p99 {}",
                    ms(ready.p50()),
                    ms(ready.p99()),
                    ms(cold.p50()),
                    ms(cold.p99()),
                    ms(direct.p50()),
                    ms(direct.p99()),
                ));
            }
        }
        if let Some(b) = &self.broker {
            note(format!(
                "broker: {} credentials in {:.1} s with {} calls in flight, {} errors{}; control plane CPU {:.0} us per credential",
                b.credentials,
                b.elapsed.as_secs_f64(),
                b.concurrency,
                b.errors,
                b.first_error.as_ref().map(|e| format!(" (first: {e})")).unwrap_or_default(),
                b.cp_cpu_per_credential * 1e6
            ));
        }
        if let Some(t) = &self.throughput {
            note(format!(
                "throughput: iperf3, client to guest, best of {} runs of {} s; CPU per GB over all runs of the path (server: gateway agent / nginx master+workers / CP + node1 agent / WebSocket server + node socat (+ CP-side socat for websockify); client: otherix forward / socat and its children / websocat)",
                t.rounds, t.seconds
            ));
            note(format!(
                "node side of server CPU/GB: relay {:.2} s (node1 agent; the rest is the CP), websocat {:.2} s, websockify {:.2} s (node socat; the rest is the WebSocket server, and for websockify the CP-side socat)",
                t.relay.node_cpu_per_gb(),
                t.websocat.node_cpu_per_gb(),
                t.websockify.node_cpu_per_gb(),
            ));
        }
        if let Some(m) = &self.memory {
            note(format!(
                "memory: {} of {} idle sessions open ({} failed{}){}; gateway agent RSS {:.1} MiB before, {:.1} MiB with them open, {:.1} MiB after they closed",
                m.opened,
                m.requested,
                m.failed,
                m.first_error.as_ref().map(|e| format!(", first: {e}")).unwrap_or_default(),
                m.capped.as_ref().map(|c| format!("; capped: {c}")).unwrap_or_default(),
                m.rss_before as f64 / 1048576.0,
                m.rss_idle as f64 / 1048576.0,
                m.rss_closed as f64 / 1048576.0,
            ));
        }
        if let Some(m) = &self.relay_memory {
            note(format!(
                "relay memory: {} of {} idle relay sessions open ({} failed{}){}; control plane RSS {:.1} MiB before, {:.1} MiB with them open, {:.1} MiB after they closed",
                m.opened,
                m.requested,
                m.failed,
                m.first_error.as_ref().map(|e| format!(", first: {e}")).unwrap_or_default(),
                m.capped.as_ref().map(|c| format!("; capped: {c}")).unwrap_or_default(),
                m.rss_before as f64 / 1048576.0,
                m.rss_idle as f64 / 1048576.0,
                m.rss_closed as f64 / 1048576.0,
            ));
        }
        note(format!("command: {}", self.command_line));
        note(format!("machine: {}", machine()));
        out
    }
}

/// The soak: one table of the victims' figures, quiet and under each
/// attack (p99 ratios to the quiet phase), then per attack what the
/// processes did and what the attacker got, the goals, and notes.
fn render_soak(s: &Soak) -> String {
    let quiet = &s.without;
    let mut header: Vec<String> = vec![String::new(), "quiet".into()];
    header.extend(s.attacks.iter().map(|a| a.attack.title().to_string()));
    let mut rows: Vec<Vec<String>> = Vec::new();
    // One row: its name, the quiet cell, and each attack's cell.
    let mut row = |name: String, cell: &dyn Fn(&Phase, bool) -> String| {
        let mut r = vec![name, cell(quiet, true)];
        r.extend(s.attacks.iter().map(|a| cell(&a.phase, false)));
        rows.push(r);
    };
    let with_ratio = |cell: String, ratio: Option<f64>, quiet: bool| {
        if quiet {
            cell
        } else {
            format!(
                "{cell} ({})",
                ratio.map_or_else(|| DASH.into(), |r| format!("{r:.2}x"))
            )
        }
    };
    row("heartbeat p50 / p99, probe node".into(), &|p, q| {
        with_ratio(pair(&p.probe), ratio_of(p.probe.p99(), quiet.probe.p99()), q)
    });
    row("heartbeat p50 / p99, agents' histogram".into(), &|p, q| {
        with_ratio(hist_pair(&p.agents), hist_ratio(&p.agents, &quiet.agents), q)
    });
    row("heartbeat handler p50 / p99, CP's histogram".into(), &|p, q| {
        with_ratio(
            hist_pair(&p.cp_handler),
            hist_ratio(&p.cp_handler, &quiet.cp_handler),
            q,
        )
    });
    row("heartbeats: probe / agents (failed)".into(), &|p, _| {
        format!(
            "{} ({}) / {} ({})",
            p.probe.len(),
            p.probe_failed,
            p.agents.count(),
            p.agents_failed
        )
    });
    for kind in SetupKind::ALL {
        row(format!("setup p50 / p99, {}", setup_name(kind)), &|p, q| {
            with_ratio(
                pair(&p.setup(kind)),
                ratio_of(p.setup(kind).p99(), quiet.setup(kind).p99()),
                q,
            )
        });
    }
    row("setups done (failed), the four rows above".into(), &|p, _| {
        SetupKind::ALL
            .iter()
            .map(|k| format!("{} ({})", p.setup(*k).len(), p.failed(*k)))
            .collect::<Vec<_>>()
            .join(" / ")
    });
    row(
        "nodes NotReady seen (node list checks, failed)".into(),
        &|p, _| {
            format!(
                "{} ({}, {})",
                p.not_ready.len(),
                p.node_checks,
                p.node_check_errors
            )
        },
    );
    for (i, proc) in quiet.procs.iter().enumerate() {
        row(format!("{}: fds / RSS / CPU (max)", proc.name), &|p, _| {
            p.procs.get(i).map_or_else(|| DASH.into(), proc_cell)
        });
    }
    row("load average, start / end".into(), &|p, _| {
        format!("{} / {}", p.load.0, p.load.1)
    });
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    let mut out = format!(
        "soak: a quiet phase, then {}; victims' p50 / p99 and, under an attack, its p99 over the quiet one\n\n",
        s.attacks
            .iter()
            .map(|a| a.attack.title())
            .collect::<Vec<_>>()
            .join(", ")
    );
    out.push_str(&table(&header, &rows));

    let by_reason = |v: &[(String, f64)]| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.iter()
                .map(|(k, n)| format!("{k} {n:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    for a in &s.attacks {
        let b = &a.phase;
        let _ = writeln!(
            out,
            "\nunder the {} (measured from {:.0} s after it started{}):",
            a.attack.title(),
            a.lead.as_secs_f64(),
            a.lead_note.as_ref().map(|n| format!("; {n}")).unwrap_or_default()
        );
        for (target, kind, t) in &b.flood {
            let answers = t
                .answers
                .iter()
                .map(|(k, v)| format!("{v} {k}"))
                .collect::<Vec<_>>()
                .join(", ");
            let _ = writeln!(
                out,
                "  {target}, {}: {} connects ({} failed), {} TLS done, {} turned away within 1 s, {} cut after {:.1} s on average, open at the end {}, at most {}; the server's answers: {}",
                kind.name(),
                t.attempts,
                t.connect_failed,
                t.tls_done,
                t.turned_away,
                t.cut,
                t.mean_hold().as_secs_f64(),
                t.open,
                t.peak,
                if answers.is_empty() { "none".into() } else { answers },
            );
        }
        for (target, min, mean, max) in &b.flood_open {
            let _ = writeln!(
                out,
                "  open at the {target}: min / mean / max {min} / {mean:.0} / {max}"
            );
        }
        if !b.attacker.is_empty() {
            let calls: u64 = b.attacker.values().sum();
            let _ = writeln!(
                out,
                "  the attacker got ({calls} answers, {:.0}/s): {}",
                calls as f64 / b.elapsed.as_secs_f64().max(1e-9),
                crate::outcomes::render(&b.attacker)
            );
        }
        for (what, v) in [
            ("control plane's connection refusals (over a cap)", &b.cp_refused),
            ("gateway's refusals and failed handshakes", &b.gateway_refused),
            (
                "control plane's node calls over their rate (429)",
                &b.node_limited,
            ),
            ("relay's refusals", &b.relay_refused),
            ("broker's refusals", &b.broker_refused),
        ] {
            let _ = writeln!(out, "  {what}: {}", by_reason(v));
        }
        let _ = writeln!(
            out,
            "  {} s after it stopped: {}; nodes not Ready: {}",
            crate::soak::AFTER.as_secs(),
            a.after
                .iter()
                .map(|p| format!("{} {} fds, {}", p.name, p.fds_end, mib(p.rss_end)))
                .collect::<Vec<_>>()
                .join("; "),
            if a.not_ready_after.is_empty() {
                "none".into()
            } else {
                a.not_ready_after.join(", ")
            }
        );
    }

    out.push_str("\ngoals (p99 under the attack within 2x of quiet; nothing failed or NotReady):\n");
    let mut line = |goal: &str, value: String, verdict: String| {
        let _ = writeln!(out, "  {goal:<66} {value:<10} {verdict}");
    };
    let ratio_goal = |r: Option<f64>| match r {
        Some(r) => (
            format!("{r:.2}x"),
            verdict_max(r, GOAL_SOAK_RATIO, |d| format!("{d:.2}x")),
        ),
        None => ("n/a".into(), "not measured".into()),
    };
    for a in &s.attacks {
        let (b, t) = (&a.phase, a.attack.title());
        let (v, verdict) = ratio_goal(ratio_of(b.probe.p99(), quiet.probe.p99()));
        line(&format!("{t}: heartbeat p99 (probe node)"), v, verdict);
        let (v, verdict) = ratio_goal(hist_ratio(&b.agents, &quiet.agents));
        line(&format!("{t}: heartbeat p99 (agents' histogram)"), v, verdict);
        for kind in SetupKind::ALL {
            let (v, verdict) = ratio_goal(ratio_of(b.setup(kind).p99(), quiet.setup(kind).p99()));
            line(&format!("{t}: setup p99, {}", setup_name(kind)), v, verdict);
        }
        let failed = b.probe_failed as u64
            + b.agents_failed
            + SetupKind::ALL.iter().map(|k| b.failed(*k) as u64).sum::<u64>();
        let seen = b.not_ready.len() + a.not_ready_after.len();
        line(
            &format!("{t}: nothing failed, no node NotReady"),
            format!("{failed}, {seen}"),
            if failed == 0 && seen == 0 {
                "met".into()
            } else {
                format!(
                    "MISSED: {failed} failed{}",
                    b.not_ready
                        .iter()
                        .map(|(at, n)| format!(", {n} NotReady at {at} s"))
                        .chain(a.not_ready_after.iter().map(|n| format!(", {n} NotReady after")))
                        .collect::<String>()
                )
            },
        );
    }

    out.push_str("\nnotes:\n");
    let mut note = |t: String| {
        let _ = writeln!(out, "  {t}");
    };
    for a in &s.attacks {
        note(match a.attack {
            Attack::SlowClients => format!(
                "slow clients: {} against each of the control plane and the gateway, kinds {} dealt out in turn (body clients send the gateway a slow head: it reads no body), from {} source addresses, one byte every {} s; back within {:.1} s when the server cut them after holding them, {} s (+-25%) after it turned them away; started over {} s, measured from {} s after the last started",
                s.clients_per_target,
                s.kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join(","),
                s.sources,
                s.interval.as_secs(),
                s.interval.as_secs_f64() / 10.0,
                s.interval.as_secs(),
                crate::soak::RAMP.as_secs(),
                crate::soak::SETTLE.as_secs(),
            ),
            Attack::HalfOpen => format!(
                "half-open flood: {} connections to the gateway from {} source addresses that never finish TLS (tcp: no byte; hello: the first 11 bytes of a ClientHello), in turn; back at once when the gateway cut them after holding them, {} s (+-25%) after it turned them away; started over {} s, measured from {} s after the last started",
                s.half_open_clients,
                s.half_open_sources,
                s.interval.as_secs(),
                crate::soak::RAMP.as_secs(),
                crate::soak::HALF_OPEN_SETTLE.as_secs(),
            ),
            Attack::NodeFlood => format!(
                "node flood: node {} (enrolled with a join token, its own key and certificate) loops heartbeats (6 in flight), desired-state waits that answer at once and certificate renewals, ignoring Retry-After, from the host's address; measured from {} s after it started; deleted after its phase",
                crate::node_flood::FLOOD_NODE,
                crate::soak::NODE_FLOOD_SETTLE.as_secs(),
            ),
            Attack::RelayFill => format!(
                "relay cache fill: user {} (role user, allowed {}'s echo port) brokers a relay ticket and spends it on a relay connection it drops, 8 loops, as fast as the broker and the relay let it; measured once the relay refused its tickets (at most {} s)",
                crate::relay_fill::FLOOD_USER,
                crate::bed::RELAY_VM,
                crate::soak::FILL_BUDGET.as_secs(),
            ),
        });
    }
    note("every attacker runs on a thread of its own at nice 19 in the bench: a real attacker does not share the servers' cores".into());
    note(format!(
        "phases: {:.0} s each; setups one every {} ms, the four kinds in turn; probe heartbeats every 250 ms on one kept-alive mutual-TLS connection; agents heartbeat every 2 s; node list every 2 s",
        quiet.elapsed.as_secs_f64(),
        crate::soak::PACE.as_millis(),
    ));
    note("histogram percentiles are interpolated within buckets (1, 2.5, 5, 10, 25 ms ...), as Prometheus's histogram_quantile does".into());
    note(format!(
        "limits in force: the control plane's defaults (its command line: {}), the gateway's defaults; open-file soft limits: {}",
        s.cp_args,
        quiet
            .procs
            .iter()
            .map(|p| format!("{} {}", p.name, p.nofile_soft))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let errors =
        std::iter::once(("quiet", quiet)).chain(s.attacks.iter().map(|a| (a.attack.title(), &a.phase)));
    for (phase, p) in errors {
        for (what, e) in [
            ("first probe heartbeat failure", &p.probe_first_error),
            ("first setup failure", &p.setup_first_error),
        ] {
            if let Some(e) = e {
                note(format!("{phase}: {what}: {e}"));
            }
        }
    }
    out
}

/// Issue #14's goals, on this 2-core machine.
const GOAL_SCALE_CP_SHARE: f64 = 0.25;
const GOAL_SCALE_HEARTBEAT_P99: Duration = Duration::from_millis(50);
const GOAL_SCALE_CPU_PER_CREDENTIAL: Duration = Duration::from_micros(50);
const GOAL_SCALE_VM_CREATES: f64 = 2_000.0;
/// Issue #30's goal for LB creates with the nodes live.
const GOAL_SCALE_LB_CREATES: f64 = 1_000.0;
const GOAL_SCALE_VM_LIST: Duration = Duration::from_millis(200);
const GOAL_SCALE_RSS: f64 = 300.0 * 1048576.0;

/// The scale table (one line per row), the goals of issue #14 where a row
/// measures them, and per-row notes.
fn render_scale(scale: &Scale) -> String {
    let header = [
        "nodes / VMs / LBs",
        "CP CPU per heartbeat",
        "CP CPU",
        "heartbeats/s served",
        "heartbeat p50 / p99",
        "credentials/s",
        "CP CPU per credential (net)",
        "VM create rate",
        "LB create rate",
        "vm list",
        "CP RSS",
        "NotReady",
        "result",
    ];
    let rows: Vec<Vec<String>> = scale.rows.iter().map(scale_row).collect();
    let replicas = scale.settings.replicas;
    let mut out = format!(
        "scale: simulated nodes heartbeating every {} against {} per row, its store on {}\n\n",
        short(scale.settings.interval),
        if replicas > 1 {
            format!("{replicas} control-plane replicas (the nodes spread over them; the CP columns sum them)")
        } else {
            "one control plane".to_string()
        },
        match scale.settings.postgres {
            true => "PostgreSQL (the server's own CPU and memory are not in the CP columns)",
            false => "SQLite",
        }
    );
    out.push_str(&table(&header, &rows));
    if replicas > 1 {
        out.push_str(&render_replicas(&scale.rows, replicas));
    }
    out.push_str(&scale_goals(&scale.rows));
    out.push_str("\nnotes:\n");
    let s = &scale.settings;
    let _ = writeln!(
        out,
        "  CP CPU: the control plane's own utime+stime (/proc/PID/stat) over a {} s steady-state window ({} s after the last VM ran), per heartbeat answered in it and as a share of one core (200 % = both cores); heartbeat p50/p99: every heartbeat started in the window, from request to answer (a timed-out one at the agent's {} s timeout); served: answers per second against nodes / interval",
        s.window.as_secs(),
        s.settle.as_secs(),
        crate::scale::fleet::HEARTBEAT_TIMEOUT.as_secs(),
    );
    let _ = writeln!(
        out,
        "  credentials/s: {} callers brokering random VMs for {} s while the nodes heartbeat; CP CPU per credential: the CP's CPU-seconds over that phase per credential (net: less the heartbeats answered meanwhile at the steady state's CPU per heartbeat — they give way to the broker calls, so the time alone would overstate them; \"within noise\" when that leaves less than a tenth); VM create rate: the VMs created while every node heartbeats, placed by the scheduler ({}; the others were created on hypervisors named in turn before any heartbeat), {} in flight; LB create rate: the row's LBs, created while every node heartbeats, as many in flight; vm list: one GET /v1/vms at the end; CP RSS: VmRSS at the end; NotReady: nodes GET /v1/nodes showed NotReady at least once, polled one after the other every {} s, from the settle time to the end of the broker calls (the notes also count the live creates before)",
        s.broker_concurrency,
        s.broker_time.as_secs(),
        s.live_vms.map_or("2 % of the row, 20 to 200".to_string(), |n| n.to_string()),
        match s.live_batch {
            1 => s.live_in_flight.to_string(),
            n => format!("{} requests of {n} VMs each (POST /v1/vm-batches)", s.live_in_flight),
        },
        2,
    );
    for r in &scale.rows {
        out.push_str(&scale_notes(r));
    }
    out
}

/// Brokering through one replica and through all, and the failover gap.
fn render_replicas(rows: &[RowResult], replicas: usize) -> String {
    let header = [
        "nodes / VMs / LBs",
        "credentials/s, one replica",
        "CP CPU per credential (net)",
        &format!("credentials/s, all {replicas}"),
        "CP CPU per credential (net)",
        "failover gap p50 / p99",
        "nodes failed over",
    ];
    let per_cred = |b: &crate::scale::Brokered| {
        if b.load.credentials == 0 {
            return (rate(0.0), DASH.to_string());
        }
        let per = |cpu: f64| short(Duration::from_secs_f64(cpu / b.load.credentials as f64));
        let net = if crate::scale::figures::net_is_signal(b.cp_cpu_net, b.cp_cpu) {
            per(b.cp_cpu_net)
        } else {
            "within noise".to_string()
        };
        (rate(b.per_second()), format!("{} ({net})", per(b.cp_cpu)))
    };
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let (one, one_cpu) = r.broker.as_ref().map_or((DASH.into(), DASH.into()), per_cred);
            let (all, all_cpu) = r.broker_all.as_ref().map_or((DASH.into(), DASH.into()), per_cred);
            let (gap, nodes) = match &r.failover {
                Some(f) if f.gaps.len() > 0 => (
                    format!("{} / {}", short(f.gaps.p50()), short(f.gaps.p99())),
                    format!("{} of {}", f.gaps.len(), f.nodes),
                ),
                Some(f) => (DASH.into(), format!("0 of {}", f.nodes)),
                None => (DASH.into(), DASH.into()),
            };
            vec![r.row.to_string(), one, one_cpu, all, all_cpu, gap, nodes]
        })
        .collect();
    let mut out = format!("\nreplicas (issue #16): {replicas} control planes on one PostgreSQL\n\n");
    out.push_str(&table(&header, &body));
    let _ = writeln!(
        out,
        "  (the same callers brokering random VMs through the first replica, then spread over all; CP CPU: every replica's; failover gap: kill -9 of the first replica, then for each node that heartbeat to it, from the kill to the answer of its first heartbeat begun after it, through the client's failover to the next replica; a node not answered within {} s counts as not failed over)",
        crate::scale::FAILOVER_BOUND.as_secs()
    );
    out
}

fn scale_row(r: &RowResult) -> Vec<String> {
    let steady = r.steady.as_ref();
    let per_hb = steady
        .and_then(|s| s.cpu_per_heartbeat())
        .map_or(DASH.into(), short);
    let share = steady.map_or(DASH.into(), |s| format!("{:.0} %", s.cp_share() * 100.0));
    let served = steady.map_or(DASH.into(), |s| {
        format!("{:.1} of {:.1}", s.served_rate(), s.expected_rate)
    });
    let latency = steady
        .filter(|s| s.beats.latencies.len() > 0)
        .map_or(DASH.into(), |s| {
            format!(
                "{} / {}",
                short(s.beats.latencies.p50()),
                short(s.beats.latencies.p99())
            )
        });
    let (creds, per_cred) = match &r.broker {
        Some(b) if b.load.credentials > 0 => {
            let n = b.load.credentials;
            let per = |cpu: f64| Duration::from_secs_f64(cpu / n as f64);
            let net = if crate::scale::figures::net_is_signal(b.cp_cpu_net, b.cp_cpu) {
                short(per(b.cp_cpu_net))
            } else {
                "within noise".to_string()
            };
            (rate(b.per_second()), format!("{} ({net})", short(per(b.cp_cpu))))
        }
        Some(_) => ("0".into(), DASH.into()),
        None => (DASH.into(), DASH.into()),
    };
    let creates = if r.live.done > 0 {
        format!("{}/s", rate(r.live.per_second()))
    } else {
        DASH.into()
    };
    let lb_creates = if r.lbs.done > 0 {
        format!("{}/s", rate(r.lbs.per_second()))
    } else {
        DASH.into()
    };
    let vm_list = match &r.vm_list {
        Some(Ok((d, _))) => short(*d),
        Some(Err(_)) => "failed".into(),
        None => DASH.into(),
    };
    let rss = if r.rss_end > 0 {
        bytes(r.rss_end as f64)
    } else {
        DASH.into()
    };
    let not_ready = if r.steady.is_some() {
        format!(
            "{} of {}",
            r.nodes_watch.not_ready(r.measured).0.len(),
            r.enroll.done
        )
    } else {
        DASH.into()
    };
    let result = if r.shortfalls.is_empty() {
        "fine".to_string()
    } else {
        r.shortfalls.join("; ")
    };
    vec![
        r.row.to_string(),
        per_hb,
        share,
        served,
        latency,
        creds,
        per_cred,
        creates,
        lb_creates,
        vm_list,
        rss,
        not_ready,
        result,
    ]
}

fn scale_goals(rows: &[RowResult]) -> String {
    let mut out = String::from("\ngoals (issue #14):\n");
    let before = out.len();
    let mut line = |goal: &str, value: String, verdict: String| {
        let _ = writeln!(out, "  {goal:<58} {value:<14} {verdict}");
    };
    let find = |nodes: usize, vms: usize, lbs: usize| {
        rows.iter()
            .find(|r| r.row.nodes == nodes && r.row.vms == vms && r.row.lbs == lbs && r.steady.is_some())
    };
    if let Some(r) = find(100, 10_000, 1_000) {
        let s = r.steady.as_ref().map(|s| (s.cp_share(), s.beats.latencies.p99()));
        if let Some((share, p99)) = s {
            line(
                "100 nodes, 10,000 VMs, 1,000 LBs: CP < 25 % of one core",
                format!("{:.0} %", share * 100.0),
                verdict_max(share, GOAL_SCALE_CP_SHARE, |d| format!("{:.0} points", d * 100.0)),
            );
            line(
                "  ... heartbeat p99 < 50 ms",
                short(p99),
                verdict_max(p99.as_secs_f64(), GOAL_SCALE_HEARTBEAT_P99.as_secs_f64(), |d| {
                    short(Duration::from_secs_f64(d))
                }),
            );
        }
        let down = r.nodes_watch.not_ready(r.measured).0.len();
        line(
            "  ... no node NotReady",
            format!("{down} seen"),
            if down == 0 {
                "met".into()
            } else {
                format!("MISSED: {down} nodes")
            },
        );
    }
    if let Some(r) = find(100, 10_000, 0).or_else(|| find(100, 10_000, 1_000)) {
        let at = format!("at {}", r.row);
        if let Some(b) = r.broker.as_ref().filter(|b| b.load.credentials > 0) {
            let per_second = b.per_second();
            line(
                &format!("{at}: >= 20,000 credentials/s"),
                format!("{}/s", rate(per_second)),
                verdict_min(per_second, GOAL_CREDENTIALS_PER_SECOND, |d| {
                    format!("{}/s", rate(d))
                }),
            );
            let per = b.cp_cpu / b.load.credentials as f64;
            line(
                "  ... CP CPU per credential < 50 µs",
                short(Duration::from_secs_f64(per)),
                verdict_max(per, GOAL_SCALE_CPU_PER_CREDENTIAL.as_secs_f64(), |d| {
                    short(Duration::from_secs_f64(d))
                }),
            );
        }
        if r.live.done > 0 {
            let creates = r.live.per_second();
            line(
                "  ... VM creation >= 2,000/s",
                format!("{}/s", rate(creates)),
                verdict_min(creates, GOAL_SCALE_VM_CREATES, |d| format!("{}/s", rate(d))),
            );
        }
        if r.lbs.done > 0 {
            let creates = r.lbs.per_second();
            line(
                "  ... LB creation with the nodes live >= 1,000/s",
                format!("{}/s", rate(creates)),
                verdict_min(creates, GOAL_SCALE_LB_CREATES, |d| format!("{}/s", rate(d))),
            );
        }
        if let Some(Ok((took, _))) = &r.vm_list {
            line(
                "  ... vm list < 200 ms",
                short(*took),
                verdict_max(took.as_secs_f64(), GOAL_SCALE_VM_LIST.as_secs_f64(), |d| {
                    short(Duration::from_secs_f64(d))
                }),
            );
        }
        line(
            "  ... CP RSS < 300 MiB",
            bytes(r.rss_end as f64),
            verdict_max(r.rss_end as f64, GOAL_SCALE_RSS, bytes),
        );
    }
    if out.len() == before {
        out.push_str("  (measured at 100 nodes and 10,000 VMs: no such row in this run)\n");
    }
    out
}

fn scale_notes(r: &RowResult) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "  row {} ({:.0} s, load average {} at its start, {} at its end):",
        r.row,
        r.elapsed.as_secs_f64(),
        r.load.0,
        r.load.1
    );
    let mut note = |t: String| {
        let _ = writeln!(out, "    {t}");
    };
    let batch = |b: &crate::scale::load::Batch| {
        format!(
            "{} in {:.1} s ({}/s{})",
            thousands(b.done as u64),
            b.elapsed.as_secs_f64(),
            rate(b.per_second()),
            if b.failed > 0 {
                format!(", {} failed", b.failed)
            } else {
                String::new()
            }
        )
    };
    note(format!(
        "setup: {} networks; nodes enrolled: {}; VMs created on named hypervisors before they heartbeat: {}; every node answering and every VM running {:.0} s after the heartbeats began; LBs: {}{}; VMs with the nodes live: {}",
        r.networks.done,
        batch(&r.enroll),
        batch(&r.bulk),
        r.placing.as_secs_f64(),
        batch(&r.lbs),
        match (r.lb_checks, r.lb_verdicts) {
            (Some(d), Some(v)) => format!(
                ", their health checks at every node {:.1} s after the last, their first verdicts written {:.1} s after",
                d.as_secs_f64(),
                v.as_secs_f64()
            ),
            (Some(d), None) => format!(", their health checks at every node {:.1} s after the last", d.as_secs_f64()),
            _ => String::new(),
        },
        batch(&r.live),
    ));
    let per = |cpu: f64, b: &crate::scale::load::Batch| {
        if b.done == 0 {
            DASH.to_string()
        } else {
            short(Duration::from_secs_f64(cpu / b.done as f64))
        }
    };
    note(format!(
        "CP CPU per create with the nodes live (heartbeats answered meanwhile included; an LB's until its health checks were at every node and their first verdicts written): LB {} ({:.1} CPU-s), VM {} ({:.1} CPU-s)",
        per(r.lbs_cpu, &r.lbs),
        r.lbs_cpu,
        per(r.live_cpu, &r.live),
        r.live_cpu,
    ));
    if let Some(s) = &r.steady {
        note(format!(
            "steady state ({:.1} s): {} VMs placed, {} running, {} health checks handed out; {} heartbeats answered ({} woken early by a desired-state wait), {} timed out, {} failed; CP {:.1} CPU-s, the simulated nodes (this process) {:.1} CPU-s ({:.0} % of a core); nodes silent longer than the CP's node timeout (as the nodes saw it): {}",
            s.elapsed.as_secs_f64(),
            thousands(r.placed as u64),
            thousands(r.running as u64),
            thousands(r.checks as u64),
            thousands(s.beats.answered),
            thousands(s.beats.woken),
            thousands(s.beats.timed_out),
            thousands(s.beats.failed),
            s.cp_cpu,
            s.bench_cpu,
            core_pct(s.bench_cpu, s.elapsed),
            s.silent,
        ));
    }
    if let Some(b) = &r.broker {
        note(format!(
            "broker ({:.1} s, {} in flight): {} credentials, {} errors{}; p50 / p99 {}; CP {:.2} CPU-s ({:.2} net of the heartbeats answered meanwhile), the bench (its nodes and callers) {:.2} CPU-s; heartbeats meanwhile: {} answered, p50 / p99 {}",
            b.load.elapsed.as_secs_f64(),
            b.load.concurrency,
            thousands(b.load.credentials),
            thousands(b.load.errors),
            b.load.first_error.as_ref().map(|e| format!(" (first: {e})")).unwrap_or_default(),
            if b.load.latencies.len() > 0 {
                format!("{} / {}", short(b.load.latencies.p50()), short(b.load.latencies.p99()))
            } else {
                DASH.into()
            },
            b.cp_cpu,
            b.cp_cpu_net,
            b.bench_cpu,
            thousands(b.beats.answered),
            if b.beats.latencies.len() > 0 {
                format!("{} / {}", short(b.beats.latencies.p50()), short(b.beats.latencies.p99()))
            } else {
                DASH.into()
            },
        ));
    }
    let w = &r.nodes_watch;
    let (measured, most_measured) = w.not_ready(r.measured);
    let (all, most) = w.not_ready(None);
    note(format!(
        "node list: {} checks ({} failed), p50 / max {}; NotReady seen: {} nodes from the settle time on (at most {} at once), {} since the first VMs ran (at most {} at once); desired-state waits answered: {} changed, {} unchanged, {} failed; one desired state: hypervisor {}, gateway {}; CP RSS peak {}; vm list listed {}; audit writes the CP logged as failed: {}",
        w.checks,
        w.failed,
        if w.took.len() > 0 {
            format!("{} / {}", short(w.took.p50()), short(w.took.percentile(1.0)))
        } else {
            DASH.into()
        },
        measured.len(),
        most_measured,
        all.len(),
        most,
        thousands(r.wakes.0),
        thousands(r.wakes.1),
        thousands(r.wakes.2),
        r.desired_bytes.0.map_or(DASH.into(), |b| bytes(b as f64)),
        r.desired_bytes.1.map_or(DASH.into(), |b| bytes(b as f64)),
        bytes(r.rss_peak as f64),
        match &r.vm_list {
            Some(Ok((_, n))) => thousands(*n as u64),
            Some(Err(e)) => format!("nothing ({e})"),
            None => DASH.into(),
        },
        r.audit_failures,
    ));
    if let Some(e) = &r.first_heartbeat_error {
        note(format!("first heartbeat error: {e}"));
    }
    if let Some(e) = &r.error {
        note(format!("error: {e}"));
    }
    out
}

/// The latency table, its goals and what it measured.
fn render_latency(l: &Latency) -> String {
    let added = |path: Path| -> Option<Duration> {
        let p = l.path(path)?.round_trip.p50();
        let d = l.path(path.baseline())?.round_trip.p50();
        Some(p.saturating_sub(d))
    };
    let rows: Vec<Vec<String>> = l
        .paths
        .iter()
        .map(|p| {
            let rt = &p.round_trip;
            vec![
                p.path.name().to_string(),
                format!("{} / {}", short(rt.p50()), short(rt.p99())),
                if p.path.baseline() == p.path {
                    DASH.into()
                } else {
                    added(p.path).map_or_else(|| DASH.into(), short)
                },
                rate(p.connections),
            ]
        })
        .collect();
    let mut out = format!(
        "latency: {}-byte round trips over one connection, and new connections with one byte echoed\n\n",
        crate::latency::MESSAGE
    );
    out.push_str(&table(
        &["path", "round trip p50 / p99", "added p50", "new connections/s"],
        &rows,
    ));
    match &l.pgbench {
        Ok(pg) => {
            let _ = writeln!(
                out,
                "\npgbench -S (PostgreSQL {} in the overlay guest, 4 clients, {} s a run)\n",
                pg.version, pg.seconds
            );
            let direct = pg.row(crate::pgbench::DIRECT);
            let share = |tps: f64, of: Option<f64>| {
                of.map_or_else(|| DASH.into(), |d| format!("{:.2}x", ratio(tps, d)))
            };
            let rows: Vec<Vec<String>> = pg
                .rows
                .iter()
                .map(|r| {
                    vec![
                        r.path.to_string(),
                        format!(
                            "{} tps, {:.3} ms",
                            rate(r.persistent.tps),
                            r.persistent.latency_ms
                        ),
                        share(r.persistent.tps, direct.map(|d| d.persistent.tps)),
                        format!(
                            "{} tps, {:.2} ms",
                            rate(r.per_connection.tps),
                            r.per_connection.latency_ms
                        ),
                        share(r.per_connection.tps, direct.map(|d| d.per_connection.tps)),
                    ]
                })
                .collect();
            out.push_str(&table(
                &[
                    "path",
                    "persistent",
                    "of direct",
                    "a connection per transaction (-C)",
                    "of direct",
                ],
                &rows,
            ));
        }
        Err(why) => {
            let _ = writeln!(out, "\npgbench -S: not run ({why})");
        }
    }
    out.push_str("\ngoals (issue #17):\n");
    let mut goal = |what: &str, value: String, verdict: String| {
        let _ = writeln!(out, "  {what:<62} {value:<14} {verdict}");
    };
    match (added(Path::Forward), added(Path::NginxSocat)) {
        (Some(fwd), Some(socat)) => {
            goal(
                "round trip through otherix forward: added p50 < 150 µs",
                short(fwd),
                verdict_max(fwd.as_secs_f64(), GOAL_ROUND_TRIP_ADDED.as_secs_f64(), |v| {
                    short(Duration::from_secs_f64(v))
                }),
            );
            // Each with a local process and a loopback hop in front of the
            // TLS server: forward before the gateway, socat before nginx.
            goal(
                "  ... and no more than nginx stream+TLS via socat adds",
                format!("{} vs {}", short(fwd), short(socat)),
                verdict_max(fwd.as_secs_f64(), socat.as_secs_f64(), |v| {
                    short(Duration::from_secs_f64(v))
                }),
            );
        }
        _ => goal(
            "round trip through otherix forward",
            DASH.into(),
            "not measured".into(),
        ),
    }
    if let (Some(gw), Some(nginx)) = (added(Path::Gateway), added(Path::Nginx)) {
        goal(
            "round trip, client library to the gateway, <= nginx stream+TLS",
            format!("{} vs {}", short(gw), short(nginx)),
            verdict_max(gw.as_secs_f64(), nginx.as_secs_f64(), |v| {
                short(Duration::from_secs_f64(v))
            }),
        );
    }
    if let Ok(pg) = &l.pgbench {
        if let (Some(d), Some(f)) = (pg.row(crate::pgbench::DIRECT), pg.row(crate::pgbench::FORWARD)) {
            let p = ratio(f.persistent.tps, d.persistent.tps);
            goal(
                "pgbench -S through forward >= 0.7x direct (persistent)",
                format!("{p:.2}x"),
                verdict_min(p, GOAL_PGBENCH_PERSISTENT, |v| format!("{v:.2}x")),
            );
            let c = ratio(f.per_connection.tps, d.per_connection.tps);
            goal(
                "  ... >= 0.8x direct with a connection per transaction",
                format!("{c:.2}x"),
                verdict_min(c, GOAL_PGBENCH_RECONNECT, |v| format!("{v:.2}x")),
            );
        }
    }
    let _ = writeln!(
        out,
        "\nnotes:\n  round trip: {} messages over one connection kept open, in {} rounds with every path in turn (each round after {} of warm-up); added: p50 less the direct p50 to the same guest (the bridge guest for the relay and websocat); otherix forward: its local port, connections kept ready (its default), the forward and the gateway on the path; library: tunnel::open_brokered, as the setup rows\n  new connections/s: {} loops for {} s, each connecting, echoing one byte and closing; through the library each is also brokered (the CP call and a TLS handshake to the gateway or the CP); direct: this binary in the node's namespace",
        thousands(crate::latency::ROUND_TRIPS as u64),
        crate::latency::ROUNDS,
        crate::latency::WARM_UP,
        crate::latency::CONCURRENCY,
        crate::latency::CONNECT_TIME.as_secs()
    );
    out
}

/// The two runtimes side by side, then what went wrong, if anything.
fn render_qemu(c: &Comparison) -> String {
    let qemu_title = format!(
        "qemu ({})",
        c.qemu.accelerator.as_deref().unwrap_or("accelerator unknown")
    );
    let header = ["", "netns", qemu_title.as_str()];
    let boots = c.netns.boots.len().max(c.qemu.boots.len());
    let moved = |f: &Figures| f.migrations.iter().filter(|m| m.failed.is_none()).count();
    type Cell = dyn Fn(&Figures) -> String;
    let rows: Vec<(String, Box<Cell>)> = vec![
        (
            format!("boot: vm create to first HTTP 200, {boots} boots: p50 / p99 (range)"),
            Box::new(|f| spread_cell(&f.boots, short)),
        ),
        (
            "RSS per guest after boot: p50 / p99 (range)".into(),
            Box::new(|f| spread_cell(&f.rss_after_boot, mib)),
        ),
        (
            "RSS of the migrated guest after its migrations".into(),
            Box::new(|f| f.rss_after_migrations.map_or_else(|| DASH.into(), mib)),
        ),
        (
            format!("migrations done / failed (of {})", c.migrations),
            Box::new(move |f| format!("{} / {}", moved(f), f.migrations.len() - moved(f))),
        ),
        (
            "`vm migrate` wall clock, migrations done: p50 / p99 (range)".into(),
            Box::new(|f| {
                let done: Vec<Duration> = f
                    .migrations
                    .iter()
                    .filter(|m| m.failed.is_none())
                    .map(|m| m.wall)
                    .collect();
                spread_cell(&done, short)
            }),
        ),
        (
            "client-visible gap per migration done: p50 / p99 (range)".into(),
            Box::new(move |f| {
                let gaps: Vec<Duration> = f
                    .migrations
                    .iter()
                    .filter(|m| m.failed.is_none())
                    .filter_map(|m| m.gap)
                    .collect();
                let cell = spread_cell(&gaps, short);
                if gaps.len() < moved(f) {
                    format!("{cell}, {} of {} (then the stream broke)", gaps.len(), moved(f))
                } else {
                    cell
                }
            }),
        ),
        (
            "QEMU downtime: p50 / p99 (range)".into(),
            Box::new(|f| spread_cell(&qemu_figure(f, |q| q.downtime), short)),
        ),
        (
            "QEMU total time: p50 / p99 (range)".into(),
            Box::new(|f| spread_cell(&qemu_figure(f, |q| q.total), short)),
        ),
        (
            "QEMU bytes sent: p50 / p99 (range)".into(),
            Box::new(|f| spread_cell(&qemu_figure(f, |q| q.bytes), mib)),
        ),
        (
            "echo stream: sent / back / lost".into(),
            Box::new(|f| {
                f.stream.as_ref().map_or_else(
                    || DASH.into(),
                    |s| {
                        format!(
                            "{} / {} / {}",
                            bytes(s.sent as f64),
                            bytes(s.received as f64),
                            s.lost
                        )
                    },
                )
            }),
        ),
        (
            "echo stream byte-exact (count and SHA-256)".into(),
            Box::new(|f| {
                f.stream.as_ref().map_or_else(
                    || DASH.into(),
                    |s| match (&s.broke, s.exact) {
                        (Some(why), _) => format!("NO: {why}"),
                        (None, true) => "yes".into(),
                        (None, false) => "NO".into(),
                    },
                )
            }),
        ),
        (
            "guest restarted (QEMU: uptime; netns: processes)".into(),
            Box::new(|f| match f.restarted {
                Some(true) => "YES".into(),
                Some(false) => "no".into(),
                None => DASH.into(),
            }),
        ),
        (
            "boots / kernel trouble lines on the serial console".into(),
            Box::new(|f| match f.console_boots {
                Some(b) => format!("{b} / {}", f.trouble.len()),
                None => DASH.into(),
            }),
        ),
        (
            "QEMU ended on its own and restarted by the agent".into(),
            Box::new(|f| f.qemu_restarts.map_or_else(|| DASH.into(), |n| n.to_string())),
        ),
    ];
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|(name, cell)| vec![name.clone(), cell(&c.netns), cell(&c.qemu)])
        .collect();
    let mut out = format!(
        "qemu: the namespace runtime beside QEMU on one testbed; {} migrations each, node1 → node2 → node1 ..., an echo stream through the gateway across them\n\n",
        c.migrations
    );
    out.push_str(&table(&header, &rows));
    out.push('\n');
    out.push_str(&migration_lines(c));
    out.push('\n');
    for f in [&c.netns, &c.qemu] {
        for (i, m) in f.migrations.iter().enumerate() {
            if let Some(why) = &m.failed {
                let _ = writeln!(
                    out,
                    "  {} migration {} ({} → {}) FAILED after {}: {why}",
                    f.kind.name(),
                    i + 1,
                    m.from,
                    m.to,
                    short(m.wall)
                );
            } else if f.kind == crate::qemu::Kind::Qemu && m.qemu.is_none() {
                let _ = writeln!(
                    out,
                    "  qemu migration {}: no `QEMU migration completed` line in {}'s log",
                    i + 1,
                    m.from
                );
            }
        }
        for line in f.trouble.iter().take(20) {
            let _ = writeln!(out, "  {} console: {line}", f.kind.name());
        }
    }
    let _ = writeln!(
        out,
        "  p99 is nearest-rank: over fewer than 100 samples, the largest. The gap is the stream's longest silence from a migration's start to the next one's."
    );
    let _ = match c.downtime_limit {
        Some(limit) => writeln!(
            out,
            "  QEMU downtime limit: {} ms (--qemu-downtime)",
            limit.as_millis()
        ),
        None => writeln!(out, "  QEMU downtime limit: the agents' default"),
    };
    let _ = writeln!(out, "  logs (agents, QEMU console): {}", c.logs.display());
    out
}

/// Every migration of both runtimes, one line each.
fn migration_lines(c: &Comparison) -> String {
    let mut rows = Vec::new();
    for f in [&c.netns, &c.qemu] {
        for (i, m) in f.migrations.iter().enumerate() {
            let q = m.qemu.unwrap_or_default();
            let opt = |d: Option<Duration>| d.map_or_else(|| DASH.into(), short);
            rows.push(vec![
                f.kind.name().to_string(),
                (i + 1).to_string(),
                format!("{} → {}", m.from, m.to),
                if m.failed.is_some() {
                    "FAILED".into()
                } else {
                    "ok".into()
                },
                short(m.wall),
                opt(m.gap),
                opt(q.downtime),
                opt(q.total),
                q.bytes.map_or_else(|| DASH.into(), mib),
            ]);
        }
    }
    table(
        &[
            "runtime",
            "#",
            "move",
            "outcome",
            "vm migrate",
            "gap",
            "QEMU downtime",
            "QEMU total",
            "QEMU bytes",
        ],
        &rows,
    )
}

/// The QEMU figures of a runtime's migrations that QEMU reported.
fn qemu_figure<T>(f: &Figures, pick: impl Fn(&crate::qemu::figures::QemuMigration) -> Option<T>) -> Vec<T> {
    f.migrations
        .iter()
        .filter_map(|m| pick(m.qemu.as_ref()?))
        .collect()
}

/// Resumable relay sessions beside plain ones: one table, the goal under it,
/// then whatever failed.
fn render_resume(r: &crate::resume::Figures) -> String {
    use crate::resume::Kind;
    let header = [
        "",
        "direct",
        "plain relay",
        "resumable relay",
        "resumable / plain",
    ];
    use crate::resume::{median, Round};
    // Median (min – max) over the rounds.
    let middle = |xs: Vec<f64>, show: &dyn Fn(f64) -> String| match median(xs.clone()) {
        Some(m) => {
            let (lo, hi) = xs
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
                    (lo.min(x), hi.max(x))
                });
            format!("{} ({} – {})", show(m), show(lo), show(hi))
        }
        None => DASH.into(),
    };
    let mut rows: Vec<Vec<String>> = Vec::new();
    for w in &r.throughput {
        let rate = |path: fn(&Round) -> Option<f64>| middle(w.rates(path), &gbits);
        rows.push(vec![
            format!("throughput, 1 stream, {}", w.name),
            rate(|r| r.direct),
            rate(|r| r.plain),
            rate(|r| r.resumable),
            middle(w.ratios(), &|x| format!("{x:.2}")),
        ]);
    }
    let per = |kind: Kind, f: fn(&crate::resume::SessionMemory) -> Option<f64>| {
        r.memory
            .iter()
            .find(|m| m.kind == kind)
            .and_then(|m| Some((f(m)?, m)))
            .map_or_else(
                || DASH.into(),
                |(b, m)| format!("{} ({} of {})", signed_bytes(b), m.opened, m.requested),
            )
    };
    let ratio_of = |f: fn(&crate::resume::SessionMemory) -> Option<f64>| {
        let get = |k| r.memory.iter().find(|m| m.kind == k).and_then(f);
        match (get(Kind::Plain), get(Kind::Resumable)) {
            (Some(p), Some(q)) if p > 0.0 => format!("{:.2}", q / p),
            _ => DASH.into(),
        }
    };
    type PerSession = fn(&crate::resume::SessionMemory) -> Option<f64>;
    for (what, f) in [
        (
            "idle memory per session, CP (the replica carrying them)",
            crate::resume::SessionMemory::cp_per_session as PerSession,
        ),
        (
            "idle memory per session, node agent",
            crate::resume::SessionMemory::agent_per_session,
        ),
    ] {
        rows.push(vec![
            what.into(),
            DASH.into(),
            per(Kind::Plain, f),
            per(Kind::Resumable, f),
            ratio_of(f),
        ]);
    }
    for e in &r.events {
        rows.push(vec![
            format!("gap: {}", e.event.title()),
            DASH.into(),
            e.plain.clone(),
            format!("{} n={}", spread_cell(&e.gaps, short), e.gaps.len()),
            DASH.into(),
        ]);
    }
    let mut out = format!(
        "resume: resumable relay sessions beside plain ones (#31); otherix forward in the host namespace, a bridge guest on node1 (node2 after migrations), two CP replicas on PostgreSQL; throughput median (min – max) of {} rounds of {} s, the ratio the median of each round's own (plain and resumable back to back); gaps p50 / p99 (min – max) of a 64-byte echo message every 1 ms over {} tries; the plain column's gap cells say what became of a plain stream during the first try\n\n",
        r.rounds, r.seconds, r.tries
    );
    out.push_str(&table(&header, &rows));
    out.push('\n');
    for w in &r.throughput {
        if let Some(x) = w.ratio() {
            let _ = writeln!(
                out,
                "  goal: the resumable stream costs <= 10 % of one-stream throughput, {}: {:.0} % of plain: {}",
                w.name,
                x * 100.0,
                verdict_min(x, 0.90, |d| format!("{:.0} points", d * 100.0))
            );
        }
    }
    for e in &r.events {
        let _ = writeln!(
            out,
            "  {}: {} of {} tries resumed, stream byte-exact: {}",
            e.event.title(),
            e.gaps.len(),
            r.tries,
            if e.exact { "yes" } else { "NO" }
        );
        for f in &e.failures {
            let _ = writeln!(out, "    {f}");
        }
    }
    for w in &r.throughput {
        for f in &w.failures {
            let _ = writeln!(out, "  iperf3 failed, {}: {f}", w.name);
        }
    }
    for m in &r.memory {
        let _ = writeln!(out, "  {:?} idle sessions: carried by {}", m.kind, m.replica);
        if let Some(e) = &m.first_error {
            let _ = writeln!(out, "  {:?} sessions: first failure: {e}", m.kind);
        }
    }
    let _ = writeln!(
        out,
        "  load average (1, 5, 15 min): {} at the start, {} at the end",
        r.load.0, r.load.1
    );
    out
}

/// `12.3 KiB`, or `-1.2 KiB` when the resident set shrank.
fn signed_bytes(b: f64) -> String {
    if b < 0.0 {
        format!("-{}", bytes(-b))
    } else {
        bytes(b)
    }
}

/// `p50 / p99 (min – max)`, or a dash for no sample.
fn spread_cell<T: Copy + Ord>(samples: &[T], show: impl Fn(T) -> String) -> String {
    match Spread::of(samples.to_vec()) {
        Some(s) => format!(
            "{} / {} ({} – {})",
            show(s.p50),
            show(s.p99),
            show(s.min),
            show(s.max)
        ),
        None => DASH.into(),
    }
}

fn core_pct(cpu_seconds: f64, elapsed: Duration) -> f64 {
    crate::scale::figures::core_share(cpu_seconds, elapsed) * 100.0
}

/// A rate with the precision it needs: `2.7`, `375`, `1,730`.
fn rate(per_second: f64) -> String {
    if per_second < 10.0 {
        format!("{per_second:.1}")
    } else {
        thousands(per_second.round() as u64)
    }
}

/// A duration in the unit that reads best: `48 µs`, `13.0 ms`, `8.80 s`.
fn short(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{:.0} µs", s * 1e6)
    }
}

/// `300.0 MiB`, `1.06 GiB`, `12.3 KiB`.
fn bytes(b: f64) -> String {
    if b >= 1073741824.0 {
        format!("{:.2} GiB", b / 1073741824.0)
    } else if b >= 1048576.0 {
        format!("{:.1} MiB", b / 1048576.0)
    } else {
        format!("{:.1} KiB", b / 1024.0)
    }
}

fn setup_name(kind: SetupKind) -> &'static str {
    match kind {
        SetupKind::Gateway => "credential in hand",
        SetupKind::Broker => "incl. broker, kept-alive CP connection",
        SetupKind::BrokerNewConnection => "incl. broker, new CP connection",
        SetupKind::Relay => "relay, incl. broker",
    }
}

fn proc_cell(p: &crate::soak::ProcFigures) -> String {
    format!(
        "{} ({}) / {} ({}) / {:.0}%",
        p.fds_end,
        p.fds_max,
        mib(p.rss_end),
        mib(p.rss_max),
        p.cpu * 100.0
    )
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1048576.0)
}

fn ratio_of(with: Duration, without: Duration) -> Option<f64> {
    (!without.is_zero() && !with.is_zero()).then(|| with.as_secs_f64() / without.as_secs_f64())
}

fn hist_ratio(with: &Histogram, without: &Histogram) -> Option<f64> {
    ratio_of(with.quantile(0.99)?, without.quantile(0.99)?)
}

fn hist_pair(h: &Histogram) -> String {
    match (h.quantile(0.5), h.quantile(0.99)) {
        (Some(p50), Some(p99)) => format!("{} / {}", ms(p50), ms(p99)),
        _ => DASH.into(),
    }
}

fn pair(l: &Latencies) -> String {
    format!("{} / {}", ms(l.p50()), ms(l.p99()))
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn gbits(bps: f64) -> String {
    format!("{:.2} Gbit/s", bps / 1e9)
}

fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        0.0
    } else {
        a / b
    }
}

/// Met if `value <= goal`; otherwise by how much it is over.
fn verdict_max(value: f64, goal: f64, show: impl Fn(f64) -> String) -> String {
    if value <= goal {
        "met".into()
    } else {
        format!("MISSED by {} ({:.1}x the goal)", show(value - goal), value / goal)
    }
}

/// Met if `value >= goal`; otherwise by how much it is short.
fn verdict_min(value: f64, goal: f64, show: impl Fn(f64) -> String) -> String {
    if value >= goal {
        "met".into()
    } else {
        format!(
            "MISSED by {} ({:.0}% of the goal)",
            show(goal - value),
            100.0 * value / goal
        )
    }
}

/// A left-aligned text table with a rule under the header.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            rows.iter()
                .map(|r| r[i].chars().count())
                .chain([header[i].chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<&str>| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join(" | ")
            .trim_end()
            .to_string()
            + "\n"
    };
    let mut out = line(header.to_vec());
    out.push_str(
        &(widths
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .join("-|-")
            + "\n"),
    );
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

/// `nproc`, memory, kernel, CPU model and load average, from /proc.
pub fn machine() -> String {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_kib: u64 = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    let kernel = read("/proc/sys/kernel/osrelease");
    let load: Vec<String> = read("/proc/loadavg")
        .split_whitespace()
        .take(3)
        .map(str::to_string)
        .collect();
    format!(
        "{cpus} CPUs ({model}), {:.1} GiB RAM, Linux {}, load average {} at the end",
        mem_kib as f64 / 1048576.0,
        kernel.trim(),
        load.join(" ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_say_by_how_much_a_goal_is_missed() {
        assert_eq!(verdict_max(1.0, 2.0, |d| format!("{d}")), "met");
        assert_eq!(
            verdict_max(3.0, 2.0, |d| format!("{d}")),
            "MISSED by 1 (1.5x the goal)"
        );
        assert_eq!(verdict_min(30.0, 20.0, |d| format!("{d}")), "met");
        assert_eq!(
            verdict_min(5.0, 20.0, |d| format!("{d}")),
            "MISSED by 15 (25% of the goal)"
        );
    }

    #[test]
    fn scale_figures_read_in_their_units() {
        assert_eq!(short(Duration::from_micros(48)), "48 µs");
        assert_eq!(short(Duration::from_millis(13)), "13.0 ms");
        assert_eq!(short(Duration::from_millis(8_800)), "8.80 s");
        assert_eq!(rate(2.66), "2.7");
        assert_eq!(rate(1_730.4), "1,730");
        assert_eq!(bytes(1.06 * 1073741824.0), "1.06 GiB");
        assert_eq!(bytes(300.0 * 1048576.0), "300.0 MiB");
    }

    #[test]
    fn a_scale_row_that_stopped_early_still_renders() {
        let scale = Scale {
            settings: crate::scale::Settings::from_options(&match crate::options::parse(std::iter::empty())
                .unwrap()
            {
                crate::options::Command::Run(o) => *o,
                _ => unreachable!(),
            }),
            rows: vec![RowResult {
                row: crate::scale::plan::Row::parse("100x10000x1000").unwrap(),
                shortfalls: vec!["placed 4,000 of 10,000 in 300 s".into()],
                ..RowResult::default()
            }],
        };
        let text = render_scale(&scale);
        assert!(text.contains("100 / 10,000 / 1,000"), "{text}");
        assert!(text.contains("placed 4,000 of 10,000 in 300 s"), "{text}");
    }

    #[test]
    fn tables_align_cells_with_wide_characters() {
        let t = table(
            &["a", "b"],
            &[
                vec!["48 µs".into(), "x".into()],
                vec!["13.0 ms".into(), "y".into()],
            ],
        );
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[2].chars().count(), lines[3].chars().count(), "{t}");
    }

    #[test]
    fn an_empty_report_still_renders_every_row() {
        let opts = match crate::options::parse(std::iter::empty()).unwrap() {
            crate::options::Command::Run(o) => o,
            _ => unreachable!(),
        };
        let text = Report::new(&opts).render();
        for row in [
            "direct",
            "otherix gateway",
            "nginx stream+TLS",
            "direct (bridge)",
            "otherix relay",
            "websocat (wss)",
            "websockify (wss)",
            "machine:",
        ] {
            assert!(text.contains(row), "{text}");
        }
    }

    #[test]
    fn a_soak_report_has_a_column_per_attack_and_says_what_the_attacker_got() {
        use crate::soak::{Attacked, Phase, Soak};
        let quiet = Phase {
            probe: Latencies::new(vec![Duration::from_millis(2); 10]),
            ..Phase::default()
        };
        let flooded = Phase {
            probe: Latencies::new(vec![Duration::from_millis(5); 10]),
            node_limited: vec![("heartbeat".into(), 1234.0)],
            attacker: [
                ("heartbeat 429".to_string(), 1234),
                ("heartbeat 200".to_string(), 60),
            ]
            .into(),
            ..Phase::default()
        };
        let attacked = |attack, phase| Attacked {
            attack,
            lead: Duration::from_secs(5),
            lead_note: None,
            phase,
            after: Vec::new(),
            not_ready_after: Vec::new(),
        };
        let soak = Soak {
            clients_per_target: 5_000,
            sources: 8,
            kinds: vec![crate::options::SlowKind::Tcp],
            interval: Duration::from_secs(5),
            half_open_clients: 12_000,
            half_open_sources: 8,
            without: quiet.clone(),
            attacks: vec![
                attacked(Attack::NodeFlood, flooded),
                attacked(Attack::RelayFill, quiet),
            ],
            cp_args: "otherix server".into(),
        };
        let text = render_soak(&soak);
        let header = text.lines().find(|l| l.contains("quiet")).unwrap_or_default();
        assert!(
            header.contains("node flood") && header.contains("relay cache fill"),
            "{text}"
        );
        assert!(text.contains("2.00 ms / 2.00 ms (1.00x)"), "{text}");
        assert!(text.contains("5.00 ms / 5.00 ms (2.50x)"), "{text}");
        assert!(text.contains("heartbeat 429 1234, heartbeat 200 60"), "{text}");
        assert!(
            text.contains("node calls over their rate (429): heartbeat 1234"),
            "{text}"
        );
        assert!(
            text.contains("node flood: heartbeat p99 (probe node)") && text.contains("MISSED by 0.50x"),
            "{text}"
        );
    }

    #[test]
    fn the_qemu_table_counts_only_migrations_done_and_stops_the_gaps_where_the_stream_broke() {
        use crate::qemu::figures::QemuMigration;
        use crate::qemu::{Kind, Migration, StreamFigures};
        let migration = |wall_ms: u64, gap_ms: Option<u64>, failed: bool, downtime_ms: u64| Migration {
            from: "node1".into(),
            to: "node2".into(),
            wall: Duration::from_millis(wall_ms),
            failed: failed.then(|| "vm \"q\" is pending, not running".into()),
            qemu: (!failed).then_some(QemuMigration {
                downtime: Some(Duration::from_millis(downtime_ms)),
                total: Some(Duration::from_millis(1200)),
                bytes: Some(100 << 20),
            }),
            gap: gap_ms.map(Duration::from_millis),
        };
        let figures = |kind: Kind, migrations: Vec<Migration>| Figures {
            kind,
            accelerator: (kind == Kind::Qemu).then(|| "tcg".into()),
            boots: vec![Duration::from_millis(3800)],
            rss_after_boot: vec![244 << 20],
            rss_after_migrations: Some(180 << 20),
            migrations,
            stream: Some(StreamFigures {
                sent: 1000,
                received: 1000,
                exact: true,
                lost: 0,
                broke: None,
            }),
            restarted: Some(false),
            console_boots: None,
            qemu_restarts: None,
            trouble: Vec::new(),
        };
        let mut qemu = figures(
            Kind::Qemu,
            vec![
                migration(2900, Some(300), false, 130),
                migration(3100, None, false, 150),
                migration(8, None, true, 0),
            ],
        );
        qemu.restarted = Some(true);
        qemu.console_boots = Some(2);
        qemu.qemu_restarts = Some(1);
        qemu.trouble = vec!["[   46.376512] kernel BUG at lib/list_debug.c:49!".into()];
        let c = Comparison {
            netns: figures(Kind::Netns, vec![migration(3250, Some(99), false, 0)]),
            qemu,
            migrations: 3,
            logs: "/tmp/otherix-bench-qemu/ox0000".into(),
            downtime_limit: Some(Duration::from_millis(10)),
        };
        let text = render_qemu(&c);
        let row = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| panic!("no row {name}: {text}"))
                .to_string()
        };
        assert!(row("migrations done / failed").ends_with("| 2 / 1"), "{text}");
        // The failed call's 8 ms is not a migration's time.
        assert!(
            row("`vm migrate` wall clock").ends_with("| 2.90 s / 3.10 s (2.90 s – 3.10 s)"),
            "{text}"
        );
        assert!(
            row("client-visible gap").ends_with(", 1 of 2 (then the stream broke)"),
            "{text}"
        );
        assert!(row("guest restarted").ends_with("| YES"), "{text}");
        assert!(row("boots / kernel trouble").ends_with("| 2 / 1"), "{text}");
        let cells: Vec<String> = row("QEMU ended on its own")
            .split('|')
            .map(|c| c.trim().to_string())
            .collect();
        assert_eq!(cells[1..], ["-", "1"], "{text}");
        assert!(text.contains("qemu migration 3 (node1 → node2) FAILED"), "{text}");
        assert!(
            text.contains("qemu console: [   46.376512] kernel BUG at"),
            "{text}"
        );
        assert!(
            text.contains("QEMU downtime limit: 10 ms (--qemu-downtime)"),
            "{text}"
        );
    }
}
