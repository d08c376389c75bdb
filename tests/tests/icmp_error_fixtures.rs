//! Katran-style fixtures for the reverse NAT of ICMP errors about tracked connections
//! (proxy-ebpf/src/icmp_error.rs), run with BPF_PROG_TEST_RUN.
//!
//! Each fixture sets up a connection (balanced by running the client's packet through the
//! program, or a masqueraded one written into the flows map), then sends one ICMP or ICMPv6
//! frame and expects a verdict and an exact output frame: the error the client's kernel must
//! see, built independently here from the packet as the client sent it (the quote
//! client -> frontend, the outer source the frontend). Every output is also checked on its own
//! (fixtures/icmp_error.rs): outer IPv4 header checksum, ICMP checksum over the whole message
//! (ICMPv6 with the pseudo header), quoted IPv4 header checksum, and the quoted TCP/UDP
//! checksum over the quoted pseudo header when the quote is the whole packet (a partial
//! quote's checksum field is compared with the one of the packet the client sent). An error
//! changes no flow entry: the flows map must be exactly as before it. Needs root (BPF and
//! mount).

use testbed::fixtures::{frame, frame6, harness, harness6, icmp_error, table};

use anyhow::{anyhow, ensure, Result};
use frame::{ep, input_and_output, Ep, Packet, IPPROTO_TCP, IPPROTO_UDP, IP_MF, ROUTER_ALERT};
use frame6::{ep6, ip6, Ep6, Packet6};
use harness::{check_verdict, masqueraded_entries, verdict_name, Harness, TC_ACT_OK, TC_ACT_UNSPEC};
use harness6::{add_service6, flows6, insert_flow6};
use icmp_error::{check_error_checksums, compare_errors, icmp4_error, icmp6_error, quote, Quote};
use proxy_common::source_class;
use table::{run_table, Outcome};

// ---------------------------------------------------------------------------------------------
// The world: a UDP and a TCP frontend on one cluster IP, for each family.

const CLIENT: Ep = ep([192, 168, 1, 100], 40000);
const VIP: [u8; 4] = [10, 96, 0, 10];
const DNS: Ep = ep(VIP, 53);
const DNS_BACKEND: Ep = ep([10, 244, 2, 7], 5353);
const WEB: Ep = ep(VIP, 80);
const WEB_BACKEND: Ep = ep([10, 244, 1, 5], 8080);
/// The node's address toward the backends, and the port a masqueraded connection got.
const NODE: Ep = ep([10, 244, 0, 1], 61000);
/// A router between the node and a backend.
const ROUTER: [u8; 4] = [10, 244, 9, 1];
/// The node's address toward the client.
const NODE_UPLINK: [u8; 4] = [192, 168, 1, 1];
const NODE6_UPLINK: [u8; 16] = ip6([0xfd00, 0x1, 0, 0], 0x1);

const CLIENT6: Ep6 = ep6(ip6([0xfd00, 0x1, 0, 0], 0x64), 40000);
const DNS6: Ep6 = ep6(ip6([0xfd00, 0x10, 0x96, 0], 0xa), 53);
const DNS6_BACKEND: Ep6 = ep6(ip6([0xfd00, 0x10, 0x244, 2], 0x7), 5353);
const WEB6: Ep6 = ep6(ip6([0xfd00, 0x10, 0x96, 0], 0xa), 80);
const WEB6_BACKEND: Ep6 = ep6(ip6([0xfd00, 0x10, 0x244, 1], 0x5), 8080);
const NODE6: Ep6 = ep6(ip6([0xfd00, 0x10, 0x244, 0], 0x1), 61000);

// ICMP types and codes.
const PORT_UNREACHABLE: (u8, u8) = (3, 3);
const HOST_UNREACHABLE: (u8, u8) = (3, 1);
const FRAGMENTATION_NEEDED: (u8, u8) = (3, 4);
const TTL_EXCEEDED: (u8, u8) = (11, 0);
const PARAMETER_PROBLEM: (u8, u8) = (12, 0);
const PORT_UNREACHABLE6: (u8, u8) = (1, 4);
const PACKET_TOO_BIG6: (u8, u8) = (2, 0);
const TIME_EXCEEDED6: (u8, u8) = (3, 0);
/// The next-hop MTU of a fragmentation needed (1400) and of a packet too big (1280).
const MTU_1400: [u8; 4] = [0, 0, 0x05, 0x78];
const MTU_1280: [u8; 4] = [0, 0, 0x05, 0x00];

fn packet(proto: u8, from: Ep, to: Ep) -> Packet {
    if proto == IPPROTO_TCP {
        Packet::tcp(from, to)
    } else {
        Packet::udp(from, to)
    }
}

fn packet6(proto: u8, from: Ep6, to: Ep6) -> Packet6 {
    if proto == IPPROTO_TCP {
        Packet6::tcp(from, to)
    } else {
        Packet6::udp(from, to)
    }
}

/// Runs a packet that must be balanced (TC_ACT_OK), setting its connection's flows up.
fn establish(h: &Harness, frame: &[u8]) -> Result<()> {
    let (verdict, out) = h.run(frame)?;
    ensure!(
        verdict == TC_ACT_OK && out != frame,
        "setup packet not balanced: {}\n  {}",
        verdict_name(verdict),
        input_and_output(frame, &out)
    );
    Ok(())
}

/// Both frontends; the client's first packets balanced to their only backends.
fn world(h: &mut Harness) -> Result<()> {
    h.add_service(DNS, IPPROTO_UDP, 1, &[DNS_BACKEND])?;
    h.add_service(WEB, IPPROTO_TCP, 2, &[WEB_BACKEND])?;
    establish(h, &Packet::udp(CLIENT, DNS).build())?;
    establish(h, &Packet::tcp(CLIENT, WEB).build())
}

/// Connections masqueraded to the node's address (as a MASQUERADE service or a hairpin
/// leaves them), written into the flows map.
fn masqueraded_world(h: &mut Harness) -> Result<()> {
    for (frontend, backend, proto) in [(DNS, DNS_BACKEND, IPPROTO_UDP), (WEB, WEB_BACKEND, IPPROTO_TCP)] {
        for (key, flow) in masqueraded_entries(CLIENT, frontend, backend, NODE, proto) {
            h.insert_flow(key, flow)?;
        }
    }
    Ok(())
}

fn world6(h: &mut Harness) -> Result<()> {
    let outside = source_class::OUTSIDE;
    add_service6(h, DNS6, IPPROTO_UDP, outside, 1, &[DNS6_BACKEND], 0)?;
    add_service6(h, WEB6, IPPROTO_TCP, outside, 2, &[WEB6_BACKEND], 0)?;
    establish(h, &Packet6::udp(CLIENT6, DNS6).build())?;
    establish(h, &Packet6::tcp(CLIENT6, WEB6).build())
}

fn masqueraded_world6(h: &mut Harness) -> Result<()> {
    for (frontend, backend, proto) in [(DNS6, DNS6_BACKEND, IPPROTO_UDP), (WEB6, WEB6_BACKEND, IPPROTO_TCP)] {
        for (key, flow) in masqueraded_entries(CLIENT6, frontend, backend, NODE6, proto) {
            insert_flow6(h, key, flow)?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The table.

struct Fixture {
    name: &'static str,
    setup: fn(&mut Harness) -> Result<()>,
    input: Vec<u8>,
    verdict: u32,
    /// `None`: the frame must come back unchanged.
    output: Option<Vec<u8>>,
    /// Whether the input is an ICMP error, whose checksums must then be right (else the
    /// program could leave it alone for the wrong reason).
    error_input: bool,
    /// Run through the egress program (an error the node's own stack sends), not ingress.
    at_egress: bool,
}

/// `fixture` run through the egress program.
fn at_egress(fixture: Fixture) -> Fixture {
    Fixture { at_egress: true, ..fixture }
}

/// What an error must become; `reversed` is the error as the client must receive it.
fn reversed(
    name: &'static str,
    setup: fn(&mut Harness) -> Result<()>,
    input: Vec<u8>,
    output: Vec<u8>,
) -> Fixture {
    Fixture {
        name,
        setup,
        input,
        verdict: TC_ACT_OK,
        output: Some(output),
        error_input: true,
        at_egress: false,
    }
}

fn untouched(name: &'static str, setup: fn(&mut Harness) -> Result<()>, input: Vec<u8>) -> Fixture {
    Fixture { name, setup, input, verdict: TC_ACT_UNSPEC, output: None, error_input: true, at_egress: false }
}

/// A frame that is no ICMP error, left alone.
fn not_an_error(name: &'static str, setup: fn(&mut Harness) -> Result<()>, input: Vec<u8>) -> Fixture {
    Fixture { error_input: false, ..untouched(name, setup, input) }
}

/// An IPv4 error from `from` about `client -> to` as quoted, and the error the client must get
/// instead: from `frontend`, about `client -> frontend`, with the same type, code and rest.
struct Error4 {
    kind: (u8, u8),
    rest: [u8; 4],
    proto: u8,
    quote: Quote,
}

impl Error4 {
    fn of(kind: (u8, u8), proto: u8) -> Self {
        Self { kind, rest: [0; 4], proto, quote: Quote::Whole }
    }

    fn packet(&self, from: [u8; 4], to: [u8; 4], quoted: &Packet) -> Packet {
        icmp4_error(from, to, self.kind, self.rest, &quote(&quoted.build(), self.quote))
    }

    fn frame(&self, from: [u8; 4], to: [u8; 4], quoted: &Packet) -> Vec<u8> {
        self.packet(from, to, quoted).build()
    }

    /// From `sender` to `receiver` about `quoted_from -> quoted_to`.
    fn about(&self, sender: [u8; 4], receiver: [u8; 4], quoted_from: Ep, quoted_to: Ep) -> Vec<u8> {
        self.frame(sender, receiver, &packet(self.proto, quoted_from, quoted_to))
    }
}

struct Error6 {
    kind: (u8, u8),
    rest: [u8; 4],
    proto: u8,
    quote: Quote,
}

impl Error6 {
    fn of(kind: (u8, u8), proto: u8) -> Self {
        Self { kind, rest: [0; 4], proto, quote: Quote::Whole }
    }

    fn about(&self, sender: [u8; 16], receiver: [u8; 16], quoted_from: Ep6, quoted_to: Ep6) -> Vec<u8> {
        let quoted = packet6(self.proto, quoted_from, quoted_to).build();
        icmp6_error(sender, receiver, self.kind, self.rest, &quote(&quoted, self.quote))
    }
}

fn ipv4_fixtures() -> Vec<Fixture> {
    let udp = Error4::of(PORT_UNREACHABLE, IPPROTO_UDP);
    let tcp = Error4::of(HOST_UNREACHABLE, IPPROTO_TCP);
    let frag_needed = Error4 { rest: MTU_1400, ..Error4::of(FRAGMENTATION_NEEDED, IPPROTO_TCP) };
    let udp_8 = Error4 { quote: Quote::L4Bytes(8), ..Error4::of(PORT_UNREACHABLE, IPPROTO_UDP) };
    let tcp_8 = Error4 { quote: Quote::L4Bytes(8), ..Error4::of(FRAGMENTATION_NEEDED, IPPROTO_TCP) };
    let udp_4 = Error4 { quote: Quote::L4Bytes(4), ..Error4::of(PORT_UNREACHABLE, IPPROTO_UDP) };
    let ttl = Error4::of(TTL_EXCEEDED, IPPROTO_UDP);
    let param = Error4 { rest: [20, 0, 0, 0], ..Error4::of(PARAMETER_PROBLEM, IPPROTO_TCP) };
    let (client, backend) = (CLIENT.addr, DNS_BACKEND.addr);
    let with_options = |from, to| Packet::udp(from, to).ip_options(&ROUTER_ALERT);
    let udp_2 = Error4 { quote: Quote::L4Bytes(2), ..Error4::of(PORT_UNREACHABLE, IPPROTO_UDP) };
    let mut padded_ports = udp_2.about(backend, client, CLIENT, DNS_BACKEND);
    padded_ports.extend_from_slice(&DNS_BACKEND.port.to_be_bytes());
    let mut fragmented = udp.packet(backend, client, &Packet::udp(CLIENT, DNS_BACKEND));
    fragmented.frag = IP_MF;
    vec![
        reversed(
            "udp_port_unreachable_from_the_backend",
            world,
            udp.about(backend, client, CLIENT, DNS_BACKEND),
            udp.about(DNS.addr, client, CLIENT, DNS),
        ),
        reversed(
            "tcp_host_unreachable",
            world,
            tcp.about(WEB_BACKEND.addr, client, CLIENT, WEB_BACKEND),
            tcp.about(WEB.addr, client, CLIENT, WEB),
        ),
        reversed(
            "fragmentation_needed_keeps_its_mtu",
            world,
            frag_needed.about(ROUTER, client, CLIENT, WEB_BACKEND),
            frag_needed.about(WEB.addr, client, CLIENT, WEB),
        ),
        // As in netfilter, the outer source becomes the frontend even when a router sent it.
        reversed(
            "ttl_exceeded_from_a_router",
            world,
            ttl.about(ROUTER, client, CLIENT, DNS_BACKEND),
            ttl.about(DNS.addr, client, CLIENT, DNS),
        ),
        reversed(
            "tcp_parameter_problem",
            world,
            param.about(WEB_BACKEND.addr, client, CLIENT, WEB_BACKEND),
            param.about(WEB.addr, client, CLIENT, WEB),
        ),
        reversed(
            "udp_masqueraded_error_to_the_node",
            masqueraded_world,
            udp.about(backend, NODE.addr, NODE, DNS_BACKEND),
            udp.about(DNS.addr, client, CLIENT, DNS),
        ),
        reversed(
            "tcp_masqueraded_error_to_the_node",
            masqueraded_world,
            tcp.about(WEB_BACKEND.addr, NODE.addr, NODE, WEB_BACKEND),
            tcp.about(WEB.addr, client, CLIENT, WEB),
        ),
        // The UDP checksum lies inside the 8 bytes: it is updated; TCP's is not quoted.
        reversed(
            "udp_quote_of_8_bytes",
            world,
            udp_8.about(backend, client, CLIENT, DNS_BACKEND),
            udp_8.about(DNS.addr, client, CLIENT, DNS),
        ),
        reversed(
            "tcp_quote_of_8_bytes",
            world,
            tcp_8.about(ROUTER, client, CLIENT, WEB_BACKEND),
            tcp_8.about(WEB.addr, client, CLIENT, WEB),
        ),
        reversed(
            "masqueraded_tcp_quote_of_8_bytes",
            masqueraded_world,
            tcp_8.about(ROUTER, NODE.addr, NODE, WEB_BACKEND),
            tcp_8.about(WEB.addr, client, CLIENT, WEB),
        ),
        reversed(
            "quoted_header_with_ip_options",
            world,
            udp.frame(backend, client, &with_options(CLIENT, DNS_BACKEND)),
            udp.frame(DNS.addr, client, &with_options(CLIENT, DNS)),
        ),
        // The client's error about a reply it got: the forward entry applies.
        reversed(
            "client_error_about_a_reply",
            world,
            udp.about(client, DNS.addr, DNS, CLIENT),
            udp.about(client, backend, DNS_BACKEND, CLIENT),
        ),
        untouched(
            "error_about_an_untracked_tuple",
            world,
            udp.about(backend, client, ep(client, 40001), DNS_BACKEND),
        ),
        untouched(
            "error_about_an_untracked_port",
            world,
            udp.about(backend, client, CLIENT, ep(backend, 5354)),
        ),
        // Conntrack finds the connection by the ports alone; the checksum is not quoted.
        reversed(
            "udp_quote_of_only_the_ports",
            world,
            udp_4.about(backend, client, CLIENT, DNS_BACKEND),
            udp_4.about(DNS.addr, client, CLIENT, DNS),
        ),
        // Half the ports quoted, the other half in the Ethernet padding after the IP packet:
        // no flow may be found from bytes outside the message.
        untouched("ports_beyond_the_ip_packet", world, padded_ports),
        untouched("fragmented_error", world, fragmented.build()),
        // The node's own stack, forwarding a DNATed request (`stack`), answers it: at egress
        // toward the client the quote gets the frontend back, as conntrack does for a locally
        // sent error.
        at_egress(reversed(
            "node_fragmentation_needed_about_a_request_at_egress",
            world,
            frag_needed.about(NODE_UPLINK, client, CLIENT, WEB_BACKEND),
            frag_needed.about(WEB.addr, client, CLIENT, WEB),
        )),
        at_egress(reversed(
            "node_host_unreachable_about_a_udp_request_at_egress",
            world,
            Error4::of(HOST_UNREACHABLE, IPPROTO_UDP).about(NODE_UPLINK, client, CLIENT, DNS_BACKEND),
            Error4::of(HOST_UNREACHABLE, IPPROTO_UDP).about(DNS.addr, client, CLIENT, DNS),
        )),
        // A backend's error, reverse-NATed at ingress already, leaves as it is.
        at_egress(untouched(
            "reverse_nated_error_at_egress",
            world,
            udp.about(DNS.addr, client, CLIENT, DNS),
        )),
        at_egress(not_an_error("echo_request_at_egress", world, Packet::icmp_echo(client, VIP).build())),
        not_an_error("echo_request_to_the_vip", world, Packet::icmp_echo(client, VIP).build()),
        not_an_error("echo_request_from_the_backend", world, Packet::icmp_echo(backend, client).build()),
    ]
}

fn ipv6_fixtures() -> Vec<Fixture> {
    let udp = Error6::of(PORT_UNREACHABLE6, IPPROTO_UDP);
    let too_big = Error6 { rest: MTU_1280, ..Error6::of(PACKET_TOO_BIG6, IPPROTO_TCP) };
    let udp_8 = Error6 { quote: Quote::L4Bytes(8), ..Error6::of(TIME_EXCEEDED6, IPPROTO_UDP) };
    let (client, backend) = (CLIENT6.addr, DNS6_BACKEND.addr);
    vec![
        reversed(
            "v6_udp_port_unreachable_from_the_backend",
            world6,
            udp.about(backend, client, CLIENT6, DNS6_BACKEND),
            udp.about(DNS6.addr, client, CLIENT6, DNS6),
        ),
        reversed(
            "v6_tcp_packet_too_big_keeps_its_mtu",
            world6,
            too_big.about(WEB6_BACKEND.addr, client, CLIENT6, WEB6_BACKEND),
            too_big.about(WEB6.addr, client, CLIENT6, WEB6),
        ),
        reversed(
            "v6_udp_masqueraded_error_to_the_node",
            masqueraded_world6,
            udp.about(backend, NODE6.addr, NODE6, DNS6_BACKEND),
            udp.about(DNS6.addr, client, CLIENT6, DNS6),
        ),
        reversed(
            "v6_tcp_masqueraded_packet_too_big",
            masqueraded_world6,
            too_big.about(WEB6_BACKEND.addr, NODE6.addr, NODE6, WEB6_BACKEND),
            too_big.about(WEB6.addr, client, CLIENT6, WEB6),
        ),
        reversed(
            "v6_udp_quote_of_8_bytes",
            world6,
            udp_8.about(backend, client, CLIENT6, DNS6_BACKEND),
            udp_8.about(DNS6.addr, client, CLIENT6, DNS6),
        ),
        untouched(
            "v6_error_about_an_untracked_tuple",
            world6,
            udp.about(backend, client, ep6(client, 40001), DNS6_BACKEND),
        ),
        not_an_error("v6_echo_request_to_the_vip", world6, Packet6::icmp6_echo(client, DNS6.addr).build()),
        at_egress(reversed(
            "v6_node_packet_too_big_about_a_request_at_egress",
            world6,
            too_big.about(NODE6_UPLINK, client, CLIENT6, WEB6_BACKEND),
            too_big.about(WEB6.addr, client, CLIENT6, WEB6),
        )),
    ]
}

/// The flows of both families, to see that an error changed none.
fn all_flows(h: &Harness) -> Result<String> {
    let mut v4: Vec<String> = h.raw_flows()?.iter().map(|entry| format!("{entry:?}")).collect();
    v4.sort();
    let mut v6: Vec<String> = flows6(h)?.iter().map(|entry| format!("{entry:?}")).collect();
    v6.sort();
    Ok(format!("{v4:#?}\n{v6:#?}"))
}

fn run_fixture(fixture: &Fixture) -> Result<Outcome> {
    if fixture.error_input {
        check_error_checksums(&fixture.input).map_err(|e| anyhow!("fixture bug: input: {e}"))?;
    }
    // The egress program serves `--bpf-forwarding=stack` only.
    let mut h = if fixture.at_egress { Harness::stack()? } else { Harness::new()? };
    (fixture.setup)(&mut h)?;
    let before = all_flows(&h)?;
    let (verdict, out) =
        if fixture.at_egress { h.run_egress(&fixture.input)? } else { h.run(&fixture.input)? };
    let observed = || input_and_output(&fixture.input, &out);
    check_verdict(&fixture.input, verdict, &out, fixture.verdict, fixture.output.is_none())?;
    match &fixture.output {
        None => {}
        Some(expected) => {
            let checked =
                check_error_checksums(&out).map_err(|e| anyhow!("output: {e}\n  {}", observed()))?;
            compare_errors(expected, &out).map_err(|e| anyhow!("output frame: {e}"))?;
            // A whole quote's TCP/UDP checksum was verified on its own, not only compared.
            let whole = check_error_checksums(expected).map_err(|e| anyhow!("fixture bug: {e}"))?;
            ensure!(checked.quoted_l4_verified == whole.quoted_l4_verified, "quoted checksum not verified");
        }
    }
    let after = all_flows(&h)?;
    ensure!(before == after, "the error changed the flows:\n  before: {before}\n  after: {after}");
    Ok(Outcome::Passed)
}

#[test]
fn icmp_error_fixture_table() {
    let mut fixtures = ipv4_fixtures();
    fixtures.extend(ipv6_fixtures());
    run_table(&fixtures, |fixture| fixture.name, run_fixture);
}
