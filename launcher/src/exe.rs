//! Finding the two programs the launcher runs.
//!
//! `pip install .` puts `sluice-launcher`, `sluice-router` and `sluice-server`
//! into the same bin folder, so the launcher looks next to itself first (the
//! right ones even when another Sluice is on PATH), then on PATH. The
//! variables SLUICE_SERVER_BIN / SLUICE_ROUTER_BIN override both.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

#[derive(Debug, Clone)]
pub struct Executables {
    pub server: PathBuf,
    pub router: PathBuf,
}

impl Executables {
    pub fn find() -> Result<Self> {
        let own_dir = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(Path::to_path_buf));
        let path = std::env::var_os("PATH");
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        Ok(Self {
            server: locate("sluice-server", var("SLUICE_SERVER_BIN"), own_dir.as_deref(), path.as_ref())?,
            router: locate("sluice-router", var("SLUICE_ROUTER_BIN"), own_dir.as_deref(), path.as_ref())?,
        })
    }
}

/// Override, else `own_dir/name`, else the first `name` on `path`.
fn locate(
    name: &str,
    override_: Option<OsString>,
    own_dir: Option<&Path>,
    path: Option<&OsString>,
) -> Result<PathBuf> {
    let env_var = format!("SLUICE_{}_BIN", name.trim_start_matches("sluice-").to_uppercase());
    if let Some(explicit) = override_ {
        let explicit = PathBuf::from(explicit);
        if !is_executable(&explicit) {
            bail!("{env_var}={} is not an executable file", explicit.display());
        }
        return Ok(explicit);
    }
    let beside = own_dir.map(|dir| dir.join(name));
    let on_path = path.into_iter().flat_map(std::env::split_paths).map(|dir| dir.join(name));
    if let Some(found) = beside.into_iter().chain(on_path).find(|p| is_executable(p)) {
        return Ok(found);
    }
    bail!(
        "cannot find `{name}` next to sluice-launcher or on PATH; install Sluice with `pip install .` \
         (it installs all three commands) or set {env_var}"
    )
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn make_exe(dir: &Path, name: &str) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sluice-exe-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn own_folder_beats_path_and_override_beats_both() {
        let root = temp_dir("order");
        let own = make_exe(&root.join("own"), "sluice-server");
        let on_path = make_exe(&root.join("path"), "sluice-server");
        let explicit = make_exe(&root.join("explicit"), "server-stand-in");
        let path = std::env::join_paths([root.join("path")]).unwrap();

        let found = locate("sluice-server", None, Some(&root.join("own")), Some(&path)).unwrap();
        assert_eq!(found, own);
        let found = locate("sluice-server", None, Some(&root.join("nowhere")), Some(&path)).unwrap();
        assert_eq!(found, on_path);
        let found =
            locate("sluice-server", Some(explicit.clone().into()), Some(&root.join("own")), Some(&path)).unwrap();
        assert_eq!(found, explicit);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn missing_programs_say_how_to_install() {
        let root = temp_dir("missing");
        let err = locate("sluice-router", None, Some(&root), None).unwrap_err().to_string();
        assert!(err.contains("pip install .") && err.contains("SLUICE_ROUTER_BIN"), "{err}");
        let err = locate("sluice-server", Some(root.join("nope").into()), None, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("SLUICE_SERVER_BIN=") && err.contains("not an executable"), "{err}");
    }
}
