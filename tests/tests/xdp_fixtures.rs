//! Fixtures for vipr's XDP fast path (`proxy-ebpf/src/xdp.rs`), run with BPF_PROG_TEST_RUN.
//!
//! The program needs a FIB route with a resolved neighbour, so each fixture runs in a network
//! namespace of its own holding a veth "NIC" (`xdp0`, 10.0.0.1/24) with a permanent
//! neighbour entry for the backend: the program's frame goes back out of the interface it came
//! in on (`XDP_TX`), with the backend's MAC as destination. Every rewritten frame is compared
//! byte for byte with the frame a client would have sent straight to the backend, and its
//! checksums are recomputed independently. The same fixtures run for IPv6 (`fd00::1/64` on
//! the same NIC), which takes the same generic path with no header checksum. Needs root (BPF,
//! mount, netns).

use testbed::fixtures::{frame, frame6, harness};

use anyhow::{ensure, Context as _, Result};
use aya::{
    maps::{lpm_trie::Key, Array, HashMap, LpmTrie, PerCpuArray},
    programs::{TestRun as _, TestRunOptions, Xdp},
    Ebpf, EbpfLoader,
};
use frame::{ep, hex, parse_ipv4, Ep, Packet, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};
use frame6::{dsr_carrier6, ep6, ip6, parse_ipv6, Ep6, Packet6, NEXTHDR_DEST};
use harness::{flow_key, nat_entries, PrivateBpffs};
use proxy_common::{
    datapath_stat, flow_flags, pins, service_flags, source_class, Backend4, Backend6, BackendSlot, Family,
    Flow, Flow4, Flow6, FlowKey, FlowKey4, FlowKey6, FlowTrack, NextHop, Service, ServiceKey4, ServiceKey6,
};
use testbed::{unique_name, Netns};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const PROGRAM: &str = proxy_common::pins::XDP_PROGRAM;

const CLIENT: Ep = ep([192, 168, 1, 100], 40000);
const NODE: [u8; 4] = [10, 0, 0, 1];
const NODE_PORT: Ep = ep(NODE, 30080);
const BACKEND: Ep = ep([10, 0, 0, 2], 8080);
const BACKEND_MAC: [u8; 6] = [0x02, 0xbb, 0, 0, 0, 0x02];
const NIC_MAC: [u8; 6] = [0x02, 0xaa, 0, 0, 0, 0x01];
const SET: u32 = 7;

/// A pod behind node 2 (10.0.0.3), as direct server return's remote backend.
const POD: Ep = ep([10, 244, 2, 10], 8080);
const NODE2_MAC: [u8; 6] = [0x02, 0xcc, 0, 0, 0, 0x03];
/// vipr's IPv4 option carrying NODE_PORT: type 0x9a, length 8, port 30080, 10.0.0.1.
const NODE_PORT_OPTION: [u8; 8] = [0x9a, 8, 0x75, 0x80, 10, 0, 0, 1];

const CLIENT6: Ep6 = ep6(ip6([0xfd00, 1, 0, 0], 0x100), 40000);
const NODE6: [u8; 16] = ip6([0xfd00, 0, 0, 0], 1);
const NODE_PORT6: Ep6 = ep6(NODE6, 30080);
const BACKEND6: Ep6 = ep6(ip6([0xfd00, 0, 0, 0], 2), 8080);
/// A pod behind node 2 (fd00::3).
const POD6: Ep6 = ep6(ip6([0xfd00, 0x244, 0, 2], 0x10), 8080);

/// The XDP program loaded with private maps, inside a namespace with the dummy NIC.
struct World {
    // Drop order: program and maps, then the bpffs, then the namespace.
    ebpf: Ebpf,
    _bpffs: PrivateBpffs,
    netns: Netns,
    ifindex: u32,
}

impl World {
    fn new(label: &str) -> Result<Self> {
        let netns = Netns::create(&unique_name(&format!("vxdp-{label}")))?;
        let mac = frame_mac(&NIC_MAC);
        // A veth pair stands in for the NIC (the kernel here has no dummy driver).
        netns.ip(&["link", "add", "xdp0", "address", &mac, "type", "veth", "peer", "name", "xdp1"])?;
        netns.ip(&["link", "set", "xdp1", "up"])?;
        // The FIB answers "forwarding disabled" otherwise, as on a node that routes nothing.
        netns.set_sysctl("net.ipv4.ip_forward", "1")?;
        netns.set_sysctl("net.ipv6.conf.all.forwarding", "1")?;
        netns.ip(&["addr", "add", "10.0.0.1/24", "dev", "xdp0"])?;
        // Without duplicate address detection the address and its route are usable at once.
        netns.ip(&["-6", "addr", "add", "fd00::1/64", "dev", "xdp0", "nodad"])?;
        netns.ip(&["link", "set", "xdp0", "up"])?;
        // The client is outside: reached through a router on the same link.
        netns.ip(&["route", "add", "192.168.1.0/24", "via", "10.0.0.254"])?;
        netns.ip(&["-6", "route", "add", "fd00:1::/64", "via", "fd00::fe"])?;
        for backend in ["10.0.0.2", "fd00::2"] {
            let mac = frame_mac(&BACKEND_MAC);
            netns.ip(&["neigh", "add", backend, "lladdr", &mac, "dev", "xdp0", "nud", "permanent"])?;
        }
        let ifindex: u32 = netns
            .run(|| Ok(std::fs::read_to_string("/sys/class/net/xdp0/ifindex")?))
            .or_else(|_| -> Result<String> {
                let out = netns.ip(&["-o", "link", "show", "xdp0"])?;
                Ok(out.split(':').next().unwrap_or_default().to_owned())
            })?
            .trim()
            .parse()
            .context("ifindex of xdp0")?;
        let bpffs = PrivateBpffs::new()?;
        let mut ebpf = EbpfLoader::new().default_map_pin_directory(bpffs.path()).load(vipr::EBPF_OBJECT)?;
        let program: &mut Xdp = ebpf.program_mut(PROGRAM).context("no XDP program")?.try_into()?;
        harness::load_program("the XDP program", || program.load())?;
        Ok(Self { ebpf, _bpffs: bpffs, netns, ifindex })
    }

    fn service(&mut self, proto: u8, flags: u32) -> Result<()> {
        self.service_to(proto, flags, BACKEND)
    }

    /// The NodePort frontend of `proto` with `flags`, its one backend `backend`.
    fn service_to(&mut self, proto: u8, flags: u32, backend: Ep) -> Result<()> {
        let key = ServiceKey4 {
            addr: NODE_PORT.addr,
            port: NODE_PORT.port,
            proto,
            source_class: source_class::OUTSIDE,
        };
        let service =
            Service { backend_set: SET, backend_count: 1, service_id: 11, flags, ..Service::default() };
        HashMap::<_, ServiceKey4, Service>::try_from(self.ebpf.map_mut(pins::SERVICES4).context("svc")?)?
            .insert(key, service, 0)?;
        let backend = Backend4 { addr: backend.addr, port: backend.port, pad: 0, counter: 3 };
        HashMap::<_, BackendSlot, Backend4>::try_from(self.ebpf.map_mut(pins::BACKENDS4).context("back")?)?
            .insert(BackendSlot { backend_set: SET, slot: 0 }, backend, 0)?;
        Ok(())
    }

    fn service6(&mut self, proto: u8) -> Result<()> {
        self.service6_to(proto, 0, BACKEND6)
    }

    /// [`World::service_to`] for IPv6.
    fn service6_to(&mut self, proto: u8, flags: u32, backend: Ep6) -> Result<()> {
        let key = ServiceKey6 {
            addr: NODE_PORT6.addr,
            port: NODE_PORT6.port,
            proto,
            source_class: source_class::OUTSIDE,
        };
        let service =
            Service { backend_set: SET, backend_count: 1, service_id: 11, flags, ..Service::default() };
        HashMap::<_, ServiceKey6, Service>::try_from(self.ebpf.map_mut(pins::SERVICES6).context("svc")?)?
            .insert(key, service, 0)?;
        let backend = Backend6 { addr: backend.addr, port: backend.port, pad: 0, counter: 3 };
        HashMap::<_, BackendSlot, Backend6>::try_from(self.ebpf.map_mut(pins::BACKENDS6).context("back")?)?
            .insert(BackendSlot { backend_set: SET, slot: 0 }, backend, 0)?;
        Ok(())
    }

    /// Node 2 on the NIC's link (10.0.0.3, fd00::3, resolved), with the pods behind it, and
    /// the cluster's pod CIDRs as the agent writes `--cluster-cidr`: what makes a backend
    /// remote for direct server return.
    fn node_two(&mut self) -> Result<()> {
        let mac = frame_mac(&NODE2_MAC);
        for (gateway, pods) in [("10.0.0.3", "10.244.2.0/24"), ("fd00::3", "fd00:244:0:2::/64")] {
            self.netns.ip(&["neigh", "add", gateway, "lladdr", &mac, "dev", "xdp0", "nud", "permanent"])?;
            self.netns.ip(&["route", "add", pods, "via", gateway])?;
        }
        LpmTrie::<_, [u8; 4], u8>::try_from(self.ebpf.map_mut(pins::POD_CIDRS4).context("pods4")?)?.insert(
            &Key::new(16, [10, 244, 0, 0]),
            1,
            0,
        )?;
        LpmTrie::<_, [u8; 16], u8>::try_from(self.ebpf.map_mut(pins::POD_CIDRS6).context("pods6")?)?.insert(
            &Key::new(32, ip6([0xfd00, 0x244, 0, 0], 0)),
            1,
            0,
        )?;
        Ok(())
    }

    /// The route generation, as the agent writes it when it watches the node's routes and
    /// neighbours (0, the map's initial value: nothing is cached).
    fn set_route_generation(&mut self, generation: u32) -> Result<()> {
        Array::<_, u32>::try_from(self.ebpf.map_mut(pins::ROUTE_GENERATION).context("generation")?)?
            .set(0, generation, 0)?;
        Ok(())
    }

    /// The NIC's neighbour `address` (either family), now at `mac`.
    fn set_neighbour(&self, address: &str, mac: &[u8; 6]) -> Result<()> {
        let mac = frame_mac(mac);
        self.netns.ip(&["neigh", "replace", address, "lladdr", &mac, "dev", "xdp0", "nud", "permanent"])?;
        Ok(())
    }

    /// The flow entry of `key` with its cached next hop and route generation (not cleared, as
    /// [`World::flows`] clears the tracking state).
    fn flow_entry<A: Family>(&self, name: &str, key: FlowKey<A>) -> Result<Flow<A>>
    where
        FlowKey<A>: aya::Pod,
        Flow<A>: aya::Pod,
    {
        let map = HashMap::<_, FlowKey<A>, Flow<A>>::try_from(self.ebpf.map(name).context("flows")?)?;
        Ok(map.get(&key, 0)?)
    }

    /// Writes the flow entry `key` -> `flow` into the flows map `name` (either family).
    fn insert_flow<A: Family>(&mut self, name: &str, key: FlowKey<A>, flow: Flow<A>) -> Result<()>
    where
        FlowKey<A>: aya::Pod,
        Flow<A>: aya::Pod,
    {
        HashMap::<_, FlowKey<A>, Flow<A>>::try_from(self.ebpf.map_mut(name).context("flows")?)?
            .insert(key, flow, 0)?;
        Ok(())
    }

    fn datapath_stat(&self, index: u32) -> Result<u64> {
        let map = self.ebpf.map(pins::DATAPATH_STATS).context("stats")?;
        Ok(PerCpuArray::<_, u64>::try_from(map)?.get(&index, 0)?.iter().sum())
    }

    fn flows(&self) -> Result<Vec<(FlowKey4, Flow4)>> {
        self.flows_of(pins::FLOWS4)
    }

    fn flows6(&self) -> Result<Vec<(FlowKey6, Flow6)>> {
        self.flows_of(pins::FLOWS6)
    }

    fn flows_of<A: Family>(&self, name: &str) -> Result<Vec<(FlowKey<A>, Flow<A>)>>
    where
        FlowKey<A>: aya::Pod,
        Flow<A>: aya::Pod,
    {
        let map = HashMap::<_, FlowKey<A>, Flow<A>>::try_from(self.ebpf.map(name).context("flows")?)?;
        let mut all: Vec<(FlowKey<A>, Flow<A>)> = map.iter().collect::<Result<_, _>>()?;
        for (_, flow) in &mut all {
            flow.track.last_seen = 0;
            // The handshake bits are checked by packet_fixtures.rs; FIN and RST stay.
            flow.track.state &= proxy_common::flow_state::FIN | proxy_common::flow_state::RST;
        }
        all.sort_by_key(|(key, _)| (key.src_addr, key.src_port));
        Ok(all)
    }

    /// Runs `frame` through the program as received on the veth NIC.
    fn run(&self, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
        let program: &Xdp = self.ebpf.program(PROGRAM).context("program")?.try_into()?;
        // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress.
        let mut ctx = [0u8; 24];
        // The kernel wants data_end to be the frame's length.
        ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
        ctx[12..16].copy_from_slice(&self.ifindex.to_ne_bytes());
        let mut out = vec![0u8; frame.len() + 256];
        let result = self.netns.run(|| {
            Ok(program.test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                repeat: 1,
                ..Default::default()
            })?)
        })?;
        out.truncate(result.data_size_out as usize);
        Ok((result.return_value, out))
    }
}

fn frame_mac(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// What the client would have sent straight to the backend, as the NIC sends it on.
fn forwarded(packet: Packet) -> Vec<u8> {
    with_backend_macs(packet.build())
}

fn with_backend_macs(mut frame: Vec<u8>) -> Vec<u8> {
    frame[..6].copy_from_slice(&BACKEND_MAC);
    frame[6..12].copy_from_slice(&NIC_MAC);
    frame
}

fn expect_same(actual: &[u8], expected: &[u8]) -> Result<()> {
    ensure!(actual == expected, "output frame\n  expected {}\n  actual   {}", hex(expected), hex(actual));
    // Independent of the expected bytes: both checksums verify.
    parse_ipv4(actual).map_err(|error| anyhow::anyhow!("output frame does not verify: {error}"))?;
    Ok(())
}

fn expect_same6(actual: &[u8], expected: &[u8]) -> Result<()> {
    ensure!(actual == expected, "output frame\n  expected {}\n  actual   {}", hex(expected), hex(actual));
    parse_ipv6(actual).map_err(|error| anyhow::anyhow!("output frame does not verify: {error}"))?;
    Ok(())
}

/// The two entries of a connection balanced without masquerading, with the service's counter
/// (3), sorted as [`World::flows`] lists them.
fn tracked_entries<A: Family + Ord>(
    client: frame::Ep<A>,
    frontend: frame::Ep<A>,
    backend: frame::Ep<A>,
    proto: u8,
) -> Vec<(FlowKey<A>, Flow<A>)> {
    let mut entries = nat_entries(client, frontend, backend, proto);
    for (_, flow) in &mut entries {
        flow.track.counter = 3;
        if flow.flags & flow_flags::REPLY == 0 {
            flow.flags |= flow_flags::FROM_OUTSIDE;
        }
    }
    entries.sort_by_key(|(key, _)| (key.src_addr, key.src_port));
    entries
}

/// The forward entry of a client from outside balanced to `backend`.
fn forward_entry<A: Family>(backend: frame::Ep<A>) -> Flow<A> {
    Flow {
        src_addr: A::UNSPECIFIED,
        src_port: 0,
        dst_addr: backend.addr,
        dst_port: backend.port,
        flags: flow_flags::REWRITE_DESTINATION | flow_flags::FROM_OUTSIDE,
        track: FlowTrack { counter: 3, ..FlowTrack::default() },
        next_hop: Default::default(),
    }
}

#[test]
fn a_new_tcp_nodeport_connection_is_dnated_and_sent_back_out() -> Result<()> {
    let mut world = World::new("tcp")?;
    world.service(IPPROTO_TCP, 0)?;
    let (verdict, out) = world.run(&Packet::tcp(CLIENT, NODE_PORT).build())?;
    ensure!(verdict == XDP_TX, "verdict {verdict}, expected XDP_TX");
    expect_same(&out, &forwarded(Packet::tcp(CLIENT, BACKEND)))?;
    // The same two entries TC records, so TC continues the connection (the replies).
    let expected = tracked_entries(CLIENT, NODE_PORT, BACKEND, IPPROTO_TCP);
    ensure!(world.flows()? == expected, "flows {:?}", world.flows()?);
    Ok(())
}

#[test]
fn udp_nodeport_datagrams_get_valid_checksums_and_zero_stays_zero() -> Result<()> {
    let mut world = World::new("udp")?;
    world.service(IPPROTO_UDP, 0)?;
    let (verdict, out) = world.run(&Packet::udp(CLIENT, NODE_PORT).build())?;
    ensure!(verdict == XDP_TX, "verdict {verdict}");
    expect_same(&out, &forwarded(Packet::udp(CLIENT, BACKEND)))?;
    let (verdict, out) = world.run(&Packet::udp(CLIENT, NODE_PORT).no_udp_checksum().build())?;
    ensure!(verdict == XDP_TX, "verdict {verdict}");
    expect_same(&out, &forwarded(Packet::udp(CLIENT, BACKEND).no_udp_checksum()))?;
    Ok(())
}

#[test]
fn an_established_flow_is_rewritten_from_its_entry() -> Result<()> {
    let mut world = World::new("est")?;
    // No service at all: only the flow entry (as TC would have left it) says where to go.
    let other = ep([10, 0, 0, 2], 9090);
    world.insert_flow(pins::FLOWS4, flow_key(CLIENT, NODE_PORT, IPPROTO_TCP), forward_entry(other))?;
    let (verdict, out) = world.run(&Packet::tcp(CLIENT, NODE_PORT).build())?;
    ensure!(verdict == XDP_TX, "verdict {verdict}");
    expect_same(&out, &forwarded(Packet::tcp(CLIENT, other)))?;
    Ok(())
}

/// A tracked connection that was not balanced from outside (a pod's or the node's, or one an
/// earlier vipr stored) is TC's, whatever its packet's source address: its source is not
/// classified again per packet, the entry says it.
#[test]
fn an_entry_not_marked_from_outside_passes_to_tc() -> Result<()> {
    let mut world = World::new("orig")?;
    let other = ep([10, 0, 0, 2], 9090);
    let mut entry = forward_entry(other);
    entry.flags &= !flow_flags::FROM_OUTSIDE;
    world.insert_flow(pins::FLOWS4, flow_key(CLIENT, NODE_PORT, IPPROTO_TCP), entry)?;
    let frame = Packet::tcp(CLIENT, NODE_PORT).build();
    let (verdict, out) = world.run(&frame)?;
    ensure!(verdict == XDP_PASS && out == frame, "verdict {verdict}, expected XDP_PASS untouched");
    Ok(())
}

#[test]
fn what_xdp_does_not_finish_passes_to_tc_untouched() -> Result<()> {
    let mut world = World::new("pass")?;
    world.service(IPPROTO_TCP, 0)?;
    let unknown = Packet::tcp(CLIENT, ep(NODE, 22)).build();
    let icmp = Packet::icmp_echo(CLIENT.addr, NODE).build();
    let fragment = Packet::udp(CLIENT, NODE_PORT).frag(frame::IP_MF).build();
    let no_service = Packet::udp(CLIENT, NODE_PORT).build();
    for (what, frame) in
        [("unknown", unknown), ("icmp", icmp), ("first fragment", fragment), ("udp/no service", no_service)]
    {
        let (verdict, out) = world.run(&frame)?;
        ensure!(verdict == XDP_PASS, "{what}: verdict {verdict}, expected XDP_PASS");
        ensure!(out == frame, "{what}: frame changed");
    }
    // A source-ranges service whose ranges the client is not in: TC's drop, not XDP's.
    world.service(IPPROTO_TCP, service_flags::SOURCE_RANGES)?;
    let (verdict, _) = world.run(&Packet::tcp(CLIENT, NODE_PORT).build())?;
    ensure!(verdict == XDP_PASS, "source ranges: verdict {verdict}");
    ensure!(world.flows()?.is_empty(), "nothing recorded for passed packets");
    Ok(())
}

/// XDP parses with TC's parser, which takes SCTP too; SCTP's checksum is a CRC that XDP does
/// not update, so a balanced SCTP service's packets are TC's.
#[test]
fn sctp_to_a_balanced_service_passes_to_tc() -> Result<()> {
    let mut world = World::new("sctp")?;
    world.service(IPPROTO_SCTP, 0)?;
    let frame = Packet::sctp(CLIENT, NODE_PORT, 1, &[]).build();
    let (verdict, out) = world.run(&frame)?;
    ensure!(verdict == XDP_PASS, "sctp: verdict {verdict}, expected XDP_PASS");
    ensure!(out == frame, "sctp: frame changed");
    ensure!(world.flows()?.is_empty(), "nothing recorded for a passed packet");
    Ok(())
}

#[test]
fn replies_and_unrouted_backends_pass_to_tc() -> Result<()> {
    let mut world = World::new("reply")?;
    world.service(IPPROTO_TCP, 0)?;
    // The first packet records the reply entry; the backend's reply is TC's.
    let (verdict, _) = world.run(&Packet::tcp(CLIENT, NODE_PORT).build())?;
    ensure!(verdict == XDP_TX, "verdict {verdict}");
    let reply = Packet::tcp(BACKEND, CLIENT).build();
    let (verdict, out) = world.run(&reply)?;
    ensure!(verdict == XDP_PASS && out == reply, "reply: verdict {verdict}");
    // A backend without a resolved neighbour: TC resolves it with bpf_redirect_neigh.
    world.netns.ip(&["neigh", "del", "10.0.0.2", "dev", "xdp0"])?;
    let second = Packet::tcp(ep(CLIENT.addr, 40001), NODE_PORT).build();
    let (verdict, out) = world.run(&second)?;
    ensure!(verdict == XDP_PASS && out == second, "no neighbour: verdict {verdict}");
    ensure!(verdict != XDP_DROP);
    Ok(())
}

#[test]
fn a_new_tcp_nodeport_connection_over_ipv6_is_dnated_and_sent_back_out() -> Result<()> {
    let mut world = World::new("tcp6")?;
    world.service6(IPPROTO_TCP)?;
    let (verdict, out) = world.run(&Packet6::tcp(CLIENT6, NODE_PORT6).build())?;
    ensure!(verdict == XDP_TX, "verdict {verdict}, expected XDP_TX");
    expect_same6(&out, &with_backend_macs(Packet6::tcp(CLIENT6, BACKEND6).build()))?;
    // The same two entries TC records for IPv6, so TC continues the connection.
    let expected = tracked_entries(CLIENT6, NODE_PORT6, BACKEND6, IPPROTO_TCP);
    ensure!(world.flows6()? == expected, "flows {:?}", world.flows6()?);
    Ok(())
}

#[test]
fn udp_over_ipv6_and_established_ipv6_flows_get_valid_checksums() -> Result<()> {
    let mut world = World::new("udp6")?;
    world.service6(IPPROTO_UDP)?;
    let payload = b"checksum me";
    let (verdict, out) = world.run(&Packet6::udp(CLIENT6, NODE_PORT6).payload(payload).build())?;
    ensure!(verdict == XDP_TX, "verdict {verdict}");
    expect_same6(&out, &with_backend_macs(Packet6::udp(CLIENT6, BACKEND6).payload(payload).build()))?;
    // A TCP connection known only by its flow entry (as TC would have left it).
    let other = ep6(BACKEND6.addr, 9090);
    world.insert_flow(pins::FLOWS6, flow_key(CLIENT6, NODE_PORT6, IPPROTO_TCP), forward_entry(other))?;
    let (verdict, out) = world.run(&Packet6::tcp(CLIENT6, NODE_PORT6).build())?;
    ensure!(verdict == XDP_TX, "established: verdict {verdict}");
    expect_same6(&out, &with_backend_macs(Packet6::tcp(CLIENT6, other).build()))?;
    Ok(())
}

/// What the IPv6 parser refuses (extension headers, a UDP checksum of 0, which IPv6 forbids)
/// and replies are TC's, untouched.
#[test]
fn ipv6_packets_xdp_does_not_finish_pass_to_tc_untouched() -> Result<()> {
    let mut world = World::new("pass6")?;
    world.service6(IPPROTO_UDP)?;
    world.service6(IPPROTO_TCP)?;
    let extension = Packet6::tcp(CLIENT6, NODE_PORT6).extension(NEXTHDR_DEST).build();
    let zero_checksum = Packet6::udp(CLIENT6, NODE_PORT6).no_udp_checksum().build();
    let reply = Packet6::tcp(BACKEND6, CLIENT6).build();
    let unknown = Packet6::tcp(CLIENT6, ep6(NODE6, 22)).build();
    for (what, frame) in [
        ("extension header", extension),
        ("udp checksum 0", zero_checksum),
        ("reply", reply),
        ("unknown port", unknown),
    ] {
        let (verdict, out) = world.run(&frame)?;
        ensure!(verdict == XDP_PASS, "{what}: verdict {verdict}, expected XDP_PASS");
        ensure!(out == frame, "{what}: frame changed");
    }
    ensure!(world.flows6()?.is_empty(), "nothing recorded for passed packets");
    Ok(())
}

/// What node 2 receives from the NIC: `packet` with node 2's MAC as destination.
fn to_node_two(frame: Vec<u8>) -> Vec<u8> {
    let mut frame = frame;
    frame[..6].copy_from_slice(&NODE2_MAC);
    frame[6..12].copy_from_slice(&NIC_MAC);
    frame
}

/// The flow entries of `connections` sent by direct server return: a forward entry each
/// (destination rewritten, source kept), no reply entry, as TC stores them.
fn dsr_entries<A: Family + Ord>(
    connections: &[(frame::Ep<A>, u8)],
    frontend: frame::Ep<A>,
    pod: frame::Ep<A>,
) -> Vec<(FlowKey<A>, Flow<A>)> {
    let mut entries: Vec<_> = connections
        .iter()
        .map(|&(client, proto)| {
            let mut entry = forward_entry(pod);
            entry.flags |= flow_flags::DSR_INGRESS;
            (flow_key(client, frontend, proto), entry)
        })
        .collect();
    entries.sort_by_key(|(key, _)| key.proto);
    entries
}

/// [`World::flows`]' entries in [`dsr_entries`]' order.
fn by_protocol<A: Family>(mut entries: Vec<(FlowKey<A>, Flow<A>)>) -> Vec<(FlowKey<A>, Flow<A>)> {
    entries.sort_by_key(|(key, _)| key.proto);
    entries
}

/// [`expect_same6`] for a frame with vipr's destination-options header, which the checking
/// parser refuses. The expected frame's L4 checksum is computed over the pseudo header, which
/// the extension header does not enter: an equal frame has a valid checksum.
fn expect_carried6(actual: &[u8], expected: &[u8]) -> Result<()> {
    ensure!(actual == expected, "output frame\n  expected {}\n  actual   {}", hex(expected), hex(actual));
    Ok(())
}

/// Direct server return from XDP (`--lb-mode=dsr`): a new TCP connection to a pod behind
/// another node leaves for that node with its destination rewritten, its source kept and the
/// service address in vipr's IPv4 option (the frame grown at its front); the ACK that follows
/// is a plain rewrite; every UDP datagram carries the option. Only forward entries are stored,
/// as TC stores them, and the connections are counted as sent by DSR.
#[test]
fn dsr_requests_leave_for_the_backend_s_node_with_the_service_address() -> Result<()> {
    let mut world = World::new("dsr")?;
    world.node_two()?;
    world.service_to(IPPROTO_TCP, service_flags::MASQUERADE | service_flags::DSR, POD)?;
    let syn = Packet::tcp(CLIENT, NODE_PORT).tcp_flags(0x02).payload(b"");
    let (verdict, out) = world.run(&syn.build())?;
    ensure!(verdict == XDP_TX, "SYN: verdict {verdict}, expected XDP_TX");
    expect_same(&out, &to_node_two(syn.clone().to(POD).ip_options(&NODE_PORT_OPTION).build()))
        .context("SYN")?;
    let ack = Packet::tcp(CLIENT, NODE_PORT).tcp_flags(0x10).payload(b"data");
    let (verdict, out) = world.run(&ack.build())?;
    ensure!(verdict == XDP_TX, "ACK: verdict {verdict}");
    expect_same(&out, &to_node_two(ack.to(POD).build())).context("ACK")?;

    world.service_to(IPPROTO_UDP, service_flags::MASQUERADE | service_flags::DSR, POD)?;
    let datagram = Packet::udp(CLIENT, NODE_PORT);
    for round in 0..2 {
        let (verdict, out) = world.run(&datagram.build())?;
        ensure!(verdict == XDP_TX, "datagram {round}: verdict {verdict}");
        expect_same(&out, &to_node_two(datagram.clone().to(POD).ip_options(&NODE_PORT_OPTION).build()))
            .with_context(|| format!("datagram {round}"))?;
    }
    let expected = dsr_entries(&[(CLIENT, IPPROTO_TCP), (CLIENT, IPPROTO_UDP)], NODE_PORT, POD);
    ensure!(by_protocol(world.flows()?) == expected, "flows {:?}", world.flows()?);
    ensure!(world.datapath_stat(datapath_stat::DSR_SENT)? == 2, "DSR_SENT");
    Ok(())
}

/// The same over IPv6: the service address in a destination-options header of 24 bytes.
#[test]
fn ipv6_dsr_requests_leave_with_the_service_address_in_a_destination_options_header() -> Result<()> {
    let mut world = World::new("dsr6")?;
    world.node_two()?;
    world.service6_to(IPPROTO_TCP, service_flags::MASQUERADE | service_flags::DSR, POD6)?;
    let carrier = dsr_carrier6(NODE_PORT6);
    let syn = Packet6::tcp(CLIENT6, NODE_PORT6).tcp_flags(0x02).payload(b"");
    let (verdict, out) = world.run(&syn.build())?;
    ensure!(verdict == XDP_TX, "SYN: verdict {verdict}, expected XDP_TX");
    let sent = syn.clone().to(POD6).extension_bytes(NEXTHDR_DEST, &carrier);
    expect_carried6(&out, &to_node_two(sent.build())).context("SYN")?;
    let ack = Packet6::tcp(CLIENT6, NODE_PORT6).tcp_flags(0x10).payload(b"data");
    let (verdict, out) = world.run(&ack.build())?;
    ensure!(verdict == XDP_TX, "ACK: verdict {verdict}");
    expect_same6(&out, &to_node_two(ack.to(POD6).build())).context("ACK")?;

    world.service6_to(IPPROTO_UDP, service_flags::MASQUERADE | service_flags::DSR, POD6)?;
    let datagram = Packet6::udp(CLIENT6, NODE_PORT6).payload(b"ask");
    let (verdict, out) = world.run(&datagram.build())?;
    ensure!(verdict == XDP_TX, "datagram: verdict {verdict}");
    let sent = datagram.to(POD6).extension_bytes(NEXTHDR_DEST, &carrier);
    expect_carried6(&out, &to_node_two(sent.build())).context("datagram")?;
    let expected = dsr_entries(&[(CLIENT6, IPPROTO_TCP), (CLIENT6, IPPROTO_UDP)], NODE_PORT6, POD6);
    ensure!(by_protocol(world.flows6()?) == expected, "flows {:?}", world.flows6()?);
    ensure!(world.datapath_stat(datapath_stat::DSR_SENT)? == 2, "DSR_SENT");
    Ok(())
}

/// A request that would not fit the egress MTU with the option is TC's (it masquerades a new
/// connection instead, and counts that), untouched and unrecorded; a DSR frontend's backend on
/// the node's own link (no gateway: no vipr behind it to restore the service address) is
/// masqueraded by XDP, without the option.
#[test]
fn dsr_requests_without_room_or_a_remote_backend_are_not_sent_direct() -> Result<()> {
    let mut world = World::new("dsrmtu")?;
    world.node_two()?;
    world.netns.ip(&["link", "set", "xdp0", "mtu", "1280"])?;
    world.service_to(IPPROTO_UDP, service_flags::MASQUERADE | service_flags::DSR, POD)?;
    // 20 + 8 + 1248 = 1276 bytes: fits the MTU, not with the option's eight more.
    let big = Packet::udp(CLIENT, NODE_PORT).payload(&[0x5a; 1248]).build();
    let (verdict, out) = world.run(&big)?;
    ensure!(verdict == XDP_PASS && out == big, "too big: verdict {verdict}, expected XDP_PASS untouched");
    ensure!(world.flows()?.is_empty(), "nothing recorded for a passed packet");

    world.service_to(IPPROTO_TCP, service_flags::MASQUERADE | service_flags::DSR, BACKEND)?;
    let (verdict, out) = world.run(&Packet::tcp(CLIENT, NODE_PORT).build())?;
    ensure!(verdict == XDP_TX, "local backend: verdict {verdict}");
    let view = parse_ipv4(&out).map_err(|error| anyhow::anyhow!("output: {error}"))?;
    ensure!(
        view.source().addr == NODE
            && view.destination() == BACKEND
            && out.len() == Packet::tcp(CLIENT, NODE_PORT).build().len(),
        "not masqueraded without the option: {view:?}"
    );
    ensure!(world.datapath_stat(datapath_stat::DSR_SENT)? == 0, "DSR_SENT");
    Ok(())
}

/// Issue 16, item 4: an established connection's packets leave toward the next hop cached in
/// its flow entry, with no FIB lookup, while the route generation it was cached under is the
/// current one; a new generation (the agent's, on any route or neighbour change) makes the next
/// packet look the hop up again and cache what it finds. The device's MTU is checked on every
/// packet, cached hop or not; a hop TC cached without its neighbour (`--bpf-forwarding=stack`)
/// is looked up and cached with it.
#[test]
fn established_flows_leave_by_the_next_hop_cached_in_their_entry_until_the_routes_change() -> Result<()> {
    const NEW_MAC: [u8; 6] = [0x02, 0xbb, 0, 0, 0, 0x22];
    let mut world = World::new("hop")?;
    world.set_route_generation(5)?;
    let other = ep([10, 0, 0, 2], 9090);
    let key = flow_key(CLIENT, NODE_PORT, IPPROTO_TCP);
    world.insert_flow(pins::FLOWS4, key, forward_entry(other))?;
    let payload = [7u8; 100];
    let packet = Packet::tcp(CLIENT, NODE_PORT).payload(&payload).build();
    let expected = forwarded(Packet::tcp(CLIENT, other).payload(&payload));
    let (verdict, out) = world.run(&packet)?;
    ensure!(verdict == XDP_TX, "first: verdict {verdict}");
    expect_same(&out, &expected)?;
    let cached = NextHop { ifindex: world.ifindex, dst_mac: BACKEND_MAC, src_mac: NIC_MAC };
    let entry = world.flow_entry(pins::FLOWS4, key)?;
    ensure!(entry.next_hop == cached, "cached {:?}, expected {cached:?}", entry.next_hop);
    ensure!(entry.flags >> flow_flags::ROUTE_GENERATION_SHIFT == 5, "flags {:#x}", entry.flags);

    // The backend's address changes; under the same generation the packet still takes the
    // cached hop: no lookup was made.
    world.set_neighbour("10.0.0.2", &NEW_MAC)?;
    let (verdict, out) = world.run(&packet)?;
    ensure!(verdict == XDP_TX, "cached: verdict {verdict}");
    expect_same(&out, &expected)?;

    // A new generation: the packet follows the neighbour, and the entry caches it.
    world.set_route_generation(6)?;
    let mut moved = expected.clone();
    moved[..6].copy_from_slice(&NEW_MAC);
    let (verdict, out) = world.run(&packet)?;
    ensure!(verdict == XDP_TX, "after the change: verdict {verdict}");
    expect_same(&out, &moved)?;
    let entry = world.flow_entry(pins::FLOWS4, key)?;
    ensure!(entry.next_hop.dst_mac == NEW_MAC, "cached {:?}", entry.next_hop);
    ensure!(entry.flags >> flow_flags::ROUTE_GENERATION_SHIFT == 6, "flags {:#x}", entry.flags);

    // IPv6 takes the same steps (before the MTU below, which IPv6 would not survive).
    let key6 = flow_key(CLIENT6, NODE_PORT6, IPPROTO_TCP);
    let other6 = ep6(BACKEND6.addr, 9090);
    world.insert_flow(pins::FLOWS6, key6, forward_entry(other6))?;
    let packet6 = Packet6::tcp(CLIENT6, NODE_PORT6).build();
    let expected6 = with_backend_macs(Packet6::tcp(CLIENT6, other6).build());
    let (verdict, out) = world.run(&packet6)?;
    ensure!(verdict == XDP_TX, "IPv6: verdict {verdict}");
    expect_same6(&out, &expected6)?;
    let entry = world.flow_entry(pins::FLOWS6, key6)?;
    ensure!(entry.next_hop == cached, "IPv6: cached {:?}, expected {cached:?}", entry.next_hop);
    world.set_neighbour("fd00::2", &NEW_MAC)?;
    let (verdict, out) = world.run(&packet6)?;
    ensure!(verdict == XDP_TX, "IPv6 cached: verdict {verdict}");
    expect_same6(&out, &expected6)?;

    // The device's MTU drops below the packet (no new generation): it passes to TC untouched.
    let ip_len = packet.len() - 14;
    world.netns.ip(&["link", "set", "xdp0", "mtu", &(ip_len - 1).to_string()])?;
    let (verdict, out) = world.run(&packet)?;
    ensure!(verdict == XDP_PASS && out == packet, "too big: verdict {verdict}");
    world.netns.ip(&["link", "set", "xdp0", "mtu", &ip_len.to_string()])?;
    let (verdict, out) = world.run(&packet)?;
    ensure!(verdict == XDP_TX, "fits again: verdict {verdict}");
    expect_same(&out, &moved)?;

    // TC's hop without the neighbour, under the current generation: XDP looks the neighbour
    // up and caches it (on a device whose MTU is at least 1280, as every cached hop's).
    world.netns.ip(&["link", "set", "xdp0", "mtu", "1500"])?;
    let mut entry = world.flow_entry(pins::FLOWS4, key)?;
    entry.next_hop = NextHop { ifindex: world.ifindex, ..NextHop::default() };
    world.insert_flow(pins::FLOWS4, key, entry)?;
    let (verdict, out) = world.run(&packet)?;
    ensure!(verdict == XDP_TX, "TC's hop: verdict {verdict}");
    expect_same(&out, &moved)?;
    let entry = world.flow_entry(pins::FLOWS4, key)?;
    ensure!(
        entry.next_hop.dst_mac == NEW_MAC && entry.next_hop.src_mac == NIC_MAC,
        "cached {:?}",
        entry.next_hop
    );

    Ok(())
}

/// A route whose MTU is below its device's (here a locked route MTU, as an operator sets for a
/// path through a tunnel): the device's MTU, which a cached hop is checked against, is not the
/// packet's limit. Such a hop is never cached: every packet asks the FIB, which passes the
/// packets too big for the route to TC (the stack then answers "fragmentation needed") and
/// sends the others. Without the route, the hop is cached again.
#[test]
fn a_route_with_a_smaller_mtu_than_its_device_is_never_cached() -> Result<()> {
    let mut world = World::new("rtmtu")?;
    world.set_route_generation(5)?;
    let other = ep(BACKEND.addr, 9090);
    let key = flow_key(CLIENT, NODE_PORT, IPPROTO_TCP);
    world.insert_flow(pins::FLOWS4, key, forward_entry(other))?;
    let small = Packet::tcp(CLIENT, NODE_PORT).payload(&[7; 100]).build();
    let big = Packet::tcp(CLIENT, NODE_PORT).payload(&[7; 300]).build();
    // Between the two packets' IP lengths, far below the device's 1,500.
    world.netns.ip(&["route", "add", "10.0.0.2/32", "dev", "xdp0", "mtu", "lock", "300"])?;
    let (verdict, out) = world.run(&small)?;
    ensure!(verdict == XDP_TX, "small: verdict {verdict}");
    expect_same(&out, &forwarded(Packet::tcp(CLIENT, other).payload(&[7; 100])))?;
    let entry = world.flow_entry(pins::FLOWS4, key)?;
    ensure!(entry.next_hop == NextHop::default(), "cached {:?} under a route MTU", entry.next_hop);
    let (verdict, out) = world.run(&big)?;
    ensure!(verdict == XDP_PASS && out == big, "too big for the route: verdict {verdict}");

    // The same over IPv6 (1,280 is IPv6's least MTU).
    let key6 = flow_key(CLIENT6, NODE_PORT6, IPPROTO_TCP);
    let other6 = ep6(BACKEND6.addr, 9090);
    world.insert_flow(pins::FLOWS6, key6, forward_entry(other6))?;
    let small6 = Packet6::tcp(CLIENT6, NODE_PORT6).build();
    let big6 = Packet6::tcp(CLIENT6, NODE_PORT6).payload(&[7; 1300]).build();
    world.netns.ip(&["-6", "route", "add", "fd00::2/128", "dev", "xdp0", "mtu", "lock", "1280"])?;
    let (verdict, out) = world.run(&small6)?;
    ensure!(verdict == XDP_TX, "IPv6 small: verdict {verdict}");
    expect_same6(&out, &with_backend_macs(Packet6::tcp(CLIENT6, other6).build()))?;
    let entry = world.flow_entry(pins::FLOWS6, key6)?;
    ensure!(entry.next_hop == NextHop::default(), "IPv6: cached {:?} under a route MTU", entry.next_hop);
    let (verdict, out) = world.run(&big6)?;
    ensure!(verdict == XDP_PASS && out == big6, "IPv6 too big for the route: verdict {verdict}");

    // The routes go (the agent then changes the generation): the device's MTU is the limit,
    // and the hop is cached.
    world.netns.ip(&["route", "del", "10.0.0.2/32"])?;
    world.set_route_generation(6)?;
    let (verdict, out) = world.run(&big)?;
    ensure!(verdict == XDP_TX, "without the route: verdict {verdict}");
    expect_same(&out, &forwarded(Packet::tcp(CLIENT, other).payload(&[7; 300])))?;
    let cached = NextHop { ifindex: world.ifindex, dst_mac: BACKEND_MAC, src_mac: NIC_MAC };
    let entry = world.flow_entry(pins::FLOWS4, key)?;
    ensure!(entry.next_hop == cached, "cached {:?}, expected {cached:?}", entry.next_hop);
    Ok(())
}
