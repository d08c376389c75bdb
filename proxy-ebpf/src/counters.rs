//! The datapath's counters: per (service port, backend) packets and bytes, read by the agent
//! for its metrics, and `proxy_common::datapath_stat`'s events. Per-CPU arrays, so a count is an
//! inlined array access: no hash lookup and no atomic operation.
use crate::maps::{BACKEND_COUNTERS, DATAPATH_STATS};

/// Adds one packet of `ip_bytes` (the IP packet, without the Ethernet header) to the
/// connection's (service port, backend) counters.
#[inline(always)]
pub(crate) fn count(counter: u32, ip_bytes: u64) {
    if let Some(counters) = BACKEND_COUNTERS.get_ptr(&counter) {
        let counters = counters.as_ptr();
        // SAFETY: this CPU's value of a live array element; nothing else writes it meanwhile.
        unsafe {
            (*counters).packets += 1;
            (*counters).bytes += ip_bytes;
        }
    }
}

/// Counts one of `proxy_common::datapath_stat`.
#[inline(always)]
pub(crate) fn stat(index: u32) {
    if let Some(value) = DATAPATH_STATS.get_ptr(&index) {
        // SAFETY: this CPU's value of a live array element.
        unsafe { *value.as_ptr() += 1 };
    }
}
