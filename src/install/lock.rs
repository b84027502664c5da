//! One installer at a time: a `flock` on `lock` in the journal's directory, held from the first
//! look at the machine to the last step, so what is planned is what is applied. The kernel drops
//! it when the process dies, `kill -9` included; the file holds the holder's pid for the message
//! another installer prints.

use super::own_dir::{open_private, DirError};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Held for the whole install.
pub struct Lock {
    _file: File,
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(transparent)]
    Open(#[from] DirError),
    /// Another installer holds it, with its pid when it wrote one.
    #[error(
        "another phq-agent install is running{} (it holds {}); wait for it, or see `journalctl -u phq-agent-install`",
        holder.as_ref().map(|p| format!(" as pid {p}")).unwrap_or_default(),
        path.display()
    )]
    Held { path: PathBuf, holder: Option<String> },
    #[error("{}: cannot lock: {source}", path.display())]
    Lock { path: PathBuf, source: std::io::Error },
}

fn lock_file(journal_dir: &Path) -> Result<(File, PathBuf), LockError> {
    let file = open_private(journal_dir, "lock", false, 0o600)?;
    Ok((file, journal_dir.join("lock")))
}

/// Writes our pid into the lock file we hold, for the message another installer prints. The pid
/// only informs: a lock whose pid could not be written is held all the same.
fn claim(mut file: File) -> Lock {
    let _ = file.set_len(0);
    let _ = writeln!(file, "{}", std::process::id());
    Lock { _file: file }
}

/// Waits for the lock instead of refusing: `--resume` at boot, when cloud-init's own install
/// may still be running.
pub fn lock_wait(journal_dir: &Path) -> Result<Lock, LockError> {
    let (file, path) = lock_file(journal_dir)?;
    file.lock().map_err(|source| LockError::Lock { path, source })?;
    Ok(claim(file))
}

/// The lock, or why not: another installer holds it (with its pid).
pub fn lock(journal_dir: &Path) -> Result<Lock, LockError> {
    let (file, path) = lock_file(journal_dir)?;
    match file.try_lock() {
        Ok(()) => Ok(claim(file)),
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = crate::sysroot::read_regular(&path, true, 64)
                .map(|b| String::from_utf8_lossy(&b).trim().to_string())
                .unwrap_or_default();
            Err(LockError::Held { path, holder: (!holder.is_empty()).then_some(holder) })
        }
        Err(std::fs::TryLockError::Error(source)) => Err(LockError::Lock { path, source }),
    }
}

#[cfg(test)]
mod tests;
