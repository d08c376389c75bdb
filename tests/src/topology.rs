//! A star of network namespaces: one node namespace that routes between leaf namespaces, each
//! connected to it by its own veth pair.

use std::{collections::HashSet, net::Ipv4Addr, process::Command};

use anyhow::{bail, ensure, Context, Result};

use crate::{cmd, left_by_dead_process, unique_name, Netns};

/// Linux's limit on interface names (IFNAMSIZ minus the terminating NUL).
const MAX_INTERFACE_NAME: usize = 15;

/// One leaf of a [`Topology`]: a namespace with a single veth to the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeafSpec {
    /// Short role name (`client`, `b1`); part of the namespace name.
    pub name: String,
    /// The leaf's address on its veth.
    pub addr: Ipv4Addr,
    /// The node's address on the other end, in the same subnet: the leaf's default gateway.
    pub gateway: Ipv4Addr,
    pub prefix_len: u8,
    /// The veth end in the node namespace; also what vipr is given in `--devices`.
    pub node_interface: String,
    /// The veth end in the leaf namespace.
    pub leaf_interface: String,
}

impl LeafSpec {
    pub fn new(name: &str, addr: Ipv4Addr, gateway: Ipv4Addr, prefix_len: u8) -> Self {
        Self {
            name: name.to_owned(),
            addr,
            gateway,
            prefix_len,
            node_interface: format!("to-{name}"),
            leaf_interface: "eth0".to_owned(),
        }
    }

    /// A leaf alone in its /24, with the node at .1 of that /24.
    pub fn in_own_slash24(name: &str, addr: Ipv4Addr) -> Result<Self> {
        let [a, b, c, d] = addr.octets();
        ensure!(d > 1 && d < 255, "{addr} cannot share a /24 with a gateway at {a}.{b}.{c}.1");
        Ok(Self::new(name, addr, Ipv4Addr::new(a, b, c, 1), 24))
    }
}

/// A leaf namespace that exists.
#[derive(Debug)]
pub struct Leaf {
    pub spec: LeafSpec,
    pub netns: Netns,
}

/// One end of a veth pair: the namespace it lives in, its name and its address.
#[derive(Clone, Copy, Debug)]
pub struct VethEnd<'a> {
    pub netns: &'a Netns,
    pub interface: &'a str,
    pub addr: Ipv4Addr,
    pub prefix_len: u8,
}

/// Connects two namespaces with a veth pair, addresses both ends and brings them up. The
/// pair disappears with either namespace.
pub fn create_veth(a: VethEnd<'_>, b: VethEnd<'_>) -> Result<()> {
    a.netns.ip(&[
        "link",
        "add",
        a.interface,
        "type",
        "veth",
        "peer",
        "name",
        b.interface,
        "netns",
        b.netns.name(),
    ])?;
    for end in [a, b] {
        let addr = format!("{}/{}", end.addr, end.prefix_len);
        end.netns.ip(&["addr", "add", &addr, "dev", end.interface])?;
        end.netns.ip(&["link", "set", end.interface, "up"])?;
    }
    Ok(())
}

/// The namespaces of a star topology; all of them are deleted on drop.
///
/// The node forwards between leaves (ip_forward=1) with reverse-path filtering off: vipr's
/// reverse NAT turns a backend's reply into a packet from the service VIP arriving on the
/// backend's interface, which strict rp_filter would drop since the VIP is not routed there.
/// Each leaf routes everything via the node.
#[derive(Debug)]
pub struct Topology {
    // Leaves before the node: dropping a leaf namespace removes its veth from the node too.
    leaves: Vec<Leaf>,
    node: Netns,
    /// Start of every namespace name of this topology.
    prefix: String,
}

impl Topology {
    /// Creates the node namespace and every leaf; namespace names start with `label`.
    pub fn build(label: &str, leaves: Vec<LeafSpec>) -> Result<Self> {
        remove_leftover_namespaces(label)?;
        let prefix = unique_name(label);
        let node = Netns::create(&format!("{prefix}-node"))?;
        // Set before any interface exists, so that every interface inherits it from `default`.
        for key in ["net.ipv4.conf.all.rp_filter", "net.ipv4.conf.default.rp_filter"] {
            node.set_sysctl(key, "0")?;
        }
        node.set_sysctl("net.ipv4.ip_forward", "1")?;
        let mut topology = Self { leaves: Vec::with_capacity(leaves.len()), node, prefix };
        for spec in leaves {
            topology.add_leaf(spec)?;
        }
        Ok(topology)
    }

    /// Creates one more leaf namespace and connects it to the node.
    pub fn add_leaf(&mut self, spec: LeafSpec) -> Result<&Leaf> {
        validate(self.leaves.iter().map(|leaf| &leaf.spec).chain([&spec]))?;
        let netns = Netns::create(&format!("{}-{}", self.prefix, spec.name))?;
        // Kept before it is wired so that a failure half-way still deletes it.
        self.leaves.push(Leaf { spec, netns });
        let leaf = self.leaves.last().expect("just pushed");
        wire(&self.node, leaf)?;
        Ok(leaf)
    }

    /// Deletes a leaf's veth pair and creates it again under the same names and addresses, as
    /// a device re-created on a node is: same name, new interface index.
    pub fn rewire_leaf(&self, name: &str) -> Result<()> {
        let leaf = self.leaf(name)?;
        self.node.ip(&["link", "delete", &leaf.spec.node_interface])?;
        wire(&self.node, leaf)
    }

    pub fn node(&self) -> &Netns {
        &self.node
    }

    pub fn leaves(&self) -> &[Leaf] {
        &self.leaves
    }

    pub fn leaf(&self, name: &str) -> Result<&Leaf> {
        self.leaves
            .iter()
            .find(|leaf| leaf.spec.name == name)
            .with_context(|| format!("the topology has no leaf named {name}"))
    }

    /// The node's ends of all veths: the interfaces vipr attaches to.
    pub fn node_interfaces(&self) -> Vec<String> {
        self.leaves.iter().map(|leaf| leaf.spec.node_interface.clone()).collect()
    }
}

/// Connects `leaf` to `node` with its veth pair, and routes everything of the leaf via the node.
fn wire(node: &Netns, leaf: &Leaf) -> Result<()> {
    let spec = &leaf.spec;
    let node_end = VethEnd {
        netns: node,
        interface: &spec.node_interface,
        addr: spec.gateway,
        prefix_len: spec.prefix_len,
    };
    let leaf_end = VethEnd {
        netns: &leaf.netns,
        interface: &spec.leaf_interface,
        addr: spec.addr,
        prefix_len: spec.prefix_len,
    };
    create_veth(node_end, leaf_end)
        .and_then(|()| leaf.netns.ip(&["route", "add", "default", "via", &spec.gateway.to_string()]))
        .map(drop)
        .with_context(|| format!("cannot wire up leaf {}", spec.name))
}

/// Deletes the namespaces of earlier runs with this label that were killed before they could.
fn remove_leftover_namespaces(label: &str) -> Result<()> {
    let listing = cmd::run(Command::new("ip").args(["netns", "list"]))?;
    // Lines are "<name>" or "<name> (id: <n>)".
    for name in listing.lines().filter_map(|line| line.split_whitespace().next()) {
        if left_by_dead_process(name, label) {
            eprintln!("testbed: deleting netns {name}, left over by a killed run");
            if let Err(error) = cmd::run(Command::new("ip").args(["netns", "del", name])) {
                eprintln!("testbed: {error:#}");
            }
        }
    }
    Ok(())
}

fn validate<'a>(leaves: impl IntoIterator<Item = &'a LeafSpec>) -> Result<()> {
    let mut names = HashSet::new();
    let mut interfaces = HashSet::new();
    for spec in leaves {
        ensure!(names.insert(&spec.name), "two leaves are named {}", spec.name);
        ensure!(
            interfaces.insert(&spec.node_interface),
            "two leaves use node interface {}",
            spec.node_interface
        );
        for interface in [&spec.node_interface, &spec.leaf_interface] {
            if interface.len() > MAX_INTERFACE_NAME {
                bail!("interface name {interface} is longer than {MAX_INTERFACE_NAME} bytes");
            }
        }
        ensure!(
            spec.prefix_len <= 30 && same_subnet(spec.addr, spec.gateway, spec.prefix_len),
            "leaf {}: {} and gateway {} are not in one /{} subnet with room for both",
            spec.name,
            spec.addr,
            spec.gateway,
            spec.prefix_len
        );
    }
    Ok(())
}

fn same_subnet(a: Ipv4Addr, b: Ipv4Addr, prefix_len: u8) -> bool {
    let mask = u32::MAX.checked_shl(32 - u32::from(prefix_len)).unwrap_or(0);
    u32::from(a) & mask == u32::from(b) & mask && a != b
}
