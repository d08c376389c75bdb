//! Socket-level balancing for pods (issue 16, item 5; `--bpf-socket-lb-pods`,
//! `--pods-cgroup`): a pod's connect() to a cluster IP goes to the backend in the system
//! call, so the TC program never tracks or rewrites its packets, and the pod still sees the
//! cluster IP as its peer. Pods are the processes under the pods' cgroup: the same pod
//! namespace's sockets from a process outside it, and every pod with the flag off, are
//! balanced by TC as before.
//!
//! The pod's process is `socket-probe` (tests/src/bin), started in the pod's network namespace
//! and moved into the lab's own stand-in for the kubelet's pod cgroup before it runs: a thread
//! of the test process cannot join a cgroup alone.
use std::{
    ffi::CString,
    fs::File,
    net::{Ipv4Addr, SocketAddr},
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::Path,
    process::Command,
    time::Duration,
};

use anyhow::{bail, ensure, Context as _, Result};
use proxy_common::{pins, sock};
use serde_json::Value;
use testbed::{
    container::Cgroup2Dir, tcp_exchange, Answer, ClusterIpService, Endpoint, Lab, LabConfig, Netns,
};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const BACKENDS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 20, 1, 2), Ipv4Addr::new(10, 20, 2, 2)];
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const TIMEOUT: Duration = Duration::from_secs(2);

fn http() -> SocketAddr {
    SocketAddr::from((VIP, 80))
}

fn dns() -> SocketAddr {
    SocketAddr::from((VIP, 53))
}

/// A lab whose vipr takes `cgroup` as the pods' cgroup, with `extra_args`.
fn lab(label: &str, cgroup: &Cgroup2Dir, extra_args: &[&str]) -> Result<Lab> {
    let endpoints =
        BACKENDS.iter().enumerate().map(|(i, addr)| Endpoint::ready(*addr, &format!("b{}", i + 1)));
    let service = ClusterIpService::web(VIP, (8080, 5353), endpoints.collect());
    let mut lab = Lab::new(LabConfig::with_backends(label, CLIENT, &BACKENDS, vec![service])?)?;
    let pods_cgroup = format!("--pods-cgroup={}", cgroup.path().display());
    lab.start_vipr_with(&[&[pods_cgroup.as_str()], extra_args].concat())?;
    lab.wait_programmed()?;
    Ok(lab)
}

/// What a pod process saw: its socket's peer and the backend's answer.
#[derive(Debug)]
struct PodExchange {
    peer: SocketAddr,
    answer: Answer,
}

/// One TCP exchange with `target` by a process of `netns` that lives in `cgroup`.
fn pod_exchange(netns: &Netns, cgroup: &Path, target: SocketAddr) -> Result<PodExchange> {
    probe(netns, cgroup, "tcp", target)
}

/// `socket-probe <transport> <target>` in `netns`, in `cgroup`.
fn probe(netns: &Netns, cgroup: &Path, transport: &str, target: SocketAddr) -> Result<PodExchange> {
    let namespace = File::open(format!("/run/netns/{}", netns.name()))
        .with_context(|| format!("opening the namespace {}", netns.name()))?;
    let procs = CString::new(cgroup.join("cgroup.procs").into_os_string().into_encoded_bytes())?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_socket-probe"));
    command.args([transport, &target.to_string()]);
    let namespace_fd = namespace.as_raw_fd();
    // SAFETY: between fork and exec the child only makes system calls on memory prepared
    // before the fork (no allocation, no lock).
    unsafe {
        command.pre_exec(move || {
            // Into the pods' cgroup first ("0": the writing process), then the namespace.
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                return Err(std::io::Error::last_os_error());
            }
            libc::close(fd);
            if libc::setns(namespace_fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let output = command.output().context("running socket-probe")?;
    ensure!(output.status.success(), "socket-probe: {}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout)?;
    let mut lines = stdout.lines();
    let peer = lines.next().and_then(|line| line.strip_prefix("peer ")).context("no peer line")?;
    let answer = lines.next().context("no answer line")?;
    Ok(PodExchange { peer: peer.parse()?, answer: answer.parse()? })
}

/// The client ports of the TCP connections from [`CLIENT`] to the cluster IP that the TC
/// program tracked, from vipr's flows map.
fn tracked_ports(bpf_root: &Path) -> Result<Vec<u16>> {
    tracked(bpf_root, 6)
}

fn tracked_udp_ports(bpf_root: &Path) -> Result<Vec<u16>> {
    tracked(bpf_root, 17)
}

/// The entries of vipr's pinned map `name`, as `bpftool -j map dump` shows them.
fn map_entries(bpf_root: &Path, name: &str) -> Result<Vec<Value>> {
    let pinned = bpf_root.join(pins::DIR).join(name);
    let output = Command::new("bpftool").args(["-j", "map", "dump", "pinned"]).arg(&pinned).output()?;
    ensure!(output.status.success(), "bpftool: {}", String::from_utf8_lossy(&output.stderr));
    // An empty map is no output at all.
    if output.stdout.trim_ascii().is_empty() {
        return Ok(Vec::new());
    }
    Ok(serde_json::from_slice::<Value>(&output.stdout)?.as_array().cloned().unwrap_or_default())
}

/// The client ports of the flows of IP protocol `protocol` from [`CLIENT`] to the cluster IP
/// that the TC program tracked, from vipr's flows map.
fn tracked(bpf_root: &Path, protocol: u64) -> Result<Vec<u16>> {
    let bytes = |value: &Value| -> Vec<u64> {
        value.as_array().map(|array| array.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
    };
    Ok(map_entries(bpf_root, pins::FLOWS4)?
        .iter()
        .filter_map(|flow| {
            let key = &flow["formatted"]["key"];
            (bytes(&key["src_addr"]) == [10, 10, 0, 2]
                && bytes(&key["dst_addr"]) == [10, 96, 0, 10]
                && key["proto"].as_u64() == Some(protocol))
            .then(|| key["src_port"].as_u64().and_then(|port| u16::try_from(port).ok()))?
        })
        .collect())
}

fn reverse_translations(bpf_root: &Path) -> Result<usize> {
    Ok(map_entries(bpf_root, sock::REVERSE4)?.len())
}

/// The pod saw the cluster IP as its peer and reached an endpoint, which saw the pod's own
/// address.
fn check_pod_view(exchange: &PodExchange) -> Result<()> {
    ensure!(exchange.peer == http(), "the pod's peer is not the cluster IP: {exchange:?}");
    ensure!(
        ["b1", "b2"].contains(&exchange.answer.backend.as_str())
            && exchange.answer.observed_client.ip() == CLIENT,
        "{exchange:?}"
    );
    Ok(())
}

#[test]
fn a_pods_connection_to_a_cluster_ip_goes_to_the_backend_in_the_system_call() -> Result<()> {
    let cgroup = Cgroup2Dir::create()?;
    let lab = lab("podsk", &cgroup, &[])?;
    let before = reverse_translations(lab.bpf_root())?;
    for _ in 0..4 {
        let exchange = pod_exchange(lab.client(), cgroup.path(), http())?;
        check_pod_view(&exchange)?;
        let port = exchange.answer.observed_client.port();
        if tracked_ports(lab.bpf_root())?.contains(&port) {
            // What vipr said about its socket hooks.
            let log = lab.vipr().map(|vipr| std::fs::read_to_string(vipr.log_path()).unwrap_or_default());
            let said: Vec<&str> = log
                .as_deref()
                .unwrap_or_default()
                .lines()
                .filter(|line| line.contains("socket") || line.contains("ERROR"))
                .collect();
            bail!(
                "the pod's connection from port {port} was balanced by the TC program: {exchange:?}\n{}",
                said.join("\n")
            );
        }
    }
    ensure!(reverse_translations(lab.bpf_root())? >= before + 4, "no reverse translation was recorded");

    // Unconnected UDP: the datagram goes to a backend, and the reply shows the cluster IP as
    // its source (recvmsg), which is what a resolver checks.
    let datagram = probe(lab.client(), cgroup.path(), "udp", dns())?;
    ensure!(datagram.peer == dns(), "the pod's reply did not come from the cluster IP: {datagram:?}");
    let port = datagram.answer.observed_client.port();
    ensure!(
        ["b1", "b2"].contains(&datagram.answer.backend.as_str())
            && !tracked_udp_ports(lab.bpf_root())?.contains(&port),
        "the pod's datagram from port {port} was balanced by the TC program: {datagram:?}"
    );

    // The same namespace, from a process outside the pods' cgroup (this one): TC's business.
    let exchange = lab.client().run(|| tcp_exchange(http(), TIMEOUT))?;
    ensure!(
        tracked_ports(lab.bpf_root())?.contains(&exchange.client_port),
        "a connection from outside the pods' cgroup was not balanced by TC: {exchange:?}"
    );
    Ok(())
}

#[test]
fn with_socket_balancing_for_pods_off_the_tc_program_balances_them() -> Result<()> {
    let cgroup = Cgroup2Dir::create()?;
    let lab = lab("podsk-off", &cgroup, &["--bpf-socket-lb-pods=false"])?;
    let exchange = pod_exchange(lab.client(), cgroup.path(), http())?;
    check_pod_view(&exchange)?;
    let port = exchange.answer.observed_client.port();
    ensure!(
        tracked_ports(lab.bpf_root())?.contains(&port),
        "with --bpf-socket-lb-pods=false the pod's connection from port {port} was not balanced by TC"
    );
    Ok(())
}

/// A service that masquerades pods' traffic (here all of it, `--masquerade-all`) is left to
/// the TC path, which gives the backend the node's address as kube-proxy does: the socket
/// level cannot.
#[test]
fn a_pods_masqueraded_connection_is_left_to_the_tc_program() -> Result<()> {
    let cgroup = Cgroup2Dir::create()?;
    let lab = lab("podsk-masq", &cgroup, &["--masquerade-all"])?;
    let exchange = pod_exchange(lab.client(), cgroup.path(), http())?;
    ensure!(exchange.peer == http(), "the pod's peer is not the cluster IP: {exchange:?}");
    ensure!(
        exchange.answer.observed_client.ip() != CLIENT,
        "the backend saw the pod's own address: {exchange:?}"
    );
    ensure!(
        !tracked_ports(lab.bpf_root())?.is_empty(),
        "the masqueraded connection was not balanced by TC: {exchange:?}"
    );
    Ok(())
}
