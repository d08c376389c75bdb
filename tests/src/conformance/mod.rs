//! Conformance with kube-proxy: the packet-flow cases recorded from kube-proxy's own unit
//! tests (`tests/conformance/kube-proxy-flows/`), checked on the wire by the
//! `vipr-conformance` runner and against vipr's desired state by the model-level test
//! (`tests/tests/conformance_model.rs`). docs/conformance.md describes both.
//!
//! - [`case`]: the case format, read as recorded;
//! - [`objects`]: recorded objects -> the Services and EndpointSlices vipr is given (one
//!   conversion for the runner's services file and the model test);
//! - [`model`]: what vipr's desired state does with a flow;
//! - [`differences`]: the iptables-file flows where vipr follows nftables instead;
//! - [`flags`]: a case's node configuration as vipr flags;
//! - [`iptables`]: the flows `--mode=iptables` checks against kube-proxy's iptables backend;
//! - [`ipvs`]: `--mode=ipvs` on a kernel without IPVS, in a User-Mode Linux guest;
//! - [`lab`], [`probe`], [`run`]: the runner's network, its checks on the wire, and the loop.

pub mod case;
pub mod differences;
pub mod flags;
pub mod iptables;
pub mod ipvs;
pub mod lab;
pub mod model;
pub mod nftables;
pub mod objects;
pub mod probe;
pub mod run;
