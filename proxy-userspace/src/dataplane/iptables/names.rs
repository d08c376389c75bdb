//! Chain names, made as kube-proxy makes them: a prefix and the first 16 characters of the
//! base32 (RFC 4648, padded alphabet) of a SHA-256 over the service port's name, its protocol
//! in lower case and, for endpoint chains, the endpoint. So a service keeps its chain names
//! across restarts, nodes and vipr/kube-proxy, and chains left by kube-proxy are recognised.
use ring::digest::{digest, SHA256};

use crate::model::{Backend, Protocol, ServicePortName};

/// The main chain of a service port: its endpoints for `Cluster` traffic policy.
pub const SERVICE_PREFIX: &str = "KUBE-SVC-";
/// A service port's node-local endpoints (`Local` traffic policies).
pub const LOCAL_PREFIX: &str = "KUBE-SVL-";
/// Where external destinations (NodePort, external IP, load-balancer IP) lead; classifies the
/// source before choosing the endpoints.
pub const EXTERNAL_PREFIX: &str = "KUBE-EXT-";
/// `loadBalancerSourceRanges`.
pub const FIREWALL_PREFIX: &str = "KUBE-FW-";
/// One endpoint of a service port: the DNAT.
pub const ENDPOINT_PREFIX: &str = "KUBE-SEP-";
/// Chains of kube-proxy versions before 1.24 (external traffic policy Local).
const OLD_LOCAL_PREFIX: &str = "KUBE-XLB-";

/// Per-service chains: vipr writes and deletes them one by one; a chain with one of these
/// prefixes that vipr does not want (its own or kube-proxy's) is stale.
pub const SERVICE_CHAIN_PREFIXES: [&str; 6] =
    [SERVICE_PREFIX, LOCAL_PREFIX, EXTERNAL_PREFIX, FIREWALL_PREFIX, ENDPOINT_PREFIX, OLD_LOCAL_PREFIX];

pub fn is_service_chain(name: &str) -> bool {
    SERVICE_CHAIN_PREFIXES.iter().any(|prefix| name.starts_with(prefix))
}

/// kube-proxy's `ServicePortName.String()`: `namespace/name`, then `:port` if the port has a
/// name.
pub fn service_port_string(name: &ServicePortName) -> String {
    name.to_string()
}

/// `prefix` + the hash of `service` (a service port string) and `protocol`.
pub fn service_chain(prefix: &str, service: &str, protocol: Protocol) -> String {
    format!("{prefix}{}", hash16(&[service, protocol.lower_case()]))
}

/// The `KUBE-SEP-` chain of `endpoint` (written `ip:port`, `[ip]:port` for IPv6, as Go's
/// `net.JoinHostPort`).
pub fn endpoint_chain(service: &str, protocol: Protocol, endpoint: &Backend) -> String {
    format!("{ENDPOINT_PREFIX}{}", hash16(&[service, protocol.lower_case(), &endpoint.to_string()]))
}

fn hash16(parts: &[&str]) -> String {
    let input: String = parts.concat();
    let hash = digest(&SHA256, input.as_bytes());
    let mut encoded = base32(hash.as_ref());
    encoded.truncate(16);
    encoded
}

/// RFC 4648 base32 with the standard alphabet (Go's `base32.StdEncoding`); padding is never
/// reached for the 16 characters used.
fn base32(data: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::with_capacity(data.len().div_ceil(5) * 8);
    let mut buffer: u64 = 0;
    let mut bits = 0;
    for byte in data {
        buffer = (buffer << 8) | u64::from(*byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((buffer >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((buffer << (5 - bits)) & 31) as usize] as char);
    }
    while !out.len().is_multiple_of(8) {
        out.push('=');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port_name(namespace: &str, name: &str, port: &str, protocol: Protocol) -> ServicePortName {
        ServicePortName { namespace: namespace.into(), name: name.into(), port: port.into(), protocol }
    }

    #[test]
    fn base32_matches_rfc4648_vectors() {
        for (input, output) in [
            ("", ""),
            ("f", "MY======"),
            ("fo", "MZXQ===="),
            ("foo", "MZXW6==="),
            ("foob", "MZXW6YQ="),
            ("fooba", "MZXW6YTB"),
            ("foobar", "MZXW6YTBOI======"),
        ] {
            assert_eq!(base32(input.as_bytes()), output, "{input:?}");
        }
    }

    #[test]
    fn chain_names_are_kube_proxys() {
        // Names recorded from kube-proxy's iptables proxier unit tests (TestOverallIPTablesRules):
        // ns1/svc1:p80 tcp and its endpoint 10.180.0.1:80.
        let svc = port_name("ns1", "svc1", "p80", Protocol::Tcp);
        let service = service_port_string(&svc);
        assert_eq!(service, "ns1/svc1:p80");
        assert_eq!(service_chain(SERVICE_PREFIX, &service, Protocol::Tcp), "KUBE-SVC-XPGD46QRK7WJZT7O");
        let endpoint = Backend { ip: "10.180.0.1".parse().unwrap(), port: 80 };
        assert_eq!(endpoint_chain(&service, Protocol::Tcp, &endpoint), "KUBE-SEP-SXIVWICOYRO3J4NJ");
        // Every name fits iptables' 28-character limit.
        assert!(endpoint_chain(&service, Protocol::Tcp, &endpoint).len() <= 28);
    }

    #[test]
    fn service_chains_are_recognised_by_prefix() {
        assert!(is_service_chain("KUBE-SVC-XPGD46QRK7WJZT7O"));
        assert!(is_service_chain("KUBE-XLB-XPGD46QRK7WJZT7O"));
        assert!(!is_service_chain("KUBE-SERVICES"));
        assert!(!is_service_chain("KUBE-MARK-MASQ"));
    }
}
