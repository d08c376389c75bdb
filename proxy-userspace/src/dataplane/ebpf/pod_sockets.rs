//! Socket-level balancing for pods (`--bpf-socket-lb-pods`, `--pods-cgroup`): which sockets
//! the cgroup hooks treat as a pod's (proxy-ebpf/src/sock.rs, `vipr_skpods_v1`).
//!
//! A pod's `connect()` or `sendmsg()` to a cluster IP is then sent to the backend once, in the
//! system call, so its packets need no NAT at all, as the node's own are; `getpeername` and
//! `recvmsg` still show the cluster IP. The hooks are attached at the cgroup root, where they
//! run for every process of the machine whatever its network namespace, so "a pod" has to
//! mean this node's pods and nothing else: the processes under the kubelet's pod cgroup
//! (`kubepods.slice` with the systemd cgroup driver, `kubepods` with cgroupfs), or the
//! directory given. Without one, pods' packets are balanced by the TC path as before.
//!
//! The hooks compare the calling task's ancestor at the cgroup's depth with the cgroup's id
//! (its inode number in cgroup v2), both in the cgroup hierarchy as the kernel has it: the
//! directory must be a path under the host's cgroup2 mount (a DaemonSet mounts the host's
//! /sys/fs/cgroup, as for `--cgroup-root`).
use std::{
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context as _};
use proxy_common::SockPods;

/// What the operator asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodSocketOptions {
    /// `--bpf-socket-lb-pods` (default on).
    pub enabled: bool,
    /// `--pods-cgroup`; `None`: the kubelet's pod cgroup under the cgroup2 mount, if any.
    pub cgroup: Option<PathBuf>,
}

impl Default for PodSocketOptions {
    fn default() -> Self {
        Self { enabled: true, cgroup: None }
    }
}

/// The kubelet's pod cgroup names: the systemd cgroup driver's, then cgroupfs'.
const KUBELET_POD_CGROUPS: [&str; 2] = ["kubepods.slice", "kubepods"];

/// The hooks' setting for `options` on a cgroup2 hierarchy mounted at `mount`, and the
/// directory it names (`None`: no pod is balanced at the socket level). A directory given
/// explicitly that cannot be used is an error; one that is merely absent when detected is not.
pub fn resolve(options: &PodSocketOptions, mount: &Path) -> anyhow::Result<(SockPods, Option<PathBuf>)> {
    if !options.enabled {
        return Ok((SockPods::default(), None));
    }
    let cgroup = match &options.cgroup {
        Some(cgroup) => cgroup.clone(),
        None => match KUBELET_POD_CGROUPS.iter().map(|name| mount.join(name)).find(|path| path.is_dir()) {
            Some(cgroup) => cgroup,
            None => return Ok((SockPods::default(), None)),
        },
    };
    let relative = cgroup.strip_prefix(mount).with_context(|| {
        format!("--pods-cgroup {} is not under the cgroup2 mount {}", cgroup.display(), mount.display())
    })?;
    let metadata = std::fs::metadata(&cgroup)
        .with_context(|| format!("cannot read the pods' cgroup {}", cgroup.display()))?;
    if !metadata.is_dir() {
        bail!("the pods' cgroup {} is not a directory", cgroup.display());
    }
    let level = relative.components().count();
    if level == 0 {
        bail!(
            "the pods' cgroup cannot be the cgroup2 root {}: every process would count as a pod",
            mount.display()
        );
    }
    let level = u32::try_from(level).context("the pods' cgroup is nested too deep")?;
    Ok((SockPods { cgroup_id: metadata.ino(), level, pad: 0 }, Some(cgroup)))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A scratch directory, removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new() -> Self {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!("vipr-pod-sockets-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&path).unwrap();
            Self(path)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A stand-in hierarchy with the cgroupfs driver's pod cgroup and a QoS class below it.
    fn hierarchy() -> Scratch {
        let root = Scratch::new();
        std::fs::create_dir_all(root.path().join("kubepods/burstable")).unwrap();
        root
    }

    #[test]
    fn the_kubelets_pod_cgroup_is_found_and_named_by_its_inode_and_depth() {
        let root = hierarchy();
        let (pods, cgroup) = resolve(&PodSocketOptions::default(), root.path()).unwrap();
        let expected = root.path().join("kubepods");
        assert_eq!(cgroup.as_deref(), Some(expected.as_path()));
        assert_eq!(pods.cgroup_id, std::fs::metadata(&expected).unwrap().ino());
        assert_eq!(pods.level, 1);

        let nested = PodSocketOptions { enabled: true, cgroup: Some(root.path().join("kubepods/burstable")) };
        assert_eq!(resolve(&nested, root.path()).unwrap().0.level, 2);
    }

    #[test]
    fn off_or_without_a_pod_cgroup_no_socket_is_a_pods() {
        let root = hierarchy();
        let off = PodSocketOptions { enabled: false, cgroup: None };
        assert_eq!(resolve(&off, root.path()).unwrap(), (SockPods::default(), None));
        let empty = Scratch::new();
        assert_eq!(resolve(&PodSocketOptions::default(), empty.path()).unwrap(), (SockPods::default(), None));
    }

    #[test]
    fn a_given_directory_outside_the_hierarchy_or_its_root_is_refused() {
        let root = hierarchy();
        let outside = Scratch::new();
        for cgroup in [outside.path().to_owned(), root.path().to_owned(), root.path().join("missing")] {
            let options = PodSocketOptions { enabled: true, cgroup: Some(cgroup.clone()) };
            assert!(resolve(&options, root.path()).is_err(), "{} was accepted", cgroup.display());
        }
    }
}
