//! Switching `--proxy-mode` on a node: vipr started in ebpf mode where an iptables-mode vipr
//! ran before removes the iptables-mode chains (they would keep matching beside the new
//! datapath) and nothing else. In network namespaces of its own (iptables state is per
//! namespace): the host is untouched. Needs root and a built vipr (or VIPR_BIN).

use std::{net::Ipv4Addr, path::Path, time::Duration};

use anyhow::{Context, Result};
use testbed::{
    locate_vipr, vipr_cleanup, wait_for_first_sync, write_atomically, BpfFs, LeafSpec, Netns, Topology, Vipr,
    WorkDir,
};

const POD: Ipv4Addr = Ipv4Addr::new(10, 20, 1, 2);

/// A NodePort service with one endpoint: iptables mode makes service, endpoint and NodePort
/// chains for it.
fn manifests() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\nspec:\n  type: NodePort\n  \
         clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10]\n  ports:\n  \
         - {{name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: 30080}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: default\n  \
         labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nports:\n\
         - {{name: http, protocol: TCP, port: 8080}}\nendpoints:\n- addresses: [{POD}]\n  conditions: {{ready: true}}\n"
    )
}

fn save(netns: &Netns) -> Result<String> {
    let output = netns.command("iptables-save")?.output().context("cannot run iptables-save")?;
    anyhow::ensure!(output.status.success(), "iptables-save failed");
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn run(netns: &Netns, program: &str, args: &[&str]) -> Result<String> {
    let output =
        netns.command(program)?.args(args).output().with_context(|| format!("cannot run {program}"))?;
    anyhow::ensure!(
        output.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Starts vipr with `args` and waits for its first sync.
fn start_synced(netns: &Netns, args: &[String], log: &Path) -> Result<Vipr> {
    let mut vipr = Vipr::start_with_args(&locate_vipr()?, netns, args, log)?;
    wait_for_first_sync(log, Duration::from_secs(30), || vipr.ensure_running())?;
    Ok(vipr)
}

#[test]
fn ebpf_mode_removes_what_iptables_mode_left_and_nothing_else() {
    testbed::require_root().unwrap();
    let workdir = WorkDir::create("mode-switch").unwrap();
    let bpffs = BpfFs::mount("mode-switch").unwrap();
    let topology = Topology::build("modesw", vec![LeafSpec::in_own_slash24("pod", POD).unwrap()]).unwrap();
    let node = topology.node();
    let services = workdir.path().join("services.yaml");
    write_atomically(&services, &manifests()).unwrap();
    let common = |mode: &str| -> Vec<String> {
        vec![
            format!("--proxy-mode={mode}"),
            format!("--services-file={}", services.display()),
            "--node-name=node-a".to_owned(),
            format!("--bpf-root={}", bpffs.path().display()),
            format!("--devices={}", topology.node_interfaces().join(",")),
            "--healthz-bind-address=".to_owned(),
            "--metrics-bind-address=".to_owned(),
            "-v".to_owned(),
        ]
    };

    // iptables mode programs its chains and stops; they stay (a stop is not a cleanup).
    let vipr = start_synced(node, &common("iptables"), &workdir.path().join("iptables.log")).unwrap();
    vipr.stop().unwrap();
    let saved = save(node).unwrap();
    for chain in ["KUBE-SVC-", "KUBE-SEP-", "KUBE-EXT-", "KUBE-NODEPORTS", "KUBE-SERVICES"] {
        assert!(saved.contains(chain), "iptables mode made no {chain} chain:\n{saved}");
    }

    // Someone else's rules, in the tables and built-in chains vipr uses.
    run(node, "iptables", &["-t", "nat", "-N", "FOREIGN-NAT"]).unwrap();
    run(node, "iptables", &["-t", "nat", "-A", "FOREIGN-NAT", "-s", "10.244.0.0/16", "-j", "MASQUERADE"])
        .unwrap();
    run(node, "iptables", &["-t", "nat", "-A", "POSTROUTING", "-j", "FOREIGN-NAT"]).unwrap();
    run(node, "iptables", &["-A", "INPUT", "-p", "tcp", "--dport", "22", "-j", "ACCEPT"]).unwrap();

    // ebpf mode starts: what iptables mode left is gone before its first sync, the rest stays.
    let vipr = start_synced(node, &common("ebpf"), &workdir.path().join("ebpf.log")).unwrap();
    let saved = save(node).unwrap();
    let result = (|| -> Result<()> {
        // But for kubelet's CVE-2020-8558 guard (KUBE-FIREWALL), which localhost NodePorts
        // ensure and which stays with route_localnet=1, as kube-proxy leaves it.
        let left: Vec<&str> =
            saved.lines().filter(|line| line.contains("KUBE-") && !line.contains("KUBE-FIREWALL")).collect();
        anyhow::ensure!(left.is_empty(), "iptables mode's rules remain: {left:#?}");
        for foreign in [
            ":FOREIGN-NAT - ",
            "-A FOREIGN-NAT -s 10.244.0.0/16 -j MASQUERADE",
            "-A POSTROUTING -j FOREIGN-NAT",
            "-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT",
        ] {
            anyhow::ensure!(saved.contains(foreign), "{foreign} is gone:\n{saved}");
        }
        // Neither mode made sets here (only the IPVS mode does), and none appeared.
        let sets = run(node, "ipset", &["list", "-n"])?;
        anyhow::ensure!(!sets.contains("KUBE-"), "sets: {sets}");
        Ok(())
    })();
    // Whatever the outcome: no pins left behind on the test's bpffs.
    vipr.stop().unwrap();
    vipr_cleanup(&locate_vipr().unwrap(), node, bpffs.path()).unwrap();
    result.unwrap();
}
