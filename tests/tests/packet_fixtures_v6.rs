//! Katran-style packet fixtures for vipr's TC program on IPv6, run with BPF_PROG_TEST_RUN: the
//! IPv6 counterpart of `packet_fixtures.rs` and `reject_fixtures.rs`.
//!
//! Each fixture is a setup of the IPv6 maps, an input frame, the expected verdict and the
//! expected output frame (or "unchanged", or the ICMPv6 error built here from the input), plus
//! the exact IPv6 flows map afterwards. Every rewritten frame is also checked by recomputing its
//! TCP/UDP checksum over the IPv6 pseudo header, independently of the expected bytes.
//!
//! Each test runs in a network namespace of its own (unshared by its thread), so the FIB
//! lookups of the program see the same empty routing table on every machine: no route, so a
//! rewritten packet goes on with TC_ACT_OK. The masquerade tests add the one route they need.
//! Needs root (BPF, mount, unshare).

use testbed::fixtures::{frame, frame6, harness, harness6, icmp_error, icmp_quote, netns, table};

use std::collections::{BTreeMap, HashMap};

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use frame::{hex, input_and_output, L4Checksum, Packet, ETH_HLEN, IPPROTO_TCP, IPPROTO_UDP};
use frame6::{
    compare_frames6, ep6, ip6, parse_ipv6, Ep6, Packet6, IPV6_HLEN, NEXTHDR_DEST, NEXTHDR_FRAGMENT,
    NEXTHDR_HOP, NEXTHDR_ROUTING,
};
use harness::{
    check_verdict, describe_flows, is_einval, masqueraded_entries, nat_entries, verdict_name, Harness,
    TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC,
};
use harness6::{
    add_node_ip6, add_pod_cidr6, add_service6, add_source_range6, flows6, insert_flow6, raw_flows6,
    remove_service6, service_key6, set_backend6, set_service6, set_unmatched6,
};
use icmp_error::{check_icmp6_unreachable_answer, icmp6_unreachable_answer};
use icmp_quote::{l4_quote, offload_checksum, offload_fixed_point};
use netns::{in_fresh_netns, ip};
use proxy_common::{
    flow_flags, service_flags, snat, source_class, unmatched, Flow6, FlowKey6, Service, SnatPorts,
};
use table::{run_table, Outcome};

/// TC_ACT_REDIRECT, as BPF_PROG_TEST_RUN reports the program's return.
const TC_ACT_REDIRECT: u32 = 7;

// ---------------------------------------------------------------------------------------------
// The standard world: two frontends on one cluster IP, one frontend without endpoints, the
// service CIDR and the cluster IPs in the unmatched trie.

const CLIENT: Ep6 = ep6(ip6([0x2001, 0xdb8, 1, 0], 0x100), 40000);
const VIP: [u8; 16] = ip6([0xfd00, 0x10, 0x96, 0], 0xa);
const SERVICE_CIDR: [u8; 16] = ip6([0xfd00, 0x10, 0x96, 0], 0);
/// TCP frontend, backend set 1.
const WEB: Ep6 = ep6(VIP, 80);
const WEB_BACKEND: Ep6 = ep6(ip6([0xfd00, 0x10, 0x244, 1], 5), 8080);
const WEB_SET: u32 = 1;
/// UDP frontend, backend set 2.
const DNS: Ep6 = ep6(VIP, 53);
const DNS_BACKEND: Ep6 = ep6(ip6([0xfd00, 0x10, 0x244, 2], 7), 5353);
const DNS_SET: u32 = 2;
/// TCP and UDP frontends of a service without endpoints that asks for REJECT.
const EMPTY_VIP: [u8; 16] = ip6([0xfd00, 0x10, 0x96, 0], 0x14);
const EMPTY: Ep6 = ep6(EMPTY_VIP, 80);
const EMPTY_UDP: Ep6 = ep6(EMPTY_VIP, 53);
const EMPTY_SET: u32 = 3;
/// A frontend without endpoints that does not ask for REJECT (a Local policy elsewhere).
const SILENT: Ep6 = ep6(EMPTY_VIP, 8000);

fn standard_world(h: &Harness) -> Result<()> {
    add_service6(h, WEB, IPPROTO_TCP, source_class::OUTSIDE, WEB_SET, &[WEB_BACKEND], 0)?;
    add_service6(h, DNS, IPPROTO_UDP, source_class::OUTSIDE, DNS_SET, &[DNS_BACKEND], 0)?;
    let reject = service_flags::REJECT_WHEN_EMPTY;
    add_service6(h, EMPTY, IPPROTO_TCP, source_class::OUTSIDE, EMPTY_SET, &[], reject)?;
    add_service6(h, EMPTY_UDP, IPPROTO_UDP, source_class::OUTSIDE, EMPTY_SET, &[], reject)?;
    add_service6(h, SILENT, IPPROTO_TCP, source_class::OUTSIDE, EMPTY_SET, &[], 0)?;
    set_unmatched6(h, 112, SERVICE_CIDR, unmatched::DROP)?;
    set_unmatched6(h, 128, VIP, unmatched::REJECT)?;
    set_unmatched6(h, 128, EMPTY_VIP, unmatched::REJECT)
}

fn packet(proto: u8, from: Ep6, to: Ep6) -> Packet6 {
    match proto {
        IPPROTO_TCP => Packet6::tcp(from, to),
        IPPROTO_UDP => Packet6::udp(from, to),
        other => panic!("no builder for protocol {other}"),
    }
}

/// The node's address toward the pod network in the masquerade tests.
const NODE: [u8; 16] = ip6([0xfd00, 0x10, 0x244, 0], 1);

/// In the current (fresh) namespace: a forwarding node with `NODE` on an interface whose
/// connected route covers the backends, so the program finds a route and a source toward them.
fn route_to_pods() -> Result<()> {
    ip(&["link", "set", "lo", "up"])?;
    // A veth pair: this kernel has no dummy devices.
    ip(&["link", "add", "vd0", "type", "veth", "peer", "name", "vd1"])?;
    ip(&["link", "set", "vd1", "up"])?;
    ip(&["link", "set", "vd0", "up"])?;
    let node = format!("{}/48", std::net::Ipv6Addr::from(NODE));
    ip(&["-6", "addr", "add", &node, "dev", "vd0", "nodad"])?;
    std::fs::write("/proc/sys/net/ipv6/conf/all/forwarding", "1").context("enabling IPv6 forwarding")
}

// ---------------------------------------------------------------------------------------------
// Running one frame and judging the result.

enum Expect<'a> {
    Unchanged,
    Frame(&'a [u8]),
    /// The ICMPv6 port unreachable for the input.
    Unreachable,
}

fn check(h: &Harness, input: &[u8], verdict: u32, expect: Expect<'_>) -> Result<Vec<u8>> {
    if let Ok(view) = parse_ipv6(input) {
        let udp_zero = view.next_header == IPPROTO_UDP && input[view.l4_csum_offset..][..2] == [0, 0];
        ensure!(
            udp_zero || view.l4_checksum == L4Checksum::Valid,
            "fixture bug: input checksum is not valid: {view:?}"
        );
    }
    let (got, out) = h.run(input)?;
    let observed = || input_and_output(input, &out);
    check_verdict(input, got, &out, verdict, matches!(expect, Expect::Unchanged))?;
    match expect {
        Expect::Unchanged => {}
        Expect::Frame(expected) => {
            let want = parse_ipv6(expected).map_err(|e| anyhow!("fixture bug: expected frame: {e}"))?;
            ensure!(want.l4_checksum == L4Checksum::Valid, "fixture bug: expected frame: {want:?}");
            let view = parse_ipv6(&out)
                .map_err(|e| anyhow!("output is not a TCP/UDP IPv6 frame: {e}\n  {}", observed()))?;
            ensure!(
                view.l4_checksum == L4Checksum::Valid,
                "output L4 checksum {:?}\n  {}",
                view.l4_checksum,
                observed()
            );
            compare_frames6(expected, &out).map_err(|e| anyhow!("output frame: {e}"))?;
        }
        Expect::Unreachable => {
            let expected = expected_unreachable(input);
            ensure!(
                out == expected,
                "answer differs from the expected ICMPv6 error\n  expected:{}\n  {}",
                hex(&expected),
                observed()
            );
            check_unreachable_alone(input, &out).with_context(observed)?;
        }
    }
    Ok(out)
}

fn expect_flows(h: &Harness, expected: &[(FlowKey6, Flow6)]) -> Result<()> {
    let expected: HashMap<FlowKey6, Flow6> = expected.iter().copied().collect();
    let actual = flows6(h)?;
    ensure!(
        actual == expected,
        "IPv6 flows map:\n  expected:\n{}\n  actual:\n{}",
        describe_flows(&expected),
        describe_flows(&actual)
    );
    let v4 = h.flows()?;
    ensure!(v4.is_empty(), "an IPv6 packet recorded IPv4 flows: {v4:?}");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The ICMPv6 port unreachable, built from the input alone.

/// Ethernet addresses swapped; IPv6 with traffic class and flow label 0, hop limit 64, from
/// the service address to the client; ICMPv6 type 1 code 4; the quote: the input's IPv6 header
/// and 20 (TCP) or 8 (UDP) bytes of its L4 header, zero-filled, the quoted L4 checksum settled.
fn expected_unreachable(input: &[u8]) -> Vec<u8> {
    let ip = &input[ETH_HLEN..];
    let (l4_len, csum_at) = l4_quote(ip[6]);
    let mut quote = ip[..(IPV6_HLEN + l4_len).min(ip.len())].to_vec();
    quote.resize(IPV6_HLEN + l4_len, 0);
    let settled = offload_fixed_point(&quote[IPV6_HLEN..], csum_at);
    quote[IPV6_HLEN + csum_at..][..2].copy_from_slice(&settled.to_be_bytes());

    icmp6_unreachable_answer(input, &quote)
}

/// What a receiving kernel relies on, without the expected bytes: addresses, the ICMPv6
/// checksum over the pseudo header, the quote, and that a checksum offload changes nothing.
fn check_unreachable_alone(input: &[u8], out: &[u8]) -> Result<()> {
    let icmp = check_icmp6_unreachable_answer(input, out)?;
    let original = &input[ETH_HLEN..];
    let quote = &icmp[8..];
    ensure!(quote[..IPV6_HLEN] == original[..IPV6_HLEN], "quoted IPv6 header differs from the input's");
    let (l4_len, csum_at) = l4_quote(original[6]);
    ensure!(quote.len() == IPV6_HLEN + l4_len, "quote of {} bytes", quote.len());
    let quoted_l4 = &quote[IPV6_HLEN..];
    for (i, byte) in quoted_l4.iter().enumerate().filter(|(i, _)| *i != csum_at && *i != csum_at + 1) {
        let want = original.get(IPV6_HLEN + i).copied().unwrap_or(0);
        ensure!(*byte == want, "quoted L4 byte {i}: {byte:#04x}, input {want:#04x}");
    }
    // A CHECKSUM_PARTIAL skb leaving a device without checksum offload: the field is the
    // checksum of the quoted L4 bytes as they are.
    let c = offload_checksum(quoted_l4);
    ensure!(
        quoted_l4[csum_at..csum_at + 2] == c.to_be_bytes(),
        "a checksum offload would change the quoted checksum to {c:#06x}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The table.

enum Output {
    Unchanged,
    /// Unchanged, if BPF_PROG_TEST_RUN accepts the frame at all (it may refuse an IPv6
    /// ethertype without a whole IPv6 header with EINVAL before the program runs); then the
    /// fixture is reported as skipped, not passed.
    UnchangedIfKernelAccepts,
    Rewritten(Vec<u8>),
    Unreachable,
}

type Setup = Box<dyn Fn(&Harness) -> Result<()> + Send + Sync>;

struct Fixture {
    name: &'static str,
    /// Map state before the packet; the harness starts with empty maps.
    setup: Setup,
    input: Vec<u8>,
    verdict: u32,
    output: Output,
    /// The exact IPv6 flows map after the packet.
    flows: Vec<(FlowKey6, Flow6)>,
}

/// A new connection to `frontend` balanced to `backend`: destination rewritten, both
/// directions recorded.
fn balanced(name: &'static str, input: Packet6, frontend: Ep6, backend: Ep6) -> Fixture {
    let flows = nat_entries(input.source(), frontend, backend, input.proto());
    Fixture {
        name,
        setup: Box::new(standard_world),
        input: input.build(),
        verdict: TC_ACT_OK,
        output: Output::Rewritten(input.to(backend).build()),
        flows,
    }
}

/// A packet of a tracked connection: the flow entries of `client -> frontend` balanced to
/// `backend` exist, and `input` becomes `output`.
fn tracked(
    name: &'static str,
    (client, frontend, backend): (Ep6, Ep6, Ep6),
    input: Packet6,
    output: Packet6,
) -> Fixture {
    let flows = nat_entries(client, frontend, backend, input.proto());
    let tracked = flows.clone();
    Fixture {
        name,
        setup: Box::new(move |h| {
            standard_world(h)?;
            tracked.iter().try_for_each(|(k, v)| insert_flow6(h, *k, *v))
        }),
        input: input.build(),
        verdict: TC_ACT_OK,
        output: Output::Rewritten(output.build()),
        flows,
    }
}

/// A backend that is in no backend set: only a flow entry can send a packet there.
const OTHER_BACKEND: Ep6 = ep6(ip6([0xfd00, 0x10, 0x244, 9], 9), 9090);

fn untouched(name: &'static str, input: Vec<u8>) -> Fixture {
    Fixture {
        name,
        setup: Box::new(standard_world),
        input,
        verdict: TC_ACT_UNSPEC,
        output: Output::Unchanged,
        flows: vec![],
    }
}

fn refusable(name: &'static str, input: Vec<u8>) -> Fixture {
    Fixture { output: Output::UnchangedIfKernelAccepts, ..untouched(name, input) }
}

fn dropped(
    name: &'static str,
    setup: impl Fn(&Harness) -> Result<()> + Send + Sync + 'static,
    input: Vec<u8>,
) -> Fixture {
    Fixture {
        name,
        setup: Box::new(setup),
        input,
        verdict: TC_ACT_SHOT,
        output: Output::Unchanged,
        flows: vec![],
    }
}

fn rejected(name: &'static str, input: Vec<u8>) -> Fixture {
    Fixture {
        name,
        setup: Box::new(standard_world),
        input,
        verdict: TC_ACT_REDIRECT,
        output: Output::Unreachable,
        flows: vec![],
    }
}

fn truncated(packet: Packet6, len: usize) -> Vec<u8> {
    let mut frame = packet.build();
    assert!(len < frame.len());
    frame.truncate(len);
    frame
}

/// A UDP datagram to DNS whose checksum after DNAT to DNS_BACKEND computes to 0, which must go
/// out as 0xffff (in IPv6 a 0 would be invalid). Returns (input, expected output).
fn udp_with_zero_checksum_after_nat() -> (Packet6, Packet6) {
    let out = Packet6::udp(CLIENT, DNS_BACKEND).payload(&[0, 0]);
    let c0 = out.raw_udp_checksum();
    let out = out.payload(&c0.to_be_bytes());
    assert_eq!(out.raw_udp_checksum(), 0, "construction of the zero-checksum datagram");
    (out.clone().to(DNS), out)
}

const SYN: u8 = 0x02;

fn fixtures() -> Vec<Fixture> {
    let (zero_in, zero_out) = udp_with_zero_checksum_after_nat();
    let syn = |to| Packet6::tcp(CLIENT, to).tcp_flags(SYN).payload(&[]);
    let mut tcp_short = Packet6::tcp(CLIENT, EMPTY).build();
    tcp_short.truncate(ETH_HLEN + IPV6_HLEN + 18);
    vec![
        // --- new connections to a cluster IP
        balanced("tcp_hit_rewrites_destination", Packet6::tcp(CLIENT, WEB), WEB, WEB_BACKEND),
        balanced("udp_hit_rewrites_destination", Packet6::udp(CLIENT, DNS), DNS, DNS_BACKEND),
        balanced("tcp_syn_hit", syn(WEB), WEB, WEB_BACKEND),
        balanced(
            "tcp_hit_odd_payload_length",
            Packet6::tcp(CLIENT, WEB).payload(b"odd-len"),
            WEB,
            WEB_BACKEND,
        ),
        balanced("udp_hit_odd_payload_length", Packet6::udp(CLIENT, DNS).payload(b"abc"), DNS, DNS_BACKEND),
        balanced("udp_hit_without_payload", Packet6::udp(CLIENT, DNS).payload(&[]), DNS, DNS_BACKEND),
        Fixture {
            output: Output::Rewritten(zero_out.build()),
            ..balanced("udp_checksum_computing_to_zero_is_sent_as_ffff", zero_in, DNS, DNS_BACKEND)
        },
        // --- tracked connections
        tracked(
            "reply_from_backend_is_reverse_nated_tcp",
            (CLIENT, WEB, WEB_BACKEND),
            Packet6::tcp(WEB_BACKEND, CLIENT),
            Packet6::tcp(WEB, CLIENT),
        ),
        tracked(
            "reply_from_backend_is_reverse_nated_udp",
            (CLIENT, DNS, DNS_BACKEND),
            Packet6::udp(DNS_BACKEND, CLIENT),
            Packet6::udp(DNS, CLIENT),
        ),
        tracked(
            "flow_entry_used_although_service_has_no_backends",
            (CLIENT, EMPTY, OTHER_BACKEND),
            Packet6::tcp(CLIENT, EMPTY),
            Packet6::tcp(CLIENT, OTHER_BACKEND),
        ),
        // --- misses
        untouched(
            "miss_other_address",
            Packet6::tcp(CLIENT, ep6(ip6([0xfd00, 0x10, 0x97, 0], 1), 80)).build(),
        ),
        untouched("miss_udp_to_tcp_frontend_outside_the_trie", {
            let mut packet = Packet6::udp(CLIENT, WEB);
            packet.dst = ip6([0x2001, 0xdb8, 9, 0], 1);
            packet.build()
        }),
        untouched("miss_icmpv6_echo_to_cluster_ip", Packet6::icmp6_echo(CLIENT.addr, VIP).build()),
        untouched("miss_cluster_ip_as_source", Packet6::tcp(WEB, CLIENT).build()),
        untouched("miss_reply_from_backend_without_flow", Packet6::tcp(WEB_BACKEND, CLIENT).build()),
        // --- not IPv6 TCP/UDP as vipr balances it: left to the stack
        untouched("hop_by_hop_header_untouched", Packet6::tcp(CLIENT, WEB).extension(NEXTHDR_HOP).build()),
        untouched("destination_options_untouched", Packet6::udp(CLIENT, DNS).extension(NEXTHDR_DEST).build()),
        untouched("routing_header_untouched", Packet6::tcp(CLIENT, WEB).extension(NEXTHDR_ROUTING).build()),
        untouched("fragment_header_untouched", Packet6::udp(CLIENT, DNS).extension(NEXTHDR_FRAGMENT).build()),
        untouched(
            "two_extension_headers_untouched",
            Packet6::tcp(CLIENT, WEB).extension(NEXTHDR_HOP).extension(NEXTHDR_DEST).build(),
        ),
        untouched("udp_zero_checksum_untouched", Packet6::udp(CLIENT, DNS).no_udp_checksum().build()),
        refusable("truncated_ipv6_header", truncated(Packet6::tcp(CLIENT, WEB), ETH_HLEN + 39)),
        untouched(
            "truncated_tcp_inside_ports",
            truncated(Packet6::tcp(CLIENT, WEB), ETH_HLEN + IPV6_HLEN + 3),
        ),
        untouched(
            "truncated_tcp_before_checksum",
            truncated(Packet6::tcp(CLIENT, WEB), ETH_HLEN + IPV6_HLEN + 17),
        ),
        untouched(
            "truncated_udp_before_checksum",
            truncated(Packet6::udp(CLIENT, DNS), ETH_HLEN + IPV6_HLEN + 7),
        ),
        untouched("ip_version_4_in_ipv6_ethertype", {
            let mut frame = Packet6::tcp(CLIENT, WEB).build();
            frame[ETH_HLEN] = 0x40 | (frame[ETH_HLEN] & 0x0f);
            frame
        }),
        // An IPv4 frame to an address whose bytes begin the IPv6 cluster IP: the IPv4 maps
        // are empty, so nothing happens.
        untouched("ipv4_frame_does_not_meet_the_ipv6_maps", {
            let vip4 = [VIP[0], VIP[1], VIP[2], VIP[3]];
            Packet::tcp(frame::ep([192, 168, 1, 100], 40000), frame::ep(vip4, 80)).build()
        }),
        // --- drops
        dropped("no_backends_is_dropped", standard_world, Packet6::tcp(CLIENT, SILENT).build()),
        dropped(
            "missing_backend_slot_is_dropped",
            |h: &Harness| {
                standard_world(h)?;
                let service =
                    Service { backend_set: 9, backend_count: 1, service_id: 9, ..Service::default() };
                set_service6(h, service_key6(ep6(VIP, 443), IPPROTO_TCP, source_class::OUTSIDE), service)
            },
            Packet6::tcp(CLIENT, ep6(VIP, 443)).build(),
        ),
        dropped(
            "unallocated_service_cidr_address_is_dropped",
            standard_world,
            Packet6::tcp(CLIENT, ep6(ip6([0xfd00, 0x10, 0x96, 0], 0x99), 80)).build(),
        ),
        // --- rejects: ICMPv6 port unreachable back to the client
        rejected("tcp_syn_without_endpoints_is_rejected", syn(EMPTY).build()),
        rejected("tcp_data_without_endpoints_is_rejected", Packet6::tcp(CLIENT, EMPTY).build()),
        rejected("tcp_short_without_endpoints_is_rejected", tcp_short),
        rejected("udp_without_endpoints_is_rejected", Packet6::udp(CLIENT, EMPTY_UDP).build()),
        rejected(
            "udp_large_without_endpoints_is_rejected",
            Packet6::udp(CLIENT, EMPTY_UDP).payload(&[0xa5; 1200]).build(),
        ),
        rejected("tcp_to_unserved_port_of_cluster_ip_is_rejected", syn(ep6(VIP, 9999)).build()),
        rejected(
            "udp_to_unserved_port_of_cluster_ip_is_rejected",
            Packet6::udp(CLIENT, ep6(VIP, 9999)).build(),
        ),
        // A TCP frontend on port 53 does not exist: UDP's does, TCP's is unserved.
        rejected("tcp_to_udp_frontend_is_rejected", Packet6::tcp(CLIENT, DNS).build()),
    ]
}

fn run_fixture(fixture: &Fixture) -> Result<Outcome> {
    let h = Harness::new()?;
    (fixture.setup)(&h).context("setup")?;
    let expect = match &fixture.output {
        Output::Unchanged | Output::UnchangedIfKernelAccepts => Expect::Unchanged,
        Output::Rewritten(frame) => Expect::Frame(frame),
        Output::Unreachable => Expect::Unreachable,
    };
    if let Err(err) = check(&h, &fixture.input, fixture.verdict, expect) {
        if matches!(fixture.output, Output::UnchangedIfKernelAccepts) && is_einval(&err) {
            expect_flows(&h, &fixture.flows)?;
            return Ok(Outcome::Skipped("BPF_PROG_TEST_RUN refuses this frame (EINVAL) on this kernel"));
        }
        return Err(err);
    }
    expect_flows(&h, &fixture.flows)?;
    Ok(Outcome::Passed)
}

#[test]
fn fixture_table() {
    let fixtures = fixtures();
    // A failing table panics on the namespace's thread, after printing every failure.
    in_fresh_netns(|| {
        run_table(&fixtures, |fixture| fixture.name, run_fixture);
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

// ---------------------------------------------------------------------------------------------
// Source classes and source ranges.

const NODE_SOURCE: Ep6 = ep6(ip6([0x2001, 0xdb8, 0, 0], 1), 41000);
const POD_SOURCE: Ep6 = ep6(ip6([0xfd00, 0x10, 0x244, 7], 9), 42000);

/// One frontend with a different backend per source class: the node's address, a source in
/// the pod CIDR and anything else each get their own.
#[test]
fn source_classes_choose_their_own_entries() {
    in_fresh_netns(|| {
        let h = Harness::new()?;
        standard_world(&h)?;
        let (pod_backend, node_backend) =
            (ep6(ip6([0xfd00, 0x10, 0x244, 3], 3), 80), ep6(ip6([0xfd00, 0x10, 0x244, 4], 4), 80));
        add_service6(&h, WEB, IPPROTO_TCP, source_class::POD, 11, &[pod_backend], 0)?;
        add_service6(&h, WEB, IPPROTO_TCP, source_class::NODE, 12, &[node_backend], 0)?;
        add_node_ip6(&h, NODE_SOURCE.addr)?;
        add_pod_cidr6(&h, 48, ip6([0xfd00, 0x10, 0x244, 0], 0))?;
        let mut flows = Vec::new();
        for (source, backend) in
            [(CLIENT, WEB_BACKEND), (POD_SOURCE, pod_backend), (NODE_SOURCE, node_backend)]
        {
            let input = Packet6::tcp(source, WEB);
            check(&h, &input.build(), TC_ACT_OK, Expect::Frame(&input.clone().to(backend).build()))
                .with_context(|| format!("from {source}"))?;
            flows.extend(nat_entries(source, WEB, backend, IPPROTO_TCP));
        }
        expect_flows(&h, &flows)?;
        // Only the outside client's forward entry says it came from outside: XDP finishes that
        // connection's later packets, and leaves a pod's or the node's (partial checksums) to TC.
        let raw = raw_flows6(&h)?;
        for (key, flow) in &raw {
            let outside = flow.flags & flow_flags::FROM_OUTSIDE != 0;
            let expected = flow.flags & flow_flags::REPLY == 0 && key.src_addr == CLIENT.addr;
            ensure!(outside == expected, "{key:?}: FROM_OUTSIDE {outside}, expected {expected}");
        }
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// A frontend with SOURCE_RANGES admits the sources in its ranges (longest prefix, under its
/// own service id) and drops the rest; another service's ranges do not count.
#[test]
fn source_ranges_admit_or_drop() {
    in_fresh_netns(|| {
        let h = Harness::new()?;
        standard_world(&h)?;
        let lb = ep6(ip6([0x2001, 0xdb8, 0xffff, 0], 0x10), 443);
        add_service6(
            &h,
            lb,
            IPPROTO_TCP,
            source_class::OUTSIDE,
            20,
            &[WEB_BACKEND],
            service_flags::SOURCE_RANGES,
        )?;
        // Service id 1020 admits 2001:db8:1::/64; id 1021 (another service) admits 2001:db8:2::/64.
        add_source_range6(&h, 1020, 64, ip6([0x2001, 0xdb8, 1, 0], 0))?;
        add_source_range6(&h, 1021, 64, ip6([0x2001, 0xdb8, 2, 0], 0))?;
        let admitted = Packet6::tcp(CLIENT, lb);
        check(&h, &admitted.build(), TC_ACT_OK, Expect::Frame(&admitted.clone().to(WEB_BACKEND).build()))
            .context("source inside the range")?;
        for outside in
            [ep6(ip6([0x2001, 0xdb8, 2, 0], 0x100), 40000), ep6(ip6([0x2001, 0xdb9, 1, 0], 0x100), 40000)]
        {
            check(&h, &Packet6::tcp(outside, lb).build(), TC_ACT_SHOT, Expect::Unchanged)
                .with_context(|| format!("source {outside} outside the range"))?;
        }
        expect_flows(&h, &nat_entries(CLIENT, lb, WEB_BACKEND, IPPROTO_TCP))
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

// ---------------------------------------------------------------------------------------------
// Masquerade and hairpin, with a route toward the backends.

const MASQUERADED: Ep6 = ep6(ip6([0xfd00, 0x10, 0x96, 0], 0x1e), 80);

/// The masquerade range of the harness's program: `vipr_snat_v1`, as the agent writes it.
fn set_snat_ports(h: &Harness, first: u32, count: u32) -> Result<()> {
    let path = h.bpffs().join(snat::PORTS);
    let data = aya::maps::MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    let mut map: aya::maps::Array<_, SnatPorts> = aya::maps::Map::from_map_data(data)?.try_into()?;
    map.set(0, SnatPorts { first, count }, 0)?;
    Ok(())
}

/// Runs a new masqueraded connection's first packet from `client`; the node side it got.
fn masqueraded(h: &Harness, client: Ep6) -> Result<Ep6> {
    let input = Packet6::tcp(client, MASQUERADED);
    let (verdict, out) = h.run(&input.build())?;
    ensure!(verdict == TC_ACT_REDIRECT, "{client}: verdict {}", verdict_name(verdict));
    let view = parse_ipv6(&out).map_err(|e| anyhow!("{client}: {e}{}", hex(&out)))?;
    ensure!(view.l4_checksum == L4Checksum::Valid, "{client}: checksum {:?}", view.l4_checksum);
    ensure!(view.src == NODE && view.destination() == WEB_BACKEND, "{client}: {:?}", view);
    let expected = input.to(WEB_BACKEND).from(view.source());
    compare_frames6(&expected.build(), &out).map_err(|e| anyhow!("{client}: {e}"))?;
    Ok(view.source())
}

/// A MASQUERADE frontend: the source becomes the node's address toward the backend (the FIB's
/// preferred source) on a port of the masquerade range, the client's own when it is in the
/// range and free; replies to the node come back as from the frontend to the client. The
/// packet is redirected to the route's interface.
#[test]
fn masquerade_takes_the_route_source_and_claims_ports() {
    in_fresh_netns(|| {
        route_to_pods()?;
        let h = Harness::new()?;
        standard_world(&h)?;
        add_service6(
            &h,
            MASQUERADED,
            IPPROTO_TCP,
            source_class::OUTSIDE,
            30,
            &[WEB_BACKEND],
            service_flags::MASQUERADE,
        )?;
        // No range written yet: the default one, below Linux's ephemeral ports. The client's
        // port (40000) is an ephemeral one, which a node socket to the same backend could take
        // too: it is not kept.
        let default_range = snat::DEFAULT_FIRST..snat::DEFAULT_FIRST + snat::DEFAULT_COUNT;
        let node_side = masqueraded(&h, CLIENT).context("first client")?;
        ensure!(
            default_range.contains(&node_side.port.into()),
            "first client got node port {}",
            node_side.port
        );
        let mut flows = masqueraded_entries(CLIENT, MASQUERADED, WEB_BACKEND, node_side, IPPROTO_TCP);
        expect_flows(&h, &flows)?;

        // A client port inside the range is kept while it is free; another client on the same
        // port toward this backend gets another one.
        let in_range = ep6(ip6([0x2001, 0xdb8, 1, 0], 0x200), 20000);
        let other = ep6(ip6([0x2001, 0xdb8, 1, 0], 0x300), in_range.port);
        let kept = masqueraded(&h, in_range).context("client in the range")?;
        ensure!(kept == ep6(NODE, in_range.port), "the client's port was not kept: {kept}");
        let moved = masqueraded(&h, other).context("second client on that port")?;
        ensure!(
            moved.port != in_range.port && default_range.contains(&moved.port.into()),
            "second client got node port {}",
            moved.port
        );
        for (client, node) in [(in_range, kept), (other, moved)] {
            flows.extend(masqueraded_entries(client, MASQUERADED, WEB_BACKEND, node, IPPROTO_TCP));
        }
        expect_flows(&h, &flows)?;

        // The backend's replies go back to each client, as from the frontend. There is no route
        // toward the clients here, so the stack gets them.
        for (client, node) in [(CLIENT, node_side), (in_range, kept), (other, moved)] {
            let reply = Packet6::tcp(WEB_BACKEND, node).payload(b"HTTP/1.1 200 OK\r\n\r\n");
            let expected = reply.clone().from(MASQUERADED).to(client);
            check(&h, &reply.build(), TC_ACT_OK, Expect::Frame(&expected.build()))
                .with_context(|| format!("reply to {client}"))?;
        }
        expect_flows(&h, &flows)?;

        // The agent's range is used as written: with one port, the first client keeps it and a
        // second finds nothing free (dropped; its retransmission tries again).
        set_snat_ports(&h, 50000, 1)?;
        let only = ep6(ip6([0x2001, 0xdb8, 2, 0], 0x100), 40001);
        ensure!(masqueraded(&h, only)? == ep6(NODE, 50000), "not the range's only port");
        let crowded = ep6(ip6([0x2001, 0xdb8, 2, 0], 0x200), 50000);
        check(&h, &Packet6::tcp(crowded, MASQUERADED).build(), TC_ACT_SHOT, Expect::Unchanged)
            .context("no port left")
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// A pod reaching itself through its service is masqueraded although the frontend does not
/// ask for it, or it would answer itself directly.
#[test]
fn hairpin_is_masqueraded() {
    in_fresh_netns(|| {
        route_to_pods()?;
        let h = Harness::new()?;
        standard_world(&h)?;
        // A port of the masquerade range, so that the pod keeps it (see above).
        let pod = ep6(WEB_BACKEND.addr, 23000);
        let input = Packet6::udp(pod, ep6(VIP, 8080)).payload(b"to myself");
        add_service6(&h, ep6(VIP, 8080), IPPROTO_UDP, source_class::OUTSIDE, 40, &[WEB_BACKEND], 0)?;
        let node_side = ep6(NODE, pod.port);
        let expected = input.clone().to(WEB_BACKEND).from(node_side);
        check(&h, &input.build(), TC_ACT_REDIRECT, Expect::Frame(&expected.build()))?;
        expect_flows(&h, &masqueraded_entries(pod, ep6(VIP, 8080), WEB_BACKEND, node_side, IPPROTO_UDP))
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

// ---------------------------------------------------------------------------------------------
// `--bpf-forwarding=stack` (the agent's default): a packet the node forwards goes back into the
// stack with the NAT's ingress half, so that routing and netfilter's FORWARD see client ->
// backend and backend -> client; the egress program completes it.

/// Forward packets are DNATed and handed to the stack (`TC_ACT_OK`, not redirected); their
/// reply crosses the stack as backend -> client and the egress program gives it the frontend's
/// source. A masqueraded connection is rewritten whole and redirected in both directions, as
/// with `--bpf-forwarding=redirect` (its egress half is not done yet).
#[test]
fn stack_forwarding_dnats_at_ingress_and_restores_the_frontend_at_egress() {
    in_fresh_netns(|| {
        route_to_pods()?;
        // Clients are routed too, so that replies are forwarded packets as well.
        ip(&["-6", "route", "add", "2001:db8::/32", "dev", "vd0"])?;
        let h = Harness::stack()?;
        standard_world(&h)?;
        add_service6(
            &h,
            MASQUERADED,
            IPPROTO_TCP,
            source_class::OUTSIDE,
            30,
            &[WEB_BACKEND],
            service_flags::MASQUERADE,
        )?;
        let plain = Packet6::tcp(CLIENT, WEB);
        check(&h, &plain.build(), TC_ACT_OK, Expect::Frame(&plain.clone().to(WEB_BACKEND).build()))
            .context("DNAT toward the backend")?;
        let reply = Packet6::tcp(WEB_BACKEND, CLIENT).payload(b"HTTP/1.1 200 OK\r\n\r\n");
        check(&h, &reply.build(), TC_ACT_UNSPEC, Expect::Unchanged).context("reply at ingress")?;
        let (verdict, out) = h.run_egress(&reply.build())?;
        ensure!(verdict == TC_ACT_OK, "reply at egress: verdict {}", verdict_name(verdict));
        compare_frames6(&reply.clone().from(WEB).build(), &out)
            .map_err(|e| anyhow!("reply at egress: {e}"))?;
        // The forward packet after DNAT is no reply: egress leaves it alone.
        let dnated = plain.clone().to(WEB_BACKEND).build();
        ensure!(h.run_egress(&dnated)? == (TC_ACT_UNSPEC, dnated.clone()), "DNATed packet at egress");

        // A client port of the masquerade range is kept as the node's port.
        let client = ep6(ip6([0x2001, 0xdb8, 1, 0], 0x200), 20000);
        let node_side = ep6(NODE, client.port);
        let masqueraded = Packet6::tcp(client, MASQUERADED);
        let expected = masqueraded.clone().to(WEB_BACKEND).from(node_side);
        check(&h, &masqueraded.build(), TC_ACT_REDIRECT, Expect::Frame(&expected.build()))
            .context("masqueraded: rewritten whole")?;
        let mut flows = nat_entries(CLIENT, WEB, WEB_BACKEND, IPPROTO_TCP);
        flows.extend(masqueraded_entries(client, MASQUERADED, WEB_BACKEND, node_side, IPPROTO_TCP));
        expect_flows(&h, &flows)?;
        let reply = Packet6::tcp(WEB_BACKEND, node_side);
        check(
            &h,
            &reply.build(),
            TC_ACT_REDIRECT,
            Expect::Frame(&reply.clone().from(MASQUERADED).to(client).build()),
        )
        .context("masqueraded reply: rewritten whole")?;
        // Nothing left for egress: the reply already has the frontend as source.
        let rewritten = reply.clone().from(MASQUERADED).to(client).build();
        ensure!(
            h.run_egress(&rewritten)? == (TC_ACT_UNSPEC, rewritten.clone()),
            "masqueraded reply at egress"
        );
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// With `--bpf-forwarding=redirect` the egress program does nothing: ingress rewrote whole.
#[test]
fn the_egress_program_is_idle_when_redirecting() {
    in_fresh_netns(|| {
        let h = Harness::new()?;
        standard_world(&h)?;
        check(
            &h,
            &Packet6::tcp(CLIENT, WEB).build(),
            TC_ACT_OK,
            Expect::Frame(&Packet6::tcp(CLIENT, WEB).to(WEB_BACKEND).build()),
        )?;
        let reply = Packet6::tcp(WEB_BACKEND, CLIENT).build();
        ensure!(h.run_egress(&reply)? == (TC_ACT_UNSPEC, reply.clone()), "reply at egress while redirecting");
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

// ---------------------------------------------------------------------------------------------
// Connection lifecycles and spread.

/// First packet balanced and tracked; later packets follow the flow entry whatever happens to
/// the service; replies are reverse-NATed; a crossed reply is not.
fn flow_lifecycle(proto: u8) -> Result<()> {
    let (front, backend_a, set) = match proto {
        IPPROTO_TCP => (WEB, WEB_BACKEND, WEB_SET),
        _ => (DNS, DNS_BACKEND, DNS_SET),
    };
    let backend_b = ep6(ip6([0xfd00, 0x10, 0x244, 7], 7), backend_a.port + 1);
    let client2 = ep6(CLIENT.addr, CLIENT.port + 1);
    let h = Harness::new()?;
    standard_world(&h)?;

    let first = packet(proto, CLIENT, front);
    check(&h, &first.build(), TC_ACT_OK, Expect::Frame(&first.clone().to(backend_a).build()))
        .context("first")?;
    let mut flows = nat_entries(CLIENT, front, backend_a, proto);

    set_backend6(&h, set, 0, backend_b)?;
    let second = packet(proto, CLIENT, front).payload(b"second packet of the flow");
    check(&h, &second.build(), TC_ACT_OK, Expect::Frame(&second.clone().to(backend_a).build()))
        .context("second packet after the backend changed")?;
    let other = packet(proto, client2, front);
    check(&h, &other.build(), TC_ACT_OK, Expect::Frame(&other.clone().to(backend_b).build()))
        .context("new flow after the backend changed")?;
    flows.extend(nat_entries(client2, front, backend_b, proto));
    expect_flows(&h, &flows)?;

    remove_service6(&h, service_key6(front, proto, source_class::OUTSIDE))?;
    let third = packet(proto, CLIENT, front).payload(b"third");
    check(&h, &third.build(), TC_ACT_OK, Expect::Frame(&third.clone().to(backend_a).build()))
        .context("tracked flow after the service was removed")?;

    let reply = packet(proto, backend_a, CLIENT).payload(b"HTTP/1.1 200 OK\r\n\r\n");
    check(&h, &reply.build(), TC_ACT_OK, Expect::Frame(&reply.clone().from(front).build()))
        .context("reply A")?;
    let reply = packet(proto, backend_b, client2);
    check(&h, &reply.build(), TC_ACT_OK, Expect::Frame(&reply.clone().from(front).build()))
        .context("reply B")?;
    check(&h, &packet(proto, backend_a, client2).build(), TC_ACT_UNSPEC, Expect::Unchanged)
        .context("crossed reply")?;
    expect_flows(&h, &flows)
}

#[test]
fn tcp_flow_lifecycle() {
    in_fresh_netns(|| flow_lifecycle(IPPROTO_TCP)).unwrap_or_else(|err| panic!("{err:#}"));
}

#[test]
fn udp_flow_lifecycle() {
    in_fresh_netns(|| flow_lifecycle(IPPROTO_UDP)).unwrap_or_else(|err| panic!("{err:#}"));
}

/// 300 new flows to a service with three backends reach all three and nothing else, roughly
/// evenly, each tracked to the backend its packet went to.
#[test]
fn random_spread_over_three_backends() {
    in_fresh_netns(|| {
        const FLOWS: u16 = 300;
        let front = ep6(VIP, 443);
        let backends = [1, 2, 3].map(|i| ep6(ip6([0xfd00, 0x10, 0x244, 3], i), 8442 + i));
        let h = Harness::new()?;
        standard_world(&h)?;
        add_service6(&h, front, IPPROTO_TCP, source_class::OUTSIDE, 5, &backends, 0)?;
        let mut hits: BTreeMap<Ep6, u32> = backends.iter().map(|b| (*b, 0)).collect();
        let mut expected = Vec::new();
        for i in 0..FLOWS {
            let client = ep6(CLIENT.addr, 20000 + i);
            let input = Packet6::tcp(client, front);
            let (verdict, out) = h.run(&input.build())?;
            ensure!(verdict == TC_ACT_OK, "flow {client}: verdict {}", verdict_name(verdict));
            let view = parse_ipv6(&out).map_err(|e| anyhow!("flow {client}: {e}{}", hex(&out)))?;
            let backend = view.destination();
            let Some(count) = hits.get_mut(&backend) else {
                bail!("flow {client} went to {backend}, not a backend of {front}");
            };
            *count += 1;
            compare_frames6(&input.to(backend).build(), &out).map_err(|e| anyhow!("flow {client}: {e}"))?;
            expected.extend(nat_entries(client, front, backend, IPPROTO_TCP));
        }
        println!("hits per backend: {hits:?}");
        for (backend, count) in &hits {
            ensure!(*count >= 50, "backend {backend} got {count} of {FLOWS} flows: {hits:?}");
        }
        expect_flows(&h, &expected)
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

// ---------------------------------------------------------------------------------------------
// The checks themselves.

/// The IPv6 frame checks notice damage: a flipped bit anywhere in the addresses or the L4
/// part fails the pseudo-header checksum, and the ICMPv6 answer checks notice a damaged answer.
#[test]
fn checks_can_fail() {
    for frame in [Packet6::tcp(CLIENT, WEB).build(), Packet6::udp(CLIENT, DNS).payload(b"odd").build()] {
        let view = parse_ipv6(&frame).expect("built frame parses");
        assert_eq!(view.l4_checksum, L4Checksum::Valid, "{view:?}");
        for i in ETH_HLEN + 8..frame.len() {
            let mut damaged = frame.clone();
            damaged[i] ^= 0x01;
            if let Ok(view) = parse_ipv6(&damaged) {
                assert_ne!(view.l4_checksum, L4Checksum::Valid, "flipping a bit of byte {i} went unnoticed");
            }
            assert!(compare_frames6(&frame, &damaged).is_err(), "compare_frames6 missed byte {i}");
        }
    }
    // A zero UDP checksum is invalid in IPv6.
    let zero = Packet6::udp(CLIENT, DNS).no_udp_checksum().build();
    assert!(matches!(parse_ipv6(&zero).unwrap().l4_checksum, L4Checksum::Invalid { stored: 0, .. }));

    let input = Packet6::tcp(CLIENT, EMPTY).tcp_flags(SYN).payload(&[]).build();
    let answer = expected_unreachable(&input);
    check_unreachable_alone(&input, &answer).expect("the expected answer passes its own checks");
    for i in 0..answer.len() {
        let mut damaged = answer.clone();
        damaged[i] ^= 0x01;
        assert!(
            check_unreachable_alone(&input, &damaged).is_err(),
            "flipping a bit of byte {i} went unnoticed"
        );
    }
}
