//! The IPVS dataplane on a kernel that has IPVS. The host kernel here has none, so
//! [`in_a_uml_guest`] boots a User-Mode Linux guest (xtask/src/uml.rs: vipr's build of Debian's
//! 6.1 source with IPVS, the host's / as root) once and runs this same test binary in it,
//! restricted to the `ipvs_kernel::guest_` tests; they are `#[ignore]`d on the host and run only
//! there. One boot (about two seconds) serves all of them. Needs root and `cargo xtask setup`
//! (which builds the kernel, xtask/src/uml_kernel.rs).

#[path = "../../xtask/src/uml.rs"]
#[allow(dead_code, clippy::all)]
mod uml;

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsString,
    io::{BufRead as _, BufReader, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream},
    sync::Arc,
    time::Duration,
};

use testbed::{
    count_by_backend, exchanges, wait_for, Check, EchoServer, Frontend, LeafSpec, Netns, Protocol,
    TcpSession, Topology,
};
use vipr::{
    dataplane::{
        iptables::conntrack,
        ipvs::{
            client::{Destination, Ipvs, ServiceKey, ServiceSettings, Timeouts, VirtualServer},
            link::DUMMY_INTERFACE,
            IpvsDataplane, IpvsOptions,
        },
        Dataplane,
    },
    model::{
        self, Backend, DesiredState, FrontendEntry, FrontendKind, ServicePortName, SourceClassifier,
        Treatment, WhenEmpty,
    },
};

const TIMEOUT: Duration = Duration::from_secs(2);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const B1: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 2);
const B2: Ipv4Addr = Ipv4Addr::new(10, 20, 2, 2);
/// A second TCP port of the service, for the graceful-termination check.
const DRAIN_PORT: u16 = 8443;
/// The pods' range: the backends are pods, the client is not.
const POD_CIDR: &str = "10.20.0.0/16";

/// Boots one guest and runs every `guest_` test of this binary in it.
#[test]
fn in_a_uml_guest() {
    if uml::in_guest() {
        return;
    }
    let executable = std::env::current_exe().expect("our own executable");
    // libtest names a test by its module path without the crate: `ipvs_kernel::guest_…`.
    let module = module_path!().split_once("::").map_or(module_path!(), |(_crate, module)| module);
    let guest_tests = format!("{module}::guest_");
    let command: Vec<OsString> = [
        executable.as_os_str(),
        guest_tests.as_ref(),
        "--ignored".as_ref(),
        "--test-threads=1".as_ref(),
        "--nocapture".as_ref(),
    ]
    .into_iter()
    .map(OsString::from)
    .collect();
    let options = uml::Options {
        timeout: Duration::from_secs(300),
        stream: false,
        run_base: Some(std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("uml")),
        ..uml::Options::default()
    };
    let outcome = uml::run(&command, &options).unwrap_or_else(|error| panic!("the guest failed: {error:#}"));
    println!("{}", outcome.stdout);
    eprintln!("{}", outcome.stderr);
    assert_eq!(outcome.code, 0, "the guest tests failed (their output is above)");
    let passed = outcome
        .stdout
        .lines()
        .filter(|line| line.starts_with(&format!("test {guest_tests}")) && line.ends_with("ok"))
        .count();
    assert_eq!(passed, 4, "every guest test ran and passed:\n{}", outcome.stdout);
}

fn tcp_frontend(port: u16) -> Frontend {
    Frontend { addr: SocketAddrV4::new(VIP, port), protocol: Protocol::Tcp }
}

fn udp_frontend(port: u16) -> Frontend {
    Frontend { addr: SocketAddrV4::new(VIP, port), protocol: Protocol::Udp }
}

fn backend(ip: Ipv4Addr, port: u16) -> Backend {
    Backend { ip: IpAddr::V4(ip), port }
}

/// A cluster IP frontend as the model makes it with a detector: pods keep their address,
/// everyone else is masqueraded.
fn cluster_ip(protocol: model::Protocol, backends: &[Backend]) -> FrontendEntry {
    let backends: Arc<[Backend]> = backends.to_vec().into();
    let treatment =
        |masquerade| Treatment { backends: backends.clone(), when_empty: WhenEmpty::Reject, masquerade };
    FrontendEntry {
        service: ServicePortName {
            namespace: "default".into(),
            name: "web".into(),
            port: "p".into(),
            protocol,
        },
        kind: FrontendKind::ClusterIp,
        from_pod: treatment(false),
        from_node: treatment(true),
        from_outside: treatment(true),
        allowed_sources: Vec::new(),
        affinity: None,
    }
}

/// The service with these endpoints; `terminating` ones are still listed by the slices.
fn state(
    tcp: &[Backend],
    udp: &[Backend],
    terminating: &[Backend],
    node_ips: BTreeSet<IpAddr>,
) -> DesiredState {
    let frontend = |port, protocol| model::Frontend { ip: IpAddr::V4(VIP), port, protocol };
    DesiredState {
        frontends: [
            (frontend(80, model::Protocol::Tcp), cluster_ip(model::Protocol::Tcp, tcp)),
            (frontend(53, model::Protocol::Udp), cluster_ip(model::Protocol::Udp, udp)),
            // Used only by the graceful-termination check, so that no earlier connection
            // (IPVS remembers closed ones for two minutes) holds up the removal there.
            (frontend(DRAIN_PORT, model::Protocol::Tcp), cluster_ip(model::Protocol::Tcp, tcp)),
        ]
        .into_iter()
        .collect(),
        cluster_ips: [IpAddr::V4(VIP)].into(),
        listed_endpoints: tcp.iter().chain(udp).chain(terminating).copied().collect(),
        sources: SourceClassifier {
            pod_cidrs: vec![POD_CIDR.parse().unwrap()],
            node_ips,
            ..SourceClassifier::default()
        },
        ..DesiredState::default()
    }
}

/// `ipvsadm`-free look at one virtual service's real servers: address -> weight.
fn weights(node: &Netns, key: ServiceKey) -> BTreeMap<SocketAddr, u32> {
    node.run(|| {
        let mut ipvs = Ipvs::open()?;
        Ok(ipvs
            .destinations(&key)?
            .into_iter()
            .map(|destination| (SocketAddr::new(destination.ip, destination.port), destination.weight))
            .collect())
    })
    .unwrap()
}

fn run_in(node: &Netns, program: &str, args: &[&str]) -> String {
    let output = node.command(program).unwrap().args(args).output().unwrap();
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
#[ignore = "runs inside the UML guest that in_a_uml_guest boots"]
fn guest_the_netlink_client_programs_services_and_real_servers() {
    let netns = Netns::create(&testbed::unique_name("ipvs-client")).unwrap();
    netns
        .run(|| {
            let mut ipvs = Ipvs::open()?;
            assert!(ipvs.services()?.is_empty(), "a new namespace has no virtual service");
            let key =
                ServiceKey { ip: "10.96.0.10".parse().unwrap(), port: 80, protocol: model::Protocol::Tcp };
            let v6 = ServiceKey { ip: "fd00::10".parse().unwrap(), port: 53, protocol: model::Protocol::Udp };
            let settings = ServiceSettings { scheduler: "rr".into(), flags: 0, timeout: 0 };
            ipvs.add_service(&VirtualServer { key, settings: settings.clone() })?;
            ipvs.add_service(&VirtualServer {
                key: v6,
                settings: ServiceSettings { scheduler: "sh".into(), ..settings.clone() },
            })?;
            let again = ipvs.add_service(&VirtualServer { key, settings: settings.clone() }).unwrap_err();
            assert_eq!(again.errno(), Some(libc::EEXIST), "{again}");

            let sticky = ServiceSettings { scheduler: "wlc".into(), flags: 1, timeout: 600 };
            ipvs.update_service(&VirtualServer { key, settings: sticky.clone() })?;
            let listed: BTreeMap<ServiceKey, ServiceSettings> =
                ipvs.services()?.into_iter().map(|server| (server.key, server.settings)).collect();
            assert_eq!(listed.len(), 2);
            assert_eq!(listed[&key], sticky);
            assert_eq!(listed[&v6].scheduler, "sh");

            ipvs.add_destination(&key, &Destination::new("10.1.0.2".parse().unwrap(), 8080, 1))?;
            ipvs.add_destination(&key, &Destination::new("10.1.0.3".parse().unwrap(), 8080, 1))?;
            ipvs.add_destination(&v6, &Destination::new("fd00:1::2".parse().unwrap(), 5353, 1))?;
            ipvs.update_destination(&key, &Destination::new("10.1.0.3".parse().unwrap(), 8080, 0))?;
            let mut destinations = ipvs.destinations(&key)?;
            destinations.sort_by_key(|destination| destination.ip);
            assert_eq!(
                destinations.iter().map(|d| (d.ip.to_string(), d.port, d.weight)).collect::<Vec<_>>(),
                [("10.1.0.2".to_owned(), 8080, 1), ("10.1.0.3".to_owned(), 8080, 0)]
            );
            assert_eq!(ipvs.destinations(&v6)?[0].ip, "fd00:1::2".parse::<IpAddr>().unwrap());
            ipvs.delete_destination(&key, &destinations[1])?;
            assert_eq!(ipvs.destinations(&key)?.len(), 1);

            ipvs.set_timeouts(&Timeouts { tcp: 900, tcp_fin: 30, udp: 60 })?;
            assert_eq!(ipvs.timeouts()?, Timeouts { tcp: 900, tcp_fin: 30, udp: 60 });

            ipvs.delete_service(&key)?;
            let gone = ipvs.delete_service(&key).unwrap_err();
            assert_eq!(gone.errno(), Some(libc::ESRCH), "{gone}");
            ipvs.flush()?;
            assert!(ipvs.services()?.is_empty());
            Ok(())
        })
        .unwrap();
}

#[test]
#[ignore = "runs inside the UML guest that in_a_uml_guest boots"]
fn guest_a_synced_cluster_ip_balances_masquerades_and_drains() {
    let topology = Topology::build(
        "ipvs",
        vec![
            LeafSpec::in_own_slash24("client", CLIENT).unwrap(),
            LeafSpec::in_own_slash24("b1", B1).unwrap(),
            LeafSpec::in_own_slash24("b2", B2).unwrap(),
        ],
    )
    .unwrap();
    let node = topology.node();
    let _servers: Vec<EchoServer> = [("b1", B1), ("b2", B2)]
        .into_iter()
        .map(|(name, ip)| {
            let leaf = topology.leaf(name).unwrap();
            let tcp = SocketAddr::V4(SocketAddrV4::new(ip, 8080));
            let udp = SocketAddr::V4(SocketAddrV4::new(ip, 5353));
            EchoServer::start(&leaf.netns, name, &[tcp], &[udp]).unwrap()
        })
        .collect();
    let node_ips: BTreeSet<IpAddr> =
        [Ipv4Addr::new(10, 10, 0, 1), Ipv4Addr::new(10, 20, 1, 1), Ipv4Addr::new(10, 20, 2, 1)]
            .into_iter()
            .map(IpAddr::V4)
            .collect();
    let both_tcp = [backend(B1, 8080), backend(B2, 8080)];
    let both_udp = [backend(B1, 5353), backend(B2, 5353)];
    let desired = state(&both_tcp, &both_udp, &[], node_ips.clone());

    let mut dataplane = node.run(|| IpvsDataplane::start(IpvsOptions::default())).unwrap();
    let report = node.run(|| dataplane.sync(&desired)).unwrap();
    assert_eq!((report.changed, report.failed.len()), (3, 0), "{report:?}");
    assert!(run_in(node, "ip", &["-o", "addr", "show", "dev", DUMMY_INTERFACE]).contains("10.96.0.10/32"));

    // From outside the pod range: both backends, masqueraded to the node's address.
    let client = &topology.leaf("client").unwrap().netns;
    for frontend in [tcp_frontend(80), udp_frontend(53)] {
        let seen = client.run(|| exchanges(frontend, 20, TIMEOUT)).unwrap();
        assert_eq!(count_by_backend(&seen).len(), 2, "{frontend}: {:?}", count_by_backend(&seen));
        for exchange in &seen {
            assert_eq!(exchange.replied_from, frontend.socket_addr(), "replies come from the frontend");
            assert!(node_ips.contains(&exchange.answer.observed_client.ip()), "masqueraded: {exchange:?}");
        }
    }
    // A pod keeps its address, except toward itself (hairpin), which must be masqueraded.
    let b1 = &topology.leaf("b1").unwrap().netns;
    let seen = b1.run(|| exchanges(tcp_frontend(80), 20, TIMEOUT)).unwrap();
    for exchange in &seen {
        let observed = exchange.answer.observed_client.ip();
        match exchange.answer.backend.as_str() {
            "b1" => assert_eq!(observed, IpAddr::V4(Ipv4Addr::new(10, 20, 1, 1)), "hairpin is masqueraded"),
            _ => assert_eq!(observed, IpAddr::V4(B1), "pod traffic keeps its source"),
        }
    }
    // An unserved port of the service address is refused, not silently dropped.
    let refused =
        client.run(|| Ok(TcpSession::connect(SocketAddr::V4(SocketAddrV4::new(VIP, 81)), TIMEOUT).is_err()));
    assert!(refused.unwrap());

    // Nothing differs: nothing is written.
    let report = node.run(|| dataplane.sync(&desired)).unwrap();
    assert_eq!(report.changed, 0, "{report:?}");

    // Graceful termination: b1 leaves while a connection to it is open.
    let mut session = client
        .run(|| {
            for _ in 0..20 {
                let mut session = Session::connect(tcp_frontend(DRAIN_PORT).socket_addr())?;
                if session.ask()? == "b1" {
                    return Ok(session);
                }
            }
            anyhow::bail!("no connection landed on b1")
        })
        .unwrap();
    // UDP "connections" to both backends, in conntrack: those to b1 must go with it.
    let udp_53 = SocketAddr::V4(SocketAddrV4::new(VIP, 53));
    let udp_keep: conntrack::Keep = [(udp_53, [SocketAddr::V4(SocketAddrV4::new(B2, 5353))].into())].into();
    client.run(|| exchanges(udp_frontend(53), 20, TIMEOUT)).unwrap();
    let to_b1 = node.run(|| Ok(conntrack::count_stale_udp(&udp_keep)?)).unwrap();
    assert!(to_b1 > 0, "no UDP conntrack entry leads to b1 before it leaves");
    // b1 is terminating: still listed, no longer used.
    let only_b2 = state(
        &[backend(B2, 8080)],
        &[backend(B2, 5353)],
        &[backend(B1, 8080), backend(B1, 5353)],
        node_ips.clone(),
    );
    let report = node.run(|| dataplane.sync(&only_b2)).unwrap();
    assert_eq!(report.changed, 3, "{report:?}");
    let key = ServiceKey { ip: IpAddr::V4(VIP), port: DRAIN_PORT, protocol: model::Protocol::Tcp };
    let udp_key = ServiceKey { ip: IpAddr::V4(VIP), port: 53, protocol: model::Protocol::Udp };
    let b1_tcp = SocketAddr::V4(SocketAddrV4::new(B1, 8080));
    assert_eq!(weights(node, key).get(&b1_tcp), Some(&0), "TCP: weight 0 while connections last");
    assert_eq!(weights(node, udp_key).len(), 1, "UDP: removed at once");
    let left = node.run(|| Ok(conntrack::count_stale_udp(&udp_keep)?)).unwrap();
    assert_eq!(left, 0, "the sync deleted the {to_b1} UDP conntrack entries that led to b1");
    assert_eq!(session.ask().unwrap(), "b1", "the open connection goes on");
    let seen = client.run(|| exchanges(tcp_frontend(DRAIN_PORT), 10, TIMEOUT)).unwrap();
    assert_eq!(count_by_backend(&seen).keys().collect::<Vec<_>>(), ["b2"], "new connections avoid b1");
    // A reset closes it at once (IPVS keeps it 10 s in CLOSE); then a sync deletes b1.
    session.reset();
    wait_for("a sync to remove b1 once its connection is reset", Duration::from_secs(30), || {
        node.run(|| dataplane.sync(&only_b2))?;
        let now = weights(node, key);
        Ok(if now.contains_key(&b1_tcp) { Check::NotYet(format!("{now:?}")) } else { Check::Done(()) })
    })
    .unwrap();

    // A restarted dataplane reads the kernel back and finds nothing to do.
    drop(dataplane);
    let mut restarted = node.run(|| IpvsDataplane::start(IpvsOptions::default())).unwrap();
    let report = node.run(|| restarted.sync(&only_b2)).unwrap();
    assert_eq!(report.changed, 0, "{report:?}");

    // An endpoint that no slice lists any more is removed at once, connections or not.
    let mut session = client.run(|| Session::connect(tcp_frontend(80).socket_addr())).unwrap();
    assert_eq!(session.ask().unwrap(), "b2");
    let gone = state(&[], &[], &[], node_ips.clone());
    node.run(|| restarted.sync(&gone)).unwrap();
    let services = node.run(|| Ok(Ipvs::open()?.services()?)).unwrap();
    assert!(services.is_empty(), "without endpoints no virtual service is left: {services:?}");
    assert!(session.ask().is_err(), "the connection to a vanished endpoint is broken off");
    let refused = client.run(|| Ok(TcpSession::connect(tcp_frontend(80).socket_addr(), TIMEOUT).is_err()));
    assert!(refused.unwrap(), "a service without endpoints refuses");

    // Removing the service removes its virtual services and unbinds its address.
    let empty = DesiredState { sources: desired.sources.clone(), ..DesiredState::default() };
    node.run(|| restarted.sync(&empty)).unwrap();
    assert!(!run_in(node, "ip", &["-o", "addr", "show", "dev", DUMMY_INTERFACE]).contains("10.96.0.10"));
    let refused = client.run(|| Ok(TcpSession::connect(tcp_frontend(80).socket_addr(), TIMEOUT).is_err()));
    assert!(refused.unwrap(), "the address is gone");
}

/// One TCP connection to an echo backend that can be asked again and closed with a reset.
struct Session {
    stream: BufReader<TcpStream>,
}

impl Session {
    fn connect(to: SocketAddr) -> anyhow::Result<Self> {
        let stream = TcpStream::connect_timeout(&to, TIMEOUT)?;
        stream.set_read_timeout(Some(TIMEOUT))?;
        Ok(Self { stream: BufReader::new(stream) })
    }

    /// Who answers.
    fn ask(&mut self) -> anyhow::Result<String> {
        self.stream.get_mut().write_all(b"who are you?\n")?;
        let mut line = String::new();
        self.stream.read_line(&mut line)?;
        Ok(line.split_whitespace().next().unwrap_or_default().to_owned())
    }

    /// Closes with a reset (linger 0), which IPVS forgets after 10 s, not a FIN (2 min).
    fn reset(self) {
        let stream = self.stream.into_inner();
        socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO)).unwrap();
    }
}

#[test]
#[ignore = "runs inside the UML guest that in_a_uml_guest boots"]
fn guest_cleanup_removes_everything_the_dataplane_installed() {
    let node = Netns::create(&testbed::unique_name("ipvs-cleanup")).unwrap();
    let desired = state(&[backend(B1, 8080)], &[], &[], BTreeSet::new());
    node.run(|| {
        let mut dataplane = IpvsDataplane::start(IpvsOptions::default())?;
        dataplane.sync(&desired)?;
        Ok(())
    })
    .unwrap();
    assert!(run_in(&node, "iptables-save", &[]).contains("KUBE-IPVS-FILTER"));
    assert!(run_in(&node, "ipset", &["list", "-n"]).contains("KUBE-CLUSTER-IP"));

    // A rule of someone else's in a shared built-in chain stays.
    let mut other = node.command("iptables").unwrap();
    assert!(other.args(["-t", "nat", "-A", "PREROUTING", "-j", "RETURN"]).status().unwrap().success());
    node.run(|| IpvsDataplane::cleanup(&[])).unwrap();
    let saved = run_in(&node, "iptables-save", &[]);
    assert!(!saved.contains("KUBE-"), "{saved}");
    assert!(saved.contains("-A PREROUTING -j RETURN"), "{saved}");
    assert!(!run_in(&node, "ipset", &["list", "-n"]).contains("KUBE-"));
    assert!(!run_in(&node, "ip", &["link"]).contains(DUMMY_INTERFACE));
    assert!(node.run(|| Ok(Ipvs::open()?.services()?.is_empty())).unwrap());
}

#[test]
#[ignore = "runs inside the UML guest that in_a_uml_guest boots"]
fn guest_inspect_lists_the_virtual_services_and_ipsets() {
    let node = Netns::create(&testbed::unique_name("ipvs-inspect")).unwrap();
    let desired = state(&[backend(B1, 8080), backend(B2, 8080)], &[backend(B1, 5353)], &[], BTreeSet::new());
    node.run(|| {
        let mut dataplane = IpvsDataplane::start(IpvsOptions::default())?;
        dataplane.sync(&desired)?;
        Ok(())
    })
    .unwrap();
    // No pins to find: the mode is told by kube-ipvs0.
    let inspect = |args: &[&str]| testbed::netfilter_lab::inspect(&node, args).unwrap();

    let services: serde_json::Value = serde_json::from_str(&inspect(&["services", "-o", "json"])).unwrap();
    let listed: BTreeMap<String, BTreeSet<String>> = services
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| {
            let backends = entry["backends"].as_array().unwrap();
            assert!(backends.iter().all(|backend| backend["slots"] == 1), "weight 1 each: {entry:#}");
            let key =
                format!("{} {}", entry["protocol"].as_str().unwrap(), entry["frontend"].as_str().unwrap());
            (key, backends.iter().map(|backend| backend["address"].as_str().unwrap().to_owned()).collect())
        })
        .collect();
    let set = |addresses: &[&str]| addresses.iter().map(|address| (*address).to_owned()).collect();
    assert_eq!(listed["TCP 10.96.0.10:80"], set(&["10.20.1.2:8080", "10.20.2.2:8080"]), "{services:#}");
    assert_eq!(listed["UDP 10.96.0.10:53"], set(&["10.20.1.2:5353"]), "{services:#}");

    let text = inspect(&["services", "--frontend", "10.96.0.10:80"]);
    assert!(
        text.lines()
            .any(|line| line.starts_with("TCP") && line.contains("10.96.0.10:80") && line.contains("rr")),
        "{text}"
    );
    assert!(text.contains("  -> 10.20.2.2:8080"), "{text}");

    let maps: serde_json::Value = serde_json::from_str(&inspect(&["maps", "-o", "json"])).unwrap();
    let cluster_ips = maps
        .as_array()
        .unwrap()
        .iter()
        .find(|map| map["name"] == "KUBE-CLUSTER-IP")
        .unwrap_or_else(|| panic!("no KUBE-CLUSTER-IP in {maps:#}"));
    // 10.96.0.10 on ports 80, 53 and the drain port.
    assert_eq!(cluster_ips["entries"], 3, "{cluster_ips:#}");
}
