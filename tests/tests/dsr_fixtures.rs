//! Direct server return's packets (`--lb-mode=dsr`), run through vipr's TC program with
//! BPF_PROG_TEST_RUN: on the ingress node a new connection to a remote backend leaves with its
//! destination rewritten, its source kept and the service address in an IPv4 option or an IPv6
//! destination-options header (checksums right, only a forward flow entry); on the backend's
//! node a request with it stores the connection's entries and reaches the backend without it,
//! and the reply gets the service address as source. Each test runs in a network namespace of
//! its own, whose routes it sets. Needs root (BPF, mount, unshare).

use anyhow::{anyhow, ensure, Context as _, Result};
use aya::maps::{lpm_trie::Key, LpmTrie, MapData};
use proxy_common::{datapath_stat, flow_flags, pins, service_flags, source_class, Flow4, Flow6, Service};
use testbed::fixtures::{
    frame::{
        compare_frames, dsr_option, ep, input_and_output, parse_ipv4, Ep, L4Checksum, Packet, ETH_HLEN,
        IPPROTO_TCP, IPPROTO_UDP,
    },
    frame6::{compare_frames6, dsr_carrier6, ep6, ip6, parse_ipv6, Ep6, Packet6, NEXTHDR_DEST},
    harness::{flow_key, verdict_name, Harness, TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC},
    harness6::{add_pod_cidr6, add_service6, flows6, service_key6, set_backend6, set_member6, set_service6},
    netns::{in_fresh_netns, ip},
};

/// TC_ACT_REDIRECT, as BPF_PROG_TEST_RUN reports the program's return.
const TC_ACT_REDIRECT: u32 = 7;

const CLIENT: Ep = ep([203, 0, 113, 2], 40000);
/// Node 1's NodePort, where the client connects.
const FRONTEND: Ep = ep([192, 168, 100, 1], 30080);
/// A pod on node 2, behind node 2's address.
const BACKEND: Ep = ep([10, 244, 2, 10], 8080);
/// The option carrying FRONTEND: type 0x9a, length 8, port 30080, address 192.168.100.1.
const OPTION: [u8; 8] = [0x9a, 8, 0x75, 0x80, 192, 168, 100, 1];

/// Node 1's network: its uplink 192.168.100.1/24 (a veth pair: this kernel has no dummy
/// devices) and node 2's pod CIDR through node 2, MTU `mtu`.
fn node_one(mtu: u32) -> Result<()> {
    ip(&["link", "set", "lo", "up"])?;
    ip(&["link", "add", "vd0", "mtu", &mtu.to_string(), "type", "veth", "peer", "name", "vd1"])?;
    ip(&["link", "set", "vd1", "up"])?;
    ip(&["link", "set", "vd0", "up"])?;
    ip(&["addr", "add", "192.168.100.1/24", "dev", "vd0"])?;
    ip(&["route", "add", "10.244.2.0/24", "via", "192.168.100.2"])?;
    std::fs::write("/proc/sys/net/ipv4/conf/all/forwarding", "1").context("enabling IPv4 forwarding")
}

/// The cluster CIDR in the local-traffic detector's trie, as the agent writes `--cluster-cidr`.
fn cluster_cidr(h: &Harness) -> Result<()> {
    let path = h.bpffs().join(pins::POD_CIDRS4);
    let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    let mut trie: LpmTrie<_, [u8; 4], u8> = aya::maps::Map::LpmTrie(data).try_into()?;
    trie.insert(&Key::new(16, [10, 244, 0, 0]), 1, 0)?;
    Ok(())
}

/// A NodePort frontend of `proto` as the agent writes it with `--lb-mode=dsr`: masqueraded,
/// direct server return for remote backends, its one backend BACKEND.
fn dsr_frontend(h: &mut Harness, proto: u8, backend_set: u32) -> Result<()> {
    let flags = service_flags::MASQUERADE | service_flags::DSR;
    let service = Service { backend_set, backend_count: 1, service_id: 7, flags, ..Service::default() };
    h.store_service(FRONTEND, proto, service)?;
    h.set_backend(backend_set, 0, BACKEND)
}

/// The entry a backend's node checks a carried NodePort address against, as an agent that
/// takes carriers writes it: keyed by the unspecified address and the node port (the address
/// carried is the ingress node's), its set of `proto` holding `backend` (slot and member).
fn carried_node_port(h: &mut Harness, proto: u8, backend_set: u32, backend: Ep) -> Result<()> {
    carried_entry(h, ep([0; 4], FRONTEND.port), proto, backend_set, backend)
}

/// The entry of a carried `frontend`'s address (source class CARRIED), its set holding
/// `backend`.
fn carried_entry(h: &mut Harness, frontend: Ep, proto: u8, backend_set: u32, backend: Ep) -> Result<()> {
    let flags = service_flags::CARRIED;
    let service = Service { backend_set, backend_count: 1, service_id: 7, flags, ..Service::default() };
    h.store_service_for(frontend, proto, source_class::CARRIED, service)?;
    h.set_backend(backend_set, 0, backend)?;
    h.set_member(backend_set, backend, 0)
}

/// Whether `out` is an ICMP "fragmentation needed" (IPv4) or ICMPv6 "packet too big" to
/// `client` (4 or 16 bytes) telling `mtu`.
fn answers_too_big(out: &[u8], client: &[u8], mtu: u32) -> bool {
    let (header, next_header_at, destination_at, protocol, kind) =
        if client.len() == 16 { (40, 6, 24, 58, [2, 0]) } else { (20, 9, 16, 1, [3, 4]) };
    let icmp = ETH_HLEN + header;
    out.len() > icmp + 8
        && out[ETH_HLEN + next_header_at] == protocol
        && out[ETH_HLEN + destination_at..ETH_HLEN + destination_at + client.len()] == *client
        && out[icmp..icmp + 2] == kind
        // IPv4's unused half word before the 16-bit MTU is zero.
        && out[icmp + 4..icmp + 8] == mtu.to_be_bytes()
}

/// Runs `input`, expects `verdict` and exactly `expected` out, with valid checksums.
fn check(h: &Harness, input: &Packet, verdict: u32, expected: &Packet) -> Result<()> {
    let input = input.build();
    let (got, out) = h.run(&input)?;
    let observed = || input_and_output(&input, &out);
    ensure!(
        got == verdict,
        "verdict {} (want {})\n  {}",
        verdict_name(got),
        verdict_name(verdict),
        observed()
    );
    let view = parse_ipv4(&out).map_err(|e| anyhow!("output: {e}\n  {}", observed()))?;
    ensure!(view.ip_checksum_valid, "the IPv4 header checksum is wrong\n  {}", observed());
    ensure!(view.l4_checksum == L4Checksum::Valid, "L4 checksum {:?}\n  {}", view.l4_checksum, observed());
    compare_frames(&expected.build(), &out).map_err(|e| anyhow!("{e}\n  {}", observed()))
}

/// The ingress node: the SYN leaves for node 2 with the destination rewritten, the client's
/// address kept and the option after the header; the ACK that follows without it; a UDP
/// datagram always with it. Only forward entries are stored, marked DSR_INGRESS.
#[test]
fn the_ingress_node_sends_the_request_with_the_service_address_and_no_source_nat() {
    in_fresh_netns(|| {
        node_one(1500)?;
        let mut h = Harness::new()?;
        cluster_cidr(&h)?;
        dsr_frontend(&mut h, IPPROTO_TCP, 1)?;
        let syn = Packet::tcp(CLIENT, FRONTEND).tcp_flags(0x02).payload(b"");
        check(&h, &syn, TC_ACT_REDIRECT, &syn.clone().to(BACKEND).ip_options(&OPTION)).context("SYN")?;
        let ack = Packet::tcp(CLIENT, FRONTEND).tcp_flags(0x10).payload(b"");
        check(&h, &ack, TC_ACT_REDIRECT, &ack.clone().to(BACKEND)).context("ACK")?;

        dsr_frontend(&mut h, IPPROTO_UDP, 2)?;
        let datagram = Packet::udp(CLIENT, FRONTEND);
        for round in 0..2 {
            check(&h, &datagram, TC_ACT_REDIRECT, &datagram.clone().to(BACKEND).ip_options(&OPTION))
                .with_context(|| format!("UDP datagram {round}"))?;
        }
        let flows = h.flows()?;
        ensure!(flows.len() == 2, "one forward entry per connection, no reply entry: {flows:?}");
        for proto in [IPPROTO_TCP, IPPROTO_UDP] {
            let entry: Flow4 = flows[&flow_key(CLIENT, FRONTEND, proto)];
            ensure!(
                (entry.dst_addr, entry.dst_port) == (BACKEND.addr, BACKEND.port)
                    && entry.flags == flow_flags::REWRITE_DESTINATION | flow_flags::DSR_INGRESS,
                "protocol {proto}: {entry:?}"
            );
        }
        ensure!(h.datapath_stat(datapath_stat::DSR_SENT)? == 2, "DSR_SENT");
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// A first datagram that would exceed the uplink's MTU with the option is masqueraded instead,
/// and counted; one that exceeds it without the option is answered, not counted.
#[test]
fn a_request_too_big_for_the_option_is_masqueraded() {
    in_fresh_netns(|| {
        node_one(1280)?;
        let mut h = Harness::new()?;
        cluster_cidr(&h)?;
        dsr_frontend(&mut h, IPPROTO_UDP, 2)?;
        // 20 + 8 + 1248 = 1276 bytes: fits the MTU, not with eight more.
        let big = Packet::udp(CLIENT, FRONTEND).payload(&[0x5a; 1248]);
        let (verdict, out) = h.run(&big.build())?;
        ensure!(verdict == TC_ACT_REDIRECT, "verdict {}", verdict_name(verdict));
        let view = parse_ipv4(&out).map_err(|e| anyhow!("output: {e}"))?;
        ensure!(
            view.source().addr == FRONTEND.addr && view.destination() == BACKEND,
            "not masqueraded: {view:?}"
        );
        ensure!(h.datapath_stat(datapath_stat::DSR_MTU_SNAT)? == 1, "DSR_MTU_SNAT");
        ensure!(h.datapath_stat(datapath_stat::DSR_SENT)? == 0, "DSR_SENT");

        // One too big for the uplink even without the option (DF set) is answered
        // "fragmentation needed" with the uplink's MTU, and not counted as a DSR fallback.
        let too_big = Packet::udp(ep(CLIENT.addr, CLIENT.port + 1), FRONTEND).payload(&[0x5a; 1300]);
        let (verdict, out) = h.run(&too_big.build())?;
        ensure!(verdict == TC_ACT_REDIRECT, "too big: verdict {}", verdict_name(verdict));
        ensure!(
            answers_too_big(&out, &CLIENT.addr, 1280),
            "not answered \"fragmentation needed\", MTU 1280: {out:02x?}"
        );
        ensure!(
            h.datapath_stat(datapath_stat::DSR_MTU_SNAT)? == 1,
            "DSR_MTU_SNAT counted a packet too big anyway"
        );
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// The backend's node: the request with the option stores both entries of the connection
/// (DSR_BACKEND) and goes on to the backend without the option; the backend's reply leaves with
/// the service address and port as its source.
#[test]
fn the_backend_node_stores_the_service_address_and_strips_the_option() {
    in_fresh_netns(|| {
        let mut h = Harness::new()?;
        carried_node_port(&mut h, IPPROTO_TCP, 1, BACKEND)?;
        let request = Packet::tcp(CLIENT, BACKEND).tcp_flags(0x02).payload(b"").ip_options(&OPTION);
        // No route in this namespace: the stack delivers the packet.
        check(&h, &request, TC_ACT_OK, &request.clone().ip_options(&[])).context("SYN with the option")?;
        let flows = h.flows()?;
        let reply_entry: Flow4 = flows[&flow_key(BACKEND, CLIENT, IPPROTO_TCP)];
        ensure!(
            (reply_entry.src_addr, reply_entry.src_port) == (FRONTEND.addr, FRONTEND.port)
                && reply_entry.flags
                    == flow_flags::REPLY | flow_flags::REWRITE_SOURCE | flow_flags::DSR_BACKEND,
            "reply entry {reply_entry:?}"
        );
        let forward_entry: Flow4 = flows[&flow_key(CLIENT, BACKEND, IPPROTO_TCP)];
        ensure!(
            forward_entry.flags == flow_flags::DSR_BACKEND
                && (forward_entry.dst_addr, forward_entry.dst_port) == (BACKEND.addr, BACKEND.port),
            "forward entry {forward_entry:?}"
        );
        ensure!(flows.len() == 2, "{flows:?}");
        ensure!(h.datapath_stat(datapath_stat::DSR_RECEIVED)? == 1, "DSR_RECEIVED");

        let reply = Packet::tcp(BACKEND, CLIENT).tcp_flags(0x12).payload(b"");
        check(&h, &reply, TC_ACT_OK, &reply.clone().from(FRONTEND)).context("the backend's reply")?;
        // Later requests carry no option and pass as they are.
        let ack = Packet::tcp(CLIENT, BACKEND).tcp_flags(0x10);
        check(&h, &ack, TC_ACT_OK, &ack).context("the client's ACK")?;
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// With `stack` the backend's node forwards a carried request through its stack, which may
/// answer it with an ICMP error ("fragmentation needed": the pod's link is smaller than the
/// client's way) quoting it as forwarded, to the pod. At the node's egress the error gets the
/// service address back, in the quote and as its source, as if the ingress node had sent it:
/// the client matches it to its socket and learns the MTU.
#[test]
fn the_backend_node_s_own_error_about_a_carried_request_names_the_service_address() {
    use testbed::fixtures::icmp_error::{check_error_checksums, compare_errors, icmp4_error, quote, Quote};
    const NODE_TWO: [u8; 4] = [192, 168, 100, 2];
    const FRAGMENTATION_NEEDED: (u8, u8) = (3, 4);
    const MTU_1400: [u8; 4] = [0, 0, 0x05, 0x78];
    in_fresh_netns(|| {
        let mut h = Harness::stack()?;
        carried_node_port(&mut h, IPPROTO_TCP, 1, BACKEND)?;
        let request = Packet::tcp(CLIENT, BACKEND).tcp_flags(0x02).payload(b"").ip_options(&OPTION);
        let (verdict, _) = h.run(&request.build())?;
        ensure!(verdict == TC_ACT_OK, "the carried SYN: verdict {}", verdict_name(verdict));

        let data = |to: Ep| Packet::tcp(CLIENT, to).tcp_flags(0x18).payload(&[0x5a; 200]).build();
        let error = |from: [u8; 4], to: Ep| {
            icmp4_error(from, CLIENT.addr, FRAGMENTATION_NEEDED, MTU_1400, &quote(&data(to), Quote::Whole))
                .build()
        };
        let (verdict, out) = h.run_egress(&error(NODE_TWO, BACKEND))?;
        ensure!(verdict == TC_ACT_OK, "the node's error at egress: verdict {}", verdict_name(verdict));
        check_error_checksums(&out).map_err(|e| anyhow!("output: {e}"))?;
        compare_errors(&error(FRONTEND.addr, FRONTEND), &out).map_err(|e| anyhow!("output frame: {e}"))
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// A tracked DSR connection's requests that carry the service address (every UDP datagram)
/// leave by the next hop cached in its flow entry, as every tracked packet does: no FIB lookup
/// per datagram while the route generation holds (a new neighbour address is not seen until
/// it moves). The option's room is checked against the cached device's MTU on every datagram:
/// the device's MTU lowered under the same generation sends the datagram without it (counted).
#[test]
fn tracked_requests_carrying_the_service_address_leave_by_the_cached_next_hop() {
    const NODE2_MAC: [u8; 6] = [0x02, 0xcc, 0, 0, 0, 0x02];
    const NEW_MAC: [u8; 6] = [0x02, 0xcc, 0, 0, 0, 0x22];
    let text = |mac: [u8; 6]| mac.map(|byte| format!("{byte:02x}")).join(":");
    in_fresh_netns(|| {
        node_one(1500)?;
        ip(&["neigh", "add", "192.168.100.2", "lladdr", &text(NODE2_MAC), "dev", "vd0", "nud", "permanent"])?;
        let mut h = Harness::new()?;
        cluster_cidr(&h)?;
        h.set_route_generation(3)?;
        dsr_frontend(&mut h, IPPROTO_UDP, 2)?;
        let datagram = Packet::udp(CLIENT, FRONTEND).payload(&[0x5a; 100]);
        let carried = datagram.clone().to(BACKEND).ip_options(&OPTION);
        // The first datagram balances the connection; the second caches its hop.
        for round in 0..2 {
            let (verdict, out) = h.run(&datagram.build())?;
            ensure!(verdict == TC_ACT_REDIRECT, "datagram {round}: verdict {}", verdict_name(verdict));
            compare_frames(&carried.build()[12..], &out[12..])
                .map_err(|e| anyhow!("datagram {round}: {e}"))?;
        }
        let entry: Flow4 = h.flows()?[&flow_key(CLIENT, FRONTEND, IPPROTO_UDP)];
        ensure!(entry.next_hop.dst_mac == NODE2_MAC, "cached {:?}", entry.next_hop);
        ensure!(entry.flags >> flow_flags::ROUTE_GENERATION_SHIFT == 3, "flags {:#x}", entry.flags);

        // Node 2's address changes; under the same generation the cached hop still serves.
        ip(&[
            "neigh",
            "replace",
            "192.168.100.2",
            "lladdr",
            &text(NEW_MAC),
            "dev",
            "vd0",
            "nud",
            "permanent",
        ])?;
        let (verdict, out) = h.run(&datagram.build())?;
        ensure!(verdict == TC_ACT_REDIRECT, "cached: verdict {}", verdict_name(verdict));
        ensure!(out[..6] == NODE2_MAC, "cached: to {:02x?}", &out[..6]);
        compare_frames(&carried.build()[12..], &out[12..]).map_err(|e| anyhow!("cached: {e}"))?;

        // The device's MTU drops below the datagram with the option (same generation): it
        // leaves without the option, counted.
        let ip_len = 20 + 8 + 100;
        ip(&["link", "set", "vd0", "mtu", &(ip_len + 4).to_string()])?;
        let (verdict, out) = h.run(&datagram.build())?;
        ensure!(verdict == TC_ACT_REDIRECT, "too big: verdict {}", verdict_name(verdict));
        compare_frames(&datagram.clone().to(BACKEND).build()[12..], &out[12..])
            .map_err(|e| anyhow!("too big: {e}"))?;
        ensure!(h.datapath_stat(datapath_stat::DSR_MTU_NO_OPTION)? == 1, "DSR_MTU_NO_OPTION");

        // A new generation: the datagram follows node 2's new address.
        ip(&["link", "set", "vd0", "mtu", "1500"])?;
        h.set_route_generation(4)?;
        let (verdict, out) = h.run(&datagram.build())?;
        ensure!(verdict == TC_ACT_REDIRECT, "new generation: verdict {}", verdict_name(verdict));
        ensure!(out[..6] == NEW_MAC, "new generation: to {:02x?}", &out[..6]);
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

const CLIENT6: Ep6 = ep6(ip6([0x2001, 0xdb8, 0x113, 0], 2), 40000);
/// Node 1's NodePort on its IPv6 address.
const FRONTEND6: Ep6 = ep6(ip6([0xfd00, 0x100, 0, 0], 1), 30080);
/// A pod on node 2, behind node 2's IPv6 address.
const BACKEND6: Ep6 = ep6(ip6([0xfd00, 0x244, 0, 2], 0x10), 8080);

/// The destination-options header carrying FRONTEND6.
fn carrier6() -> Vec<u8> {
    dsr_carrier6(FRONTEND6)
}

/// Node 1's IPv6 network: its uplink fd00:100::1/64 and node 2's pod CIDR fd00:244:0:2::/64
/// through node 2, MTU `mtu`.
fn node_one6(mtu: u32) -> Result<()> {
    ip(&["link", "set", "lo", "up"])?;
    ip(&["link", "add", "vd0", "mtu", &mtu.to_string(), "type", "veth", "peer", "name", "vd1"])?;
    ip(&["link", "set", "vd1", "up"])?;
    ip(&["link", "set", "vd0", "up"])?;
    ip(&["-6", "addr", "add", "fd00:100::1/64", "dev", "vd0", "nodad"])?;
    ip(&["-6", "route", "add", "fd00:244:0:2::/64", "via", "fd00:100::2"])?;
    std::fs::write("/proc/sys/net/ipv6/conf/all/forwarding", "1").context("enabling IPv6 forwarding")
}

/// The IPv6 NodePort frontend of `proto` as the agent writes it with `--lb-mode=dsr`, its one
/// backend BACKEND6, and the cluster CIDR fd00:244::/48.
fn dsr_frontend6(h: &Harness, proto: u8, backend_set: u32) -> Result<()> {
    add_pod_cidr6(h, 48, ip6([0xfd00, 0x244, 0, 0], 0))?;
    let flags = service_flags::MASQUERADE | service_flags::DSR;
    add_service6(h, FRONTEND6, proto, source_class::OUTSIDE, backend_set, &[BACKEND6], flags)
}

/// [`carried_node_port`] for IPv6: the NodePort's entry keyed by `::`.
fn carried_node_port6(h: &Harness, proto: u8, backend_set: u32, backend: Ep6) -> Result<()> {
    let flags = service_flags::CARRIED;
    let service = Service { backend_set, backend_count: 1, service_id: 7, flags, ..Service::default() };
    set_service6(h, service_key6(ep6([0; 16], FRONTEND6.port), proto, source_class::CARRIED), service)?;
    set_backend6(h, backend_set, 0, backend)?;
    set_member6(h, backend_set, backend, 0)
}

/// Runs `input`, expects `verdict` and exactly `expected` out; the L4 checksum is checked on
/// its own where the output has no extension header.
fn check6(h: &Harness, input: &Packet6, verdict: u32, expected: &Packet6) -> Result<()> {
    let input = input.build();
    let (got, out) = h.run(&input)?;
    let observed = || input_and_output(&input, &out);
    ensure!(
        got == verdict,
        "verdict {} (want {})\n  {}",
        verdict_name(got),
        verdict_name(verdict),
        observed()
    );
    if expected.extensions.is_empty() {
        let view = parse_ipv6(&out).map_err(|e| anyhow!("output: {e}\n  {}", observed()))?;
        ensure!(
            view.l4_checksum == L4Checksum::Valid,
            "L4 checksum {:?}\n  {}",
            view.l4_checksum,
            observed()
        );
    }
    // The expected frame's checksum is computed over the pseudo header, which an extension
    // header does not enter: an equal frame has a valid checksum.
    compare_frames6(&expected.build(), &out).map_err(|e| anyhow!("{e}\n  {}", observed()))
}

/// IPv6 on the ingress node: the SYN leaves for node 2 with the destination rewritten, the
/// client's address kept and vipr's destination-options header after the fixed header; the
/// ACK without it; every UDP datagram with it. Only forward entries, marked DSR_INGRESS.
#[test]
fn the_ingress_node_sends_an_ipv6_request_with_the_service_address_in_a_destination_options_header() {
    in_fresh_netns(|| {
        node_one6(1500)?;
        let h = Harness::new()?;
        dsr_frontend6(&h, IPPROTO_TCP, 1)?;
        let syn = Packet6::tcp(CLIENT6, FRONTEND6).tcp_flags(0x02).payload(b"");
        let sent = syn.clone().to(BACKEND6).extension_bytes(NEXTHDR_DEST, &carrier6());
        check6(&h, &syn, TC_ACT_REDIRECT, &sent).context("SYN")?;
        let ack = Packet6::tcp(CLIENT6, FRONTEND6).tcp_flags(0x10).payload(b"");
        check6(&h, &ack, TC_ACT_REDIRECT, &ack.clone().to(BACKEND6)).context("ACK")?;

        dsr_frontend6(&h, IPPROTO_UDP, 2)?;
        let datagram = Packet6::udp(CLIENT6, FRONTEND6);
        let sent = datagram.clone().to(BACKEND6).extension_bytes(NEXTHDR_DEST, &carrier6());
        for round in 0..2 {
            check6(&h, &datagram, TC_ACT_REDIRECT, &sent).with_context(|| format!("UDP datagram {round}"))?;
        }
        let flows = flows6(&h)?;
        ensure!(flows.len() == 2, "one forward entry per connection, no reply entry: {flows:?}");
        for proto in [IPPROTO_TCP, IPPROTO_UDP] {
            let entry: Flow6 = flows[&flow_key(CLIENT6, FRONTEND6, proto)];
            ensure!(
                (entry.dst_addr, entry.dst_port) == (BACKEND6.addr, BACKEND6.port)
                    && entry.flags == flow_flags::REWRITE_DESTINATION | flow_flags::DSR_INGRESS,
                "protocol {proto}: {entry:?}"
            );
        }
        ensure!(h.datapath_stat(datapath_stat::DSR_SENT)? == 2, "DSR_SENT");
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// An IPv6 datagram that would exceed the uplink's MTU with the 24-byte header is masqueraded
/// instead, and counted; one that exceeds it without the header is answered, not counted.
#[test]
fn an_ipv6_request_too_big_for_the_carrier_is_masqueraded() {
    in_fresh_netns(|| {
        node_one6(1280)?;
        let h = Harness::new()?;
        dsr_frontend6(&h, IPPROTO_UDP, 2)?;
        // 40 + 8 + 1220 = 1268 bytes: fits the MTU, not with 24 more.
        let big = Packet6::udp(CLIENT6, FRONTEND6).payload(&[0x5a; 1220]);
        let (verdict, out) = h.run(&big.build())?;
        ensure!(verdict == TC_ACT_REDIRECT, "verdict {}", verdict_name(verdict));
        let view = parse_ipv6(&out).map_err(|e| anyhow!("output: {e}"))?;
        ensure!(
            view.source().addr == FRONTEND6.addr && view.destination() == BACKEND6,
            "not masqueraded: {view:?}"
        );
        ensure!(h.datapath_stat(datapath_stat::DSR_MTU_SNAT)? == 1, "DSR_MTU_SNAT");
        ensure!(h.datapath_stat(datapath_stat::DSR_SENT)? == 0, "DSR_SENT");

        // One too big for the uplink even without the header is answered "packet too big"
        // with the uplink's MTU, and not counted as a DSR fallback.
        let too_big = Packet6::udp(ep6(CLIENT6.addr, CLIENT6.port + 1), FRONTEND6).payload(&[0x5a; 1300]);
        let (verdict, out) = h.run(&too_big.build())?;
        ensure!(verdict == TC_ACT_REDIRECT, "too big: verdict {}", verdict_name(verdict));
        ensure!(
            answers_too_big(&out, &CLIENT6.addr, 1280),
            "not answered \"packet too big\", MTU 1280: {out:02x?}"
        );
        ensure!(
            h.datapath_stat(datapath_stat::DSR_MTU_SNAT)? == 1,
            "DSR_MTU_SNAT counted a packet too big anyway"
        );
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// IPv6 on the backend's node: the request with vipr's header stores both entries of the
/// connection and goes on to the backend without the header; the reply leaves with the service
/// address and port as its source. Another destination-options header is not vipr's: the
/// packet passes as it is.
#[test]
fn the_backend_node_stores_the_ipv6_service_address_and_strips_the_header() {
    in_fresh_netns(|| {
        let h = Harness::new()?;
        carried_node_port6(&h, IPPROTO_TCP, 1, BACKEND6)?;
        let request = Packet6::tcp(CLIENT6, BACKEND6)
            .tcp_flags(0x02)
            .payload(b"")
            .extension_bytes(NEXTHDR_DEST, &carrier6());
        check6(&h, &request, TC_ACT_OK, &request.clone().without_extensions())
            .context("SYN with the header")?;
        let flows = flows6(&h)?;
        let reply_entry: Flow6 = flows[&flow_key(BACKEND6, CLIENT6, IPPROTO_TCP)];
        ensure!(
            (reply_entry.src_addr, reply_entry.src_port) == (FRONTEND6.addr, FRONTEND6.port)
                && reply_entry.flags
                    == flow_flags::REPLY | flow_flags::REWRITE_SOURCE | flow_flags::DSR_BACKEND,
            "reply entry {reply_entry:?}"
        );
        let forward_entry: Flow6 = flows[&flow_key(CLIENT6, BACKEND6, IPPROTO_TCP)];
        ensure!(forward_entry.flags == flow_flags::DSR_BACKEND, "forward entry {forward_entry:?}");
        ensure!(flows.len() == 2, "{flows:?}");
        ensure!(h.datapath_stat(datapath_stat::DSR_RECEIVED)? == 1, "DSR_RECEIVED");

        let reply = Packet6::tcp(BACKEND6, CLIENT6).tcp_flags(0x12).payload(b"");
        check6(&h, &reply, TC_ACT_OK, &reply.clone().from(FRONTEND6)).context("the backend's reply")?;
        let ack = Packet6::tcp(CLIENT6, BACKEND6).tcp_flags(0x10);
        check6(&h, &ack, TC_ACT_OK, &ack).context("the client's ACK")?;

        // A UDP request whose destination options are someone else's (another option type)
        // is left alone, header and all, and stores nothing.
        let mut foreign = carrier6();
        foreign[1] = 0x1f;
        let other = Packet6::udp(CLIENT6, BACKEND6).extension_bytes(NEXTHDR_DEST, &foreign);
        check6(&h, &other, TC_ACT_UNSPEC, &other).context("another destination-options header")?;
        ensure!(flows6(&h)?.len() == 2, "a foreign header stored entries");
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// A node takes a carried service address only for the protocols its own `--lb-mode` sends by
/// direct server return: the option is not authenticated, and whoever sends a pod a request
/// with it chooses the source address of the pod's replies. With `snat` it takes none, with
/// `hybrid` TCP's only. An ignored request goes on as if it carried nothing: untouched (the
/// stack delivers it, and ignores an option it does not know), nothing stored, counted.
#[test]
fn a_node_takes_a_carried_service_address_only_for_what_its_lb_mode_sends_by_dsr() {
    use proxy_common::dsr_accept;
    in_fresh_netns(|| {
        let syn = Packet::tcp(CLIENT, BACKEND).tcp_flags(0x02).payload(b"").ip_options(&OPTION);
        let datagram = Packet::udp(CLIENT, BACKEND).ip_options(&OPTION);
        let syn6 = Packet6::tcp(CLIENT6, BACKEND6)
            .tcp_flags(0x02)
            .payload(b"")
            .extension_bytes(NEXTHDR_DEST, &carrier6());
        let datagram6 = Packet6::udp(CLIENT6, BACKEND6).extension_bytes(NEXTHDR_DEST, &carrier6());

        let carried_node_ports = |h: &mut Harness| -> Result<()> {
            for (set, proto) in [(1, IPPROTO_TCP), (2, IPPROTO_UDP)] {
                carried_node_port(h, proto, set, BACKEND)?;
                carried_node_port6(h, proto, set + 10, BACKEND6)?;
            }
            Ok(())
        };
        let mut snat = Harness::taking_carriers(dsr_accept::NONE)?;
        carried_node_ports(&mut snat)?;
        check(&snat, &syn, TC_ACT_UNSPEC, &syn).context("snat: a SYN with the option")?;
        check(&snat, &datagram, TC_ACT_UNSPEC, &datagram).context("snat: a datagram with the option")?;
        check6(&snat, &syn6, TC_ACT_UNSPEC, &syn6).context("snat: an IPv6 SYN with the header")?;
        check6(&snat, &datagram6, TC_ACT_UNSPEC, &datagram6)
            .context("snat: an IPv6 datagram with the header")?;
        ensure!(snat.flows()?.is_empty() && flows6(&snat)?.is_empty(), "snat stored entries");
        ensure!(snat.datapath_stat(datapath_stat::DSR_CARRIER_IGNORED)? == 4, "snat: DSR_CARRIER_IGNORED");
        ensure!(snat.datapath_stat(datapath_stat::DSR_RECEIVED)? == 0, "snat: DSR_RECEIVED");

        let mut hybrid = Harness::taking_carriers(dsr_accept::TCP)?;
        carried_node_ports(&mut hybrid)?;
        check(&hybrid, &syn, TC_ACT_OK, &syn.clone().ip_options(&[]))
            .context("hybrid: a SYN with the option")?;
        check(&hybrid, &datagram, TC_ACT_UNSPEC, &datagram).context("hybrid: a datagram with the option")?;
        check6(&hybrid, &syn6, TC_ACT_OK, &syn6.clone().without_extensions())
            .context("hybrid: an IPv6 SYN with the header")?;
        check6(&hybrid, &datagram6, TC_ACT_UNSPEC, &datagram6)
            .context("hybrid: an IPv6 datagram with the header")?;
        ensure!(hybrid.flows()?.len() == 2 && flows6(&hybrid)?.len() == 2, "hybrid: the SYNs' entries only");
        ensure!(hybrid.datapath_stat(datapath_stat::DSR_RECEIVED)? == 2, "hybrid: DSR_RECEIVED");
        ensure!(
            hybrid.datapath_stat(datapath_stat::DSR_CARRIER_IGNORED)? == 2,
            "hybrid: DSR_CARRIER_IGNORED"
        );
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}

/// A node that takes carriers takes a carried service address only where a service of the
/// request's destination has it: the entries for carried addresses (source class CARRIED) hold
/// a load-balancer IP by address and port, a NodePort by port alone (the address is the
/// ingress node's), each with the backends an ingress node chooses from. Any other address, or
/// a service's address to a pod that is not its backend, is refused: dropped, nothing stored,
/// counted. Taken, it would give the pod's replies a source of the sender's choosing. A tracked
/// connection's retransmitted SYN that carries another address renews nothing (refused,
/// counted); its datagrams store nothing at all and only lose their carrier: the replies keep
/// the source the first request stored.
#[test]
fn a_carried_service_address_is_taken_only_from_a_service_of_the_requests_backend() {
    const LOAD_BALANCER: Ep = ep([198, 51, 100, 10], 80);
    const OTHER_BACKEND: Ep = ep([10, 244, 2, 11], 8080);
    const OTHER_CLIENT: Ep = ep([203, 0, 113, 3], 40001);
    const OTHER_BACKEND6: Ep6 = ep6(ip6([0xfd00, 0x244, 0, 2], 0x11), 8080);
    in_fresh_netns(|| {
        let mut h = Harness::new()?;
        carried_entry(&mut h, LOAD_BALANCER, IPPROTO_TCP, 1, BACKEND)?;
        carried_node_port(&mut h, IPPROTO_TCP, 2, OTHER_BACKEND)?;
        carried_node_port(&mut h, IPPROTO_UDP, 3, BACKEND)?;
        carried_node_port6(&h, IPPROTO_TCP, 4, OTHER_BACKEND6)?;
        let syn = |client: Ep, backend: Ep, carried: Ep| {
            Packet::tcp(client, backend).tcp_flags(0x02).payload(b"").ip_options(&dsr_option(carried))
        };
        let refused = |h: &Harness, packet: &Packet, what: &str| -> Result<()> {
            let (verdict, out) = h.run(&packet.build())?;
            ensure!(verdict == TC_ACT_SHOT, "{what}: verdict {} (want TC_ACT_SHOT)", verdict_name(verdict));
            ensure!(out.is_empty() || out == packet.build(), "{what}: rewritten");
            Ok(())
        };

        // Taken: the load balancer's address to its backend; the NodePort from any node's
        // address to its backend.
        let taken = syn(CLIENT, BACKEND, LOAD_BALANCER);
        check(&h, &taken, TC_ACT_OK, &taken.clone().ip_options(&[])).context("the load balancer's SYN")?;
        let via_node = syn(OTHER_CLIENT, OTHER_BACKEND, ep([192, 168, 100, 7], FRONTEND.port));
        check(&h, &via_node, TC_ACT_OK, &via_node.clone().ip_options(&[])).context("the NodePort's SYN")?;
        ensure!(h.flows()?.len() == 4, "two connections' entries: {:?}", h.flows()?);

        // Refused: a service's address to a pod that is not its backend, an address no service
        // has.
        let before = h.flows()?.len();
        refused(&h, &syn(OTHER_CLIENT, BACKEND, FRONTEND), "the NodePort to another service's backend")?;
        // (A client of its own: OTHER_CLIENT's connection to OTHER_BACKEND is tracked.)
        let new_client = ep([203, 0, 113, 4], 40002);
        refused(&h, &syn(new_client, OTHER_BACKEND, LOAD_BALANCER), "the load balancer to a stranger")?;
        refused(&h, &syn(OTHER_CLIENT, BACKEND, ep([8, 8, 8, 8], 53)), "an address no service has")?;
        let syn6 = |backend: Ep6| {
            Packet6::tcp(CLIENT6, backend)
                .tcp_flags(0x02)
                .payload(b"")
                .extension_bytes(NEXTHDR_DEST, &carrier6())
        };
        check6(&h, &syn6(OTHER_BACKEND6), TC_ACT_OK, &syn6(OTHER_BACKEND6).without_extensions())
            .context("the IPv6 NodePort's SYN")?;
        let (verdict, _) = h.run(&syn6(BACKEND6).build())?;
        ensure!(verdict == TC_ACT_SHOT, "IPv6 to another pod: verdict {}", verdict_name(verdict));
        ensure!(h.flows()?.len() == before, "a refused request stored entries: {:?}", h.flows()?);
        ensure!(flows6(&h)?.len() == 2, "IPv6: the taken connection's entries only");
        ensure!(h.datapath_stat(datapath_stat::DSR_CARRIER_REFUSED)? == 4, "DSR_CARRIER_REFUSED");
        ensure!(h.datapath_stat(datapath_stat::DSR_RECEIVED)? == 3, "DSR_RECEIVED");

        // Tracked connections: a retransmitted SYN with an address no service has renews
        // nothing; a datagram with another service's address stores nothing.
        let reply_source = |proto: u8| -> Result<Ep> {
            let entry: Flow4 = h.flows()?[&flow_key(BACKEND, CLIENT, proto)];
            Ok(ep(entry.src_addr, entry.src_port))
        };
        let forged_syn = syn(CLIENT, BACKEND, ep([8, 8, 8, 8], 53));
        check(&h, &forged_syn, TC_ACT_OK, &forged_syn.clone().ip_options(&[])).context("a forged SYN")?;
        ensure!(h.datapath_stat(datapath_stat::DSR_CARRIER_REFUSED)? == 5, "the SYN's renewal not refused");
        ensure!(reply_source(IPPROTO_TCP)? == LOAD_BALANCER, "the forged SYN changed the reply's source");
        let datagram = Packet::udp(CLIENT, BACKEND).ip_options(&OPTION);
        check(&h, &datagram, TC_ACT_OK, &datagram.clone().ip_options(&[])).context("the first datagram")?;
        let forged = Packet::udp(CLIENT, BACKEND).ip_options(&dsr_option(LOAD_BALANCER));
        check(&h, &forged, TC_ACT_OK, &forged.clone().ip_options(&[])).context("a forged datagram")?;
        ensure!(reply_source(IPPROTO_UDP)? == FRONTEND, "the forged datagram changed the reply's source");
        Ok(())
    })
    .unwrap_or_else(|err| panic!("{err:#}"));
}
