//! Named network namespaces, and running code and processes inside them.

use std::{
    fs::File,
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
    thread,
};

use anyhow::{Context, Result};

use crate::cmd;

/// Where `ip netns add` bind-mounts a namespace so it outlives the processes in it.
const NETNS_RUN_DIR: &str = "/var/run/netns";

/// A named network namespace (`ip netns add`), deleted on drop.
///
/// Deleting only removes the name: the kernel frees the namespace, and the veths in it, once
/// no process or socket refers to it any more. Drop the processes and servers living in a
/// namespace before the namespace itself.
#[derive(Debug)]
pub struct Netns {
    name: String,
    /// Keeps tests that must run alone off while this namespace lives.
    _turn: crate::exclusive::Shared,
}

impl Netns {
    pub fn create(name: &str) -> Result<Self> {
        let turn = crate::exclusive::Shared::take();
        // The first `ip netns add` on a machine sets up the shared mount on /var/run/netns;
        // two of them racing there can fail, so creations from parallel tests take turns.
        static CREATION: Mutex<()> = Mutex::new(());
        let _turn = CREATION.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        cmd::run(Command::new("ip").args(["netns", "add", name]))?;
        let netns = Self { name: name.to_owned(), _turn: turn };
        netns.ip(&["link", "set", "lo", "up"])?;
        Ok(netns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace file that `setns()` takes.
    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_RUN_DIR).join(&self.name)
    }

    /// Runs `ip -n <this namespace> <args>` and returns its stdout.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        cmd::run(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// Writes a sysctl of this namespace; `key` is dotted (`net.ipv4.ip_forward`), so it
    /// cannot name interfaces that contain dots.
    pub fn set_sysctl(&self, key: &str, value: &str) -> Result<()> {
        // /proc/sys/net shows the namespace of the thread that opens it.
        let path = Path::new("/proc/sys").join(key.replace('.', "/"));
        self.run(|| {
            std::fs::write(&path, value)
                .with_context(|| format!("cannot set {key}={value} in netns {}", self.name))
        })
    }

    /// Runs `f` on a fresh thread that has entered this namespace and returns its result.
    /// Sockets `f` creates belong to this namespace for their whole life, whichever thread
    /// uses them later. A panic in `f` is resumed on the calling thread.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> Result<R> + Send) -> Result<R> {
        let namespace = self.open()?;
        let outcome = thread::scope(|scope| {
            scope
                .spawn(move || {
                    enter(&namespace).with_context(|| format!("cannot enter netns {}", self.name))?;
                    f()
                })
                .join()
        });
        outcome.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    /// A command that will run inside this namespace. The child enters it with `setns()`
    /// between fork and exec, so it keeps the caller's mounts (the bpffs in particular).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Result<Command> {
        let namespace = self.open()?;
        let mut command = Command::new(program);
        // SAFETY: the closure only makes the setns system call, which is async-signal-safe;
        // it allocates nothing and takes no locks.
        unsafe {
            command.pre_exec(move || enter(&namespace));
        }
        Ok(command)
    }

    fn open(&self) -> Result<File> {
        File::open(self.path()).with_context(|| format!("cannot open netns {}", self.name))
    }
}

/// Moves the calling thread (or the freshly forked child) into `namespace`.
fn enter(namespace: &File) -> std::io::Result<()> {
    // SAFETY: setns only reads the descriptor, which `namespace` keeps open.
    if unsafe { libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(error) = cmd::run(Command::new("ip").args(["netns", "del", &self.name])) {
            eprintln!("testbed: cannot delete netns {}: {error:#}", self.name);
        }
    }
}
