//! Where Kubernetes objects come from. A source only delivers objects; it never sees the
//! dataplane or its errors.
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use crate::model::kubernetes::Rejection;

pub mod file;

/// Every Service and EndpointSlice the source currently knows, plus the objects it could
/// not even decode.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub rejected: Vec<Rejection>,
}

pub enum SourceEvent {
    /// A complete new view of the objects.
    Objects(Objects),
    /// The source cannot be read right now; the datapath keeps what it has.
    Unusable(String),
}
