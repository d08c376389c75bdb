//! Kubernetes Events, with the real vipr binary reading the in-suite API server inside a lab's
//! node: vipr records its start (version and mode; its first log line says the version too) and
//! the mode it chose and why on its Node,
//! and each object it refuses once on that object (not at every sync); an API server that
//! refuses Events does not keep vipr from programming services, and the dropped Events are
//! counted. Needs root and a built vipr (`cargo build -p proxy-userspace`, or VIPR_BIN).

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use serde_json::Value;
use testbed::{
    apiserver::Collection, locate_vipr, wait_for, Check, ClusterIpService, Endpoint, FakeApiServer, Lab,
    LabConfig, Vipr,
};

/// vipr's default `--metrics-bind-address` (0.0.0.0:10249), seen from inside the node.
const METRICS: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10249);
/// How long vipr may take to start, sync and send its Events.
const SETTLE: Duration = Duration::from_secs(30);

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const BACKENDS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 20, 1, 2), Ipv4Addr::new(10, 20, 2, 2)];
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

fn web(backends: &[Ipv4Addr]) -> ClusterIpService {
    let endpoints = backends.iter().map(|addr| Endpoint::ready(*addr, "pod")).collect();
    ClusterIpService::web(VIP, (8080, 5353), endpoints)
}

/// A lab serving `web` from the API server (the lab's own services file is not read).
struct EventsLab {
    lab: Lab,
    api: FakeApiServer,
    kubeconfig: PathBuf,
}

impl EventsLab {
    fn new(label: &str) -> Self {
        let lab = Lab::new(
            LabConfig::with_backends(label, CLIENT, &[BACKENDS[0], BACKENDS[1]], vec![web(&BACKENDS)])
                .unwrap(),
        )
        .unwrap();
        // In the node's namespace, where vipr runs.
        let api = lab.node().run(FakeApiServer::start).unwrap();
        let kubeconfig = lab.services_file().with_file_name("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let events_lab = Self { lab, api, kubeconfig };
        events_lab.apply(&web(&BACKENDS));
        events_lab
    }

    fn apply(&self, service: &ClusterIpService) {
        let (service, slice) = service.objects();
        self.api.apply(&service).unwrap();
        self.api.apply(&slice).unwrap();
    }

    /// Serves `web` from `backends` and waits until the datapath does: a sync happened.
    fn move_web_to(&mut self, backends: &[Ipv4Addr]) {
        self.lab.set_services(vec![web(backends)]).unwrap();
        self.apply(&web(backends));
        self.lab.wait_programmed().unwrap();
    }

    /// vipr with `--proxy-mode=mode` on the API server.
    fn start_vipr(&self, mode: &str) -> Vipr {
        let args = vec![
            format!("--proxy-mode={mode}"),
            format!("--kubeconfig={}", self.kubeconfig.display()),
            format!("--hostname-override={}", self.node_name()),
            format!("--devices={}", self.lab.topology().node_interfaces().join(",")),
            format!("--bpf-root={}", self.lab.bpf_root().display()),
            "--min-sync-period=0s".to_owned(),
            "-v".to_owned(),
        ];
        let log = self.lab.services_file().with_file_name("vipr.log");
        Vipr::start_with_args(&locate_vipr().unwrap(), self.lab.node(), &args, &log).unwrap()
    }

    fn node_name(&self) -> String {
        self.lab.node().name().to_owned()
    }

    fn events(&self) -> Vec<Value> {
        self.api.objects(Collection::Events)
    }

    /// Waits until an Event with `reason` regarding `kind` `name` is stored; returns it.
    fn wait_for_event(&self, vipr: &mut Vipr, reason: &str, kind: &str, name: &str) -> Value {
        wait_for(&format!("a {reason} Event regarding {kind} {name}"), SETTLE, || {
            vipr.ensure_running()?;
            let events = self.events();
            Ok(match events.iter().find(|event| is_about(event, reason, kind, name)) {
                Some(event) => Check::Done(event.clone()),
                None => Check::NotYet(format!("{events:#?}")),
            })
        })
        .unwrap()
    }
}

fn is_about(event: &Value, reason: &str, kind: &str, name: &str) -> bool {
    event["reason"] == reason && event["regarding"]["kind"] == kind && event["regarding"]["name"] == name
}

/// What every Event of vipr's carries, as events.k8s.io/v1 and kube-proxy's have it.
fn assert_recorded_by_vipr(event: &Value, node: &str, severity: &str) {
    assert_eq!(event["reportingController"], "vipr", "{event:#}");
    assert_eq!(event["reportingInstance"], node, "{event:#}");
    assert_eq!(event["type"], severity, "{event:#}");
    assert!(event["eventTime"].is_string(), "{event:#}");
    assert!(event["action"].is_string(), "{event:#}");
}

/// `--proxy-mode=auto`: the start Event on the Node names vipr's version and the mode it runs
/// (ebpf on this kernel), and another says which mode auto chose and why.
#[test]
fn start_and_the_chosen_mode_are_recorded_on_the_node() {
    let events_lab = EventsLab::new("events-start");
    let node = events_lab.node_name();
    let mut vipr = events_lab.start_vipr("auto");

    let start = events_lab.wait_for_event(&mut vipr, "Starting", "Node", &node);
    assert_recorded_by_vipr(&start, &node, "Normal");
    let note = start["note"].as_str().unwrap();
    assert!(note.contains(env!("CARGO_PKG_VERSION")), "no version in {note:?}");
    assert!(note.contains("ebpf"), "no mode in {note:?}");
    // Cluster-scoped: the Event lives in `default`, regarding the Node as kubelet names it.
    assert_eq!(start["metadata"]["namespace"], "default");
    assert_eq!(start["regarding"]["apiVersion"], "v1");

    // The log says the version at start too.
    let log = std::fs::read_to_string(vipr.log_path()).unwrap();
    let starting = format!("vipr {} starting", env!("CARGO_PKG_VERSION"));
    assert!(log.lines().next().is_some_and(|line| line.contains(&starting)), "{log}");

    let mode = events_lab.wait_for_event(&mut vipr, "ProxyMode", "Node", &node);
    assert_recorded_by_vipr(&mode, &node, "Normal");
    let note = mode["note"].as_str().unwrap();
    assert!(note.contains("--proxy-mode=auto") && note.contains("chose ebpf"), "{note:?}");
}

/// A Service vipr refuses (an external IP that is a loopback address) and a Service that loses
/// a frontend to another each get one Warning Event regarding them, and only one however many
/// syncs follow.
#[test]
fn each_refused_service_gets_one_event_once() {
    let mut events_lab = EventsLab::new("events-refused");
    let node = events_lab.node_name();
    let mut loopback = web(&BACKENDS);
    loopback.name = "loopback".into();
    loopback.cluster_ip = Ipv4Addr::new(10, 96, 0, 11);
    let (mut bad, bad_slice) = loopback.objects();
    bad.spec.as_mut().unwrap().external_ips = Some(vec!["127.0.0.1".into()]);
    events_lab.api.apply(&bad).unwrap();
    events_lab.api.apply(&bad_slice).unwrap();
    // Two services with one external IP: the first by name keeps it, the other loses it.
    for (name, cluster_ip) in [("claim-a", 12), ("claim-b", 13)] {
        let mut claim = web(&BACKENDS);
        claim.name = name.into();
        claim.cluster_ip = Ipv4Addr::new(10, 96, 0, cluster_ip);
        let (mut service, slice) = claim.objects();
        service.spec.as_mut().unwrap().external_ips = Some(vec!["192.0.2.80".into()]);
        events_lab.api.apply(&service).unwrap();
        events_lab.api.apply(&slice).unwrap();
    }
    let mut vipr = events_lab.start_vipr("ebpf");

    let refused = events_lab.wait_for_event(&mut vipr, "RejectedObject", "Service", "loopback");
    assert_recorded_by_vipr(&refused, &node, "Warning");
    assert_eq!(refused["metadata"]["namespace"], "default", "the Service's namespace");
    assert_eq!(refused["regarding"]["namespace"], "default");
    let note = refused["note"].as_str().unwrap();
    assert!(note.contains("127.0.0.1") && note.contains("loopback"), "{note:?}");
    let conflict = events_lab.wait_for_event(&mut vipr, "FrontendConflict", "Service", "claim-b");
    assert_recorded_by_vipr(&conflict, &node, "Warning");
    assert!(conflict["note"].as_str().unwrap().contains("192.0.2.80:80"), "{conflict:#}");

    // More syncs: the refusals stand, and are not recorded again.
    events_lab.move_web_to(&BACKENDS[..1]);
    events_lab.move_web_to(&BACKENDS);
    let events = events_lab.events();
    let warnings: Vec<&Value> = events.iter().filter(|event| event["type"] == "Warning").collect();
    assert_eq!(warnings.len(), 2, "{events:#?}");
    for warning in warnings {
        assert!(warning["series"].is_null(), "recorded again: {warning:#}");
    }
    vipr.ensure_running().unwrap();
}

/// The API server refuses Events (403, as without the RBAC rule): vipr programs services as
/// before, and counts the Events it dropped.
#[test]
fn refused_events_do_not_stop_programming() {
    let mut events_lab = EventsLab::new("events-forbidden");
    events_lab.api.set_forbidden(Collection::Events, true);
    let mut vipr = events_lab.start_vipr("ebpf");
    events_lab.lab.wait_programmed().unwrap();
    events_lab.move_web_to(&BACKENDS[..1]);

    let dropped = wait_for("the refused start Events to be counted", SETTLE, || {
        vipr.ensure_running()?;
        let answer = testbed::http::get(events_lab.lab.node(), METRICS, "/metrics")?;
        let dropped = answer
            .body
            .lines()
            .find_map(|line| line.strip_prefix("vipr_events_dropped_total{reason=\"api_error\"} "))
            .and_then(|value| value.trim().parse::<f64>().ok());
        Ok(match dropped {
            Some(count) if count >= 2.0 => Check::Done(count),
            other => Check::NotYet(format!("vipr_events_dropped_total{{reason=\"api_error\"}}: {other:?}")),
        })
    })
    .unwrap();
    eprintln!("dropped {dropped} Events");
    assert!(events_lab.events().is_empty());
    events_lab.move_web_to(&BACKENDS);
    vipr.ensure_running().unwrap();
}

/// The recorder itself against the in-suite API server (no lab): the same Event recorded again
/// is not sent again (an object refused anew after it was fixed and broken again, say), and
/// another message about the same object is an Event of its own.
#[test]
fn repeats_of_an_event_are_sent_once() {
    use vipr::{
        events::{reasons, ApiEvents, EventSink, ObjectRef},
        metrics::{Collector, SampleValue},
        source::{kubernetes::KubeSourceConfig, Objects},
    };
    let api = FakeApiServer::start().unwrap();
    let workdir = testbed::WorkDir::create("events-repeats").unwrap();
    let kubeconfig = workdir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let config = KubeSourceConfig {
        kubeconfig: Some(kubeconfig),
        node_name: "node-a".into(),
        master: None,
        ownership: Default::default(),
    };
    let recorder = ApiEvents::start(config, "node-a".into()).unwrap();
    let web = ObjectRef::service("shop", "web", &Objects::default());
    for _ in 0..3 {
        recorder.refused(web.clone(), reasons::REJECTED_OBJECT, "spec.ports[0] is wrong".into());
    }
    recorder.refused(web.clone(), reasons::REJECTED_OBJECT, "spec.ports[1] is wrong".into());
    let sent = || {
        let families = recorder.metrics().collect();
        let family = families.iter().find(|family| family.name == "vipr_events_sent_total").unwrap();
        match family.samples[0].value {
            SampleValue::Number(count) => count,
            SampleValue::Histogram { .. } => panic!("a counter"),
        }
    };
    // Requests go out in order: once the last Event is stored and counted, every earlier one
    // has been handled.
    let events = wait_for("the last Event", SETTLE, || {
        let events = api.objects(Collection::Events);
        let last = events.iter().any(|event| event["note"] == "spec.ports[1] is wrong");
        Ok(if last && sent() >= 2.0 { Check::Done(events) } else { Check::NotYet(format!("{events:#?}")) })
    })
    .unwrap();
    assert_eq!(sent(), 2.0);
    assert_eq!(events.len(), 2, "{events:#?}");
    for event in &events {
        assert!(is_about(event, "RejectedObject", "Service", "web"), "{event:#}");
        assert_eq!(event["metadata"]["namespace"], "shop");
        assert!(event["series"].is_null(), "{event:#}");
    }
}
