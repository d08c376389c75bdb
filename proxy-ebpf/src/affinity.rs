//! ClientIP session affinity, shared by the TC path and the socket-level load balancer: a
//! client's new connection to a service port goes to the backend of its previous one, as long
//! as that one started less than the service's timeout ago and the service still has that
//! backend (the membership map answers, whatever backend set the service uses now).
use proxy_common::Service;

use crate::{family::Endpoint, family_maps::Maps};

const NS_PER_SEC: u64 = 1_000_000_000;

/// The slot of `service`'s current backend set that holds `client`'s remembered backend.
#[inline(always)]
pub fn remembered_slot<A: Maps>(service: &Service, client: &A, now: u64) -> Option<u32> {
    if service.affinity_timeout == 0 {
        return None;
    }
    let (backend, since) = A::affinity(service.service_id, client)?;
    if now.wrapping_sub(since) >= u64::from(service.affinity_timeout) * NS_PER_SEC {
        return None;
    }
    A::slot_of(service.backend_set, &backend)
}

/// Remembers the backend of `client`'s new connection, as kube-proxy's `recent --set` does on
/// every new connection: the timeout runs from the latest one.
#[inline(always)]
pub fn remember<A: Maps>(service: &Service, client: &A, backend: &Endpoint<A>, now: u64) {
    if service.affinity_timeout != 0 {
        A::remember(service.service_id, client, backend, now);
    }
}
