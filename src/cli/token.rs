//! `phq-agent token`: create the HTTP bearer token on first start. The service's unit runs it
//! as root before the service (`ExecStartPre=+`): the token file lives in /etc/phq-agent, which
//! the sandboxed service cannot write, and must be readable by the service's user alone.

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
        let path = &config.http.token_file;
        if path.exists() {
            // Someone (cloud-init, the operator) put one there: it is theirs, never replaced.
            return Ok(0);
        }
        let (uid, gid) = user_ids(&self.owner)?;
        let mut bytes = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .map_err(|e| anyhow::anyhow!("/dev/urandom: {e}"))?;
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        crate::install::apply::write_atomic(path, format!("{token}\n").as_bytes(), 0o600)
            .map_err(|e| anyhow::anyhow!("{}: cannot write the token: {e}", path.display()))?;
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .map_err(|e| anyhow::anyhow!("{}: cannot give the token to {}: {e}", path.display(), self.owner))?;
        eprintln!("phq-agent token: created {} (0600, {})", path.display(), self.owner);
        Ok(0)
    }
}

fn user_ids(name: &str) -> anyhow::Result<(u32, u32)> {
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
