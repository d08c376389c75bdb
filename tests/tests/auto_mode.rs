//! `--proxy-mode=auto` with the real vipr binary in a network-namespace lab: on this kernel it
//! chooses ebpf; with `bpf()` denied (a seccomp filter, as on a node whose runtime forbids BPF)
//! it falls back to nftables (kernel 5.13 or later with `nft`; ipvs runs only when asked for),
//! says why, reports the mode it runs on `/proxyMode` and in `vipr_proxy_mode_info`, and serves
//! the service through its nftables table.
//! Needs root and a built vipr (`cargo build -p proxy-userspace`, or VIPR_BIN).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4},
    time::Duration,
};

use anyhow::Result;
use testbed::{
    locate_vipr, sandbox, wait_for, wait_for_first_sync, Check, ClusterIpService, Endpoint, Frontend, Lab,
    LabConfig, Netns, Protocol, Vipr,
};

/// vipr's default `--metrics-bind-address` (0.0.0.0:10249), seen from inside the node.
const METRICS: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10249);
const TIMEOUT: Duration = Duration::from_secs(2);
/// How long vipr may take to start and sync.
const SETTLE: Duration = Duration::from_secs(20);
/// With two endpoints chosen at random, the chance that one gets none of 30 is ~2e-9.
const CONNECTIONS: usize = 30;

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const BACKENDS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 20, 1, 2), Ipv4Addr::new(10, 20, 2, 2)];
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

fn web() -> ClusterIpService {
    let endpoints = BACKENDS.iter().map(|addr| Endpoint::ready(*addr, "pod")).collect();
    ClusterIpService::web(VIP, (8080, 5353), endpoints)
}

fn lab(label: &str) -> Lab {
    Lab::new(LabConfig::with_backends(label, CLIENT, &[BACKENDS[0], BACKENDS[1]], vec![web()]).unwrap())
        .unwrap()
}

/// vipr with `--proxy-mode=auto` in the lab's node, started from the calling thread (so that
/// a seccomp filter of that thread applies to it).
fn start_auto(lab: &Lab, log_name: &str) -> (Vipr, std::path::PathBuf) {
    let args = vec![
        "--proxy-mode=auto".to_owned(),
        format!("--services-file={}", lab.services_file().display()),
        format!("--hostname-override={}", lab.node().name()),
        format!("--devices={}", lab.topology().node_interfaces().join(",")),
        format!("--bpf-root={}", lab.bpf_root().display()),
        "--min-sync-period=0s".to_owned(),
        "-v".to_owned(),
    ];
    let log = lab.services_file().with_file_name(log_name);
    (Vipr::start_with_args(&locate_vipr().unwrap(), lab.node(), &args, &log).unwrap(), log)
}

/// The line vipr logged about its choice.
fn choice_line(log: &str) -> &str {
    let line = log
        .lines()
        .find(|line| line.contains("proxy mode auto:"))
        .unwrap_or_else(|| panic!("no choice logged:\n{log}"));
    eprintln!("vipr: {line}");
    line
}

/// `GET path` on vipr's metrics server, from inside `netns`: status and body.
fn get(netns: &Netns, path: &str) -> Result<(u16, String)> {
    let answer = testbed::http::get(netns, METRICS, path)?;
    Ok((answer.status, answer.body))
}

/// `/proxyMode` and the mode metric, once the metrics server answers.
fn reported_mode(vipr: &mut Vipr, node: &Netns) -> (String, String) {
    let proxy_mode = wait_for("/proxyMode to answer", SETTLE, || {
        vipr.ensure_running()?;
        Ok(match get(node, "/proxyMode") {
            Ok((200, body)) => Check::Done(body),
            other => Check::NotYet(format!("{other:?}")),
        })
    })
    .unwrap();
    let (status, metrics) = get(node, "/metrics").unwrap();
    assert_eq!(status, 200);
    let info = metrics
        .lines()
        .find(|line| line.starts_with("vipr_proxy_mode_info{"))
        .unwrap_or_else(|| panic!("no vipr_proxy_mode_info in\n{metrics}"))
        .to_owned();
    (proxy_mode, info)
}

/// The backends that answered `CONNECTIONS` connections to `VIP:port`, unmasqueraded.
fn reach(lab: &Lab, port: u16, protocol: Protocol) -> BTreeSet<String> {
    lab.backends_reached(Frontend { addr: SocketAddrV4::new(VIP, port), protocol }, CONNECTIONS, TIMEOUT)
        .unwrap()
}

/// The names the backends' servers answer with.
fn all_backends() -> BTreeSet<String> {
    ["b1", "b2"].map(str::to_owned).into()
}

#[test]
fn without_bpf_auto_falls_back_to_nftables_and_serves_the_service() {
    let lab = lab("auto-nobpf");
    // The filter stays on the thread that installs it: a thread of its own, which also starts
    // vipr (and outlives it: vipr gets SIGTERM when its starting thread ends).
    let sandboxed = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                sandbox::deny_bpf_to_this_thread().unwrap();
                let (mut vipr, log) = start_auto(&lab, "vipr-nobpf.log");
                let text = wait_for_first_sync(&log, SETTLE, || vipr.ensure_running()).unwrap();
                let choice = choice_line(&text);
                assert!(choice.contains("proxy mode auto: chose nftables: "), "{choice}");
                assert!(choice.contains("bpf(BPF_PROG_LOAD SCHED_CLS): Operation not permitted"), "{choice}");

                let (proxy_mode, info) = reported_mode(&mut vipr, lab.node());
                assert_eq!(proxy_mode, "nftables", "kube-proxy's bare mode name");
                assert_eq!(info, "vipr_proxy_mode_info{mode=\"nftables\",requested=\"auto\"} 1");

                assert_eq!(reach(&lab, 80, Protocol::Tcp), all_backends());
                assert_eq!(reach(&lab, 53, Protocol::Udp), all_backends());
                let table = lab
                    .node()
                    .command("nft")
                    .unwrap()
                    .args(["list", "table", "ip", "vipr"])
                    .output()
                    .unwrap();
                let table = String::from_utf8_lossy(&table.stdout);
                assert!(
                    table.contains("map service-ips"),
                    "the service is served by vipr's nftables table:\n{table}"
                );
                assert!(!lab.bpf_root().join("vipr").exists(), "nothing was pinned");
                vipr.stop().unwrap()
            })
            .join()
    });
    let status = sandboxed.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    assert!(status.success(), "{status}");
    // The rules live in the lab's node namespace and go with it; `vipr --cleanup` is not run
    // because its eBPF part needs the bpf() this test denied.
}

/// Detaches and unpins what an eBPF-mode vipr left, even when the test fails half-way.
struct EbpfCleanup<'a>(&'a Lab);

impl Drop for EbpfCleanup<'_> {
    fn drop(&mut self) {
        if let Err(error) = self.0.cleanup_vipr() {
            eprintln!("vipr --cleanup: {error:#}");
        }
    }
}

#[test]
fn with_bpf_auto_chooses_ebpf() {
    let lab = lab("auto-bpf");
    let _cleanup = EbpfCleanup(&lab);
    let (mut vipr, log) = start_auto(&lab, "vipr-bpf.log");
    let text = wait_for_first_sync(&log, SETTLE, || vipr.ensure_running()).unwrap();
    let choice = choice_line(&text);
    assert!(choice.contains("proxy mode auto: chose ebpf"), "{choice}");
    let (proxy_mode, info) = reported_mode(&mut vipr, lab.node());
    assert_eq!(proxy_mode, "ebpf");
    assert_eq!(info, "vipr_proxy_mode_info{mode=\"ebpf\",requested=\"auto\"} 1");
    assert!(lab.bpf_root().join("vipr").is_dir(), "the eBPF dataplane pinned its maps");
    assert_eq!(reach(&lab, 80, Protocol::Tcp), all_backends());
    let status = vipr.stop().unwrap();
    assert!(status.success(), "{status}");
}
