//! Where Kubernetes objects come from. A source only delivers objects; it never sees the
//! dataplane or its errors.
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

use crate::model::kubernetes::Rejection;

pub mod file;
pub mod kubernetes;

/// Every Service and EndpointSlice the source currently knows, this node's Node when the
/// source has one (the file source does not), plus the objects it could not even decode.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Objects {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub node: Option<Node>,
    pub rejected: Vec<Rejection>,
}

#[allow(
    clippy::large_enum_variant,
    reason = "a few events a second, each moved once through a channel: boxing would buy nothing"
)]
pub enum SourceEvent {
    /// A complete new view of the objects.
    Objects(Objects),
    /// The source cannot be read right now; the datapath keeps what it has.
    Unusable(String),
}
