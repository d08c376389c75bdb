//! Which node ports masqueraded connections get (proxy-ebpf/src/route.rs).
//!
//! The TC program gives a masqueraded connection a node port by claiming its reply tuple in
//! the flows map, but the node's own sockets take ports from the ephemeral range
//! (`net.ipv4.ip_local_port_range`, for IPv6 too) without looking at that map. A port in both
//! could serve a node socket and a masqueraded connection to the same backend at once, and the
//! replies of one would go to the other. So the masquerade range is kept disjoint from the
//! ephemeral one: the agent reads the ephemeral range and writes the larger of the two gaps
//! around it (above the privileged ports) into `vipr_snat_v1`.
//!
//! Reserving ports with `net.ipv4.ip_local_reserved_ports` would do the same from the other
//! side, but it changes a node-wide setting other software owns too, and must be undone on
//! cleanup; reading the range changes nothing on the node.
use anyhow::Context as _;
use aya::{
    maps::{Array, MapData},
    Ebpf,
};
use proxy_common::{snat, SnatPorts};
use tracing::{info, warn};

const EPHEMERAL_RANGE: &str = "/proc/sys/net/ipv4/ip_local_port_range";
/// Ports below this are privileged: services listen there, clients do not come from there.
const FIRST_UNPRIVILEGED: u32 = 1024;
/// A gap smaller than this would make masqueraded connections to one backend fail after a
/// handful; the whole unprivileged range is used then, as before this range existed.
const MIN_PORTS: u32 = 4096;

/// The masquerade range in the map, following the node's ephemeral range.
pub struct SnatRange {
    map: Array<MapData, SnatPorts>,
    current: SnatPorts,
}

impl SnatRange {
    /// Writes the range for the node's current ephemeral range.
    pub fn start(ebpf: &mut Ebpf) -> anyhow::Result<Self> {
        let mut range = Self { map: super::take_map(ebpf, snat::PORTS)?, current: SnatPorts::default() };
        range.refresh();
        Ok(range)
    }

    /// Follows changes of the ephemeral range (cheap: one small file read). A failure keeps
    /// the previous range and is retried at the next sync.
    pub fn refresh(&mut self) {
        let ephemeral = match read_ephemeral_range() {
            Ok(ephemeral) => Some(ephemeral),
            Err(error) => {
                warn!("cannot read {EPHEMERAL_RANGE}: {error:#}; assuming Linux's default");
                None
            }
        };
        let wanted = masquerade_range(ephemeral);
        if wanted == self.current {
            return;
        }
        match self.map.set(0, wanted, 0) {
            Ok(()) => {
                let last = wanted.first + wanted.count - 1;
                match ephemeral {
                    Some((low, high)) if wanted.first <= high && last >= low => warn!(
                        ephemeral = %format!("{low}-{high}"),
                        "the ephemeral port range leaves too few ports: masquerade ports {}-{last} may \
                         collide with the node's own connections",
                        wanted.first
                    ),
                    _ => info!(first = wanted.first, last, "masquerade source ports"),
                }
                self.current = wanted;
            }
            Err(error) => warn!(%error, "cannot write {}", snat::PORTS),
        }
    }
}

fn read_ephemeral_range() -> anyhow::Result<(u32, u32)> {
    let text = std::fs::read_to_string(EPHEMERAL_RANGE)?;
    parse_ephemeral_range(&text).with_context(|| format!("unexpected contents {text:?}"))
}

fn parse_ephemeral_range(text: &str) -> Option<(u32, u32)> {
    let mut fields = text.split_whitespace().map(str::parse::<u32>);
    let (low, high) = (fields.next()?.ok()?, fields.next()?.ok()?);
    (fields.next().is_none() && low <= high && high <= 65_535).then_some((low, high))
}

/// The larger of the unprivileged gaps below and above `ephemeral`; with no ephemeral range
/// known, the default one's gap below.
fn masquerade_range(ephemeral: Option<(u32, u32)>) -> SnatPorts {
    let Some((low, high)) = ephemeral else {
        return SnatPorts { first: snat::DEFAULT_FIRST, count: snat::DEFAULT_COUNT };
    };
    let below = SnatPorts { first: FIRST_UNPRIVILEGED, count: low.saturating_sub(FIRST_UNPRIVILEGED) };
    let above_first = (high + 1).max(FIRST_UNPRIVILEGED);
    let above = SnatPorts { first: above_first, count: 65_536u32.saturating_sub(above_first) };
    let larger = if above.count > below.count { above } else { below };
    if larger.count >= MIN_PORTS {
        larger
    } else {
        SnatPorts { first: FIRST_UNPRIVILEGED, count: 65_536 - FIRST_UNPRIVILEGED }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_sysctl() {
        assert_eq!(parse_ephemeral_range("32768\t60999\n"), Some((32768, 60999)));
        assert_eq!(parse_ephemeral_range("1024 65535"), Some((1024, 65535)));
        assert_eq!(parse_ephemeral_range("60999 32768"), None);
        assert_eq!(parse_ephemeral_range("32768"), None);
        assert_eq!(parse_ephemeral_range("a b"), None);
        assert_eq!(parse_ephemeral_range("1 2 3"), None);
        assert_eq!(parse_ephemeral_range("1 70000"), None);
    }

    #[test]
    fn stays_clear_of_the_ephemeral_range() {
        // Linux's default: the gap below is larger.
        assert_eq!(masquerade_range(Some((32768, 60999))), SnatPorts { first: 1024, count: 31744 });
        // Ephemeral ports low: the gap above.
        assert_eq!(masquerade_range(Some((1024, 20000))), SnatPorts { first: 20001, count: 45535 });
        assert_eq!(masquerade_range(Some((10, 20000))), SnatPorts { first: 20001, count: 45535 });
        // No room: the whole unprivileged range (and a warning).
        assert_eq!(masquerade_range(Some((1024, 65535))), SnatPorts { first: 1024, count: 64512 });
        assert_eq!(masquerade_range(Some((2048, 65000))), SnatPorts { first: 1024, count: 64512 });
        assert_eq!(masquerade_range(None), SnatPorts { first: 1024, count: 31744 });
        for ephemeral in [(32768, 60999), (1024, 20000), (40000, 65535), (0, 0), (65535, 65535)] {
            let range = masquerade_range(Some(ephemeral));
            assert!(range.count > 0 && range.first + range.count <= 65_536, "{ephemeral:?}: {range:?}");
        }
    }
}
