//! `otherix-bench`: the speed benchmark of brokered access. Builds its own
//! testbed cluster, measures the paths to an overlay guest side by side — a
//! direct TCP dial, the Otherix gateway, nginx's stream module with TLS — and
//! to a bridge guest — a direct dial, the Otherix relay, websocat,
//! websockify — and prints one table with the goals under it; or, with
//! `--only soak`, attacks the cluster — slow clients against the control
//! plane and the gateway, half-open handshakes against the gateway, a node
//! looping its calls, a principal filling the relay's replay cache — and
//! compares heartbeats and connection setup quiet and under each attack; or, with `--only scale`, measures the control
//! plane with hundreds of simulated nodes and thousands of VMs and LBs
//! (no testbed, no root); or, with `--only qemu`, compares the QEMU guest
//! runtime with the namespace runtime: boot, memory, and migrations under a
//! stream; or, with `--only resume`, resumable relay sessions beside plain
//! ones: throughput, memory per idle session, and the gap a client sees when
//! its connection drops, its replica fails over or its VM migrates. Run as root:
//! `cargo run --release -p otherix-bench` (see `--help` and
//! docs/benchmarks.md).

mod bed;
mod broker;
mod flood;
mod latency;
mod memory;
mod nginx;
mod node_flood;
mod options;
mod outcomes;
mod pgbench;
mod probe;
mod procfs;
mod prom;
mod qemu;
mod relay_fill;
mod report;
mod resume;
mod scale;
mod setup;
mod soak;
mod throughput;
mod tools;
mod tunnels;

use std::process::ExitCode;

use options::{Command, Options, Part};
use report::Report;

fn main() -> ExitCode {
    let command = match options::parse(std::env::args().skip(1)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}\nhint: otherix-bench --help");
            return ExitCode::from(2);
        }
    };
    let result = match command {
        Command::Help => {
            print!("{}", options::HELP);
            Ok(())
        }
        Command::ProbeDirect { addr, count } => setup::probe_direct(addr, count),
        Command::ProbePingpong { addr, count } => latency::probe_pingpong(addr, count),
        Command::ProbeConnections {
            addr,
            millis,
            concurrency,
        } => latency::probe_connections(addr, millis, concurrency),
        Command::ProbeBroker {
            vms,
            callers,
            millis,
            seed,
        } => scale::load::probe_broker(vms, callers, millis, seed),
        Command::Run(opts) => run(&opts),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Builds the testbed, runs the chosen parts in a fixed order, prints the table.
fn run(opts: &Options) -> anyhow::Result<()> {
    if opts.runs(Part::Scale) {
        // No testbed: control planes of its own on 127.0.0.1.
        let bin = options::otherix_binary(opts)?;
        let mut report = Report::new(opts);
        report.scale = Some(scale::run(&bin, opts)?);
        print!("{}", report.render());
        return Ok(());
    }
    if opts.runs(Part::Qemu) {
        // A testbed of its own, with two hypervisors.
        let bin = options::otherix_binary(opts)?;
        let mut report = Report::new(opts);
        report.qemu = Some(qemu::run(&bin, opts)?);
        print!("{}", report.render());
        return Ok(());
    }
    if opts.runs(Part::Resume) {
        // A testbed of its own: two replicas on PostgreSQL, two hypervisors.
        let bin = options::otherix_binary(opts)?;
        let mut report = Report::new(opts);
        report.resume = Some(resume::run(&bin, opts)?);
        print!("{}", report.render());
        return Ok(());
    }
    let purpose = if opts.runs(Part::Soak) {
        bed::Purpose::Soak
    } else {
        bed::Purpose::Speed
    };
    let websocat = tools::preflight(opts.websocat.as_deref(), purpose)?;
    let bin = options::otherix_binary(opts)?;
    tools::raise_nofile_limit(tools::NOFILE);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;

    let bed = bed::Bed::start(&bin, websocat.as_deref(), purpose)?;
    let mut report = Report::new(opts);
    if opts.runs(Part::Broker) {
        progress("brokering credentials");
        report.broker = Some(rt.block_on(broker::rate(&bed, opts))?);
    }
    if opts.runs(Part::Setup) {
        progress("timing connection setup");
        report.setup = Some(setup::measure(&bed, &rt, opts)?);
    }
    if opts.runs(Part::Throughput) {
        progress("moving bytes with iperf3");
        report.throughput = Some(throughput::measure(&bed, opts)?);
    }
    if opts.runs(Part::Memory) {
        progress("opening idle sessions");
        report.memory = Some(rt.block_on(memory::idle_sessions(&bed, opts))?);
        progress("opening idle relay sessions");
        report.relay_memory = Some(rt.block_on(memory::relay_sessions(&bed, opts))?);
    }
    if opts.runs(Part::Latency) {
        progress("timing round trips and new connections");
        report.latency = Some(latency::measure(&bed, &rt, opts, &bin)?);
    }
    if opts.runs(Part::Soak) {
        progress("soaking: a quiet phase, then each attack");
        report.soak = Some(soak::run(&bed, &rt, opts)?);
    }
    print!("{}", report.render());
    if !opts.hold.is_zero() {
        progress(&format!(
            "holding the testbed for {:?} (world {}, gateway agent pid {}, control plane pid {})",
            opts.hold,
            bed.world().prefix(),
            bed.agent_pid,
            bed.cp_pid
        ));
        std::thread::sleep(opts.hold);
    }
    Ok(())
}

/// Progress goes to stderr; the table alone goes to stdout.
pub(crate) fn progress(what: &str) {
    eprintln!("otherix-bench: {what}...");
}
