//! Packet fixtures for REJECT, run with BPF_PROG_TEST_RUN: a new flow to a frontend without
//! endpoints (backend_count 0) whose service says REJECT_WHEN_EMPTY, or to a port a cluster IP
//! does not serve (the unmatched map says REJECT), must come back as an ICMP port
//! unreachable.
//!
//! Each fixture sends one frame and expects verdict TC_ACT_REDIRECT (the program redirects
//! the answer to egress of the interface it came in on; BPF_PROG_TEST_RUN reports the verdict
//! and does not perform the redirect) and exactly the answer built here, independently of the
//! program, from the input frame:
//!
//! - Ethernet addresses swapped, ethertype IPv4;
//! - IPv4: IHL 5, TOS 0xc0 | (input TOS & 0x1e), ID 0, no flags, TTL 64, protocol 1, from the
//!   service address to the client, valid header checksum;
//! - ICMP type 3 code 3, unused word 0, valid checksum;
//! - the quote: the input's IPv4 header as it was (options included) and the first 8 (UDP) or
//!   20 (TCP) bytes of its L4 header, zero-filled where the input was shorter, except the
//!   quoted L4 checksum field, which holds the fixed point of a checksum offload over the
//!   quoted L4 bytes (found here by trying all 65 536 values).
//!
//! Every answer is also checked without reference to the expected bytes: header and ICMP
//! checksums, the quote against the input, and that emulating `skb_checksum_help` (what a
//! CHECKSUM_PARTIAL skb gets on its way out of a device without checksum offload) leaves the
//! frame unchanged. Needs root (BPF and mount).

use testbed::fixtures::{frame, harness, icmp_quote, table};

use anyhow::{bail, ensure, Context as _, Result};
use aya::maps::{lpm_trie::Key, HashMap, LpmTrie, Map, MapData};
use frame::{
    checksum, ep, fold, hex, input_and_output, max_ip_options, ones_sum, Ep, Packet, ETH_HLEN, ETH_P_IP,
    IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP, L4, ROUTER_ALERT,
};
use harness::{describe_flows, nat_entries, verdict_name, Harness, TC_ACT_OK, TC_ACT_SHOT};
use icmp_quote::{l4_quote, offload_checksum, offload_fixed_point};
use proxy_common::{flow_flags, pins, service_flags, source_class, unmatched, Service, ServiceKey4};
use table::{run_table, Outcome};

/// TC_ACT_REDIRECT, as BPF_PROG_TEST_RUN reports the program's return.
const TC_ACT_REDIRECT: u32 = 7;

const CLIENT: Ep = ep([192, 168, 1, 100], 40000);
/// A cluster IP with a TCP and a UDP frontend, both without endpoints and REJECT_WHEN_EMPTY.
const EMPTY_VIP: [u8; 4] = [10, 96, 0, 20];
const EMPTY_TCP: Ep = ep(EMPTY_VIP, 80);
const EMPTY_UDP: Ep = ep(EMPTY_VIP, 53);
/// A frontend with an endpoint, on the same address.
const FULL_TCP: Ep = ep(EMPTY_VIP, 443);
const FULL_BACKEND: Ep = ep([10, 244, 1, 5], 8443);
/// A frontend without endpoints whose service does not ask for REJECT: dropped silently.
const SILENT_TCP: Ep = ep(EMPTY_VIP, 8000);
/// A port the cluster IP does not serve: the unmatched map says REJECT for the address.
const UNSERVED_TCP: Ep = ep(EMPTY_VIP, 9999);
const UNSERVED_UDP: Ep = ep(EMPTY_VIP, 9999);

fn world(h: &mut Harness) -> Result<()> {
    h.add_service(EMPTY_TCP, IPPROTO_TCP, 1, &[])?;
    h.add_service(EMPTY_UDP, IPPROTO_UDP, 2, &[])?;
    h.add_service(FULL_TCP, IPPROTO_TCP, 3, &[FULL_BACKEND])?;
    h.add_service(SILENT_TCP, IPPROTO_TCP, 4, &[])?;
    for (frontend, proto) in [(EMPTY_TCP, IPPROTO_TCP), (EMPTY_UDP, IPPROTO_UDP), (FULL_TCP, IPPROTO_TCP)] {
        add_service_flags(h, frontend, proto, service_flags::REJECT_WHEN_EMPTY)?;
    }
    set_unmatched(h, EMPTY_VIP, unmatched::REJECT)
}

/// The harness has no setter for these; the maps are pinned in its bpffs.
fn pinned(h: &Harness, name: &str) -> Result<Map> {
    let path = h.bpffs().join(name);
    let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    Ok(Map::from_map_data(data)?)
}

fn add_service_flags(h: &Harness, frontend: Ep, proto: u8, flags: u32) -> Result<()> {
    let mut services: HashMap<MapData, ServiceKey4, Service> = pinned(h, pins::SERVICES4)?.try_into()?;
    let key =
        ServiceKey4 { addr: frontend.addr, port: frontend.port, proto, source_class: source_class::OUTSIDE };
    let mut service = services.get(&key, 0).with_context(|| format!("no service entry for {frontend}"))?;
    service.flags |= flags;
    services.insert(key, service, 0)?;
    Ok(())
}

fn set_unmatched(h: &Harness, addr: [u8; 4], action: u8) -> Result<()> {
    let mut trie: LpmTrie<MapData, [u8; 4], u8> = pinned(h, pins::UNMATCHED4)?.try_into()?;
    trie.insert(&Key::new(32, addr), action, 0)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The expected answer, built from the input frame alone.

/// Where the parts of an answer lie.
#[derive(Clone, Copy, Debug)]
struct Layout {
    /// Length of the input's IPv4 header.
    ihl: usize,
    proto: u8,
}

impl Layout {
    fn of_input(input: &[u8]) -> Self {
        let ip = &input[ETH_HLEN..];
        Self { ihl: usize::from(ip[0] & 0x0f) * 4, proto: ip[9] }
    }

    const ICMP_AT: usize = ETH_HLEN + 20;
    const QUOTE_AT: usize = Self::ICMP_AT + 8;

    fn quote_l4_at(self) -> usize {
        Self::QUOTE_AT + self.ihl
    }

    fn quote_len(self) -> usize {
        self.ihl + l4_quote(self.proto).0
    }

    fn frame_len(self) -> usize {
        Self::QUOTE_AT + self.quote_len()
    }

    fn quoted_csum_at(self) -> usize {
        self.quote_l4_at() + l4_quote(self.proto).1
    }
}

fn expected_answer(input: &[u8]) -> Vec<u8> {
    expected_answer_with(input, PORT_UNREACHABLE)
}

/// ICMP type 3 code 3, unused word 0.
const PORT_UNREACHABLE: [u8; 8] = [3, 3, 0, 0, 0, 0, 0, 0];

/// [`expected_answer`] with `header` as the ICMP header (its checksum filled in).
fn expected_answer_with(input: &[u8], header: [u8; 8]) -> Vec<u8> {
    let layout = Layout::of_input(input);
    let ip = &input[ETH_HLEN..];
    let (src, dst) = (&ip[12..16], &ip[16..20]);
    let (l4_len, csum_at) = l4_quote(layout.proto);

    let mut quote = ip.to_vec();
    quote.resize(layout.quote_len(), 0);
    let settled = offload_fixed_point(&quote[layout.ihl..], csum_at);
    quote[layout.ihl + csum_at..layout.ihl + csum_at + 2].copy_from_slice(&settled.to_be_bytes());
    assert_eq!(quote.len(), layout.ihl + l4_len);

    let mut icmp = header.to_vec();
    icmp.extend_from_slice(&quote);
    let icmp_csum = checksum(ones_sum(0, &icmp));
    icmp[2..4].copy_from_slice(&icmp_csum.to_be_bytes());

    let total_len = u16::try_from(20 + icmp.len()).unwrap();
    let mut iph = vec![0x45, 0xc0 | (ip[1] & 0x1e)];
    iph.extend_from_slice(&total_len.to_be_bytes());
    iph.extend_from_slice(&[0, 0, 0, 0, 64, IPPROTO_ICMP, 0, 0]);
    iph.extend_from_slice(dst);
    iph.extend_from_slice(src);
    let ip_csum = checksum(ones_sum(0, &iph));
    iph[10..12].copy_from_slice(&ip_csum.to_be_bytes());

    let mut frame = Vec::new();
    frame.extend_from_slice(&input[6..12]);
    frame.extend_from_slice(&input[0..6]);
    frame.extend_from_slice(&ETH_P_IP.to_be_bytes());
    frame.extend_from_slice(&iph);
    frame.extend_from_slice(&icmp);
    assert_eq!(frame.len(), layout.frame_len());
    frame
}

/// Checks an answer without the expected bytes: what a receiving kernel relies on.
fn check_answer_alone(input: &[u8], out: &[u8]) -> Result<()> {
    check_answer_alone_with(input, out, PORT_UNREACHABLE)
}

/// [`check_answer_alone`] for an answer whose ICMP header is `header` but for its checksum.
fn check_answer_alone_with(input: &[u8], out: &[u8], header: [u8; 8]) -> Result<()> {
    let layout = Layout::of_input(input);
    ensure!(out.len() == layout.frame_len(), "answer is {} bytes, not {}", out.len(), layout.frame_len());
    ensure!(out[0..6] == input[6..12] && out[6..12] == input[0..6], "Ethernet addresses not swapped");
    ensure!(out[12..14] == ETH_P_IP.to_be_bytes(), "ethertype is not IPv4");
    let ip = &out[ETH_HLEN..];
    ensure!(ip[0] == 0x45, "new IPv4 header starts with {:#04x}", ip[0]);
    ensure!(fold(ones_sum(0, &ip[..20])) == 0xffff, "IPv4 header checksum invalid");
    ensure!(usize::from(u16::from_be_bytes([ip[2], ip[3]])) == out.len() - ETH_HLEN, "IPv4 total length");
    ensure!(ip[6] & 0x40 == 0, "DF is set");
    ensure!((ip[8], ip[9]) == (64, IPPROTO_ICMP), "TTL/protocol {}/{}", ip[8], ip[9]);
    let original = &input[ETH_HLEN..];
    ensure!(ip[12..16] == original[16..20], "source is not the service address");
    ensure!(ip[16..20] == original[12..16], "destination is not the client");
    let icmp = &out[Layout::ICMP_AT..];
    ensure!((icmp[0], icmp[1]) == (header[0], header[1]), "ICMP type/code {}/{}", icmp[0], icmp[1]);
    ensure!(icmp[4..8] == header[4..8], "ICMP second word {:02x?}, not {:02x?}", &icmp[4..8], &header[4..8]);
    ensure!(fold(ones_sum(0, icmp)) == 0xffff, "ICMP checksum invalid");
    let quote = &out[Layout::QUOTE_AT..];
    ensure!(quote[..layout.ihl] == original[..layout.ihl], "quoted IPv4 header differs from the input's");
    // The L4 quote is the input's, zero-filled, except the checksum field.
    let (l4_len, csum_at) = l4_quote(layout.proto);
    for i in 0..l4_len {
        if i == csum_at || i == csum_at + 1 {
            continue;
        }
        let want = original.get(layout.ihl + i).copied().unwrap_or(0);
        ensure!(
            quote[layout.ihl + i] == want,
            "quoted L4 byte {i}: {:#04x}, input {want:#04x}",
            quote[layout.ihl + i]
        );
    }
    // A CHECKSUM_PARTIAL skb leaving a device without checksum offload.
    let mut offloaded = out.to_vec();
    let field = layout.quoted_csum_at();
    let c = offload_checksum(&offloaded[layout.quote_l4_at()..]);
    offloaded[field..field + 2].copy_from_slice(&c.to_be_bytes());
    ensure!(offloaded == out, "a checksum offload would change the quoted checksum field to {c:#06x}");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The table.

struct Fixture {
    name: &'static str,
    input: Vec<u8>,
}

fn fixture(name: &'static str, input: Vec<u8>) -> Fixture {
    Fixture { name, input }
}

fn tcp_with_flags(from: Ep, to: Ep, flags: u8) -> Packet {
    let mut packet = Packet::tcp(from, to).payload(&[]);
    match &mut packet.l4 {
        L4::Tcp { flags: f, .. } => *f = flags,
        _ => unreachable!(),
    }
    packet
}

fn syn(from: Ep, to: Ep) -> Packet {
    tcp_with_flags(from, to, 0x02)
}

fn fixtures() -> Vec<Fixture> {
    let mut tcp_truncated = Packet::tcp(CLIENT, EMPTY_TCP).build();
    tcp_truncated.truncate(ETH_HLEN + 20 + 18);
    let mut tos = Packet::udp(CLIENT, EMPTY_UDP);
    tos.tos = 0xbb; // DSCP 46 + ECN CE: the TOS bits 0x1a stay, precedence 6, no ECN
    vec![
        fixture("tcp_syn", syn(CLIENT, EMPTY_TCP).build()),
        fixture("tcp_data_segment", Packet::tcp(CLIENT, EMPTY_TCP).build()),
        fixture("tcp_syn_ihl6_router_alert", syn(CLIENT, EMPTY_TCP).ip_options(&ROUTER_ALERT).build()),
        fixture("tcp_syn_ihl15", syn(CLIENT, EMPTY_TCP).ip_options(&max_ip_options()).build()),
        fixture("tcp_syn_without_df", syn(CLIENT, EMPTY_TCP).frag(0).build()),
        // The parser needs the checksum field; the urgent pointer is missing: the quote is
        // grown with zeros.
        fixture("tcp_truncated_after_checksum", tcp_truncated),
        fixture("udp_datagram", Packet::udp(CLIENT, EMPTY_UDP).build()),
        fixture("udp_ihl6_router_alert", Packet::udp(CLIENT, EMPTY_UDP).ip_options(&ROUTER_ALERT).build()),
        fixture("udp_ihl15", Packet::udp(CLIENT, EMPTY_UDP).ip_options(&max_ip_options()).build()),
        fixture("udp_large_payload_truncated", Packet::udp(CLIENT, EMPTY_UDP).payload(&[0xa5; 1400]).build()),
        fixture("udp_without_payload", Packet::udp(CLIENT, EMPTY_UDP).payload(&[]).build()),
        fixture(
            "udp_short_with_ethernet_padding",
            Packet::udp(CLIENT, EMPTY_UDP).payload(b"x").pad_to_ethernet_minimum().build(),
        ),
        fixture("udp_without_checksum", Packet::udp(CLIENT, EMPTY_UDP).no_udp_checksum().build()),
        fixture("tos_bits_kept_precedence_6_no_ecn", tos.build()),
        // Not a frontend at all: a port the cluster IP does not serve.
        fixture("tcp_syn_to_unserved_port", syn(CLIENT, UNSERVED_TCP).build()),
        fixture("udp_to_unserved_port", Packet::udp(CLIENT, UNSERVED_UDP).build()),
    ]
}

fn run_fixture(fixture: &Fixture) -> Result<()> {
    let mut h = Harness::new()?;
    world(&mut h).context("setup")?;
    let (verdict, out) = h.run(&fixture.input)?;
    let observed = || input_and_output(&fixture.input, &out);
    ensure!(
        verdict == TC_ACT_REDIRECT,
        "verdict: expected TC_ACT_REDIRECT (7), got {}\n  {}",
        verdict_name(verdict),
        observed()
    );
    let expected = expected_answer(&fixture.input);
    if out != expected {
        let at = expected.iter().zip(&out).position(|(e, a)| e != a).unwrap_or(expected.len().min(out.len()));
        bail!(
            "answer differs from the expected one (first at offset {at}; lengths {} and {})\n  expected:{}\n  {}",
            expected.len(),
            out.len(),
            hex(&expected),
            observed()
        );
    }
    check_answer_alone(&fixture.input, &out).with_context(observed)?;
    let flows = h.flows()?;
    ensure!(flows.is_empty(), "a rejected packet recorded flows:\n{}", describe_flows(&flows));
    Ok(())
}

#[test]
fn reject_fixture_table() {
    run_table(&fixtures(), |fixture| fixture.name, |fixture| run_fixture(fixture).map(|()| Outcome::Passed));
}

/// A frontend with endpoints on the same address is balanced as before, a frontend without
/// endpoints whose service does not ask for REJECT still drops, and a tracked flow to the
/// frontend without endpoints keeps going to its backend: only new flows are rejected.
#[test]
fn only_new_flows_to_frontends_without_endpoints_are_rejected() {
    let run = || -> Result<()> {
        let mut h = Harness::new()?;
        world(&mut h)?;
        let input = syn(CLIENT, FULL_TCP);
        let (verdict, out) = h.run(&input.build())?;
        ensure!(verdict == TC_ACT_OK, "frontend with endpoints: verdict {}", verdict_name(verdict));
        ensure!(
            out == input.clone().to(FULL_BACKEND).build(),
            "frontend with endpoints: output{}",
            hex(&out)
        );

        let input = syn(CLIENT, SILENT_TCP).build();
        let (verdict, out) = h.run(&input)?;
        ensure!(verdict == TC_ACT_SHOT, "no endpoints, no REJECT: verdict {}", verdict_name(verdict));
        ensure!(out == input, "no endpoints, no REJECT: output changed{}", hex(&out));

        let old_backend = ep([10, 244, 9, 9], 9090);
        for (k, v) in nat_entries(CLIENT, EMPTY_TCP, old_backend, IPPROTO_TCP) {
            h.insert_flow(k, v)?;
        }
        let input = Packet::tcp(CLIENT, EMPTY_TCP);
        let (verdict, out) = h.run(&input.build())?;
        ensure!(verdict == TC_ACT_OK, "tracked flow: verdict {}", verdict_name(verdict));
        ensure!(out == input.clone().to(old_backend).build(), "tracked flow: output{}", hex(&out));

        let other_client = ep(CLIENT.addr, CLIENT.port + 1);
        let input = syn(other_client, EMPTY_TCP).build();
        let (verdict, out) = h.run(&input)?;
        ensure!(verdict == TC_ACT_REDIRECT, "new flow: verdict {}", verdict_name(verdict));
        ensure!(out == expected_answer(&input), "new flow: output{}", hex(&out));
        Ok(())
    };
    run().unwrap_or_else(|err| panic!("{err:#}"));
}

/// The node's rejects are rate-limited as the kernel's own ICMP errors (1000/s after a burst of
/// 50): a flood toward a service without endpoints gets a burst of answers, then about one
/// per millisecond; the rest is dropped and counted.
#[test]
fn rejects_are_rate_limited() {
    let run = || -> Result<()> {
        let mut h = Harness::new()?;
        world(&mut h)?;
        const FLOOD: u16 = 2000;
        let (mut answered, mut dropped) = (0u64, 0u64);
        let started = std::time::Instant::now();
        for port in 0..FLOOD {
            let (verdict, _) = h.run(&syn(ep(CLIENT.addr, 20000 + port), EMPTY_TCP).build())?;
            match verdict {
                TC_ACT_REDIRECT => answered += 1,
                TC_ACT_SHOT => dropped += 1,
                other => bail!("verdict {}", verdict_name(other)),
            }
        }
        let elapsed_ms = started.elapsed().as_millis() as u64;
        ensure!(answered >= 50, "only {answered} of {FLOOD} answered: the burst is 50");
        ensure!(
            answered <= 50 + elapsed_ms + 1,
            "{answered} of {FLOOD} answered in {elapsed_ms} ms: more than the burst and 1/ms"
        );
        ensure!(dropped > 0, "nothing dropped");
        let counted = h.datapath_stat(proxy_common::datapath_stat::REJECT_RATE_LIMITED)?;
        ensure!(counted == dropped, "{counted} counted, {dropped} dropped");
        Ok(())
    };
    run().unwrap_or_else(|err| panic!("{err:#}"));
}

/// The expected-answer builder itself: its fixed point is what the closed form gives, and the
/// checks notice damage anywhere in an answer.
#[test]
fn answer_checks_can_fail() {
    let input = syn(CLIENT, EMPTY_TCP).ip_options(&ROUTER_ALERT).build();
    let answer = expected_answer(&input);
    check_answer_alone(&input, &answer).expect("the expected answer passes its own checks");
    for i in 0..answer.len() {
        let mut damaged = answer.clone();
        damaged[i] ^= 0x01;
        assert!(check_answer_alone(&input, &damaged).is_err(), "flipping a bit of byte {i} went unnoticed");
    }
    let mut longer = answer.clone();
    longer.push(0);
    assert!(check_answer_alone(&input, &longer).is_err());
    // The closed form vipr uses: f = rotr1(!fold(others)), 0 as 0xffff.
    for others in [0u32, 1, 0xfffe, 0xffff, 0x1_0000, 0x1234_5678, 0x0002_fffd] {
        let mut region = vec![0u8; 8];
        let folded = fold(others);
        region[0..2].copy_from_slice(&folded.to_be_bytes());
        let closed = match (!folded).rotate_right(1) {
            0 => 0xffff,
            f => f,
        };
        assert_eq!(offload_fixed_point(&region, 6), closed, "others {others:#x}");
    }
}

/// A tracked connection's packet that vipr sends on itself (`--bpf-forwarding=redirect`) is
/// checked against the MTU of its way, as the kernel's forwarding checks a packet it forwards
/// (`bpf_redirect` checks nothing): too big and not to be fragmented (DF), it is answered with
/// "fragmentation needed" naming the MTU, quoting the packet as the client sent it (to the
/// service address), so that the client's path MTU discovery works through the service; without
/// DF it goes to the stack, rewritten, which fragments it. A cached next hop is checked against
/// its device's MTU for every packet larger than 1280 bytes (a hop is cached only where the MTUs
/// are at least that, and a change moves the route generation); a route whose MTU is below its
/// device's is never cached, and its packets meet the route's MTU in the lookup. IPv6 is
/// answered with "packet too big".
#[test]
fn a_tracked_packet_too_big_for_its_way_is_answered_as_a_router_would() {
    use testbed::fixtures::{
        frame6::{ep6, ip6, Packet6},
        harness::flow_key,
        harness6::{add_service6, flows6},
        icmp_error::check_icmp6_answer,
        netns::{in_fresh_netns, ip},
    };
    const FRONTEND: Ep = ep([10, 96, 0, 30], 53);
    const BACKEND: Ep = ep([10, 244, 2, 10], 5353);
    const MASQUERADED: Ep = ep([10, 96, 0, 31], 53);
    let frontend6 = ep6(ip6([0xfd00, 0x96, 0, 0], 0x30), 53);
    let backend6 = ep6(ip6([0xfd00, 0x244, 0, 2], 0x10), 5353);
    let client6 = ep6(ip6([0x2001, 0xdb8, 1, 0], 0x64), 40000);
    in_fresh_netns(|| {
        ip(&["link", "set", "lo", "up"])?;
        ip(&["link", "add", "vd0", "mtu", "1500", "type", "veth", "peer", "name", "vd1"])?;
        ip(&["link", "set", "vd1", "up"])?;
        ip(&["link", "set", "vd0", "up"])?;
        ip(&["addr", "add", "192.168.100.1/24", "dev", "vd0"])?;
        ip(&["-6", "addr", "add", "fd00:100::1/64", "dev", "vd0", "nodad"])?;
        let node_two_mac = "02:cc:00:00:00:02";
        for (family, cidr, node_two) in
            [("-4", "10.244.2.0/24", "192.168.100.2"), ("-6", "fd00:244:0:2::/64", "fd00:100::2")]
        {
            ip(&[family, "route", "add", cidr, "via", node_two])?;
            ip(&[
                family,
                "neigh",
                "add",
                node_two,
                "lladdr",
                node_two_mac,
                "dev",
                "vd0",
                "nud",
                "permanent",
            ])?;
        }
        for family in ["ipv4", "ipv6"] {
            std::fs::write(format!("/proc/sys/net/{family}/conf/all/forwarding"), "1")?;
        }
        let mut h = Harness::new()?;
        h.add_service(FRONTEND, IPPROTO_UDP, 1, &[BACKEND])?;
        h.add_service_with_flags(MASQUERADED, IPPROTO_UDP, 3, &[BACKEND], service_flags::MASQUERADE)?;
        add_service6(&h, frontend6, IPPROTO_UDP, source_class::OUTSIDE, 2, &[backend6], 0)?;
        h.set_route_generation(3)?;
        let datagram = |len: usize| Packet::udp(CLIENT, FRONTEND).payload(&vec![0x5a; len]);
        let run = |packet: &Packet, want: u32, what: &str| -> Result<(Vec<u8>, Vec<u8>)> {
            let input = packet.build();
            let (verdict, out) = h.run(&input)?;
            ensure!(
                verdict == want,
                "{what}: verdict {}\n  {}",
                verdict_name(verdict),
                input_and_output(&input, &out)
            );
            Ok((input, out))
        };
        let answered = |packet: &Packet, mtu: u16, what: &str| -> Result<()> {
            let (input, out) = run(packet, TC_ACT_REDIRECT, what)?;
            let [high, low] = mtu.to_be_bytes();
            let header = [3, 4, 0, 0, 0, 0, high, low];
            ensure!(
                out == expected_answer_with(&input, header),
                "{what}: not the expected answer\n  {}",
                input_and_output(&input, &out)
            );
            check_answer_alone_with(&input, &out, header).with_context(|| what.to_string())
        };
        let to_backend =
            |out: &[u8]| out.len() > ETH_HLEN + 20 && out[ETH_HLEN + 16..ETH_HLEN + 20] == BACKEND.addr;

        // Balanced, then its hop cached.
        for round in 0..2 {
            let (_, out) = run(&datagram(1000), TC_ACT_REDIRECT, "a datagram that fits")?;
            ensure!(to_backend(&out), "round {round}: not sent to the backend");
        }
        let entry = h.flows()?[&flow_key(CLIENT, FRONTEND, IPPROTO_UDP)];
        ensure!(
            entry.next_hop.ifindex != 0 && entry.flags >> flow_flags::ROUTE_GENERATION_SHIFT == 3,
            "not cached: {entry:?}"
        );

        // IPv6: "packet too big" with the cached device's MTU (first: an MTU below 1280 takes
        // IPv6 off the device).
        let datagram6 = |len: usize| Packet6::udp(client6, frontend6).payload(&vec![0x5a; len]);
        for round in 0..2 {
            let (verdict, out) = h.run(&datagram6(1000).build())?;
            ensure!(
                verdict == TC_ACT_REDIRECT,
                "IPv6 round {round}: verdict {} out {}",
                verdict_name(verdict),
                hex(&out[..80])
            );
        }
        ensure!(
            flows6(&h)?.values().any(|entry| entry.next_hop.ifindex != 0),
            "IPv6 hop not cached: {:?}",
            flows6(&h)?
        );
        ip(&["link", "set", "vd0", "mtu", "1300"])?;
        let input = datagram6(1400).build();
        let (verdict, out) = h.run(&input)?;
        ensure!(verdict == TC_ACT_REDIRECT, "IPv6 too big: verdict {}", verdict_name(verdict));
        let icmp = check_icmp6_answer(&input, &out, [2, 0, 0, 0, 0, 0, 0x05, 0x14])?;
        ensure!(icmp[8..48] == input[ETH_HLEN..ETH_HLEN + 40], "the quote is not the datagram's IPv6 header");

        // The device's MTU drops under the same generation: the cached hop is checked.
        // (IPv6 left it at 1300.) A packet of at most 1280 bytes fits every cached hop's device.
        ip(&["link", "set", "vd0", "mtu", "1300"])?;
        answered(&datagram(1400), 1300, "too big for the cached hop's device")?;
        let (_, out) = run(&datagram(1400).frag(0), TC_ACT_OK, "too big, without DF")?;
        ensure!(to_backend(&out), "a datagram without DF went to the stack unrewritten");
        let (_, out) = run(&datagram(1200), TC_ACT_REDIRECT, "a datagram that fits the device")?;
        ensure!(to_backend(&out), "not sent to the backend");

        // A route with a smaller MTU than its device's: not cached, checked in the lookup.
        ip(&["link", "set", "vd0", "mtu", "1500"])?;
        ip(&["route", "replace", "10.244.2.0/24", "via", "192.168.100.2", "mtu", "lock", "700"])?;
        h.set_route_generation(4)?;
        let (_, out) = run(&datagram(600), TC_ACT_REDIRECT, "a datagram that fits the route")?;
        ensure!(to_backend(&out), "not sent to the backend");
        let entry = h.flows()?[&flow_key(CLIENT, FRONTEND, IPPROTO_UDP)];
        ensure!(
            entry.flags >> flow_flags::ROUTE_GENERATION_SHIFT == 3,
            "cached under the smaller route MTU: {entry:?}"
        );
        answered(&datagram(1000), 700, "too big for the route")?;

        // A masqueraded connection's packet too big without DF cannot go into the stack
        // rewritten (its source is then the node's own, which the stack drops as a martian):
        // answered as one with DF is, its first packet (a new connection) and a later one alike.
        ip(&["route", "replace", "10.244.2.0/24", "via", "192.168.100.2"])?;
        ip(&["link", "set", "vd0", "mtu", "1300"])?;
        h.set_route_generation(5)?;
        let masqueraded = |len: usize| Packet::udp(CLIENT, MASQUERADED).payload(&vec![0x5a; len]);
        answered(&masqueraded(1400).frag(0), 1300, "a new masqueraded connection's datagram without DF")?;
        ensure!(
            !h.flows()?.contains_key(&flow_key(CLIENT, MASQUERADED, IPPROTO_UDP)),
            "a connection answered \"too big\" was stored"
        );
        let (_, out) = run(&masqueraded(1000), TC_ACT_REDIRECT, "a masqueraded datagram that fits")?;
        ensure!(
            to_backend(&out) && out[ETH_HLEN + 12..ETH_HLEN + 16] == [192, 168, 100, 1],
            "not masqueraded to the backend"
        );
        answered(&masqueraded(1400).frag(0), 1300, "a masqueraded connection's datagram without DF")?;

        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}
