//! vipr started the way kube-proxy is started on today's clusters, in a network-namespace lab:
//! with the KubeProxyConfiguration kubeadm writes, unchanged (every field, most of them zero or
//! null), and with the flag set kops gives kube-proxy. Each time a ClusterIP connection from
//! the client goes through vipr, /healthz answers on port 10256 on every address of the node
//! (both families) and /metrics on 127.0.0.1:10249 only, and the one-time settings kube-proxy
//! applies (its OOM score, the conntrack sysctls of the netfilter modes) are in place.
//! The fixtures are proxy-userspace/testdata/kube-proxy/. Needs root and a built vipr (`cargo
//! build -p proxy-userspace`, or VIPR_BIN).

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4},
    path::PathBuf,
    time::Duration,
};

use testbed::{
    count_by_backend, exchange, exchanges,
    http::{get, HttpAnswer},
    locate_vipr, wait_for, Check, ClusterIpService, Endpoint, FakeApiServer, Frontend, Lab, LabConfig,
    LeafSpec, Netns, Protocol, ServicePort, Vipr,
};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
/// The node's address on the client's link.
const NODE: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 1);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 2);
const OTHER_BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 2, 2);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const TIMEOUT: Duration = Duration::from_secs(2);
/// How long vipr may take to start serving.
const SETTLE: Duration = Duration::from_secs(30);
/// kube-proxy's default `conntrack.tcpEstablishedTimeout` (the kernel's own is five days).
const KUBE_PROXY_TCP_ESTABLISHED: &str = "86400";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../proxy-userspace/testdata/kube-proxy").join(name)
}

fn kubeadm_config(version: &str) -> String {
    format!("--config={}", fixture(&format!("kubeadm-{version}.yaml")).display())
}

/// kops's kube-proxy command line (testdata/kube-proxy/kops-flags.txt).
fn kops_flags() -> Vec<String> {
    std::fs::read_to_string(fixture("kops-flags.txt"))
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(str::to_owned)
        .collect()
}

fn lab(label: &str) -> Lab {
    Lab::new(LabConfig {
        label: label.to_owned(),
        vipr_binary: locate_vipr().unwrap(),
        client: LeafSpec::in_own_slash24("client", CLIENT).unwrap(),
        backends: vec![
            LeafSpec::in_own_slash24("b1", BACKEND).unwrap(),
            LeafSpec::in_own_slash24("b2", OTHER_BACKEND).unwrap(),
        ],
        services: vec![ClusterIpService {
            namespace: "default".to_owned(),
            name: "web".to_owned(),
            cluster_ip: VIP,
            ports: vec![ServicePort {
                name: "http".to_owned(),
                protocol: Protocol::Tcp,
                port: 80,
                target_port: 8080,
            }],
            endpoints: [BACKEND, OTHER_BACKEND].iter().map(|addr| Endpoint::ready(*addr, "pod")).collect(),
        }],
    })
    .unwrap()
}

/// Starts vipr in the lab's node with `kube_proxy_args` (what the cluster would give
/// kube-proxy), then the lab's own: its services file instead of an API server, its node
/// name, devices and bpffs.
fn start_vipr(lab: &Lab, kube_proxy_args: &[String]) -> Vipr {
    let mut args = kube_proxy_args.to_vec();
    args.extend([
        format!("--services-file={}", lab.services_file().display()),
        format!("--hostname-override={}", lab.node().name()),
        format!("--devices={}", lab.topology().node_interfaces().join(",")),
        format!("--bpf-root={}", lab.bpf_root().display()),
    ]);
    let log = lab.services_file().with_file_name("vipr.log");
    Vipr::start_with_args(&locate_vipr().unwrap(), lab.node(), &args, &log).unwrap()
}

/// Polls `GET path` from `netns` until it answers 200.
fn wait_for_ok(agent: &mut Vipr, netns: &Netns, address: SocketAddr, path: &str) -> HttpAnswer {
    wait_for(&format!("{path} on {address}"), SETTLE, || {
        agent.ensure_running()?;
        Ok(match get(netns, address, path) {
            Ok(answer) if answer.status == 200 => Check::Done(answer),
            Ok(answer) => Check::NotYet(format!("{answer:?}")),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })
    .unwrap()
}

/// Waits until connections from the client to the ClusterIP reach both endpoints.
fn wait_for_cluster_ip(agent: &mut Vipr, lab: &Lab) {
    let frontend = Frontend { addr: SocketAddrV4::new(VIP, 80), protocol: Protocol::Tcp };
    wait_for("ClusterIP connections through vipr to reach both endpoints", SETTLE, || {
        agent.ensure_running()?;
        Ok(match lab.client().run(|| exchanges(frontend, 16, TIMEOUT)) {
            Ok(done) => {
                let answered = count_by_backend(&done);
                if answered.len() == 2 {
                    Check::Done(())
                } else {
                    Check::NotYet(format!("answered by {answered:?}"))
                }
            }
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })
    .unwrap();
}

/// What every start must give, whatever the mode: the datapath, the servers where kube-proxy
/// has them, and the mode `/proxyMode` reports.
fn check_serving_as_kube_proxy(agent: &mut Vipr, lab: &Lab, mode: &str) {
    wait_for_cluster_ip(agent, lab);
    let node = lab.node();
    // /healthz on port 10256 of every address: loopback of both families inside the node, and
    // the node's address from the client.
    for address in [IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V6(Ipv6Addr::LOCALHOST)] {
        wait_for_ok(agent, node, SocketAddr::new(address, 10256), "/healthz");
    }
    wait_for_ok(agent, lab.client(), SocketAddr::from((NODE, 10256)), "/healthz");
    // /metrics on the node's loopback only.
    let metrics = wait_for_ok(agent, node, SocketAddr::from((Ipv4Addr::LOCALHOST, 10249)), "/metrics");
    for family in [
        "kubeproxy_sync_proxy_rules_duration_seconds histogram",
        "process_cpu_seconds_total counter",
        "process_resident_memory_bytes gauge",
        "vipr_build_info gauge",
        "rest_client_requests_total counter",
        "rest_client_request_duration_seconds histogram",
    ] {
        assert!(metrics.body.contains(&format!("# TYPE {family}\n")), "no {family} in\n{}", metrics.body);
    }
    let proxy_mode = wait_for_ok(agent, node, SocketAddr::from((Ipv4Addr::LOCALHOST, 10249)), "/proxyMode");
    assert_eq!(proxy_mode.body, mode);
    assert!(
        get(lab.client(), SocketAddr::from((NODE, 10249)), "/metrics").is_err(),
        "metrics reachable from outside the node"
    );
    // kube-proxy's z-pages beside the metrics.
    let metrics_address = SocketAddr::from((Ipv4Addr::LOCALHOST, 10249));
    let configz = wait_for_ok(agent, node, metrics_address, "/configz");
    let configz: serde_json::Value = serde_json::from_str(&configz.body).unwrap();
    assert_eq!(configz["kubeproxy.config.k8s.io"]["healthzBindAddress"], "0.0.0.0:10256", "{configz}");
    assert_eq!(configz["kubeproxy.config.k8s.io"]["mode"], mode, "{configz}");
    let flagz = wait_for_ok(agent, node, metrics_address, "/flagz").body;
    assert!(flagz.contains("\nhostname-override="), "{flagz}");
    let statusz = wait_for_ok(agent, node, metrics_address, "/statusz").body;
    assert!(statusz.contains("\nStarted: "), "{statusz}");
}

fn oom_score_adj(agent: &Vipr) -> String {
    std::fs::read_to_string(format!("/proc/{}/oom_score_adj", agent.pid())).unwrap().trim().to_owned()
}

/// Whether this process may lower OOM score adjustments (CAP_SYS_RESOURCE); some sandboxes
/// run root without it.
fn may_lower_oom_score() -> bool {
    const CAP_SYS_RESOURCE: u32 = 24;
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let effective = status.lines().find_map(|line| line.strip_prefix("CapEff:")).unwrap().trim();
    u64::from_str_radix(effective, 16).unwrap() & (1 << CAP_SYS_RESOURCE) != 0
}

/// vipr gave itself `expected`, or, where lowering is not permitted, said why it could not
/// (kube-proxy too only logs that).
fn assert_oom_score_adj(agent: &Vipr, expected: i32) {
    let actual = oom_score_adj(agent);
    if actual == expected.to_string() {
        return;
    }
    assert!(expected < 0 && !may_lower_oom_score(), "oom_score_adj {actual}, want {expected}");
    let log = std::fs::read_to_string(agent.log_path()).unwrap();
    assert!(
        log.contains(&format!("cannot write {expected} to /proc/self/oom_score_adj")),
        "no word of the OOM score adjustment in\n{log}"
    );
}

/// A netfilter sysctl as the lab's node namespace has it (never the host's: the test reads
/// and vipr writes only inside the namespace).
fn node_sysctl(lab: &Lab, name: &str) -> String {
    let path = format!("/proc/sys/net/netfilter/{name}");
    lab.node().run(|| Ok(std::fs::read_to_string(&path)?.trim().to_owned())).unwrap()
}

#[test]
fn kubeadm_configs_as_written_run_iptables_mode_as_kube_proxy_would() {
    for version in ["1.35", "1.37"] {
        let lab = lab(&format!("kp-kubeadm-{}", version.replace('.', "")));
        let before = node_sysctl(&lab, "nf_conntrack_tcp_timeout_established");
        assert_ne!(before, KUBE_PROXY_TCP_ESTABLISHED, "the namespace starts with the kernel's default");
        let mut agent = start_vipr(&lab, &[kubeadm_config(version)]);
        // mode "" (1.35) and "iptables" (1.37) both mean kube-proxy's iptables mode.
        check_serving_as_kube_proxy(&mut agent, &lab, "iptables");
        assert_oom_score_adj(&agent, -999);
        assert_eq!(
            node_sysctl(&lab, "nf_conntrack_tcp_timeout_established"),
            KUBE_PROXY_TCP_ESTABLISHED,
            "{version}: the null tcpEstablishedTimeout is kube-proxy's default, set in iptables mode"
        );
    }
}

#[test]
fn kubeadm_config_with_the_daemonsets_proxy_mode_runs_ebpf() {
    let mut lab = lab("kp-kubeadm-ebpf");
    // What deploy/daemonset.yaml passes beside a reused kube-proxy ConfigMap.
    let mut agent = start_vipr(&lab, &[kubeadm_config("1.37"), "--proxy-mode=ebpf".to_owned()]);
    lab.wait_programmed().unwrap();
    check_serving_as_kube_proxy(&mut agent, &lab, "ebpf");
    assert_oom_score_adj(&agent, -999);
}

#[test]
fn kops_flags_over_the_kubeadm_config_run_as_kube_proxy_would() {
    let lab = lab("kp-kops");
    let mut args = vec![kubeadm_config("1.35")];
    args.extend(kops_flags());
    let mut agent = start_vipr(&lab, &args);
    check_serving_as_kube_proxy(&mut agent, &lab, "iptables");
    assert_oom_score_adj(&agent, -998);
    assert_eq!(node_sysctl(&lab, "nf_conntrack_tcp_timeout_established"), KUBE_PROXY_TCP_ESTABLISHED);
}

#[test]
fn kops_flags_with_ebpf_mode() {
    let mut lab = lab("kp-kops-ebpf");
    let mut args = kops_flags();
    // A later flag wins, as with kube-proxy's pflag; a raised score needs no privilege, so the
    // write is seen wherever the test runs.
    args.extend(["--proxy-mode=ebpf".to_owned(), "--oom-score-adj=300".to_owned()]);
    // kube-proxy flags that mean nothing to vipr: vipr runs, and says so once.
    args.extend(["--profiling".to_owned(), "--iptables-masquerade-bit=13".to_owned()]);
    let mut agent = start_vipr(&lab, &args);
    lab.wait_programmed().unwrap();
    check_serving_as_kube_proxy(&mut agent, &lab, "ebpf");
    assert_eq!(oom_score_adj(&agent), "300");
    let log = std::fs::read_to_string(agent.log_path()).unwrap();
    let settings_lines: Vec<&str> = log.lines().filter(|line| line.contains("settings: mode=ebpf")).collect();
    assert_eq!(settings_lines.len(), 1, "{log}");
    assert!(
        settings_lines[0].contains("ignored: --iptables-masquerade-bit (")
            && settings_lines[0].contains("--profiling ("),
        "{}",
        settings_lines[0]
    );
    // The eBPF datapath tracks its own connections: the node's conntrack is left alone.
    assert_ne!(node_sysctl(&lab, "nf_conntrack_tcp_timeout_established"), KUBE_PROXY_TCP_ESTABLISHED);
}

/// The Node object of the lab's node, with `pod_cidrs` as its `spec.podCIDRs`.
fn node_object(name: &str, pod_cidrs: &[&str]) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "spec": {"podCIDR": pod_cidrs[0], "podCIDRs": pod_cidrs},
    })
}

/// Waits until a ClusterIP connection's backend sees the client's own address (`true`: the
/// client counts as a pod, nothing is masqueraded) or another one (`false`: masqueraded).
fn wait_for_client_seen_as(agent: &mut Vipr, lab: &Lab, own_address: bool) {
    let frontend = Frontend { addr: SocketAddrV4::new(VIP, 80), protocol: Protocol::Tcp };
    let what = if own_address { "the client's address at the backend" } else { "a masqueraded client" };
    wait_for(what, SETTLE, || {
        agent.ensure_running()?;
        Ok(match lab.client().run(|| exchanges(frontend, 1, TIMEOUT)) {
            Ok(done) if (done[0].answer.observed_client.ip() == IpAddr::V4(CLIENT)) == own_address => {
                Check::Done(())
            }
            Ok(done) => Check::NotYet(format!("seen as {}", done[0].answer.observed_client)),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })
    .unwrap();
}

/// `--detect-local-mode=NodeCIDR` takes the pods' ranges from the Node object, over
/// `--cluster-cidr`, and follows them when they change; `--master` replaces the kubeconfig's
/// server. The API server is the in-suite one, inside the lab's node.
#[test]
fn node_cidr_local_detection_follows_the_nodes_pod_cidrs() {
    let mut lab = lab("kp-nodecidr");
    let node_name = lab.node().name().to_owned();
    let api = lab.node().run(FakeApiServer::start).unwrap();
    let service = lab.services()[0].clone();
    let (service_object, slice) = service.objects();
    api.apply(&service_object).unwrap();
    api.apply(&slice).unwrap();
    // The client's own range is the node's pod CIDR: its traffic is pod traffic.
    api.apply_json(node_object(&node_name, &["10.10.0.0/24"])).unwrap();
    // A kubeconfig whose server is nowhere: only --master leads to the API server.
    let kubeconfig = lab.services_file().with_file_name("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://192.0.2.1:1\n\
         users:\n- name: u\n  user: {}\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\n\
         current-context: x\n",
    )
    .unwrap();
    let args = [
        "--proxy-mode=ebpf".to_owned(),
        format!("--kubeconfig={}", kubeconfig.display()),
        format!("--master={}", api.url()),
        "--detect-local-mode=NodeCIDR".to_owned(),
        // Not the detector in NodeCIDR mode: the client is outside it.
        "--cluster-cidr=10.244.0.0/16".to_owned(),
        format!("--hostname-override={node_name}"),
        format!("--devices={}", lab.topology().node_interfaces().join(",")),
        format!("--bpf-root={}", lab.bpf_root().display()),
    ];
    let log = lab.services_file().with_file_name("vipr.log");
    let mut agent = Vipr::start_with_args(&locate_vipr().unwrap(), lab.node(), &args, &log).unwrap();
    lab.wait_programmed().unwrap();
    wait_for_client_seen_as(&mut agent, &lab, true);

    // The Node's pod CIDR moves away from the client: its traffic is masqueraded again.
    api.apply_json(node_object(&node_name, &["10.244.1.0/24"])).unwrap();
    wait_for_client_seen_as(&mut agent, &lab, false);
}

/// Runs vipr to completion in `netns` with `args` and returns its stderr.
fn run_to_exit(netns: &Netns, args: &[String]) -> String {
    let output = netns
        .command(locate_vipr().unwrap())
        .unwrap()
        .args(args)
        .env("NO_COLOR", "1")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "vipr {args:?} failed ({}):\n{stderr}", output.status);
    stderr
}

/// `--init-only` applies kube-proxy's one-time settings for the mode, then exits; nothing else
/// is installed.
#[test]
fn init_only_sets_the_conntrack_sysctls_and_exits() {
    let netns = Netns::create(&testbed::unique_name("kp-init")).unwrap();
    let sysctl = |name: &str| {
        let path = format!("/proc/sys/net/netfilter/{name}");
        netns.run(|| Ok(std::fs::read_to_string(&path)?.trim().to_owned())).unwrap()
    };
    assert_ne!(sysctl("nf_conntrack_tcp_timeout_established"), KUBE_PROXY_TCP_ESTABLISHED);
    run_to_exit(
        &netns,
        &[
            kubeadm_config("1.35"),
            "--init-only".to_owned(),
            "--conntrack-tcp-be-liberal".to_owned(),
            "--conntrack-udp-timeout=17s".to_owned(),
            "--hostname-override=n".to_owned(),
            "--services-file=/dev/null".to_owned(),
        ],
    );
    assert_eq!(sysctl("nf_conntrack_tcp_timeout_established"), KUBE_PROXY_TCP_ESTABLISHED);
    assert_eq!(sysctl("nf_conntrack_tcp_be_liberal"), "1");
    assert_eq!(sysctl("nf_conntrack_udp_timeout"), "17");
    let rules = netns.command("iptables-save").unwrap().output().unwrap();
    let rules = String::from_utf8_lossy(&rules.stdout);
    assert!(!rules.contains("KUBE-") && !rules.contains("VIPR"), "--init-only installed rules:\n{rules}");
    drop(netns);
}

/// `--write-config-to` writes the effective configuration, which `--config` reads back the
/// same; `--logging-format=json` makes every log line a JSON object.
#[test]
fn write_config_to_round_trips_and_json_logging() {
    let netns = Netns::create(&testbed::unique_name("kp-write")).unwrap();
    let workdir = testbed::WorkDir::create("kp-write").unwrap();
    let written = workdir.path().join("written.yaml");
    let rewritten = workdir.path().join("rewritten.yaml");
    let stderr = run_to_exit(
        &netns,
        &[
            kubeadm_config("1.35"),
            "--oom-score-adj=-500".to_owned(),
            "--ipvs-scheduler=mh".to_owned(),
            "--hostname-override=node-w".to_owned(),
            "--logging-format=json".to_owned(),
            format!("--write-config-to={}", written.display()),
        ],
    );
    for line in stderr.lines() {
        let object: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|error| panic!("not JSON ({error}): {line}"));
        assert!(object["level"].is_string() && object["timestamp"].is_string(), "{line}");
    }
    assert!(!stderr.is_empty(), "vipr logged nothing");
    let text = std::fs::read_to_string(&written).unwrap();
    let config: serde_json::Value = serde_yaml::from_str(&text).unwrap();
    assert_eq!(config["kind"], "KubeProxyConfiguration");
    assert_eq!(config["oomScoreAdj"], -500, "{text}");
    assert_eq!(config["iptables"]["syncPeriod"], "30s", "{text}");
    assert_eq!(config["clusterCIDR"], "10.244.0.0/16", "{text}");
    // Read back and written again: the same file.
    run_to_exit(
        &netns,
        &[format!("--config={}", written.display()), format!("--write-config-to={}", rewritten.display())],
    );
    assert_eq!(std::fs::read_to_string(&rewritten).unwrap(), text);
}

#[test]
fn a_changed_config_file_makes_vipr_exit_to_be_restarted_with_it() {
    let lab = lab("kp-config-change");
    let config = lab.services_file().with_file_name("kube-proxy.yaml");
    std::fs::copy(fixture("kubeadm-1.37.yaml"), &config).unwrap();
    let mut agent =
        start_vipr(&lab, &[format!("--config={}", config.display()), "--proxy-mode=ebpf".to_owned()]);
    wait_for_cluster_ip(&mut agent, &lab);
    // An unchanged rewrite is no change.
    std::fs::copy(fixture("kubeadm-1.37.yaml"), &config).unwrap();
    // As a ConfigMap update: a new file swapped in under the name.
    let changed = config.with_file_name("kube-proxy.yaml.new");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&changed, text.replace("masqueradeAll: false", "masqueradeAll: true")).unwrap();
    assert!(std::fs::read_to_string(&changed).unwrap() != text, "the fixture has masqueradeAll: false");
    std::fs::rename(&changed, &config).unwrap();
    let exit = wait_for("vipr to exit after its config file changed", SETTLE, || {
        Ok(match agent.ensure_running() {
            Err(exited) => Check::Done(format!("{exited:#}")),
            Ok(()) => Check::NotYet("still running".to_owned()),
        })
    })
    .unwrap();
    assert!(exit.contains("exit status: 1"), "{exit}");
    assert!(exit.contains("configuration file") && exit.contains("changed"), "{exit}");
    // The datapath it leaves keeps serving until the restarted vipr takes it over.
    let frontend = Frontend { addr: SocketAddrV4::new(VIP, 80), protocol: Protocol::Tcp };
    lab.client().run(|| exchange(frontend, Duration::from_secs(2))).unwrap();
}
