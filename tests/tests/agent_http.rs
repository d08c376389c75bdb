//! kube-proxy's HTTP endpoints, answered by the real vipr binary running in a network-namespace
//! lab and asked with real HTTP requests, as a kubelet probe, Prometheus or a cloud load
//! balancer would: `/healthz` and `/livez` on 10256, `/metrics` and `/proxyMode` on 10249, and
//! a service's health-check node port. Needs root and a built vipr (`cargo build -p
//! proxy-userspace`, or VIPR_BIN).

use std::{
    io::Write as _,
    net::{Ipv4Addr, SocketAddr, TcpStream},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{bail, Context as _, Result};
use aya::maps::{HashMap, Map, MapData, MapInfo};
use proxy_common::{pins, proto, Service, ServiceKey4};
use serde_json::Value;
use testbed::{
    count_by_backend, exchanges,
    http::{get, get_within, HttpAnswer},
    locate_vipr, manifest, raise_open_files_limit, wait_for, write_atomically, Check, ClusterIpService,
    Endpoint, Frontend, Lab, LabConfig, Netns, PidsLimit, Protocol, ServicePort, Vipr,
};

/// vipr's default `--healthz-bind-address` (0.0.0.0:10256), seen from inside the node.
const HEALTHZ: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 10256);
/// vipr's default `--metrics-bind-address`.
const METRICS: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 10249);
/// Bound on connecting and on a whole request.
const TIMEOUT: Duration = Duration::from_secs(5);
/// How long vipr may take to notice and answer a change.
const SETTLE: Duration = Duration::from_secs(20);

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 2);
const OTHER_BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 2, 2);

fn service(name: &str, last_octet: u8, endpoints: &[Ipv4Addr]) -> ClusterIpService {
    ClusterIpService {
        namespace: "default".to_owned(),
        name: name.to_owned(),
        cluster_ip: Ipv4Addr::new(10, 96, 0, last_octet),
        ports: vec![ServicePort {
            name: "http".to_owned(),
            protocol: Protocol::Tcp,
            port: 80,
            target_port: 8080,
        }],
        endpoints: endpoints.iter().map(|addr| Endpoint::ready(*addr, "pod")).collect(),
    }
}

fn web(endpoints: &[Ipv4Addr]) -> ClusterIpService {
    service("web", 10, endpoints)
}

fn lab(label: &str) -> Lab {
    Lab::new(
        LabConfig::with_backends(
            label,
            CLIENT,
            &[BACKEND, OTHER_BACKEND],
            vec![web(&[BACKEND, OTHER_BACKEND])],
        )
        .unwrap(),
    )
    .unwrap()
}

/// Starts vipr in the lab's node with kube-proxy flags of the test's choosing besides the
/// lab's own (the lab's `start_vipr` passes a fixed set).
fn start_vipr(lab: &Lab, flags: &[&str]) -> Vipr {
    let mut args = vec![
        "--proxy-mode=ebpf".to_owned(),
        format!("--services-file={}", lab.services_file().display()),
        format!("--hostname-override={}", lab.node().name()),
        format!("--devices={}", lab.topology().node_interfaces().join(",")),
        format!("--bpf-root={}", lab.bpf_root().display()),
        "--v=4".to_owned(),
    ];
    args.extend(flags.iter().map(|flag| (*flag).to_owned()));
    let log = lab.services_file().with_file_name("vipr.log");
    Vipr::start_with_args(&locate_vipr().unwrap(), lab.node(), &args, &log).unwrap()
}

/// An HTTP answer.
/// The JSON body of an answer.
fn json(answer: &HttpAnswer) -> Value {
    serde_json::from_str(&answer.body).unwrap_or_else(|error| panic!("{error}: {:?}", answer.body))
}

/// Polls `GET path` until `done` accepts the answer.
fn wait_for_answer(
    agent: &mut Vipr,
    netns: &Netns,
    address: SocketAddr,
    path: &str,
    what: &str,
    done: impl Fn(&HttpAnswer) -> bool,
) -> HttpAnswer {
    wait_for(what, SETTLE, || {
        agent.ensure_running()?;
        Ok(match get(netns, address, path) {
            Ok(answer) if done(&answer) => Check::Done(answer),
            Ok(answer) => Check::NotYet(format!("{answer:?}")),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })
    .unwrap()
}

/// A time as Go's `time.Time.String()` prints it, which kube-proxy's health answers carry.
fn is_go_time(text: &str) -> bool {
    let parts: Vec<&str> = text.split(' ').collect();
    matches!(parts.as_slice(), [date, time, "+0000", "UTC", monotonic]
        if date.len() == 10 && time.len() >= 8 && monotonic.starts_with("m=+"))
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs_f64()
}

#[test]
fn health_metrics_and_proxy_mode_answer_as_kube_proxy_does() {
    let mut lab = lab("http-answers");
    let started = unix_now();
    let mut agent = start_vipr(&lab, &[]);
    lab.wait_programmed().unwrap();
    let node = lab.node();
    let healthz =
        wait_for_answer(&mut agent, node, HEALTHZ, "/healthz", "/healthz", |answer| answer.status == 200);
    assert_eq!(healthz.content_type, "application/json");
    let body = json(&healthz);
    assert_eq!(body.as_object().unwrap().len(), 3, "{body}");
    assert_eq!(body["nodeEligible"], true);
    // Healthy: lastUpdated is reported as the current time, as kube-proxy does.
    assert_eq!(body["lastUpdated"], body["currentTime"]);
    assert!(is_go_time(body["currentTime"].as_str().unwrap()), "{body}");

    let livez = get(node, HEALTHZ, "/livez").unwrap();
    assert_eq!(livez.status, 200);
    let body = json(&livez);
    assert_eq!(body.as_object().unwrap().keys().collect::<Vec<_>>(), ["currentTime", "lastUpdated"]);

    let mode = get(node, METRICS, "/proxyMode").unwrap();
    assert_eq!((mode.status, mode.body.as_str()), (200, "ebpf"));

    // The sync is recorded once the maps it programmed are written, which `wait_programmed`
    // already saw: polled, not read once.
    const FIRST_SYNC: &str = r#"kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv4"}"#;
    let metrics =
        wait_for_answer(&mut agent, node, METRICS, "/metrics", "the first sync's metrics", |answer| {
            answer.metric(FIRST_SYNC).is_some_and(|count| count >= 1.0)
        });
    assert_eq!(metrics.status, 200);
    assert!(metrics.content_type.starts_with("text/plain; version=0.0.4"), "{}", metrics.content_type);
    for family in [
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "kubeproxy_network_programming_duration_seconds",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_service_changes_total",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "vipr_rejected_objects",
        "vipr_sync_failures_total",
        "vipr_sync_frontend_errors_total",
    ] {
        assert!(metrics.body.contains(&format!("# TYPE {family} ")), "no {family} in\n{}", metrics.body);
    }
    let last_sync =
        metrics.metric(r#"kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"}"#).unwrap();
    assert!(
        (started..=unix_now()).contains(&last_sync),
        "last sync at {last_sync}, test started at {started}"
    );
    assert_eq!(
        metrics.metric(r#"kubeproxy_sync_proxy_rules_service_changes_total{ip_family="IPv4"}"#),
        Some(1.0)
    );
    assert_eq!(
        metrics.metric(r#"kubeproxy_sync_proxy_rules_endpoint_changes_total{ip_family="IPv4"}"#),
        Some(1.0)
    );
    // The lab's slice is an IPv4 one: kube-proxy's IPv6 proxier would see no change.
    assert_eq!(
        metrics.metric(r#"kubeproxy_sync_proxy_rules_endpoint_changes_total{ip_family="IPv6"}"#),
        Some(0.0)
    );
    assert_eq!(metrics.metric("vipr_rejected_objects"), Some(0.0));
    assert_eq!(metrics.metric("vipr_sync_failures_total"), Some(0.0));
    assert!(metrics.metric("kubeproxy_proxy_healthz_total{code=\"200\"}").unwrap() >= 1.0);

    // One endpoint goes: one EndpointSlice change, no Service change, one more sync.
    let syncs =
        metrics.metric(r#"kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv4"}"#).unwrap();
    lab.set_services(vec![web(&[BACKEND])]).unwrap();
    lab.wait_programmed().unwrap();
    let node = lab.node();
    let metrics =
        wait_for_answer(&mut agent, node, METRICS, "/metrics", "the endpoint change to be counted", |m| {
            m.metric(r#"kubeproxy_sync_proxy_rules_endpoint_changes_total{ip_family="IPv4"}"#) == Some(2.0)
                && m.metric(r#"kubeproxy_sync_proxy_rules_endpoint_changes_pending{ip_family="IPv4"}"#)
                    == Some(0.0)
        });
    assert_eq!(
        metrics.metric(r#"kubeproxy_sync_proxy_rules_service_changes_total{ip_family="IPv4"}"#),
        Some(1.0)
    );
    assert!(
        metrics.metric(r#"kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv4"}"#).unwrap()
            > syncs
    );

    // The metrics server listens on the node's loopback only, as kube-proxy's default.
    let outside = SocketAddr::from((Ipv4Addr::new(10, 10, 0, 1), METRICS.port()));
    assert!(get(lab.client(), outside, "/metrics").is_err(), "metrics reachable from outside the node");
}

/// The eBPF datapath counts the packets and bytes of each (service port, endpoint) pair, both
/// directions, and `/metrics` reports them per endpoint and summed per service.
#[test]
fn datapath_counters_reach_the_metrics() {
    const CONNECTIONS: usize = 8;
    let mut lab = lab("http-counters");
    let mut agent = start_vipr(&lab, &[]);
    lab.wait_programmed().unwrap();
    let frontend = Frontend {
        addr: std::net::SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80),
        protocol: Protocol::Tcp,
    };
    let done = lab.client().run(|| exchanges(frontend, CONNECTIONS, TIMEOUT)).unwrap();
    let answered = count_by_backend(&done);

    // Label names Prometheus-Operator does not overwrite with its target labels.
    let service = r#"service_namespace="default",service_name="web",service_port="http",protocol="TCP""#;
    let service_packets = format!("vipr_service_packets_total{{{service}}}");
    // A connection is at least SYN, SYN-ACK, the request and its answer; the closing packets
    // may still be on their way.
    let metrics = wait_for_answer(&mut agent, lab.node(), METRICS, "/metrics", "the counters", |answer| {
        answer.metric(&service_packets).is_some_and(|packets| packets >= (4 * CONNECTIONS) as f64)
    });
    let mut sum = (0.0, 0.0);
    for (name, addr) in [("b1", BACKEND), ("b2", OTHER_BACKEND)] {
        let labels = format!(r#"{{{service},backend="{addr}:8080"}}"#);
        let packets = metrics.metric(&format!("vipr_backend_packets_total{labels}")).unwrap();
        let bytes = metrics.metric(&format!("vipr_backend_bytes_total{labels}")).unwrap();
        let connections = answered.get(name).copied().unwrap_or(0) as f64;
        assert!(packets >= 4.0 * connections, "{name}: {packets} packets for {connections} connections");
        assert_eq!(packets == 0.0, connections == 0.0, "{name} counted packets without connections, or none");
        // Every packet carries at least an IPv4 and a TCP header.
        assert!(bytes >= 40.0 * packets, "{name}: {bytes} bytes in {packets} packets");
        sum = (sum.0 + packets, sum.1 + bytes);
    }
    assert_eq!(metrics.metric(&service_packets), Some(sum.0), "{}", metrics.body);
    assert_eq!(metrics.metric(&format!("vipr_service_bytes_total{{{service}}}")), Some(sum.1));
    for family in ["vipr_datapath_flow_insert_failures_total", "vipr_flow_entries_expired_total"] {
        assert!(
            metrics.body.contains(&format!("# TYPE {family} counter")),
            "no {family} in\n{}",
            metrics.body
        );
    }
    assert_eq!(
        metrics.metric(r#"vipr_datapath_flow_insert_failures_total{cause="forward_entry"}"#),
        Some(0.0)
    );
    // No series carries a label that Prometheus-Operator sets on every series of a target.
    for line in metrics.body.lines().filter(|line| !line.starts_with('#')) {
        for target_label in ["namespace", "service", "pod", "endpoint", "instance", "job", "container"] {
            assert!(
                !line.contains(&format!("{{{target_label}=\""))
                    && !line.contains(&format!(",{target_label}=\"")),
                "{line} has the target label {target_label}"
            );
        }
    }
}

/// `--metrics-per-endpoint=false` leaves out the per-endpoint series and keeps the
/// per-service sums.
#[test]
fn per_endpoint_series_can_be_turned_off() {
    let mut lab = lab("http-no-backend");
    let mut agent = start_vipr(&lab, &["--metrics-per-endpoint=false"]);
    lab.wait_programmed().unwrap();
    let metrics =
        wait_for_answer(&mut agent, lab.node(), METRICS, "/metrics", "the service counters", |answer| {
            answer.body.contains("# TYPE vipr_service_packets_total counter")
        });
    assert!(!metrics.body.contains("vipr_backend_"), "per-endpoint series in\n{}", metrics.body);
}

/// vipr's services map filled to capacity with entries for addresses nobody uses, as on a
/// node with more frontends than the map holds: the kernel then refuses every new frontend
/// (E2BIG) while existing ones keep working. Not a test hook: it is the real failure an
/// operator would meet, and vipr cannot tell it from one.
struct FullServicesMap {
    map: HashMap<MapData, ServiceKey4, Service>,
    filler: Vec<ServiceKey4>,
}

impl FullServicesMap {
    fn fill(lab: &Lab) -> Result<Self> {
        let path = lab.maps().path(pins::SERVICES4);
        let capacity = MapInfo::from_pin(&path)?.max_entries();
        let mut map: HashMap<MapData, ServiceKey4, Service> =
            HashMap::try_from(Map::HashMap(MapData::from_pin(&path)?))?;
        let used = map.keys().count() as u32;
        // 198.18.0.0/15 is reserved for benchmarks: no service of the test lives there.
        let filler: Vec<ServiceKey4> = (0..capacity - used)
            .map(|n| ServiceKey4 {
                addr: [198, 18, (n >> 16) as u8, (n >> 8) as u8],
                port: 1 + (n & 0xff) as u16,
                proto: proto::TCP,
                ..ServiceKey4::default()
            })
            .collect();
        for key in &filler {
            map.insert(key, Service::default(), 0).context("cannot fill the services map")?;
        }
        let overflow =
            ServiceKey4 { addr: [198, 19, 255, 255], port: 1, proto: proto::TCP, ..ServiceKey4::default() };
        if map.insert(overflow, Service::default(), 0).is_ok() {
            bail!("the services map took more than its {capacity} entries");
        }
        Ok(Self { map, filler })
    }

    fn drain(mut self) -> Result<()> {
        for key in &self.filler {
            self.map.remove(key)?;
        }
        Ok(())
    }
}

/// A full map (filled behind vipr's back, as by entries it cannot account for) makes the
/// kernel refuse a new frontend: that Service is refused alone and reported, the rest of the
/// node keeps being served, and /healthz and /livez stay 200, so that no liveness probe
/// restarts the agent in a loop (docs/reliability.md, *Capacity*). It is tried again at the
/// next change, not on every sync. (The unhealthy answers of a sync that fails as a whole are
/// held by health.rs's unit tests.)
#[test]
fn a_frontend_a_full_map_refuses_is_reported_the_node_stays_healthy_and_the_next_change_retries_it() {
    let mut lab = lab("http-stall");
    let mut agent = start_vipr(&lab, &["--sync-period=2s"]);
    lab.wait_programmed().unwrap();
    wait_for_answer(&mut agent, lab.node(), HEALTHZ, "/healthz", "/healthz", |answer| answer.status == 200);

    let full = FullServicesMap::fill(&lab).unwrap();
    lab.set_services(vec![web(&[BACKEND, OTHER_BACKEND]), service("api", 11, &[BACKEND])]).unwrap();
    let node = lab.node();
    let refused = wait_for_answer(&mut agent, node, METRICS, "/metrics", "the refusal", |answer| {
        answer.metric("vipr_rejected_objects").is_some_and(|count| count >= 1.0)
    });
    assert_eq!(refused.metric("vipr_sync_failures_total"), Some(0.0), "{}", refused.body);
    // Longer than twice the sync period, kube-proxy's unhealthy timeout: still healthy.
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        assert_eq!(get(node, HEALTHZ, "/healthz").unwrap().status, 200);
        assert_eq!(get(node, HEALTHZ, "/livez").unwrap().status, 200);
        std::thread::sleep(Duration::from_millis(250));
    }
    let log = std::fs::read_to_string(agent.log_path()).unwrap();
    let named = log.lines().filter(|line| line.contains("skipping Service default/api")).count();
    assert_eq!(named, 1, "the refused Service is named once, not once per sync:\n{log}");

    // Room again, and a change: the refused Service is tried again and programmed.
    full.drain().unwrap();
    lab.set_services(vec![
        web(&[BACKEND, OTHER_BACKEND]),
        service("api", 11, &[BACKEND]),
        service("later", 12, &[OTHER_BACKEND]),
    ])
    .unwrap();
    lab.wait_programmed().unwrap();
    assert_eq!(get(lab.node(), HEALTHZ, "/livez").unwrap().status, 200);
}

/// An RFC 3339 time, as the EndpointSlice controller writes its trigger-time annotation.
fn rfc3339(time: SystemTime) -> String {
    jiff::Timestamp::try_from(time).unwrap().to_string()
}

/// A LoadBalancer service with `externalTrafficPolicy: Local` and a health-check node port,
/// whose slice lists `local` on this node (ready or not) and another endpoint elsewhere.
fn local_load_balancer(lab: &Lab, local_ready: bool) -> String {
    let node = lab.node().name();
    let trigger_time = rfc3339(SystemTime::now());
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: lb, namespace: default}}
spec:
  type: LoadBalancer
  externalTrafficPolicy: Local
  healthCheckNodePort: 31999
  clusterIP: 10.96.0.20
  clusterIPs: [10.96.0.20]
  ports: [{{name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: 31080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: lb-1
  namespace: default
  labels: {{kubernetes.io/service-name: lb}}
  annotations: {{endpoints.kubernetes.io/last-change-trigger-time: \"{trigger_time}\"}}
addressType: IPv4
ports: [{{name: http, protocol: TCP, port: 8080}}]
endpoints:
- addresses: [{BACKEND}]
  nodeName: {node}
  conditions: {{ready: {local_ready}}}
- addresses: [{OTHER_BACKEND}]
  nodeName: elsewhere
  conditions: {{ready: true}}
"
    )
}

#[test]
fn health_check_node_port_answers_with_the_local_endpoints() {
    let mut lab = lab("http-hcnp");
    let mut agent = start_vipr(&lab, &["--nodeport-addresses=10.10.0.0/24"]);
    lab.wait_programmed().unwrap();
    let services = |local_ready| {
        format!("{}---\n{}", manifest::render(lab.services()), local_load_balancer(&lab, local_ready))
    };
    write_atomically(lab.services_file(), &services(true)).unwrap();

    // Asked as a cloud load balancer would: on the node's address, from outside the node.
    // (Health checks listen on the --nodeport-addresses, the client link's here.)
    let health_check = SocketAddr::from((Ipv4Addr::new(10, 10, 0, 1), 31999));
    let client = lab.client();
    let healthy = wait_for_answer(&mut agent, client, health_check, "/", "the health check to pass", |a| {
        a.status == 200
    });
    assert_eq!(healthy.content_type, "application/json");
    // kube-proxy's headers: no content sniffing, and the local endpoints as the node's weight.
    assert_eq!(healthy.header("X-Content-Type-Options"), Some("nosniff"));
    assert_eq!(healthy.header("X-Load-Balancing-Endpoint-Weight"), Some("1"));
    assert_eq!(
        json(&healthy),
        serde_json::json!({
            "service": {"namespace": "default", "name": "lb"},
            "localEndpoints": 1,
            "serviceProxyHealthy": true
        })
    );
    let metrics = get(lab.node(), METRICS, "/metrics").unwrap();
    assert!(
        metrics.metric(r#"kubeproxy_network_programming_duration_seconds_count{ip_family="IPv4"}"#).unwrap()
            >= 1.0,
        "the slice's trigger time was not measured:\n{}",
        metrics.body
    );

    write_atomically(lab.services_file(), &services(false)).unwrap();
    let failing = wait_for_answer(&mut agent, client, health_check, "/", "the health check to fail", |a| {
        a.status == 503
    });
    assert_eq!(json(&failing)["localEndpoints"], 0);
    assert_eq!(failing.header("X-Load-Balancing-Endpoint-Weight"), Some("0"));

    write_atomically(lab.services_file(), &manifest::render(lab.services())).unwrap();
    wait_for("the health check port to close", SETTLE, || {
        agent.ensure_running()?;
        Ok(match get(client, health_check, "/") {
            Err(_) => Check::Done(()),
            Ok(answer) => Check::NotYet(format!("{answer:?}")),
        })
    })
    .unwrap();
}

/// A kubelet's liveness probe gives up after 1 s by default.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the attacks below last: longer than vipr's header read timeout (5 s), so that
/// connections it times out are seen going and coming back.
const ATTACK: Duration = Duration::from_secs(8);
/// How much more memory vipr may use under attack than before it.
const RSS_GROWTH_LIMIT_KIB: u64 = 20 * 1024;

/// The resident memory of process `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in {status}"))
}

/// `count` connections to `address` that never send a byte, opened without waiting for the
/// handshakes (a connection the server cannot take in time stays pending, as an attacker's).
fn idle_connections(address: SocketAddr, count: usize) -> Result<Vec<socket2::Socket>> {
    (0..count)
        .map(|_| {
            let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
            socket.set_nonblocking(true)?;
            match socket.connect(&address.into()) {
                Err(error) if error.raw_os_error() != Some(libc::EINPROGRESS) => {
                    return Err(error).context("cannot open an idle connection")
                }
                _ => {}
            }
            Ok(socket)
        })
        .collect()
}

/// Sends one request whose header line never ends, as fast as `address` takes it, until `stop`;
/// starts over whenever the server closes or stops reading. Returns the bytes sent.
fn stream_endless_header(address: SocketAddr, stop: &AtomicBool) -> u64 {
    let chunk = vec![b'a'; 64 * 1024];
    let mut sent = 0;
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut stream) = TcpStream::connect_timeout(&address, PROBE_TIMEOUT) else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let _ = stream.set_write_timeout(Some(Duration::from_millis(500)));
        if stream.write_all(b"GET /livez HTTP/1.1\r\nHost: vipr\r\nX-Endless: ").is_err() {
            continue;
        }
        while !stop.load(Ordering::Relaxed) {
            match stream.write(&chunk) {
                Ok(written) => sent += written as u64,
                Err(_) => break,
            }
        }
    }
    sent
}

/// 2,000 idle connections and a client streaming an endless header line, at the proxy health
/// server and at a service's health-check node port: the kubelet's `/livez` probe and the
/// cloud load balancer's health check keep being answered within a second, vipr's memory stays
/// put and it keeps running.
#[test]
fn health_servers_keep_answering_under_idle_connections_and_endless_headers() {
    // Alone: probe latencies are measured, and the process holds thousands of sockets.
    let _alone = testbed::exclusive();
    const IDLE_CONNECTIONS: usize = 2000;
    raise_open_files_limit(2 * IDLE_CONNECTIONS as u64 + 1024).unwrap();
    let mut lab = lab("http-flood");
    let mut agent = start_vipr(&lab, &["--nodeport-addresses=10.10.0.0/24"]);
    lab.wait_programmed().unwrap();
    let services = format!("{}---\n{}", manifest::render(lab.services()), local_load_balancer(&lab, true));
    write_atomically(lab.services_file(), &services).unwrap();
    let health_check = SocketAddr::from((Ipv4Addr::new(10, 10, 0, 1), 31999));
    wait_for_answer(&mut agent, lab.client(), health_check, "/", "the health check", |a| a.status == 200);
    wait_for_answer(&mut agent, lab.node(), HEALTHZ, "/livez", "/livez", |answer| answer.status == 200);
    let rss_before = rss_kib(agent.pid());

    let (node, client) = (lab.node(), lab.client());
    let idle = (
        node.run(|| idle_connections(HEALTHZ, IDLE_CONNECTIONS)).unwrap(),
        client.run(|| idle_connections(health_check, IDLE_CONNECTIONS)).unwrap(),
    );
    let stop = AtomicBool::new(false);
    let streamed = std::thread::scope(|scope| {
        let streamers = [
            scope.spawn(|| node.run(|| Ok(stream_endless_header(HEALTHZ, &stop)))),
            scope.spawn(|| client.run(|| Ok(stream_endless_header(health_check, &stop)))),
        ];
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let started = Instant::now();
            let (mut probes, mut slowest, mut most_growth) = (0, Duration::ZERO, 0);
            while started.elapsed() < ATTACK {
                agent.ensure_running().unwrap();
                for (netns, address, path) in [(node, HEALTHZ, "/livez"), (client, health_check, "/")] {
                    let asked = Instant::now();
                    let answer = get_within(netns, address, path, PROBE_TIMEOUT).unwrap_or_else(|error| {
                        panic!("{address}{path} after {:?}: {error:#}", started.elapsed())
                    });
                    let took = asked.elapsed();
                    assert_eq!(answer.status, 200, "{address}{path}: {answer:?}");
                    assert!(took < PROBE_TIMEOUT, "{address}{path} took {took:?}");
                    slowest = slowest.max(took);
                }
                let growth = rss_kib(agent.pid()).saturating_sub(rss_before);
                assert!(growth < RSS_GROWTH_LIMIT_KIB, "vipr grew by {growth} KiB under attack");
                most_growth = most_growth.max(growth);
                probes += 1;
                // A kubelet probes every few seconds; 20 times a second is plenty here.
                std::thread::sleep(Duration::from_millis(50));
            }
            assert!(probes >= 10, "only {probes} probes in {ATTACK:?}");
            eprintln!(
                "{probes} probe rounds in {ATTACK:?}: slowest answer {slowest:?}, RSS {rss_before} KiB + at most \
                 {most_growth} KiB"
            );
        }));
        stop.store(true, Ordering::Relaxed);
        let streamed: Vec<u64> = streamers.map(|streamer| streamer.join().unwrap().unwrap()).into();
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
        streamed
    });
    drop(idle);
    assert!(streamed.iter().all(|bytes| *bytes > 0), "a streamer sent nothing: {streamed:?}");
    agent.ensure_running().unwrap();
    assert_eq!(get(lab.node(), HEALTHZ, "/livez").unwrap().status, 200);
    // The caps and the header limit did the work, and say so.
    let metrics = get(lab.node(), METRICS, "/metrics").unwrap();
    let evicted = metrics.metric("vipr_http_connections_evicted_total").unwrap();
    let refused = metrics.metric("vipr_http_connection_errors_total").unwrap();
    eprintln!("streamed {streamed:?} bytes; {evicted} connections evicted, {refused} ended in an error");
    assert!(evicted >= 1.0 && refused >= 1.0, "{}", metrics.body);
}

/// Sets the open-files limit (soft and hard) of process `pid`.
fn set_open_files_limit(pid: u32, limit: u64) {
    let limit = libc::rlimit { rlim_cur: limit, rlim_max: limit };
    // SAFETY: prlimit reads the struct we own and writes nothing (no old limit asked for).
    let set = unsafe { libc::prlimit(pid as libc::pid_t, libc::RLIMIT_NOFILE, &limit, std::ptr::null_mut()) };
    assert_eq!(set, 0, "prlimit: {}", std::io::Error::last_os_error());
}

/// Out of file descriptors (here a limit lowered under vipr's feet, as descriptors held
/// elsewhere would do): accepting fails with EMFILE, yet the listener goes on, and `/livez`
/// keeps being answered within a second while 2,000 connections wait for a descriptor.
#[test]
fn health_servers_keep_answering_when_out_of_file_descriptors() {
    // Alone: probe latencies are measured, and the process holds thousands of sockets.
    let _alone = testbed::exclusive();
    const IDLE_CONNECTIONS: usize = 2000;
    const FREE_DESCRIPTORS: u64 = 64;
    raise_open_files_limit(IDLE_CONNECTIONS as u64 + 1024).unwrap();
    let mut lab = lab("http-fds");
    let mut agent = start_vipr(&lab, &[]);
    lab.wait_programmed().unwrap();
    let node = lab.node();
    wait_for_answer(&mut agent, node, HEALTHZ, "/livez", "/livez", |answer| answer.status == 200);
    let open = std::fs::read_dir(format!("/proc/{}/fd", agent.pid())).unwrap().count() as u64;
    set_open_files_limit(agent.pid(), open + FREE_DESCRIPTORS);

    let idle = node.run(|| idle_connections(HEALTHZ, IDLE_CONNECTIONS)).unwrap();
    let started = Instant::now();
    while started.elapsed() < ATTACK / 2 {
        agent.ensure_running().unwrap();
        let asked = Instant::now();
        let answer = get_within(node, HEALTHZ, "/livez", PROBE_TIMEOUT)
            .unwrap_or_else(|error| panic!("/livez after {:?}: {error:#}", started.elapsed()));
        assert_eq!(answer.status, 200, "{answer:?}");
        assert!(asked.elapsed() < PROBE_TIMEOUT, "/livez took {:?}", asked.elapsed());
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(idle);
    let metrics = wait_for_answer(&mut agent, node, METRICS, "/metrics", "/metrics", |a| a.status == 200);
    let accept_errors = metrics.metric("vipr_http_accept_errors_total").unwrap();
    eprintln!("{accept_errors} failed accepts with {FREE_DESCRIPTORS} descriptors free");
    assert!(accept_errors >= 1.0, "the descriptors never ran out:\n{}", metrics.body);
}

/// 700 eTP:Local load balancers, each with its own health-check node port, in an agent
/// limited to 2,048 tasks (as a pod's pids limit would): no crash, and every port answers.
#[test]
fn seven_hundred_health_check_node_ports_fit_in_a_pids_limit() {
    const SERVICES: u16 = 700;
    const FIRST_HEALTH_CHECK_PORT: u16 = 30000;
    const FIRST_NODE_PORT: u16 = 31000;
    let pids = PidsLimit::create(2048).unwrap();
    let mut lab = lab("http-ports");
    let mut agent = start_vipr(&lab, &["--nodeport-addresses=10.10.0.0/24"]);
    pids.add(agent.pid()).unwrap();
    lab.wait_programmed().unwrap();
    let node = lab.node().name().to_owned();
    let mut manifests = manifest::render(lab.services());
    for n in 0..SERVICES {
        let (health_check_port, node_port) = (FIRST_HEALTH_CHECK_PORT + n, FIRST_NODE_PORT + n);
        let cluster_ip = Ipv4Addr::new(10, 97, (n >> 8) as u8, n as u8);
        manifests.push_str(&format!(
            "---
apiVersion: v1
kind: Service
metadata: {{name: lb-{n}, namespace: default}}
spec:
  type: LoadBalancer
  externalTrafficPolicy: Local
  healthCheckNodePort: {health_check_port}
  clusterIP: {cluster_ip}
  clusterIPs: [{cluster_ip}]
  ports: [{{name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: {node_port}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: lb-{n}-1
  namespace: default
  labels: {{kubernetes.io/service-name: lb-{n}}}
addressType: IPv4
ports: [{{name: http, protocol: TCP, port: 8080}}]
endpoints:
- addresses: [{BACKEND}]
  nodeName: {node}
  conditions: {{ready: true}}
"
        ));
    }
    write_atomically(lab.services_file(), &manifests).unwrap();

    let written = Instant::now();
    let client = lab.client();
    let mut waiting: Vec<u16> = (0..SERVICES).map(|n| FIRST_HEALTH_CHECK_PORT + n).collect();
    wait_for("every health-check node port to answer", Duration::from_secs(60), || {
        agent.ensure_running()?;
        waiting.retain(|port| {
            let address = SocketAddr::from((Ipv4Addr::new(10, 10, 0, 1), *port));
            !get_within(client, address, "/", PROBE_TIMEOUT).is_ok_and(|answer| answer.status == 200)
        });
        Ok(if waiting.is_empty() {
            Check::Done(())
        } else {
            Check::NotYet(format!("{} ports not answering, such as {:?}", waiting.len(), waiting.first()))
        })
    })
    .unwrap();
    agent.ensure_running().unwrap();
    assert_eq!(get(lab.node(), HEALTHZ, "/livez").unwrap().status, 200);
    let tasks = pids.current().unwrap();
    eprintln!(
        "{SERVICES} health-check ports answering {:?} after the write, with {tasks} tasks",
        written.elapsed()
    );
    assert!(tasks < 64, "vipr runs {tasks} tasks for {SERVICES} health-check ports");
    assert_eq!(pids.refused().unwrap(), 0, "vipr tried to exceed its pids limit");
    drop(agent);
}
