//! nftables mode at scale, the dataplane driven as a library in a fresh network namespace
//! (needs root): 10,000 services × 10 endpoints programmed from empty, one endpoint change
//! among them, and a full resync at 44,000 services; and new connections/s through one
//! service of 1 and of 30,000 services. Ignored by default (a minute of work each);
//! `cargo test -p vipr-tests --test nftables_scale -- --ignored --nocapture` prints the
//! figures docs/benchmarks.md ("nftables") records.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4},
    time::{Duration, Instant},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::json;
use testbed::{exchanges, unique_name, EchoServer, Frontend, LeafSpec, Netns, Protocol, Topology};
use vipr::{
    dataplane::{
        nftables::{NftablesDataplane, NftablesOptions},
        Dataplane,
    },
    model::{
        kubernetes::{desired_state, NodeContext, SERVICE_NAME_LABEL},
        DesiredState,
    },
};

fn service(index: usize) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": format!("svc{index}"), "namespace": "bench"},
        "spec": {
            "type": if index.is_multiple_of(3) { "NodePort" } else { "ClusterIP" },
            "clusterIP": IpAddr::from([172, 30 + (index / 62500) as u8, (index / 250 % 250) as u8, (index % 250 + 1) as u8]).to_string(),
            "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
        },
    }))
    .unwrap()
}

/// `endpoints` endpoints of service `index`, moved by `generation`.
fn slice(index: usize, endpoints: usize, generation: usize) -> EndpointSlice {
    let mut slice = slice_json(index, endpoints, generation);
    if index == 0 && generation == usize::MAX {
        // The service the connection measurement reaches: its one endpoint is the lab's backend.
        slice["endpoints"] = json!([{"addresses": [BACKEND.to_string()], "nodeName": "node-b"}]);
    }
    serde_json::from_value(slice).unwrap()
}

fn slice_json(index: usize, endpoints: usize, generation: usize) -> serde_json::Value {
    let generation = if generation == usize::MAX { 0 } else { generation };
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("svc{index}-1"), "namespace": "bench", "labels": {SERVICE_NAME_LABEL: format!("svc{index}")}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": (0..endpoints).map(|e| json!({
            "addresses": [format!("10.{}.{}.{}", 100 + index / 250 % 150, index % 250, e + 1 + generation)],
            "nodeName": "node-b",
        })).collect::<Vec<_>>(),
    })
}

fn state(services: usize, endpoints: usize, generation: usize) -> DesiredState {
    let node_ip: IpAddr = "192.168.0.2".parse().unwrap();
    let node = NodeContext {
        name: "node-a".into(),
        cluster_cidrs: vec!["10.0.0.0/8".parse().unwrap()],
        node_ips: [node_ip].into(),
        primary_ips: vec![node_ip],
        node_port_ips: [node_ip].into(),
        ..NodeContext::default()
    };
    let objects: Vec<Service> = (0..services).map(service).collect();
    let slices: Vec<EndpointSlice> =
        (0..services).map(|i| slice(i, endpoints, if i == 0 { generation } else { 0 })).collect();
    // (generation usize::MAX: service 0 leads to the lab's backend, see `slice`.)
    let translation = desired_state(&objects, &slices, &node);
    assert!(translation.rejected.is_empty(), "{:?}", translation.rejected.first());
    translation.state
}

/// Syncs `state`; prints and returns (the whole sync, nft alone) in seconds.
fn timed(dataplane: &mut NftablesDataplane, state: &DesiredState, what: &str) -> (f64, f64) {
    let started = Instant::now();
    let report = dataplane.sync(state).unwrap();
    let total = started.elapsed().as_secs_f64();
    assert!(report.is_complete(), "{report:?}");
    let stats = dataplane.last_sync();
    let nft: f64 = stats.batches.iter().map(|applied| applied.took.as_secs_f64()).sum();
    let lines: usize = stats.batches.iter().map(|applied| applied.batch.text.lines().count()).sum();
    eprintln!("{what}: sync {total:.3} s (nft -f {nft:.3} s, {lines} batch lines, full: {})", stats.full);
    (total, nft)
}

#[test]
#[ignore = "scale measurement: a minute of work; run with --ignored --nocapture"]
fn ten_thousand_services_then_one_endpoint_change_then_a_full_resync_at_44k() {
    testbed::require_root().unwrap();
    let netns = Netns::create(&unique_name("nft-scale")).unwrap();
    netns
        .run(|| {
            let options = NftablesOptions { conntrack_cleanup: false, ..NftablesOptions::default() };
            let mut dataplane = NftablesDataplane::start(&options)?;
            let ten_k = state(10_000, 10, 0);
            timed(&mut dataplane, &ten_k, "10k services x 10 endpoints, from empty");
            let changed = state(10_000, 10, 1);
            let (_, _) = timed(&mut dataplane, &changed, "one endpoint change at 10k services");
            let batch = &dataplane.last_sync().batches[0].batch;
            assert_eq!(batch.chains_written.len(), 1, "only that service's chain is rewritten");
            let big = state(44_000, 2, 0);
            timed(&mut dataplane, &big, "44k services x 2 endpoints, partial (from 10k)");
            dataplane.request_full_sync();
            timed(&mut dataplane, &big, "44k services x 2 endpoints, full resync");
            Ok(())
        })
        .unwrap();
}

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 2);
/// Service 0's cluster IP.
const VIP: Ipv4Addr = Ipv4Addr::new(172, 30, 0, 1);
const CONNECTIONS: usize = 400;

/// New connections/s (TCP connect, one request and its answer, close) from the client to
/// service 0, best of three rounds.
fn connections_per_second(topology: &Topology) -> f64 {
    let client = &topology.leaf("client").unwrap().netns;
    let frontend = Frontend { addr: SocketAddrV4::new(VIP, 80), protocol: Protocol::Tcp };
    (0..3)
        .map(|_| {
            let started = Instant::now();
            let answers = client.run(|| exchanges(frontend, CONNECTIONS, Duration::from_secs(2))).unwrap();
            assert_eq!(answers.len(), CONNECTIONS);
            CONNECTIONS as f64 / started.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max)
}

#[test]
#[ignore = "scale measurement: a minute of work; run with --ignored --nocapture"]
fn new_connections_per_second_at_30k_services_as_at_one() {
    testbed::require_root().unwrap();
    let leaves = vec![
        LeafSpec::in_own_slash24("client", CLIENT).unwrap(),
        LeafSpec::in_own_slash24("backend", BACKEND).unwrap(),
    ];
    let topology = Topology::build("nft-cps", leaves).unwrap();
    let backend = &topology.leaf("backend").unwrap().netns;
    let _server = EchoServer::start(backend, "backend", &[SocketAddr::from((BACKEND, 8080))], &[]).unwrap();
    let one = state(1, 1, usize::MAX);
    let many = state(30_000, 2, usize::MAX);
    let (at_one, at_many) = topology
        .node()
        .run(|| {
            let options = NftablesOptions { conntrack_cleanup: false, ..NftablesOptions::default() };
            let mut dataplane = NftablesDataplane::start(&options)?;
            dataplane.sync(&one)?;
            let at_one = connections_per_second(&topology);
            dataplane.sync(&many)?;
            let at_many = connections_per_second(&topology);
            // Back to one service: the machine's drift between the rounds shows.
            dataplane.sync(&one)?;
            let again = connections_per_second(&topology);
            Ok((at_one.max(again), at_many))
        })
        .unwrap();
    eprintln!(
        "new connections/s: {at_one:.0} at 1 service (best of before and after), {at_many:.0} at 30k \
         services ({:.1}%)",
        100.0 * at_many / at_one
    );
}
