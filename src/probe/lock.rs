//! One probe run at a time on a machine: the CLI's `probe` and `doctor --probe`, the service's
//! boot and idle probes and D-Bus `RunProbes` all take `<state_dir>/probe.lock` (an `flock`, so
//! the kernel drops it when the holder dies, `kill -9` included). Two runs at once would halve
//! each other's bandwidth and fail healthy GPUs; the second caller is told who holds it.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Held while probes run.
#[derive(Debug)]
pub struct RunLock {
    _file: Option<File>,
}

/// Why a run may not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("another probe run is in progress ({holder}; it holds {path}): one run at a time, or the runs halve each other's bandwidth")]
pub struct Held {
    pub holder: String,
    pub path: PathBuf,
}

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("probe.lock")
}

/// Takes the lock for `who` ("phq-agent probe", "D-Bus RunProbes", …) without waiting. A state
/// directory this user cannot write (a probe run by a non-root user) still locks through a
/// read-only open of an existing lock file; with no lock file to open at all the run goes ahead
/// unlocked, with a warning.
pub fn acquire(state_dir: &Path, who: &str) -> Result<RunLock, Held> {
    let path = path(state_dir);
    let _ = std::fs::create_dir_all(state_dir);
    // The state directory is the service user's, and a person runs `probe` as root: a link
    // planted at the lock's name is never followed (O_NOFOLLOW: ELOOP), so root never
    // truncates or writes another file; only a regular file is taken as the lock.
    let opened = crate::sysroot::open_regular_rw(&path, false, 0o644)
        .map(|f| (f, true))
        .or_else(|_| crate::sysroot::open_regular(&path, true).map(|(f, _)| (f, false)));
    let (mut file, writable) = match opened {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot open the probe lock; probing without it");
            return Ok(RunLock { _file: None });
        }
    };
    match file.try_lock() {
        Ok(()) => {
            if writable {
                let _ = file.set_len(0);
                let _ =
                    writeln!(file, "pid {} ({who}) since {}", std::process::id(), crate::snapshot::Timestamp::now());
            }
            Ok(RunLock { _file: Some(file) })
        }
        Err(std::fs::TryLockError::WouldBlock) => {
            let text = crate::sysroot::read_regular(&path, true, 4096)
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default();
            let holder = match text.trim() {
                "" => "holder unknown".to_string(),
                t => t.to_string(),
            };
            Err(Held { holder, path })
        }
        Err(std::fs::TryLockError::Error(e)) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot lock the probe lock; probing without it");
            Ok(RunLock { _file: None })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_run_is_refused_naming_the_first_until_it_ends() {
        let dir = std::env::temp_dir().join(format!("phq-probe-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = acquire(&dir, "phq-agent probe").unwrap();
        let refused = acquire(&dir, "D-Bus RunProbes").unwrap_err();
        assert!(refused.holder.contains(&format!("pid {} (phq-agent probe)", std::process::id())), "{refused}");
        assert!(refused.to_string().contains("another probe run is in progress"));
        drop(first);
        acquire(&dir, "D-Bus RunProbes").unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_link_planted_at_the_lock_is_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious\n").unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir(&state).unwrap();
        std::os::unix::fs::symlink(&victim, path(&state)).unwrap();
        // The run goes ahead unlocked (and says so), and the link's target is untouched.
        let lock = acquire(&state, "phq-agent probe").unwrap();
        assert!(lock._file.is_none());
        drop(lock);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    }
}
