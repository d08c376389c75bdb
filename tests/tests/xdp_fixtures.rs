//! Fixtures for vipr's XDP fast path (`proxy-ebpf/src/xdp.rs`), run with BPF_PROG_TEST_RUN.
//!
//! The program needs a FIB route with a resolved neighbour, so each fixture runs in a network
//! namespace of its own holding a veth "NIC" (`xdp0`, 10.0.0.1/24) with a permanent
//! neighbour entry for the backend: the program's frame goes back out of the interface it came
//! in on (`XDP_TX`), with the backend's MAC as destination. Every rewritten frame is compared
//! byte for byte with the frame a client would have sent straight to the backend, and its
//! checksums are recomputed independently. Needs root (BPF, mount, netns).

use testbed::fixtures::{frame, harness};

use anyhow::{ensure, Context as _, Result};
use aya::{
    maps::HashMap,
    programs::{TestRun as _, TestRunOptions, Xdp},
    Ebpf, EbpfLoader,
};
use frame::{ep, hex, parse_ipv4, Ep, Packet, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};
use harness::{flow_key, PrivateBpffs};
use proxy_common::{
    flow_flags, pins, service_flags, source_class, Backend4, BackendSlot, Flow4, FlowKey4, FlowTrack,
    Service, ServiceKey4,
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
        netns.ip(&["addr", "add", "10.0.0.1/24", "dev", "xdp0"])?;
        netns.ip(&["link", "set", "xdp0", "up"])?;
        // The client is outside: reached through a router on the same link.
        netns.ip(&["route", "add", "192.168.1.0/24", "via", "10.0.0.254"])?;
        netns.ip(&[
            "neigh",
            "add",
            "10.0.0.2",
            "lladdr",
            &frame_mac(&BACKEND_MAC),
            "dev",
            "xdp0",
            "nud",
            "permanent",
        ])?;
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
        let backend = Backend4 { addr: BACKEND.addr, port: BACKEND.port, pad: 0, counter: 3 };
        HashMap::<_, BackendSlot, Backend4>::try_from(self.ebpf.map_mut(pins::BACKENDS4).context("back")?)?
            .insert(BackendSlot { backend_set: SET, slot: 0 }, backend, 0)?;
        Ok(())
    }

    fn flows(&self) -> Result<Vec<(FlowKey4, Flow4)>> {
        let map = HashMap::<_, FlowKey4, Flow4>::try_from(self.ebpf.map(pins::FLOWS4).context("flows")?)?;
        let mut all: Vec<(FlowKey4, Flow4)> = map.iter().collect::<Result<_, _>>()?;
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
    let mut frame = packet.build();
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

fn forward_entry(backend: Ep) -> Flow4 {
    Flow4 {
        src_addr: [0; 4],
        src_port: 0,
        dst_addr: backend.addr,
        dst_port: backend.port,
        flags: flow_flags::REWRITE_DESTINATION,
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
    let reply = Flow4 {
        src_addr: NODE_PORT.addr,
        src_port: NODE_PORT.port,
        dst_addr: [0; 4],
        dst_port: 0,
        flags: flow_flags::REPLY | flow_flags::REWRITE_SOURCE,
        track: FlowTrack { counter: 3, ..FlowTrack::default() },
        next_hop: Default::default(),
    };
    let mut expected = vec![
        (flow_key(CLIENT, NODE_PORT, IPPROTO_TCP), forward_entry(BACKEND)),
        (flow_key(BACKEND, CLIENT, IPPROTO_TCP), reply),
    ];
    expected.sort_by_key(|(key, _)| (key.src_addr, key.src_port));
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
    HashMap::<_, FlowKey4, Flow4>::try_from(world.ebpf.map_mut(pins::FLOWS4).context("flows")?)?.insert(
        flow_key(CLIENT, NODE_PORT, IPPROTO_TCP),
        forward_entry(other),
        0,
    )?;
    let (verdict, out) = world.run(&Packet::tcp(CLIENT, NODE_PORT).build())?;
    ensure!(verdict == XDP_TX, "verdict {verdict}");
    expect_same(&out, &forwarded(Packet::tcp(CLIENT, other)))?;
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
