//! The manifests in deploy/, as deploy/render.sh renders them, are valid API objects that fit
//! together: every document parses into its k8s-openapi type without losing a field (a
//! misspelt field would be dropped silently by the API server too), the DaemonSet runs as the
//! ServiceAccount with the ConfigMap's KubeProxyConfiguration, which vipr's own parser
//! accepts, and the ClusterRole grants exactly what the code watches and records. The render
//! puts each value where it belongs and leaves no placeholder. Every metric the alert rules
//! and the Grafana dashboard name is one vipr exposes: the real binary, started in a lab,
//! is scraped for them (that test needs root and a built vipr). No cluster needed.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{ConfigMap, Container, PodSpec, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding},
};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use testbed::{
    http::get, locate_vipr, wait_for, Check, ClusterIpService, Endpoint, Lab, LabConfig, LeafSpec, Protocol,
    ServicePort, Vipr,
};
use vipr::{
    agent::{ApiAccess, RECORDED_EVENTS, WATCHED_RESOURCES},
    cli::Args,
    config::{KubeProxyConfiguration, ProxyMode},
    settings::{Settings, SourceSettings},
};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Every object of deploy/, typed (the Prometheus operator's, which k8s-openapi does not
/// know, as YAML).
#[derive(Default)]
struct Manifests {
    daemon_sets: Vec<DaemonSet>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    config_maps: Vec<ConfigMap>,
    pod_monitors: Vec<serde_yaml::Value>,
    prometheus_rules: Vec<serde_yaml::Value>,
}

/// The values the tests render with, unlike every default of render.sh.
const IMAGE: &str = "registry.example:5000/vipr@sha256:0123abcd";
const API_SERVER_HOST: &str = "192.0.2.10";
const API_SERVER_PORT: &str = "6443";
const CLUSTER_CIDR: &str = "10.244.0.0/16";

/// deploy/render.sh's output for `args`, or its error message.
fn render(args: &[&str]) -> Result<String, String> {
    let output =
        Command::new("sh").arg(deploy_dir().join("render.sh")).args(args).output().expect("running sh");
    if output.status.success() {
        Ok(String::from_utf8(output.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

/// Every manifest, monitoring included, rendered in eBPF mode with kube-proxy's ports.
fn rendered() -> String {
    let api_server = format!("--api-server={API_SERVER_HOST}:{API_SERVER_PORT}");
    let image = format!("--image={IMAGE}");
    let cidr = format!("--cluster-cidr={CLUSTER_CIDR}");
    render(&[&api_server, &image, &cidr, "--mode=ebpf", "--ports=kube-proxy", "--monitoring"])
        .unwrap_or_else(|error| panic!("render.sh failed: {error}"))
}

/// Parses a document into `T` and checks that serializing it again gives the document back:
/// whatever the type does not know (a misspelt or misplaced field) is lost on the way.
fn typed<T: DeserializeOwned + Serialize>(document: &serde_yaml::Value, origin: &str) -> T {
    let object: T =
        serde_yaml::from_value(document.clone()).unwrap_or_else(|error| panic!("{origin}: {error}"));
    let original: serde_json::Value = serde_json::to_value(document).unwrap();
    let again = serde_json::to_value(&object).unwrap();
    let mut differences = Vec::new();
    differing_paths(&original, &again, "", &mut differences);
    assert!(
        differences.is_empty(),
        "{origin}: these fields are unknown or changed by parsing: {differences:?}"
    );
    object
}

/// The paths at which `a` and `b` differ.
fn differing_paths(a: &serde_json::Value, b: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for key in a.keys().chain(b.keys()).collect::<BTreeSet<_>>() {
                let child = format!("{path}.{key}");
                match (a.get(key), b.get(key)) {
                    (Some(a), Some(b)) => differing_paths(a, b, &child, out),
                    _ => out.push(child),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (index, (a, b)) in a.iter().zip(b).enumerate() {
                differing_paths(a, b, &format!("{path}[{index}]"), out);
            }
        }
        (a, b) if a != b => out.push(path.to_owned()),
        _ => {}
    }
}

fn manifests() -> Manifests {
    parse_manifests(&rendered(), "render.sh's output")
}

fn parse_manifests(text: &str, source: &str) -> Manifests {
    let mut manifests = Manifests::default();
    for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let document = serde_yaml::Value::deserialize(document)
            .unwrap_or_else(|error| panic!("{source} document {}: {error}", index + 1));
        if document.is_null() {
            continue;
        }
        let origin = format!("{source} document {}", index + 1);
        let field = |name: &str| document.get(name).and_then(serde_yaml::Value::as_str).unwrap_or_default();
        match (field("apiVersion"), field("kind")) {
            ("apps/v1", "DaemonSet") => manifests.daemon_sets.push(typed(&document, &origin)),
            ("v1", "ServiceAccount") => manifests.service_accounts.push(typed(&document, &origin)),
            ("v1", "ConfigMap") => manifests.config_maps.push(typed(&document, &origin)),
            ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
                manifests.cluster_roles.push(typed(&document, &origin))
            }
            ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
                manifests.cluster_role_bindings.push(typed(&document, &origin))
            }
            ("monitoring.coreos.com/v1", "PodMonitor") => manifests.pod_monitors.push(document),
            ("monitoring.coreos.com/v1", "PrometheusRule") => manifests.prometheus_rules.push(document),
            (api_version, kind) => panic!("{origin}: unexpected {api_version} {kind}"),
        }
    }
    manifests
}

fn only<'a, T>(objects: &'a [T], what: &str) -> &'a T {
    assert_eq!(objects.len(), 1, "expected exactly one {what}");
    &objects[0]
}

fn pod_spec(daemon_set: &DaemonSet) -> &PodSpec {
    daemon_set.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
}

fn vipr_container(pod: &PodSpec) -> &Container {
    only(&pod.containers, "container")
}

/// The container's arguments with `$(VAR)` references expanded as the kubelet would, from
/// `values`.
fn expanded_args(container: &Container, values: &BTreeMap<&str, &str>) -> Vec<String> {
    container
        .args
        .iter()
        .flatten()
        .map(|arg| {
            values.iter().fold(arg.clone(), |arg, (name, value)| arg.replace(&format!("$({name})"), value))
        })
        .collect()
}

#[test]
fn the_daemon_set_runs_as_the_service_account_with_the_config_map() {
    let manifests = manifests();
    let daemon_set = only(&manifests.daemon_sets, "DaemonSet");
    let namespace = daemon_set.metadata.namespace.as_deref().unwrap();
    let pod = pod_spec(daemon_set);

    let account = only(&manifests.service_accounts, "ServiceAccount");
    assert_eq!(pod.service_account_name, account.metadata.name);
    assert_eq!(account.metadata.namespace.as_deref(), Some(namespace));

    let config_map = only(&manifests.config_maps, "ConfigMap");
    assert_eq!(config_map.metadata.namespace.as_deref(), Some(namespace));
    let config_volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|volume| {
            volume.config_map.as_ref().map(|source| &source.name) == config_map.metadata.name.as_ref()
        })
        .expect("a volume of the ConfigMap");
    let container = vipr_container(pod);
    let config_mount = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|mount| mount.name == config_volume.name)
        .expect("the ConfigMap volume is mounted");

    // vipr's own parser takes the arguments and the configuration they point to, read from a
    // copy of the ConfigMap's files where the pod would see them.
    let mounted = std::env::temp_dir().join(format!("vipr-deploy-test-{}", std::process::id()));
    std::fs::create_dir_all(&mounted).unwrap();
    for (key, value) in config_map.data.iter().flatten() {
        std::fs::write(mounted.join(key), value).unwrap();
    }
    let args: Vec<String> = expanded_args(container, &BTreeMap::from([("NODE_NAME", "node-a")]))
        .into_iter()
        .map(|arg| arg.replace(&config_mount.mount_path, mounted.to_str().unwrap()))
        .collect();
    let parsed = Args::try_parse_kube_proxy_style(std::iter::once("vipr".to_owned()).chain(args))
        .unwrap_or_else(|error| panic!("vipr refuses the DaemonSet's arguments: {error}"));
    let settings = Settings::resolve(&parsed);
    std::fs::remove_dir_all(&mounted).unwrap();
    let settings = settings.unwrap_or_else(|error| panic!("vipr refuses the configuration: {error:#}"));
    assert!(parsed.config.is_some(), "the DaemonSet passes --config");
    assert_eq!(
        parsed.proxy_mode,
        Some(ProxyMode::Ebpf),
        "the DaemonSet passes --proxy-mode, so that a reused kube-proxy ConfigMap's mode does not apply"
    );
    assert_eq!(settings.proxy_mode, ProxyMode::Ebpf);
    assert_eq!(settings.node_name, "node-a");
    assert!(
        settings.ignored_config.is_empty(),
        "the ConfigMap sets what vipr ignores: {:?}",
        settings.ignored_config
    );
    // In-cluster configuration, with the API server's own endpoint in the environment the
    // kubelet would otherwise fill with the `kubernetes` Service's ClusterIP.
    assert!(
        matches!(settings.source, SourceSettings::Kubernetes { kubeconfig: None }),
        "the DaemonSet must use the in-cluster configuration: {:?}",
        settings.source
    );
    let env = |name: &str| {
        container
            .env
            .iter()
            .flatten()
            .find(|var| var.name == name)
            .and_then(|var| var.value.clone())
            .unwrap_or_else(|| panic!("no {name} in the container's environment"))
    };
    assert_eq!(env("KUBERNETES_SERVICE_HOST"), API_SERVER_HOST);
    assert_eq!(env("KUBERNETES_SERVICE_PORT"), API_SERVER_PORT);

    // Every probe asks where vipr serves health: liveness /livez, startup and readiness
    // /healthz. The container declares the ports vipr binds.
    let healthz_port = settings.healthz_bind_address.expect("healthz served").port();
    let port = |probe: Option<&k8s_openapi::api::core::v1::Probe>, what: &str| {
        let http =
            probe.and_then(|probe| probe.http_get.as_ref()).unwrap_or_else(|| panic!("no HTTP {what} probe"));
        (http.path.clone().unwrap_or_default(), http.port.clone())
    };
    let healthz = k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(healthz_port.into());
    assert_eq!(port(container.liveness_probe.as_ref(), "liveness"), ("/livez".to_owned(), healthz.clone()));
    assert_eq!(
        port(container.readiness_probe.as_ref(), "readiness"),
        ("/healthz".to_owned(), healthz.clone())
    );
    assert_eq!(port(container.startup_probe.as_ref(), "startup"), ("/healthz".to_owned(), healthz));
    let metrics = settings.metrics_bind_address.expect("metrics served");
    assert!(metrics.ip().is_unspecified(), "the PodMonitor needs metrics on every address, not {metrics}");
    let declared: BTreeMap<String, i32> = container
        .ports
        .iter()
        .flatten()
        .map(|port| (port.name.clone().unwrap_or_default(), port.container_port))
        .collect();
    assert_eq!(
        declared,
        BTreeMap::from([
            ("healthz".to_owned(), i32::from(healthz_port)),
            ("metrics".to_owned(), i32::from(metrics.port()))
        ])
    );
}

#[test]
fn the_config_map_holds_a_kube_proxy_configuration_vipr_accepts() {
    let manifests = manifests();
    let config_map = only(&manifests.config_maps, "ConfigMap");
    let data = config_map.data.as_ref().expect("ConfigMap data");
    let config = KubeProxyConfiguration::parse(&data["config.conf"]).unwrap();
    assert_eq!(config.mode.as_deref(), Some("ebpf"));
    assert!(config.ignored.is_empty(), "{:?}", config.ignored);
    assert!(!data.contains_key("kubeconfig.conf"), "the in-cluster configuration replaces the kubeconfig");
    assert!(data["config.conf"].contains(&format!("clusterCIDR: \"{CLUSTER_CIDR}\"")));
}

#[test]
fn the_pod_is_a_host_network_node_critical_agent_with_its_mounts_and_ebpf_modes_capabilities() {
    let manifests = manifests();
    let pod = pod_spec(only(&manifests.daemon_sets, "DaemonSet"));
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    let tolerates_everything = pod.tolerations.iter().flatten().any(|toleration| {
        toleration.operator.as_deref() == Some("Exists")
            && toleration.key.is_none()
            && toleration.effect.is_none()
    });
    assert!(tolerates_everything, "the DaemonSet must tolerate every taint");
    let container = vipr_container(pod);
    // eBPF mode needs a few capabilities, not a privileged container (tests/tests/image.rs
    // runs the image with this securityContext).
    let context = container.security_context.as_ref().expect("a securityContext");
    assert_eq!(context.privileged, Some(false));
    let capabilities = context.capabilities.as_ref().expect("a capability list");
    assert_eq!(capabilities.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    assert_eq!(
        capabilities.add.as_deref().unwrap_or_default(),
        ["BPF", "PERFMON", "NET_ADMIN", "NET_RAW", "SYS_RESOURCE"].map(str::to_owned)
    );
    assert_eq!(context.seccomp_profile.as_ref().map(|profile| profile.type_.as_str()), Some("Unconfined"));

    let host_path = |mount_path: &str| {
        let mount = container
            .volume_mounts
            .iter()
            .flatten()
            .find(|mount| mount.mount_path == mount_path)
            .unwrap_or_else(|| panic!("nothing mounted at {mount_path}"));
        let volume = pod.volumes.iter().flatten().find(|volume| volume.name == mount.name).unwrap();
        (mount.clone(), volume.host_path.as_ref().map(|host| host.path.clone()))
    };
    let (bpffs, bpffs_host) = host_path("/sys/fs/bpf");
    assert_eq!(bpffs_host.as_deref(), Some("/sys/fs/bpf"), "the datapath must be pinned on the host's bpffs");
    // Kubernetes allows Bidirectional only to privileged containers.
    assert_eq!(bpffs.mount_propagation.as_deref(), Some("HostToContainer"));
    assert_eq!(host_path("/sys/fs/cgroup").1.as_deref(), Some("/sys/fs/cgroup"));
    // iptables and ipvs modes: the node's xtables lock (a file, created if no iptables user
    // made it yet) and the kernel's modules, as kube-proxy's DaemonSet mounts them.
    let (lock, lock_host) = host_path("/run/xtables.lock");
    assert_eq!(lock_host.as_deref(), Some("/run/xtables.lock"));
    assert_ne!(lock.read_only, Some(true), "iptables takes the lock by writing it");
    let lock_volume = pod.volumes.iter().flatten().find(|volume| volume.name == lock.name).unwrap();
    assert_eq!(lock_volume.host_path.as_ref().unwrap().type_.as_deref(), Some("FileOrCreate"));
    let (modules, modules_host) = host_path("/lib/modules");
    assert_eq!(modules_host.as_deref(), Some("/lib/modules"));
    assert_eq!(modules.read_only, Some(true));
    assert_eq!(pod.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
    assert_eq!(container.image.as_deref(), Some(IMAGE));
}

/// `render.sh --uninstall` prints one DaemonSet that runs `vipr --cleanup` (the command
/// testbed's `vipr_cleanup` runs against live datapaths in e2e_netns, iptables_lab and
/// host_traffic) on every node, in the agent's network namespace, privileged, with the agent's
/// host mounts (the bpffs where the datapath is pinned, the xtables lock, ...), and needs
/// nothing of the install (no ServiceAccount token, no ConfigMap) so that it runs after it is
/// deleted.
#[test]
fn the_uninstall_daemon_set_runs_cleanup_on_every_node_with_the_agents_mounts() {
    let output =
        render(&["--uninstall", &format!("--image={IMAGE}"), "--pause-image=registry.example/pause:1"])
            .unwrap_or_else(|error| panic!("render.sh --uninstall failed: {error}"));
    let uninstall = parse_manifests(&output, "render.sh --uninstall");
    let daemon_set = only(&uninstall.daemon_sets, "uninstall DaemonSet");
    assert!(
        uninstall.config_maps.is_empty()
            && uninstall.service_accounts.is_empty()
            && uninstall.cluster_roles.is_empty()
    );
    assert_eq!(daemon_set.metadata.name.as_deref(), Some("vipr-uninstall"));
    let pod = pod_spec(daemon_set);
    let agent_manifests = manifests();
    let agent_pod = pod_spec(only(&agent_manifests.daemon_sets, "DaemonSet"));
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.tolerations, agent_pod.tolerations,
        "the uninstall must reach every node the agent ran on"
    );
    assert_eq!(pod.node_selector, agent_pod.node_selector);
    assert_eq!(pod.automount_service_account_token, Some(false));

    let cleanup = only(pod.init_containers.as_deref().unwrap_or_default(), "init container");
    assert_eq!(cleanup.image.as_deref(), Some(IMAGE));
    let args = cleanup.args.clone().unwrap_or_default();
    assert_eq!(args, ["--cleanup", "--cleanup-keep-kube-proxy"]);
    assert_eq!(testbed::uninstall_args().unwrap(), args, "testbed runs another command");
    assert_eq!(cleanup.security_context.as_ref().and_then(|context| context.privileged), Some(true));
    // vipr accepts the command line: a cleanup that leaves a returned kube-proxy's rules.
    let parsed = Args::try_parse_kube_proxy_style(std::iter::once("vipr".to_owned()).chain(args)).unwrap();
    let settings = Settings::resolve(&parsed).unwrap();
    assert!(settings.cleanup && settings.cleanup_keep_kube_proxy);
    assert_eq!(settings.bpf_root, Path::new("/sys/fs/bpf"), "the cleanup must look where the agent pins");

    // Every host path the agent mounts, mounted the same, but for its ConfigMap.
    let agent = vipr_container(agent_pod);
    let host_mounts =
        |pod: &PodSpec, container: &Container| -> BTreeMap<String, (String, bool, Option<String>)> {
            container
                .volume_mounts
                .iter()
                .flatten()
                .filter_map(|mount| {
                    let volume = pod.volumes.iter().flatten().find(|volume| volume.name == mount.name)?;
                    let host = volume.host_path.as_ref()?;
                    Some((
                        mount.mount_path.clone(),
                        (host.path.clone(), mount.read_only == Some(true), mount.mount_propagation.clone()),
                    ))
                })
                .collect()
        };
    let agent_mounts = host_mounts(agent_pod, agent);
    assert!(agent_mounts.contains_key("/sys/fs/bpf"), "{agent_mounts:?}");
    assert_eq!(host_mounts(pod, cleanup), agent_mounts);
    assert!(cleanup.volume_mounts.iter().flatten().all(|mount| mount.mount_path != "/var/lib/vipr"));

    // Once the cleanup is done the pod idles, Ready, so `rollout status` returns.
    let done = only(&pod.containers, "container");
    assert_eq!(done.image.as_deref(), Some("registry.example/pause:1"));
    assert!(render(&["--uninstall", "--pause-image=a b"]).is_err());
}

/// A memory quantity in bytes (the binary and decimal suffixes the manifests use).
fn bytes(quantity: &k8s_openapi::apimachinery::pkg::api::resource::Quantity) -> u64 {
    let text = quantity.0.as_str();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let unit: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        _ => panic!("unexpected quantity {text}"),
    };
    number.parse::<u64>().unwrap() * unit
}

#[test]
fn the_update_strategy_and_resources_fit_large_clusters_and_the_measured_memory() {
    let manifests = manifests();
    let daemon_set = only(&manifests.daemon_sets, "DaemonSet");
    let strategy = daemon_set.spec.as_ref().unwrap().update_strategy.as_ref().unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.as_ref().unwrap();
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    assert_eq!(rolling.max_unavailable, Some(IntOrString::String("10%".to_owned())));
    // Never two agents on one node: they would program the same pinned maps.
    assert_eq!(rolling.max_surge, Some(IntOrString::Int(0)));

    let resources = vipr_container(pod_spec(daemon_set)).resources.as_ref().expect("resources");
    let requests = resources.requests.as_ref().expect("requests");
    let limits = resources.limits.as_ref().expect("limits");
    let request = bytes(&requests["memory"]);
    let limit = bytes(&limits["memory"]);
    // docs/deploy.md ("Resources"): the agent's RSS at 10k services x 10 endpoints plus the
    // BPF maps charged to the pod, on a node of up to 64 CPUs.
    let needed = AGENT_MIB_AT_10K_SERVICES + MAPS_MIB + MAPS_MIB_PER_CPU * (CPUS_SIZED_FOR - 2);
    assert!(request >= needed << 20, "memory request {request} below the measured {needed} MiB");
    assert!(limit >= request, "memory limit {limit} below the request {request}");
    assert!(requests.contains_key("cpu"));
    assert!(!limits.contains_key("cpu"), "a CPU limit throttles syncs");
}

/// What the kernel charges for vipr's BPF maps right after it starts on a 2-CPU node
/// (measured: docs/deploy.md, "Resources"; the lab test below measures it again), and what
/// every further CPU adds (the per-CPU backend counters).
const MAPS_MIB: u64 = 380;
const MAPS_MIB_PER_CPU: u64 = 1;
/// The agent's RSS at 10k services x 10 endpoints (docs/benchmarks.md).
const AGENT_MIB_AT_10K_SERVICES: u64 = 130;
/// The largest node the memory request is sized for.
const CPUS_SIZED_FOR: u64 = 64;

#[test]
fn render_puts_every_value_in_place_and_leaves_no_placeholder() {
    // Every manifest of deploy/ is rendered: the uninstall DaemonSet alone, the others together.
    let output = render(&["--api-server=[2001:db8::1]:443", "--mode=auto", "--monitoring"]).unwrap();
    let uninstall = render(&["--uninstall"]).unwrap();
    for entry in std::fs::read_dir(deploy_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|extension| extension == "yaml") {
            let name = path.file_name().unwrap().to_str().unwrap();
            let rendered_in = if name == "uninstall.yaml" { &uninstall } else { &output };
            assert!(
                rendered_in.contains(&format!("# Source: deploy/{name}\n")),
                "render.sh leaves out {name}"
            );
        }
    }
    assert!(!output.contains("${"), "a placeholder is left:\n{output}");
    assert!(!uninstall.contains("${"), "a placeholder is left:\n{uninstall}");

    // Defaults: side by side with kube-proxy, on ports it does not hold.
    let manifests = parse_manifests(&output, "render.sh's side-by-side output");
    let daemon_set = only(&manifests.daemon_sets, "DaemonSet");
    let container = vipr_container(pod_spec(daemon_set));
    let args = container.args.clone().unwrap_or_default();
    for expected in
        ["--proxy-mode=auto", "--healthz-bind-address=0.0.0.0:10266", "--metrics-bind-address=0.0.0.0:10269"]
    {
        assert!(args.iter().any(|arg| arg == expected), "no {expected} in {args:?}");
    }
    // The other modes write sysctls: privileged, as kube-proxy, and so allowed to share a bpffs
    // it mounts with the node.
    assert_eq!(container.security_context.as_ref().and_then(|context| context.privileged), Some(true));
    let bpffs =
        container.volume_mounts.iter().flatten().find(|mount| mount.mount_path == "/sys/fs/bpf").unwrap();
    assert_eq!(bpffs.mount_propagation.as_deref(), Some("Bidirectional"));
    let ports: Vec<i32> = container.ports.iter().flatten().map(|port| port.container_port).collect();
    assert!(!ports.contains(&10256) && !ports.contains(&10249), "{ports:?} collide with kube-proxy's");
    let env: BTreeMap<String, String> = container
        .env
        .iter()
        .flatten()
        .filter_map(|var| Some((var.name.clone(), var.value.clone()?)))
        .collect();
    assert_eq!(env["KUBERNETES_SERVICE_HOST"], "2001:db8::1");
    assert_eq!(env["KUBERNETES_SERVICE_PORT"], "443");
    let config = only(&manifests.config_maps, "ConfigMap").data.as_ref().unwrap()["config.conf"].clone();
    assert_eq!(KubeProxyConfiguration::parse(&config).unwrap().mode.as_deref(), Some("auto"));
    assert!(!render(&["--api-server=192.0.2.1:6443"]).unwrap().contains("monitoring.coreos.com"));

    // Values that are missing or would break the YAML are refused.
    for bad in [
        vec!["--mode=ebpf"],
        vec!["--api-server=192.0.2.1"],
        vec!["--api-server=192.0.2.1:6443", "--mode=nftables"],
        vec!["--api-server=192.0.2.1:6443", "--image=a|b"],
        vec!["--api-server=192.0.2.1:6443", "--image=a\"b"],
        vec!["--api-server=192.0.2.1:6443", "--cluster-cidr=10.0.0.0/8\nkind: x"],
        vec!["--api-server=192.0.2.1:6443", "--ports=9999"],
        vec!["--api-server=192.0.2.1:6443", "--typo"],
    ] {
        let error = render(&bad).expect_err(&format!("render.sh accepts {bad:?}"));
        assert!(error.starts_with("render.sh: "), "{error}");
    }
}

#[test]
fn the_pod_monitor_scrapes_the_pods_metrics_port() {
    let manifests = manifests();
    let daemon_set = only(&manifests.daemon_sets, "DaemonSet");
    let monitor = only(&manifests.pod_monitors, "PodMonitor");
    let spec = &monitor["spec"];
    let selector: BTreeMap<String, String> =
        serde_yaml::from_value(spec["selector"]["matchLabels"].clone()).unwrap();
    let pod_labels =
        daemon_set.spec.as_ref().unwrap().template.metadata.as_ref().unwrap().labels.clone().unwrap();
    assert!(
        selector.iter().all(|(key, value)| pod_labels.get(key) == Some(value)),
        "{selector:?} does not select the pods ({pod_labels:?})"
    );
    assert_eq!(monitor["metadata"]["namespace"].as_str(), daemon_set.metadata.namespace.as_deref());
    let container = vipr_container(pod_spec(daemon_set));
    let endpoints = spec["podMetricsEndpoints"].as_sequence().expect("podMetricsEndpoints");
    assert!(!endpoints.is_empty());
    for endpoint in endpoints {
        let port = endpoint["port"].as_str().expect("a named port");
        let declared =
            container.ports.iter().flatten().find(|declared| declared.name.as_deref() == Some(port));
        let declared = declared.unwrap_or_else(|| panic!("the container has no port {port}"));
        let args = container.args.clone().unwrap_or_default();
        assert!(
            args.contains(&format!("--metrics-bind-address=0.0.0.0:{}", declared.container_port)),
            "port {port} is not where vipr serves metrics on every address: {args:?}"
        );
        assert_eq!(endpoint["path"].as_str(), Some("/metrics"));
    }
}

/// PromQL's functions, aggregations and keywords: the identifiers of an expression that are
/// not metric names.
const PROMQL_WORDS: &[&str] = &[
    "abs",
    "absent",
    "absent_over_time",
    "avg",
    "avg_over_time",
    "bool",
    "by",
    "ceil",
    "changes",
    "clamp_max",
    "clamp_min",
    "count",
    "count_over_time",
    "delta",
    "deriv",
    "floor",
    "group_left",
    "group_right",
    "histogram_quantile",
    "idelta",
    "ignoring",
    "increase",
    "irate",
    "label_replace",
    "max",
    "max_over_time",
    "min",
    "min_over_time",
    "offset",
    "on",
    "quantile",
    "rate",
    "resets",
    "round",
    "scalar",
    "sort",
    "sort_desc",
    "stddev",
    "sum",
    "sum_over_time",
    "time",
    "timestamp",
    "topk",
    "bottomk",
    "vector",
    "without",
    "and",
    "or",
    "unless",
];

/// The metric names of a PromQL expression: its identifiers, less PromQL's own words, label
/// matchers (`{...}`), ranges (`[...]`), strings, numbers, and the label lists of
/// `by`/`without`/`on`/`ignoring`/`group_*`. A word PromQL does not know followed by `(` is
/// an error (a misspelt function).
fn metric_names(expression: &str) -> Vec<String> {
    let chars: Vec<char> = expression.chars().collect();
    let mut names = Vec::new();
    let mut index = 0;
    let mut skip_label_list = false;
    while index < chars.len() {
        let c = chars[index];
        match c {
            '{' | '[' | '"' | '\'' => {
                let close = match c {
                    '{' => '}',
                    '[' => ']',
                    quote => quote,
                };
                index += 1;
                while index < chars.len() && chars[index] != close {
                    if chars[index] == '\\' {
                        index += 1;
                    }
                    index += 1;
                }
                index += 1;
            }
            '(' if skip_label_list => {
                while index < chars.len() && chars[index] != ')' {
                    index += 1;
                }
                skip_label_list = false;
                index += 1;
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = index;
                while index < chars.len()
                    && (chars[index].is_ascii_alphanumeric() || "_:".contains(chars[index]))
                {
                    index += 1;
                }
                let word: String = chars[start..index].iter().collect();
                let next = chars[index..].iter().find(|c| !c.is_whitespace());
                if ["by", "without", "on", "ignoring", "group_left", "group_right"].contains(&word.as_str()) {
                    skip_label_list = true;
                } else if PROMQL_WORDS.contains(&word.as_str()) {
                } else if next == Some(&'(') {
                    panic!("{word:?} in {expression:?} is no PromQL function");
                } else {
                    names.push(word);
                }
            }
            c if c.is_ascii_digit() || c == '.' => {
                // A number, with an exponent or a duration unit (`offset 5m`).
                while index < chars.len() && (chars[index].is_ascii_alphanumeric() || chars[index] == '.') {
                    index += 1;
                }
            }
            _ => index += 1,
        }
    }
    names
}

#[test]
fn promql_metric_names_are_found_and_nothing_else() {
    assert_eq!(
        metric_names(r#"max by (pod, map) (vipr_bpf_map_entries{map=~"a|b"} / vipr_bpf_map_capacity) > 0.8"#),
        ["vipr_bpf_map_entries", "vipr_bpf_map_capacity"]
    );
    assert_eq!(
        metric_names(
            "histogram_quantile(0.99, sum by (le) (rate(x_bucket{pod=~\"$pod\"}[$__rate_interval])))"
        ),
        ["x_bucket"]
    );
    assert_eq!(metric_names("time() - a offset 5m > 1e3 and on (pod) b"), ["a", "b"]);
    assert!(std::panic::catch_unwind(|| metric_names("rat(a[5m])")).is_err());
}

/// Every PromQL expression of the PrometheusRule and the dashboard, with where it is.
fn monitoring_expressions() -> Vec<(String, String)> {
    let manifests = manifests();
    let mut expressions = Vec::new();
    let rule_object = only(&manifests.prometheus_rules, "PrometheusRule");
    for group in rule_object["spec"]["groups"].as_sequence().expect("rule groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["alert"].as_str().or(rule["record"].as_str()).expect("a named rule");
            expressions.push((format!("rule {name}"), rule["expr"].as_str().expect("expr").to_owned()));
        }
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(deploy_dir().join("grafana-dashboard.json")).unwrap())
            .expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(!panels.is_empty());
    for panel in panels {
        let title = panel["title"].as_str().expect("a titled panel");
        let targets = panel["targets"].as_array().unwrap_or_else(|| panic!("panel {title} has no targets"));
        assert!(!targets.is_empty(), "panel {title} has no targets");
        for target in targets {
            let expression =
                target["expr"].as_str().unwrap_or_else(|| panic!("panel {title}: a target without expr"));
            expressions.push((format!("panel {title:?}"), expression.to_owned()));
        }
    }
    for variable in dashboard["templating"]["list"].as_array().into_iter().flatten() {
        if let Some(query) = variable["query"].as_str().and_then(|query| query.strip_prefix("label_values("))
        {
            let metric = query.split([',', '{']).next().unwrap().trim();
            expressions.push((format!("variable {}", variable["name"]), metric.to_owned()));
        }
    }
    expressions
}

/// The metric names vipr's /metrics answers with: each family's (`# TYPE`) name, and for a
/// histogram the series Prometheus stores (`_bucket`, `_sum`, `_count`).
fn exposed_metric_names(body: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in body.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else { continue };
        let mut words = rest.split_whitespace();
        let (Some(name), Some(kind)) = (words.next(), words.next()) else { continue };
        names.insert(name.to_owned());
        if kind == "histogram" || kind == "summary" {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
    }
    names
}

/// The families (`# TYPE` names) in `body` that the metrics reference does not name in
/// backquotes.
fn undocumented_families(body: &str, reference: &str) -> Vec<String> {
    body.lines()
        .filter_map(|line| line.strip_prefix("# TYPE ")?.split_whitespace().next())
        .filter(|name| !reference.contains(&format!("`{name}`")))
        .map(str::to_owned)
        .collect()
}

fn metrics_reference() -> String {
    let path = deploy_dir().parent().unwrap().join("docs").join("metrics.md");
    std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

#[test]
fn the_metrics_reference_check_catches_an_undocumented_family() {
    let body = "# TYPE vipr_documented gauge\nvipr_documented 1\n# TYPE vipr_new counter\nvipr_new 2\n";
    assert_eq!(undocumented_families(body, "| `vipr_documented` | gauge |"), ["vipr_new"]);
    assert!(metrics_reference().contains("`vipr_bpf_map_capacity`"));
}

/// Series Prometheus itself adds to every scrape target.
const SCRAPE_SERIES: &[&str] = &["up", "scrape_duration_seconds", "scrape_samples_scraped"];

/// Checks every expression against the metrics vipr exposes: the names that do not exist.
fn unknown_metrics(expressions: &[(String, String)], exposed: &BTreeSet<String>) -> Vec<String> {
    let mut unknown = Vec::new();
    for (origin, expression) in expressions {
        let names = metric_names(expression);
        assert!(!names.is_empty(), "{origin} names no metric: {expression}");
        for name in names {
            if !exposed.contains(&name) && !SCRAPE_SERIES.contains(&name.as_str()) {
                unknown.push(format!("{origin}: {name}"));
            }
        }
    }
    unknown
}

/// The memory the kernel charges for the BPF maps a process holds open, in bytes: each map
/// once, from its fdinfo's `memlock`.
fn bpf_map_memory(pid: u32) -> u64 {
    let mut maps = BTreeMap::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fdinfo")).unwrap().flatten() {
        let Ok(info) = std::fs::read_to_string(entry.path()) else { continue };
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|value| value.trim().parse::<u64>().ok())
        };
        if let (Some(id), Some(memlock)) = (field("map_id:"), field("memlock:")) {
            maps.insert(id, memlock);
        }
    }
    maps.values().sum()
}

/// The real vipr, in eBPF mode in a lab, scraped: every metric a rule or a panel names is
/// one it answers with. Its maps take no more memory than the DaemonSet's request accounts
/// for.
#[test]
fn vipr_in_a_lab_exposes_every_monitored_metric_and_its_maps_fit_the_request() {
    let expressions = monitoring_expressions();
    let backend = Ipv4Addr::new(10, 20, 1, 2);
    let lab = Lab::new(LabConfig {
        label: "deploy-metrics".to_owned(),
        vipr_binary: locate_vipr().unwrap(),
        client: LeafSpec::in_own_slash24("client", Ipv4Addr::new(10, 10, 0, 2)).unwrap(),
        backends: vec![LeafSpec::in_own_slash24("b1", backend).unwrap()],
        services: vec![ClusterIpService {
            namespace: "default".to_owned(),
            name: "web".to_owned(),
            cluster_ip: Ipv4Addr::new(10, 96, 0, 10),
            ports: vec![ServicePort {
                name: "http".to_owned(),
                protocol: Protocol::Tcp,
                port: 80,
                target_port: 8080,
            }],
            endpoints: vec![Endpoint::ready(backend, "pod")],
        }],
    })
    .unwrap();
    let args = [
        "--proxy-mode=ebpf".to_owned(),
        format!("--services-file={}", lab.services_file().display()),
        format!("--hostname-override={}", lab.node().name()),
        format!("--devices={}", lab.topology().node_interfaces().join(",")),
        format!("--bpf-root={}", lab.bpf_root().display()),
    ];
    let log = lab.services_file().with_file_name("vipr.log");
    let mut agent = Vipr::start_with_args(&locate_vipr().unwrap(), lab.node(), &args, &log).unwrap();
    let metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, 10249));
    // After the first sync, when every collector (the datapath's included) answers.
    let body = wait_for("vipr's first sync", Duration::from_secs(20), || {
        agent.ensure_running()?;
        Ok(match get(lab.node(), metrics, "/metrics") {
            Ok(answer)
                if answer
                    .metric(r#"kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"}"#)
                    .is_some_and(|t| t > 0.0) =>
            {
                Check::Done(answer.body)
            }
            Ok(answer) => Check::NotYet(answer.body),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })
    .unwrap();
    let exposed = exposed_metric_names(&body);
    let unknown = unknown_metrics(&expressions, &exposed);
    assert!(unknown.is_empty(), "named but not exposed by vipr: {unknown:?}\nexposed: {exposed:?}");
    // The check itself catches a name vipr does not have.
    let misspelt = [("a rule".to_owned(), "vipr_bpf_map_entrie > 0".to_owned())];
    assert_eq!(unknown_metrics(&misspelt, &exposed), ["a rule: vipr_bpf_map_entrie"]);
    let undocumented = undocumented_families(&body, &metrics_reference());
    assert!(undocumented.is_empty(), "exposed but missing from docs/metrics.md: {undocumented:?}");

    let cpus = std::thread::available_parallelism().unwrap().get() as u64;
    let maps_mib = bpf_map_memory(agent.pid()) >> 20;
    let accounted = MAPS_MIB + MAPS_MIB_PER_CPU * cpus.saturating_sub(2);
    assert!(maps_mib > 100, "vipr holds no maps open? {maps_mib} MiB");
    assert!(
        maps_mib <= accounted,
        "vipr's maps take {maps_mib} MiB on {cpus} CPUs, the request accounts for {accounted}"
    );
}

/// (API group, resource, verb) triples.
fn access_triples<'a>(
    accesses: impl IntoIterator<Item = &'a ApiAccess>,
) -> BTreeSet<(String, String, String)> {
    accesses
        .into_iter()
        .flat_map(|access| {
            access
                .verbs
                .iter()
                .map(|verb| (access.group.to_owned(), access.resource.to_owned(), (*verb).to_owned()))
        })
        .collect()
}

#[test]
fn rbac_grants_exactly_what_vipr_watches_and_records() {
    let manifests = manifests();
    let role = only(&manifests.cluster_roles, "ClusterRole");
    let mut granted = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none(), "{rule:?}");
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    assert!(
                        !["*"].contains(&verb.as_str()) && group != "*" && resource != "*",
                        "wildcard in {rule:?}"
                    );
                    granted.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    assert_eq!(granted, access_triples(WATCHED_RESOURCES.iter().chain(RECORDED_EVENTS)));

    let binding = only(&manifests.cluster_role_bindings, "ClusterRoleBinding");
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let account = only(&manifests.service_accounts, "ServiceAccount");
    let subject = only(binding.subjects.as_deref().unwrap_or_default(), "subject");
    assert_eq!(subject.kind, "ServiceAccount");
    assert_eq!(Some(&subject.name), account.metadata.name.as_ref());
    assert_eq!(subject.namespace, account.metadata.namespace);
}
