//! NetworkPolicy enforced in netfilter applies to service traffic (`--bpf-forwarding`): a
//! client namespace reaches a ClusterIP service whose endpoint lives in a backend namespace,
//! through a node namespace where vipr runs and where an iptables FORWARD rule stands for the
//! policy (Calico's iptables dataplane, kube-router, ...). Rules go into the node namespace
//! only, which disappears with the test. Needs root and a built vipr.

use std::{net::Ipv4Addr, time::Duration};

use anyhow::{ensure, Context as _, Result};
use testbed::{
    locate_vipr, tcp_exchange, udp_exchange, ClusterIpService, Endpoint, Frontend, Lab, LabConfig, LeafSpec,
};

/// Bound on each connect and reply; a blocked connection fails after it.
const TIMEOUT: Duration = Duration::from_secs(1);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 2);
/// The node's address toward the backend: what a masqueraded backend sees.
const NODE_TOWARD_BACKEND: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 1);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const HTTP_TARGET: u16 = 8080;
const DNS_TARGET: u16 = 5353;

fn service() -> ClusterIpService {
    ClusterIpService::web(VIP, (HTTP_TARGET, DNS_TARGET), vec![Endpoint::ready(BACKEND, "b1")])
}

fn http() -> Frontend {
    service().frontend_named("http").unwrap()
}

fn dns() -> Frontend {
    service().frontend_named("dns").unwrap()
}

/// A lab with the service programmed by a vipr started with `args`.
fn running_lab(label: &str, args: &[&str]) -> Lab {
    let mut lab = Lab::new(LabConfig {
        label: label.to_owned(),
        vipr_binary: locate_vipr().unwrap(),
        client: LeafSpec::in_own_slash24("client", CLIENT).unwrap(),
        backends: vec![LeafSpec::in_own_slash24("b1", BACKEND).unwrap()],
        services: vec![service()],
    })
    .unwrap();
    lab.start_vipr_with(args).unwrap();
    lab.wait_programmed().unwrap();
    lab
}

/// Adds (`-A`) or deletes (`-D`) `iptables <op> FORWARD <rule>` in the node namespace.
fn forward_rule(lab: &Lab, op: &str, rule: &[&str]) -> Result<()> {
    let output = lab.node().command("iptables")?.args([op, "FORWARD"]).args(rule).output()?;
    ensure!(
        output.status.success(),
        "iptables {op} FORWARD {rule:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

fn drop_between(src: Ipv4Addr, dst: Ipv4Addr) -> Vec<String> {
    ["-s", &src.to_string(), "-d", &dst.to_string(), "-j", "DROP"].map(str::to_owned).to_vec()
}

fn as_strs(rule: &[String]) -> Vec<&str> {
    rule.iter().map(String::as_str).collect()
}

/// One TCP connection and one UDP datagram through the VIP, answered; the backend's view of
/// the client's address is returned (both must agree).
fn served(lab: &Lab) -> Result<Ipv4Addr> {
    let tcp =
        lab.client().run(|| tcp_exchange(http().socket_addr(), TIMEOUT)).context("TCP through the VIP")?;
    let udp =
        lab.client().run(|| udp_exchange(dns().socket_addr(), TIMEOUT)).context("UDP through the VIP")?;
    for exchange in [&tcp, &udp] {
        ensure!(exchange.replied_from.ip() == VIP, "reply from {} instead of the VIP", exchange.replied_from);
    }
    let seen = [tcp.answer.observed_client.ip(), udp.answer.observed_client.ip()];
    ensure!(seen[0] == seen[1], "the backend saw the client as {seen:?}");
    match seen[0] {
        std::net::IpAddr::V4(addr) => Ok(addr),
        other => anyhow::bail!("the backend saw an IPv6 client {other}"),
    }
}

/// Neither TCP nor UDP through the VIP gets an answer.
fn blocked(lab: &Lab, why: &str) {
    let tcp = lab.client().run(|| tcp_exchange(http().socket_addr(), TIMEOUT));
    assert!(tcp.is_err(), "{why}: a TCP connection through the VIP was answered: {tcp:?}");
    let udp = lab.client().run(|| udp_exchange(dns().socket_addr(), TIMEOUT));
    assert!(udp.is_err(), "{why}: a UDP datagram through the VIP was answered: {udp:?}");
}

#[test]
fn a_forward_rule_between_client_and_backend_blocks_the_vip_by_default() {
    let lab = running_lab("np-fwd", &[]);
    assert_eq!(served(&lab).unwrap(), CLIENT, "the client's address is kept");
    let rule = drop_between(CLIENT, BACKEND);
    forward_rule(&lab, "-A", &as_strs(&rule)).unwrap();
    blocked(&lab, "FORWARD -s client -d backend -j DROP");
    forward_rule(&lab, "-D", &as_strs(&rule)).unwrap();
    assert_eq!(served(&lab).unwrap(), CLIENT, "served again once the rule is gone");
}

/// The reply crosses FORWARD as backend -> client, as behind kube-proxy, not as VIP -> client.
#[test]
fn a_forward_rule_on_the_replies_blocks_the_vip_by_default() {
    let lab = running_lab("np-reply", &[]);
    served(&lab).unwrap();
    forward_rule(&lab, "-A", &as_strs(&drop_between(BACKEND, CLIENT))).unwrap();
    blocked(&lab, "FORWARD -s backend -d client -j DROP");
}

/// Masqueraded connections are not split between ingress and egress yet: they keep the
/// redirect path in the default mode too (docs/architecture/ebpf-datapath.md, "Forwarding"), and must work
/// beside the egress program.
#[test]
fn masqueraded_connections_are_served_in_the_default_mode() {
    let lab = running_lab("np-masq", &["--masquerade-all"]);
    assert_eq!(served(&lab).unwrap(), NODE_TOWARD_BACKEND, "masqueraded to the node's address");
}

/// `--bpf-forwarding=redirect` sends rewritten packets past netfilter's FORWARD chain: the
/// same rule does not stop them (the documented cost of the fast path).
#[test]
fn the_redirect_path_bypasses_forward_rules() {
    let lab = running_lab("np-redir", &["--bpf-forwarding=redirect"]);
    forward_rule(&lab, "-A", &as_strs(&drop_between(CLIENT, BACKEND))).unwrap();
    // The rule itself works: a direct connection to the backend is blocked.
    let direct = lab.client().run(|| tcp_exchange((BACKEND, HTTP_TARGET).into(), TIMEOUT));
    assert!(direct.is_err(), "a direct connection passed the FORWARD rule: {direct:?}");
    assert_eq!(served(&lab).unwrap(), CLIENT, "redirected past the FORWARD rule");
}
