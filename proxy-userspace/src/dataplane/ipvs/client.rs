//! IPVS over generic netlink (family "IPVS", `include/uapi/linux/ip_vs.h`): virtual services,
//! their real servers (destinations), and the connection timeouts. The messages are built
//! and read by pure functions, unit-tested byte for byte; [`Ipvs`] sends them.
use std::{
    fmt, io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use crate::model::Protocol;
use crate::netlink::{genl_payload, parse_attributes, Attribute, Attributes, GenericFamily};

pub const FAMILY_NAME: &str = "IPVS";
pub const FAMILY_VERSION: u8 = 1;

// Commands.
const CMD_NEW_SERVICE: u8 = 1;
const CMD_SET_SERVICE: u8 = 2;
const CMD_DEL_SERVICE: u8 = 3;
const CMD_GET_SERVICE: u8 = 4;
const CMD_NEW_DEST: u8 = 5;
const CMD_SET_DEST: u8 = 6;
const CMD_DEL_DEST: u8 = 7;
const CMD_GET_DEST: u8 = 8;
const CMD_SET_CONFIG: u8 = 12;
const CMD_GET_CONFIG: u8 = 13;
const CMD_FLUSH: u8 = 17;

// Top-level attributes.
const CMD_ATTR_SERVICE: u16 = 1;
const CMD_ATTR_DEST: u16 = 2;
const CMD_ATTR_TIMEOUT_TCP: u16 = 4;
const CMD_ATTR_TIMEOUT_TCP_FIN: u16 = 5;
const CMD_ATTR_TIMEOUT_UDP: u16 = 6;

// Service attributes.
const SVC_ATTR_AF: u16 = 1;
const SVC_ATTR_PROTOCOL: u16 = 2;
const SVC_ATTR_ADDR: u16 = 3;
const SVC_ATTR_PORT: u16 = 4;
const SVC_ATTR_FWMARK: u16 = 5;
const SVC_ATTR_SCHED_NAME: u16 = 6;
const SVC_ATTR_FLAGS: u16 = 7;
const SVC_ATTR_TIMEOUT: u16 = 8;
const SVC_ATTR_NETMASK: u16 = 9;

// Destination attributes.
const DEST_ATTR_ADDR: u16 = 1;
const DEST_ATTR_PORT: u16 = 2;
const DEST_ATTR_FWD_METHOD: u16 = 3;
const DEST_ATTR_WEIGHT: u16 = 4;
const DEST_ATTR_U_THRESH: u16 = 5;
const DEST_ATTR_L_THRESH: u16 = 6;
const DEST_ATTR_ACTIVE_CONNS: u16 = 7;
const DEST_ATTR_INACT_CONNS: u16 = 8;
const DEST_ATTR_ADDR_FAMILY: u16 = 11;

/// `IP_VS_CONN_F_MASQ`: the real server is reached by destination NAT.
pub const FORWARD_MASQUERADE: u32 = 0;
/// `IP_VS_SVC_F_PERSISTENT`: a client sticks to its real server (session affinity).
pub const SERVICE_PERSISTENT: u32 = 0x1;
/// `IP_VS_SVC_F_HASHED`: set by the kernel on every service it lists; never ours to set.
const SERVICE_HASHED: u32 = 0x2;

const AF_INET: u16 = libc::AF_INET as u16;
const AF_INET6: u16 = libc::AF_INET6 as u16;

/// IPVS carries the protocol number in 16 bits.
fn protocol_number(protocol: Protocol) -> u16 {
    u16::from(protocol.number())
}

fn protocol_of(number: u16) -> Option<Protocol> {
    Protocol::from_number(u8::try_from(number).ok()?)
}

fn family_of(ip: IpAddr) -> u16 {
    if ip.is_ipv4() {
        AF_INET
    } else {
        AF_INET6
    }
}

/// An address as the kernel's `union nf_inet_addr`: 4 bytes for IPv4, 16 for IPv6 (the
/// kernel zero-fills what is not sent).
fn address_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

fn address_of(family: u16, bytes: &[u8]) -> Option<IpAddr> {
    match family {
        AF_INET => Some(IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(bytes.get(..4)?).ok()?))),
        AF_INET6 => Some(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(bytes.get(..16)?).ok()?))),
        _ => None,
    }
}

/// What identifies a virtual service: address, port and protocol (vipr uses no firewall-mark
/// services).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", std::net::SocketAddr::new(self.ip, self.port), self.protocol)
    }
}

/// How a virtual service schedules.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServiceSettings {
    pub scheduler: String,
    /// `IP_VS_SVC_F_*`, without the kernel's own `HASHED`.
    pub flags: u32,
    /// Persistence timeout in seconds (with [`SERVICE_PERSISTENT`]).
    pub timeout: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VirtualServer {
    pub key: ServiceKey,
    pub settings: ServiceSettings,
}

/// A real server of a virtual service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Destination {
    pub ip: IpAddr,
    pub port: u16,
    pub weight: u32,
    /// Connections the kernel tracks to it (read only).
    pub active_connections: u32,
    pub inactive_connections: u32,
}

impl Destination {
    pub fn new(ip: IpAddr, port: u16, weight: u32) -> Self {
        Self { ip, port, weight, active_connections: 0, inactive_connections: 0 }
    }
}

/// The nested service attributes identifying `key` (enough for delete, get and listing its
/// destinations).
pub fn service_identity(key: &ServiceKey) -> Attributes {
    let mut attributes = Attributes::new();
    attributes
        .put_u16(SVC_ATTR_AF, family_of(key.ip))
        .put_u16(SVC_ATTR_PROTOCOL, protocol_number(key.protocol))
        .put(SVC_ATTR_ADDR, &address_bytes(key.ip))
        .put_be16(SVC_ATTR_PORT, key.port);
    attributes
}

/// The nested service attributes of a full service (new and set need all of them).
pub fn service_full(server: &VirtualServer) -> Attributes {
    let mut attributes = service_identity(&server.key);
    let mut flags = Vec::with_capacity(8);
    flags.extend_from_slice(&server.settings.flags.to_ne_bytes());
    flags.extend_from_slice(&u32::MAX.to_ne_bytes());
    let netmask = if server.key.ip.is_ipv4() { u32::MAX } else { 128 };
    attributes
        .put_str(SVC_ATTR_SCHED_NAME, &server.settings.scheduler)
        .put(SVC_ATTR_FLAGS, &flags)
        .put_u32(SVC_ATTR_TIMEOUT, server.settings.timeout)
        .put_u32(SVC_ATTR_NETMASK, netmask);
    attributes
}

/// The nested destination attributes (all of them: new and set need them).
pub fn destination_full(destination: &Destination) -> Attributes {
    let mut attributes = Attributes::new();
    attributes
        .put(DEST_ATTR_ADDR, &address_bytes(destination.ip))
        .put_be16(DEST_ATTR_PORT, destination.port)
        .put_u32(DEST_ATTR_FWD_METHOD, FORWARD_MASQUERADE)
        .put_u32(DEST_ATTR_WEIGHT, destination.weight)
        .put_u32(DEST_ATTR_U_THRESH, 0)
        .put_u32(DEST_ATTR_L_THRESH, 0)
        .put_u16(DEST_ATTR_ADDR_FAMILY, family_of(destination.ip));
    attributes
}

fn destination_identity(destination: &Destination) -> Attributes {
    let mut attributes = Attributes::new();
    attributes
        .put(DEST_ATTR_ADDR, &address_bytes(destination.ip))
        .put_be16(DEST_ATTR_PORT, destination.port)
        .put_u16(DEST_ATTR_ADDR_FAMILY, family_of(destination.ip));
    attributes
}

/// The message attributes of a service command.
pub fn service_message(service: Attributes) -> Attributes {
    let mut attributes = Attributes::new();
    attributes.put_nested(CMD_ATTR_SERVICE, &service);
    attributes
}

/// The message attributes of a destination command.
pub fn destination_message(key: &ServiceKey, destination: Attributes) -> Attributes {
    let mut attributes = Attributes::new();
    attributes.put_nested(CMD_ATTR_SERVICE, &service_identity(key)).put_nested(CMD_ATTR_DEST, &destination);
    attributes
}

fn find<'a>(attributes: &[Attribute<'a>], kind: u16) -> Option<Attribute<'a>> {
    attributes.iter().copied().find(|attribute| attribute.kind == kind)
}

/// A service from one answer of a service dump; `None` for services vipr does not manage
/// (firewall-mark services, unknown protocols).
pub fn parse_service(message: &[u8]) -> Option<VirtualServer> {
    let top: Vec<_> = parse_attributes(message).collect();
    let service: Vec<_> = find(&top, CMD_ATTR_SERVICE)?.nested().collect();
    if find(&service, SVC_ATTR_FWMARK).and_then(|mark| mark.u32()).is_some_and(|mark| mark != 0) {
        return None;
    }
    let family = find(&service, SVC_ATTR_AF)?.u16()?;
    let ip = address_of(family, find(&service, SVC_ATTR_ADDR)?.payload)?;
    let protocol = protocol_of(find(&service, SVC_ATTR_PROTOCOL)?.u16()?)?;
    let port = find(&service, SVC_ATTR_PORT)?.be16()?;
    let flags = find(&service, SVC_ATTR_FLAGS)
        .and_then(|flags| flags.u32())
        .map_or(0, |flags| flags & !SERVICE_HASHED);
    Some(VirtualServer {
        key: ServiceKey { ip, port, protocol },
        settings: ServiceSettings {
            scheduler: find(&service, SVC_ATTR_SCHED_NAME)
                .and_then(|name| name.str())
                .unwrap_or("")
                .to_owned(),
            flags,
            timeout: find(&service, SVC_ATTR_TIMEOUT).and_then(|timeout| timeout.u32()).unwrap_or(0),
        },
    })
}

/// A destination from one answer of a destination dump of the service at `service_ip`.
pub fn parse_destination(message: &[u8], service_ip: IpAddr) -> Option<Destination> {
    let top: Vec<_> = parse_attributes(message).collect();
    let dest: Vec<_> = find(&top, CMD_ATTR_DEST)?.nested().collect();
    let family =
        find(&dest, DEST_ATTR_ADDR_FAMILY).and_then(|family| family.u16()).unwrap_or(family_of(service_ip));
    let u32_of = |kind| find(&dest, kind).and_then(|attribute| attribute.u32()).unwrap_or(0);
    Some(Destination {
        ip: address_of(family, find(&dest, DEST_ATTR_ADDR)?.payload)?,
        port: find(&dest, DEST_ATTR_PORT)?.be16()?,
        weight: u32_of(DEST_ATTR_WEIGHT),
        active_connections: u32_of(DEST_ATTR_ACTIVE_CONNS),
        inactive_connections: u32_of(DEST_ATTR_INACT_CONNS),
    })
}

/// Connection timeouts of IPVS (`ipvsadm --set`); zero leaves a value as it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timeouts {
    pub tcp: u32,
    pub tcp_fin: u32,
    pub udp: u32,
}

pub fn timeouts_message(timeouts: &Timeouts) -> Attributes {
    let mut attributes = Attributes::new();
    attributes
        .put_u32(CMD_ATTR_TIMEOUT_TCP, timeouts.tcp)
        .put_u32(CMD_ATTR_TIMEOUT_TCP_FIN, timeouts.tcp_fin)
        .put_u32(CMD_ATTR_TIMEOUT_UDP, timeouts.udp);
    attributes
}

/// An IPVS error, with what was being done.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct IpvsError {
    pub what: String,
    #[source]
    pub source: io::Error,
}

impl IpvsError {
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}

fn context<T>(result: io::Result<T>, what: impl FnOnce() -> String) -> Result<T, IpvsError> {
    result.map_err(|source| IpvsError { what: what(), source })
}

/// The kernel's IPVS in the current network namespace.
#[derive(Debug)]
pub struct Ipvs {
    family: GenericFamily,
}

impl Ipvs {
    /// Opens IPVS; the kernel loads `ip_vs` on demand where it can. `ENOENT` means this
    /// kernel has no IPVS.
    pub fn open() -> Result<Self, IpvsError> {
        let family = context(GenericFamily::resolve(FAMILY_NAME, FAMILY_VERSION), || {
            "cannot find the IPVS generic netlink family (does this kernel have CONFIG_IP_VS?)".to_owned()
        })?;
        Ok(Self { family })
    }

    /// Every virtual service (but firewall-mark ones).
    pub fn services(&mut self) -> Result<Vec<VirtualServer>, IpvsError> {
        let answers = context(self.family.dump(CMD_GET_SERVICE, &Attributes::new()), || {
            "cannot list IPVS services".to_owned()
        })?;
        Ok(answers.iter().filter_map(|answer| parse_service(answer)).collect())
    }

    pub fn add_service(&mut self, server: &VirtualServer) -> Result<(), IpvsError> {
        context(self.family.command(CMD_NEW_SERVICE, &service_message(service_full(server))), || {
            format!("cannot add IPVS service {}", server.key)
        })
    }

    pub fn update_service(&mut self, server: &VirtualServer) -> Result<(), IpvsError> {
        context(self.family.command(CMD_SET_SERVICE, &service_message(service_full(server))), || {
            format!("cannot update IPVS service {}", server.key)
        })
    }

    pub fn delete_service(&mut self, key: &ServiceKey) -> Result<(), IpvsError> {
        context(self.family.command(CMD_DEL_SERVICE, &service_message(service_identity(key))), || {
            format!("cannot delete IPVS service {key}")
        })
    }

    pub fn destinations(&mut self, key: &ServiceKey) -> Result<Vec<Destination>, IpvsError> {
        let answers =
            context(self.family.dump(CMD_GET_DEST, &service_message(service_identity(key))), || {
                format!("cannot list the real servers of IPVS service {key}")
            })?;
        Ok(answers.iter().filter_map(|answer| parse_destination(answer, key.ip)).collect())
    }

    pub fn add_destination(&mut self, key: &ServiceKey, destination: &Destination) -> Result<(), IpvsError> {
        context(
            self.family.command(CMD_NEW_DEST, &destination_message(key, destination_full(destination))),
            || format!("cannot add real server {} to IPVS service {key}", backend(destination)),
        )
    }

    pub fn update_destination(
        &mut self,
        key: &ServiceKey,
        destination: &Destination,
    ) -> Result<(), IpvsError> {
        context(
            self.family.command(CMD_SET_DEST, &destination_message(key, destination_full(destination))),
            || format!("cannot update real server {} of IPVS service {key}", backend(destination)),
        )
    }

    pub fn delete_destination(
        &mut self,
        key: &ServiceKey,
        destination: &Destination,
    ) -> Result<(), IpvsError> {
        context(
            self.family.command(CMD_DEL_DEST, &destination_message(key, destination_identity(destination))),
            || format!("cannot delete real server {} of IPVS service {key}", backend(destination)),
        )
    }

    pub fn set_timeouts(&mut self, timeouts: &Timeouts) -> Result<(), IpvsError> {
        context(self.family.command(CMD_SET_CONFIG, &timeouts_message(timeouts)), || {
            "cannot set the IPVS timeouts".to_owned()
        })
    }

    /// The current timeouts.
    pub fn timeouts(&mut self) -> Result<Timeouts, IpvsError> {
        let answers = context(
            self.family.socket.request(
                self.family.id,
                0,
                &genl_payload(CMD_GET_CONFIG, FAMILY_VERSION, &Attributes::new()),
            ),
            || "cannot read the IPVS timeouts".to_owned(),
        )?;
        let mut timeouts = Timeouts::default();
        for answer in answers.iter().filter(|answer| answer.kind == self.family.id) {
            for attribute in parse_attributes(answer.payload.get(4..).unwrap_or_default()) {
                let value = attribute.u32().unwrap_or(0);
                match attribute.kind {
                    CMD_ATTR_TIMEOUT_TCP => timeouts.tcp = value,
                    CMD_ATTR_TIMEOUT_TCP_FIN => timeouts.tcp_fin = value,
                    CMD_ATTR_TIMEOUT_UDP => timeouts.udp = value,
                    _ => {}
                }
            }
        }
        Ok(timeouts)
    }

    /// Removes every virtual service.
    pub fn flush(&mut self) -> Result<(), IpvsError> {
        context(self.family.command(CMD_FLUSH, &Attributes::new()), || "cannot flush IPVS".to_owned())
    }
}

fn backend(destination: &Destination) -> std::net::SocketAddr {
    std::net::SocketAddr::new(destination.ip, destination.port)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::NLA_F_NESTED;

    fn key() -> ServiceKey {
        ServiceKey { ip: "10.96.0.10".parse().unwrap(), port: 80, protocol: Protocol::Tcp }
    }

    fn attribute(kind: u16, payload: &[u8]) -> Vec<u8> {
        Attributes::new().put(kind, payload).bytes().to_vec()
    }

    #[test]
    fn a_new_service_is_encoded_as_the_kernel_expects() {
        let server = VirtualServer {
            key: key(),
            settings: ServiceSettings { scheduler: "rr".into(), flags: SERVICE_PERSISTENT, timeout: 10800 },
        };
        let message = service_message(service_full(&server));
        let bytes = message.bytes();
        // One nested SERVICE attribute holding the rest.
        assert_eq!(u16::from_ne_bytes([bytes[2], bytes[3]]), CMD_ATTR_SERVICE | NLA_F_NESTED);
        assert_eq!(usize::from(u16::from_ne_bytes([bytes[0], bytes[1]])), bytes.len());
        let flags: Vec<u8> = [1u32.to_ne_bytes(), u32::MAX.to_ne_bytes()].concat();
        let expected: Vec<u8> = [
            attribute(SVC_ATTR_AF, &2u16.to_ne_bytes()),
            attribute(SVC_ATTR_PROTOCOL, &6u16.to_ne_bytes()),
            attribute(SVC_ATTR_ADDR, &[10, 96, 0, 10]),
            attribute(SVC_ATTR_PORT, &[0, 80]),
            attribute(SVC_ATTR_SCHED_NAME, b"rr\0"),
            attribute(SVC_ATTR_FLAGS, &flags),
            attribute(SVC_ATTR_TIMEOUT, &10800u32.to_ne_bytes()),
            attribute(SVC_ATTR_NETMASK, &u32::MAX.to_ne_bytes()),
        ]
        .concat();
        assert_eq!(&bytes[4..], expected);
    }

    #[test]
    fn ipv6_services_carry_sixteen_bytes_and_a_prefix_length() {
        let server = VirtualServer {
            key: ServiceKey { ip: "fd00::10".parse().unwrap(), port: 53, protocol: Protocol::Udp },
            settings: ServiceSettings { scheduler: "wrr".into(), flags: 0, timeout: 0 },
        };
        let service = service_full(&server);
        let attributes: Vec<_> = parse_attributes(service.bytes()).collect();
        assert_eq!(find(&attributes, SVC_ATTR_AF).unwrap().u16(), Some(10));
        assert_eq!(find(&attributes, SVC_ATTR_PROTOCOL).unwrap().u16(), Some(17));
        assert_eq!(find(&attributes, SVC_ATTR_ADDR).unwrap().payload.len(), 16);
        assert_eq!(find(&attributes, SVC_ATTR_NETMASK).unwrap().u32(), Some(128));
    }

    #[test]
    fn destinations_are_masqueraded_real_servers() {
        let destination = Destination::new("10.1.0.2".parse().unwrap(), 8080, 1);
        let message = destination_message(&key(), destination_full(&destination));
        let top: Vec<_> = parse_attributes(message.bytes()).collect();
        assert_eq!(top.len(), 2);
        let service: Vec<_> = top[0].nested().collect();
        assert_eq!(find(&service, SVC_ATTR_PORT).unwrap().payload, [0, 80]);
        assert!(find(&service, SVC_ATTR_SCHED_NAME).is_none(), "only the identity");
        let dest: Vec<_> = top[1].nested().collect();
        assert_eq!(find(&dest, DEST_ATTR_ADDR).unwrap().payload, [10, 1, 0, 2]);
        assert_eq!(find(&dest, DEST_ATTR_PORT).unwrap().payload, 8080u16.to_be_bytes());
        assert_eq!(find(&dest, DEST_ATTR_FWD_METHOD).unwrap().u32(), Some(FORWARD_MASQUERADE));
        assert_eq!(find(&dest, DEST_ATTR_WEIGHT).unwrap().u32(), Some(1));
        for required in [DEST_ATTR_U_THRESH, DEST_ATTR_L_THRESH] {
            assert_eq!(find(&dest, required).unwrap().u32(), Some(0));
        }
    }

    /// A dump answer as the kernel writes it: the address always 16 bytes, flags with
    /// HASHED, statistics nested.
    #[test]
    fn dumped_services_and_destinations_parse() {
        let mut address = [0u8; 16];
        address[..4].copy_from_slice(&[10, 96, 0, 10]);
        let flags: Vec<u8> =
            [(SERVICE_PERSISTENT | SERVICE_HASHED).to_ne_bytes(), u32::MAX.to_ne_bytes()].concat();
        let mut service = Attributes::new();
        service
            .put_u16(SVC_ATTR_AF, 2)
            .put_u16(SVC_ATTR_PROTOCOL, 17)
            .put(SVC_ATTR_ADDR, &address)
            .put_be16(SVC_ATTR_PORT, 53)
            .put_str(SVC_ATTR_SCHED_NAME, "sh")
            .put(SVC_ATTR_FLAGS, &flags)
            .put_u32(SVC_ATTR_TIMEOUT, 60)
            .put_nested(10, Attributes::new().put_u32(1, 5));
        let parsed = parse_service(service_message(service).bytes()).unwrap();
        assert_eq!(
            parsed.key,
            ServiceKey { ip: "10.96.0.10".parse().unwrap(), port: 53, protocol: Protocol::Udp }
        );
        assert_eq!(
            parsed.settings,
            ServiceSettings { scheduler: "sh".into(), flags: SERVICE_PERSISTENT, timeout: 60 }
        );

        let mut dest = Attributes::new();
        dest.put(DEST_ATTR_ADDR, &address)
            .put_be16(DEST_ATTR_PORT, 5353)
            .put_u32(DEST_ATTR_FWD_METHOD, 0)
            .put_u32(DEST_ATTR_WEIGHT, 0)
            .put_u32(DEST_ATTR_ACTIVE_CONNS, 3)
            .put_u32(DEST_ATTR_INACT_CONNS, 4)
            .put_u16(DEST_ATTR_ADDR_FAMILY, 2);
        let mut message = Attributes::new();
        message.put_nested(CMD_ATTR_DEST, &dest);
        let parsed = parse_destination(message.bytes(), "10.96.0.10".parse().unwrap()).unwrap();
        assert_eq!(
            parsed,
            Destination {
                ip: "10.96.0.10".parse().unwrap(),
                port: 5353,
                weight: 0,
                active_connections: 3,
                inactive_connections: 4
            }
        );
    }

    #[test]
    fn firewall_mark_services_are_not_ours() {
        let mut service = Attributes::new();
        service.put_u16(SVC_ATTR_AF, 2).put_u16(SVC_ATTR_PROTOCOL, 6).put_u32(SVC_ATTR_FWMARK, 7);
        assert_eq!(parse_service(service_message(service).bytes()), None);
    }

    #[test]
    fn timeouts_are_three_top_level_u32s() {
        let bytes = timeouts_message(&Timeouts { tcp: 900, tcp_fin: 120, udp: 300 }).into_bytes();
        let attributes: Vec<_> = parse_attributes(&bytes).map(|a| (a.kind, a.u32().unwrap())).collect();
        assert_eq!(attributes, [(4, 900), (5, 120), (6, 300)]);
    }
}
