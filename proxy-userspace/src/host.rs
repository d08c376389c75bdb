//! Facts about the node vipr runs on, read from the kernel of its network namespace.
use std::{
    ffi::CStr,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

/// One address of one interface, in the order the kernel lists them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterfaceAddress {
    pub interface: String,
    pub ip: IpAddr,
}

/// Every IPv4 and IPv6 address of every interface of the current network namespace.
pub fn interface_addresses() -> io::Result<Vec<InterfaceAddress>> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list we free below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut addresses = Vec::new();
    let mut entry = list;
    while !entry.is_null() {
        // SAFETY: entry is a node of the list getifaddrs returned; its fields are valid
        // pointers or null.
        unsafe {
            let ifaddr = &*entry;
            if let Some(ip) = socket_address(ifaddr.ifa_addr) {
                let interface = CStr::from_ptr(ifaddr.ifa_name).to_string_lossy().into_owned();
                addresses.push(InterfaceAddress { interface, ip });
            }
            entry = ifaddr.ifa_next;
        }
    }
    // SAFETY: list came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    Ok(addresses)
}

/// # Safety
/// `address` must be null or point to a sockaddr of the length its family implies.
unsafe fn socket_address(address: *const libc::sockaddr) -> Option<IpAddr> {
    if address.is_null() {
        return None;
    }
    match i32::from(unsafe { (*address).sa_family }) {
        libc::AF_INET => {
            let v4 = unsafe { &*address.cast::<libc::sockaddr_in>() };
            Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr))))
        }
        libc::AF_INET6 => {
            let v6 = unsafe { &*address.cast::<libc::sockaddr_in6>() };
            Some(IpAddr::V6(Ipv6Addr::from(v6.sin6_addr.s6_addr)))
        }
        _ => None,
    }
}

/// One network interface of the current network namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// The index of the device it is enslaved to (a bridge's port: the bridge), if any.
    pub master: Option<u32>,
}

impl Link {
    /// The name of this link's master among `links`.
    pub fn master_name<'a>(&self, links: &'a [Link]) -> Option<&'a str> {
        let master = self.master?;
        links.iter().find(|link| link.index == master).map(|link| link.name.as_str())
    }
}

/// `RTM_GETLINK`/`RTM_NEWLINK` and the attributes read from its answers (linux/rtnetlink.h,
/// linux/if_link.h).
const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const IFLA_IFNAME: u16 = 3;
const IFLA_MASTER: u16 = 10;
/// `struct ifinfomsg`: family, pad, type, index, flags, change.
const IFINFOMSG_LEN: usize = 16;

/// Every interface of the current network namespace, with its master (rtnetlink: the
/// namespace of the calling thread, unlike /sys/class/net after setns()).
pub fn links() -> io::Result<Vec<Link>> {
    use crate::netlink::Socket;
    let mut socket = Socket::open(libc::NETLINK_ROUTE)?;
    let mut request = vec![0u8; IFINFOMSG_LEN];
    request[0] = libc::AF_UNSPEC as u8;
    let answers = socket.dump(RTM_GETLINK, &request)?;
    Ok(answers
        .iter()
        .filter(|answer| answer.kind == RTM_NEWLINK)
        .filter_map(|answer| parse_link(&answer.payload))
        .collect())
}

/// A link from an `RTM_NEWLINK` payload; `None` if it is malformed or has no name.
fn parse_link(payload: &[u8]) -> Option<Link> {
    use crate::netlink::parse_attributes;
    let index = u32::from_ne_bytes(payload.get(4..8)?.try_into().ok()?);
    let mut name = None;
    let mut master = None;
    for attribute in parse_attributes(payload.get(IFINFOMSG_LEN..)?) {
        match attribute.kind {
            IFLA_IFNAME => name = attribute.str().map(str::to_owned),
            IFLA_MASTER => master = attribute.u32().filter(|master| *master != 0),
            _ => {}
        }
    }
    Some(Link { index, name: name?, master })
}

/// The devices to serve: the listed ones, or every interface of this network namespace but
/// loopback.
pub fn devices(listed: &[String]) -> io::Result<Vec<String>> {
    if !listed.is_empty() {
        return Ok(listed.to_vec());
    }
    // if_nameindex asks the kernel about the current namespace; /sys/class/net would show
    // the namespace sysfs was mounted in, which differs after setns().
    // SAFETY: no preconditions; the list is freed below.
    let list = unsafe { libc::if_nameindex() };
    if list.is_null() {
        return Err(io::Error::last_os_error());
    }
    let mut devices = Vec::new();
    let mut entry = list;
    // SAFETY: the list ends with an entry whose index is 0 and every name is a C string.
    unsafe {
        while (*entry).if_index != 0 {
            let name = CStr::from_ptr((*entry).if_name).to_string_lossy().into_owned();
            if name != "lo" {
                devices.push(name);
            }
            entry = entry.add(1);
        }
        libc::if_freenameindex(list);
    }
    devices.sort();
    Ok(devices)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_listed_with_their_index() {
        let links = links().unwrap();
        assert!(
            links.iter().any(|link| link.name == "lo" && link.index == 1 && link.master.is_none()),
            "{links:?}"
        );
    }

    #[test]
    fn a_link_message_gives_name_and_master() {
        use crate::netlink::Attributes;
        let mut payload = vec![0u8; IFINFOMSG_LEN];
        payload[4..8].copy_from_slice(&7u32.to_ne_bytes());
        let mut attributes = Attributes::new();
        attributes.put_str(IFLA_IFNAME, "veth1").put_u32(IFLA_MASTER, 3);
        payload.extend_from_slice(attributes.bytes());
        let link = parse_link(&payload).unwrap();
        assert_eq!(link, Link { index: 7, name: "veth1".into(), master: Some(3) });
        let bridge = Link { index: 3, name: "cbr0".into(), master: None };
        assert_eq!(link.master_name(&[bridge.clone(), link.clone()]), Some("cbr0"));
        assert_eq!(bridge.master_name(std::slice::from_ref(&bridge)), None);
        assert_eq!(parse_link(&payload[..IFINFOMSG_LEN]), None, "no name");
    }

    #[test]
    fn loopback_is_listed() {
        let addresses = interface_addresses().unwrap();
        assert!(
            addresses.iter().any(|address| address.interface == "lo" && address.ip == Ipv4Addr::LOCALHOST),
            "{addresses:?}"
        );
    }
}
