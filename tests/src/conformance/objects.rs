//! Recorded Services and EndpointSlices -> the Kubernetes objects vipr is given.
//!
//! One conversion, used both to write the runner's services file and by the model-level test,
//! so both judge vipr on the same objects. Everything is carried over as recorded, with no
//! API-server validation or defaulting: a `NodePort` service without a node port stays so, an
//! unset type stays unset, unset endpoint conditions stay unset, source ranges keep their
//! whitespace. The only mapping is the one Go's `omitempty` makes: an empty string or list is
//! an absent field.

use std::{collections::BTreeMap, fmt::Write as _};

use anyhow::{Context, Result};
use k8s_openapi::{
    api::{
        core::v1::{
            ClientIPConfig, LoadBalancerIngress, LoadBalancerStatus, Service, ServicePort, ServiceSpec,
            ServiceStatus, SessionAffinityConfig,
        },
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};

use super::case::{self, Stage};

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

fn non_empty(text: &str) -> Option<String> {
    (!text.is_empty()).then(|| text.to_owned())
}

fn non_empty_list(list: &[String]) -> Option<Vec<String>> {
    (!list.is_empty()).then(|| list.to_vec())
}

fn metadata(namespace: &str, name: &str, labels: Option<BTreeMap<String, String>>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: Some(namespace.to_owned()),
        labels,
        ..ObjectMeta::default()
    }
}

pub fn service(recorded: &case::Service) -> Service {
    let ports = recorded
        .ports
        .iter()
        .map(|port| ServicePort {
            name: non_empty(&port.name),
            protocol: Some(port.protocol.to_string()),
            port: port.port,
            target_port: port.target_port.map(IntOrString::Int),
            node_port: port.node_port,
            ..ServicePort::default()
        })
        .collect();
    let ingress: Vec<LoadBalancerIngress> = recorded
        .load_balancer_ingress
        .iter()
        .map(|ingress| LoadBalancerIngress {
            ip: Some(ingress.ip.clone()),
            ip_mode: ingress.ip_mode.clone(),
            ..LoadBalancerIngress::default()
        })
        .collect();
    let (session_affinity, session_affinity_config) = match &recorded.session_affinity {
        None => (None, None),
        Some(affinity) => (
            Some(affinity.type_.clone()),
            affinity.timeout_seconds.map(|timeout_seconds| SessionAffinityConfig {
                client_ip: Some(ClientIPConfig { timeout_seconds: Some(timeout_seconds) }),
            }),
        ),
    };
    Service {
        metadata: metadata(&recorded.namespace, &recorded.name, None),
        spec: Some(ServiceSpec {
            type_: recorded.type_.clone(),
            // The API keeps clusterIP equal to clusterIPs[0].
            cluster_ip: recorded.cluster_ips.first().cloned(),
            cluster_ips: non_empty_list(&recorded.cluster_ips),
            ports: Some(ports),
            external_ips: non_empty_list(&recorded.external_ips),
            load_balancer_source_ranges: non_empty_list(&recorded.load_balancer_source_ranges),
            external_traffic_policy: recorded.external_traffic_policy.clone(),
            internal_traffic_policy: recorded.internal_traffic_policy.clone(),
            session_affinity,
            session_affinity_config,
            health_check_node_port: recorded.health_check_node_port,
            ..ServiceSpec::default()
        }),
        status: (!ingress.is_empty()).then(|| ServiceStatus {
            load_balancer: Some(LoadBalancerStatus { ingress: Some(ingress) }),
            ..ServiceStatus::default()
        }),
    }
}

pub fn endpoint_slice(recorded: &case::EndpointSlice) -> EndpointSlice {
    let labels = BTreeMap::from([(SERVICE_NAME_LABEL.to_owned(), recorded.service_name.clone())]);
    EndpointSlice {
        metadata: metadata(&recorded.namespace, &recorded.name, Some(labels)),
        address_type: recorded.address_type.clone(),
        endpoints: recorded
            .endpoints
            .iter()
            .map(|endpoint| Endpoint {
                addresses: endpoint.addresses.clone(),
                node_name: endpoint.node_name.clone(),
                conditions: endpoint.conditions.as_ref().map(|conditions| EndpointConditions {
                    ready: conditions.ready,
                    serving: conditions.serving,
                    terminating: conditions.terminating,
                }),
                ..Endpoint::default()
            })
            .collect(),
        ports: Some(
            recorded
                .ports
                .iter()
                .map(|port| EndpointPort {
                    name: non_empty(&port.name),
                    port: Some(port.port),
                    protocol: Some(port.protocol.to_string()),
                    ..EndpointPort::default()
                })
                .collect(),
        ),
    }
}

/// The objects of one stage, in recorded order.
pub fn objects(stage: &Stage) -> (Vec<Service>, Vec<EndpointSlice>) {
    (stage.services.iter().map(service).collect(), stage.endpoint_slices.iter().map(endpoint_slice).collect())
}

/// The services file for one stage: every Service, then every EndpointSlice, as a
/// multi-document YAML file of complete manifests (apiVersion and kind included).
pub fn manifests(stage: &Stage) -> Result<String> {
    let (services, slices) = objects(stage);
    let mut yaml = format!(
        "# {} Services and {} EndpointSlices, stage {:?}\n",
        services.len(),
        slices.len(),
        stage.label
    );
    let documents =
        services.iter().map(serde_yaml::to_string).chain(slices.iter().map(serde_yaml::to_string));
    for (index, document) in documents.enumerate() {
        if index > 0 {
            yaml.push_str("---\n");
        }
        let document = document.context("cannot render a manifest")?;
        write!(yaml, "{document}").expect("writing to a String cannot fail");
    }
    Ok(yaml)
}
