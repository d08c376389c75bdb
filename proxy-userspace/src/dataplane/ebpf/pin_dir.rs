//! Where vipr's pins live on the bpffs, and how to remove them all.
use std::{
    ffi::CString,
    io,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use aya::programs::links::PinnedLink;
use proxy_common::pins;
use tracing::{info, warn};

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The pin layout under one `--bpf-root`.
#[derive(Clone, Debug)]
pub struct PinDir {
    root: PathBuf,
}

impl PinDir {
    pub fn new(bpf_root: &Path) -> Self {
        Self { root: bpf_root.join(pins::DIR) }
    }

    pub fn path(&self) -> &Path {
        &self.root
    }

    pub fn links(&self) -> PathBuf {
        self.root.join(pins::LINKS_DIR)
    }

    pub fn link(&self, device: &str) -> PathBuf {
        self.links().join(device)
    }

    /// Creates the directories, mounting a bpffs at `bpf_root` first when there is none.
    pub fn create(&self, bpf_root: &Path) -> anyhow::Result<()> {
        ensure_bpffs(bpf_root)?;
        std::fs::create_dir_all(self.links())
            .with_context(|| format!("cannot create {}", self.links().display()))
    }

    /// Detaches every pinned link and deletes every pin: after this no trace of vipr is left
    /// under the root. Returns how many pins were removed.
    pub fn remove_all(&self) -> anyhow::Result<usize> {
        let mut removed = 0;
        for link in entries(&self.links())? {
            // Unpinning drops the last reference to the link, which detaches the program.
            match PinnedLink::from_pin(&link) {
                Ok(pinned) => {
                    drop(pinned.unpin().with_context(|| format!("cannot unpin {}", link.display()))?);
                }
                Err(error) => {
                    warn!(pin = %link.display(), %error, "not a link; removing the pin");
                    std::fs::remove_file(&link)
                        .with_context(|| format!("cannot remove {}", link.display()))?;
                }
            }
            removed += 1;
        }
        remove_dir_if_present(&self.links())?;
        for pin in entries(&self.root)? {
            std::fs::remove_file(&pin).with_context(|| format!("cannot remove {}", pin.display()))?;
            removed += 1;
        }
        remove_dir_if_present(&self.root)?;
        info!(dir = %self.root.display(), removed, "removed vipr's pinned programs and maps");
        Ok(removed)
    }
}

fn entries(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    match std::fs::read_dir(dir) {
        Ok(read) => read
            .map(|entry| entry.map(|entry| entry.path()))
            .collect::<Result<_, _>>()
            .with_context(|| format!("cannot list {}", dir.display())),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(error) => Err(error).with_context(|| format!("cannot list {}", dir.display())),
    }
}

fn remove_dir_if_present(dir: &Path) -> anyhow::Result<()> {
    match std::fs::remove_dir(dir) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => {
            Err(error).with_context(|| format!("cannot remove {}", dir.display()))
        }
        _ => Ok(()),
    }
}

fn is_bpffs(path: &Path) -> io::Result<bool> {
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c_path is NUL-terminated and stat is a valid out-pointer.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stat.f_type as i64 == BPF_FS_MAGIC)
}

/// Pins only survive on a bpffs; on a plain directory they would fail (or, on tmpfs, vanish
/// from the kernel's view), so vipr mounts one itself like the kernel tools do.
fn ensure_bpffs(root: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(root).with_context(|| format!("cannot create {}", root.display()))?;
    if is_bpffs(root).with_context(|| format!("cannot stat {}", root.display()))? {
        return Ok(());
    }
    let target = CString::new(root.as_os_str().as_bytes())?;
    // SAFETY: all pointers are NUL-terminated strings that outlive the call.
    let result =
        unsafe { libc::mount(c"bpf".as_ptr(), target.as_ptr(), c"bpf".as_ptr(), 0, std::ptr::null()) };
    if result != 0 {
        return Err(io::Error::last_os_error())
            .with_context(|| format!("cannot mount a bpffs at {}", root.display()));
    }
    info!(root = %root.display(), "mounted a bpffs");
    Ok(())
}
