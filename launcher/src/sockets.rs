//! Where the shards' unix sockets live.
//!
//! A shard obeys whoever connects to its socket (Warmup, Step, ClearCache),
//! and whoever binds a socket path first can pose as the shard. So, unless
//! `--shard-uds-path` names a path, the sockets go into a folder made for
//! this launcher alone:
//!
//! ```text
//! $XDG_RUNTIME_DIR/sluice-XXXXXX/      mode 0700, made by mkdtemp(3); the temp
//!     shard-0  shard-1 ...             dir when XDG_RUNTIME_DIR is unset.
//!                                      Sockets are 0600 (the shard binds them
//!                                      under umask 077). Removed at exit.
//! ```
//!
//! With `--shard-uds-path` the operator chose the folder; the sockets are
//! still 0600.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::args::Args;

/// The socket path of every rank; owns the private folder, if one was made.
#[derive(Debug)]
pub struct ShardSockets {
    /// Shard RANK listens on `{base}-{RANK}`.
    base: PathBuf,
    private_dir: Option<PathBuf>,
}

impl ShardSockets {
    pub fn new(args: &Args) -> Result<Self> {
        match &args.shard_uds_path {
            Some(base) => Ok(Self { base: PathBuf::from(base), private_dir: None }),
            None => Self::private_in(&runtime_dir()),
        }
    }

    /// Sockets in a fresh 0700 folder inside `parent`.
    pub fn private_in(parent: &Path) -> Result<Self> {
        let dir = nix::unistd::mkdtemp(&parent.join("sluice-XXXXXX"))
            .with_context(|| format!("cannot create a private socket folder in {}", parent.display()))?;
        Ok(Self { base: dir.join("shard"), private_dir: Some(dir) })
    }

    /// What `sluice-server serve --uds-path` gets.
    pub fn base(&self) -> &Path {
        &self.base
    }

    /// `{base}-{rank}`: the socket file shard `rank` listens on.
    pub fn socket(&self, rank: u32) -> PathBuf {
        PathBuf::from(format!("{}-{rank}", self.base.display()))
    }
}

impl Drop for ShardSockets {
    fn drop(&mut self) {
        if let Some(dir) = &self.private_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The per-user runtime folder when the session has one (a tmpfs only its
/// user can enter), else the temp dir.
fn runtime_dir() -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|dir| dir.is_absolute() && dir.is_dir())
        .unwrap_or_else(std::env::temp_dir)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::args::test_args;

    #[test]
    fn the_default_folder_is_private_and_removed_at_the_end() {
        let parent = std::env::temp_dir();
        let sockets = ShardSockets::private_in(&parent).unwrap();
        let dir = sockets.base().parent().unwrap().to_path_buf();
        assert!(dir.starts_with(&parent) && dir.file_name().unwrap().to_string_lossy().starts_with("sluice-"));
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(sockets.socket(2), dir.join("shard-2"));
        let other = ShardSockets::private_in(&parent).unwrap();
        assert_ne!(other.base(), sockets.base(), "each launcher gets its own folder");
        std::fs::write(sockets.socket(0), "").unwrap();
        drop(sockets);
        assert!(!dir.exists());
    }

    #[test]
    fn a_given_path_is_used_as_is_and_never_removed() {
        let args = test_args(&["--shard-uds-path", "/srv/sluice/s"]);
        let sockets = ShardSockets::new(&args).unwrap();
        assert_eq!(sockets.base(), Path::new("/srv/sluice/s"));
        assert_eq!(sockets.socket(0), PathBuf::from("/srv/sluice/s-0"));
        assert!(sockets.private_dir.is_none());
    }
}
