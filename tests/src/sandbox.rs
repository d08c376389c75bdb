//! A node without BPF, simulated on any kernel: a seccomp filter that makes `bpf(2)` fail with
//! EPERM, as it does for a process without CAP_BPF or under a container runtime's default
//! profile. (A kernel built without CONFIG_BPF_SYSCALL answers ENOSYS instead; vipr's auto
//! mode treats both alike.) bpffs and /sys/fs/bpf stay visible: only the system call is denied,
//! which is why auto mode probes `bpf()` itself rather than the file system.
//!
//! The filter is installed on the calling thread only (no TSYNC): that thread and every thread
//! and process it starts afterwards are denied `bpf()`, the rest of the process is not. Tests
//! therefore install it on a thread of their own and start vipr from there.

use std::io;

/// The architecture of the filter's system call numbers (`AUDIT_ARCH_*` of linux/audit.h).
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;

/// Offsets in `struct seccomp_data`.
const SECCOMP_DATA_NR: u32 = 0;
const SECCOMP_DATA_ARCH: u32 = 4;

const LOAD_WORD: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
const JUMP_IF_EQUAL: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
const RETURN: u16 = (libc::BPF_RET | libc::BPF_K) as u16;

const fn statement(code: u16, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt: 0, jf: 0, k }
}

const fn jump(code: u16, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// `bpf()` of this architecture fails with EPERM; everything else is allowed (a system call of
/// another architecture too: it cannot be this one's `bpf`).
const DENY_BPF: [libc::sock_filter; 6] = [
    statement(LOAD_WORD, SECCOMP_DATA_ARCH),
    jump(JUMP_IF_EQUAL, AUDIT_ARCH, 0, 3),
    statement(LOAD_WORD, SECCOMP_DATA_NR),
    jump(JUMP_IF_EQUAL, libc::SYS_bpf as u32, 0, 1),
    statement(RETURN, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
    statement(RETURN, libc::SECCOMP_RET_ALLOW),
];

/// Denies `bpf()` to the calling thread and everything it starts from now on. It cannot be
/// undone: call it on a thread that exists for that purpose.
///
/// Only system calls, no allocation or locks: it is also safe in a `pre_exec` hook.
pub fn deny_bpf_to_this_thread() -> io::Result<()> {
    let program =
        libc::sock_fprog { len: DENY_BPF.len() as u16, filter: DENY_BPF.as_ptr() as *mut libc::sock_filter };
    // SAFETY: plain prctl calls; `program` and the filter it points to outlive them, and the
    // kernel copies the filter.
    unsafe {
        // Required for an unprivileged filter, harmless for root: the children cannot gain
        // privileges through setuid programs, which vipr and its tools do not use.
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            return Err(io::Error::last_os_error());
        }
        if libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &program as *const libc::sock_fprog)
            != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bpf_is_denied_only_where_the_filter_was_installed() {
        let bpf_errno = || {
            // SAFETY: BPF_PROG_LOAD with a NULL attribute: the kernel (or the filter) refuses
            // it without reading anything.
            let result = unsafe { libc::syscall(libc::SYS_bpf, 5, std::ptr::null_mut::<u8>(), 0) };
            assert_eq!(result, -1);
            io::Error::last_os_error().raw_os_error()
        };
        let outside = bpf_errno();
        let (inside, child_thread) = std::thread::spawn(move || {
            deny_bpf_to_this_thread().unwrap();
            (bpf_errno(), std::thread::spawn(bpf_errno).join().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(inside, Some(libc::EPERM));
        assert_eq!(child_thread, Some(libc::EPERM), "threads started afterwards inherit the filter");
        assert_ne!(bpf_errno(), Some(libc::EPERM), "other threads keep bpf() (before: {outside:?})");
    }
}
