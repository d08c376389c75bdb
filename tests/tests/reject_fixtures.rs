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
use proxy_common::{pins, service_flags, source_class, unmatched, Service, ServiceKey4};
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
    let layout = Layout::of_input(input);
    let ip = &input[ETH_HLEN..];
    let (src, dst) = (&ip[12..16], &ip[16..20]);
    let (l4_len, csum_at) = l4_quote(layout.proto);

    let mut quote = ip.to_vec();
    quote.resize(layout.quote_len(), 0);
    let settled = offload_fixed_point(&quote[layout.ihl..], csum_at);
    quote[layout.ihl + csum_at..layout.ihl + csum_at + 2].copy_from_slice(&settled.to_be_bytes());
    assert_eq!(quote.len(), layout.ihl + l4_len);

    let mut icmp = vec![3, 3, 0, 0, 0, 0, 0, 0];
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
    ensure!((icmp[0], icmp[1]) == (3, 3), "ICMP type/code {}/{}", icmp[0], icmp[1]);
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
