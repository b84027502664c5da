//! Files that must survive a crash whole: the install journal, the spool, `seq`, tokens.

use std::fs::File;
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` so that a crash leaves the old file or the new one, never a torn
/// one: a temporary file beside it, fsynced, renamed over it, and the directory fsynced.
/// `mode` applies when the file is created (the umask still narrows it).
pub fn write(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    write_owned(path, bytes, mode, None)
}

/// `write`, and the new file given to `owner` (uid, gid) before it takes the name.
///
/// Safe in a directory another user can write (a service's state directory that root writes
/// into): the temporary name is unlinked and then created with `O_EXCL`, which never follows
/// a symlink planted there (open(2): "If O_CREAT and O_EXCL are set, … symbolic links are not
/// followed"); ownership and mode are set on the open descriptor (`fchown`, `fchmod`), never by
/// path; and `rename` replaces a planted link itself rather than its target. A race that
/// re-plants the temporary name makes the write fail, never write elsewhere.
pub fn write_owned(path: &Path, bytes: &[u8], mode: u32, owner: Option<(u32, u32)>) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let dir = path.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{}.phq-tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("file")));
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::fchown(&f, Some(uid), Some(gid))?;
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
    }
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_planted_symlink_is_replaced_never_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        // At the temporary name and at the name itself.
        std::os::unix::fs::symlink(&victim, dir.path().join(".token.phq-tmp")).unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join("token")).unwrap();
        write(&dir.path().join("token"), b"new", 0o600).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(std::fs::read_to_string(dir.path().join("token")).unwrap(), "new");
        assert!(!std::fs::symlink_metadata(dir.path().join("token")).unwrap().file_type().is_symlink());
    }
}
