//! Katran-style packet fixtures for vipr's TC program, run with BPF_PROG_TEST_RUN.
//!
//! Each fixture is a map setup, an input frame, the expected verdict and the expected output
//! frame (or "unchanged"), plus the exact flows map afterwards. Every rewritten frame is also
//! checked by recomputing its IPv4 header checksum and its TCP/UDP checksum over the pseudo
//! header, independently of the expected bytes. BPF_PROG_TEST_RUN builds an skb without
//! CHECKSUM_PARTIAL, so the checksums here are full checksums.
//!
//! Every harness loads its own copy of the object with its maps pinned in a private bpffs
//! mounted on a unique temp directory, so the tests run in parallel and leave nothing behind.
//! Needs root (BPF and mount).

use testbed::fixtures::{frame, harness, table};

use std::collections::{BTreeMap, HashMap};

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use frame::{
    arp_request_frame, checksum, compare_frames, ep, hex, input_and_output, ipv6_tcp_frame, max_ip_options,
    ones_sum, parse_ipv4, Ep, L4Checksum, Packet, ETH_HLEN, IPPROTO_TCP, IPPROTO_UDP, IP_DF, IP_MF,
    ROUTER_ALERT,
};
use harness::{
    check_verdict, describe_flows, flow_key, is_einval, nat_entries, verdict_name, Harness, TC_ACT_OK,
    TC_ACT_SHOT, TC_ACT_UNSPEC,
};
use proxy_common::{capacity, datapath_stat, flow_state, pins, Counters, Flow4, FlowKey4, FlowTrack};
use table::{run_table, Outcome};

// ---------------------------------------------------------------------------------------------
// The standard world: two frontends on one VIP, one frontend without endpoints.

const CLIENT: Ep = ep([192, 168, 1, 100], 40000);
const VIP: [u8; 4] = [10, 96, 0, 10];
/// TCP frontend, backend set 1.
const WEB: Ep = ep(VIP, 80);
const WEB_BACKEND: Ep = ep([10, 244, 1, 5], 8080);
const WEB_SET: u32 = 1;
/// UDP frontend, backend set 2.
const DNS: Ep = ep(VIP, 53);
const DNS_BACKEND: Ep = ep([10, 244, 2, 7], 5353);
const DNS_SET: u32 = 2;
/// TCP frontend whose service has no usable endpoint (backend_count 0).
const EMPTY: Ep = ep([10, 96, 0, 20], 80);
const EMPTY_SET: u32 = 3;

fn standard_world(h: &mut Harness) -> Result<()> {
    h.add_service(WEB, IPPROTO_TCP, WEB_SET, &[WEB_BACKEND])?;
    h.add_service(DNS, IPPROTO_UDP, DNS_SET, &[DNS_BACKEND])?;
    h.add_service(EMPTY, IPPROTO_TCP, EMPTY_SET, &[])
}

fn packet(proto: u8, from: Ep, to: Ep) -> Packet {
    match proto {
        IPPROTO_TCP => Packet::tcp(from, to),
        IPPROTO_UDP => Packet::udp(from, to),
        other => panic!("no builder for protocol {other}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Running one frame and judging the result.

enum Expect<'a> {
    /// The program must not touch the frame.
    Unchanged,
    /// The program must turn the frame into this one.
    Frame(&'a [u8]),
}

/// Runs `input`, checks verdict and output, returns the output frame.
fn check(h: &Harness, input: &[u8], verdict: u32, expect: Expect<'_>) -> Result<Vec<u8>> {
    // Guard against fixture mistakes: whatever parses as a full IPv4 TCP/UDP frame must be
    // valid on the way in.
    if let Ok(view) = parse_ipv4(input) {
        ensure!(
            view.ip_checksum_valid && !matches!(view.l4_checksum, L4Checksum::Invalid { .. }),
            "fixture bug: input checksums are not valid: {view:?}"
        );
    }
    let (got, out) = h.run(input)?;
    let observed = || input_and_output(input, &out);
    check_verdict(input, got, &out, verdict, matches!(expect, Expect::Unchanged))?;
    match expect {
        Expect::Unchanged => {}
        Expect::Frame(expected) => {
            let want = parse_ipv4(expected).map_err(|e| anyhow!("fixture bug: expected frame: {e}"))?;
            ensure!(
                want.ip_checksum_valid && matches!(want.l4_checksum, L4Checksum::Valid | L4Checksum::Absent),
                "fixture bug: expected frame has bad checksums: {want:?}"
            );
            let view = parse_ipv4(&out)
                .map_err(|e| anyhow!("output is not a TCP/UDP IPv4 frame: {e}\n  {}", observed()))?;
            ensure!(view.ip_checksum_valid, "output IPv4 header checksum is wrong\n  {}", observed());
            ensure!(
                view.l4_checksum == want.l4_checksum,
                "output L4 checksum: expected {:?}, found {:?}\n  {}",
                want.l4_checksum,
                view.l4_checksum,
                observed()
            );
            compare_frames(expected, &out)
                .map_err(|e| anyhow!("output frame: {e}\n  verdict {}", verdict_name(got)))?;
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// The table.

enum Output {
    Unchanged,
    /// Unchanged, if BPF_PROG_TEST_RUN accepts the frame at all: kernels carrying the 2026
    /// fix of fa5cb548ced6 (syzbot 619b9ef527f510a57cfc), this one included, refuse an IPv4
    /// ethertype with less than 20 bytes of IPv4 header with EINVAL before the program runs.
    /// Then the fixture is reported as skipped, not passed.
    UnchangedIfKernelAccepts,
    Rewritten(Vec<u8>),
}

struct Fixture {
    name: &'static str,
    /// Map state before the packet; the harness starts with empty maps.
    setup: fn(&mut Harness) -> Result<()>,
    input: Vec<u8>,
    verdict: u32,
    output: Output,
    /// The exact flows map after the packet.
    flows: Vec<(FlowKey4, Flow4)>,
}

fn rewritten(name: &'static str, input: &Packet, output: &Packet, flows: Vec<(FlowKey4, Flow4)>) -> Fixture {
    Fixture {
        name,
        setup: standard_world,
        input: input.build(),
        verdict: TC_ACT_OK,
        output: Output::Rewritten(output.build()),
        flows,
    }
}

/// A new connection to `frontend` balanced to `backend`: destination rewritten, both
/// directions recorded.
fn balanced(name: &'static str, input: Packet, frontend: Ep, backend: Ep) -> Fixture {
    let client = Ep { addr: input.src, port: source_port(&input) };
    let flows = nat_entries(client, frontend, backend, input.proto());
    let output = input.clone().to(backend);
    rewritten(name, &input, &output, flows)
}

fn source_port(packet: &Packet) -> u16 {
    match packet.l4 {
        frame::L4::Tcp { sport, .. } | frame::L4::Udp { sport, .. } => sport,
        frame::L4::Other { .. } => 0,
    }
}

/// A frame the program must not touch (TC_ACT_UNSPEC, nothing recorded).
fn untouched(name: &'static str, input: Vec<u8>) -> Fixture {
    Fixture {
        name,
        setup: standard_world,
        input,
        verdict: TC_ACT_UNSPEC,
        output: Output::Unchanged,
        flows: vec![],
    }
}

/// Like [`untouched`], for frames the kernel's test runner may refuse to run at all.
fn refusable(name: &'static str, input: Vec<u8>) -> Fixture {
    Fixture { output: Output::UnchangedIfKernelAccepts, ..untouched(name, input) }
}

fn truncated(packet: Packet, len: usize) -> Vec<u8> {
    let mut frame = packet.build();
    assert!(len < frame.len());
    frame.truncate(len);
    frame
}

/// A UDP datagram to DNS whose checksum after DNAT to DNS_BACKEND computes to 0, which must go
/// out as 0xffff (0 would mean "no checksum"). Returns (input, expected output).
fn udp_with_zero_checksum_after_nat() -> (Packet, Packet) {
    let out = Packet::udp(CLIENT, DNS_BACKEND).payload(&[0, 0]);
    // One payload word w: the raw checksum is !(S + w); choosing w = !S makes it 0.
    let c0 = out.raw_udp_checksum().expect("UDP");
    let out = out.payload(&c0.to_be_bytes());
    assert_eq!(out.raw_udp_checksum(), Some(0), "construction of the zero-checksum datagram");
    let input = out.clone().to(DNS);
    (input, out)
}

fn fixtures() -> Vec<Fixture> {
    let (zero_in, zero_out) = udp_with_zero_checksum_after_nat();
    let other_backend = ep([10, 244, 9, 9], 9090);
    vec![
        // --- new connections to a VIP
        balanced("tcp_vip_hit_rewrites_destination", Packet::tcp(CLIENT, WEB), WEB, WEB_BACKEND),
        balanced("udp_vip_hit_rewrites_destination", Packet::udp(CLIENT, DNS), DNS, DNS_BACKEND),
        balanced(
            "tcp_vip_hit_odd_payload_length",
            Packet::tcp(CLIENT, WEB).payload(b"odd-len"),
            WEB,
            WEB_BACKEND,
        ),
        balanced("tcp_vip_hit_without_payload", Packet::tcp(CLIENT, WEB).payload(&[]), WEB, WEB_BACKEND),
        balanced(
            "udp_vip_hit_odd_payload_length",
            Packet::udp(CLIENT, DNS).payload(b"abc"),
            DNS,
            DNS_BACKEND,
        ),
        balanced("tcp_vip_hit_without_df", Packet::tcp(CLIENT, WEB).frag(0), WEB, WEB_BACKEND),
        balanced(
            "udp_zero_checksum_stays_zero",
            Packet::udp(CLIENT, DNS).no_udp_checksum(),
            DNS,
            DNS_BACKEND,
        ),
        rewritten(
            "udp_checksum_computing_to_zero_is_sent_as_ffff",
            &zero_in,
            &zero_out,
            nat_entries(CLIENT, DNS, DNS_BACKEND, IPPROTO_UDP),
        ),
        balanced(
            "udp_vip_hit_with_ethernet_padding",
            Packet::udp(CLIENT, DNS).payload(b"x").pad_to_ethernet_minimum(),
            DNS,
            DNS_BACKEND,
        ),
        balanced(
            "tcp_vip_hit_ipv4_options_ihl6",
            Packet::tcp(CLIENT, WEB).ip_options(&ROUTER_ALERT),
            WEB,
            WEB_BACKEND,
        ),
        balanced(
            "udp_vip_hit_ipv4_options_ihl6",
            Packet::udp(CLIENT, DNS).ip_options(&ROUTER_ALERT),
            DNS,
            DNS_BACKEND,
        ),
        balanced(
            "tcp_vip_hit_ipv4_options_ihl15",
            Packet::tcp(CLIENT, WEB).ip_options(&max_ip_options()),
            WEB,
            WEB_BACKEND,
        ),
        // --- tracked flows
        Fixture {
            name: "reply_from_backend_is_reverse_nated_tcp",
            setup: |h| {
                standard_world(h)?;
                nat_entries(CLIENT, WEB, WEB_BACKEND, IPPROTO_TCP)
                    .into_iter()
                    .try_for_each(|(k, v)| h.insert_flow(k, v))
            },
            input: Packet::tcp(WEB_BACKEND, CLIENT).build(),
            verdict: TC_ACT_OK,
            output: Output::Rewritten(Packet::tcp(WEB, CLIENT).build()),
            flows: nat_entries(CLIENT, WEB, WEB_BACKEND, IPPROTO_TCP),
        },
        Fixture {
            name: "reply_from_backend_is_reverse_nated_udp",
            setup: |h| {
                standard_world(h)?;
                nat_entries(CLIENT, DNS, DNS_BACKEND, IPPROTO_UDP)
                    .into_iter()
                    .try_for_each(|(k, v)| h.insert_flow(k, v))
            },
            input: Packet::udp(DNS_BACKEND, CLIENT).build(),
            verdict: TC_ACT_OK,
            output: Output::Rewritten(Packet::udp(DNS, CLIENT).build()),
            flows: nat_entries(CLIENT, DNS, DNS_BACKEND, IPPROTO_UDP),
        },
        Fixture {
            name: "reply_from_backend_is_reverse_nated_ihl6",
            setup: |h| {
                standard_world(h)?;
                nat_entries(CLIENT, WEB, WEB_BACKEND, IPPROTO_TCP)
                    .into_iter()
                    .try_for_each(|(k, v)| h.insert_flow(k, v))
            },
            input: Packet::tcp(WEB_BACKEND, CLIENT).ip_options(&ROUTER_ALERT).build(),
            verdict: TC_ACT_OK,
            output: Output::Rewritten(Packet::tcp(WEB, CLIENT).ip_options(&ROUTER_ALERT).build()),
            flows: nat_entries(CLIENT, WEB, WEB_BACKEND, IPPROTO_TCP),
        },
        Fixture {
            name: "reply_from_backend_udp_zero_checksum_stays_zero",
            setup: |h| {
                standard_world(h)?;
                nat_entries(CLIENT, DNS, DNS_BACKEND, IPPROTO_UDP)
                    .into_iter()
                    .try_for_each(|(k, v)| h.insert_flow(k, v))
            },
            input: Packet::udp(DNS_BACKEND, CLIENT).no_udp_checksum().build(),
            verdict: TC_ACT_OK,
            output: Output::Rewritten(Packet::udp(DNS, CLIENT).no_udp_checksum().build()),
            flows: nat_entries(CLIENT, DNS, DNS_BACKEND, IPPROTO_UDP),
        },
        Fixture {
            // The flow entry names a backend that is in no backend set: only the entry can
            // explain the destination.
            name: "flow_entry_takes_precedence_over_service",
            setup: |h| {
                standard_world(h)?;
                let other_backend = ep([10, 244, 9, 9], 9090);
                nat_entries(CLIENT, WEB, other_backend, IPPROTO_TCP)
                    .into_iter()
                    .try_for_each(|(k, v)| h.insert_flow(k, v))
            },
            input: Packet::tcp(CLIENT, WEB).build(),
            verdict: TC_ACT_OK,
            output: Output::Rewritten(Packet::tcp(CLIENT, other_backend).build()),
            flows: nat_entries(CLIENT, WEB, other_backend, IPPROTO_TCP),
        },
        Fixture {
            name: "flow_entry_used_although_service_has_no_backends",
            setup: |h| {
                standard_world(h)?;
                let other_backend = ep([10, 244, 9, 9], 9090);
                nat_entries(CLIENT, EMPTY, other_backend, IPPROTO_TCP)
                    .into_iter()
                    .try_for_each(|(k, v)| h.insert_flow(k, v))
            },
            input: Packet::tcp(CLIENT, EMPTY).build(),
            verdict: TC_ACT_OK,
            output: Output::Rewritten(Packet::tcp(CLIENT, other_backend).build()),
            flows: nat_entries(CLIENT, EMPTY, other_backend, IPPROTO_TCP),
        },
        Fixture {
            // The reply key is proto-specific: a UDP packet matching a TCP flow's addresses
            // and ports is not reverse-NATed.
            name: "udp_reply_does_not_match_tcp_flow",
            setup: |h| {
                standard_world(h)?;
                nat_entries(CLIENT, WEB, WEB_BACKEND, IPPROTO_TCP)
                    .into_iter()
                    .try_for_each(|(k, v)| h.insert_flow(k, v))
            },
            input: Packet::udp(WEB_BACKEND, CLIENT).build(),
            verdict: TC_ACT_UNSPEC,
            output: Output::Unchanged,
            flows: nat_entries(CLIENT, WEB, WEB_BACKEND, IPPROTO_TCP),
        },
        // --- misses
        untouched("miss_other_vip", Packet::tcp(CLIENT, ep([10, 96, 0, 11], 80)).build()),
        untouched("miss_other_port", Packet::tcp(CLIENT, ep(VIP, 443)).build()),
        untouched("miss_udp_to_tcp_frontend", Packet::udp(CLIENT, WEB).build()),
        untouched("miss_tcp_to_udp_frontend", Packet::tcp(CLIENT, DNS).build()),
        untouched("miss_icmp_to_vip", Packet::icmp_echo(CLIENT.addr, VIP).build()),
        untouched("miss_vip_as_source", Packet::tcp(WEB, CLIENT).build()),
        untouched("miss_reply_from_backend_without_flow", Packet::tcp(WEB_BACKEND, CLIENT).build()),
        // --- drops
        Fixture {
            name: "no_backends_is_dropped",
            setup: standard_world,
            input: Packet::tcp(CLIENT, EMPTY).build(),
            verdict: TC_ACT_SHOT,
            output: Output::Unchanged,
            flows: vec![],
        },
        Fixture {
            // backend_count says 1 but the set has no slot 0: a retired set, dropped.
            name: "missing_backend_slot_is_dropped",
            setup: |h| {
                standard_world(h)?;
                h.set_service(ep([10, 96, 0, 30], 80), IPPROTO_TCP, 9, 1)
            },
            input: Packet::tcp(CLIENT, ep([10, 96, 0, 30], 80)).build(),
            verdict: TC_ACT_SHOT,
            output: Output::Unchanged,
            flows: vec![],
        },
        // --- not IPv4 TCP/UDP, or not parseable
        untouched("ipv6_untouched", ipv6_tcp_frame(CLIENT, WEB)),
        untouched("arp_untouched", arp_request_frame(CLIENT.addr, VIP)),
        refusable("ethernet_header_only", truncated(Packet::tcp(CLIENT, WEB), ETH_HLEN)),
        refusable("truncated_ipv4_header", truncated(Packet::tcp(CLIENT, WEB), ETH_HLEN + 19)),
        // The fixed 20 bytes are there, the option word IHL 6 announces is not.
        untouched(
            "truncated_ipv4_header_ihl6",
            truncated(Packet::tcp(CLIENT, WEB).ip_options(&ROUTER_ALERT), ETH_HLEN + 20),
        ),
        untouched(
            "truncated_ipv4_options",
            truncated(Packet::tcp(CLIENT, WEB).ip_options(&max_ip_options()), ETH_HLEN + 40),
        ),
        untouched("truncated_tcp_inside_ports", truncated(Packet::tcp(CLIENT, WEB), ETH_HLEN + 20 + 3)),
        untouched("truncated_tcp_before_checksum", truncated(Packet::tcp(CLIENT, WEB), ETH_HLEN + 20 + 10)),
        untouched("truncated_udp_before_checksum", truncated(Packet::udp(CLIENT, DNS), ETH_HLEN + 20 + 6)),
        // A first fragment carries the L4 header and is balanced like a whole packet (its
        // checksum covers the whole datagram, which the incremental update keeps right).
        balanced("first_fragment_is_balanced", Packet::tcp(CLIENT, WEB).frag(IP_MF), WEB, WEB_BACKEND),
        // Later fragments whose first fragment was never seen: no ports to place them by, and
        // no service address in this world's unmatched trie, so they are left to the stack.
        untouched("middle_fragment_untouched", Packet::udp(CLIENT, DNS).frag(IP_MF | 185).build()),
        // A later fragment whose payload happens to start with bytes that look like ports.
        untouched("last_fragment_untouched", Packet::tcp(CLIENT, WEB).frag(185).build()),
        untouched("fragment_with_df_and_offset_untouched", Packet::tcp(CLIENT, WEB).frag(IP_DF | 1).build()),
        untouched("ip_version_6_in_ipv4_ethertype", {
            let mut frame = Packet::tcp(CLIENT, WEB).build();
            frame[ETH_HLEN] = 0x65;
            frame
        }),
        untouched("ihl_below_5", {
            let mut frame = Packet::tcp(CLIENT, WEB).build();
            frame[ETH_HLEN] = 0x44;
            frame
        }),
    ]
}

fn run_fixture(fixture: &Fixture) -> Result<Outcome> {
    let mut h = Harness::new()?;
    (fixture.setup)(&mut h).context("setup")?;
    let expect = match &fixture.output {
        Output::Unchanged | Output::UnchangedIfKernelAccepts => Expect::Unchanged,
        Output::Rewritten(frame) => Expect::Frame(frame),
    };
    if let Err(err) = check(&h, &fixture.input, fixture.verdict, expect) {
        if matches!(fixture.output, Output::UnchangedIfKernelAccepts) && is_einval(&err) {
            h.expect_flows(&fixture.flows)?;
            return Ok(Outcome::Skipped("BPF_PROG_TEST_RUN refuses this frame (EINVAL) on this kernel"));
        }
        return Err(err);
    }
    h.expect_flows(&fixture.flows)?;
    Ok(Outcome::Passed)
}

#[test]
fn fixture_table() {
    run_table(&fixtures(), |fixture| fixture.name, run_fixture);
}

// ---------------------------------------------------------------------------------------------
// Connection lifecycles: several packets against one harness.

/// First packet balanced and tracked; later packets of the same flow follow the flow entry
/// whatever happens to the service (new backend, no backends, service gone); replies are
/// reverse-NATed; a crossed reply is not.
fn flow_lifecycle(proto: u8) -> Result<()> {
    let (front, backend_a, set) = match proto {
        IPPROTO_TCP => (WEB, WEB_BACKEND, WEB_SET),
        _ => (DNS, DNS_BACKEND, DNS_SET),
    };
    let backend_b = ep([10, 244, 7, 7], backend_a.port + 1);
    let client2 = ep(CLIENT.addr, CLIENT.port + 1);
    let client3 = ep(CLIENT.addr, CLIENT.port + 2);
    let client4 = ep([192, 168, 1, 101], CLIENT.port);
    let mut h = Harness::new()?;
    standard_world(&mut h)?;

    let first = packet(proto, CLIENT, front);
    check(&h, &first.build(), TC_ACT_OK, Expect::Frame(&first.clone().to(backend_a).build()))
        .context("first packet")?;
    let mut flows = nat_entries(CLIENT, front, backend_a, proto);
    h.expect_flows(&flows).context("after the first packet")?;

    // Slot 0 now holds backend B: the tracked flow stays on A, a new flow goes to B.
    h.set_backend(set, 0, backend_b)?;
    let second = packet(proto, CLIENT, front).payload(b"second packet of the flow");
    check(&h, &second.build(), TC_ACT_OK, Expect::Frame(&second.clone().to(backend_a).build()))
        .context("second packet after the backend changed")?;
    let other = packet(proto, client2, front);
    check(&h, &other.build(), TC_ACT_OK, Expect::Frame(&other.clone().to(backend_b).build()))
        .context("new flow after the backend changed")?;
    flows.extend(nat_entries(client2, front, backend_b, proto));
    h.expect_flows(&flows).context("after the backend changed")?;

    // No endpoints: tracked flows go on, new ones are dropped.
    h.set_service(front, proto, set, 0)?;
    let third = packet(proto, CLIENT, front).payload(b"third");
    check(&h, &third.build(), TC_ACT_OK, Expect::Frame(&third.clone().to(backend_a).build()))
        .context("tracked flow with backend_count 0")?;
    let other = packet(proto, client2, front).payload(b"more");
    check(&h, &other.build(), TC_ACT_OK, Expect::Frame(&other.clone().to(backend_b).build()))
        .context("second tracked flow with backend_count 0")?;
    check(&h, &packet(proto, client3, front).build(), TC_ACT_SHOT, Expect::Unchanged)
        .context("new flow with backend_count 0")?;

    // Service gone: tracked flows go on, new ones are not vipr's business.
    h.remove_service(front, proto)?;
    let fourth = packet(proto, CLIENT, front).payload(b"fourth");
    check(&h, &fourth.build(), TC_ACT_OK, Expect::Frame(&fourth.clone().to(backend_a).build()))
        .context("tracked flow after the service was removed")?;
    check(&h, &packet(proto, client4, front).build(), TC_ACT_UNSPEC, Expect::Unchanged)
        .context("new flow after the service was removed")?;

    // Replies.
    let reply = packet(proto, backend_a, CLIENT).payload(b"HTTP/1.1 200 OK\r\n\r\n");
    check(&h, &reply.build(), TC_ACT_OK, Expect::Frame(&reply.clone().from(front).build()))
        .context("reply from backend A")?;
    let reply = packet(proto, backend_b, client2);
    check(&h, &reply.build(), TC_ACT_OK, Expect::Frame(&reply.clone().from(front).build()))
        .context("reply from backend B")?;
    check(&h, &packet(proto, backend_a, client2).build(), TC_ACT_UNSPEC, Expect::Unchanged)
        .context("crossed reply (backend A to client 2)")?;
    check(
        &h,
        &packet(proto, ep(backend_a.addr, backend_a.port + 100), CLIENT).build(),
        TC_ACT_UNSPEC,
        Expect::Unchanged,
    )
    .context("reply from another port of backend A")?;

    h.expect_flows(&flows).context("at the end")
}

#[test]
fn tcp_flow_lifecycle() {
    flow_lifecycle(IPPROTO_TCP).unwrap_or_else(|err| panic!("{err:#}"));
}

#[test]
fn udp_flow_lifecycle() {
    flow_lifecycle(IPPROTO_UDP).unwrap_or_else(|err| panic!("{err:#}"));
}

// ---------------------------------------------------------------------------------------------
// Counters and connection state.

/// The counters of a connection's (service port, backend) pair, named by the index in its
/// backend slot, advance by one packet and its IP length for the packet that is balanced and
/// for every later one, in both directions; both flow entries carry the index.
#[test]
fn counters_count_balanced_and_established_packets() {
    counters().unwrap_or_else(|err| panic!("{err:#}"));
}

fn counters() -> Result<()> {
    const COUNTER: u32 = 42;
    let mut h = Harness::new()?;
    h.set_counted_backend(WEB_SET, 0, WEB_BACKEND, COUNTER)?;
    h.set_service(WEB, IPPROTO_TCP, WEB_SET, 1)?;
    let ip_len = |frame: &[u8]| (frame.len() - ETH_HLEN) as u64;
    let expect = |packets, bytes| -> Result<()> {
        let counted = h.counters(COUNTER)?;
        ensure!(
            counted == Counters { packets, bytes },
            "counters: expected {packets} packets and {bytes} bytes, found {counted:?}"
        );
        Ok(())
    };
    expect(0, 0)?;

    let first = Packet::tcp(CLIENT, WEB);
    check(&h, &first.build(), TC_ACT_OK, Expect::Frame(&first.clone().to(WEB_BACKEND).build()))
        .context("balanced packet")?;
    let mut bytes = ip_len(&first.build());
    expect(1, bytes).context("after the balanced packet")?;
    let flows = h.flows()?;
    ensure!(
        flows.len() == 2 && flows.values().all(|flow| flow.track.counter == COUNTER),
        "both entries must carry counter {COUNTER}:\n{}",
        describe_flows(&flows)
    );

    let second = Packet::tcp(CLIENT, WEB).payload(&[b'x'; 300]);
    check(&h, &second.build(), TC_ACT_OK, Expect::Frame(&second.clone().to(WEB_BACKEND).build()))
        .context("established packet")?;
    bytes += ip_len(&second.build());
    expect(2, bytes).context("after the established packet")?;

    let reply = Packet::tcp(WEB_BACKEND, CLIENT).payload(b"HTTP/1.1 200 OK\r\n\r\n");
    check(&h, &reply.build(), TC_ACT_OK, Expect::Frame(&reply.clone().from(WEB).build())).context("reply")?;
    bytes += ip_len(&reply.build());
    expect(3, bytes).context("after the reply")?;

    // Packets vipr leaves alone count nowhere; the shared slot 0 saw nothing either.
    check(&h, &Packet::tcp(CLIENT, ep(VIP, 81)).build(), TC_ACT_UNSPEC, Expect::Unchanged)?;
    expect(3, bytes).context("after a packet to no frontend")?;
    ensure!(h.counters(0)? == Counters::default(), "slot 0 counted {:?}", h.counters(0)?);
    for (stat, name) in [
        (datapath_stat::FLOW_INSERT_FORWARD, "forward"),
        (datapath_stat::FLOW_INSERT_REPLY, "reply"),
        (datapath_stat::SNAT_PORT_EXHAUSTED, "snat"),
    ] {
        ensure!(h.datapath_stat(stat)? == 0, "no {name} insert can have failed");
    }
    Ok(())
}

/// A full flows map with nothing to evict refuses new connections: their first packet is
/// dropped and counted, as conntrack drops when its table is full, since a connection whose
/// replies could not be reverse-NATed must not start. With one free entry, the reply entry
/// fits and the forward one does not: the reply entry is taken back. The established
/// connection tracked before the map filled is never evicted and keeps both its entries.
#[test]
fn a_full_flows_map_refuses_new_connections_and_keeps_tracked_ones() {
    full_flows_map().unwrap_or_else(|err| panic!("{err:#}"));
}

fn full_flows_map() -> Result<()> {
    let mut h = Harness::new()?;
    standard_world(&mut h)?;
    let first = Packet::tcp(CLIENT, WEB);
    check(&h, &first.build(), TC_ACT_OK, Expect::Frame(&first.clone().to(WEB_BACKEND).build()))
        .context("the connection tracked before the map fills")?;
    // Established (answered, then acknowledged by the client), so early drop must spare it.
    let answer = Packet::tcp(WEB_BACKEND, CLIENT);
    check(&h, &answer.build(), TC_ACT_OK, Expect::Frame(&answer.clone().from(WEB).build()))?;
    check(&h, &first.build(), TC_ACT_OK, Expect::Frame(&first.clone().to(WEB_BACKEND).build()))?;
    // Distinct clients of some other address, none of them recent.
    let (_, filler_flow) = nat_entries(CLIENT, WEB, WEB_BACKEND, IPPROTO_TCP)[0];
    let filler = |i: u32| {
        let [_, a, b, c] = i.to_be_bytes();
        flow_key(ep([100, a, b, c], 1), ep([10, 96, 9, 9], 80), IPPROTO_TCP)
    };
    // All but one entry.
    for i in 0..capacity::FLOWS - 3 {
        h.insert_flow(filler(i), filler_flow).with_context(|| format!("filling entry {i}"))?;
    }
    let stats = |h: &Harness| -> Result<(u64, u64)> {
        Ok((
            h.datapath_stat(datapath_stat::FLOW_INSERT_REPLY)?,
            h.datapath_stat(datapath_stat::FLOW_INSERT_FORWARD)?,
        ))
    };

    let reply_fits = Packet::tcp(ep([192, 168, 1, 200], 41000), WEB);
    check(&h, &reply_fits.build(), TC_ACT_SHOT, Expect::Unchanged)
        .context("a new connection with room for one entry")?;
    ensure!(stats(&h)? == (0, 1), "(reply, forward) insert failures: {:?}, not (0, 1)", stats(&h)?);
    // Its reply entry was taken back: the last entry is free.
    h.insert_flow(filler(capacity::FLOWS), filler_flow).context("the entry the refused connection freed")?;

    let nothing_fits = Packet::tcp(ep([192, 168, 1, 201], 41000), WEB);
    check(&h, &nothing_fits.build(), TC_ACT_SHOT, Expect::Unchanged)
        .context("a new connection while the map is full")?;
    ensure!(stats(&h)? == (1, 1), "(reply, forward) insert failures: {:?}, not (1, 1)", stats(&h)?);

    let later = Packet::tcp(CLIENT, WEB).payload(b"still tracked");
    check(&h, &later.build(), TC_ACT_OK, Expect::Frame(&later.clone().to(WEB_BACKEND).build()))
        .context("the tracked connection's next packet")?;
    let reply = Packet::tcp(WEB_BACKEND, CLIENT).payload(b"HTTP/1.1 200 OK\r\n\r\n");
    check(&h, &reply.build(), TC_ACT_OK, Expect::Frame(&reply.clone().from(WEB).build()))
        .context("the tracked connection's reply")?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The handshake and early drop (docs/reliability.md, "Flow table under attack").

const TCP_SYN: u8 = 0x02;
const TCP_SYN_ACK: u8 = 0x12;
const TCP_ACK: u8 = 0x10;

/// The handshake bits of `key`'s entry (FIN and RST left out).
fn handshake_bits(h: &Harness, key: FlowKey4) -> Result<u32> {
    let flows = h.raw_flows()?;
    let flow = flows.get(&key).with_context(|| format!("no entry {key:?}"))?;
    Ok(flow.track.state & !(flow_state::FIN | flow_state::RST))
}

/// Runs `packet` and expects it balanced into `expected`.
fn pass(h: &Harness, packet: &Packet, expected: Packet) -> Result<()> {
    check(h, &packet.build(), TC_ACT_OK, Expect::Frame(&expected.build())).map(drop)
}

/// As conntrack: a SYN and the backend's SYN-ACK leave a connection half-open (what a spoofed
/// SYN flood, whose SYN-ACKs go nowhere, produces); only the client's ACK after the SYN-ACK
/// establishes it. Both entries carry the bits, so either tells whether it may be evicted.
#[test]
fn a_syn_ack_alone_does_not_establish_the_clients_ack_does() {
    handshake().unwrap_or_else(|err| panic!("{err:#}"));
}

fn handshake() -> Result<()> {
    let mut h = Harness::new()?;
    standard_world(&mut h)?;
    let keys = [flow_key(CLIENT, WEB, IPPROTO_TCP), flow_key(WEB_BACKEND, CLIENT, IPPROTO_TCP)];
    let both = |h: &Harness, bits: u32, after: &str| -> Result<()> {
        for key in keys {
            let got = handshake_bits(h, key)?;
            ensure!(got == bits, "after {after}: state {got:#x} in {key:?}, expected {bits:#x}");
        }
        Ok(())
    };
    let tracked = flow_state::HANDSHAKE_TRACKED;
    let syn = Packet::tcp(CLIENT, WEB).tcp_flags(TCP_SYN);
    pass(&h, &syn, syn.clone().to(WEB_BACKEND)).context("SYN")?;
    both(&h, tracked | flow_state::SYN, "the SYN")?;
    let syn_ack = Packet::tcp(WEB_BACKEND, CLIENT).tcp_flags(TCP_SYN_ACK);
    pass(&h, &syn_ack, syn_ack.clone().from(WEB)).context("SYN-ACK")?;
    let half_open = tracked | flow_state::SYN | flow_state::SYN_ACK | flow_state::REPLIED;
    both(&h, half_open, "the SYN-ACK")?;
    // Retransmissions of both change nothing.
    pass(&h, &syn, syn.clone().to(WEB_BACKEND)).context("SYN again")?;
    pass(&h, &syn_ack, syn_ack.clone().from(WEB)).context("SYN-ACK again")?;
    both(&h, half_open, "retransmissions")?;
    let ack = Packet::tcp(CLIENT, WEB).tcp_flags(TCP_ACK);
    pass(&h, &ack, ack.clone().to(WEB_BACKEND)).context("the client's ACK")?;
    both(&h, half_open | flow_state::ESTABLISHED, "the client's ACK")?;
    Ok(())
}

/// A new connection that finds the flows map full replaces a half-open one (early drop,
/// counted), never an established one: with only established connections to evict, the next
/// new connection is refused. A half-open connection younger than a quarter second (the newcomer
/// itself, right after its SYN) is spared too.
#[test]
fn early_drop_replaces_a_half_open_connection_never_an_established_one() {
    early_drop().unwrap_or_else(|err| panic!("{err:#}"));
}

fn early_drop() -> Result<()> {
    let mut h = Harness::new()?;
    standard_world(&mut h)?;
    let half_open = ep([192, 168, 1, 50], 40000);
    let established = ep([192, 168, 1, 51], 40000);
    for client in [half_open, established] {
        let syn = Packet::tcp(client, WEB).tcp_flags(TCP_SYN);
        pass(&h, &syn, syn.clone().to(WEB_BACKEND))?;
        let syn_ack = Packet::tcp(WEB_BACKEND, client).tcp_flags(TCP_SYN_ACK);
        pass(&h, &syn_ack, syn_ack.clone().from(WEB))?;
    }
    let ack = Packet::tcp(established, WEB).tcp_flags(TCP_ACK);
    pass(&h, &ack, ack.clone().to(WEB_BACKEND))?;
    // The half-open connection's SYN was long ago: early drop spares younger ones (a
    // handshake in flight).
    let half_open_key = flow_key(half_open, WEB, IPPROTO_TCP);
    let mut stale = h.raw_flows()?[&half_open_key];
    stale.track.last_seen = 1;
    h.insert_flow(half_open_key, stale)?;

    // The rest of the map: entries of an earlier vipr's layout, which are never evicted.
    let (_, filler_flow) = nat_entries(CLIENT, WEB, WEB_BACKEND, IPPROTO_TCP)[0];
    let filler = |i: u32| {
        let [_, a, b, c] = i.to_be_bytes();
        flow_key(ep([100, a, b, c], 1), ep([10, 96, 9, 9], 80), IPPROTO_TCP)
    };
    for i in 0..capacity::FLOWS - 4 {
        h.insert_flow(filler(i), filler_flow).with_context(|| format!("filling entry {i}"))?;
    }
    ensure!(h.insert_flow(filler(capacity::FLOWS), filler_flow).is_err(), "the map should be full");

    let newcomer = Packet::tcp(ep([192, 168, 1, 52], 40000), WEB).tcp_flags(TCP_SYN);
    pass(&h, &newcomer, newcomer.clone().to(WEB_BACKEND)).context("a new connection into a full map")?;
    let flows = h.raw_flows()?;
    ensure!(
        !flows.contains_key(&flow_key(half_open, WEB, IPPROTO_TCP))
            && !flows.contains_key(&flow_key(WEB_BACKEND, half_open, IPPROTO_TCP)),
        "the half-open connection should have made room"
    );
    for key in [
        flow_key(established, WEB, IPPROTO_TCP),
        flow_key(WEB_BACKEND, established, IPPROTO_TCP),
        flow_key(ep([192, 168, 1, 52], 40000), WEB, IPPROTO_TCP),
    ] {
        ensure!(flows.contains_key(&key), "{key:?} should be tracked");
    }
    ensure!(h.datapath_stat(datapath_stat::EARLY_DROP)? == 1, "one early drop");

    // The newcomer completes its handshake: every connection left is established, and the
    // next new connection has nothing to evict.
    let newcomer_client = ep([192, 168, 1, 52], 40000);
    let syn_ack = Packet::tcp(WEB_BACKEND, newcomer_client).tcp_flags(TCP_SYN_ACK);
    pass(&h, &syn_ack, syn_ack.clone().from(WEB))?;
    let newcomer_ack = Packet::tcp(newcomer_client, WEB).tcp_flags(TCP_ACK);
    pass(&h, &newcomer_ack, newcomer_ack.clone().to(WEB_BACKEND))?;
    let refused = Packet::tcp(ep([192, 168, 1, 53], 40000), WEB).tcp_flags(TCP_SYN);
    check(&h, &refused.build(), TC_ACT_SHOT, Expect::Unchanged).context("nothing evictable")?;
    ensure!(h.datapath_stat(datapath_stat::EARLY_DROP)? == 1, "no second early drop");
    ensure!(h.datapath_stat(datapath_stat::FLOW_INSERT_REPLY)? == 1, "the refusal is counted");
    let flows = h.raw_flows()?;
    ensure!(
        flows.contains_key(&flow_key(established, WEB, IPPROTO_TCP))
            && flows.contains_key(&flow_key(WEB_BACKEND, established, IPPROTO_TCP)),
        "the established connection keeps both entries"
    );
    pass(&h, &ack, ack.clone().to(WEB_BACKEND)).context("the established connection's next packet")?;
    Ok(())
}

/// Each flow entry records the FIN and RST its direction sent, and when it last saw a packet:
/// the forward entry from the first packet on, the reply entry only once a reply passed.
#[test]
fn tcp_fin_and_rst_are_tracked_per_direction() {
    close_tracking().unwrap_or_else(|err| panic!("{err:#}"));
}

fn close_tracking() -> Result<()> {
    const FIN_ACK: u8 = 0x11;
    const RST_ACK: u8 = 0x14;
    let mut h = Harness::new()?;
    standard_world(&mut h)?;
    let forward_key = flow_key(CLIENT, WEB, IPPROTO_TCP);
    let reply_key = flow_key(WEB_BACKEND, CLIENT, IPPROTO_TCP);
    // Only the FIN and RST bits: the handshake bits have their own test.
    let track = |key| -> Result<FlowTrack> {
        let flows = h.raw_flows()?;
        let mut track =
            flows.get(&key).map(|flow| flow.track).with_context(|| format!("no entry {key:?}"))?;
        track.state &= flow_state::FIN | flow_state::RST;
        Ok(track)
    };
    let send = |packet: Packet, expected: Packet| -> Result<()> {
        check(&h, &packet.build(), TC_ACT_OK, Expect::Frame(&expected.build())).map(drop)
    };

    send(Packet::tcp(CLIENT, WEB), Packet::tcp(CLIENT, WEB_BACKEND)).context("first packet")?;
    let (forward, reply) = (track(forward_key)?, track(reply_key)?);
    ensure!(
        forward.last_seen != 0 && forward.state == 0,
        "forward entry after the first packet: {forward:?}"
    );
    ensure!(reply.last_seen == 0 && reply.state == 0, "no reply yet, but: {reply:?}");

    send(Packet::tcp(WEB_BACKEND, CLIENT), Packet::tcp(WEB, CLIENT)).context("reply")?;
    ensure!(track(reply_key)?.last_seen != 0, "the reply entry must note its first packet");

    let fin = Packet::tcp(CLIENT, WEB).tcp_flags(FIN_ACK);
    send(fin.clone(), fin.to(WEB_BACKEND)).context("the client's FIN")?;
    ensure!(
        track(forward_key)?.state == flow_state::FIN,
        "forward after the client's FIN: {:?}",
        track(forward_key)?
    );
    ensure!(track(reply_key)?.state == 0, "the reply direction sent no FIN: {:?}", track(reply_key)?);
    let fin = Packet::tcp(WEB_BACKEND, CLIENT).tcp_flags(FIN_ACK);
    send(fin.clone(), fin.from(WEB)).context("the backend's FIN")?;
    ensure!(
        track(reply_key)?.state == flow_state::FIN,
        "reply after the backend's FIN: {:?}",
        track(reply_key)?
    );
    // The last ACK still passes and changes nothing.
    send(Packet::tcp(CLIENT, WEB).tcp_flags(0x10), Packet::tcp(CLIENT, WEB_BACKEND).tcp_flags(0x10))?;
    ensure!(track(forward_key)?.state == flow_state::FIN, "{:?}", track(forward_key)?);

    // Another connection ends with an RST from the backend.
    let client2 = ep(CLIENT.addr, CLIENT.port + 1);
    send(Packet::tcp(client2, WEB), Packet::tcp(client2, WEB_BACKEND)).context("second connection")?;
    let rst = Packet::tcp(WEB_BACKEND, client2).tcp_flags(RST_ACK);
    send(rst.clone(), rst.from(WEB)).context("the backend's RST")?;
    let reply2 = track(flow_key(WEB_BACKEND, client2, IPPROTO_TCP))?;
    ensure!(reply2.state == flow_state::RST && reply2.last_seen != 0, "reply after an RST: {reply2:?}");
    ensure!(track(flow_key(client2, WEB, IPPROTO_TCP))?.state == 0, "the client sent no RST");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Spread.

/// 300 new flows to a service with three backends reach all three and nothing else, with a
/// roughly even spread, and each flow is tracked to the backend its packet went to.
#[test]
fn random_spread_over_three_backends() {
    spread().unwrap_or_else(|err| panic!("{err:#}"));
}

fn spread() -> Result<()> {
    const FLOWS: u16 = 300;
    let front = ep([10, 96, 0, 50], 443);
    let backends = [ep([10, 244, 3, 1], 8443), ep([10, 244, 3, 2], 8444), ep([10, 244, 3, 3], 8445)];
    let mut h = Harness::new()?;
    standard_world(&mut h)?;
    h.add_service(front, IPPROTO_TCP, 5, &backends)?;

    let mut hits: BTreeMap<Ep, u32> = backends.iter().map(|b| (*b, 0)).collect();
    let mut chosen = HashMap::new();
    for i in 0..FLOWS {
        let client = ep(CLIENT.addr, 20000 + i);
        let input = Packet::tcp(client, front);
        let (verdict, out) = h.run(&input.build())?;
        ensure!(verdict == TC_ACT_OK, "flow {client}: verdict {}", verdict_name(verdict));
        let view = parse_ipv4(&out).map_err(|e| anyhow!("flow {client}: output: {e}{}", hex(&out)))?;
        let backend = view.destination();
        ensure!(view.source() == client, "flow {client}: source changed to {}{}", view.source(), hex(&out));
        let Some(count) = hits.get_mut(&backend) else {
            bail!("flow {client} went to {backend}, which is not a backend of {front}{}", hex(&out));
        };
        *count += 1;
        // Full check of this output against the frame expected for the chosen backend.
        check_output_for(&input, &out, backend).with_context(|| format!("flow {client}"))?;
        chosen.insert(client, backend);
    }
    println!("hits per backend: {hits:?}");
    // Binomial(300, 1/3): mean 100, standard deviation 8.2. Below 50 is 6 deviations out
    // (probability ~1e-9): a fair random choice never fails this, a stuck one always does.
    for (backend, count) in &hits {
        ensure!(*count >= 50, "backend {backend} got {count} of {FLOWS} flows: {hits:?}");
    }

    let mut expected = Vec::new();
    for (client, backend) in &chosen {
        expected.extend(nat_entries(*client, front, *backend, IPPROTO_TCP));
    }
    h.expect_flows(&expected)
}

fn check_output_for(input: &Packet, out: &[u8], backend: Ep) -> Result<()> {
    let view = parse_ipv4(out).map_err(|e| anyhow!("{e}"))?;
    ensure!(view.ip_checksum_valid, "IPv4 checksum invalid{}", hex(out));
    ensure!(view.l4_checksum == L4Checksum::Valid, "TCP checksum {:?}{}", view.l4_checksum, hex(out));
    compare_frames(&input.clone().to(backend).build(), out).map_err(|e| anyhow!("{e}"))
}

// ---------------------------------------------------------------------------------------------
// The harness and the frame checks themselves.

/// The maps are pinned in the private bpffs (and so not in /sys/fs/bpf), and the bpffs is
/// unmounted and its directory removed after use, also when a test panics.
#[test]
fn private_bpffs_is_used_and_cleaned_up() {
    let h = Harness::new().expect("harness");
    let dir = h.bpffs().to_owned();
    for name in [pins::SERVICES4, pins::BACKENDS4, pins::FLOWS4] {
        assert!(dir.join(name).exists(), "map {name} is not pinned in {}", dir.display());
    }
    assert_eq!(fs_magic(&dir), Some(BPF_FS_MAGIC), "{} is not a bpffs", dir.display());
    assert!(is_mount_point(&dir), "{} is not in /proc/self/mountinfo", dir.display());
    drop(h);
    assert!(!is_mount_point(&dir), "{} is still mounted", dir.display());
    assert!(!dir.exists(), "{} still exists", dir.display());

    let seen = std::sync::Mutex::new(None);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let h = Harness::new().expect("harness");
        *seen.lock().unwrap() = Some(h.bpffs().to_owned());
        panic!("deliberate panic with a loaded harness");
    }));
    assert!(result.is_err());
    let dir = seen.lock().unwrap().take().expect("the closure ran");
    assert!(!is_mount_point(&dir), "{} is still mounted after a panic", dir.display());
    assert!(!dir.exists(), "{} still exists after a panic", dir.display());
}

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

fn fs_magic(path: &std::path::Path) -> Option<i64> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and a properly sized out-parameter.
    (unsafe { libc::statfs(c.as_ptr(), &mut stat) } == 0).then_some(stat.f_type as i64)
}

fn is_mount_point(path: &std::path::Path) -> bool {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("reading mountinfo");
    let path = path.to_string_lossy();
    mountinfo.lines().any(|line| line.split(' ').nth(4) == Some(path.as_ref()))
}

/// The checksum code against a reference vector, and its ability to notice damage.
#[test]
fn checksum_checks_can_fail() {
    // The IPv4 header example from RFC 1071's usual illustration (Wikipedia): checksum 0xb861.
    let header = [
        0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8, 0x00, 0x01, 0xc0,
        0xa8, 0x00, 0xc7,
    ];
    assert_eq!(checksum(ones_sum(0, &header)), 0xb861);

    for frame in [
        Packet::tcp(CLIENT, WEB).build(),
        Packet::udp(CLIENT, DNS).payload(b"odd").build(),
        Packet::tcp(CLIENT, WEB).ip_options(&ROUTER_ALERT).build(),
    ] {
        let view = parse_ipv4(&frame).expect("built frame parses");
        assert!(view.ip_checksum_valid && view.l4_checksum == L4Checksum::Valid, "{view:?}");
        let ip_end = ETH_HLEN + view.total_len;
        for i in ETH_HLEN..ip_end {
            let mut damaged = frame.clone();
            damaged[i] ^= 0x01;
            if let Ok(view) = parse_ipv4(&damaged) {
                assert!(
                    !(view.ip_checksum_valid && view.l4_checksum == L4Checksum::Valid),
                    "flipping a bit of byte {i} went unnoticed"
                );
            }
            assert!(compare_frames(&frame, &damaged).is_err(), "compare_frames missed byte {i}");
        }
    }
    // A zero UDP checksum is "absent", not "valid".
    let view = parse_ipv4(&Packet::udp(CLIENT, DNS).no_udp_checksum().build()).unwrap();
    assert_eq!(view.l4_checksum, L4Checksum::Absent);
    // 0x0000 and 0xffff are interchangeable in a TCP checksum field, not in a UDP one.
    let (_, zero_out) = udp_with_zero_checksum_after_nat();
    let frame = zero_out.build();
    let at = parse_ipv4(&frame).unwrap().l4_csum_offset;
    assert_eq!(&frame[at..at + 2], &[0xff, 0xff]);
    let mut zeroed = frame.clone();
    zeroed[at..at + 2].copy_from_slice(&[0, 0]);
    assert!(compare_frames(&frame, &zeroed).is_err());
}

// ---------------------------------------------------------------------------------------------
// A reply tuple that is already another connection's.

/// The same client port reaches the same backend through two frontends (two services sharing
/// a pod, or a port reused toward another frontend): both connections would have the reply
/// tuple backend -> client:port. The second must not take the first's replies: it is given
/// another source port, its address kept, as the kernel's NAT resolves such a clash, and each
/// connection's replies come back from its own frontend.
#[test]
fn a_reply_tuple_clash_remaps_the_new_connections_port_and_leaves_the_old_one_alone() {
    reply_clash().unwrap_or_else(|err| panic!("{err:#}"));
}

fn reply_clash() -> Result<()> {
    const OTHER: Ep = ep([10, 96, 0, 11], 80);
    let mut h = Harness::new()?;
    standard_world(&mut h)?;
    h.add_service(OTHER, IPPROTO_TCP, 7, &[WEB_BACKEND])?;
    let first = Packet::tcp(CLIENT, WEB);
    check(&h, &first.build(), TC_ACT_OK, Expect::Frame(&first.clone().to(WEB_BACKEND).build()))?;

    let second = Packet::tcp(CLIENT, OTHER).payload(b"second");
    let (verdict, out) = h.run(&second.build())?;
    ensure!(verdict == TC_ACT_OK, "verdict {}", verdict_name(verdict));
    let out = parse_ipv4(&out[..]).map_err(|error| anyhow!("{error}"))?;
    ensure!(out.destination() == WEB_BACKEND, "the second connection went to {:?}", out.destination());
    ensure!(out.src == CLIENT.addr, "the client's address must be kept, got {:?}", out.src);
    ensure!(out.sport != CLIENT.port, "the second connection kept the clashing port {}", out.sport);
    ensure!(out.ip_checksum_valid && matches!(out.l4_checksum, L4Checksum::Valid), "checksums: {out:?}");
    ensure!(h.datapath_stat(datapath_stat::REPLY_CLASH_REMAPPED)? == 1, "the remap is not counted");

    let first_reply = Packet::tcp(WEB_BACKEND, CLIENT).payload(b"to the first");
    check(&h, &first_reply.build(), TC_ACT_OK, Expect::Frame(&first_reply.clone().from(WEB).build()))
        .context("the first connection's replies still come from its frontend")?;
    let second_reply = Packet::tcp(WEB_BACKEND, out.source()).payload(b"to the second");
    let expected = Packet::tcp(OTHER, CLIENT).payload(b"to the second");
    check(&h, &second_reply.build(), TC_ACT_OK, Expect::Frame(&expected.build()))
        .context("the second connection's replies come from its frontend, to the client's own port")?;
    Ok(())
}
