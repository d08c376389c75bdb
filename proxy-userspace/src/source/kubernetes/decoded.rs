//! Objects as the API server sent them, decoded one at a time.
//!
//! kube's client decodes a whole list response, or a whole watch event, into the target type
//! at once: one object vipr cannot decode would fail the entire list (and the watcher would
//! retry it forever), or its watch event would be lost without a trace. [`Decoded`] accepts
//! any JSON value and decodes it into `K` itself. An object that does not decode is kept by
//! its identity only, and sent under its key, so the agent's change tracker reports it
//! instead of silently leaving it out, until a later fix or deletion replaces it.
//!
//! A decoded object is [`Slim`]med before it is sent.
// The API types the source watches, as the source names them.
use super::{EndpointSlice, Metadata, Node, ObjectMeta, Resource, Service, ServiceCIDR};
use serde::{de::DeserializeOwned, Deserialize, Deserializer};
use serde_json::Value;

#[derive(Clone, Debug)]
pub enum Decoded<K> {
    Valid(K),
    /// The object did not decode into `K`; only its identity and version are known.
    Invalid {
        metadata: Box<ObjectMeta>,
        reason: String,
    },
}

/// Drops what the API server sends and vipr never reads. The agent's change tracker holds
/// every Service and EndpointSlice of the cluster; in the API server's
/// objects, managed fields (a JSON tree per field manager), `kubectl apply`'s copy of the
/// whole object and each endpoint's pod reference take half of it (a Service written by
/// `kubectl apply` and its controller's slice of 10 endpoints: 23 KB decoded, 12 KB slimmed).
pub trait Slim {
    fn slim(&mut self);
}

/// The annotation in which `kubectl apply` keeps the whole object as last applied.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

fn slim_metadata(metadata: &mut ObjectMeta) {
    metadata.managed_fields = None;
    metadata.owner_references = None;
    if let Some(annotations) = &mut metadata.annotations {
        annotations.remove(LAST_APPLIED);
    }
}

impl Slim for Service {
    fn slim(&mut self) {
        slim_metadata(&mut self.metadata);
    }
}

impl Slim for EndpointSlice {
    fn slim(&mut self) {
        slim_metadata(&mut self.metadata);
        for endpoint in &mut self.endpoints {
            endpoint.target_ref = None;
            endpoint.hostname = None;
            // Topology-aware routing reads the hints, not the endpoint's own zone.
            endpoint.zone = None;
            endpoint.deprecated_topology = None;
        }
    }
}

impl Slim for Node {
    fn slim(&mut self) {
        slim_metadata(&mut self.metadata);
        if let Some(status) = &mut self.status {
            // Every image on the node, with its names and size: often the bulk of a Node.
            status.images = None;
        }
    }
}

impl Slim for ServiceCIDR {
    fn slim(&mut self) {
        slim_metadata(&mut self.metadata);
        // Its conditions: the ranges are in the spec.
        self.status = None;
    }
}

impl<'de, K> Deserialize<'de> for Decoded<K>
where
    K: DeserializeOwned + Metadata<Ty = ObjectMeta> + Slim,
{
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Only a value that is not JSON at all fails here; that is a broken response, not a
        // broken object.
        let value = Value::deserialize(deserializer)?;
        // The identity first: decoding consumes the value, moving its strings into `K` instead
        // of copying each of them.
        let metadata = identity(&value);
        let decoded = match serde_path_to_error::deserialize::<_, K>(value) {
            // kube-rs keys its stores by name and panics on an object without one.
            Ok(object) if object.metadata().name.as_deref().is_none_or(str::is_empty) => {
                Self::Invalid { metadata: Box::new(metadata), reason: "metadata.name is missing".into() }
            }
            Ok(mut object) => {
                object.slim();
                Self::Valid(object)
            }
            Err(error) => Self::Invalid { metadata: Box::new(metadata), reason: error.to_string() },
        };
        Ok(decoded)
    }
}

/// The fields that identify an object and its version, read leniently: in an object that does
/// not decode, the metadata may be malformed too. The name is never absent, for the store.
fn identity(value: &Value) -> ObjectMeta {
    let field =
        |name: &str| -> Option<String> { value.get("metadata")?.get(name)?.as_str().map(str::to_owned) };
    ObjectMeta {
        name: Some(field("name").unwrap_or_default()),
        namespace: field("namespace"),
        resource_version: field("resourceVersion"),
        uid: field("uid"),
        ..ObjectMeta::default()
    }
}

/// `Decoded<K>` is listed and watched at `K`'s URL, so kube-rs's `Api` and reflector work
/// with it as with `K`.
impl<K: Resource> Resource for Decoded<K> {
    const API_VERSION: &'static str = K::API_VERSION;
    const GROUP: &'static str = K::GROUP;
    const KIND: &'static str = K::KIND;
    const VERSION: &'static str = K::VERSION;
    const URL_PATH_SEGMENT: &'static str = K::URL_PATH_SEGMENT;
    type Scope = K::Scope;
}

impl<K: Metadata<Ty = ObjectMeta>> Metadata for Decoded<K> {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        match self {
            Self::Valid(object) => object.metadata(),
            Self::Invalid { metadata, .. } => metadata,
        }
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Self::Valid(object) => object.metadata_mut(),
            Self::Invalid { metadata, .. } => metadata,
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Service;
    use kube::core::ObjectList;

    use super::*;

    #[test]
    fn one_bad_item_does_not_fail_the_list() {
        let list: ObjectList<Decoded<Service>> = serde_json::from_str(
            r#"{"apiVersion": "v1", "kind": "ServiceList", "metadata": {"resourceVersion": "7"}, "items": [
                {"metadata": {"name": "good", "namespace": "shop", "resourceVersion": "5"}, "spec": {"clusterIP": "10.96.0.1"}},
                {"metadata": {"name": "bad", "namespace": "shop", "resourceVersion": "6"}, "spec": {"ports": [{"port": "eighty"}]}},
                {"metadata": {"namespace": "shop"}},
                42
            ]}"#,
        )
        .unwrap();
        let [good, bad, nameless, number] = &list.items[..] else { panic!("{:?}", list.items) };
        assert!(matches!(good, Decoded::Valid(service) if service.metadata.name.as_deref() == Some("good")));
        let Decoded::Invalid { metadata, reason } = bad else { panic!("{bad:?}") };
        assert_eq!(metadata.name.as_deref(), Some("bad"));
        assert_eq!(metadata.resource_version.as_deref(), Some("6"));
        assert!(reason.starts_with("spec.ports[0].port: invalid type"), "{reason}");
        assert!(matches!(nameless, Decoded::Invalid { reason, .. } if reason == "metadata.name is missing"));
        assert!(matches!(number, Decoded::Invalid { metadata, .. } if metadata.name.as_deref() == Some("")));
    }

    #[test]
    fn objects_keep_only_what_vipr_reads() {
        let slice: Decoded<EndpointSlice> = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "web-abc", "namespace": "shop", "resourceVersion": "5", "uid": "u1",
                "labels": {"kubernetes.io/service-name": "web"},
                "annotations": {
                    "endpoints.kubernetes.io/last-change-trigger-time": "2024-01-01T00:00:00Z",
                    LAST_APPLIED: "{\"a very\": \"long copy\"}",
                },
                "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                                   "fieldsType": "FieldsV1", "fieldsV1": {"f:endpoints": {}}}],
                "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "web", "uid": "u0"}],
            },
            "addressType": "IPv4",
            "endpoints": [{
                "addresses": ["10.1.0.1"], "conditions": {"ready": true}, "nodeName": "node-a",
                "hostname": "web-0", "zone": "z1", "hints": {"forZones": [{"name": "z1"}]},
                "targetRef": {"kind": "Pod", "name": "web-0", "namespace": "shop", "uid": "p1"},
            }],
            "ports": [{"name": "http", "port": 8080}],
        }))
        .unwrap();
        let Decoded::Valid(slice) = slice else { panic!("{slice:?}") };
        assert_eq!(
            (slice.metadata.managed_fields.as_ref(), slice.metadata.owner_references.as_ref()),
            (None, None)
        );
        let annotations = slice.metadata.annotations.as_ref().unwrap();
        assert_eq!(
            annotations.keys().collect::<Vec<_>>(),
            ["endpoints.kubernetes.io/last-change-trigger-time"]
        );
        assert_eq!(
            (slice.metadata.resource_version.as_deref(), slice.metadata.uid.as_deref()),
            (Some("5"), Some("u1"))
        );
        let endpoint = &slice.endpoints[0];
        assert_eq!(
            (endpoint.target_ref.as_ref(), endpoint.hostname.as_ref(), endpoint.zone.as_ref()),
            (None, None, None)
        );
        // What the model reads stays.
        assert_eq!(endpoint.addresses, ["10.1.0.1"]);
        assert_eq!(endpoint.node_name.as_deref(), Some("node-a"));
        assert_eq!(endpoint.conditions.as_ref().and_then(|c| c.ready), Some(true));
        assert!(endpoint.hints.is_some());
    }

    #[test]
    fn a_bad_watch_event_still_carries_its_identity() {
        let event: kube::core::WatchEvent<Decoded<Service>> = serde_json::from_str(
            r#"{"type": "MODIFIED", "object": {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "web", "namespace": "shop", "resourceVersion": "9"}, "spec": "oops"}}"#,
        )
        .unwrap();
        let kube::core::WatchEvent::Modified(Decoded::Invalid { metadata, .. }) = event else {
            panic!("{event:?}")
        };
        assert_eq!(
            (metadata.name.as_deref(), metadata.resource_version.as_deref()),
            (Some("web"), Some("9"))
        );
    }
}
