//! The iptables dataplane on the real kernel, driven as a library inside a fresh network
//! namespace (needs root): what a full and a partial sync write (the `iptables-restore`
//! input), that the kernel then holds exactly the wanted rules, and both iptables variants;
//! the health-check node ports kube-proxy accepts in the filter table; NodePorts on 127.0.0.1
//! with `--iptables-localhost-nodeports` and not without; what `--cleanup` and a switch to
//! another mode remove. (Restore times are measured by `cargo xtask bench
//! control-plane`.)

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{ErrorKind, Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    time::{Duration, Instant},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::json;
use testbed::{unique_name, Netns};
use vipr::{
    dataplane::{
        iptables::{
            restore::parse_save, ruleset, Family, IptablesDataplane, IptablesOptions, TableName, Tools,
            Variant,
        },
        Dataplane,
    },
    model::{
        kubernetes::{desired_state, NodeContext, SERVICE_NAME_LABEL},
        DesiredState, HealthCheck, ServiceName,
    },
};

fn service(index: usize, node_port: bool) -> Service {
    let mut port = json!({"name": "http", "port": 80, "protocol": "TCP"});
    if node_port {
        port["nodePort"] = json!(30000 + index);
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": format!("svc{index}"), "namespace": "bench"},
        "spec": {
            "type": if node_port { "NodePort" } else { "ClusterIP" },
            "clusterIP": cluster_ip(index).to_string(),
            "ports": [port],
        },
    }))
    .unwrap()
}

fn cluster_ip(index: usize) -> IpAddr {
    IpAddr::from([172, 30, (index / 250) as u8, (index % 250 + 1) as u8])
}

/// `endpoints` endpoints of service `index`, the first `local` of them on this node.
fn slice(index: usize, endpoints: usize, generation: usize) -> EndpointSlice {
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("svc{index}-1"), "namespace": "bench", "labels": {SERVICE_NAME_LABEL: format!("svc{index}")}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": (0..endpoints).map(|e| json!({
            "addresses": [format!("10.{}.{}.{}", 100 + index / 250, index % 250, e + 1 + generation)],
            "nodeName": if e == 0 { "node-a" } else { "node-b" },
        })).collect::<Vec<_>>(),
    }))
    .unwrap()
}

fn node() -> NodeContext {
    let node_ip: IpAddr = "192.168.0.2".parse().unwrap();
    NodeContext {
        name: "node-a".into(),
        cluster_cidrs: vec!["10.0.0.0/8".parse().unwrap()],
        node_ips: [node_ip].into(),
        primary_ips: vec![node_ip],
        node_port_ips: [node_ip].into(),
        ..NodeContext::default()
    }
}

/// `services` services, every third a NodePort, with `endpoints` endpoints each; service 0's
/// endpoints moved by `generation`.
fn state(services: usize, endpoints: usize, generation: usize) -> DesiredState {
    let objects: Vec<Service> = (0..services).map(|i| service(i, i % 3 == 0)).collect();
    let slices: Vec<EndpointSlice> =
        (0..services).map(|i| slice(i, endpoints, if i == 0 { generation } else { 0 })).collect();
    let translation = desired_state(&objects, &slices, &node());
    assert!(translation.rejected.is_empty(), "{:?}", translation.rejected);
    translation.state
}

fn options(variant: Variant) -> IptablesOptions {
    IptablesOptions { variant: Some(variant), ..IptablesOptions::default() }
}

/// Our chains in the kernel: table -> chain -> rule count (iptables-save of the namespace).
fn kernel_chains(tools: &Tools) -> BTreeMap<(String, String), usize> {
    let saved = parse_save(&tools.save(Family::Ipv4).unwrap());
    let mut chains = BTreeMap::new();
    for (table, contents) in saved {
        for (chain, builtin) in &contents.chains {
            if !builtin && chain.starts_with("KUBE-") {
                let rules = contents.rules.iter().filter(|(name, _)| name == chain).count();
                chains.insert((table.clone(), chain.clone()), rules);
            }
        }
    }
    chains
}

fn wanted_chains(state: &DesiredState, tools: &Tools) -> BTreeMap<(String, String), usize> {
    let options = ruleset::RuleOptions {
        conntrack_tcp_liberal: false,
        random_fully: tools.has_random_fully(),
        localhost_node_ports: None,
    };
    let wanted = ruleset::generate(state, Family::Ipv4, options);
    let mut chains = BTreeMap::new();
    for table in TableName::ALL {
        for (chain, rules) in &wanted.table(table).chains {
            chains.insert((table.as_str().to_owned(), chain.clone()), rules.len());
        }
    }
    chains
}

fn chains_in(input: &str) -> BTreeSet<String> {
    input
        .lines()
        .filter_map(|line| line.strip_prefix(':'))
        .map(|line| line.split(' ').next().unwrap().to_owned())
        .collect()
}

fn syncs_write_everything_then_only_what_changed(variant: Variant) {
    testbed::require_root().unwrap();
    let netns = Netns::create(&unique_name("ipt-restore")).unwrap();
    netns
        .run(|| {
            let mut dataplane = IptablesDataplane::start(&options(variant))?;
            assert_eq!(dataplane.variant(), variant);
            let tools = dataplane.tools().clone();
            // Someone else's rules, which vipr must leave alone.
            tools.restore(
                Family::Ipv4,
                "*filter\n:CNI-OTHER - [0:0]\n-A CNI-OTHER -j ACCEPT\n-A FORWARD -j CNI-OTHER\nCOMMIT\n",
            )?;

            // First sync: full, every chain, and the jumps from the built-in chains.
            let first = state(30, 3, 0);
            let report = dataplane.sync(&first)?;
            assert!(report.is_complete() && report.changed > 0, "{report:?}");
            let stats = dataplane.last_sync().clone();
            assert!(stats.full);
            let restore = &stats.restores[0];
            assert_eq!(restore.family, Family::Ipv4);
            assert!(restore.input.contains(
                "-I PREROUTING 1 -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
            ));
            assert_eq!(
                kernel_chains(&tools),
                wanted_chains(&first, &tools),
                "the kernel holds what was wanted"
            );

            // Nothing changed: nothing written.
            dataplane.sync(&first)?;
            assert!(dataplane.last_sync().restores.is_empty(), "{:?}", dataplane.last_sync());

            // Service 1's endpoints move: only its endpoint-list chain and endpoint chains are
            // written, the old endpoint chains deleted; no other service's chain, and not
            // KUBE-SERVICES (its rules did not change).
            let moved = state(30, 3, 5);
            dataplane.sync(&moved)?;
            let stats = dataplane.last_sync().clone();
            assert!(!stats.full);
            let restore = &stats.restores[0];
            let written: BTreeSet<&str> = restore.written.iter().map(|(_, chain)| chain.as_str()).collect();
            let deleted: BTreeSet<&str> = restore.deleted.iter().map(|(_, chain)| chain.as_str()).collect();
            assert!(written.iter().any(|chain| chain.starts_with("KUBE-SVC-")), "{written:?}");
            assert_eq!(
                written.iter().filter(|chain| chain.starts_with("KUBE-SEP-")).count(),
                3,
                "{written:?}"
            );
            assert_eq!(deleted.len(), 3, "the three old endpoint chains: {deleted:?}");
            assert!(!written.contains("KUBE-SERVICES") && !written.contains("KUBE-NODEPORTS"), "{written:?}");
            // Service 0 is a NodePort: its KUBE-EXT chain jumps to the same KUBE-SVC chain, unchanged.
            assert!(!written.iter().any(|chain| chain.starts_with("KUBE-EXT-")), "{written:?}");
            assert_eq!(written.len(), 4, "{written:?}");
            // The input declares exactly those chains, and nothing about other services.
            let declared = chains_in(&restore.input);
            assert_eq!(declared, written.union(&deleted).map(|chain| (*chain).to_owned()).collect());
            assert!(!restore.input.contains("svc7"), "{}", restore.input);
            assert_eq!(kernel_chains(&tools), wanted_chains(&moved, &tools));

            // Services removed: their chains go, KUBE-SERVICES and KUBE-NODEPORTS are rewritten.
            let fewer = state(20, 3, 5);
            dataplane.sync(&fewer)?;
            let restore = &dataplane.last_sync().restores[0];
            assert!(restore
                .written
                .iter()
                .any(|(table, chain)| *table == TableName::Nat && chain == "KUBE-SERVICES"));
            assert_eq!(
                restore.deleted.len(),
                10 * (1 + 3) + 3,
                "10 × (SVC + 3 SEP) + 3 EXT: {:?}",
                restore.deleted
            );
            assert_eq!(kernel_chains(&tools), wanted_chains(&fewer, &tools));

            // A full resync after the chains were tampered with puts them back.
            tools.restore(Family::Ipv4, "*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n")?;
            dataplane.request_full_sync();
            dataplane.sync(&fewer)?;
            assert!(dataplane.last_sync().full);
            assert_eq!(kernel_chains(&tools), wanted_chains(&fewer, &tools));

            // --cleanup removes all of it, and only it.
            IptablesDataplane::cleanup()?;
            let saved = tools.save(Family::Ipv4)?;
            assert!(!saved.contains("KUBE-"), "{saved}");
            assert!(saved.contains("-A FORWARD -j CNI-OTHER"), "{saved}");
            Ok(())
        })
        .unwrap();
}

#[test]
fn nft_syncs_write_everything_then_only_what_changed() {
    syncs_write_everything_then_only_what_changed(Variant::Nft);
}

#[test]
fn legacy_syncs_write_everything_then_only_what_changed() {
    syncs_write_everything_then_only_what_changed(Variant::Legacy);
}

/// A load balancer with `externalTrafficPolicy: Local` has a health-check node port; kube-proxy
/// accepts it in the filter table's KUBE-NODEPORTS (jumped to from INPUT), so that the load
/// balancer's probes get through a node whose INPUT policy drops. The rule goes with the
/// service.
#[test]
fn health_check_node_ports_are_accepted_while_the_service_exists() {
    testbed::require_root().unwrap();
    let netns = Netns::create(&unique_name("ipt-hc")).unwrap();
    netns
        .run(|| {
            let mut dataplane = IptablesDataplane::start(&IptablesOptions::default())?;
            let tools = dataplane.tools().clone();
            let mut with_service = state(3, 2, 0);
            with_service.health_checks = [(
                ServiceName { namespace: "bench".into(), name: "svc0".into() },
                HealthCheck { port: 30500, local_endpoints: 1 },
            )]
            .into();
            dataplane.sync(&with_service)?;
            let accepts = |saved: &str| -> Vec<String> {
                saved
                    .lines()
                    .filter(|line| line.starts_with("-A KUBE-NODEPORTS ") && line.ends_with("-j ACCEPT"))
                    .map(str::to_owned)
                    .collect()
            };
            let filter = |family| -> anyhow::Result<String> {
                let saved = tools.save(family)?;
                Ok(saved.split("*filter").nth(1).unwrap_or_default().to_owned())
            };
            let rules = accepts(&filter(Family::Ipv4)?);
            assert_eq!(rules.len(), 1, "{rules:?}");
            let rule = &rules[0];
            for part in ["--comment \"bench/svc0 health check node port\"", "-p tcp", "--dport 30500"] {
                assert!(rule.contains(part), "{rule} lacks {part}");
            }
            // IPv4-only service: no IPv6 rule.
            assert!(accepts(&filter(Family::Ipv6)?).is_empty());
            // INPUT reaches it.
            assert!(filter(Family::Ipv4)?.contains(
                "-A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS"
            ));

            // The service goes (and its health check with it): the rule goes.
            let without: DesiredState = state(0, 0, 0);
            dataplane.sync(&without)?;
            assert!(accepts(&filter(Family::Ipv4)?).is_empty());
            Ok(())
        })
        .unwrap();
}

/// kube-proxy's iptables mode as it leaves a node (nat and filter chains, the canary in every
/// table, the jumps from the built-in chains), next to rules of someone else.
const KUBE_PROXY_RULES: &str = "\
*mangle
:KUBE-PROXY-CANARY - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
COMMIT
*nat
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-NPX46M4PTMTKRN6Y - [0:0]
:KUBE-SEP-ZZZ3JPVOKAWHDH5W - [0:0]
:CNI-FOREIGN - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING
-A POSTROUTING -j CNI-FOREIGN
-A CNI-FOREIGN -s 10.244.0.0/16 -j MASQUERADE
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -j MASQUERADE
-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment \"default/kubernetes:https cluster IP\" -m tcp --dport 443 -j KUBE-SVC-NPX46M4PTMTKRN6Y
-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-NPX46M4PTMTKRN6Y -j KUBE-SEP-ZZZ3JPVOKAWHDH5W
-A KUBE-SEP-ZZZ3JPVOKAWHDH5W -p tcp -m tcp -j DNAT --to-destination 192.168.0.2:6443
COMMIT
*filter
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES
-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT
-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-NODEPORTS -m comment --comment \"default/lb health check node port\" -m tcp -p tcp --dport 30500 -j ACCEPT
COMMIT
";

/// The user chains and rules of every table in `saved`, in one sorted list.
fn chains_and_rules(saved: &str) -> Vec<String> {
    let mut table = "";
    let mut lines: Vec<String> = Vec::new();
    for line in saved.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name;
        } else if line.starts_with("-A ") || (line.starts_with(':') && !line.contains(" ACCEPT ")) {
            lines.push(format!("{table} {}", line.split(" [").next().unwrap_or(line)));
        }
    }
    lines.sort();
    lines
}

/// A vipr starting in another mode takes kube-proxy's chains (its canary says so) for
/// kube-proxy's and leaves them alone, and so does the uninstall DaemonSet's command (vipr
/// `--cleanup --cleanup-keep-kube-proxy`, run while kube-proxy serves again); `vipr --cleanup`
/// removes them, and only them.
#[test]
fn cleanup_removes_kube_proxys_chains_and_a_mode_switch_does_not() {
    testbed::require_root().unwrap();
    let netns = Netns::create(&unique_name("ipt-kp")).unwrap();
    let before = netns
        .run(|| {
            let tools = Tools::detect(None)?;
            tools.restore(Family::Ipv4, KUBE_PROXY_RULES)?;
            let before = chains_and_rules(&tools.save(Family::Ipv4)?);
            assert!(before.iter().any(|line| line.contains("KUBE-SVC-")), "{before:?}");

            IptablesDataplane::cleanup_leftovers()?;
            assert_eq!(
                chains_and_rules(&tools.save(Family::Ipv4)?),
                before,
                "kube-proxy's rules were touched"
            );
            Ok(before)
        })
        .unwrap();
    let uninstall = testbed::vipr_cleanup(
        &testbed::locate_vipr().unwrap(),
        &netns,
        std::path::Path::new("/nonexistent-vipr-bpffs"),
    );
    eprintln!("uninstall: {uninstall:?}");
    uninstall.unwrap();
    netns
        .run(|| {
            let tools = Tools::detect(None)?;
            assert_eq!(
                chains_and_rules(&tools.save(Family::Ipv4)?),
                before,
                "the uninstall touched kube-proxy's rules"
            );

            IptablesDataplane::cleanup()?;
            let after = chains_and_rules(&tools.save(Family::Ipv4)?);
            let left: Vec<&String> = after
                .iter()
                .filter(|line| line.contains("KUBE-") && !line.contains("KUBE-KUBELET-CANARY"))
                .collect();
            assert!(left.is_empty(), "left behind: {left:?}");
            for foreign in [
                "mangle :KUBE-KUBELET-CANARY -",
                "nat :CNI-FOREIGN -",
                "nat -A POSTROUTING -j CNI-FOREIGN",
                "nat -A CNI-FOREIGN -s 10.244.0.0/16 -j MASQUERADE",
                "filter -A INPUT -p tcp -m tcp --dport 22 -j ACCEPT",
            ] {
                assert!(after.iter().any(|line| line == foreign), "{foreign} is gone: {after:?}");
            }
            Ok(())
        })
        .unwrap();
}

const ROUTE_LOCALNET: &str = "/proc/sys/net/ipv4/conf/all/route_localnet";

/// What a connection from the node to 127.0.0.1:30000 (service 0's NodePort) did.
#[derive(Debug)]
struct LocalhostAttempt {
    /// The endpoint's answer, or the connection's error.
    answer: Result<String, ErrorKind>,
    /// The client address the endpoint saw.
    peer: Option<IpAddr>,
    route_localnet: String,
    /// `iptables-save` of the node's filter table after the sync, then after `--cleanup`.
    filter: String,
    filter_after_cleanup: String,
    route_localnet_after_cleanup: String,
}

/// A node namespace (10.100.0.254/24 and the NodePort address 192.168.0.2 on a veth) and
/// the endpoint of service 0 (10.100.0.1:8080) in a pod namespace behind the veth; the
/// dataplane syncs service 0 (NodePort 30000) with `localhost` as the localhost NodePort
/// addresses, then a process of the node connects to 127.0.0.1:30000, then `--cleanup`.
fn connect_to_localhost_node_port(localhost: Option<&str>) -> LocalhostAttempt {
    let node_ns = Netns::create(&unique_name("ipt-lh-node")).unwrap();
    let pod = Netns::create(&unique_name("ipt-lh-pod")).unwrap();
    node_ns.ip(&["link", "add", "np0", "type", "veth", "peer", "name", "np1", "netns", pod.name()]).unwrap();
    node_ns.ip(&["addr", "add", "10.100.0.254/24", "dev", "np0"]).unwrap();
    node_ns.ip(&["link", "set", "np0", "up"]).unwrap();
    node_ns.ip(&["addr", "add", "192.168.0.2/24", "dev", "np0"]).unwrap();
    pod.ip(&["addr", "add", "10.100.0.1/24", "dev", "np1"]).unwrap();
    pod.ip(&["link", "set", "np1", "up"]).unwrap();
    pod.ip(&["route", "add", "default", "via", "10.100.0.254"]).unwrap();
    // A new namespace may inherit the host's value: start from the kernel's default.
    node_ns.set_sysctl("net.ipv4.conf.all.route_localnet", "0").unwrap();

    let listener = pod.run(|| Ok(TcpListener::bind("10.100.0.1:8080")?)).unwrap();
    listener.set_nonblocking(true).unwrap();
    let server = std::thread::spawn(move || -> Option<IpAddr> {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            match listener.accept() {
                Ok((mut stream, peer)) => {
                    stream.set_nonblocking(false).ok()?;
                    stream.write_all(b"endpoint 10.100.0.1").ok()?;
                    return Some(peer.ip());
                }
                Err(error) if error.kind() == ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(_) => return None,
            }
        }
        None
    });

    let localhost_node_ports = localhost.map(|net| net.parse().unwrap());
    let attempt = node_ns
        .run(|| {
            let options = IptablesOptions { localhost_node_ports, ..IptablesOptions::default() };
            let mut dataplane = IptablesDataplane::start(&options)?;
            let tools = dataplane.tools().clone();
            let report = dataplane.sync(&state(1, 1, 0))?;
            assert!(report.is_complete(), "{report:?}");
            let route_localnet = std::fs::read_to_string(ROUTE_LOCALNET)?.trim().to_owned();
            let filter = |tools: &Tools| -> anyhow::Result<String> {
                Ok(tools.save(Family::Ipv4)?.split("*filter").nth(1).unwrap_or_default().to_owned())
            };
            let answer = TcpStream::connect_timeout(
                &SocketAddr::from(([127, 0, 0, 1], 30000)),
                Duration::from_secs(2),
            )
            .and_then(|mut stream| {
                stream.set_read_timeout(Some(Duration::from_secs(2)))?;
                let mut answer = String::new();
                stream.read_to_string(&mut answer)?;
                Ok(answer)
            })
            .map_err(|error| error.kind());
            let filter_before = filter(&tools)?;
            IptablesDataplane::cleanup()?;
            Ok(LocalhostAttempt {
                answer,
                peer: None,
                route_localnet,
                filter: filter_before,
                filter_after_cleanup: filter(&tools)?,
                route_localnet_after_cleanup: std::fs::read_to_string(ROUTE_LOCALNET)?.trim().to_owned(),
            })
        })
        .unwrap();
    LocalhostAttempt { peer: server.join().unwrap(), ..attempt }
}

/// `--iptables-localhost-nodeports` (the agent's default): a NodePort answers on 127.0.0.1,
/// the connection reaches an endpoint on another host masqueraded (route_localnet=1 lets the
/// kernel route it), and kubelet's CVE-2020-8558 guard is in place. `--cleanup` leaves the
/// guard and the sysctl, as kube-proxy does.
#[test]
fn a_node_port_answers_on_localhost_with_the_flag() {
    testbed::require_root().unwrap();
    let attempt = connect_to_localhost_node_port(Some("127.0.0.0/8"));
    assert_eq!(attempt.answer.as_deref(), Ok("endpoint 10.100.0.1"), "{attempt:#?}");
    assert_eq!(attempt.peer, Some("10.100.0.254".parse().unwrap()), "masqueraded: {attempt:#?}");
    assert_eq!(attempt.route_localnet, "1");
    for filter in [&attempt.filter, &attempt.filter_after_cleanup] {
        assert!(filter.contains("-A INPUT -j KUBE-FIREWALL\n"), "{filter}");
        assert!(filter.contains("-A OUTPUT -j KUBE-FIREWALL\n"), "{filter}");
        let guard = filter.lines().find(|line| line.starts_with("-A KUBE-FIREWALL ")).unwrap_or_default();
        assert!(
            vipr::dataplane::iptables::restore::is_localnet_guard(
                guard.trim_start_matches("-A KUBE-FIREWALL ")
            ),
            "{filter}"
        );
    }
    assert_eq!(attempt.route_localnet_after_cleanup, "1");
}

/// `--iptables-localhost-nodeports=false`: nothing answers on 127.0.0.1:30000, and neither the
/// sysctl nor KUBE-FIREWALL is touched.
#[test]
fn a_node_port_does_not_answer_on_localhost_without_the_flag() {
    testbed::require_root().unwrap();
    let attempt = connect_to_localhost_node_port(None);
    assert_eq!(attempt.answer, Err(ErrorKind::ConnectionRefused), "{attempt:#?}");
    assert_eq!(attempt.peer, None);
    assert_eq!(attempt.route_localnet, "0");
    assert!(!attempt.filter.contains("KUBE-FIREWALL"), "{}", attempt.filter);
}
