//! The raw-socket SCTP client and server (`testbed::sctp`) on the real kernel, without vipr:
//! a client namespace and a server namespace on either side of a router namespace. They must
//! answer each other, tell a refusal from silence and from other ICMP errors, keep concurrent
//! associations from one address apart, and the conformance runner's checks built on them
//! must fail on a wrong endpoint, a reply that was not reverse-NATed and a reply whose ports
//! were rewritten without fixing the checksum. Needs root; kernel netfilter and tc do the
//! NAT and the rewriting.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use testbed::{
    conformance::{
        case::{Protocol, Verdict},
        model::Outcome,
        probe::{self, FlowCheck},
    },
    sctp::{self, Reply},
    wait_for, Check, LeafSpec, Netns, Topology,
};

const ANSWER: Duration = Duration::from_secs(2);
/// Long enough for an answer on an idle machine; what comes later counts as silence.
const SILENCE: Duration = Duration::from_millis(400);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 71, 1, 2);
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 71, 2, 2);
/// On the server's link, owned by the server, and rejected by the router.
const REJECTED: Ipv4Addr = Ipv4Addr::new(10, 71, 2, 3);
/// The router's address on the client's link: no SCTP socket anywhere behind it.
const ROUTER: Ipv4Addr = Ipv4Addr::new(10, 71, 1, 1);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd71, 1, 0, 0, 0, 0, 0, 2);
const SERVER6: Ipv6Addr = Ipv6Addr::new(0xfd71, 2, 0, 0, 0, 0, 0, 2);
const ROUTER6: Ipv6Addr = Ipv6Addr::new(0xfd71, 1, 0, 0, 0, 0, 0, 1);
const PORT: u16 = 53;
const OTHER_PORT: u16 = 5353;

/// client ── router ── server, IPv4 and IPv6, with SCTP servers on the server's address at
/// [`PORT`] and [`OTHER_PORT`] and at [`REJECTED`]:[`PORT`], answering as their address.
struct Lab {
    _servers: Vec<sctp::Server>,
    topology: Topology,
}

impl Lab {
    fn start(label: &str) -> Self {
        testbed::require_root().unwrap();
        if let Some(reason) = sctp::unavailable() {
            panic!("raw SCTP cannot work here: {reason}");
        }
        let leaves = vec![
            LeafSpec::in_own_slash24("client", CLIENT).unwrap(),
            LeafSpec::in_own_slash24("server", SERVER).unwrap(),
        ];
        let topology = Topology::build(label, leaves).unwrap();
        let router = topology.node();
        router.set_sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
        for (name, leaf_ip, router_ip) in
            [("client", CLIENT6, ROUTER6), ("server", SERVER6, Ipv6Addr::new(0xfd71, 2, 0, 0, 0, 0, 0, 1))]
        {
            let leaf = topology.leaf(name).unwrap();
            router
                .ip(&["addr", "add", &format!("{router_ip}/64"), "dev", &format!("to-{name}"), "nodad"])
                .unwrap();
            leaf.netns.ip(&["addr", "add", &format!("{leaf_ip}/64"), "dev", "eth0", "nodad"]).unwrap();
            leaf.netns.ip(&["-6", "route", "add", "default", "via", &router_ip.to_string()]).unwrap();
        }
        // A REJECT must be seen every time.
        router.set_sysctl("net.ipv4.icmp_ratelimit", "0").unwrap();
        router.set_sysctl("net.ipv6.icmp.ratelimit", "0").unwrap();
        // Neighbour discovery waits for the link-local addresses the veths got on creation.
        for netns in
            [router, &topology.leaf("client").unwrap().netns, &topology.leaf("server").unwrap().netns]
        {
            wait_for("IPv6 duplicate address detection", Duration::from_secs(10), || {
                let tentative = netns.ip(&["-6", "addr", "show", "tentative"])?;
                Ok(if tentative.trim().is_empty() { Check::Done(()) } else { Check::NotYet(tentative) })
            })
            .unwrap();
        }
        let server = &topology.leaf("server").unwrap().netns;
        server.ip(&["addr", "add", &format!("{REJECTED}/32"), "dev", "eth0"]).unwrap();
        let sockets = [
            SocketAddr::new(SERVER.into(), PORT),
            SocketAddr::new(SERVER.into(), OTHER_PORT),
            SocketAddr::new(SERVER6.into(), PORT),
            SocketAddr::new(REJECTED.into(), PORT),
        ];
        let servers = sockets
            .iter()
            .map(|socket| sctp::Server::echo(server, &socket.to_string(), *socket).unwrap())
            .collect();
        Self { _servers: servers, topology }
    }

    fn router(&self) -> &Netns {
        self.topology.node()
    }

    fn client(&self) -> &Netns {
        &self.topology.leaf("client").unwrap().netns
    }

    fn send_init(&self, source: IpAddr, dest: SocketAddr, timeout: Duration) -> sctp::InitExchange {
        self.client().run(|| Ok(sctp::send_init(source, dest, timeout)?)).unwrap()
    }

    /// Runs a runner check from the client's address.
    fn check(
        &self,
        dest: SocketAddr,
        expect: Outcome,
        listener_at_dest: Option<&str>,
    ) -> Result<String, String> {
        let source = if dest.is_ipv4() { IpAddr::V4(CLIENT) } else { IpAddr::V6(CLIENT6) };
        let flow = FlowCheck {
            protocol: Protocol::SCTP,
            source,
            dest,
            expect,
            affinity: false,
            node_addresses: BTreeSet::from([IpAddr::V4(ROUTER)]),
            listener_at_dest: listener_at_dest.map(str::to_owned),
        };
        self.client().run(|| Ok(probe::check(&flow))).unwrap()
    }
}

/// Runs a command in `netns` and fails the test if it fails.
fn run_in(netns: &Netns, program: &str, args: &[&str]) {
    let output = netns.command(program).unwrap().args(args).output().unwrap();
    assert!(
        output.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr).trim()
    );
}

fn dnat_to(endpoint: SocketAddr) -> Outcome {
    Outcome { verdict: Verdict::DNAT, endpoints: BTreeSet::from([endpoint]), masquerade: false }
}

#[test]
fn a_server_answers_with_the_client_it_saw() {
    let lab = Lab::start("sctpraw-answer");
    for (source, server) in
        [(IpAddr::V4(CLIENT), IpAddr::V4(SERVER)), (IpAddr::V6(CLIENT6), IpAddr::V6(SERVER6))]
    {
        let dest = SocketAddr::new(server, PORT);
        let exchange = lab.send_init(source, dest, ANSWER);
        assert_eq!(exchange.client.ip(), source);
        let Reply::InitAck { from, cookie: Some(cookie) } = &exchange.reply else {
            panic!("{dest}: {:?}", exchange.reply);
        };
        assert_eq!(*from, dest);
        assert_eq!(String::from_utf8_lossy(cookie), format!("{dest} {}", exchange.client));
    }
}

#[test]
fn silence_refusal_and_other_icmp_errors_are_told_apart() {
    let lab = Lab::start("sctpraw-icmp");
    run_in(
        lab.router(),
        "iptables",
        &["-A", "FORWARD", "-p", "sctp", "-d", &REJECTED.to_string(), "-j", "REJECT"],
    );
    run_in(
        lab.router(),
        "ip6tables",
        &["-A", "FORWARD", "-p", "sctp", "-d", &SERVER6.to_string(), "-j", "REJECT"],
    );

    // The server's raw sockets take every SCTP packet to its address, served port or not.
    let unserved = lab.send_init(CLIENT.into(), SocketAddr::new(SERVER.into(), 9), SILENCE);
    assert_eq!(unserved.reply, Reply::Silence);

    for (source, dest) in [
        (IpAddr::V4(CLIENT), SocketAddr::new(REJECTED.into(), PORT)),
        (IpAddr::V6(CLIENT6), SocketAddr::new(SERVER6.into(), PORT)),
    ] {
        let rejected = lab.send_init(source, dest, ANSWER);
        let Reply::Icmp(error) = rejected.reply else { panic!("{dest}: {:?}", rejected.reply) };
        assert!(error.port_unreachable(), "{dest}: {error}");
    }

    // No raw socket on the router: its kernel says it has no SCTP.
    for (source, dest) in
        [(IpAddr::V4(CLIENT), IpAddr::V4(ROUTER)), (IpAddr::V6(CLIENT6), IpAddr::V6(ROUTER6))]
    {
        let unknown = lab.send_init(source, SocketAddr::new(dest, PORT), ANSWER);
        let Reply::Icmp(error) = unknown.reply else { panic!("{dest}: {:?}", unknown.reply) };
        assert!(!error.port_unreachable(), "{dest}: {error}");
    }

    // The runner's checks on the same answers.
    let reject = Outcome::of(Verdict::REJECT);
    lab.check(SocketAddr::new(REJECTED.into(), PORT), reject.clone(), None).unwrap();
    lab.check(SocketAddr::new(SERVER6.into(), PORT), reject.clone(), None).unwrap();
    let error = lab.check(SocketAddr::new(SERVER.into(), 9), reject, None).unwrap_err();
    assert!(error.contains("dropped, not rejected"), "{error}");
    lab.check(SocketAddr::new(SERVER.into(), 9), Outcome::of(Verdict::DROP), None).unwrap();
    let error =
        lab.check(SocketAddr::new(ROUTER.into(), PORT), Outcome::of(Verdict::DROP), None).unwrap_err();
    assert!(error.contains("protocol unreachable"), "{error}");
}

#[test]
fn concurrent_associations_from_one_address_keep_their_own_answers() {
    let lab = Lab::start("sctpraw-concurrent");
    run_in(
        lab.router(),
        "iptables",
        &["-A", "FORWARD", "-p", "sctp", "-d", &REJECTED.to_string(), "-j", "REJECT"],
    );
    let exchanges: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..24)
            .map(|index| {
                let dest = match index % 3 {
                    0 => SocketAddr::new(SERVER.into(), PORT),
                    1 => SocketAddr::new(SERVER.into(), OTHER_PORT),
                    _ => SocketAddr::new(REJECTED.into(), PORT),
                };
                let lab = &lab;
                scope.spawn(move || (dest, lab.send_init(CLIENT.into(), dest, ANSWER)))
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().unwrap()).collect()
    });
    for (dest, exchange) in exchanges {
        match exchange.reply {
            Reply::InitAck { from, cookie: Some(cookie) } if dest.ip() == IpAddr::V4(SERVER) => {
                assert_eq!(from, dest);
                assert_eq!(String::from_utf8_lossy(&cookie), format!("{dest} {}", exchange.client));
            }
            Reply::Icmp(error) if dest.ip() == IpAddr::V4(REJECTED) => assert!(error.port_unreachable()),
            other => panic!("{dest} from {}: {other:?}", exchange.client),
        }
    }
}

/// Netfilter's DNAT of SCTP (with a port change, which makes it fix the checksum) passes the
/// runner's DNAT check; the same check fails for a wrong endpoint and when the reply is not
/// reverse-NATed.
#[test]
fn the_runner_sees_wrong_endpoints_and_missing_reverse_nat() {
    let lab = Lab::start("sctpraw-dnat");
    let vip = SocketAddr::new(VIP.into(), PORT);
    let endpoint = SocketAddr::new(SERVER.into(), OTHER_PORT);
    run_in(
        lab.router(),
        "iptables",
        &[
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-p",
            "sctp",
            "-d",
            &VIP.to_string(),
            "-j",
            "DNAT",
            "--to-destination",
            &endpoint.to_string(),
        ],
    );
    let detail = lab.check(vip, dnat_to(endpoint), None).unwrap();
    assert!(detail.contains(&format!("{endpoint}×")), "{detail}");

    let elsewhere = SocketAddr::new(SERVER.into(), PORT);
    let error = lab.check(vip, dnat_to(elsewhere), None).unwrap_err();
    assert!(error.contains(&format!("DNATed to {endpoint}, not one of [{elsewhere}]")), "{error}");

    // Untracked replies are not reverse-NATed: the INIT-ACK arrives from the endpoint.
    run_in(
        lab.router(),
        "iptables",
        &["-t", "raw", "-A", "PREROUTING", "-i", "to-server", "-p", "sctp", "-j", "CT", "--notrack"],
    );
    let error = lab.check(vip, dnat_to(endpoint), None).unwrap_err();
    assert!(error.contains(&format!("came from {endpoint}, not {vip}")), "{error}");
}

/// A reply whose source port is rewritten on the way (by a raw nftables payload write on
/// the router, which leaves checksums alone) is a failure of its own; with the checksum
/// fixed (nftables' `sctp sport set`, which updates the CRC32c), the rewrite is still seen,
/// as a reply from the wrong port.
#[test]
fn a_port_rewrite_without_checksum_fix_fails() {
    let lab = Lab::start("sctpraw-crc");
    let dest = SocketAddr::new(SERVER.into(), PORT);
    let listener = dest.to_string();
    let pass = Outcome::of(Verdict::PASS);
    lab.check(dest, pass.clone(), Some(&listener)).unwrap();

    let nft = |args: &[&str]| run_in(lab.router(), "nft", args);
    nft(&["add", "table", "ip", "rewrite"]);
    nft(&["add", "chain", "ip", "rewrite", "pre", "{ type filter hook prerouting priority -300; }"]);
    nft(&[
        "add",
        "rule",
        "ip",
        "rewrite",
        "pre",
        "iifname",
        "to-server",
        "ip",
        "protocol",
        "sctp",
        "@th,0,16",
        "set",
        "54",
    ]);
    let error = lab.check(dest, pass.clone(), Some(&listener)).unwrap_err();
    assert!(error.contains("bad SCTP checksum"), "{error}");
    let exchange = lab.send_init(CLIENT.into(), dest, ANSWER);
    assert!(
        matches!(exchange.reply, Reply::BadChecksum { from, .. } if from == SocketAddr::new(SERVER.into(), 54)),
        "{:?}",
        exchange.reply
    );

    nft(&["flush", "chain", "ip", "rewrite", "pre"]);
    nft(&["add", "rule", "ip", "rewrite", "pre", "iifname", "to-server", "sctp", "sport", "set", "54"]);
    let error = lab.check(dest, pass, Some(&listener)).unwrap_err();
    assert!(error.contains(&format!("reply from {SERVER}:54")), "{error}");
}
