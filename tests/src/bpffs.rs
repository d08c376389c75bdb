//! A private bpffs mount, so every lab has its own pins and can remove them all at once.

use std::{
    ffi::CString,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};

use crate::{temp_dir_leftovers, unique_name};

/// A bpffs mounted on a fresh directory under the temp dir; unmounted and removed on drop,
/// which also releases every pin in it.
#[derive(Debug)]
pub struct BpfFs {
    path: PathBuf,
    /// Keeps tests that must run alone off while this mount lives.
    _turn: crate::exclusive::Shared,
}

impl BpfFs {
    pub fn mount(label: &str) -> Result<Self> {
        let turn = crate::exclusive::Shared::take();
        let prefix = format!("{label}-bpffs");
        remove_leftover_mounts(&prefix)?;
        let path = std::env::temp_dir().join(unique_name(&prefix));
        std::fs::create_dir(&path).with_context(|| format!("cannot create {}", path.display()))?;
        let target = c_path(&path)?;
        // SAFETY: all pointers are NUL-terminated strings that outlive the call; bpffs takes
        // no mount data.
        let mounted =
            unsafe { libc::mount(c"bpf".as_ptr(), target.as_ptr(), c"bpf".as_ptr(), 0, std::ptr::null()) };
        if mounted != 0 {
            let error = std::io::Error::last_os_error();
            let _ = std::fs::remove_dir(&path);
            return Err(error).with_context(|| format!("cannot mount bpffs on {}", path.display()));
        }
        Ok(Self { path, _turn: turn })
    }

    /// The mount point: what vipr takes as `--bpf-root`.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for BpfFs {
    fn drop(&mut self) {
        if let Err(error) = unmount_and_remove(&self.path) {
            eprintln!("testbed: cannot remove bpffs {}: {error:#}", self.path.display());
        }
    }
}

fn unmount_and_remove(path: &Path) -> Result<()> {
    unmount(path).context("cannot unmount")?;
    Ok(std::fs::remove_dir(path)?)
}

fn unmount(path: &Path) -> Result<()> {
    let target = c_path(path)?;
    // SAFETY: `target` is a NUL-terminated path that outlives the call. The unmount is lazy,
    // so it cannot fail because a pinned object is still in use.
    if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(())
}

/// Unmounts and removes the bpffs mounts of earlier runs with this prefix that were killed
/// before they could.
fn remove_leftover_mounts(prefix: &str) -> Result<()> {
    for path in temp_dir_leftovers(prefix)? {
        eprintln!("testbed: removing bpffs {}, left over by a killed run", path.display());
        // The killed run may have died before mounting it, leaving just the directory.
        let _ = unmount(&path);
        if let Err(error) = std::fs::remove_dir(&path) {
            eprintln!("testbed: cannot remove {}: {error}", path.display());
        }
    }
    Ok(())
}

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).context("path contains a NUL byte")
}
