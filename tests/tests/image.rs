//! vipr's container image (deploy/Containerfile, built by `cargo xtask image` from the vipr
//! binary under test) run with podman inside a lab's node namespace, as the DaemonSet runs it
//! on a node: host network (here the node namespace), the bpffs mounted with Bidirectional
//! propagation, a cgroup v2 directory for the socket hooks. eBPF mode serves a ClusterIP,
//! privileged and with the DaemonSet's own securityContext; `--cleanup` from the image removes
//! what it made; `auto` without BPF falls back to nftables, and iptables mode uses the node's
//! iptables variant.
//! Needs root, podman (`cargo xtask setup`) and a built workspace (`cargo build --workspace`:
//! the vipr and xtask binaries).

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
    time::Duration,
};

use serde::Deserialize as _;
use testbed::{
    container::{
        deny_bpf_profile, run_to_completion, test_image, Cgroup2Dir, Container, ContainerSpec, Privileges,
        Seccomp,
    },
    exchange, unique_name, wait_for_first_sync, ClusterIpService, Endpoint, Frontend, Lab, LabConfig, Netns,
    Protocol,
};

const TIMEOUT: Duration = Duration::from_secs(2);
/// How long vipr may take to start in its container and sync.
const SETTLE: Duration = Duration::from_secs(30);
/// With two endpoints chosen at random, the chance that one gets none of 30 is ~2e-9.
const CONNECTIONS: usize = 30;

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const BACKENDS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 20, 1, 2), Ipv4Addr::new(10, 20, 2, 2)];
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

/// Where the containers see the cgroup for the socket hooks.
const CGROUP_IN_CONTAINER: &str = "/run/vipr-cg2";

/// The DaemonSet's `privileged: true` of the modes other than eBPF.
const PRIVILEGED: Security = (Privileges::Privileged, Seccomp::RuntimeDefault);

/// The tests take turns: each starts containers, and removing podman's empty cgroups after
/// one container could race the start of another.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn web() -> ClusterIpService {
    let endpoints = BACKENDS.iter().map(|addr| Endpoint::ready(*addr, "pod")).collect();
    ClusterIpService::web(VIP, (8080, 5353), endpoints)
}

fn lab(label: &str) -> Lab {
    Lab::new(LabConfig::with_backends(label, CLIENT, &[BACKENDS[0], BACKENDS[1]], vec![web()]).unwrap())
        .unwrap()
}

/// A pod's `privileged` or capabilities, and its seccomp profile.
type Security = (Privileges, Seccomp);

/// A container of the image in the lab's node, with the DaemonSet's mounts: the lab's bpffs
/// as /sys/fs/bpf, the directory of the services file (read-only;
/// the directory, so that its atomic rewrites show), and `cgroup` for the socket hooks.
fn spec(lab: &Lab, cgroup: &Cgroup2Dir, (privileges, seccomp): Security, args: Vec<String>) -> ContainerSpec {
    let services_dir = lab.services_file().parent().expect("the services file is in the lab's directory");
    // Kubernetes allows Bidirectional propagation (a bpffs vipr mounts itself reaching the
    // node) only to privileged containers; others get HostToContainer.
    let bpffs = match &privileges {
        Privileges::Privileged => "/sys/fs/bpf:rshared",
        Privileges::Capabilities(_) => "/sys/fs/bpf:rslave",
    };
    ContainerSpec {
        image: test_image().unwrap().to_owned(),
        privileges,
        seccomp,
        volumes: vec![
            (lab.bpf_root().to_owned(), bpffs.to_owned()),
            (services_dir.to_owned(), format!("{}:ro", services_dir.display())),
            (cgroup.path().to_owned(), CGROUP_IN_CONTAINER.to_owned()),
        ],
        entrypoint: None,
        args,
    }
}

/// vipr's command line in the container, as the DaemonSet's with the lab's services file.
fn agent_args(lab: &Lab, mode: &str) -> Vec<String> {
    vec![
        format!("--proxy-mode={mode}"),
        format!("--services-file={}", lab.services_file().display()),
        format!("--hostname-override={}", lab.node().name()),
        format!("--devices={}", lab.topology().node_interfaces().join(",")),
        "--bpf-root=/sys/fs/bpf".to_owned(),
        format!("--cgroup-root={CGROUP_IN_CONTAINER}"),
        "--min-sync-period=0s".to_owned(),
        "-v".to_owned(),
    ]
}

/// `vipr --cleanup` from the image, in the lab's node.
fn cleanup_from_image(lab: &Lab, cgroup: &Cgroup2Dir, security: Security) {
    let args = vec!["--cleanup".to_owned(), "--bpf-root=/sys/fs/bpf".to_owned()];
    run_to_completion(lab.node(), &spec(lab, cgroup, security, args)).unwrap();
}

fn log_path(lab: &Lab, name: &str) -> PathBuf {
    lab.services_file().with_file_name(name)
}

/// The backends that answered `CONNECTIONS` connections to `VIP:port`, unmasqueraded.
fn reach(lab: &Lab, port: u16, protocol: Protocol) -> BTreeSet<String> {
    lab.backends_reached(Frontend { addr: SocketAddrV4::new(VIP, port), protocol }, CONNECTIONS, TIMEOUT)
        .unwrap()
}

fn all_backends() -> BTreeSet<String> {
    ["b1", "b2"].map(str::to_owned).into()
}

fn assert_service_gone(lab: &Lab) {
    for port in [80, 53] {
        let protocol = if port == 80 { Protocol::Tcp } else { Protocol::Udp };
        let frontend = Frontend { addr: SocketAddrV4::new(VIP, port), protocol };
        if let Ok(answer) = lab.client().run(|| exchange(frontend, TIMEOUT)) {
            panic!("{frontend} still answers after vipr --cleanup: {answer:?}");
        }
    }
}

/// The securityContext of the DaemonSet render.sh prints for eBPF mode, as podman options:
/// its capability list and seccomp profile.
fn daemonset_security() -> Security {
    let render = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/render.sh");
    let output = Command::new("sh")
        .arg(&render)
        .args(["--api-server=192.0.2.10:6443", "--mode=ebpf"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let text = String::from_utf8(output.stdout).unwrap();
    let daemon_set = serde_yaml::Deserializer::from_str(&text)
        .map(|document| serde_yaml::Value::deserialize(document).unwrap())
        .find(|document| document["kind"].as_str() == Some("DaemonSet"))
        .expect("render.sh prints a DaemonSet");
    let context = &daemon_set["spec"]["template"]["spec"]["containers"][0]["securityContext"];
    assert_eq!(context["privileged"].as_bool(), Some(false), "{context:?}");
    let drop = context["capabilities"]["drop"].as_sequence().cloned().unwrap_or_default();
    assert_eq!(drop, [serde_yaml::Value::from("ALL")], "{context:?}");
    let add = context["capabilities"]["add"]
        .as_sequence()
        .unwrap_or_else(|| panic!("no capabilities.add in {context:?}"))
        .iter()
        .map(|capability| capability.as_str().expect("a capability name").to_owned())
        .collect();
    let seccomp = match context["seccompProfile"]["type"].as_str() {
        Some("Unconfined") => Seccomp::Unconfined,
        None | Some("RuntimeDefault") => Seccomp::RuntimeDefault,
        Some(other) => panic!("seccompProfile {other}: not one this test can give podman"),
    };
    (Privileges::Capabilities(add), seccomp)
}

/// eBPF mode from the image serves the lab's ClusterIP and pins its datapath on the node's
/// bpffs; the datapath outlives the container; `--cleanup` from the image removes it.
fn ebpf_mode_serves_and_cleanup_removes_it(label: &str, security: Security) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poison| poison.into_inner());
    let mut lab = lab(label);
    let cgroup = Cgroup2Dir::create().unwrap();
    let log = log_path(&lab, "vipr-container.log");
    let mut container =
        Container::start(lab.node(), &spec(&lab, &cgroup, security.clone(), agent_args(&lab, "ebpf")), &log)
            .unwrap();
    let _ = wait_for_first_sync(&log, SETTLE, || container.ensure_running()).unwrap();
    lab.wait_programmed().unwrap();
    assert_eq!(reach(&lab, 80, Protocol::Tcp), all_backends());
    assert_eq!(reach(&lab, 53, Protocol::Udp), all_backends());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("balancing the node's own connections at the socket level"),
        "the socket hooks are not attached:\n{text}"
    );

    let status = container.stop().unwrap();
    assert!(status.success(), "vipr in its container exited with {status} on SIGTERM");
    assert!(lab.maps().dir().is_dir(), "the datapath is pinned on the node's bpffs");
    assert_eq!(reach(&lab, 80, Protocol::Tcp), all_backends(), "while no vipr runs");

    cleanup_from_image(&lab, &cgroup, security);
    let pins = lab.maps().dir().to_owned();
    assert!(!pins.exists(), "{} survived vipr --cleanup from the image", pins.display());
    assert_service_gone(&lab);
}

#[test]
fn privileged_ebpf_mode_serves_a_cluster_ip_and_cleanup_from_the_image_removes_it() {
    ebpf_mode_serves_and_cleanup_removes_it("image-priv", PRIVILEGED);
}

#[test]
fn with_the_daemonsets_capabilities_ebpf_mode_serves_and_cleanup_removes_it() {
    ebpf_mode_serves_and_cleanup_removes_it("image-caps", daemonset_security());
}

/// `iptables-save` of one variant in the lab's node.
fn save(lab: &Lab, program: &str) -> String {
    let output = lab.node().command(program).unwrap().output().unwrap();
    assert!(output.status.success(), "{program}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Without bpf() (a seccomp profile denying it, as on a node whose runtime forbids BPF; the
/// DaemonSet runs `auto` privileged), `auto` falls back to nftables inside the container (the
/// image has `nft`); iptables mode there writes its rules with the variant the node uses:
/// legacy here, which the kubelet's hint chain says, though the image's own default is nft.
#[test]
fn without_bpf_auto_mode_falls_back_to_nftables_and_iptables_mode_to_the_nodes_variant() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poison| poison.into_inner());
    let lab = lab("image-auto");
    let cgroup = Cgroup2Dir::create().unwrap();
    // The kubelet's mark of the variant it uses (KUBE-IPTABLES-HINT, kubelet 1.24+).
    let hint = lab
        .node()
        .command("iptables-legacy")
        .unwrap()
        .args(["-t", "mangle", "-N", "KUBE-IPTABLES-HINT"])
        .output()
        .unwrap();
    assert!(hint.status.success(), "{}", String::from_utf8_lossy(&hint.stderr));

    let profile = deny_bpf_profile(lab.services_file().parent().unwrap()).unwrap();
    let without_bpf = (Privileges::Privileged, Seccomp::Profile(profile));
    let log = log_path(&lab, "vipr-auto.log");
    let mut container = Container::start(
        lab.node(),
        &spec(&lab, &cgroup, without_bpf.clone(), agent_args(&lab, "auto")),
        &log,
    )
    .unwrap();
    let text = wait_for_first_sync(&log, SETTLE, || container.ensure_running()).unwrap();
    let choice = text
        .lines()
        .find(|line| line.contains("proxy mode auto:"))
        .unwrap_or_else(|| panic!("no choice logged:\n{text}"));
    assert!(choice.contains("proxy mode auto: chose nftables: "), "{choice}");
    assert!(choice.contains("Operation not permitted"), "{choice}");
    assert_eq!(reach(&lab, 80, Protocol::Tcp), all_backends());
    let status = container.stop().unwrap();
    assert!(status.success(), "vipr in its container exited with {status} on SIGTERM");

    let log = log_path(&lab, "vipr-iptables.log");
    let mut container =
        Container::start(lab.node(), &spec(&lab, &cgroup, without_bpf, agent_args(&lab, "iptables")), &log)
            .unwrap();
    wait_for_first_sync(&log, SETTLE, || container.ensure_running()).unwrap();
    let tables = lab.node().command("nft").unwrap().args(["list", "tables"]).output().unwrap();
    let tables = String::from_utf8_lossy(&tables.stdout);
    assert!(!tables.contains("vipr"), "nftables mode's table survived the switch: {tables}");

    assert_eq!(reach(&lab, 80, Protocol::Tcp), all_backends());
    assert_eq!(reach(&lab, 53, Protocol::Udp), all_backends());
    let legacy = save(&lab, "iptables-legacy-save");
    assert!(legacy.contains(":KUBE-SVC-"), "the service is served by legacy rules:\n{legacy}");
    let nft = save(&lab, "iptables-nft-save");
    assert!(!nft.contains("KUBE-SERVICES"), "rules went to nft too:\n{nft}");
    assert!(!lab.bpf_root().join("vipr").exists(), "nothing was pinned");
    let status = container.stop().unwrap();
    assert!(status.success(), "vipr in its container exited with {status} on SIGTERM");

    cleanup_from_image(&lab, &cgroup, PRIVILEGED);
    let legacy = save(&lab, "iptables-legacy-save");
    // KUBE-FIREWALL is the kubelet's (vipr adds its localnet guard where the kubelet has not),
    // and stays, as after kube-proxy's own cleanup.
    let left: Vec<&str> = legacy
        .lines()
        .filter(|line| line.contains("KUBE-"))
        .filter(|line| !line.contains("KUBE-IPTABLES-HINT") && !line.contains("KUBE-FIREWALL"))
        .collect();
    assert!(left.is_empty(), "left behind by --cleanup: {left:?}");
    assert!(legacy.contains(":KUBE-IPTABLES-HINT"), "the kubelet's chain is not vipr's to remove:\n{legacy}");
    assert_service_gone(&lab);
}

/// Runs `iptables` of the image in `netns`, then reports which variant `iptables` has
/// become: its `--version` and where /usr/sbin/iptables leads.
fn image_iptables_in(netns: &Netns) -> String {
    let spec = ContainerSpec {
        image: test_image().unwrap().to_owned(),
        privileges: Privileges::Privileged,
        seccomp: Seccomp::RuntimeDefault,
        volumes: Vec::new(),
        entrypoint: Some("sh".to_owned()),
        args: vec!["-c".to_owned(), "iptables --version && readlink -f /usr/sbin/iptables".to_owned()],
    };
    run_to_completion(netns, &spec).unwrap()
}

/// In `netns`, runs `program args` (a host iptables of one variant) to prepare its rules.
fn host(netns: &Netns, program: &str, args: &[&str]) {
    let output = netns.command(program).unwrap().args(args).output().unwrap();
    assert!(output.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&output.stderr));
}

/// The image's iptables is the variant holding the node's rules: the one the kubelet marked,
/// else the one with more rules, else nft; after the first call, iptables is that variant.
#[test]
fn the_images_iptables_is_the_variant_holding_the_nodes_rules() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poison| poison.into_inner());
    let netns = |label: &str| Netns::create(&unique_name(label)).unwrap();

    let empty = netns("image-ipt-empty");
    let chosen = image_iptables_in(&empty);
    assert!(chosen.contains("(nf_tables)") && chosen.contains("xtables-nft-multi"), "{chosen}");

    let legacy_rules = netns("image-ipt-legacy");
    host(&legacy_rules, "iptables-legacy", &["-A", "INPUT", "-s", "192.0.2.1", "-j", "ACCEPT"]);
    let chosen = image_iptables_in(&legacy_rules);
    assert!(chosen.contains("(legacy)") && chosen.contains("xtables-legacy-multi"), "{chosen}");

    // The kubelet's mark outweighs rule counts.
    let marked_nft = netns("image-ipt-marked");
    host(&marked_nft, "iptables-legacy", &["-A", "INPUT", "-s", "192.0.2.1", "-j", "ACCEPT"]);
    host(&marked_nft, "ip6tables-legacy", &["-A", "INPUT", "-s", "2001:db8::1", "-j", "ACCEPT"]);
    host(&marked_nft, "iptables-nft", &["-t", "mangle", "-N", "KUBE-IPTABLES-HINT"]);
    let chosen = image_iptables_in(&marked_nft);
    assert!(chosen.contains("(nf_tables)") && chosen.contains("xtables-nft-multi"), "{chosen}");
}
