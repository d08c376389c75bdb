//! A lab for vipr's netfilter modes (iptables, nftables) fed from a services file: a client
//! namespace and backend namespaces (each on a /24 of its own) around a node namespace where
//! vipr runs, echo servers on 8080/TCP and 5353/UDP in every backend. No BPF is involved: there
//! is not even a bpffs, and vipr is pointed at a bpffs that does not exist, so that a mode
//! switch's eBPF cleanup cannot touch the host's.

use std::{
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    path::{Path, PathBuf},
    process::ExitStatus,
    time::Duration,
};

use anyhow::{Context, Result};

use crate::{
    locate_vipr, udp_ask, vipr_cleanup, wait_for, write_atomically, Check, EchoServer, LeafSpec, Netns,
    Topology, Vipr, WorkDir,
};

/// The `--bpf-root` of every vipr here: no pins to find or clean up.
pub const NO_BPFFS: &str = "/nonexistent-vipr-bpffs";

/// How long a datagram's answer may take.
const UDP_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a sync may take to show in vipr's log.
const SYNC_TIMEOUT: Duration = Duration::from_secs(20);

/// The services file of a lab: what `manifests` renders for the endpoints (backend names) given.
pub type Manifests = fn(&[&str]) -> String;

pub struct NetfilterLab {
    // Dropped in this order: the agent, the servers, the namespaces, the scratch directory.
    vipr: Option<Vipr>,
    _servers: Vec<EchoServer>,
    topology: Topology,
    workdir: WorkDir,
    manifests: Manifests,
    /// vipr started so far: each start logs to a file of its own.
    starts: usize,
}

impl NetfilterLab {
    /// The namespaces and servers, and the services file with `endpoints` (some of the
    /// backends); no vipr yet ([`Self::run_vipr`]).
    pub fn build(
        label: &str,
        client: Ipv4Addr,
        backends: &[(&str, Ipv4Addr)],
        manifests: Manifests,
        endpoints: &[&str],
    ) -> Result<Self> {
        crate::require_root()?;
        let workdir = WorkDir::create(label)?;
        let mut leaves = vec![LeafSpec::in_own_slash24("client", client)?];
        for &(name, addr) in backends {
            leaves.push(LeafSpec::in_own_slash24(name, addr)?);
        }
        let topology = Topology::build(label, leaves)?;
        let servers = backends
            .iter()
            .map(|&(name, addr)| {
                let leaf = topology.leaf(name)?;
                EchoServer::start(
                    &leaf.netns,
                    name,
                    &[SocketAddr::from((addr, 8080))],
                    &[SocketAddr::from((addr, 5353))],
                )
            })
            .collect::<Result<_>>()?;
        write_atomically(&workdir.path().join("services.yaml"), &manifests(endpoints))?;
        Ok(Self { vipr: None, _servers: servers, topology, workdir, manifests, starts: 0 })
    }

    /// Starts vipr with `args` after the lab's own (its services file, no bpffs, no HTTP
    /// servers, no minimum sync period), stopping a running one first, and waits for its
    /// first sync.
    pub fn run_vipr(&mut self, args: &[String]) -> Result<()> {
        if let Some(vipr) = self.vipr.take() {
            let status = vipr.stop()?;
            anyhow::ensure!(status.success(), "the previous vipr exited with {status}");
        }
        self.starts += 1;
        let mut all = vec![
            format!("--services-file={}", self.services_file().display()),
            format!("--bpf-root={NO_BPFFS}"),
            "--node-name=node-a".to_owned(),
            "--healthz-bind-address=".to_owned(),
            "--metrics-bind-address=".to_owned(),
            "--min-sync-period=0s".to_owned(),
            "-v".to_owned(),
        ];
        all.extend_from_slice(args);
        self.vipr = Some(Vipr::start_with_args(&locate_vipr()?, self.topology.node(), &all, &self.log())?);
        self.wait_synced(0)?;
        Ok(())
    }

    /// Stops vipr with SIGTERM; what it programmed stays.
    pub fn stop_vipr(&mut self) -> Result<ExitStatus> {
        self.vipr.take().context("vipr is not running")?.stop()
    }

    /// `vipr --cleanup` as the uninstall DaemonSet runs it, in the node; its output.
    pub fn cleanup_vipr(&self) -> Result<String> {
        vipr_cleanup(&locate_vipr()?, self.topology.node(), Path::new(NO_BPFFS))
    }

    pub fn services_file(&self) -> PathBuf {
        self.workdir.path().join("services.yaml")
    }

    /// The log of the vipr started last.
    pub fn log(&self) -> PathBuf {
        self.workdir.path().join(format!("vipr-{}.log", self.starts))
    }

    /// How many syncs the vipr started last has logged.
    pub fn synced(&self) -> usize {
        syncs_logged(&self.log())
    }

    /// Waits until vipr has logged more than `before` syncs; returns the count.
    pub fn wait_synced(&mut self, before: usize) -> Result<usize> {
        let log = self.log();
        let vipr = self.vipr.as_mut().context("vipr is not running")?;
        wait_for("vipr to sync", SYNC_TIMEOUT, || {
            vipr.ensure_running()?;
            let count = syncs_logged(&log);
            Ok(if count > before { Check::Done(count) } else { Check::NotYet(format!("{count} syncs")) })
        })
    }

    /// Rewrites the services file with `endpoints` and waits for vipr to sync it.
    pub fn set_endpoints(&mut self, endpoints: &[&str]) -> Result<()> {
        let before = self.synced();
        write_atomically(&self.services_file(), &(self.manifests)(endpoints))?;
        self.wait_synced(before).map(drop)
    }

    pub fn client(&self) -> &Netns {
        &self.topology.leaf("client").expect("every lab has a client").netns
    }

    pub fn node(&self) -> &Netns {
        self.topology.node()
    }

    /// `program args` in the node; its stdout.
    pub fn node_output(&self, program: &str, args: &[&str]) -> Result<String> {
        let output = self.node().command(program)?.args(args).output()?;
        Ok(String::from_utf8(output.stdout)?)
    }

    /// One UDP flow from `client` (a fixed address and port) to `frontend` is pinned by
    /// conntrack to its first endpoint. With that endpoint taken out of `endpoints` in the
    /// services file, vipr deletes the flow's entry, so that its next datagram finds a live
    /// endpoint. Returns the endpoints left.
    pub fn udp_flow_leaves_a_removed_endpoint<'a>(
        &mut self,
        client: SocketAddr,
        frontend: SocketAddr,
        endpoints: &[&'a str],
    ) -> Result<Vec<&'a str>> {
        let socket = self.client().run(|| {
            let socket = UdpSocket::bind(client)?;
            socket.set_read_timeout(Some(UDP_TIMEOUT))?;
            Ok(socket)
        })?;
        let first = udp_ask(&socket, frontend)?.backend;
        let again = udp_ask(&socket, frontend)?.backend;
        anyhow::ensure!(again == first, "one flow, one endpoint: {first}, then {again}");
        let others: Vec<&str> = endpoints.iter().copied().filter(|name| *name != first).collect();
        self.set_endpoints(&others)?;
        let after = udp_ask(&socket, frontend)?.backend;
        anyhow::ensure!(
            others.contains(&after.as_str()),
            "the flow moved from {first} to a listed endpoint, not {after}"
        );
        Ok(others)
    }

    /// `vipr inspect args` in the node ([`inspect`]).
    pub fn inspect(&self, args: &[&str]) -> Result<String> {
        inspect(self.node(), args)
    }
}

/// `vipr inspect args` in `netns`, which has no pins (the mode is told by what the kernel
/// holds: iptables chains, the nftables table, kube-ipvs0): its stdout, which must come with
/// success.
pub fn inspect(netns: &Netns, args: &[&str]) -> Result<String> {
    let output = netns
        .command(locate_vipr()?)?
        .arg("inspect")
        .args(args)
        .arg(format!("--bpf-root={NO_BPFFS}"))
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "vipr inspect {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

fn syncs_logged(log: &Path) -> usize {
    std::fs::read_to_string(log).map_or(0, |log| log.lines().filter(|line| line.contains("synced")).count())
}
