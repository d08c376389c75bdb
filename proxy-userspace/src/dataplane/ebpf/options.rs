//! The eBPF dataplane's options, which the agent's settings fill from flags and the
//! configuration file.
use std::time::Duration;

use clap::ValueEnum;
use proxy_common::dsr_accept;

use crate::model::{Frontend, FrontendEntry, FrontendKind};

/// `--xdp`: where the XDP fast path for traffic from outside the node runs.
///
/// `Default` is `Off`: a dataplane started without a word about XDP runs none (benchmarks
/// and tests opt in); the agent's settings give `Auto` when no `--xdp` is given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum XdpMode {
    /// No `--xdp` given: native, on the devices backed by hardware whose driver supports it;
    /// none elsewhere, and no generic fallback. Not a value of the flag: it names no mode of
    /// its own, and leaving the flag out says it.
    #[value(skip)]
    Auto,
    /// On every served device, in the driver; falls back to generic, then off, where the
    /// driver refuses.
    Native,
    /// On every served device, in the kernel's generic (skb) XDP path.
    Generic,
    /// No XDP: the TC program does everything.
    #[default]
    Off,
}

/// `--bpf-forwarding`: how the eBPF datapath hands on a packet it rewrote for another host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum BpfForwarding {
    /// Back into the kernel's stack, which routes it and runs netfilter's FORWARD and
    /// POSTROUTING chains on it, as behind kube-proxy: iptables-enforced NetworkPolicy applies.
    #[default]
    Stack,
    /// Straight to the next hop (`bpf_redirect_neigh`), and XDP where `--xdp` allows: faster,
    /// but bypasses netfilter's FORWARD and POSTROUTING chains, and so any NetworkPolicy
    /// enforced there (Calico's iptables dataplane, kube-router, ...).
    Redirect,
}

/// `--lb-mode`: how a NodePort, load-balancer or external-IP connection from outside reaches a
/// backend on another node (Cilium's `bpf-lb-mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LbMode {
    /// Source NAT to this node's address, as kube-proxy: the replies come back through it.
    #[default]
    Snat,
    /// Direct server return for TCP and UDP: the client's address kept, the service address
    /// carried to the backend's node in an IPv4 option (IPv6: a destination-options header),
    /// the replies sent from there straight to the client (docs/architecture/ebpf-datapath.md,
    /// "Direct server return").
    Dsr,
    /// Direct server return for TCP, source NAT for UDP and SCTP.
    Hybrid,
}

impl LbMode {
    /// Whether connections of `protocol` go by direct server return in this mode. SCTP never
    /// does: its associations' other addresses (multi-homing) would need the option too.
    pub fn direct_return(self, protocol: crate::model::Protocol) -> bool {
        use crate::model::Protocol;
        match self {
            Self::Snat => false,
            Self::Dsr => matches!(protocol, Protocol::Tcp | Protocol::Udp),
            Self::Hybrid => protocol == Protocol::Tcp,
        }
    }

    /// The protocols whose carried service address this node takes on a backend's side
    /// (`proxy_common::dsr_accept`): all or none as `--lb-dsr-accept` (`accept`) says, else
    /// those it sends by direct server return itself. A node with `snat` takes none by
    /// default, since the option is not authenticated (whoever sends a pod a request with it
    /// chooses the source address of the pod's replies).
    pub fn carriers_taken(self, accept: Option<bool>) -> u8 {
        use crate::model::Protocol;
        use proxy_common::dsr_accept;
        match accept {
            Some(true) => dsr_accept::TCP | dsr_accept::UDP,
            Some(false) => dsr_accept::NONE,
            None => [Protocol::Tcp, Protocol::Udp]
                .into_iter()
                .filter(|protocol| self.direct_return(*protocol))
                .fold(dsr_accept::NONE, |taken, protocol| taken | carrier_bit(protocol)),
        }
    }
}

/// How the node encodes its entries: the options of the agent that shape them.
#[derive(Clone, Copy, Debug)]
pub struct Modes {
    pub balancing: Balancing,
    /// What this node sends by direct server return.
    pub lb_mode: LbMode,
    /// The protocols whose carried service address this node takes (`dsr_accept` bits,
    /// [`LbMode::carriers_taken`]): their frontends get the entries the address is checked
    /// against.
    pub carriers_taken: u8,
}

impl Modes {
    /// The modes of a node with `--lb-mode=snat` (the default) and no `--lb-dsr-accept`.
    pub fn snat(balancing: Balancing) -> Self {
        Self { balancing, lb_mode: LbMode::Snat, carriers_taken: dsr_accept::NONE }
    }
}

/// Whether a frontend of `kind` goes by direct server return where `--lb-mode` says so: a
/// NodePort, load-balancer or external IP (for connections from outside it masquerades).
pub fn takes_direct_return(kind: FrontendKind) -> bool {
    matches!(kind, FrontendKind::NodePort | FrontendKind::LoadBalancer | FrontendKind::ExternalIp)
}

/// Whether a node that takes the carriers of `carriers_taken` (`dsr_accept` bits) has an entry
/// for `frontend`'s carried address: where ingress nodes may send it by direct server return
/// (a NodePort, load-balancer or external IP masqueraded from outside), whatever this node's
/// own `--lb-mode`.
pub fn has_carried_entry(frontend: &Frontend, entry: &FrontendEntry, carriers_taken: u8) -> bool {
    carriers_taken & carrier_bit(frontend.protocol) != 0
        && takes_direct_return(entry.kind)
        && entry.from_outside.masquerade
        && !frontend.ip.is_loopback()
}

/// The `proxy_common::dsr_accept` bit of `protocol`'s carriers (none for SCTP, which never goes
/// by direct server return).
pub fn carrier_bit(protocol: crate::model::Protocol) -> u8 {
    use crate::model::Protocol;
    use proxy_common::dsr_accept;
    match protocol {
        Protocol::Tcp => dsr_accept::TCP,
        Protocol::Udp => dsr_accept::UDP,
        Protocol::Sctp => dsr_accept::NONE,
    }
}

/// Capacities of the eBPF dataplane's largest maps (`--bpf-*-max`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BpfMapSizes {
    pub services: u32,
    pub backends: u32,
    pub flows: u32,
    /// The per-CPU counters map: (service port, backend) pairs.
    pub counters: u32,
    /// Each family's session-affinity map: remembered clients.
    pub affinity: u32,
    /// Each family's source-ranges trie.
    pub source_ranges: u32,
    /// Each family's unmatched-destinations trie.
    pub unmatched: u32,
}

impl Default for BpfMapSizes {
    fn default() -> Self {
        use proxy_common::capacity;
        Self {
            services: capacity::SERVICES,
            backends: capacity::BACKENDS,
            flows: capacity::FLOWS,
            counters: capacity::BACKEND_COUNTERS,
            affinity: capacity::AFFINITY,
            source_ranges: capacity::SOURCE_RANGES,
            unmatched: capacity::UNMATCHED,
        }
    }
}

/// When the eBPF datapath's connections expire, under kube-proxy's `--conntrack-*` names and
/// defaults (the file's `conntrack` section). kube-proxy sets the kernel's conntrack sysctls
/// with them; vipr's own connection tracking applies them to its flow entries, with the
/// kernel's defaults where kube-proxy's 0 means "leave the kernel's".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackTimeouts {
    /// Established TCP connections, idle.
    pub tcp_established: Duration,
    /// TCP connections with a FIN in one direction only (CLOSE_WAIT), idle.
    pub tcp_close_wait: Duration,
    /// TCP connections with a FIN both ways or an RST, idle: the kernel's CLOSE state (10 s)
    /// rather than TIME_WAIT (120 s), since the backend keeps its own TIME_WAIT. No flag.
    pub tcp_closed: Duration,
    /// TCP connections the backend never answered, idle: the kernel's SYN_SENT (120 s). Without
    /// it a SYN flood's entries would hold the flows map for a day: the map is not LRU, so as
    /// not to evict live connections.
    pub tcp_syn_sent: Duration,
    /// TCP connections the backend answered (SYN-ACK) whose client never completed the
    /// handshake, idle: the kernel's SYN_RECV (60 s). A spoofed SYN flood's entries end here.
    pub tcp_syn_recv: Duration,
    /// UDP flows never answered, or answered once (a DNS query and its answer): conntrack's
    /// UDP entries that are not ASSURED.
    pub udp: Duration,
    /// UDP streams: the client sent again after an answer.
    pub udp_stream: Duration,
    /// What changes when the flows map fills up.
    pub pressure: FlowPressure,
}

/// The flows map under pressure (a flood of new connections): above `threshold_percent` of its
/// capacity, the reaper runs more often and expires connections that are not established (TCP
/// without the client's ACK after the SYN-ACK, UDP that is no stream) after `timeout` idle
/// instead of their usual timeout, as Cilium's connection-tracking garbage collection does when
/// its table fills up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowPressure {
    /// `--conntrack-pressure-threshold`, 1 to 100.
    pub threshold_percent: u8,
    /// `--conntrack-pressure-timeout`.
    pub timeout: Duration,
}

impl Default for FlowPressure {
    fn default() -> Self {
        Self { threshold_percent: 75, timeout: Duration::from_secs(5) }
    }
}

impl Default for ConntrackTimeouts {
    fn default() -> Self {
        Self {
            tcp_established: Duration::from_secs(24 * 3600),
            tcp_close_wait: Duration::from_secs(3600),
            tcp_closed: Duration::from_secs(10),
            tcp_syn_sent: Duration::from_secs(120),
            tcp_syn_recv: Duration::from_secs(60),
            udp: Duration::from_secs(30),
            udp_stream: Duration::from_secs(120),
            pressure: FlowPressure::default(),
        }
    }
}

/// How a new connection's backend is chosen among a frontend's (`--lb-algorithm`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Balancing {
    /// Uniformly at random, as kube-proxy.
    #[default]
    Random,
    /// By the flow's hash in a Maglev table of this many slots (a prime, see
    /// [`super::maglev`]), so that every node picks the same backend for a flow.
    Maglev { table_size: u32 },
}

#[cfg(test)]
mod tests {
    use super::LbMode;
    use proxy_common::dsr_accept;

    #[test]
    fn a_node_takes_carried_service_addresses_only_for_what_it_sends_by_dsr() {
        assert_eq!(LbMode::Snat.carriers_taken(None), dsr_accept::NONE);
        assert_eq!(LbMode::Hybrid.carriers_taken(None), dsr_accept::TCP);
        assert_eq!(LbMode::Dsr.carriers_taken(None), dsr_accept::TCP | dsr_accept::UDP);
    }

    #[test]
    fn lb_dsr_accept_takes_all_or_none_whatever_the_mode() {
        for mode in [LbMode::Snat, LbMode::Hybrid, LbMode::Dsr] {
            assert_eq!(mode.carriers_taken(Some(true)), dsr_accept::TCP | dsr_accept::UDP, "{mode:?}");
            assert_eq!(mode.carriers_taken(Some(false)), dsr_accept::NONE, "{mode:?}");
        }
    }
}
