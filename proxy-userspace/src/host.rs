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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_listed() {
        let addresses = interface_addresses().unwrap();
        assert!(
            addresses.iter().any(|address| address.interface == "lo" && address.ip == Ipv4Addr::LOCALHOST),
            "{addresses:?}"
        );
    }
}
