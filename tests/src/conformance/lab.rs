//! The network of one case: a node namespace with the recorded interfaces and addresses, an
//! upstream router behind its uplink, and one namespace per pod, endpoint and external client
//! address.
//!
//! ```text
//!   external clients ──ex*── router ──up0────eth0── node (vipr) ──lf*── pods, endpoints,
//!   (203.0.113.x, …)         (192.168.0.1,           (recorded          load-balancer-IP
//!                             fe80::2)                addresses)        sources
//! ```
//!
//! Leaves are wired the way routed CNIs (Calico) wire pods: the leaf owns its address as a /32
//! (/128) and routes everything via a link-local gateway; the center's end of the veth has
//! no IPv4 address of its own (proxy ARP answers for 169.254.1.1) and `fe80::1` for IPv6, and
//! a host route per leaf. So the node has exactly the recorded addresses, and a masqueraded
//! connection leaves with one of them.
//!
//! The router sends traffic from external clients to the node (its default route) and never
//! back: what arrives from the node goes to an external client or is answered with ICMP
//! unreachable, as the edge of a network would. A packet vipr should have intercepted thus
//! never comes back to the node's ingress by a detour, and ordinary routing always answers
//! (unreachable, or a reset from a node or leaf socket), so silence means a drop.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, ensure, Context, Result};

use super::case::{parse_cidr, IpFamily, Node, Protocol};
use crate::{cmd, left_by_dead_process, sctp, unique_name, BpfFs, EchoServer, Netns, Vipr, WorkDir};

/// The gateway address IPv4 leaves route through; answered by proxy ARP, owned by no one.
const LEAF_GATEWAY_V4: &str = "169.254.1.1";
/// The center's address on every leaf link, and the leaves' IPv6 gateway.
const CENTER_LINK_LOCAL: &str = "fe80::1";
/// The router's link-local address on the node's uplink: the node's IPv6 gateway.
const ROUTER_LINK_LOCAL: &str = "fe80::2";
/// The router's table for what comes from the node.
const FROM_NODE_TABLE: &str = "300";
/// A leaf's table for packets to its own address that must leave on the wire.
const SELF_ADDRESSED_TABLE: &str = "100";

/// Where an address lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    Node,
    Leaf(usize),
    Router,
}

/// Which namespace a leaf hangs off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Pods, endpoints and load-balancer-IP sources: a veth to the node.
    Node,
    /// External clients: a veth to the router.
    Router,
}

#[derive(Clone, Debug)]
pub struct LeafPlan {
    pub addr: IpAddr,
    pub side: Side,
    /// The leaf sends to its own address and that packet must leave on the wire (a client
    /// whose address is the load-balancer IP it connects to).
    pub self_addressed: bool,
}

/// What to build for a case.
#[derive(Clone, Debug)]
pub struct LabPlan {
    pub leaves: Vec<LeafPlan>,
    /// Every address the case mentions; helper addresses avoid them.
    pub case_addresses: BTreeSet<IpAddr>,
}

#[derive(Debug)]
struct Leaf {
    addr: IpAddr,
    netns: Netns,
}

/// One case's namespaces, servers and agent; dropping it removes all of it (agent first,
/// then servers, namespaces, the bpffs and the scratch directory).
#[derive(Debug)]
pub struct CaseLab {
    vipr: Option<Vipr>,
    servers: Vec<EchoServer>,
    sctp_servers: Vec<sctp::Server>,
    leaves: Vec<Leaf>,
    router: Netns,
    node: Netns,
    bpffs: BpfFs,
    workdir: WorkDir,
    /// Every address of the node namespace, loopback and link-local included.
    node_addresses: BTreeSet<IpAddr>,
    /// The node's interfaces but loopback: vipr's `--devices`.
    devices: Vec<String>,
    /// Who answers on a socket: server name by (address, protocol).
    listeners: BTreeMap<(SocketAddr, Protocol), String>,
}

/// Start of the names of every namespace, mount and directory of the runner.
pub const LABEL: &str = "vconf";

impl CaseLab {
    pub fn build(node: &Node, plan: &LabPlan) -> Result<Self> {
        remove_leftover_namespaces()?;
        let workdir = WorkDir::create(LABEL)?;
        let bpffs = BpfFs::mount(LABEL)?;
        let prefix = unique_name(LABEL);
        let node_ns = namespace(&format!("{prefix}-node"), true)?;
        let router = namespace(&format!("{prefix}-rtr"), true)?;
        let mut lab = Self {
            vipr: None,
            servers: Vec::new(),
            sctp_servers: Vec::new(),
            leaves: Vec::new(),
            router,
            node: node_ns,
            bpffs,
            workdir,
            node_addresses: BTreeSet::new(),
            devices: Vec::new(),
            listeners: BTreeMap::new(),
        };
        lab.wire_node(node, plan).context("cannot wire the node and the router")?;
        for (index, leaf) in plan.leaves.iter().enumerate() {
            lab.add_leaf(&prefix, index, leaf).with_context(|| format!("cannot wire leaf {}", leaf.addr))?;
        }
        lab.node_addresses = addresses(&lab.node)?;
        lab.devices = interfaces(&lab.node)?.into_iter().filter(|name| name != "lo").collect();
        Ok(lab)
    }

    fn wire_node(&mut self, node: &Node, plan: &LabPlan) -> Result<()> {
        let (n, r) = (&self.node, &self.router);
        for interface in node.interfaces.iter().filter(|interface| interface.name == "lo") {
            for address in &interface.addresses {
                let net = parse_cidr(address)?;
                if let Err(error) = n.ip(&["addr", "add", &net.to_string(), "dev", "lo"]) {
                    // 127.0.0.1/8 and ::1/128 are there from the start.
                    let text = format!("{error:#}");
                    ensure!(text.contains("exists") || text.contains("already assigned"), error);
                }
            }
        }
        r.ip(&["rule", "add", "pref", "1000", "iif", "up0", "lookup", FROM_NODE_TABLE])?;
        r.ip(&["-6", "rule", "add", "pref", "1000", "iif", "up0", "lookup", FROM_NODE_TABLE])?;
        // Local delivery moves behind the rules of the addresses the router owns only for the
        // node's packets (add_router_address).
        for family in ["-4", "-6"] {
            r.ip(&[family, "rule", "add", "pref", "100", "lookup", "local"])?;
            r.ip(&[family, "rule", "del", "pref", "0"])?;
        }
        r.ip(&["route", "add", "unreachable", "default", "table", FROM_NODE_TABLE])?;
        r.ip(&["-6", "route", "add", "unreachable", "default", "table", FROM_NODE_TABLE])?;
        let uplinks: Vec<_> = node.uplinks().collect();
        ensure!(
            uplinks.len() == 1,
            "the node has {} interfaces besides lo; the runner wires exactly one",
            uplinks.len()
        );
        let uplink = uplinks[0];
        n.ip(&["link", "add", &uplink.name, "type", "veth", "peer", "name", "up0", "netns", r.name()])?;
        let nets = uplink.addresses.iter().map(|address| parse_cidr(address)).collect::<Result<Vec<_>>>()?;
        for net in nets.iter().filter(|net| net.addr().is_ipv4()) {
            n.ip(&["addr", "add", &net.to_string(), "dev", &uplink.name])?;
        }
        // The kernel lists IPv6 addresses newest first: add them in reverse to list them as
        // recorded, primary first.
        for net in nets.iter().rev().filter(|net| net.addr().is_ipv6()) {
            n.ip(&["addr", "add", &net.to_string(), "dev", &uplink.name, "nodad"])?;
        }
        n.ip(&["addr", "add", &format!("{CENTER_LINK_LOCAL}/64"), "dev", &uplink.name, "nodad"])?;
        r.ip(&["addr", "add", &format!("{ROUTER_LINK_LOCAL}/64"), "dev", "up0", "nodad"])?;
        n.ip(&["link", "set", &uplink.name, "up"])?;
        r.ip(&["link", "set", "up0", "up"])?;

        if let Some(primary) = node.primary_ip(IpFamily::Ipv4).filter(IpAddr::is_ipv4) {
            let net = nets
                .iter()
                .find(|net| net.addr() == primary)
                .with_context(|| format!("the primary node IP {primary} is not on {}", uplink.name))?;
            let router_ip = free_host(*net, &plan.case_addresses)?;
            r.ip(&["addr", "add", &format!("{router_ip}/{}", net.prefix_len()), "dev", "up0"])?;
            n.ip(&[
                "route",
                "add",
                "default",
                "via",
                &router_ip.to_string(),
                "dev",
                &uplink.name,
                "src",
                &primary.to_string(),
            ])?;
            r.ip(&["route", "add", "default", "via", &primary.to_string(), "dev", "up0"])?;
        }
        if let Some(primary) = node.primary_ip(IpFamily::Ipv6).filter(IpAddr::is_ipv6) {
            n.ip(&[
                "-6",
                "route",
                "add",
                "default",
                "via",
                ROUTER_LINK_LOCAL,
                "dev",
                &uplink.name,
                "src",
                &primary.to_string(),
            ])?;
            r.ip(&["-6", "route", "add", "default", "via", CENTER_LINK_LOCAL, "dev", "up0"])?;
        }
        Ok(())
    }

    fn add_leaf(&mut self, prefix: &str, index: usize, plan: &LeafPlan) -> Result<()> {
        let netns = namespace(&format!("{prefix}-l{index}"), false)?;
        self.leaves.push(Leaf { addr: plan.addr, netns });
        let leaf = &self.leaves.last().expect("just pushed").netns;
        let (center, center_if) = match plan.side {
            Side::Node => (&self.node, format!("lf{index}")),
            Side::Router => (&self.router, format!("ex{index}")),
        };
        center.ip(&[
            "link",
            "add",
            &center_if,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            leaf.name(),
        ])?;
        let addr = plan.addr.to_string();
        if plan.addr.is_ipv4() {
            center.set_sysctl(&format!("net.ipv4.conf.{center_if}.proxy_arp"), "1")?;
            center.set_sysctl(&format!("net.ipv4.neigh.{center_if}.proxy_delay"), "0")?;
            leaf.ip(&["addr", "add", &format!("{addr}/32"), "dev", "eth0"])?;
        } else {
            center.ip(&["addr", "add", &format!("{CENTER_LINK_LOCAL}/64"), "dev", &center_if, "nodad"])?;
            leaf.ip(&["addr", "add", &format!("{addr}/128"), "dev", "eth0", "nodad"])?;
        }
        center.ip(&["link", "set", &center_if, "up"])?;
        leaf.ip(&["link", "set", "eth0", "up"])?;
        let gateway = if plan.addr.is_ipv4() { LEAF_GATEWAY_V4 } else { CENTER_LINK_LOCAL };
        let family = if plan.addr.is_ipv4() { "-4" } else { "-6" };
        leaf.ip(&[family, "route", "add", "default", "via", gateway, "dev", "eth0", "onlink"])?;
        center.ip(&[family, "route", "add", &addr, "dev", &center_if])?;
        if plan.side == Side::Router {
            center.ip(&[family, "route", "add", &addr, "dev", &center_if, "table", FROM_NODE_TABLE])?;
        }
        if plan.self_addressed {
            ensure!(plan.addr.is_ipv4(), "a self-addressed IPv6 leaf is not supported");
            // Local delivery is looked up after a rule that sends locally generated packets to
            // our own address out of eth0; replies from our own address are accepted.
            leaf.set_sysctl("net.ipv4.conf.all.accept_local", "1")?;
            leaf.set_sysctl("net.ipv4.conf.eth0.accept_local", "1")?;
            leaf.ip(&["rule", "add", "pref", "200", "lookup", "local"])?;
            leaf.ip(&["rule", "del", "pref", "0"])?;
            leaf.ip(&[
                "rule",
                "add",
                "pref",
                "100",
                "iif",
                "lo",
                "to",
                &addr,
                "lookup",
                SELF_ADDRESSED_TABLE,
            ])?;
            leaf.ip(&[
                "route",
                "add",
                "default",
                "via",
                gateway,
                "dev",
                "eth0",
                "onlink",
                "table",
                SELF_ADDRESSED_TABLE,
            ])?;
        }
        Ok(())
    }

    pub fn node(&self) -> &Netns {
        &self.node
    }

    pub fn netns(&self, place: Place) -> &Netns {
        match place {
            Place::Node => &self.node,
            Place::Router => &self.router,
            Place::Leaf(index) => &self.leaves[index].netns,
        }
    }

    /// The namespace that owns `ip`: the node for its addresses, a leaf for its own.
    pub fn owner(&self, ip: IpAddr) -> Option<Place> {
        if self.node_addresses.contains(&ip) {
            return Some(Place::Node);
        }
        self.leaves.iter().position(|leaf| leaf.addr == ip).map(Place::Leaf)
    }

    /// Makes the router own `ip` (on its loopback), so that it is "routed normally" to a
    /// place where a socket can see it arrive. Idempotent (`replace`): several flows that
    /// pass may share a destination address.
    ///
    /// Only packets from the node are delivered there: external clients may send to the same
    /// address (a cluster IP that passes on some ports and is DNATed on others), and theirs
    /// must still be routed to the node.
    pub fn add_router_address(&mut self, ip: IpAddr) -> Result<Place> {
        let (net, family) =
            if ip.is_ipv4() { (format!("{ip}/32"), "-4") } else { (format!("{ip}/128"), "-6") };
        let owned = self.router.ip(&[family, "addr", "show", "dev", "lo"])?;
        if owned.contains(&format!(" {net} ")) {
            return Ok(Place::Router);
        }
        // No prefix route: an IPv6 one in main would send the others' packets to lo.
        self.router.ip(&["addr", "add", &net, "dev", "lo", "noprefixroute"])?;
        self.router
            .ip(&[family, "rule", "add", "pref", "10", "iif", "up0", "to", &net, "lookup", "local"])?;
        self.router.ip(&[family, "rule", "add", "pref", "20", "to", &net, "lookup", "main"])?;
        Ok(Place::Router)
    }

    pub fn node_addresses(&self) -> &BTreeSet<IpAddr> {
        &self.node_addresses
    }

    pub fn devices(&self) -> &[String] {
        &self.devices
    }

    pub fn workdir(&self) -> &Path {
        self.workdir.path()
    }

    pub fn bpf_root(&self) -> &Path {
        self.bpffs.path()
    }

    /// Starts (or reuses) an echo server answering as `name` on `socket` in `place` (for SCTP
    /// a raw-socket server, `crate::sctp`, whose INIT-ACK carries the answer); returns the name
    /// of whoever answers there.
    pub fn listen(
        &mut self,
        place: Place,
        socket: SocketAddr,
        protocol: Protocol,
        name: &str,
    ) -> Result<String> {
        if let Some(existing) = self.listeners.get(&(socket, protocol)) {
            return Ok(existing.clone());
        }
        let netns = self.netns(place);
        let started = match protocol {
            Protocol::TCP => {
                EchoServer::start(netns, name, &[socket], &[]).map(|server| self.servers.push(server))
            }
            Protocol::UDP => {
                EchoServer::start(netns, name, &[], &[socket]).map(|server| self.servers.push(server))
            }
            Protocol::SCTP => {
                sctp::Server::echo(netns, name, socket).map(|server| self.sctp_servers.push(server))
            }
        };
        started.with_context(|| format!("cannot listen on {socket}/{protocol}"))?;
        self.listeners.insert((socket, protocol), name.to_owned());
        Ok(name.to_owned())
    }

    /// Who answers on `socket`, if anyone.
    pub fn listener(&self, socket: SocketAddr, protocol: Protocol) -> Option<&str> {
        self.listeners.get(&(socket, protocol)).map(String::as_str)
    }

    /// Starts vipr in the node namespace; its log goes to the scratch directory.
    pub fn start_vipr(&mut self, binary: &Path, args: &[String]) -> Result<&mut Vipr> {
        ensure!(self.vipr.is_none(), "vipr is running already");
        let log = self.log_path();
        let vipr = Vipr::start_with_args(binary, &self.node, args, &log)?;
        Ok(self.vipr.insert(vipr))
    }

    pub fn vipr(&mut self) -> Option<&mut Vipr> {
        self.vipr.as_mut()
    }

    pub fn log_path(&self) -> PathBuf {
        self.workdir.path().join("vipr.log")
    }

    pub fn services_file(&self) -> PathBuf {
        self.workdir.path().join("services.yaml")
    }
}

/// A namespace with the settings every namespace of the lab shares: IPv6 addresses usable at
/// once (no duplicate address detection), no reverse-path filter, ICMP errors never rate
/// limited (a REJECT must be seen every time); a center also forwards and sends no redirects.
fn namespace(name: &str, center: bool) -> Result<Netns> {
    let netns = Netns::create(name)?;
    let mut settings = vec![
        ("net.ipv6.conf.all.accept_dad", "0"),
        ("net.ipv6.conf.default.accept_dad", "0"),
        ("net.ipv4.conf.all.rp_filter", "0"),
        ("net.ipv4.conf.default.rp_filter", "0"),
        ("net.ipv4.icmp_ratelimit", "0"),
        ("net.ipv6.icmp.ratelimit", "0"),
    ];
    if center {
        settings.extend([
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv6.conf.all.forwarding", "1"),
            ("net.ipv4.conf.all.send_redirects", "0"),
            ("net.ipv4.conf.default.send_redirects", "0"),
        ]);
    }
    for (key, value) in settings {
        netns.set_sysctl(key, value)?;
    }
    Ok(netns)
}

/// The first host address of `net` (from its start) that the case does not use.
fn free_host(net: ipnet::IpNet, used: &BTreeSet<IpAddr>) -> Result<IpAddr> {
    let ipnet::IpNet::V4(net) = net else { bail!("{net} is not IPv4") };
    net.hosts()
        .map(IpAddr::V4)
        .find(|ip| !used.contains(ip) && *ip != IpAddr::V4(Ipv4Addr::UNSPECIFIED))
        .with_context(|| format!("no free address in {net} for the router"))
}

/// Every address in `netns`.
fn addresses(netns: &Netns) -> Result<BTreeSet<IpAddr>> {
    let json: serde_json::Value = serde_json::from_str(&netns.ip(&["-j", "addr", "show"])?)?;
    let mut found = BTreeSet::new();
    for interface in json.as_array().context("`ip -j addr` did not print a list")? {
        for info in interface["addr_info"].as_array().into_iter().flatten() {
            if let Some(local) = info["local"].as_str() {
                found.insert(local.parse().with_context(|| format!("address {local:?}"))?);
            }
        }
    }
    Ok(found)
}

fn interfaces(netns: &Netns) -> Result<Vec<String>> {
    let json: serde_json::Value = serde_json::from_str(&netns.ip(&["-j", "link", "show"])?)?;
    Ok(json
        .as_array()
        .context("`ip -j link` did not print a list")?
        .iter()
        .filter_map(|link| link["ifname"].as_str().map(str::to_owned))
        .collect())
}

/// Deletes namespaces of earlier runs that were killed before they could.
fn remove_leftover_namespaces() -> Result<()> {
    let listing = cmd::run(Command::new("ip").args(["netns", "list"]))?;
    for name in listing.lines().filter_map(|line| line.split_whitespace().next()) {
        if left_by_dead_process(name, LABEL) {
            eprintln!("vipr-conformance: deleting netns {name}, left over by a killed run");
            if let Err(error) = cmd::run(Command::new("ip").args(["netns", "del", name])) {
                eprintln!("vipr-conformance: {error:#}");
            }
        }
    }
    Ok(())
}
