//! Objects as the API server sent them, decoded one at a time.
//!
//! kube's client decodes a whole list response, or a whole watch event, into the target type
//! at once: one object vipr cannot decode would fail the entire list (and the watcher would
//! retry it forever), or its watch event would be lost without a trace. [`Decoded`] accepts
//! any JSON value and decodes it into `K` itself. An object that does not decode is kept by
//! its identity only, so the reflector store still tracks it — a later fix or deletion
//! replaces it — and the snapshot reports it instead of silently leaving it out.
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::ObjectMeta, Metadata, Resource};
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

impl<'de, K> Deserialize<'de> for Decoded<K>
where
    K: DeserializeOwned + Metadata<Ty = ObjectMeta>,
{
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Only a value that is not JSON at all fails here; that is a broken response, not a
        // broken object.
        let value = Value::deserialize(deserializer)?;
        let decoded = match serde_path_to_error::deserialize::<_, K>(&value) {
            // kube-rs keys its stores by name and panics on an object without one.
            Ok(object) if object.metadata().name.as_deref().is_none_or(str::is_empty) => Self::Invalid {
                metadata: Box::new(identity(&value)),
                reason: "metadata.name is missing".into(),
            },
            Ok(object) => Self::Valid(object),
            Err(error) => Self::Invalid { metadata: Box::new(identity(&value)), reason: error.to_string() },
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
