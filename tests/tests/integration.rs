//! vipr's integration tests, one test binary: each file of this directory is a module of it
//! (`cargo test -p vipr-tests --test integration <module>::`), so the testbed and vipr are
//! linked once instead of once a file. Tests of different modules run at the same time in this
//! one process: each names its namespaces, mounts and directories with
//! [`testbed::unique_name`], and the ones that measure rates or hold the machine busy take
//! [`testbed::exclusive`] (docs/architecture/testing.md).

mod affinity_members;
mod agent_http;
mod agent_restarts;
mod agent_upgrade;
mod auto_mode;
mod balancing_fixtures;
mod cluster;
mod cluster_flows;
mod conformance_model;
mod deploy_manifests;
mod detect_local_interface;
mod dsr_fixtures;
mod e2e_netns;
mod events;
mod flood;
mod fragment_fixtures;
mod host_traffic;
mod hostile_objects;
mod icmp_error_fixtures;
mod image;
mod iptables_conformance;
mod iptables_lab;
mod iptables_restore;
mod ipvs_conformance;
mod ipvs_kernel;
mod kube_proxy_config;
mod kube_source;
mod map_resize;
mod mode_switch;
mod network_policy;
mod next_hops;
mod nftables_lab;
mod packet_fixtures;
mod packet_fixtures_v6;
mod pod_sockets;
mod program_load;
mod reject_fixtures;
mod sctp_fixtures;
mod sctp_raw;
mod service_ownership;
mod xdp_e2e;
mod xdp_fixtures;

/// With `autotests = false` a file of this directory without its `mod` line above is not
/// compiled at all, and its tests silently never run.
#[test]
fn every_file_of_this_directory_is_a_module_of_the_binary() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let root = std::fs::read_to_string(dir.join("integration.rs")).expect("integration.rs");
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("tests/tests") {
        let path = entry.expect("a directory entry").path();
        let Some(module) = path.file_stem().and_then(|stem| stem.to_str()) else { continue };
        if path.extension().is_some_and(|extension| extension == "rs")
            && module != "integration"
            && !root.lines().any(|line| line.trim() == format!("mod {module};"))
        {
            missing.push(module.to_owned());
        }
    }
    assert!(missing.is_empty(), "tests/tests/integration.rs has no `mod` line for {missing:?}");
}
