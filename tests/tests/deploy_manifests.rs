//! The manifests in deploy/ are valid API objects that fit together: every document parses
//! into its k8s-openapi type without losing a field (a misspelt field would be dropped
//! silently by the API server too), the DaemonSet runs as the ServiceAccount with the
//! ConfigMap's KubeProxyConfiguration, which vipr's own parser accepts, and the ClusterRole
//! grants exactly what the code watches and records. No cluster needed.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{ConfigMap, Container, PodSpec, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding},
};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use vipr::{
    agent::{ApiAccess, RECORDED_EVENTS, WATCHED_RESOURCES},
    cli::Args,
    config::{KubeProxyConfiguration, Settings, SourceSettings},
};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Every object of deploy/, typed.
#[derive(Default)]
struct Manifests {
    daemon_sets: Vec<DaemonSet>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    config_maps: Vec<ConfigMap>,
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
    let mut manifests = Manifests::default();
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|extension| extension == "yaml" || extension == "yml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in {}", deploy_dir().display());
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (index, document) in serde_yaml::Deserializer::from_str(&text).enumerate() {
            let document = serde_yaml::Value::deserialize(document).unwrap();
            if document.is_null() {
                continue;
            }
            let origin = format!("{} document {}", file.display(), index + 1);
            let field =
                |name: &str| document.get(name).and_then(serde_yaml::Value::as_str).unwrap_or_default();
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
                (api_version, kind) => panic!("{origin}: unexpected {api_version} {kind}"),
            }
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
        Some(vipr::cli::ProxyMode::Ebpf),
        "the DaemonSet passes --proxy-mode, so that a reused kube-proxy ConfigMap's mode does not apply"
    );
    assert_eq!(settings.proxy_mode, vipr::cli::ProxyMode::Ebpf);
    assert_eq!(settings.node_name, "node-a");
    assert!(
        settings.ignored_config.is_empty(),
        "the ConfigMap sets what vipr ignores: {:?}",
        settings.ignored_config
    );
    // The kubeconfig it names (a path in the pod) comes from the same ConfigMap.
    let SourceSettings::Kubernetes { kubeconfig: Some(kubeconfig) } = &settings.source else {
        panic!("the DaemonSet must watch the API server through a kubeconfig: {:?}", settings.source)
    };
    let key = kubeconfig.strip_prefix(&config_mount.mount_path).ok().and_then(|key| key.to_str());
    assert!(
        key.is_some_and(|key| config_map.data.as_ref().is_some_and(|data| data.contains_key(key))),
        "{} is not a file of the ConfigMap",
        kubeconfig.display()
    );

    // The liveness probe asks /livez where vipr serves it.
    let healthz_port = settings.healthz_bind_address.expect("healthz served").port();
    let liveness = container
        .liveness_probe
        .as_ref()
        .and_then(|probe| probe.http_get.as_ref())
        .expect("an HTTP liveness probe");
    assert_eq!(liveness.path.as_deref(), Some("/livez"));
    assert_eq!(
        liveness.port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(healthz_port.into())
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
    assert!(data.contains_key("kubeconfig.conf"));
}

#[test]
fn the_pod_is_a_privileged_host_network_node_critical_agent_with_its_mounts() {
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
    assert_eq!(container.security_context.as_ref().and_then(|context| context.privileged), Some(true));

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
    assert_eq!(bpffs.mount_propagation.as_deref(), Some("Bidirectional"));
    assert_eq!(host_path("/sys/fs/cgroup").1.as_deref(), Some("/sys/fs/cgroup"));
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
