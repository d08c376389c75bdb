//! The dummy interface that holds the service addresses (kube-proxy's `kube-ipvs0`), over
//! rtnetlink. An address bound there is local to the node, so packets to it reach the INPUT
//! path where IPVS picks them up; the interface itself never carries traffic.
use std::{ffi::CString, io, net::IpAddr};

use crate::netlink::{Attributes, Socket, NLM_F_CREATE, NLM_F_EXCL};

/// kube-proxy's name for it, kept so that tools and habits carry over.
pub const DUMMY_INTERFACE: &str = "kube-ipvs0";

const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_NEWADDR: u16 = 20;
const RTM_DELADDR: u16 = 21;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_CACHEINFO: u16 = 6;

/// The interface index of `name`, if it exists in this network namespace.
pub fn index(name: &str) -> Option<u32> {
    let name = CString::new(name).ok()?;
    // SAFETY: a valid C string.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (index != 0).then_some(index)
}

/// `struct ifinfomsg` for `index` (0: none yet).
fn link_header(index: u32) -> Vec<u8> {
    let mut header = vec![0u8; 16];
    header[0] = libc::AF_UNSPEC as u8;
    header[4..8].copy_from_slice(&index.to_ne_bytes());
    header
}

/// The RTM_NEWLINK payload creating a dummy interface called `name`.
pub fn new_dummy_payload(name: &str) -> Vec<u8> {
    let mut info = Attributes::new();
    info.put_str(IFLA_INFO_KIND, "dummy");
    let mut attributes = Attributes::new();
    attributes.put_str(IFLA_IFNAME, name).put_nested(IFLA_LINKINFO, &info);
    let mut payload = link_header(0);
    payload.extend_from_slice(attributes.bytes());
    payload
}

/// The RTM_NEWADDR / RTM_DELADDR payload for `ip` as a host address (/32, /128) on
/// interface `index`.
pub fn address_payload(index: u32, ip: IpAddr) -> Vec<u8> {
    let (family, prefix, bytes) = match ip {
        IpAddr::V4(v4) => (libc::AF_INET as u8, 32, v4.octets().to_vec()),
        IpAddr::V6(v6) => (libc::AF_INET6 as u8, 128, v6.octets().to_vec()),
    };
    // struct ifaddrmsg: family, prefix length, flags, scope (universe), index.
    let mut payload = vec![family, prefix, 0, 0];
    payload.extend_from_slice(&index.to_ne_bytes());
    let mut attributes = Attributes::new();
    attributes.put(IFA_ADDRESS, &bytes);
    if ip.is_ipv4() {
        attributes.put(IFA_LOCAL, &bytes);
    } else {
        // Deprecated (preferred lifetime 0, valid forever): the node still accepts the
        // address, but IPv6 source address selection avoids it. Otherwise it would pick a
        // service address as the source of the node's own and masqueraded packets toward any
        // destination sharing a longer prefix with it than with the node's addresses.
        let mut cache_info = Vec::with_capacity(16);
        for value in [0, u32::MAX, 0, 0] {
            cache_info.extend_from_slice(&u32::to_ne_bytes(value));
        }
        attributes.put(IFA_CACHEINFO, &cache_info);
    }
    payload.extend_from_slice(attributes.bytes());
    payload
}

/// The dummy interface, created if missing; returns its index.
pub fn ensure_dummy(name: &str) -> io::Result<u32> {
    if let Some(index) = index(name) {
        return Ok(index);
    }
    let mut socket = Socket::open(libc::NETLINK_ROUTE)?;
    match socket.request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, &new_dummy_payload(name)) {
        Ok(_) => {}
        Err(error) if error.raw_os_error() == Some(libc::EEXIST) => {}
        Err(error) => return Err(error),
    }
    index(name)
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{name} vanished after creation")))
}

/// Deletes interface `name` if it exists.
pub fn delete_link(name: &str) -> io::Result<()> {
    let Some(index) = index(name) else { return Ok(()) };
    let mut socket = Socket::open(libc::NETLINK_ROUTE)?;
    match socket.request(RTM_DELLINK, 0, &link_header(index)) {
        Err(error) if error.raw_os_error() == Some(libc::ENODEV) => Ok(()),
        other => other.map(drop),
    }
}

/// Binds and unbinds host addresses on one interface.
#[derive(Debug)]
pub struct AddressBinder {
    socket: Socket,
}

impl AddressBinder {
    pub fn open() -> io::Result<Self> {
        Ok(Self { socket: Socket::open(libc::NETLINK_ROUTE)? })
    }

    pub fn add(&mut self, index: u32, ip: IpAddr) -> io::Result<()> {
        match self.socket.request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, &address_payload(index, ip)) {
            Err(error) if error.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            other => other.map(drop),
        }
    }

    pub fn remove(&mut self, index: u32, ip: IpAddr) -> io::Result<()> {
        match self.socket.request(RTM_DELADDR, 0, &address_payload(index, ip)) {
            Err(error) if matches!(error.raw_os_error(), Some(libc::EADDRNOTAVAIL | libc::ENOENT)) => Ok(()),
            other => other.map(drop),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::parse_attributes;

    #[test]
    fn a_dummy_link_is_named_and_kinded() {
        let payload = new_dummy_payload(DUMMY_INTERFACE);
        assert_eq!(&payload[..16], &[0u8; 16], "ifinfomsg: unspecified family, no index yet");
        let attributes: Vec<_> = parse_attributes(&payload[16..]).collect();
        assert_eq!(attributes[0].kind, IFLA_IFNAME);
        assert_eq!(attributes[0].str(), Some(DUMMY_INTERFACE));
        assert_eq!(attributes[1].kind, IFLA_LINKINFO);
        let info: Vec<_> = attributes[1].nested().collect();
        assert_eq!((info[0].kind, info[0].str()), (IFLA_INFO_KIND, Some("dummy")));
    }

    #[test]
    fn addresses_are_host_routes_on_the_interface() {
        let payload = address_payload(7, "10.96.0.10".parse().unwrap());
        assert_eq!(&payload[..4], &[2, 32, 0, 0]);
        assert_eq!(u32::from_ne_bytes(payload[4..8].try_into().unwrap()), 7);
        let attributes: Vec<_> =
            parse_attributes(&payload[8..]).map(|a| (a.kind, a.payload.to_vec())).collect();
        assert_eq!(attributes, [(IFA_ADDRESS, vec![10, 96, 0, 10]), (IFA_LOCAL, vec![10, 96, 0, 10])]);

        let payload = address_payload(7, "fd00::10".parse().unwrap());
        assert_eq!(&payload[..2], &[10, 128]);
        let attributes: Vec<_> = parse_attributes(&payload[8..]).collect();
        assert_eq!((attributes[0].kind, attributes[0].payload.len()), (IFA_ADDRESS, 16));
        assert_eq!(attributes[1].kind, IFA_CACHEINFO);
        assert_eq!(
            &attributes[1].payload[..8],
            &[[0u8; 4], u32::MAX.to_ne_bytes()].concat()[..],
            "deprecated"
        );
    }
}
