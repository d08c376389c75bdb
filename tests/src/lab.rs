//! A complete vipr lab: client -> node (vipr) -> backends, with a services file, a private
//! bpffs and echo servers on every backend.

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::ExitStatus,
    thread,
    time::Duration,
};

use anyhow::{bail, ensure, Context, Result};

use crate::{
    manifest, vipr::log_tail, vipr_cleanup, wait_for, write_atomically, BpfFs, Check, ClusterIpService,
    EchoServer, Frontend, LeafSpec, Netns, PinnedMaps, Protocol, Topology, Vipr, ViprConfig, WorkDir,
};

/// How long vipr may take to program a change of the services file.
pub const PROGRAMMING_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Clone, Debug)]
pub struct LabConfig {
    /// Prefix of the lab's namespaces, mount point and scratch directory.
    pub label: String,
    pub vipr_binary: PathBuf,
    pub client: LeafSpec,
    /// Each backend's echo servers answer with its leaf name, on every target port of
    /// `services`, whether or not it is an endpoint.
    pub backends: Vec<LeafSpec>,
    /// The initial contents of the services file.
    pub services: Vec<ClusterIpService>,
}

impl LabConfig {
    /// The usual lab: the client and the backends `b1`, `b2`, ... at `backends`, each in a
    /// /24 of its own, serving `services` from the vipr binary the tests run.
    pub fn with_backends(
        label: &str,
        client: Ipv4Addr,
        backends: &[Ipv4Addr],
        services: Vec<ClusterIpService>,
    ) -> Result<Self> {
        Ok(Self {
            label: label.to_owned(),
            vipr_binary: crate::locate_vipr()?,
            client: LeafSpec::in_own_slash24("client", client)?,
            backends: backends
                .iter()
                .enumerate()
                .map(|(i, addr)| LeafSpec::in_own_slash24(&format!("b{}", i + 1), *addr))
                .collect::<Result<_>>()?,
            services,
        })
    }
}

/// Everything of one lab; dropping it stops vipr and removes all of it.
#[derive(Debug)]
pub struct Lab {
    // Fields drop in this order: the agent first; then the servers, whose sockets would keep
    // the namespaces alive; then the namespaces, the pins, and the scratch directory.
    vipr: Option<Vipr>,
    #[expect(dead_code, reason = "kept only to be dropped with the lab")]
    servers: Vec<EchoServer>,
    topology: Topology,
    bpffs: BpfFs,
    workdir: WorkDir,
    binary: PathBuf,
    client: LeafSpec,
    services: Vec<ClusterIpService>,
    services_file: PathBuf,
    /// Logs of the agents this lab started, oldest first.
    logs: Vec<PathBuf>,
}

impl Lab {
    /// Builds the namespaces, mounts the bpffs, writes the services file and starts the echo
    /// servers. vipr is not started yet: see [`Self::start_vipr`].
    pub fn new(config: LabConfig) -> Result<Self> {
        crate::require_root()?;
        let workdir = WorkDir::create(&config.label)?;
        let bpffs = BpfFs::mount(&config.label)?;
        let mut leaves = vec![config.client.clone()];
        leaves.extend(config.backends.iter().cloned());
        let topology = Topology::build(&config.label, leaves)?;
        let services_file = workdir.path().join("services.yaml");
        write_atomically(&services_file, &manifest::render(&config.services))?;
        let servers = config
            .backends
            .iter()
            .map(|backend| {
                let leaf = topology.leaf(&backend.name)?;
                let listen = |protocol| listen_addrs(&config.services, protocol, backend.addr);
                EchoServer::start(&leaf.netns, &backend.name, &listen(Protocol::Tcp), &listen(Protocol::Udp))
                    .with_context(|| format!("cannot start the servers of {}", backend.name))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            vipr: None,
            servers,
            topology,
            bpffs,
            workdir,
            binary: config.vipr_binary,
            client: config.client,
            services: config.services,
            services_file,
            logs: Vec::new(),
        })
    }

    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    pub fn node(&self) -> &Netns {
        self.topology.node()
    }

    pub fn client(&self) -> &Netns {
        &self.topology.leaf(&self.client.name).expect("the client is a leaf").netns
    }

    pub fn client_addr(&self) -> Ipv4Addr {
        self.client.addr
    }

    pub fn bpf_root(&self) -> &Path {
        self.bpffs.path()
    }

    pub fn maps(&self) -> PinnedMaps {
        PinnedMaps::new(self.bpf_root())
    }

    pub fn services_file(&self) -> &Path {
        &self.services_file
    }

    pub fn services(&self) -> &[ClusterIpService] {
        &self.services
    }

    /// Rewrites the services file (atomically, as a config-map update would).
    pub fn set_services(&mut self, services: Vec<ClusterIpService>) -> Result<()> {
        write_atomically(&self.services_file, &manifest::render(&services))?;
        self.services = services;
        Ok(())
    }

    pub fn vipr_mut(&mut self) -> Option<&mut Vipr> {
        self.vipr.as_mut()
    }

    pub fn vipr(&self) -> Option<&Vipr> {
        self.vipr.as_ref()
    }

    /// Starts vipr in the node namespace on all of the node's interfaces, listed by name.
    pub fn start_vipr(&mut self) -> Result<&Vipr> {
        self.start_vipr_on(self.topology.node_interfaces())
    }

    /// Starts vipr in the node namespace without `--devices`: it serves every interface,
    /// including those created later.
    pub fn start_vipr_on_all_devices(&mut self) -> Result<&Vipr> {
        self.start_vipr_on(Vec::new())
    }

    /// Connects one more leaf to the node, e.g. a pod that appears while vipr runs.
    pub fn add_leaf(&mut self, spec: LeafSpec) -> Result<&Netns> {
        Ok(&self.topology.add_leaf(spec)?.netns)
    }

    /// [`Self::start_vipr`] with more flags on vipr's command line.
    pub fn start_vipr_with(&mut self, extra_args: &[&str]) -> Result<&Vipr> {
        self.start_vipr_on_with(self.topology.node_interfaces(), extra_args)
    }

    fn start_vipr_on(&mut self, devices: Vec<String>) -> Result<&Vipr> {
        self.start_vipr_on_with(devices, &[])
    }

    fn start_vipr_on_with(&mut self, devices: Vec<String>, extra_args: &[&str]) -> Result<&Vipr> {
        if self.vipr.is_some() {
            bail!("vipr is running already");
        }
        let log = self.workdir.path().join(format!("vipr-{}.log", self.logs.len() + 1));
        let vipr = self.spawn_vipr_on(devices, extra_args, &log)?;
        self.logs.push(log);
        Ok(self.vipr.insert(vipr))
    }

    /// Starts a vipr as [`Self::start_vipr_with`] does, but one whose lifetime the caller holds
    /// (several agents in turn, or one kept across the lab's own); its log goes to `log`.
    pub fn spawn_vipr(&self, extra_args: &[&str], log: &Path) -> Result<Vipr> {
        self.spawn_vipr_on(self.topology.node_interfaces(), extra_args, log)
    }

    /// [`Self::spawn_vipr`] of another vipr binary than the lab's (an earlier version).
    pub fn spawn_vipr_binary(&self, binary: &Path, extra_args: &[&str], log: &Path) -> Result<Vipr> {
        self.spawn_binary_on(binary, self.topology.node_interfaces(), extra_args, log)
    }

    /// [`Self::spawn_vipr`] through `wrapper`, a command line that ends by exec'ing the vipr
    /// command line appended to it (one that changes the agent's namespaces or cgroup first).
    pub fn spawn_vipr_through(&self, wrapper: &[&str], extra_args: &[&str], log: &Path) -> Result<Vipr> {
        let (program, wrapper_args) = wrapper.split_first().context("an empty wrapper")?;
        let mut command = self.node().command(program)?;
        command
            .args(wrapper_args)
            .arg(&self.binary)
            .args(self.vipr_args(self.topology.node_interfaces(), extra_args));
        Vipr::start_command(command, log)
    }

    fn spawn_vipr_on(&self, devices: Vec<String>, extra_args: &[&str], log: &Path) -> Result<Vipr> {
        self.spawn_binary_on(&self.binary, devices, extra_args, log)
    }

    fn spawn_binary_on(
        &self,
        binary: &Path,
        devices: Vec<String>,
        extra_args: &[&str],
        log: &Path,
    ) -> Result<Vipr> {
        Vipr::start_with_args(binary, self.node(), &self.vipr_args(devices, extra_args), log)
    }

    /// vipr's command line in this lab, without the binary.
    fn vipr_args(&self, devices: Vec<String>, extra_args: &[&str]) -> Vec<String> {
        let config = ViprConfig {
            services_file: self.services_file.clone(),
            node_name: self.node().name().to_owned(),
            devices,
            bpf_root: self.bpf_root().to_owned(),
            verbose: true,
        };
        let mut args = config.args();
        args.extend(extra_args.iter().map(|arg| (*arg).to_owned()));
        args
    }

    /// The backends that answered `count` new connections from the client to `frontend`, each
    /// answer checked to come from the frontend and to show the client's own address (no
    /// masquerade on the way).
    pub fn backends_reached(
        &self,
        frontend: Frontend,
        count: usize,
        timeout: Duration,
    ) -> Result<BTreeSet<String>> {
        let answers = self.client().run(|| crate::exchanges(frontend, count, timeout))?;
        for exchange in &answers {
            ensure!(exchange.replied_from == frontend.socket_addr(), "a reply from elsewhere: {exchange:?}");
            ensure!(
                exchange.answer.observed_client.ip() == std::net::IpAddr::V4(self.client_addr()),
                "the backend saw another client address: {exchange:?}"
            );
        }
        eprintln!("{frontend}: {:?}", crate::count_by_backend(&answers));
        Ok(answers.into_iter().map(|exchange| exchange.answer.backend).collect())
    }

    /// Stops vipr with SIGTERM and returns its exit status.
    pub fn stop_vipr(&mut self) -> Result<ExitStatus> {
        self.vipr.take().context("vipr is not running")?.stop()
    }

    /// Kills vipr with SIGKILL (see [`Vipr::kill`]).
    pub fn kill_vipr(&mut self) -> Result<ExitStatus> {
        self.vipr.take().context("vipr is not running")?.kill()
    }

    /// Runs `vipr --cleanup` on this lab's bpffs.
    pub fn cleanup_vipr(&self) -> Result<()> {
        vipr_cleanup(&self.binary, self.node(), self.bpf_root()).map(drop)
    }

    /// [`wait_for`] a condition on the pinned maps; fails at once if vipr, when running,
    /// exits meanwhile.
    pub fn wait_for<T>(
        &mut self,
        what: &str,
        mut probe: impl FnMut(&PinnedMaps) -> Result<Check<T>>,
    ) -> Result<T> {
        let maps = self.maps();
        let vipr = &mut self.vipr;
        wait_for(what, PROGRAMMING_TIMEOUT, || {
            if let Some(vipr) = vipr.as_mut() {
                vipr.ensure_running()?;
            }
            probe(&maps)
        })
    }

    /// Waits until every frontend of the current services leads to exactly its ready
    /// endpoints.
    pub fn wait_programmed(&mut self) -> Result<()> {
        let expected: Vec<_> = self
            .services
            .iter()
            .flat_map(|service| {
                service.ports.iter().map(|port| (service.frontend(port), service.expected_backends(port)))
            })
            .collect();
        self.wait_for("vipr to program the services file", |maps| {
            for (frontend, backends) in &expected {
                let programmed = match maps.frontend_backends(*frontend) {
                    Ok(programmed) => programmed,
                    Err(error) => return Ok(Check::NotYet(format!("{error:#}"))),
                };
                if programmed.as_ref() != Some(backends) {
                    return Ok(Check::NotYet(format!("{frontend} -> {programmed:?}, want {backends:?}")));
                }
            }
            Ok(Check::Done(()))
        })
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if thread::panicking() {
            // The running agent prints its own log when its guard drops.
            let running = self.vipr.as_ref().map(Vipr::log_path);
            for log in self.logs.iter().filter(|log| Some(log.as_path()) != running) {
                eprintln!("testbed: earlier vipr {}", log_tail(log));
            }
        }
        // The agent first, so that it writes no record after this: the record of its desired
        // state it left in the host's state directory goes with the lab.
        drop(self.vipr.take());
        let state_dir = Path::new(vipr::inspect::DEFAULT_STATE_DIR);
        let _ = std::fs::remove_file(vipr::dataplane::ebpf::record::path(state_dir, self.bpf_root()));
    }
}

/// The sockets a backend at `addr` listens on for `protocol`: every target port of it.
fn listen_addrs(services: &[ClusterIpService], protocol: Protocol, addr: Ipv4Addr) -> Vec<SocketAddr> {
    let ports: BTreeSet<u16> = services
        .iter()
        .flat_map(|service| &service.ports)
        .filter(|port| port.protocol == protocol)
        .map(|port| port.target_port)
        .collect();
    ports.into_iter().map(|port| SocketAddr::from((addr, port))).collect()
}
