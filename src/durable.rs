//! Files that must survive a crash whole: the install journal, the spool, `seq`, tokens.

use std::fs::File;
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` so that a crash leaves the old file or the new one, never a torn
/// one: a temporary file beside it, fsynced, renamed over it, and the directory fsynced.
/// `mode` applies when the file is created (the umask still narrows it).
pub fn write(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{}.phq-tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("file")));
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    File::open(dir)?.sync_all()
}
