//! Root's own directories and the files root opens in them: the journal's (`JOURNAL_DIR`: the
//! journal, the lock, the log) and the private one (`DOWNLOAD_DIR`: what the installer verifies
//! before installing it, the MOK password).
//!
//! The rules of this room:
//! 1. A directory is used only when it is a real directory (never a link) of this process's
//!    user; what another user could write, that user could turn into a link root follows, or
//!    fill with a file root then trusts.
//! 2. The journal's directory (0755: the service and cloud-init read the journal) is refused,
//!    not repaired, when others can write it: someone may already have planted something in it.
//!    The private one (0700) is closed to others when it was open.
//! 3. Files in them are opened without following a link (`sysroot::open_regular_rw`).
//!
//! These paths are root's own, not paths of a machine under a `Sysroot`: they are never read
//! through one, and nothing here reads a guest's files.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// What a directory of root's own is for, which decides its mode and what is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The journal's: 0755, readable by all, refused when others can write it.
    Journal,
    /// Downloads and secrets: 0700, closed to others when it was open.
    Private,
}

#[derive(Debug, thiserror::Error)]
pub enum DirError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "{}: not a directory of uid {uid} that only it can write (a link, another user's, or open to others: mode {mode:o}); the installer keeps its journal where nobody else can plant a file — remove it and rerun",
        path.display()
    )]
    NotOwnJournal { path: PathBuf, uid: u32, mode: u32 },
    #[error(
        "{}: not a directory of uid {uid} (a symlink, or another user's); the installer keeps its downloads where only it can write — remove it and rerun",
        path.display()
    )]
    NotOwnPrivate { path: PathBuf, uid: u32 },
    #[error("{}: cannot close it to other users: {source}", path.display())]
    Close { path: PathBuf, source: io::Error },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> DirError + '_ {
    move |source| DirError::Io { path: path.to_path_buf(), source }
}

/// Makes `dir` a directory of root's own of `kind`, or says why it cannot be (see the rules
/// above). Created with the kind's mode when missing, its parents as they come.
pub fn own_dir(dir: &Path, kind: Kind) -> Result<(), DirError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    let mode = match kind {
        Kind::Journal => 0o755,
        Kind::Private => 0o700,
    };
    match std::fs::DirBuilder::new().mode(mode).create(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(io_err(dir)(e)),
        _ => {}
    }
    let meta = std::fs::symlink_metadata(dir).map_err(io_err(dir))?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let ours = meta.file_type().is_dir() && meta.uid() == me;
    match kind {
        Kind::Journal if !ours || meta.mode() & 0o022 != 0 => {
            Err(DirError::NotOwnJournal { path: dir.to_path_buf(), uid: me, mode: meta.mode() & 0o7777 })
        }
        Kind::Private if !ours => Err(DirError::NotOwnPrivate { path: dir.to_path_buf(), uid: me }),
        Kind::Private if meta.mode() & 0o077 != 0 => {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|source| DirError::Close { path: dir.to_path_buf(), source })
        }
        _ => Ok(()),
    }
}

/// Opens `name` in the journal's directory for writing without following a link (open(2):
/// `O_NOFOLLOW` fails with ELOOP on a symbolic link), created with `mode`; only a regular file
/// is accepted.
pub fn open_private(dir: &Path, name: &str, append: bool, mode: u32) -> Result<File, DirError> {
    own_dir(dir, Kind::Journal)?;
    let path = dir.join(name);
    crate::sysroot::open_regular_rw(&path, append, mode).map_err(|source| DirError::Io { path, source })
}
