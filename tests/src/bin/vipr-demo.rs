//! vipr-demo: vipr balancing a ClusterIP service between network namespaces, on this kernel.
//!
//! Builds a client namespace, a node namespace running vipr on a services file
//! (examples/demo-services.yaml by default) and one namespace per endpoint; opens many TCP
//! connections and sends UDP datagrams to every service port, prints how they spread over
//! the endpoints, and removes everything again. Needs root. `cargo xtask demo` runs it.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
    thread,
    time::Duration,
};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use proxy_common::pins;
use testbed::{
    count_by_backend, exchange, locate_vipr, manifest, ClusterIpService, Exchange, Lab, LabConfig, LeafSpec,
    Protocol, ServicePort,
};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(2);
/// Width of the bar of a backend that got every connection.
const BAR_WIDTH: usize = 40;

#[derive(Parser)]
#[command(about = "Run vipr between network namespaces and show how it balances a service")]
struct Args {
    /// The vipr binary [default: $VIPR_BIN, else `vipr` next to this program]
    #[arg(long)]
    vipr: Option<PathBuf>,
    /// Services file (Services + EndpointSlices) to run vipr on
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/demo-services.yaml"))]
    services: PathBuf,
    /// TCP connections per TCP service port
    #[arg(long, default_value_t = 300)]
    connections: usize,
    /// UDP datagrams (each from a new socket) per UDP service port
    #[arg(long, default_value_t = 60)]
    datagrams: usize,
    /// Keep the lab up after the traffic, until Enter is pressed, to look around
    #[arg(long)]
    pause: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    testbed::require_root()?;
    let interrupted = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, interrupted.clone())?;
    }
    let vipr = match args.vipr.clone() {
        Some(path) => path,
        None => locate_vipr()?,
    };
    let services_file =
        args.services.canonicalize().with_context(|| format!("cannot find {}", args.services.display()))?;
    let services = manifest::parse(&std::fs::read_to_string(&services_file)?)
        .with_context(|| format!("cannot read {}", services_file.display()))?;
    ensure!(!services.is_empty(), "{} has no ClusterIP service", services_file.display());

    let mut lab = Lab::new(LabConfig {
        label: "vipr-demo".to_owned(),
        vipr_binary: vipr,
        client: LeafSpec::in_own_slash24("client", CLIENT)?,
        backends: backend_leaves(&services)?,
        services: services.clone(),
    })?;
    let check_interrupt = || -> Result<()> {
        if interrupted.load(Ordering::Relaxed) {
            bail!("interrupted; cleaning up");
        }
        Ok(())
    };
    lab.start_vipr()?;
    lab.wait_programmed()?;
    print_lab(&lab, &services_file);

    let mut problems = 0;
    for service in &services {
        for port in &service.ports {
            check_interrupt()?;
            let count = match port.protocol {
                Protocol::Tcp | Protocol::Sctp => args.connections,
                Protocol::Udp => args.datagrams,
            };
            problems += report_port(&lab, service, port, count)?;
        }
    }

    if args.pause {
        println!("The lab stays up until you press Enter.");
        wait_for_enter(&interrupted);
    }
    println!("Cleaning up: stopping vipr, vipr --cleanup, removing the namespaces.");
    let status = lab.stop_vipr()?;
    ensure!(status.success(), "vipr exited with {status}");
    lab.cleanup_vipr()?;
    drop(lab);
    ensure!(problems == 0, "{problems} exchanges failed or were not transparent");
    Ok(())
}

/// One backend namespace per endpoint address, named after its pod.
fn backend_leaves(services: &[ClusterIpService]) -> Result<Vec<LeafSpec>> {
    let client_subnet = slash24(CLIENT);
    for service in services {
        ensure!(
            slash24(service.cluster_ip) != client_subnet,
            "{}: clusterIP {} is in the client's subnet {client_subnet:?}.0/24",
            service.name,
            service.cluster_ip
        );
    }
    let mut subnets = BTreeSet::from([client_subnet]);
    manifest::endpoint_addresses(services)
        .into_iter()
        .enumerate()
        .map(|(index, (addr, pod))| {
            ensure!(
                subnets.insert(slash24(addr)),
                "endpoint {addr} shares its /24 with the client or another endpoint; the demo \
                 gives each its own"
            );
            let name = pod.unwrap_or_else(|| format!("backend-{}", index + 1));
            let mut leaf = LeafSpec::in_own_slash24(&name, addr)?;
            // Pod names can exceed the 15 bytes an interface name may have.
            leaf.node_interface = format!("to-backend{}", index + 1);
            Ok(leaf)
        })
        .collect()
}

fn slash24(addr: Ipv4Addr) -> [u8; 3] {
    let [a, b, c, _] = addr.octets();
    [a, b, c]
}

fn print_lab(lab: &Lab, services_file: &Path) {
    let vipr = lab.vipr().expect("vipr was just started");
    let maps = lab.maps();
    let client = lab.client().name();
    println!("vipr (pid {}) runs in network namespace {}", vipr.pid(), lab.node().name());
    println!("  on {}", lab.topology().node_interfaces().join(", "));
    println!("  services: {}", services_file.display());
    println!("  its log:  {}", vipr.log_path().display());
    println!("Look at the datapath while it runs (--pause keeps it running):");
    let bpf_root = lab.bpf_root().display();
    println!("  vipr inspect services --bpf-root={bpf_root}   # frontends -> backends, with counters");
    println!("  vipr inspect maps --bpf-root={bpf_root}       # every map: entries against capacity");
    println!("  vipr inspect drift --bpf-root={bpf_root}      # the agent's desired state against the maps");
    println!("  ip netns exec {} vipr inspect devices --bpf-root={bpf_root}", lab.node().name());
    println!("or the raw maps:");
    for (map, what) in [
        (pins::SERVICES4, "frontends: VIP, port, protocol -> backend set"),
        (pins::BACKENDS4, "backend sets: (set, slot) -> endpoint"),
        (pins::FLOWS4, "tracked connections, both directions"),
    ] {
        println!("  bpftool map dump pinned {}   # {what}", maps.path(map).display());
    }
    println!("  bpftool link show   # the TC attachments: tcx links, \"type 11\" to bpftool 7.1");
    println!("  bpftool prog show name {}", pins::TC_INGRESS_PROGRAM);
    println!("and talk to the service yourself:");
    for frontend in
        lab.services().iter().flat_map(|service| service.ports.iter().map(|port| service.frontend(port)))
    {
        let socat_protocol = match frontend.protocol {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        };
        println!("  ip netns exec {client} socat - {socat_protocol}:{}", frontend.addr);
    }
    println!();
}

/// Sends `count` new connections to one service port and prints how they spread; returns how
/// many failed or were not transparent.
fn report_port(lab: &Lab, service: &ClusterIpService, port: &ServicePort, count: usize) -> Result<usize> {
    let frontend = service.frontend(port);
    let outcomes: Vec<Result<Exchange>> =
        lab.client().run(|| Ok((0..count).map(|_| exchange(frontend, EXCHANGE_TIMEOUT)).collect()))?;
    let mut problems = Vec::new();
    let mut answered = Vec::new();
    for outcome in outcomes {
        match outcome.and_then(|exchange| exchange.verify(frontend, CLIENT).map(|()| exchange)) {
            Ok(exchange) => answered.push(exchange),
            Err(error) => problems.push(format!("{error:#}")),
        }
    }
    let counts = count_by_backend(&answered);
    let what = match port.protocol {
        Protocol::Tcp => "TCP connections",
        Protocol::Udp => "UDP datagrams, each from a new socket",
        Protocol::Sctp => "SCTP associations",
    };
    println!("{frontend}  ({}/{} port {}): {count} {what}", service.namespace, service.name, port.name);
    println!("  {:<16} {:<22} {:>7} {:>6}", "endpoint", "address", "answers", "share");
    let pods = endpoint_pods(lab, service);
    for endpoint in &service.endpoints {
        let pod = &pods[&endpoint.addr];
        let answers = counts.get(pod).copied().unwrap_or(0);
        let address = format!("{}:{}", endpoint.addr, port.target_port);
        let note = if endpoint.ready { "" } else { "  (not ready)" };
        println!("{}", row(pod, &address, answers, count, note));
        if !endpoint.ready && answers > 0 {
            problems.push(format!("{pod} is not ready but got {answers}"));
        }
    }
    let endpoints: BTreeSet<&String> = pods.values().collect();
    for (backend, &answers) in counts.iter().filter(|(backend, _)| !endpoints.contains(backend)) {
        println!("{}", row(backend, "-", answers, count, "  (not an endpoint!)"));
        problems.push(format!("{backend} is no endpoint of {} but got {answers}", service.name));
    }
    if problems.is_empty() {
        println!(
            "  every reply came from {}, every endpoint saw the client's own address {CLIENT}",
            frontend.addr
        );
    }
    for problem in &problems {
        println!("  PROBLEM: {problem}");
    }
    println!();
    Ok(problems.len())
}

/// Endpoint address -> the name its backend namespace answers with.
fn endpoint_pods(lab: &Lab, service: &ClusterIpService) -> BTreeMap<Ipv4Addr, String> {
    lab.topology()
        .leaves()
        .iter()
        .filter(|leaf| service.endpoints.iter().any(|endpoint| endpoint.addr == leaf.spec.addr))
        .map(|leaf| (leaf.spec.addr, leaf.spec.name.clone()))
        .collect()
}

fn row(backend: &str, address: &str, answers: usize, total: usize, note: &str) -> String {
    let share = if total == 0 { 0.0 } else { answers as f64 / total as f64 };
    let bar = "#".repeat((share * BAR_WIDTH as f64).round() as usize);
    format!("  {backend:<16} {address:<22} {answers:>7} {:>5.1}%  {bar}{note}", share * 100.0)
}

/// Returns when Enter is pressed (or stdin closes) or on Ctrl-C.
fn wait_for_enter(interrupted: &AtomicBool) {
    let (entered, enter) = mpsc::channel();
    // Left blocked in read_line if we are interrupted instead; the process exits soon after.
    thread::spawn(move || {
        let _ = std::io::stdin().read_line(&mut String::new());
        let _ = entered.send(());
    });
    while !interrupted.load(Ordering::Relaxed) {
        if enter.recv_timeout(Duration::from_millis(200)) != Err(mpsc::RecvTimeoutError::Timeout) {
            return;
        }
    }
}
