//! Hearing of new network interfaces as they appear, through the kernel's link notifications
//! (rtnetlink's `RTMGRP_LINK` group), so that a new pod's veth is served before its first
//! packet: a poll once a second would let a pod's first DNS query through unbalanced. The
//! agent's poll stays as the fallback for notifications the kernel drops (a full socket
//! buffer) and for kernels that refuse the socket.
use std::{io, os::fd::AsRawFd as _, sync::mpsc::Sender, thread::JoinHandle};

use tracing::{debug, warn};

/// `RTMGRP_LINK`: the multicast group of link (interface) changes.
const RTMGRP_LINK: u32 = 1;

/// Starts a thread that calls `notify` whenever an interface of this network namespace is
/// added, changed or removed; it ends when `notify` returns false. `None` (logged) when the
/// notifications cannot be had: the caller's polling is then all there is.
pub fn watch(mut notify: impl FnMut() -> bool + Send + 'static) -> Option<JoinHandle<()>> {
    let socket = match open() {
        Ok(socket) => socket,
        Err(error) => {
            warn!("cannot subscribe to link notifications, new devices are found by polling: {error}");
            return None;
        }
    };
    let spawned = std::thread::Builder::new().name("links".into()).spawn(move || {
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: `buffer` is valid for writes of its length.
            let received =
                unsafe { libc::recv(socket.as_raw_fd(), buffer.as_mut_ptr().cast(), buffer.len(), 0) };
            if received < 0 {
                let error = io::Error::last_os_error();
                match error.raw_os_error() {
                    // Notifications were lost: something changed, look anyway.
                    Some(libc::ENOBUFS) => {}
                    Some(libc::EINTR) => continue,
                    _ => {
                        warn!("link notifications stopped, new devices are found by polling: {error}");
                        return;
                    }
                }
            }
            // Which link changed does not matter: the agent lists them all again.
            if !notify() {
                return;
            }
        }
    });
    match spawned {
        Ok(handle) => Some(handle),
        Err(error) => {
            warn!("cannot start the link notification thread, new devices are found by polling: {error}");
            None
        }
    }
}

fn open() -> io::Result<std::os::fd::OwnedFd> {
    let socket = crate::netlink::subscribe(RTMGRP_LINK)?;
    debug!("subscribed to link notifications");
    Ok(socket)
}

/// A `notify` for [`watch`] that sends `event()` on `channel`, until its receiver is gone.
pub fn sender<T: Send + 'static>(
    channel: Sender<T>,
    event: impl Fn() -> T + Send + 'static,
) -> impl FnMut() -> bool + Send + 'static {
    move || channel.send(event()).is_ok()
}
