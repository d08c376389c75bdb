//! Desired state: what every frontend of every service should balance to.
//!
//! This is the only thing a dataplane sees. It is computed from Kubernetes objects by
//! [`kubernetes::desired_state`] and knows nothing of maps, rules or kernels; each dataplane
//! turns it into its own representation.
use std::{collections::BTreeMap, fmt, net::IpAddr};

pub mod kubernetes;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// Parses a Kubernetes protocol name; an absent protocol means TCP, as in the API.
    pub fn from_kubernetes(name: Option<&str>) -> Option<Self> {
        match name {
            None | Some("TCP") => Some(Self::Tcp),
            Some("UDP") => Some(Self::Udp),
            Some("SCTP") => Some(Self::Sctp),
            Some(_) => None,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
            Self::Sctp => "SCTP",
        })
    }
}

/// An address, port and protocol on which a service is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", std::net::SocketAddr::new(self.ip, self.port), self.protocol)
    }
}

/// An endpoint address and port a frontend's connections are sent to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend {
    pub ip: IpAddr,
    pub port: u16,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        std::net::SocketAddr::new(self.ip, self.port).fmt(f)
    }
}

/// Identity of one port of one service, as kube-proxy's `ServicePortName`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub namespace: String,
    pub name: String,
    pub port: String,
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)?;
        if !self.port.is_empty() {
            write!(f, ":{}", self.port)?;
        }
        Ok(())
    }
}

/// What one frontend balances to. `backends` is sorted and free of duplicates, so two
/// entries are equal exactly when a dataplane would program them identically.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendEntry {
    pub service: ServicePortName,
    pub backends: Vec<Backend>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    pub frontends: BTreeMap<Frontend, FrontendEntry>,
}

impl DesiredState {
    pub fn backend_count(&self) -> usize {
        self.frontends.values().map(|entry| entry.backends.len()).sum()
    }
}
