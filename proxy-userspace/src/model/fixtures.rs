//! Desired-state pieces for the dataplanes' unit tests, written once.
use std::{net::SocketAddr, sync::Arc};

use super::{
    Backend, Frontend, FrontendEntry, FrontendKind, Protocol, ServicePortName, Treatment, WhenEmpty,
};

/// Backends from `address:port` texts.
pub fn backends(texts: &[&str]) -> Arc<[Backend]> {
    texts
        .iter()
        .map(|text| {
            let address: SocketAddr = text.parse().unwrap();
            Backend { ip: address.ip(), port: address.port() }
        })
        .collect()
}

/// A frontend entry of `service` with `backends` for every source class (rejected when empty,
/// not masqueraded), no source ranges, no affinity.
pub fn entry(service: ServicePortName, kind: FrontendKind, backends: &[&str]) -> FrontendEntry {
    let treatment =
        Treatment { backends: self::backends(backends), when_empty: WhenEmpty::Reject, masquerade: false };
    FrontendEntry {
        service,
        kind,
        from_pod: treatment.clone(),
        from_node: treatment.clone(),
        from_outside: treatment,
        allowed_sources: Vec::new(),
        affinity: None,
    }
}

/// Port `port` of Service `namespace/name`.
pub fn service_port(namespace: &str, name: &str, port: &str, protocol: Protocol) -> ServicePortName {
    ServicePortName { namespace: namespace.into(), name: name.into(), port: port.into(), protocol }
}

/// A frontend from an `address:port` text.
pub fn frontend(text: &str, protocol: Protocol) -> Frontend {
    let address: SocketAddr = text.parse().unwrap();
    Frontend { ip: address.ip(), port: address.port(), protocol }
}
