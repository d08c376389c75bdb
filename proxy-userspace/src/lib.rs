//! vipr: an eBPF Kubernetes service proxy. The binary is a thin shell around this library so
//! that integration tests and tools can drive the same code.

/// The kernel programs, built from proxy-ebpf by build.rs and embedded so that the agent and
/// its datapath always come from the same commit.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"));

pub mod agent;
pub mod bpf_sys;
pub mod cli;
pub mod config;
pub mod dataplane;
pub mod events;
pub mod health;
pub mod host;
pub mod http;
pub mod inspect;
pub mod metrics;
pub mod model;
pub mod netlink;
pub mod probe;
pub mod settings;
pub mod source;
pub mod status;
pub mod tool;
pub mod tuning;
