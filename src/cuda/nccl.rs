//! NCCL, loaded at run time with `dlopen` like the driver and cuBLAS: `PHQ_NCCL_LIB`, else
//! `libnccl.so.2` (the soname NVIDIA's `libnccl2` / `libnccl` packages install), else
//! `libnccl.so`. Only what the all-reduce probe calls is bound.
//!
//! NCCL's rules the wrappers keep (NCCL's API reference and user guide, *NCCL*; its source at
//! tag v2.27.3-1):
//! - `ncclCommInitAll` makes one communicator per device of the list, all in this process; it
//!   cannot be aborted, which is why the probe runs it in a child process (`probe::allreduce`);
//! - one thread driving several communicators groups their calls between `ncclGroupStart` and
//!   `ncclGroupEnd` ("Management Of Multiple GPUs From One Thread"), or the first call blocks
//!   waiting for the other ranks — `Comms::all_reduce_sum_f32` always groups; a call that fails
//!   inside a group fails the whole group at `ncclGroupEnd`, which launches nothing
//!   (src/group.cc, `ncclGroupErrCheck`);
//! - each rank's buffers and stream belong to its device. NCCL checks buffers only when
//!   `NCCL_CHECK_POINTERS=1` (src/misc/argcheck.cc, `CudaPtrCheck`; off by default, src/init.cc),
//!   otherwise its kernel meets the bad pointer; a stream of another device fails the launch at
//!   `ncclGroupEnd`. So the wrapper checks both before NCCL sees them: each buffer's length, and
//!   each stream's context against the rank's device.

use super::driver::{c_text, cached, Api, DeviceBuffer, LoadError, Loaded, Result, Stream};
use super::driver::{CudaError, Handle};
use libloading::Library;
use std::ffi::{c_char, c_int, c_void};
use std::path::Path;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

api!("NCCL", "NCCL (libnccl.so.2, NVIDIA's collective communications library)", NcclApi {
    ncclGetVersion: fn(*mut c_int) -> c_int;
    ncclGetErrorString: fn(c_int) -> *const c_char;
    ncclCommInitAll: fn(*mut Handle, c_int, *const c_int) -> c_int;
    ncclCommDestroy: fn(Handle) -> c_int;
    ncclGroupStart: fn() -> c_int;
    ncclGroupEnd: fn() -> c_int;
    ncclAllReduce: fn(*const c_void, *mut c_void, usize, c_int, c_int, Handle, Handle) -> c_int;
});

/// The loaded NCCL library.
pub type Nccl = Loaded<NcclApi>;

/// `ncclDataType_t` ncclFloat32 and `ncclRedOp_t` ncclSum (nccl.h).
pub const NCCL_FLOAT32: c_int = 7;
pub const NCCL_SUM: c_int = 0;

static NCCL: Mutex<Option<Arc<Nccl>>> = Mutex::new(None);

/// NCCL: `PHQ_NCCL_LIB`, else `libnccl.so.2`, else `libnccl.so`.
pub fn nccl() -> std::result::Result<Arc<Nccl>, LoadError> {
    let candidates = match std::env::var_os("PHQ_NCCL_LIB") {
        Some(p) => vec![PathBuf::from(p)],
        None => vec![PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")],
    };
    cached(&NCCL, &candidates)
}

/// `ncclResult_t` names (nccl.h).
pub fn result_name(r: c_int) -> &'static str {
    match r {
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        // nccl.h from 2.28 on.
        8 => "ncclTimeout",
        _ => "ncclResult (unknown)",
    }
}

impl Nccl {
    fn check(&self, call: &'static str, r: c_int) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: NCCL answers any code with a static string.
        let text = c_text(unsafe { (self.api.ncclGetErrorString)(r) });
        Err(CudaError { call, code: r, name: result_name(r).into(), text, sticky: false })
    }

    /// `ncclGetVersion` as NCCL writes it: "2.27.3" (2.9 on: major·10000 + minor·100 + patch;
    /// before, major·1000 + minor·100 + patch — nccl.h's NCCL_VERSION).
    pub fn version(&self) -> Result<String> {
        let mut v = 0;
        // SAFETY: the out pointer is a valid local.
        self.check("ncclGetVersion", unsafe { (self.api.ncclGetVersion)(&mut v) })?;
        Ok(if v >= 20900 {
            format!("{}.{}.{}", v / 10000, v % 10000 / 100, v % 100)
        } else {
            format!("{}.{}.{}", v / 1000, v % 1000 / 100, v % 100)
        })
    }

    /// NCCL's last warning ("Cuda failure 35 '…'"): `ncclGetLastError`, which returns the text
    /// of the last WARN whatever NCCL_DEBUG says (src/debug.cc, `ncclDebugLog`; its comm "is
    /// currently unused and can be set to NULL", src/init.cc). Looked up apart from the table: an
    /// NCCL older than 2.13 lacks it, and says nothing then.
    pub fn last_error(&self) -> Option<String> {
        // SAFETY: the file is loaded already (this value holds it), so dlopen returns the same
        // handle and runs no initialiser again (dlopen(3)).
        let lib = unsafe { Library::new(&self.file) }.ok()?;
        // SAFETY: nccl.h declares `const char* ncclGetLastError(ncclComm_t comm)`.
        let get = unsafe { lib.get::<unsafe extern "C" fn(Handle) -> *const c_char>(b"ncclGetLastError\0") }.ok()?;
        // SAFETY: NULL is allowed (above); the text is NCCL's static buffer, copied at once.
        let text = c_text(unsafe { get(std::ptr::null_mut()) });
        (!text.is_empty()).then_some(text)
    }

    /// One communicator per CUDA ordinal of `ordinals`, rank i on `ordinals[i]`.
    pub fn init_all(self: &Arc<Self>, ordinals: &[usize]) -> Result<Comms> {
        let list: Vec<c_int> = ordinals.iter().map(|o| *o as c_int).collect();
        let mut comms: Vec<Handle> = vec![std::ptr::null_mut(); list.len()];
        // SAFETY: `comms` has room for one handle per listed device.
        let r = unsafe { (self.api.ncclCommInitAll)(comms.as_mut_ptr(), list.len() as c_int, list.as_ptr()) };
        self.check("ncclCommInitAll", r)?;
        Ok(Comms { nccl: self.clone(), comms, ordinals: ordinals.to_vec() })
    }
}

/// Communicators made together by `ncclCommInitAll`, destroyed together.
pub struct Comms {
    nccl: Arc<Nccl>,
    comms: Vec<Handle>,
    ordinals: Vec<usize>,
}

impl Drop for Comms {
    fn drop(&mut self) {
        for c in &self.comms {
            // SAFETY: each live communicator destroyed once; its work was synchronized by the
            // caller (the buffers and streams it used outlive it).
            unsafe { (self.nccl.api.ncclCommDestroy)(*c) };
        }
    }
}

/// One rank's part of an all-reduce: what it sends, where it receives, the stream it queues on.
pub struct Part<'a> {
    pub send: &'a DeviceBuffer,
    pub recv: &'a DeviceBuffer,
    pub stream: &'a Stream,
}

impl Comms {
    /// Every rank's `recv` ← the FP32 sum of all ranks' `send` (`count` floats), out of place,
    /// each rank's part queued on its stream, the calls grouped as one thread must.
    pub fn all_reduce_sum_f32(&self, parts: &[Part<'_>], count: usize) -> Result<()> {
        const CALL: &str = "ncclAllReduce";
        if parts.len() != self.comms.len() {
            return Err(usage(CALL, format!("{} parts for {} ranks", parts.len(), self.comms.len())));
        }
        let bytes = count.saturating_mul(4);
        for (rank, p) in parts.iter().enumerate() {
            super::driver::range_ok(CALL, bytes, p.send.len())?;
            super::driver::range_ok(CALL, bytes, p.recv.len())?;
            if p.stream.ctx.ordinal != self.ordinals[rank] {
                return Err(usage(CALL, format!("rank {rank}'s stream is not of GPU {}", self.ordinals[rank])));
            }
        }
        // SAFETY: no pointers.
        self.nccl.check("ncclGroupStart", unsafe { (self.nccl.api.ncclGroupStart)() })?;
        let mut first = Ok(());
        for (p, comm) in parts.iter().zip(&self.comms) {
            // SAFETY: both buffers hold `count` floats on the rank's device (checked above) and
            // outlive the stream's work; the stream is the rank's device's.
            let r = unsafe {
                (self.nccl.api.ncclAllReduce)(
                    p.send.ptr() as *const c_void,
                    p.recv.ptr() as *mut c_void,
                    count,
                    NCCL_FLOAT32,
                    NCCL_SUM,
                    *comm,
                    p.stream.handle,
                )
            };
            if first.is_ok() {
                first = self.nccl.check(CALL, r);
            }
        }
        // The group is closed even after a failed call, so this thread is not left inside one.
        // SAFETY: no pointers.
        let end = self.nccl.check("ncclGroupEnd", unsafe { (self.nccl.api.ncclGroupEnd)() });
        first.and(end)
    }
}

/// A call the wrapper refuses before NCCL sees it, named as NCCL would name it.
fn usage(call: &'static str, text: String) -> CudaError {
    CudaError { call, code: 5, name: result_name(5).into(), text, sticky: false }
}

/// One NCCL setting a process would run with: a variable, its value, and where it came from
/// (`environment` or a configuration file's path).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Setting {
    pub name: String,
    pub value: String,
    pub from: String,
}

impl std::fmt::Display for Setting {
    /// The value with its control characters escaped: a `\r` left by a CRLF file is part of
    /// what NCCL reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={} ({})", self.name, self.value.escape_debug(), self.from)
    }
}

/// The `NCCL_*` settings NCCL would see, read as NCCL 2.27 reads them (src/misc/param.cc,
/// `initEnvFunc`, `setEnvFile`): the environment first; then the file `NCCL_CONF_FILE` names,
/// or else `~/.nccl.conf` of the user running; then `/etc/nccl.conf`. A file sets only what is
/// not set yet (`setenv(name, value, 0)`). A file is read line by line as `getline` splits it
/// (on `\n` only: a `\r` stays in the value); a line starting with `#` or without `=` is
/// skipped; the name is what comes before the first `=` and the value the rest, each cut at
/// 1023 bytes and at a NUL (`strncpy` into 1024-byte buffers); an empty name is refused by
/// `setenv`. A name with blanks is set but is no variable NCCL reads, so it is not reported.
pub fn settings(env: &[(String, String)], files: &[PathBuf]) -> Vec<Setting> {
    fn cut(b: &[u8]) -> String {
        let b = &b[..b.len().min(1023)];
        let b = b.split(|c| *c == 0).next().unwrap_or_default();
        String::from_utf8_lossy(b).into_owned()
    }
    let mut out: Vec<Setting> = env
        .iter()
        .filter(|(k, _)| k.starts_with("NCCL_"))
        .map(|(k, v)| Setting { name: k.clone(), value: v.clone(), from: "environment".into() })
        .collect();
    let mut set: std::collections::HashSet<String> = env.iter().map(|(k, _)| k.clone()).collect();
    for file in files {
        let Ok(text) = std::fs::read(file) else { continue };
        for line in text.split_inclusive(|c| *c == b'\n') {
            let line = line.strip_suffix(b"\n").unwrap_or(line);
            if line.first() == Some(&b'#') {
                continue;
            }
            let Some(eq) = line.iter().position(|c| *c == b'=') else { continue };
            let (name, value) = (cut(&line[..eq]), cut(&line[eq + 1..]));
            if name.is_empty() || !set.insert(name.clone()) {
                continue;
            }
            if name.starts_with("NCCL_") && !name.contains(char::is_whitespace) {
                out.push(Setting { name, value, from: file.display().to_string() });
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// `settings` for this process: its environment, and the files NCCL would read for its user.
pub fn settings_here() -> Vec<Setting> {
    let env: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned())))
        .collect();
    let mut files = Vec::new();
    match std::env::var_os("NCCL_CONF_FILE").filter(|f| !f.is_empty()) {
        Some(f) => files.push(PathBuf::from(f)),
        None => files.extend(home_dir().map(|h| h.join(".nccl.conf"))),
    }
    files.push(PathBuf::from("/etc/nccl.conf"));
    settings(&env, &files)
}

/// The home directory of the user running, from the password database as NCCL finds it
/// (`getpwuid(getuid())->pw_dir`), not `$HOME`.
fn home_dir() -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    // A buffer too small is ERANGE: twice as large, up to 1 MiB.
    let mut size = 16 * 1024;
    loop {
        let mut buf = vec![0 as c_char; size];
        // SAFETY: all-zero is a valid `passwd` (null pointers, zero ids) for getpwuid_r to fill.
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: `pw`, `buf` and `found` are valid for the call; `buf`'s length is passed.
        let r = unsafe { libc::getpwuid_r(libc::getuid(), &mut pw, buf.as_mut_ptr(), buf.len(), &mut found) };
        if r == libc::ERANGE && size < 1 << 20 {
            size *= 2;
            continue;
        }
        if r != 0 || found.is_null() || pw.pw_dir.is_null() {
            return None;
        }
        // SAFETY: getpwuid_r succeeded: `pw_dir` points at a NUL-terminated string in `buf`.
        let dir = unsafe { std::ffi::CStr::from_ptr(pw.pw_dir) };
        return Some(PathBuf::from(std::ffi::OsStr::from_bytes(dir.to_bytes())));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NCCL's order: the environment wins, then the user's file, then /etc/nccl.conf; comments
    /// and lines without `=` are skipped; a CRLF line keeps its `\r`, a value is cut at 1023
    /// bytes and at a NUL, a name with a blank or none at all is no setting; only NCCL's own
    /// variables are kept.
    #[test]
    fn settings_are_read_as_nccl_reads_them() {
        let dir = tempfile::tempdir().unwrap();
        let user = dir.path().join("user.conf");
        let etc = dir.path().join("etc.conf");
        std::fs::write(&user, "# NCCL_ALGO=Tree\nNCCL_P2P_DISABLE=1\nNCCL_DEBUG=INFO\nnonsense\nOTHER=1\n").unwrap();
        let long = "x".repeat(2000);
        std::fs::write(
            &etc,
            format!(
                "NCCL_P2P_DISABLE=0\nNCCL_PROTO=Simple=x\nNCCL_DEBUG=WARN\nNCCL_ALGO=Ring\r\nNCCL_X =1\n=NCCL_Y\n\
                 NCCL_IB_HCA={long}\nNCCL_SOCKET_IFNAME=eth0\0junk"
            ),
        )
        .unwrap();
        let env = vec![("NCCL_DEBUG".to_string(), "VERSION".to_string()), ("PATH".to_string(), "/bin".to_string())];
        let missing = dir.path().join("missing.conf");
        let got: Vec<String> =
            settings(&env, &[missing, user.clone(), etc.clone()]).iter().map(|s| s.to_string()).collect();
        assert_eq!(
            got,
            vec![
                format!("NCCL_ALGO=Ring\\r ({})", etc.display()),
                "NCCL_DEBUG=VERSION (environment)".to_string(),
                format!("NCCL_IB_HCA={} ({})", "x".repeat(1023), etc.display()),
                format!("NCCL_P2P_DISABLE=1 ({})", user.display()),
                format!("NCCL_PROTO=Simple=x ({})", etc.display()),
                format!("NCCL_SOCKET_IFNAME=eth0 ({})", etc.display()),
            ]
        );
    }
}
