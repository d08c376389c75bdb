//! Katran-style fixtures for IPv4 fragments (proxy-ebpf/src/fragment.rs), run with
//! BPF_PROG_TEST_RUN.
//!
//! A datagram is built whole and split here as its sender would split it
//! (fixtures/fragment.rs); the expected fragments are the same datagram built toward its new
//! destination (or from its new source) and split the same way. Every fragment that comes
//! back rewritten must equal its expected fragment and have a valid IPv4 header checksum, and
//! the L4 part of the rewritten fragments, put back together, must have a valid TCP/UDP
//! checksum over the new pseudo header: only the first fragment's checksum field changes, and
//! it must cover the whole datagram. Each scenario runs its fragments in order on one harness
//! with the standard world below. Needs root (BPF and mount).

use testbed::fixtures::{fragment, frame, harness, table};

use std::collections::HashMap;

use anyhow::{ensure, Result};
use fragment::{fragments, reassemble};
use frame::{
    compare_frames, ep, fold, input_and_output, ones_sum, pseudo_header_sum, Ep, Packet, ETH_HLEN,
    IPPROTO_TCP, IPPROTO_UDP,
};
use harness::{check_verdict, nat_entries, Harness, TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC};
use proxy_common::{unmatched, FragmentKey4, FragmentPorts};
use table::{run_table, Outcome};

const CLIENT: Ep = ep([192, 168, 1, 100], 40000);
const OTHER_CLIENT: Ep = ep([192, 168, 1, 101], 40000);
const VIP: [u8; 4] = [10, 96, 0, 10];
const DNS: Ep = ep(VIP, 53);
const DNS_BACKEND: Ep = ep([10, 244, 2, 7], 5353);
const WEB: Ep = ep(VIP, 80);
const WEB_BACKEND: Ep = ep([10, 244, 1, 5], 8080);
/// In the service range, no cluster IP: the unmatched trie says DROP.
const UNUSED_SERVICE_ADDR: [u8; 4] = [10, 96, 5, 5];
/// The IP identification every datagram here carries, unless a scenario changes it.
const ID: u16 = 0x1c46;

/// Two frontends on a cluster IP, which the unmatched trie knows (REJECT), in a service range
/// (DROP).
fn world(h: &mut Harness) -> Result<()> {
    h.add_service(DNS, IPPROTO_UDP, 1, &[DNS_BACKEND])?;
    h.add_service(WEB, IPPROTO_TCP, 2, &[WEB_BACKEND])?;
    h.set_unmatched(16, [10, 96, 0, 0], unmatched::DROP)?;
    h.set_unmatched(32, VIP, unmatched::REJECT)
}

/// A datagram of `proto` from `from` to `to` with 100 bytes of payload, without DF, ready to
/// be split.
fn datagram(proto: u8, from: Ep, to: Ep) -> Packet {
    let payload: Vec<u8> = (0..100u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
    let packet = if proto == IPPROTO_TCP { Packet::tcp(from, to) } else { Packet::udp(from, to) };
    packet.payload(&payload).frag(0)
}

/// Runs `input`; checks the verdict, and that a dropped or ignored frame is unchanged.
fn run(h: &Harness, input: &[u8], verdict: u32) -> Result<Vec<u8>> {
    let (got, out) = h.run(input)?;
    check_verdict(input, got, &out, verdict, verdict != TC_ACT_OK)?;
    Ok(out)
}

/// Runs the fragments of `input` in the order `order`, each expected to become the fragment
/// of `output` at the same place; then checks the rewritten datagram's L4 checksum.
fn rewritten_in_order(
    h: &Harness,
    input: &Packet,
    output: &Packet,
    cuts: &[usize],
    order: &[usize],
) -> Result<()> {
    let (inputs, expected) = (fragments(&input.build(), cuts), fragments(&output.build(), cuts));
    let mut outs = Vec::new();
    for &i in order {
        let out = run(h, &inputs[i], TC_ACT_OK)?;
        let ihl = usize::from(out[ETH_HLEN] & 0x0f) * 4;
        ensure!(
            fold(ones_sum(0, &out[ETH_HLEN..ETH_HLEN + ihl])) == 0xffff,
            "fragment {i}: IPv4 header checksum invalid\n  {}",
            input_and_output(&inputs[i], &out)
        );
        compare_frames(&expected[i], &out).map_err(|e| anyhow::anyhow!("fragment {i}: {e}"))?;
        outs.push(out);
    }
    let l4 = reassemble(&outs);
    let ip = &outs[0][ETH_HLEN..];
    let (src, dst) = (ip[12..16].try_into()?, ip[16..20].try_into()?);
    let sum = ones_sum(pseudo_header_sum(src, dst, ip[9], l4.len()), &l4);
    ensure!(fold(sum) == 0xffff, "the reassembled datagram's L4 checksum is invalid");
    Ok(())
}

fn expect_flows(h: &Harness, client: Ep, frontend: Ep, backend: Ep, proto: u8) -> Result<()> {
    h.expect_flows(&nat_entries(client, frontend, backend, proto))
}

/// The record of a first fragment from `from` to `to`: its ports, as they arrived.
fn record(from: Ep, to: Ep, id: u16, proto: u8) -> (FragmentKey4, FragmentPorts) {
    (
        FragmentKey4 { src_addr: from.addr, dst_addr: to.addr, id, proto, pad: 0 },
        FragmentPorts { src_port: from.port, dst_port: to.port },
    )
}

fn udp_in_two_fragments(h: &mut Harness) -> Result<()> {
    let input = datagram(IPPROTO_UDP, CLIENT, DNS);
    rewritten_in_order(h, &input, &input.clone().to(DNS_BACKEND), &[40], &[0, 1])?;
    expect_flows(h, CLIENT, DNS, DNS_BACKEND, IPPROTO_UDP)?;
    let records = h.fragments()?;
    let expected = HashMap::from([record(CLIENT, DNS, ID, IPPROTO_UDP)]);
    ensure!(records == expected, "fragments map: {records:?}, expected {expected:?}");
    Ok(())
}

/// The last fragment may overtake a middle one: the record stays until LRU eviction.
fn udp_in_three_fragments_last_before_middle(h: &mut Harness) -> Result<()> {
    let input = datagram(IPPROTO_UDP, CLIENT, DNS);
    rewritten_in_order(h, &input, &input.clone().to(DNS_BACKEND), &[40, 80], &[0, 2, 1])?;
    expect_flows(h, CLIENT, DNS, DNS_BACKEND, IPPROTO_UDP)
}

fn tcp_in_two_fragments(h: &mut Harness) -> Result<()> {
    let input = datagram(IPPROTO_TCP, CLIENT, WEB);
    rewritten_in_order(h, &input, &input.clone().to(WEB_BACKEND), &[64], &[0, 1])?;
    expect_flows(h, CLIENT, WEB, WEB_BACKEND, IPPROTO_TCP)
}

/// A backend's fragmented reply gets the frontend as source, every fragment of it.
fn reply_in_two_fragments(h: &mut Harness) -> Result<()> {
    let request = datagram(IPPROTO_UDP, CLIENT, DNS).build();
    run(h, &request, TC_ACT_OK)?;
    let reply = datagram(IPPROTO_UDP, DNS_BACKEND, CLIENT);
    rewritten_in_order(h, &reply, &reply.clone().from(DNS), &[40], &[0, 1])?;
    expect_flows(h, CLIENT, DNS, DNS_BACKEND, IPPROTO_UDP)
}

fn later_fragment_without_first(to: Ep, verdict: u32) -> impl Fn(&mut Harness) -> Result<()> {
    move |h| {
        let later = &fragments(&datagram(IPPROTO_UDP, CLIENT, to).build(), &[40])[1];
        run(h, later, verdict)?;
        h.expect_flows(&[])
    }
}

/// Later fragments that differ from the first fragment's datagram in one of (source,
/// destination, IP id, protocol) do not take its record; the datagram's own one does.
fn record_only_for_its_datagram(h: &mut Harness) -> Result<()> {
    let input = datagram(IPPROTO_UDP, CLIENT, DNS);
    let first = &fragments(&input.build(), &[40])[0];
    run(h, first, TC_ACT_OK)?;
    let later = |packet: Packet| fragments(&packet.build(), &[40])[1].clone();
    let mut other_id = input.clone();
    other_id.id = ID + 1;
    let strangers = [
        ("other id", later(other_id)),
        ("other source", later(input.clone().from(OTHER_CLIENT))),
        ("other destination", later(input.clone().to(ep(UNUSED_SERVICE_ADDR, DNS.port)))),
        ("other protocol", later(datagram(IPPROTO_TCP, CLIENT, DNS))),
    ];
    for (what, frame) in &strangers {
        run(h, frame, TC_ACT_SHOT).map_err(|e| e.context(*what))?;
    }
    let out = run(h, &later(input.clone()), TC_ACT_OK)?;
    compare_frames(&later(input.clone().to(DNS_BACKEND)), &out).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

/// A scenario's packets and checks, on a harness with the standard world.
type Steps = Box<dyn Fn(&mut Harness) -> Result<()>>;

struct Scenario {
    name: &'static str,
    run: Steps,
}

fn scenario(name: &'static str, run: impl Fn(&mut Harness) -> Result<()> + 'static) -> Scenario {
    Scenario { name, run: Box::new(run) }
}

#[test]
fn fragment_scenarios() {
    let scenarios = [
        scenario("udp_in_two_fragments_to_a_vip", udp_in_two_fragments),
        scenario("udp_in_three_fragments_last_before_middle", udp_in_three_fragments_last_before_middle),
        scenario("tcp_in_two_fragments_to_a_vip", tcp_in_two_fragments),
        scenario("reply_in_two_fragments", reply_in_two_fragments),
        scenario(
            "later_fragment_without_first_to_a_vip_dropped",
            later_fragment_without_first(DNS, TC_ACT_SHOT),
        ),
        scenario(
            "later_fragment_without_first_to_a_service_range_dropped",
            later_fragment_without_first(ep(UNUSED_SERVICE_ADDR, 53), TC_ACT_SHOT),
        ),
        scenario(
            "later_fragment_without_first_elsewhere_untouched",
            later_fragment_without_first(DNS_BACKEND, TC_ACT_UNSPEC),
        ),
        scenario("first_fragment_record_only_for_its_datagram", record_only_for_its_datagram),
    ];
    run_table(
        &scenarios,
        |scenario| scenario.name,
        |scenario| {
            let mut h = Harness::new()?;
            world(&mut h)?;
            (scenario.run)(&mut h)?;
            Ok(Outcome::Passed)
        },
    );
}
