//! vipr's TC program: service load balancing at ingress of the node's interfaces.
//!
//! One program handles both directions of a connection, because it runs at ingress of every
//! interface vipr serves: client packets to a frontend arrive on one interface and are
//! DNATed to a backend; the backend's replies arrive on another and are reverse-NATed back
//! to the frontend. The flows map remembers each connection in both directions, so only the
//! first packet pays for the service lookup and backend choice.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(not(target_arch = "bpf"))]
fn main() {}

/// ClientIP session affinity, for both the TC and the socket paths.
#[cfg(target_arch = "bpf")]
mod affinity;
/// Flow entries: tracking, masquerade ports, early drop.
#[cfg(target_arch = "bpf")]
mod conntrack;
/// Per-connection and datapath counters.
#[cfg(target_arch = "bpf")]
mod counters;
/// Direct server return's IPv4 option.
#[cfg(target_arch = "bpf")]
mod dsr;
/// What an address family is (the bottom layer).
#[cfg(target_arch = "bpf")]
mod family;
/// Each family's maps in the datapath's terms.
#[cfg(target_arch = "bpf")]
mod family_maps;
/// Later IPv4 fragments, placed by their first fragment's ports.
#[cfg(target_arch = "bpf")]
mod fragment;
/// Reverse NAT of ICMP errors about tracked connections.
#[cfg(target_arch = "bpf")]
mod icmp_error;
/// The service decision every hook shares.
#[cfg(target_arch = "bpf")]
mod lb;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod packet;
#[cfg(target_arch = "bpf")]
mod reject;
#[cfg(target_arch = "bpf")]
mod route;
/// cgroup sock_addr programs: socket-level load balancing of the node's own traffic.
#[cfg(target_arch = "bpf")]
mod sock;
#[cfg(target_arch = "bpf")]
mod tc;
/// Header layout constants shared by every path.
#[cfg(target_arch = "bpf")]
mod wire;
/// The XDP fast path for traffic from outside the node.
#[cfg(target_arch = "bpf")]
mod xdp;

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any program that could reach a real panic; this only satisfies the
    // compiler.
    loop {}
}

#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
