//! Next hops cached in flow entries (issue 16, item 4): with `--bpf-forwarding=redirect`, a
//! tracked connection's packets leave with the interface and neighbour address cached in its
//! flow entry, without a FIB lookup; a change of the node's neighbours (or routes) moves the
//! route generation, and the next packet looks its hop up again. Here a backend's MAC address
//! changes under an established UDP flow: the flow must follow it (a stale cached address is
//! one the backend's interface drops), and its entry must cache the new address; the agent's
//! stop turns the cache off. And the MTU of a packet's way, which vipr checks where it sends the
//! packet on itself, as the kernel's forwarding does (`bpf_redirect` checks none): a client
//! learns it through the service, for a tracked connection and a new one. Needs root and a
//! built vipr.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket},
    os::fd::AsRawFd as _,
    time::Duration,
};

use anyhow::{Context as _, Result};
use testbed::{
    int_option, load, set_int_option, udp_ask, wait_for, Answer, Check, ClusterIpService, Endpoint,
    FlowEntry, Lab,
};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const TIMEOUT: Duration = Duration::from_secs(20);
/// The address the backend's interface takes in the middle of the flow.
const NEW_MAC: [u8; 6] = [0x02, 0x76, 0x69, 0x70, 0x72, 0x02];

fn mac_text(mac: [u8; 6]) -> String {
    mac.map(|byte| format!("{byte:02x}")).join(":")
}

/// The MAC address of `interface` in the backend `name`'s namespace.
fn mac_of(lab: &Lab, name: &str, interface: &str) -> Result<[u8; 6]> {
    let json = lab.topology().leaf(name)?.netns.ip(&["-j", "link", "show", "dev", interface])?;
    let links: serde_json::Value = serde_json::from_str(&json)?;
    let text = links[0]["address"].as_str().context("no address in `ip -j link`")?;
    let mut mac = [0u8; 6];
    for (byte, part) in mac.iter_mut().zip(text.split(':')) {
        *byte = u8::from_str_radix(part, 16)?;
    }
    Ok(mac)
}

/// The forward entry of the client's flow `from`.
fn forward_entry(lab: &Lab, from: SocketAddr) -> Result<Option<FlowEntry>> {
    Ok(lab.maps().flows()?.into_iter().find(|entry| SocketAddr::V4(entry.source) == from))
}

/// A lab (vipr not started) serving one cluster IP over the load's backends; its UDP echo
/// frontend.
fn web_lab(label: &str) -> Result<(Lab, SocketAddr)> {
    let web = ClusterIpService::web(
        VIP,
        (8080, 5353),
        load::BACKENDS.iter().map(|(name, addr)| Endpoint::ready(*addr, name)).collect(),
    );
    let dns = web.frontend_named("dns")?.socket_addr();
    Ok((load::lab(label, vec![web])?, dns))
}

/// A [`web_lab`] whose vipr redirects forwarded packets (`--bpf-forwarding=redirect`, no XDP).
fn redirecting_lab(label: &str) -> Result<(Lab, SocketAddr)> {
    let (mut lab, dns) = web_lab(label)?;
    lab.start_vipr_with(&["--bpf-forwarding=redirect", "--xdp=off"])?;
    lab.wait_programmed()?;
    Ok((lab, dns))
}

#[test]
fn a_cached_next_hop_follows_a_neighbour_that_changes_its_address() -> Result<()> {
    let (mut lab, dns) = redirecting_lab("nexthop")?;

    let client = lab.client();
    let socket = client.run(|| {
        let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        socket.set_read_timeout(Some(Duration::from_millis(500)))?;
        Ok(socket)
    })?;
    let from = SocketAddr::new(lab.client_addr().into(), socket.local_addr()?.port());
    // The same socket, so the same flow, every time; a lost datagram is asked again.
    let ask = |what: &str| {
        wait_for(what, TIMEOUT, || {
            Ok(match udp_ask(&socket, dns) {
                Ok(answer) => Check::Done(answer),
                Err(error) => Check::NotYet(format!("{error:#}")),
            })
        })
    };
    let backend = ask("the first answer")?.backend;
    let leaf = lab.topology().leaf(&backend)?.spec.clone();
    let old_mac = mac_of(&lab, &backend, &leaf.leaf_interface)?;

    // The flow's established packets cache their hop: the backend's interface address.
    let cached = wait_for("the backend's address cached in the flow entry", TIMEOUT, || {
        ask("an answer on the established flow")?;
        Ok(match forward_entry(&lab, from)? {
            Some(entry) if entry.next_hop_ifindex != 0 && entry.route_generation != 0 => Check::Done(entry),
            other => Check::NotYet(format!("{other:?}")),
        })
    })?;
    assert_eq!(cached.next_hop_mac, old_mac, "the cached neighbour is the backend: {cached:?}");

    // The backend's interface takes another address, and the node learns it.
    let node_ip = |args: &[&str]| lab.node().ip(args);
    lab.topology().leaf(&backend)?.netns.ip(&[
        "link",
        "set",
        "dev",
        &leaf.leaf_interface,
        "address",
        &mac_text(NEW_MAC),
    ])?;
    node_ip(&[
        "neigh",
        "replace",
        &leaf.addr.to_string(),
        "lladdr",
        &mac_text(NEW_MAC),
        "dev",
        &leaf.node_interface,
        "nud",
        "reachable",
    ])?;

    // The same flow still reaches its backend, through the hop looked up anew.
    let answer = ask("an answer after the backend's address changed")?;
    assert_eq!(answer.backend, backend, "the flow kept its backend");
    let recached = wait_for("the new address cached in the flow entry", TIMEOUT, || {
        ask("an answer on the established flow")?;
        Ok(match forward_entry(&lab, from)? {
            Some(entry) if entry.next_hop_mac == NEW_MAC => Check::Done(entry),
            other => Check::NotYet(format!("{other:?}")),
        })
    })?;
    assert!(recached.route_generation > cached.route_generation, "{cached:?} then {recached:?}");

    // A stopped agent hears of no change: the datapath it leaves trusts no cached hop.
    assert_ne!(lab.maps().route_generation()?, 0, "the cache is on while the agent runs");
    lab.stop_vipr()?;
    assert_eq!(lab.maps().route_generation()?, 0, "the cache is off once the agent stopped");
    Ok(())
}

/// Path MTU discovery through a service whose packets vipr redirects past the stack (which
/// checks no MTU there): the links to the backends shrink below the datagrams a client sends
/// with DF; the client must hear "fragmentation needed" from the node, as it would from a
/// router or from kube-proxy's node, and learn the path's MTU (its next send of that size fails
/// with EMSGSIZE). Without the answer the datagrams vanish at the backends' links.
#[test]
fn a_client_learns_the_smaller_mtu_of_the_way_to_its_backend() -> Result<()> {
    const LINK_MTU: u32 = 1000;
    let (lab, dns) = redirecting_lab("pmtu")?;

    let client = lab.client();
    let socket = client.run(|| {
        let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        socket.set_read_timeout(Some(Duration::from_millis(500)))?;
        // DF on every datagram, and EMSGSIZE for one larger than the path's known MTU.
        set_int_option(socket.as_raw_fd(), libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO)?;
        socket.connect(dns)?;
        Ok(socket)
    })?;
    let backend = wait_for("a first answer", TIMEOUT, || {
        Ok(match udp_ask(&socket, dns) {
            Ok(answer) => Check::Done(answer.backend),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })?;

    // Both ends of the flow's backend's link shrink.
    let leaf = lab.topology().leaf(&backend)?;
    let mtu = LINK_MTU.to_string();
    lab.node().ip(&["link", "set", "dev", &leaf.spec.node_interface, "mtu", &mtu])?;
    leaf.netns.ip(&["link", "set", "dev", &leaf.spec.leaf_interface, "mtu", &mtu])?;

    let large = [0x5a; 1200];
    wait_for("EMSGSIZE for a datagram larger than the way's MTU", TIMEOUT, || {
        Ok(match socket.send(&large) {
            Err(error) if error.raw_os_error() == Some(libc::EMSGSIZE) => Check::Done(()),
            Ok(_) => Check::NotYet("sent".into()),
            Err(error) => Check::NotYet(format!("{error}")),
        })
    })?;
    let learnt = int_option(socket.as_raw_fd(), libc::IPPROTO_IP, libc::IP_MTU)?;
    assert_eq!(learnt, LINK_MTU as i32, "the path MTU the client learnt");
    // The flow itself goes on with what fits.
    let answer = wait_for("an answer after the MTU shrank", TIMEOUT, || {
        Ok(match udp_ask(&socket, dns) {
            Ok(answer) => Check::Done(answer),
            Err(error) => Check::NotYet(format!("{error:#}")),
        })
    })?;
    assert_eq!(answer.backend, backend, "the flow kept its backend");
    Ok(())
}

/// A connection's first datagram too big for the way to its backend, however vipr sends it on
/// (into the stack or redirected; only DNATed, or masqueraded as a NodePort's is), must not
/// vanish. Without DF it is answered: fragmented on the way, or, masqueraded (whose rewritten
/// packet the stack cannot forward: its source is the node's own), after the client learns the
/// way's MTU from vipr's "fragmentation needed" and fragments its datagrams itself. With DF the
/// client hears "fragmentation needed" and learns the way's MTU, as from a router or
/// kube-proxy's node. Every datagram here is sent from a new socket, so each is a new
/// connection's first packet. Before, a masqueraded connection's first datagram that did not
/// fit was dropped unanswered: the route lookup that chooses its source address saw
/// "fragmentation needed" and took it for "no route".
#[test]
fn a_new_connections_first_datagram_too_big_for_its_way_is_answered_or_fragmented() -> Result<()> {
    for (label, flags, masqueraded) in [
        ("newmtu-s", &["--xdp=off"][..], false),
        ("newmtu-sm", &["--xdp=off", "--masquerade-all"][..], true),
        ("newmtu-r", &["--xdp=off", "--bpf-forwarding=redirect"][..], false),
        ("newmtu-rm", &["--xdp=off", "--bpf-forwarding=redirect", "--masquerade-all"][..], true),
    ] {
        first_datagrams_too_big(label, flags, masqueraded).with_context(|| format!("vipr {flags:?}"))?;
    }
    Ok(())
}

fn first_datagrams_too_big(label: &str, flags: &[&str], masqueraded: bool) -> Result<()> {
    const LINK_MTU: u32 = 1000;
    const CLIENT_MTU: i32 = 1500;
    let (mut lab, dns) = web_lab(label)?;
    // Every backend's link is smaller than the client's before any connection.
    let mtu = LINK_MTU.to_string();
    for (name, _) in load::BACKENDS {
        let leaf = lab.topology().leaf(name)?;
        lab.node().ip(&["link", "set", "dev", &leaf.spec.node_interface, "mtu", &mtu])?;
        leaf.netns.ip(&["link", "set", "dev", &leaf.spec.leaf_interface, "mtu", &mtu])?;
    }
    lab.start_vipr_with(flags)?;
    lab.wait_programmed()?;

    let client = lab.client();
    let large = [0x5a; 1200];
    let answer = wait_for("an answer to a new socket's datagram without DF", TIMEOUT, || {
        client.run(|| {
            let socket = socket_to(dns, Some(libc::IP_PMTUDISC_DONT))?;
            socket.send(&large)?;
            let mut reply = [0; 1500];
            Ok(match socket.recv(&mut reply) {
                Ok(len) => Check::Done(std::str::from_utf8(&reply[..len])?.parse::<Answer>()?),
                Err(error) => Check::NotYet(format!("{error}")),
            })
        })
    })?;
    let client_address = IpAddr::V4(lab.client_addr());
    assert_eq!(
        answer.observed_client.ip() != client_address,
        masqueraded,
        "the backend saw {} (masqueraded: {masqueraded})",
        answer.observed_client
    );

    // Fragmented by the stack, the datagrams taught the client nothing; masqueraded, the
    // client learnt the way's MTU from vipr's answer, as it fragments its datagrams since.
    let known = client.run(|| {
        let socket = socket_to(dns, None)?;
        Ok(int_option(socket.as_raw_fd(), libc::IPPROTO_IP, libc::IP_MTU)?)
    })?;
    let expected = if masqueraded { LINK_MTU as i32 } else { CLIENT_MTU };
    assert_eq!(known, expected, "the path MTU the client knows after datagrams without DF");

    // What the client learnt of the way is forgotten: the next datagrams leave whole.
    client.ip(&["route", "flush", "cache"])?;
    let learnt = wait_for("the way's MTU learnt from a new socket's first datagram", TIMEOUT, || {
        client.run(|| {
            let socket = socket_to(dns, Some(libc::IP_PMTUDISC_DO))?;
            let mtu = || int_option(socket.as_raw_fd(), libc::IPPROTO_IP, libc::IP_MTU);
            // One datagram per socket: each is a new connection's first. EMSGSIZE once the
            // client knows the way's MTU: at once if an earlier socket's datagram taught it,
            // else after this one is answered ("fragmentation needed" quoting it as sent; with
            // `stack` the node's own, which vipr's egress program un-NATs).
            match socket.send(&large) {
                Err(error) if error.raw_os_error() == Some(libc::EMSGSIZE) => return Ok(Check::Done(mtu()?)),
                Err(error) => return Ok(Check::NotYet(format!("{error}"))),
                // The answer arrives while the socket waits.
                Ok(_) => drop(socket.recv(&mut [0; 1500])),
            }
            let mtu = mtu()?;
            Ok(if mtu == LINK_MTU as i32 {
                Check::Done(mtu)
            } else {
                Check::NotYet(format!("sent once; the socket's MTU is {mtu}"))
            })
        })
    })?;
    assert_eq!(learnt, LINK_MTU as i32, "the path MTU the client learnt");
    Ok(())
}

/// A new UDP socket connected to `to`, with `discovery` as its `IP_MTU_DISCOVER` (DF on its
/// datagrams or not), waiting half a second for an answer.
fn socket_to(to: SocketAddr, discovery: Option<i32>) -> Result<UdpSocket> {
    let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    if let Some(discovery) = discovery {
        set_int_option(socket.as_raw_fd(), libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, discovery)?;
    }
    socket.set_read_timeout(Some(Duration::from_millis(500)))?;
    socket.connect(to)?;
    Ok(socket)
}
