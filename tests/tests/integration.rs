//! vipr's integration tests, one test binary: each file of this directory is a module of it
//! (`cargo test -p vipr-tests --test integration <module>::`), so the testbed and vipr are
//! linked once instead of once a file. Tests of different modules run at the same time in this
//! one process: each names its namespaces, mounts and directories with
//! [`testbed::unique_name`], and the ones that measure rates or hold the machine busy take
//! [`testbed::exclusive`] (docs/architecture/testing.md).

mod agent_http;
mod agent_restarts;
mod agent_upgrade;
mod auto_mode;
mod balancing_fixtures;
mod cluster;
mod conformance_model;
mod deploy_manifests;
mod detect_local_interface;
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
mod nftables_lab;
mod packet_fixtures;
mod packet_fixtures_v6;
mod reject_fixtures;
mod sctp_fixtures;
mod sctp_raw;
mod service_ownership;
mod xdp_e2e;
mod xdp_fixtures;
