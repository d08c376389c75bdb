//! Scratch files: manifests and logs of one lab.

use std::{
    io::Write,
    path::{Path, PathBuf},
    thread,
};

use anyhow::{Context, Result};

use crate::{temp_dir_leftovers, unique_name};

/// A fresh directory under the temp dir, removed on drop, except when the thread is
/// panicking: then it is kept (and its path printed) for a post-mortem, until the next run
/// with the same label.
#[derive(Debug)]
pub struct WorkDir {
    path: PathBuf,
}

impl WorkDir {
    pub fn create(label: &str) -> Result<Self> {
        for leftover in temp_dir_leftovers(label)? {
            if let Err(error) = std::fs::remove_dir_all(&leftover) {
                eprintln!("testbed: cannot remove {}: {error}", leftover.display());
            }
        }
        let path = std::env::temp_dir().join(unique_name(label));
        std::fs::create_dir(&path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!("testbed: kept {} for inspection", self.path.display());
        } else if let Err(error) = std::fs::remove_dir_all(&self.path) {
            eprintln!("testbed: cannot remove {}: {error}", self.path.display());
        }
    }
}

/// Replaces `path` with `contents` in one step (write a sibling, then rename over), so a
/// reader polling the file never sees it half-written.
pub fn write_atomically(path: &Path, contents: &str) -> Result<()> {
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = PathBuf::from(temporary);
    let mut file = std::fs::File::create(&temporary)
        .with_context(|| format!("cannot create {}", temporary.display()))?;
    file.write_all(contents.as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write {}", temporary.display()))?;
    std::fs::rename(&temporary, path)
        .with_context(|| format!("cannot rename {} to {}", temporary.display(), path.display()))
}
