//! `phq-agent token`: create the HTTP bearer token on first start, and make both token files
//! (HTTP and platform) the service's own. The service's unit runs it as root before the service
//! (`ExecStartPre=+`): the files live in /etc/phq-agent, which the sandboxed service cannot
//! write, and must be readable by the service's user alone. cloud-init writes them as root,
//! before the package has created that user; this hands them over.

use clap::Args;
use std::ffi::CString;
use std::io::Read;

#[derive(Debug, Args)]
pub struct Token {
    /// The user that must own the token (the service's).
    #[arg(long, value_name = "USER", default_value = "phq-agent")]
    pub owner: String,
}

impl Token {
    pub fn run(self, g: &super::Global) -> anyhow::Result<i32> {
        let config = g.load_config()?;
        let (uid, gid) = user_ids(&self.owner)?;
        // Tokens someone (cloud-init, the operator) put there are theirs: never replaced, only
        // given to the service's user and closed to everyone else.
        for path in [&config.http.token_file, &config.platform.token_file] {
            if path.exists() {
                hand_over(path, uid, gid, &self.owner)?;
            }
        }
        let path = &config.http.token_file;
        if path.exists() {
            return Ok(0);
        }
        let mut bytes = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .map_err(|e| anyhow::anyhow!("/dev/urandom: {e}"))?;
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        // Owner and mode set on the new file's descriptor before it takes the name: nothing
        // is ever chowned by path (see durable::write_owned).
        crate::durable::write_owned(path, format!("{token}\n").as_bytes(), 0o600, Some((uid, gid)))
            .map_err(|e| anyhow::anyhow!("{}: cannot write the token: {e}", path.display()))?;
        eprintln!("phq-agent token: created {} (0600, {})", path.display(), self.owner);
        Ok(0)
    }
}

/// Gives an existing token file to the service's user, through its descriptor: opened without
/// following a symlink and only if it is a regular file, so a link planted where the token
/// should be (`/etc/shadow`) is refused rather than handed over — the tmpfiles(5) `z`/`Z`
/// rule, which refuses to adjust through symlinks for the same reason.
fn hand_over(path: &std::path::Path, uid: u32, gid: u32, owner: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let (file, meta) = crate::sysroot::open_regular(path, true)
        .map_err(|e| anyhow::anyhow!("{}: {e}; not handing it to {owner}", path.display()))?;
    if meta.uid() != uid || meta.gid() != gid {
        std::os::unix::fs::fchown(&file, Some(uid), Some(gid))
            .map_err(|e| anyhow::anyhow!("{}: cannot give the token to {owner}: {e}", path.display()))?;
        eprintln!("phq-agent token: {} now belongs to {owner}", path.display());
    }
    if meta.permissions().mode() & 0o077 != 0 {
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| anyhow::anyhow!("{}: cannot close the token to other users: {e}", path.display()))?;
        eprintln!("phq-agent token: {} was readable by others; now 0600", path.display());
    }
    Ok(())
}

pub(super) fn user_ids(name: &str) -> anyhow::Result<(u32, u32)> {
    let c = CString::new(name).map_err(|_| anyhow::anyhow!("user name {name:?} has a NUL byte"))?;
    // SAFETY: getpwnam reads the C string we own and returns a pointer into static storage,
    // read at once and never kept; this command is single-threaded.
    let pw = unsafe { libc::getpwnam(c.as_ptr()) };
    if pw.is_null() {
        anyhow::bail!("no user {name:?} on this machine (the package's sysusers entry creates phq-agent)");
    }
    // SAFETY: pw is non-null and points at a valid passwd record (checked above).
    let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
    Ok((uid, gid))
}
