//! Socket-level load balancing of the node's own traffic.
//!
//! Packets a node process sends never pass a TC ingress hook, so the TC program cannot balance
//! them. These cgroup sock_addr programs act one step earlier, in the system calls: `connect`
//! (TCP, connected UDP) and `sendmsg` (unconnected UDP) to a frontend are sent to a backend
//! instead, chosen from the frontend's entry for source class NODE; `recvmsg` and
//! `getpeername` turn the backend back into the frontend, from a reverse map keyed by the
//! socket's cookie and the backend. The connection itself is then an ordinary one between the
//! node and the backend: no per-packet work, no flow entry.
//!
//! cgroup hooks run for every socket of the cgroup, whatever its network namespace; every
//! program first checks that the socket lives in the agent's namespace (the cookie in
//! `vipr_skcfg_v1`) and leaves all other sockets alone.
use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use aya_ebpf::{
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_set_retval},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
    EbpfContext as _,
};
use proxy_common::{
    proto, service_flags, source_class, unmatched, Backend4, BackendSlot, Prefix4, ServiceKey4, SockConfig,
    SockFrontend4, SockRevKey4, SourceRange4,
};

use crate::maps::{BACKENDS4, SERVICES4, SOCK_CONFIG, SOCK_REVERSE4, SOURCE_RANGES4, UNMATCHED4};

/// Let the system call proceed (with whatever address the program left).
const ALLOW: i32 = 1;
/// Fail the system call: with EPERM, or with the error set by `bpf_set_retval` before.
const REFUSE: i32 = 0;
const ECONNREFUSED: i32 = 111;
const EAGAIN: i32 = 11;
const SOCK_STREAM: u32 = 1;
const SOCK_DGRAM: u32 = 2;

#[cgroup_sock_addr(connect4)]
pub fn vipr_connect4(ctx: SockAddrContext) -> i32 {
    translate::<false>(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn vipr_sendmsg4(ctx: SockAddrContext) -> i32 {
    translate::<true>(&ctx)
}

// The kernel requires recvmsg and getpeername programs to return 1.
#[cgroup_sock_addr(recvmsg4)]
pub fn vipr_recvmsg4(ctx: SockAddrContext) -> i32 {
    restore(&ctx);
    ALLOW
}

#[cgroup_sock_addr(getpeername4)]
pub fn vipr_getpeer4(ctx: SockAddrContext) -> i32 {
    restore(&ctx);
    ALLOW
}

/// The agent's settings, if the socket lives in the agent's network namespace.
#[inline(always)]
fn ours(ctx: &SockAddrContext) -> Option<SockConfig> {
    let config = SOCK_CONFIG.get(&0)?;
    // SAFETY: the helper only reads the context the kernel passed in.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    (config.netns_cookie != 0 && netns == config.netns_cookie).then_some(config)
}

// Context fields are read and written one at a time with their exact width: the kernel
// rewrites each access to the context and refuses merged or partial ones.

/// The address of the system call: where the socket connects or sends to, or, for recvmsg
/// and getpeername, the peer. Address bytes in network order, port in host order.
#[inline(always)]
fn user_addr(ctx: &SockAddrContext) -> ([u8; 4], u16) {
    let sa = ctx.sock_addr;
    // SAFETY: `sa` is the context the kernel passed; these fields are readable in every
    // sock_addr program.
    let (ip, port) =
        unsafe { (read_volatile(addr_of!((*sa).user_ip4)), read_volatile(addr_of!((*sa).user_port))) };
    // user_port holds the network-order port in its first two bytes.
    (ip.to_ne_bytes(), u16::from_be(port as u16))
}

#[inline(always)]
fn set_user_addr(ctx: &SockAddrContext, addr: [u8; 4], port: u16) {
    let sa = ctx.sock_addr;
    // SAFETY: as above; user_ip4 and user_port are writable in every sock_addr program.
    unsafe {
        write_volatile(addr_of_mut!((*sa).user_ip4), u32::from_ne_bytes(addr));
        write_volatile(addr_of_mut!((*sa).user_port), u32::from(port.to_be()));
    }
}

/// connect4 (`SENDMSG` false) and sendmsg4 (true): a frontend becomes one of its backends.
#[inline(always)]
fn translate<const SENDMSG: bool>(ctx: &SockAddrContext) -> i32 {
    let Some(config) = ours(ctx) else {
        return ALLOW;
    };
    let sa = ctx.sock_addr;
    // SAFETY: type and protocol are readable in every sock_addr program.
    let (kind, protocol) =
        unsafe { (read_volatile(addr_of!((*sa).type_)), read_volatile(addr_of!((*sa).protocol))) };
    let protocol = match (kind, protocol) {
        (SOCK_STREAM, 6) => proto::TCP,
        (SOCK_DGRAM, 17) => proto::UDP,
        // Raw sockets, SCTP, ICMP: the TC path's business, if anyone's.
        _ => return ALLOW,
    };
    let (addr, port) = user_addr(ctx);
    let frontend = ServiceKey4 { addr, port, proto: protocol, source_class: source_class::NODE };
    // SAFETY: the helper only reads the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // TCP and connected UDP choose once per socket, at random as the TC path does. An
    // unconnected UDP socket chooses per datagram, so the choice is a function of the socket:
    // its datagrams stay on one backend (while the set is unchanged), as conntrack keeps a
    // UDP 5-tuple on one endpoint.
    let pick = if SENDMSG { spread(cookie) } else { unsafe { bpf_get_prandom_u32() } };
    let backend = match choose::<SENDMSG>(ctx, &config, &frontend, pick) {
        Choice::Backend(backend) => backend,
        Choice::Verdict(verdict) => return verdict,
        // The agent retired the set between the two lookups; the new one is in place now.
        Choice::Retired => match choose::<SENDMSG>(ctx, &config, &frontend, pick) {
            Choice::Backend(backend) => backend,
            Choice::Verdict(verdict) => return verdict,
            Choice::Retired => return refuse(EAGAIN),
        },
    };
    remember(cookie, &backend, addr, port);
    set_user_addr(ctx, backend.addr, backend.port);
    ALLOW
}

enum Choice {
    Backend(Backend4),
    /// Not balanced: let the call through untouched, or refuse it.
    Verdict(i32),
    /// The chosen slot is gone: the backend set was replaced meanwhile.
    Retired,
}

#[inline(always)]
fn choose<const SENDMSG: bool>(
    ctx: &SockAddrContext,
    config: &SockConfig,
    frontend: &ServiceKey4,
    pick: u32,
) -> Choice {
    let Some(service) = SERVICES4.get(frontend) else {
        return Choice::Verdict(unmatched_destination(frontend.addr));
    };
    if service.flags & service_flags::SOURCE_RANGES != 0 {
        let admitted = SOURCE_RANGES4.contains(&SourceRange4 {
            prefix_len: 64,
            service_id: service.service_id.to_be_bytes(),
            addr: source::<SENDMSG>(ctx, config),
        });
        if !admitted {
            // A drop: a socket has no silent equivalent.
            return Choice::Verdict(REFUSE);
        }
    }
    if service.backend_count == 0 {
        return Choice::Verdict(if service.flags & service_flags::REJECT_WHEN_EMPTY != 0 {
            refuse(ECONNREFUSED)
        } else {
            REFUSE
        });
    }
    let slot = BackendSlot { backend_set: service.backend_set, slot: pick % service.backend_count };
    match BACKENDS4.get(&slot) {
        Some(backend) => Choice::Backend(backend),
        None => Choice::Retired,
    }
}

/// A cluster IP on a port it does not serve is refused as the TC path rejects it; another
/// address of a service range is refused too (a drop has no socket-level equivalent).
#[inline(always)]
fn unmatched_destination(addr: [u8; 4]) -> i32 {
    match UNMATCHED4.get(&Prefix4 { prefix_len: 32, addr }) {
        Some(unmatched::REJECT) => refuse(ECONNREFUSED),
        Some(unmatched::DROP) => REFUSE,
        _ => ALLOW,
    }
}

/// Fails the system call with `errno` (connect and sendmsg programs may set it).
#[inline(always)]
fn refuse(errno: i32) -> i32 {
    // SAFETY: plain helper call; it only sets the value the system call returns.
    unsafe { bpf_set_retval(-errno) };
    REFUSE
}

/// The address the socket sends from, for source ranges: the sendmsg's own source
/// (IP_PKTINFO), else the address the socket is bound to, else the node's default source
/// (the kernel picks the real one only after this program, by routing).
#[inline(always)]
fn source<const SENDMSG: bool>(ctx: &SockAddrContext, config: &SockConfig) -> [u8; 4] {
    let sa = ctx.sock_addr;
    let mut source = 0;
    if SENDMSG {
        // SAFETY: msg_src_ip4 is readable in sendmsg programs, and only those get here.
        source = unsafe { read_volatile(addr_of!((*sa).msg_src_ip4)) };
    }
    if source == 0 {
        // SAFETY: `sk` of a sock_addr context is never null; src_ip4 is readable.
        source = unsafe {
            let sk = read_volatile(addr_of!((*sa).__bindgen_anon_1.sk));
            read_volatile(addr_of!((*sk).src_ip4))
        };
    }
    if source == 0 {
        config.default_source4
    } else {
        source.to_ne_bytes()
    }
}

/// A well-mixed 32-bit value of a socket cookie (the splitmix64 finalizer): cookies are
/// sequential, so taking them modulo the backend count directly would go round robin.
#[inline(always)]
fn spread(cookie: u64) -> u32 {
    let mut z = cookie;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) as u32
}

/// Records which frontend the socket meant by `backend`. Written only when it differs, so
/// datagrams of an unconnected socket cost a lookup, not an update, each.
#[inline(always)]
fn remember(cookie: u64, backend: &Backend4, addr: [u8; 4], port: u16) {
    let key = SockRevKey4 { cookie, addr: backend.addr, port: backend.port, pad: 0 };
    let frontend = SockFrontend4 { addr, port, pad: 0 };
    if SOCK_REVERSE4.get(&key) != Some(frontend) {
        // A failure only means the peer shows as the backend.
        let _ = SOCK_REVERSE4.insert(&key, &frontend);
    }
}

/// recvmsg4 and getpeername4: a backend the socket was sent to shows as its frontend.
#[inline(always)]
fn restore(ctx: &SockAddrContext) {
    if ours(ctx).is_none() {
        return;
    }
    let (addr, port) = user_addr(ctx);
    // SAFETY: the helper only reads the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if let Some(frontend) = SOCK_REVERSE4.get(&SockRevKey4 { cookie, addr, port, pad: 0 }) {
        set_user_addr(ctx, frontend.addr, frontend.port);
    }
}
