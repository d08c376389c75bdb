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
//! program first checks whose socket it is and leaves all others alone: the node's (it lives
//! in the agent's namespace, the cookie in `vipr_skcfg_v2`), balanced as source class NODE,
//! or a pod's (the calling task lives under the pods' cgroup, `vipr_skpods_v1`,
//! `--bpf-socket-lb-pods`), balanced as source class POD. A pod's connection is translated
//! only where the TC path would do nothing else than choose the backend: a service that
//! masquerades the pod's traffic (a load-balancer IP with eTP:Cluster, `--masquerade-all`),
//! or that must see the pod's own address (source ranges, session affinity) while the socket
//! is not bound to it yet, is left to the TC path, so a pod sees kube-proxy's semantics either
//! way.
//!
//! The logic is written once for both families, as the TC path's is: [`SockAddress`] says
//! where a hook's context keeps its addresses, and the family's maps come from
//! [`crate::family_maps::Maps`] and [`Reverse`]. An `AF_INET6` socket may also talk to an
//! IPv4-mapped address (`::ffff:a.b.c.d`, a dual-stack socket): its packets are IPv4, so the
//! IPv6 hooks balance it with the IPv4 maps ([`Mapped4`]), as kube-proxy's IPv4 rules would.
use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use aya_ebpf::{
    bindings::{bpf_sock, bpf_sock_addr},
    helpers::{
        bpf_get_current_ancestor_cgroup_id, bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie,
        bpf_set_retval,
    },
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
    EbpfContext as _,
};
use proxy_common::{
    proto, service_flags, source_class, unmatched, Family, Service, SockConfig, SockFrontend4, SockFrontend6,
    SockRevKey4, SockRevKey6,
};

use crate::{
    family::{Address, Ipv4, Ipv6},
    family_maps::Maps,
    lb::{decide_for, Decision, Pick},
    maps::{SOCK_CONFIG, SOCK_PODS, SOCK_REVERSE4, SOCK_REVERSE6},
    packet::Tuple,
};

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
    translate::<Inet4, false>(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn vipr_sendmsg4(ctx: SockAddrContext) -> i32 {
    translate::<Inet4, true>(&ctx)
}

#[cgroup_sock_addr(connect6)]
pub fn vipr_connect6(ctx: SockAddrContext) -> i32 {
    if Mapped4::applies(&ctx) {
        translate::<Mapped4, false>(&ctx)
    } else {
        translate::<Inet6, false>(&ctx)
    }
}

// An unconnected `AF_INET6` socket sending to an IPv4-mapped address is handed to the IPv4
// send path by the kernel before this hook runs, and meets sendmsg4 there; this one only sees
// IPv6 destinations.
#[cgroup_sock_addr(sendmsg6)]
pub fn vipr_sendmsg6(ctx: SockAddrContext) -> i32 {
    translate::<Inet6, true>(&ctx)
}

// The kernel requires recvmsg and getpeername programs to return 1.
#[cgroup_sock_addr(recvmsg4)]
pub fn vipr_recvmsg4(ctx: SockAddrContext) -> i32 {
    restore::<Inet4>(&ctx);
    ALLOW
}

#[cgroup_sock_addr(getpeername4)]
pub fn vipr_getpeer4(ctx: SockAddrContext) -> i32 {
    restore::<Inet4>(&ctx);
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn vipr_recvmsg6(ctx: SockAddrContext) -> i32 {
    restore6(&ctx);
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn vipr_getpeer6(ctx: SockAddrContext) -> i32 {
    restore6(&ctx);
    ALLOW
}

#[inline(always)]
fn restore6(ctx: &SockAddrContext) {
    if Mapped4::applies(ctx) {
        restore::<Mapped4>(ctx);
    } else {
        restore::<Inet6>(ctx);
    }
}

/// Whose socket a hook met: the agent's settings and the source class the socket is balanced
/// as.
#[derive(Clone, Copy)]
struct Caller {
    config: SockConfig,
    class: u8,
}

/// The agent's settings and the socket's class, if the socket is the node's (it lives in the
/// agent's network namespace) or, with pods balanced at the socket level, a pod's (the calling
/// task lives under the pods' cgroup).
#[inline(always)]
fn ours(ctx: &SockAddrContext) -> Option<Caller> {
    let config = SOCK_CONFIG.get(&0)?;
    // SAFETY: the helper only reads the context the kernel passed in.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    if config.netns_cookie != 0 && netns == config.netns_cookie {
        return Some(Caller { config, class: source_class::NODE });
    }
    let pods = SOCK_PODS.get(&0)?;
    if pods.cgroup_id == 0 {
        return None;
    }
    // SAFETY: a plain helper call about the current task; 0 when it has no ancestor at `level`.
    let ancestor = unsafe { bpf_get_current_ancestor_cgroup_id(pods.level as i32) };
    (ancestor == pods.cgroup_id).then_some(Caller { config, class: source_class::POD })
}

// Context fields are read and written one at a time with their exact width: the kernel
// rewrites each access to the context and refuses merged or partial ones (so an IPv6 address
// is four 32-bit accesses, never one 128-bit one).

/// Where one kind of hook keeps the addresses of its system call, and which family's maps
/// balance them. Addresses are network-order bytes, as the maps store them.
trait SockAddress {
    type Addr: Maps + Reverse;
    /// The address of the system call: where the socket connects or sends to, or, for recvmsg
    /// and getpeername, the peer.
    fn user(ctx: &SockAddrContext) -> Self::Addr;
    fn set_user(ctx: &SockAddrContext, addr: Self::Addr);
    /// The sendmsg's own source (`IP_PKTINFO`, `IPV6_PKTINFO`); unspecified without one. Only
    /// sendmsg programs may read it.
    fn msg_source(ctx: &SockAddrContext) -> Self::Addr;
    /// The address the socket is bound to; unspecified if none.
    fn bound_source(ctx: &SockAddrContext) -> Self::Addr;
}

/// `AF_INET` sockets: the `*4` fields.
struct Inet4;
/// `AF_INET6` sockets talking IPv6: the `*6` fields.
struct Inet6;
/// `AF_INET6` sockets talking to an IPv4-mapped address: the `*6` fields, the IPv4 maps.
struct Mapped4;

impl SockAddress for Inet4 {
    type Addr = Ipv4;

    #[inline(always)]
    fn user(ctx: &SockAddrContext) -> Ipv4 {
        // SAFETY: `sock_addr` is the context the kernel passed; user_ip4 is readable in every
        // sock_addr program.
        unsafe { read_volatile(addr_of!((*ctx.sock_addr).user_ip4)) }.to_ne_bytes()
    }

    #[inline(always)]
    fn set_user(ctx: &SockAddrContext, addr: Ipv4) {
        // SAFETY: as above; user_ip4 is writable in every IPv4 sock_addr program.
        unsafe { write_volatile(addr_of_mut!((*ctx.sock_addr).user_ip4), u32::from_ne_bytes(addr)) }
    }

    #[inline(always)]
    fn msg_source(ctx: &SockAddrContext) -> Ipv4 {
        // SAFETY: msg_src_ip4 is readable in sendmsg4 programs, the only callers.
        unsafe { read_volatile(addr_of!((*ctx.sock_addr).msg_src_ip4)) }.to_ne_bytes()
    }

    #[inline(always)]
    fn bound_source(ctx: &SockAddrContext) -> Ipv4 {
        // SAFETY: `sk` of a sock_addr context is never null; src_ip4 is readable.
        unsafe { read_volatile(addr_of!((*sock(ctx)).src_ip4)) }.to_ne_bytes()
    }
}

impl SockAddress for Inet6 {
    type Addr = Ipv6;

    #[inline(always)]
    fn user(ctx: &SockAddrContext) -> Ipv6 {
        // SAFETY: user_ip6 is readable in every IPv6 sock_addr program.
        unsafe { read_words(addr_of!((*ctx.sock_addr).user_ip6)) }
    }

    #[inline(always)]
    fn set_user(ctx: &SockAddrContext, addr: Ipv6) {
        // SAFETY: user_ip6 is writable, word by word, in every IPv6 sock_addr program.
        unsafe { write_words(addr_of_mut!((*ctx.sock_addr).user_ip6), addr) }
    }

    #[inline(always)]
    fn msg_source(ctx: &SockAddrContext) -> Ipv6 {
        // SAFETY: msg_src_ip6 is readable in sendmsg6 programs, the only callers.
        unsafe { read_words(addr_of!((*ctx.sock_addr).msg_src_ip6)) }
    }

    #[inline(always)]
    fn bound_source(ctx: &SockAddrContext) -> Ipv6 {
        // SAFETY: as for Inet4; src_ip6 is readable.
        unsafe { read_words(addr_of!((*sock(ctx)).src_ip6)) }
    }
}

/// `::ffff:0:0/96` as the third 32-bit word of an IPv6 address (the first two are zero).
const MAPPED_WORD: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

impl Mapped4 {
    /// Whether the address of an IPv6 hook's system call is IPv4-mapped.
    #[inline(always)]
    fn applies(ctx: &SockAddrContext) -> bool {
        // SAFETY: user_ip6 is readable in every IPv6 sock_addr program.
        unsafe { unmapped(addr_of!((*ctx.sock_addr).user_ip6)) }.is_some()
    }
}

impl SockAddress for Mapped4 {
    type Addr = Ipv4;

    #[inline(always)]
    fn user(ctx: &SockAddrContext) -> Ipv4 {
        // SAFETY: as for Inet6. Only called once `applies` held, so never unspecified.
        unsafe { unmapped(addr_of!((*ctx.sock_addr).user_ip6)) }.unwrap_or([0; 4])
    }

    #[inline(always)]
    fn set_user(ctx: &SockAddrContext, addr: Ipv4) {
        let mapped = [0, 0, MAPPED_WORD, u32::from_ne_bytes(addr)];
        // SAFETY: same size; the words hold the bytes in network order.
        Inet6::set_user(ctx, unsafe { core::mem::transmute::<[u32; 4], Ipv6>(mapped) });
    }

    #[inline(always)]
    fn msg_source(ctx: &SockAddrContext) -> Ipv4 {
        // SAFETY: as for Inet6.
        unsafe { unmapped(addr_of!((*ctx.sock_addr).msg_src_ip6)) }.unwrap_or([0; 4])
    }

    #[inline(always)]
    fn bound_source(ctx: &SockAddrContext) -> Ipv4 {
        // SAFETY: as for Inet6. A socket bound to an IPv6 address cannot send IPv4 at all; it
        // counts as unbound.
        unsafe { unmapped(addr_of!((*sock(ctx)).src_ip6)) }.unwrap_or([0; 4])
    }
}

/// The socket of a sock_addr context.
#[inline(always)]
fn sock(ctx: &SockAddrContext) -> *mut bpf_sock {
    // SAFETY: `sk` is readable in every sock_addr program and never null there.
    unsafe { read_volatile(addr_of!((*ctx.sock_addr).__bindgen_anon_1.sk)) }
}

/// An IPv6 address of a context (four network-order words) as bytes.
///
/// # Safety
/// `words` must be a readable IPv6 address field of the program's context.
#[inline(always)]
unsafe fn read_words(words: *const [u32; 4]) -> Ipv6 {
    let word = words.cast::<u32>();
    let words = unsafe {
        [
            read_volatile(word),
            read_volatile(word.add(1)),
            read_volatile(word.add(2)),
            read_volatile(word.add(3)),
        ]
    };
    // SAFETY: same size; the words hold the bytes in network order.
    unsafe { core::mem::transmute::<[u32; 4], Ipv6>(words) }
}

/// # Safety
/// `words` must be a writable IPv6 address field of the program's context.
#[inline(always)]
unsafe fn write_words(words: *mut [u32; 4], addr: Ipv6) {
    // SAFETY: same size; the words keep the bytes in network order.
    let addr = unsafe { core::mem::transmute::<Ipv6, [u32; 4]>(addr) };
    let word = words.cast::<u32>();
    unsafe {
        write_volatile(word, addr[0]);
        write_volatile(word.add(1), addr[1]);
        write_volatile(word.add(2), addr[2]);
        write_volatile(word.add(3), addr[3]);
    }
}

/// The IPv4 address of an IPv4-mapped IPv6 address field, `None` for any other address.
///
/// # Safety
/// As [`read_words`].
#[inline(always)]
unsafe fn unmapped(words: *const [u32; 4]) -> Option<Ipv4> {
    let word = words.cast::<u32>();
    let mapped = unsafe {
        read_volatile(word) == 0
            && read_volatile(word.add(1)) == 0
            && read_volatile(word.add(2)) == MAPPED_WORD
    };
    mapped.then(|| unsafe { read_volatile(word.add(3)) }.to_ne_bytes())
}

/// An address and port of a system call: a frontend, or the backend it became.
#[derive(Clone, Copy)]
struct Peer<A> {
    addr: A,
    port: u16,
}

/// The port of the system call, host order: `user_port` holds the network-order port in its
/// first two bytes, in both families.
#[inline(always)]
fn user_port(ctx: &SockAddrContext) -> u16 {
    // SAFETY: user_port is readable in every sock_addr program.
    u16::from_be(unsafe { read_volatile(addr_of!((*ctx.sock_addr).user_port)) } as u16)
}

#[inline(always)]
fn set_user_addr<S: SockAddress>(ctx: &SockAddrContext, endpoint: &Peer<S::Addr>) {
    S::set_user(ctx, endpoint.addr);
    let sa: *mut bpf_sock_addr = ctx.sock_addr;
    // SAFETY: user_port is writable in every sock_addr program.
    unsafe { write_volatile(addr_of_mut!((*sa).user_port), u32::from(endpoint.port.to_be())) };
}

/// connect (`SENDMSG` false) and sendmsg (true): a frontend becomes one of its backends.
#[inline(always)]
fn translate<S: SockAddress, const SENDMSG: bool>(ctx: &SockAddrContext) -> i32 {
    let Some(caller) = ours(ctx) else {
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
    let frontend = Tuple {
        src: S::Addr::UNSPECIFIED,
        dst: S::user(ctx),
        src_port: 0,
        dst_port: user_port(ctx),
        proto: protocol,
    };
    // SAFETY: the helper only reads the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // TCP and connected UDP choose once per socket, at random as the TC path does. An
    // unconnected UDP socket chooses per datagram, so the choice is a function of the socket:
    // its datagrams stay on one backend (while the set is unchanged), as conntrack keeps a
    // UDP 5-tuple on one endpoint.
    let pick = if SENDMSG { spread(cookie) } else { unsafe { bpf_get_prandom_u32() } };
    let backend = match choose::<S, SENDMSG>(ctx, &caller, &frontend, pick) {
        Choice::Backend(backend) => backend,
        Choice::Verdict(verdict) => return verdict,
        // The agent retired the set between the two lookups; the new one is in place now.
        Choice::Retired => match choose::<S, SENDMSG>(ctx, &caller, &frontend, pick) {
            Choice::Backend(backend) => backend,
            Choice::Verdict(verdict) => return verdict,
            Choice::Retired => return refuse(EAGAIN),
        },
    };
    remember(cookie, &backend, &Peer { addr: frontend.dst, port: frontend.dst_port });
    set_user_addr::<S>(ctx, &backend);
    ALLOW
}

enum Choice<A> {
    Backend(Peer<A>),
    /// Not balanced: let the call through untouched, or refuse it.
    Verdict(i32),
    /// The chosen slot is gone: the backend set was replaced meanwhile.
    Retired,
}

#[inline(always)]
fn choose<S: SockAddress, const SENDMSG: bool>(
    ctx: &SockAddrContext,
    caller: &Caller,
    frontend: &Tuple<S::Addr>,
    pick: u32,
) -> Choice<S::Addr> {
    // Looked up here, not in `decide`: a pod's socket asks its entry first whether it is
    // translated at all, and one lookup serves both.
    let Some(service) = S::Addr::service(&frontend.destination(), frontend.proto, caller.class) else {
        return Choice::Verdict(unmatched_destination(&frontend.dst));
    };
    if caller.class == source_class::POD && !pod_translates::<S, SENDMSG>(ctx, &service) {
        return Choice::Verdict(ALLOW);
    }
    // Source ranges and session affinity see the socket's source. Every node process shares
    // the node's address, so with session affinity they share one backend, as behind
    // kube-proxy.
    let client = source::<S, SENDMSG>(ctx, &caller.config);
    match decide_for(service, &client, Pick::Given(pick)) {
        Decision::Backend(chosen) => {
            Choice::Backend(Peer { addr: chosen.backend.addr, port: chosen.backend.port })
        }
        // A drop: a socket has no silent equivalent.
        Decision::SourceDenied => Choice::Verdict(REFUSE),
        Decision::NoBackend(service) => {
            Choice::Verdict(if service.flags & service_flags::REJECT_WHEN_EMPTY != 0 {
                refuse(ECONNREFUSED)
            } else {
                REFUSE
            })
        }
        Decision::Retired => Choice::Retired,
    }
}

/// Whether a pod's socket is translated here: the service's POD entry neither masquerades
/// the pod's traffic (the backend must see the node's address, which only the TC path gives
/// it) nor needs the pod's address (source ranges, session affinity) that a socket not bound
/// yet does not show. (A frontend without a POD entry goes on to the unmatched-destination
/// check, as the node's sockets do.)
#[inline(always)]
fn pod_translates<S: SockAddress, const SENDMSG: bool>(ctx: &SockAddrContext, service: &Service) -> bool {
    if service.flags & service_flags::MASQUERADE != 0 {
        return false;
    }
    let needs_source = service.flags & service_flags::SOURCE_RANGES != 0 || service.affinity_timeout != 0;
    let unspecified = S::Addr::UNSPECIFIED;
    let known = (SENDMSG && !S::msg_source(ctx).is(&unspecified)) || !S::bound_source(ctx).is(&unspecified);
    !needs_source || known
}

/// A cluster IP on a port it does not serve is refused as the TC path rejects it; another
/// address of a service range is refused too (a drop has no socket-level equivalent).
#[inline(always)]
fn unmatched_destination<A: Maps>(addr: &A) -> i32 {
    match A::unmatched(addr) {
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

/// The address the socket sends from, for source ranges: the sendmsg's own source, else the
/// address the socket is bound to, else the node's default source of the family (the kernel
/// picks the real one only after this program, by routing).
#[inline(always)]
fn source<S: SockAddress, const SENDMSG: bool>(ctx: &SockAddrContext, config: &SockConfig) -> S::Addr {
    let unspecified = S::Addr::UNSPECIFIED;
    let mut source = unspecified;
    if SENDMSG {
        source = S::msg_source(ctx);
    }
    if source.is(&unspecified) {
        source = S::bound_source(ctx);
    }
    if source.is(&unspecified) {
        S::Addr::default_source(config)
    } else {
        source
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
fn remember<A: Maps + Reverse>(cookie: u64, backend: &Peer<A>, frontend: &Peer<A>) {
    let known = A::frontend_of(cookie, backend);
    if !known.is_some_and(|known| known.port == frontend.port && known.addr.is(&frontend.addr)) {
        A::store_frontend(cookie, backend, frontend);
    }
}

/// recvmsg and getpeername: a backend the socket was sent to shows as its frontend.
#[inline(always)]
fn restore<S: SockAddress>(ctx: &SockAddrContext) {
    if ours(ctx).is_none() {
        return;
    }
    let backend = Peer { addr: S::user(ctx), port: user_port(ctx) };
    // SAFETY: the helper only reads the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if let Some(frontend) = S::Addr::frontend_of(cookie, &backend) {
        set_user_addr::<S>(ctx, &frontend);
    }
}

/// A family's share of the socket load balancer's own maps: its default source and its
/// reverse translations.
trait Reverse: Sized {
    fn default_source(config: &SockConfig) -> Self;
    /// The frontend a socket meant when it was sent to `backend`.
    fn frontend_of(cookie: u64, backend: &Peer<Self>) -> Option<Peer<Self>>;
    /// A failure only means the peer shows as the backend.
    fn store_frontend(cookie: u64, backend: &Peer<Self>, frontend: &Peer<Self>);
}

/// Implements [`Reverse`] for one family; proxy-common's types of both have the same fields
/// (the padding differs, hence `..Default::default()`).
macro_rules! reverse_map {
    ($addr:ty, $default_source:ident, $map:ident($key:ident -> $value:ident)) => {
        impl Reverse for $addr {
            #[inline(always)]
            fn default_source(config: &SockConfig) -> Self {
                config.$default_source
            }

            #[inline(always)]
            fn frontend_of(cookie: u64, backend: &Peer<Self>) -> Option<Peer<Self>> {
                let key = $key { cookie, addr: backend.addr, port: backend.port, ..Default::default() };
                $map.get(&key).map(|frontend| Peer { addr: frontend.addr, port: frontend.port })
            }

            #[inline(always)]
            fn store_frontend(cookie: u64, backend: &Peer<Self>, frontend: &Peer<Self>) {
                let key = $key { cookie, addr: backend.addr, port: backend.port, ..Default::default() };
                let value = $value { addr: frontend.addr, port: frontend.port, ..Default::default() };
                let _ = $map.insert(&key, &value);
            }
        }
    };
}

reverse_map!(Ipv4, default_source4, SOCK_REVERSE4(SockRevKey4 -> SockFrontend4));
reverse_map!(Ipv6, default_source6, SOCK_REVERSE6(SockRevKey6 -> SockFrontend6));
