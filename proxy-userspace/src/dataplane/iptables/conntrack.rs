//! Deleting stale UDP conntrack entries over ctnetlink (`NETLINK_NETFILTER`, the interface the
//! `conntrack` tool uses), without the tool, on vipr's netlink client (`crate::netlink`).
//!
//! A UDP "connection" lives in conntrack as long as datagrams keep coming, and its NAT was
//! decided by its first packet: a client that keeps sending to a service keeps reaching an
//! endpoint that is gone, or keeps being routed past a service that has since appeared. As
//! kube-proxy does, after rules change vipr deletes the entries whose original destination is a
//! UDP frontend and whose reply source is no longer one of that frontend's endpoints (for a
//! frontend that is gone: every entry to it).
use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use crate::netlink::{nfgenmsg, nfnl_type, parse_attributes, Attributes, NETLINK_NETFILTER};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_ZONE: u16 = 18;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;

pub const IPPROTO_UDP: u8 = 17;

/// The address and port of one direction's tuple.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tuple {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub protocol: u8,
}

/// One conntrack entry, with what is needed to delete it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub original: Tuple,
    pub reply: Tuple,
    /// The original tuple attribute as the kernel sent it (its payload), to name the entry
    /// when deleting.
    original_raw: Vec<u8>,
    zone: Option<[u8; 2]>,
}

/// For each UDP frontend to clean, the reply sources (endpoints) that may stay; an entry to a
/// frontend whose reply source is not among them is deleted.
pub type Keep = BTreeMap<SocketAddr, BTreeSet<SocketAddr>>;

/// UDP frontends (address and port) with the endpoints their packets may be sent to.
pub type UdpFrontends = BTreeMap<SocketAddr, BTreeSet<SocketAddr>>;

/// The UDP frontends whose conntrack entries may be stale after a sync from `before` to
/// `after`, with the endpoints their entries may keep: frontends that lost endpoints, that
/// have endpoints now and had none (or did not exist: until now their packets were routed
/// past the service), and frontends that are gone (no entry may stay). UDP has no connection
/// end, so without this a client that keeps sending would stay on a removed endpoint (or on
/// the path past the service) for as long as it keeps sending (kube-proxy's
/// `CleanStaleEntries`). Used by the iptables and the IPVS dataplanes.
pub fn stale_udp(before: &UdpFrontends, after: &UdpFrontends) -> Keep {
    let mut keep = Keep::new();
    for (frontend, now) in after {
        let stale = match before.get(frontend) {
            Some(then) => !then.is_subset(now) || (then.is_empty() && !now.is_empty()),
            None => !now.is_empty(),
        };
        if stale {
            keep.insert(*frontend, now.clone());
        }
    }
    for frontend in before.keys().filter(|frontend| !after.contains_key(*frontend)) {
        keep.insert(*frontend, BTreeSet::new());
    }
    keep
}

/// Deletes the UDP entries of `keep`'s frontends whose reply source is not kept. Returns how
/// many were deleted.
pub fn delete_stale_udp(keep: &Keep) -> io::Result<usize> {
    stale_entries(keep, true)
}

/// How many UDP entries [`delete_stale_udp`] would delete now (tests check with it that a
/// sync left none).
pub fn count_stale_udp(keep: &Keep) -> io::Result<usize> {
    stale_entries(keep, false)
}

/// Every entry of the conntrack table, both families (`vipr inspect flows` in the iptables
/// and ipvs modes).
pub fn entries() -> io::Result<Vec<Entry>> {
    let mut socket = Socket::open()?;
    let mut entries = socket.dump(libc::AF_INET as u8)?;
    entries.extend(socket.dump(libc::AF_INET6 as u8)?);
    Ok(entries)
}

fn stale_entries(keep: &Keep, delete: bool) -> io::Result<usize> {
    let mut found = 0;
    let mut socket = Socket::open()?;
    for family in [libc::AF_INET, libc::AF_INET6] {
        if !keep.keys().any(|frontend| frontend.is_ipv4() == (family == libc::AF_INET)) {
            continue;
        }
        for entry in socket.dump(family as u8)?.iter().filter(|entry| is_stale(entry, keep)) {
            if !delete {
                found += 1;
                continue;
            }
            match socket.delete(family as u8, entry) {
                Ok(()) => found += 1,
                // Gone meanwhile (timed out, or deleted by someone else).
                Err(error) if error.raw_os_error() == Some(libc::ENOENT) => {}
                Err(error) => return Err(error),
            }
        }
    }
    Ok(found)
}

pub fn is_stale(entry: &Entry, keep: &Keep) -> bool {
    entry.original.protocol == IPPROTO_UDP
        && keep.get(&entry.original.dst).is_some_and(|endpoints| !endpoints.contains(&entry.reply.src))
}

/// A ctnetlink socket: requests carry an `nfgenmsg` (family, version 0, resource id 0).
struct Socket(crate::netlink::Socket);

fn ctnetlink_payload(family: u8, attributes: &Attributes) -> Vec<u8> {
    let mut payload = nfgenmsg(family, 0).to_vec();
    payload.extend_from_slice(attributes.bytes());
    payload
}

impl Socket {
    fn open() -> io::Result<Self> {
        crate::netlink::Socket::open(NETLINK_NETFILTER).map(Self)
    }

    fn dump(&mut self, family: u8) -> io::Result<Vec<Entry>> {
        let kind = nfnl_type(NFNL_SUBSYS_CTNETLINK, IPCTNL_MSG_CT_GET);
        let replies = self.0.dump(kind, &ctnetlink_payload(family, &Attributes::new()))?;
        Ok(replies.iter().filter_map(|reply| parse_entry(reply.payload.get(4..)?)).collect())
    }

    fn delete(&mut self, family: u8, entry: &Entry) -> io::Result<()> {
        let mut attributes = Attributes::new();
        attributes.put_nested(CTA_TUPLE_ORIG, &Attributes::from_bytes(entry.original_raw.clone()));
        if let Some(zone) = entry.zone {
            attributes.put(CTA_ZONE, &zone);
        }
        let kind = nfnl_type(NFNL_SUBSYS_CTNETLINK, IPCTNL_MSG_CT_DELETE);
        self.0.request(kind, 0, &ctnetlink_payload(family, &attributes)).map(drop)
    }
}

/// Netlink attributes: (type without flags, payload).
fn attributes(data: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    parse_attributes(data).map(|attribute| (attribute.kind, attribute.payload))
}

pub fn parse_entry(data: &[u8]) -> Option<Entry> {
    let (mut original, mut reply, mut original_raw, mut zone) = (None, None, None, None);
    for (kind, payload) in attributes(data) {
        match kind {
            CTA_TUPLE_ORIG => {
                original = parse_tuple(payload);
                original_raw = Some(payload.to_vec());
            }
            CTA_TUPLE_REPLY => reply = parse_tuple(payload),
            CTA_ZONE if payload.len() >= 2 => zone = Some([payload[0], payload[1]]),
            _ => {}
        }
    }
    Some(Entry { original: original?, reply: reply?, original_raw: original_raw?, zone })
}

fn parse_tuple(data: &[u8]) -> Option<Tuple> {
    let (mut src, mut dst, mut protocol, mut sport, mut dport) = (None, None, None, 0, 0);
    for (kind, payload) in attributes(data) {
        match kind {
            CTA_TUPLE_IP => {
                for (kind, address) in attributes(payload) {
                    let ip = match (kind, address.len()) {
                        (CTA_IP_V4_SRC | CTA_IP_V4_DST, 4) => {
                            IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(address).ok()?))
                        }
                        (CTA_IP_V6_SRC | CTA_IP_V6_DST, 16) => {
                            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(address).ok()?))
                        }
                        _ => continue,
                    };
                    if matches!(kind, CTA_IP_V4_SRC | CTA_IP_V6_SRC) {
                        src = Some(ip);
                    } else {
                        dst = Some(ip);
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (kind, value) in attributes(payload) {
                    match (kind, value.len()) {
                        (CTA_PROTO_NUM, 1) => protocol = Some(value[0]),
                        (CTA_PROTO_SRC_PORT, 2) => sport = u16::from_be_bytes([value[0], value[1]]),
                        (CTA_PROTO_DST_PORT, 2) => dport = u16::from_be_bytes([value[0], value[1]]),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(Tuple { src: SocketAddr::new(src?, sport), dst: SocketAddr::new(dst?, dport), protocol: protocol? })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(kind: u16, parts: &[Vec<u8>]) -> Vec<u8> {
        Attributes::new().put_nested(kind, &Attributes::from_bytes(parts.concat())).bytes().to_vec()
    }

    fn attribute(kind: u16, payload: &[u8]) -> Vec<u8> {
        Attributes::new().put(kind, payload).bytes().to_vec()
    }

    fn tuple(kind: u16, src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16) -> Vec<u8> {
        nested(
            kind,
            &[
                nested(CTA_TUPLE_IP, &[attribute(CTA_IP_V4_SRC, &src), attribute(CTA_IP_V4_DST, &dst)]),
                nested(
                    CTA_TUPLE_PROTO,
                    &[
                        attribute(CTA_PROTO_NUM, &[IPPROTO_UDP]),
                        attribute(CTA_PROTO_SRC_PORT, &sport.to_be_bytes()),
                        attribute(CTA_PROTO_DST_PORT, &dport.to_be_bytes()),
                    ],
                ),
            ],
        )
    }

    #[test]
    fn entries_are_parsed_and_judged_by_frontend_and_reply_source() {
        // Client 10.0.0.2:5000 -> service 172.30.0.42:53, DNATed to 10.180.0.1:5353.
        let message = [
            tuple(CTA_TUPLE_ORIG, [10, 0, 0, 2], [172, 30, 0, 42], 5000, 53),
            tuple(CTA_TUPLE_REPLY, [10, 180, 0, 1], [10, 0, 0, 2], 5353, 5000),
            attribute(CTA_ZONE, &[0, 0]),
        ]
        .concat();
        let entry = parse_entry(&message).unwrap();
        assert_eq!(entry.original.dst, "172.30.0.42:53".parse().unwrap());
        assert_eq!(entry.reply.src, "10.180.0.1:5353".parse().unwrap());
        assert_eq!(entry.original.protocol, IPPROTO_UDP);
        assert_eq!(entry.zone, Some([0, 0]));

        let frontend: SocketAddr = "172.30.0.42:53".parse().unwrap();
        let keep = |endpoints: &[&str]| -> Keep {
            [(frontend, endpoints.iter().map(|e| e.parse().unwrap()).collect())].into_iter().collect()
        };
        assert!(!is_stale(&entry, &keep(&["10.180.0.1:5353"])));
        assert!(is_stale(&entry, &keep(&["10.180.0.2:5353"])), "the endpoint was removed");
        assert!(is_stale(&entry, &keep(&[])), "the frontend is gone");
        assert!(!is_stale(&entry, &Keep::new()), "another frontend's entries are left alone");
    }
}
